"""The recipe as data: :class:`RecipeEntry` (one recorded primitive call) and
:class:`Recipe` (the ordered list of them), printed as a script, serialised to JSON and
read back from either as untrusted data.

What a line may hold is checked by :mod:`torchloom.core.recipe_values`; the printed
script is read by :mod:`torchloom.core.recipe_script`; replaying a recipe on a model is
:func:`torchloom.core.recipe.apply_recipe` (see :mod:`torchloom.core.recipe` for the
whole story).

>>> recipe = Recipe([RecipeEntry("checkpoint", "0", (), {"ratio": 0.5})])
>>> print(recipe)
import torchloom
<BLANKLINE>
sch = torchloom.create_schedule(model)
sch['0'].checkpoint(ratio=0.5)
>>> Recipe.from_json(recipe.to_json()) == recipe
True
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from .errors import RecipeError
from .recipe_script import parse_script
from .recipe_values import (
    MAX_DEPTH,
    _check_fields,
    _check_places,
    _decode,
    _encode,
    _python,
    _Unserialisable,
)
from .refs import Refused, check_trusted, ref_of, resolve_untrusted, short_repr

__all__ = ["FORMAT_VERSION", "Recipe", "RecipeEntry"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class RecipeEntry:
    """One recorded primitive call: ``sch[path].<primitive>(*args, **kwargs)``.

    Only calls a recipe may hold can be made: ``primitive`` must be one of
    :func:`~torchloom.list_primitives`, ``path`` a string, ``args`` a list or tuple (kept
    as a tuple), ``kwargs`` a dict keyed by public identifiers; anything else raises
    :class:`~torchloom.core.errors.RecipeError`.

    >>> RecipeEntry("__setattr__", "", ("shard", None))
    Traceback (most recent call last):
    ...
    torchloom.core.errors.RecipeError: RecipeEntry(...): unknown primitive '__setattr__'
        values: primitive='__setattr__'
        fix: use one of the primitives: annotate, checkpoint, compile, cut_pipeline_stage, decompose, divide_attrs, fork_rng, fuse, lora, replace, replace_all, shard, sync, trace, trace_until
    """

    primitive: str
    path: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            _check_fields(self.primitive, self.path, self.args, self.kwargs)
        except Refused as exc:
            raise RecipeError(exc.problem, primitive="RecipeEntry", values=exc.values,
                              fix=exc.fix) from None
        if not isinstance(self.args, tuple):
            object.__setattr__(self, "args", tuple(self.args))

    def call_text(self, imports: set[str] | None = None) -> str:
        """The call as one line of Python; raises ``_Unserialisable`` for non-data args."""
        imports = set() if imports is None else imports
        parts = [_python(a, imports) for a in self.args]
        parts += [f"{k}={_python(v, imports)}" for k, v in self.kwargs.items()]
        return f"sch[{self.path!r}].{self.primitive}({', '.join(parts)})"

    def call_text_safe(self) -> str:
        """Like :meth:`call_text`, with ``...`` for arguments that are not data."""
        try:
            return self.call_text()
        except _Unserialisable:
            return f"sch[{self.path!r}].{self.primitive}(...)"

    def to_data(self) -> dict[str, Any]:
        """A JSON-ready dict; raises ``_Unserialisable`` for non-data args."""
        return {
            "primitive": self.primitive,
            "path": self.path,
            "args": [_encode(a) for a in self.args],
            "kwargs": {k: _encode(v) for k, v in self.kwargs.items()},
        }

    @staticmethod
    def from_data(data: dict[str, Any], trusted_refs: Mapping[str, Any] | None = None, *,
                  trust_code: bool = False) -> RecipeEntry:
        """Inverse of :meth:`to_data`: validates every field and value, and resolves
        references with :func:`resolve_ref` (so nothing untrusted is imported).

        Raises:
            RecipeError: a field or value a recipe may not hold.
        """
        try:
            return _entry_from_data(data, trusted_refs, trust_code)
        except Refused as exc:
            raise RecipeError(exc.problem, primitive="RecipeEntry.from_data",
                              values=exc.values, fix=exc.fix) from None


_ENTRY_KEYS = ("primitive", "path", "args", "kwargs")


def _entry_from_data(data: Any, trusted_refs: Mapping[str, Any] | None,
                     trust_code: bool) -> RecipeEntry:
    if type(data) is not dict:
        raise Refused(f"an entry must be an object, not a {type(data).__name__}",
                       {"entry": short_repr(data)},
                       'write {"primitive": ..., "path": ..., "args": [...], "kwargs": {...}}')
    unknown = sorted(k for k in data if k not in _ENTRY_KEYS)
    missing = [k for k in ("primitive", "path") if k not in data]
    if unknown or missing:
        problem = (f"unknown field {unknown[0]!r}" if unknown
                   else f"the entry has no {missing[0]!r}")
        raise Refused(f"{problem} in an entry", {"fields": sorted(map(str, data))[:8]},
                       f"an entry has the fields {', '.join(_ENTRY_KEYS)}")
    primitive, path = data["primitive"], data["path"]
    args, kwargs = data.get("args", []), data.get("kwargs", {})
    _check_fields(primitive, path, args, kwargs)
    if type(args) is not list:
        raise Refused(f"args of {primitive} must be a list, not a {type(args).__name__}",
                       {"primitive": primitive, "args": short_repr(args)},
                       "write the arguments as a list")

    def resolve(ref: Any) -> Any:
        return resolve_untrusted(ref, trusted_refs, trust_code)

    decoded_args = tuple(_decode(a, resolve) for a in args)
    decoded_kwargs = {k: _decode(v, resolve) for k, v in kwargs.items()}
    _check_places(primitive, decoded_args, decoded_kwargs, trusted_refs, trust_code)
    return RecipeEntry(primitive=primitive, path=path, args=decoded_args, kwargs=decoded_kwargs)


class Recipe:
    """An ordered list of :class:`RecipeEntry`, printable as Python and serialisable."""

    def __init__(self, entries: list[RecipeEntry] | None = None) -> None:
        self.entries: list[RecipeEntry] = list(entries or [])

    def append(self, entry: RecipeEntry) -> None:
        """Add one entry at the end."""
        self.entries.append(entry)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[RecipeEntry]:
        return iter(self.entries)

    def __getitem__(self, index: int) -> RecipeEntry:
        return self.entries[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Recipe):
            return NotImplemented
        return self.entries == other.entries

    def __repr__(self) -> str:
        return f"Recipe({len(self.entries)} entries)"

    def __str__(self) -> str:
        """The recipe as a script; it expects a variable ``model`` and defines ``sch``.

        Arguments that cannot be written as source are shown as ``UNSERIALISABLE_<n>``
        names with a comment; such a script needs those names defined before it runs.
        Names in the script are validated identifiers and values are written by ``repr``,
        so no recipe can print as other code than its calls.
        """
        imports: set[str] = {"torchloom"}
        lines: list[str] = []
        placeholders = 0
        for entry in self.entries:
            try:
                lines.append(entry.call_text(imports))
            except _Unserialisable as exc:
                lines.append(
                    f"# line {len(lines) + 1}: an argument is not data "
                    f"({type(exc.value).__name__}); bind UNSERIALISABLE_{placeholders} first"
                )
                lines.append(
                    f"sch[{entry.path!r}].{entry.primitive}(UNSERIALISABLE_{placeholders})"
                )
                placeholders += 1
        header = [f"import {m}" for m in sorted(imports)]
        return "\n".join(header + ["", "sch = torchloom.create_schedule(model)"] + lines)

    def references(self) -> dict[str, Any]:
        """Every function or class this recipe holds, by the reference text its JSON
        uses: pass it as ``trusted_refs`` to read back a recipe recorded in this process.

        >>> recipe = Recipe([RecipeEntry("replace", "0", (torch.nn.GELU,))])
        >>> recipe.references()
        {'torch.nn.modules.activation:GELU': <class 'torch.nn.modules.activation.GELU'>}
        """
        found: dict[str, Any] = {}

        def walk(value: Any, depth: int) -> None:
            if depth > MAX_DEPTH:
                return
            if isinstance(value, (list, tuple)):
                for v in value:
                    walk(v, depth + 1)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v, depth + 1)
            elif not isinstance(value, (str, int, float, bool, torch.dtype)) and value is not None:
                ref = ref_of(value)
                if ref is not None:
                    found[ref] = value

        for entry in self.entries:
            walk(list(entry.args) + list(entry.kwargs.values()), 0)
        return found

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON; raises :class:`RecipeError` naming the first line that holds a
        value that is not data."""
        data = []
        for number, entry in enumerate(self.entries, start=1):
            try:
                data.append(entry.to_data())
            except _Unserialisable as exc:
                raise RecipeError(
                    f"recipe line {number} ({entry.primitive} at {entry.path!r}) has an argument "
                    f"that is not data: a {type(exc.value).__name__}",
                    path=entry.path,
                    primitive="recipe.to_json",
                    values={"line": number, "argument": short_repr(exc.value)},
                    fix="pass a module-level factory function (stored by import path) instead "
                    "of an object, e.g. sch[path].replace(mypackage.kernels.make_fused_mlp)",
                ) from None
        return json.dumps({"torchloom_recipe": FORMAT_VERSION, "entries": data}, indent=indent)

    @staticmethod
    def from_json(text: str, *, trusted_refs: Mapping[str, Any] | None = None,
                  trust_code: bool = False) -> Recipe:
        """Parse the output of :meth:`to_json`, treating it as untrusted data.

        Every entry is validated (a registered primitive, a string path, a list of
        arguments, identifier keywords, values nested at most ``MAX_DEPTH`` deep) and
        every ``{"__ref__": "module:qualname"}`` is resolved by :func:`resolve_ref`: a
        class or function of torch or torchloom, a transformers module class, or an
        object of ``trusted_refs`` (keyed by the reference text, e.g.
        ``sch.recipe.references()``). No other module is imported, unless
        ``trust_code=True`` says the text is trusted (then any reference is imported).

        Raises:
            RecipeError: the text is not a recipe, or names the offending line and value.

        >>> Recipe.from_json('{"torchloom_recipe": 1, "entries": [{"primitive": "shard", '
        ...                  '"path": "0", "args": "weight"}]}')
        Traceback (most recent call last):
        ...
        torchloom.core.errors.RecipeError: Recipe.from_json(...): recipe line 1: args of shard must be a list, not a str
            values: line=1, primitive='shard', args="'weight'"
            fix: wrap the arguments in a list, e.g. "args": ['weight']
        """
        try:
            if not isinstance(text, str):
                raise ValueError(f"a recipe is JSON text, not a {type(text).__name__}")
            data = json.loads(text)
            if type(data) is not dict:
                raise ValueError(f"the JSON holds a {type(data).__name__}, not an object")
            version = data.get("torchloom_recipe")
            if type(version) is not int or version != FORMAT_VERSION:
                raise ValueError(f"unknown format version {version!r}")
            extra = sorted(k for k in data if k not in ("torchloom_recipe", "entries"))
            if extra:
                raise ValueError(f"unknown field {extra[0]!r}")
            entries = data.get("entries")
            if type(entries) is not list:
                raise ValueError("'entries' must be a list")
        except RecursionError:
            raise RecipeError(
                "not a torchloom recipe: the JSON is nested too deeply to read",
                primitive="Recipe.from_json", values={"text": short_repr(text)},
                fix="pass the text written by sch.recipe.to_json()") from None
        except (ValueError, TypeError) as exc:
            raise RecipeError(
                f"not a torchloom recipe: {exc}",
                primitive="Recipe.from_json",
                values={"text": text[:80] if isinstance(text, str) else short_repr(text)},
                fix="pass the text written by sch.recipe.to_json()",
            ) from None
        check_trusted(trusted_refs, "Recipe.from_json")
        parsed = []
        for number, item in enumerate(entries, start=1):
            try:
                parsed.append(_entry_from_data(item, trusted_refs, trust_code))
            except Refused as exc:
                raise RecipeError(f"recipe line {number}: {exc.problem}",
                                  primitive="Recipe.from_json",
                                  values={"line": number, **exc.values}, fix=exc.fix) from None
        return Recipe(parsed)

    @staticmethod
    def from_script(text: str, *, trusted_refs: Mapping[str, Any] | None = None,
                    trust_code: bool = False) -> Recipe:
        """Parse the script ``str(recipe)`` prints, without running it.

        The script must have the printed form: ``import`` lines, then
        ``sch = torchloom.create_schedule(model)``, then one call
        ``sch['path'].primitive(...)`` per line whose arguments are literals (numbers,
        strings, lists, tuples, dicts), ``torch`` dtypes, or dotted names of imported
        modules' functions and classes (resolved like :meth:`from_json` resolves
        references). Anything else raises :class:`RecipeError` naming the script line.

        >>> recipe = Recipe([RecipeEntry("checkpoint", "0", (), {"ratio": 0.5})])
        >>> Recipe.from_script(str(recipe)) == recipe
        True
        """
        calls = parse_script(text, trusted_refs, trust_code)
        return Recipe([RecipeEntry(*call) for call in calls])
