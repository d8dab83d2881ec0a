"""Regular expressions that cannot hang: the patterns of ``find`` and of recorded matches.

A pattern can come from a recipe file (``replace(target_ops={"pattern": ...})``), so it
is untrusted input: a catastrophic expression such as ``(a|aa)+$`` would otherwise
backtrack for minutes on one module path. :class:`BoundedRegex` keeps Python's regular
expression syntax and meaning (it uses the ``regex`` package in its ``re``-compatible
``VERSION0`` mode) and bounds the work:

* a pattern longer than :data:`MAX_PATTERN_CHARS` is refused;
* all the searches of one ``find`` share a time budget of :data:`MATCH_BUDGET_S` seconds
  (each search gets what is left); a pattern that runs out is refused with a
  :class:`~torchloom.core.errors.PatternError` naming it.

>>> bounded = BoundedRegex(r"attn\\.(q|k|v)_proj", primitive="find", path="layers.0")
>>> bounded.search("self_attn.q_proj"), bounded.search("mlp.up_proj")
(True, False)
>>> slow = BoundedRegex(r"(a|aa)+$", primitive="find", path="", budget_s=0.05)
>>> slow.search("a" * 60 + "b")
Traceback (most recent call last):
...
torchloom.core.errors.PatternError: sch[''].find(...): the regular expression '(a|aa)+$' took over 0.05 s on one name (it backtracks catastrophically)
    values: pattern='(a|aa)+$', name='aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab'
    fix: write a pattern without nested repetition, e.g. 'layers\\.\\d+\\.mlp' instead of '(\\w+\\.?)*mlp'
"""

from __future__ import annotations

import re
import time

import regex

from .errors import PatternError

__all__ = ["BoundedRegex", "MATCH_BUDGET_S", "MAX_PATTERN_CHARS"]

#: The longest pattern accepted (module paths are short; a pattern need not be long).
MAX_PATTERN_CHARS = 1000

#: Seconds all the searches of one pattern may take together.
MATCH_BUDGET_S = 0.5

_FIX = ("write a pattern without nested repetition, e.g. 'layers\\.\\d+\\.mlp' instead of "
        "'(\\w+\\.?)*mlp'")


class BoundedRegex:
    """A compiled pattern whose searches share a time budget; see the module docstring."""

    def __init__(self, pattern: str, *, primitive: str, path: str,
                 budget_s: float = MATCH_BUDGET_S) -> None:
        self.pattern, self.primitive, self.path = pattern, primitive, path
        if not isinstance(pattern, str):
            raise PatternError(
                f"a pattern is a string, not a {type(pattern).__name__}", path=path,
                primitive=primitive, values={"pattern": repr(pattern)[:80]},
                fix="pass a regular expression, e.g. r'attn\\.c_attn'")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise PatternError(
                f"the regular expression is {len(pattern)} characters long, over the limit "
                f"of {MAX_PATTERN_CHARS}", path=path, primitive=primitive,
                values={"pattern": pattern[:60] + "...", "length": len(pattern)},
                fix="match module paths with a shorter pattern")
        try:  # Python's own compiler says what is wrong, in Python's words
            re.compile(pattern)
            self._compiled = regex.compile(pattern, flags=regex.VERSION0)
        except (re.error, regex.error, ValueError, OverflowError, RecursionError) as exc:
            raise PatternError(
                f"invalid regular expression: {exc}", path=path, primitive=primitive,
                values={"pattern": pattern}, fix="fix the regex, e.g. r'attn\\.(q|k|v)_proj'",
            ) from None
        self._deadline = time.monotonic() + budget_s
        self.budget_s = budget_s

    def search(self, text: str) -> bool:
        """Whether the pattern occurs in ``text`` (``re.search``); raises
        :class:`PatternError` when the pattern's budget is spent."""
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return self._compiled.search(text, timeout=left) is not None
        except TimeoutError:
            raise PatternError(
                f"the regular expression {self.pattern!r} took over {self.budget_s:g} s on one "
                "name (it backtracks catastrophically)" if left > 0 else
                f"the regular expression {self.pattern!r} took over {self.budget_s:g} s on "
                "this model's names", path=self.path, primitive=self.primitive,
                values={"pattern": self.pattern[:80], "name": text[:80]}, fix=_FIX) from None
