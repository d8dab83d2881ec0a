"""The recipe: every primitive call of a schedule, recorded as data.

Each call of a primitive on any node of a schedule appends one :class:`RecipeEntry`
(primitive name, schedule path, arguments) to the root's :class:`Recipe`. A call on a
wildcard group records one entry per matched node. Primitives that call other primitives
(``replace_all`` calls ``replace``) record only the outer call. A call that raises is not
recorded.

A recipe prints as a Python script, serialises to JSON, and replays on a fresh model with
:func:`apply_recipe`. Arguments that are data serialise: ``None``, booleans, numbers,
strings, lists, tuples, string-keyed dicts, ``torch.dtype`` and module-level functions or
classes, which are stored by import path (``"package.module:qualname"``). Anything else
(a module instance, a lambda) is kept in memory so the schedule still works, but
``to_json`` raises a :class:`~torchloom.core.errors.RecipeError` naming the line.

A recipe read from text is data, never code (:meth:`Recipe.from_json`,
:meth:`Recipe.from_script`, :func:`apply_recipe`): each line must call a registered
primitive (:func:`~torchloom.list_primitives`) with a string path, a list of arguments and
identifier keywords that fit the primitive's signature; values nest at most
:data:`MAX_DEPTH` deep; a reference ``{"__ref__": "module:qualname"}`` resolves only to
an object of the schedule allow-list (:mod:`torchloom.core.refs`: module classes of
torch.nn, transformers and torchloom.ops, torchloom's schedule factories, named pure
tensor functions) or to an object the caller passes in ``trusted_refs`` (keyed by the
reference text); and references sit only in the arguments that take a function or class
(``concrete_args`` and the rest are plain data). No other module is imported, unless the
caller says ``trust_code=True``. Every refusal is a
:class:`~torchloom.core.errors.RecipeError` naming the line, the offending name and the fix.

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> sch = tl.create_schedule(model)
>>> sch["0"].annotate("weight", "replicated", True)
>>> sch["0"].checkpoint()
>>> print(sch.recipe)
import torchloom
<BLANKLINE>
sch = torchloom.create_schedule(model)
sch['0'].annotate('weight', 'replicated', True)
sch['0'].checkpoint()
>>> again = tl.Recipe.from_json(sch.recipe.to_json())
>>> again == sch.recipe
True
>>> replayed = tl.apply_recipe(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), again)
>>> replayed.recipe == sch.recipe
True
"""

from __future__ import annotations

import ast
import json
import keyword
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
from torch import nn

from .errors import RecipeError, ScheduleError
from .refs import (
    Refused,
    check_reference_places,
    check_trusted,
    import_ref,
    is_dunder,
    ref_of,
    resolve_ref,
    resolve_untrusted,
    short_repr,
)

if TYPE_CHECKING:
    from .schedule import Schedule

__all__ = [
    "MAX_DEPTH",
    "Recipe",
    "RecipeEntry",
    "apply_recipe",
    "import_ref",
    "ref_of",
    "resolve_ref",
]

FORMAT_VERSION = 1



# --------------------------------------------------------------------------- references

#: The deepest nesting of lists, tuples and dicts a recipe argument may have.
MAX_DEPTH = 20

_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

# --------------------------------------------------------------------------- values


class _Unserialisable(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


def _encode(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise _Unserialisable(value)
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, list):
        return [_encode(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        if not all(type(k) is str for k in value):
            raise _Unserialisable(value)
        if any(is_dunder(k) for k in value):
            raise _Unserialisable(value)
        return {k: _encode(v, depth + 1) for k, v in value.items()}
    ref = ref_of(value)
    if ref is not None:
        return {"__ref__": ref}
    raise _Unserialisable(value)


def _decode(value: Any, resolve: Callable[[str], Any], depth: int = 0) -> Any:
    """A JSON value back to Python; raises ``Refused`` for anything ``_encode`` does not
    write, for nesting deeper than ``MAX_DEPTH``, and for untrusted references."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_decode(v, resolve, depth + 1) for v in value]
    if type(value) is not dict:
        raise Refused(f"a {type(value).__name__} is not a recipe value", {},
                       "write the recipe with sch.recipe.to_json()")
    special = [k for k in value if is_dunder(k)]
    if not special:
        return {k: _decode(v, resolve, depth + 1) for k, v in value.items()}
    if len(value) != 1:
        raise Refused(f"the special key {special[0]!r} must be alone in its object",
                       {"keys": sorted(value)[:8]}, "write the recipe with sch.recipe.to_json()")
    key, inner = special[0], value[special[0]]
    if key == "__dtype__":
        if not isinstance(inner, str) or inner not in _DTYPES:
            raise Refused(f"unknown dtype {short_repr(inner)}", {"dtype": short_repr(inner)},
                           "use a torch dtype name, e.g. {'__dtype__': 'float16'}")
        return _DTYPES[inner]
    if key == "__tuple__":
        if type(inner) is not list:
            raise Refused("'__tuple__' must hold a list", {"value": short_repr(inner)},
                           "write {'__tuple__': [1, 2]}")
        return tuple(_decode(v, resolve, depth + 1) for v in inner)
    if key == "__ref__":
        return resolve(inner)
    raise Refused(f"unknown special key {key!r}", {"key": key},
                   "use only '__dtype__', '__tuple__' and '__ref__'")


def _check_depth(value: Any, depth: int = 0) -> None:
    """Raise ``Refused`` when an in-memory argument nests deeper than ``MAX_DEPTH``
    (a list that contains itself, say)."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_depth(v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _check_depth(v, depth + 1)


def _python(value: Any, imports: set[str], depth: int = 0) -> str:
    """Render a value as Python source, collecting the imports it needs. Only values that
    are data are rendered (by ``repr`` for scalars and strings); anything else raises
    ``_Unserialisable``."""
    if depth > MAX_DEPTH:
        raise _Unserialisable(value)
    if isinstance(value, torch.dtype):
        imports.add("torch")
        return f"torch.{str(value).removeprefix('torch.')}"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v, imports, depth + 1) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_python(v, imports, depth + 1) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return "{" + ", ".join(f"{k!r}: {_python(v, imports, depth + 1)}"
                               for k, v in value.items()) + "}"
    if type(value) is float and not math.isfinite(value):
        return f"float({str(value)!r})"
    if value is None or type(value) in (bool, int, float, str):
        return repr(value)
    ref = ref_of(value)
    if ref is not None:  # both halves are dotted identifiers (ref_of checks)
        module, _, qualname = ref.partition(":")
        imports.add(module)
        return f"{module}.{qualname}"
    raise _Unserialisable(value)


# --------------------------------------------------------------------------- entries


def _check_fields(primitive: Any, path: Any, args: Any, kwargs: Any) -> None:
    """Raise ``Refused`` unless the fields make a call a recipe may hold: a registered
    primitive, a string path, a list or tuple of arguments, keywords that are public
    Python identifiers."""
    from .registry import list_primitives

    names = list_primitives()
    if not isinstance(primitive, str) or primitive not in names:
        raise Refused(f"unknown primitive {short_repr(primitive)}",
                       {"primitive": _shown(primitive)},
                       f"use one of the primitives: {', '.join(names)}")
    if not isinstance(path, str):
        raise Refused(f"the path must be a string, not a {type(path).__name__}",
                       {"primitive": primitive, "path": _shown(path)},
                       "write the schedule path as a string, e.g. 'transformer.h.0.mlp'")
    if not isinstance(args, (list, tuple)):
        raise Refused(f"args of {primitive} must be a list, not a {type(args).__name__}",
                       {"primitive": primitive, "args": short_repr(args)},
                       f"wrap the arguments in a list, e.g. \"args\": [{short_repr(args)}]")
    if not isinstance(kwargs, dict):
        raise Refused(f"kwargs of {primitive} must be an object (a dict), not a "
                       f"{type(kwargs).__name__}",
                       {"primitive": primitive, "kwargs": short_repr(kwargs)},
                       "write keywords as an object, e.g. \"kwargs\": {\"ratio\": 0.5}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
                or is_dunder(name):
            raise Refused(f"{short_repr(name)} is not a keyword {primitive} can take",
                           {"primitive": primitive, "keyword": _shown(name)},
                           "use the keyword names of the primitive's signature")


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
        fix: use one of the primitives: annotate, checkpoint, compile, cut_pipeline_stage, decompose, divide_attrs, fork_rng, fuse, replace, replace_all, shard, sync, trace, trace_until
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


def _check_places(primitive: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
                  trusted_refs: Mapping[str, Any] | None, trust_code: bool) -> None:
    """Raise ``Refused`` when a reference of an untrusted recipe sits in an argument that
    takes plain data (see :func:`~torchloom.core.refs.takes_references`)."""
    if trust_code:
        return
    from .registry import PRIMITIVES

    try:
        bound = PRIMITIVES[primitive].signature.bind(*args, **kwargs)
    except TypeError:
        return  # apply_recipe names the misfit when it checks the line
    trusted = {id(v) for v in (trusted_refs or {}).values()}
    check_reference_places(primitive, bound.arguments, lambda obj: id(obj) in trusted)


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
        return _parse_script(text, trusted_refs, trust_code)


def _shown(value: Any) -> Any:
    """A value as an error shows it: short scalars and strings as they are, anything else
    as a short repr."""
    if value is None or type(value) in (bool, int, float) or \
            (type(value) is str and len(value) <= 80):
        return value
    return short_repr(value)


# --------------------------------------------------------------------------- scripts


def _script_error(line: int, problem: str, values: dict[str, Any] | None = None,
                  fix: str | None = None) -> RecipeError:
    return RecipeError(f"script line {line}: {problem}", primitive="Recipe.from_script",
                       values={"line": line, **(values or {})},
                       fix=fix or "pass the script that print(sch.recipe) writes")


def _dotted_name(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _literal(node: ast.expr, imports: set[str], resolve: Callable[[str], Any],
             depth: int = 0) -> Any:
    """The value of an argument expression of a printed recipe; raises ``Refused``."""
    if depth > MAX_DEPTH:
        raise Refused(f"an argument is nested deeper than {MAX_DEPTH} levels",
                       {"max_depth": MAX_DEPTH}, "flatten the argument")
    if isinstance(node, ast.Constant) and (node.value is None
                                           or type(node.value) in (bool, int, float, str)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = cast(float, node.operand.value)  # an int or a float (checked above)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [_literal(e, imports, resolve, depth + 1) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e, imports, resolve, depth + 1) for e in node.elts)
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and type(k.value) is str
                                          for k in node.keys):
        return {k.value: _literal(v, imports, resolve, depth + 1)  # type: ignore[union-attr]
                for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "float" and not node.keywords and len(node.args) == 1 and \
            isinstance(node.args[0], ast.Constant) and \
            node.args[0].value in ("nan", "inf", "-inf"):
        return float(node.args[0].value)
    dotted = _dotted_name(node)
    if dotted is not None and "." in dotted:
        head, _, attr = dotted.partition(".")
        if head == "torch" and attr in _DTYPES and "torch" in imports:
            return _DTYPES[attr]
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in imports:
                return resolve(f"{module}:{'.'.join(parts[cut:])}")
        raise Refused(f"{dotted!r} is not in a module the script imports",
                       {"name": dotted}, "import its module at the top of the script")
    raise Refused(f"{short_repr(ast.unparse(node))} is not a recipe value",
                   {"expression": short_repr(ast.unparse(node))},
                   "write arguments as literals, torch dtypes or imported names")


def _parse_script(text: str, trusted_refs: Mapping[str, Any] | None,
                  trust_code: bool) -> Recipe:
    check_trusted(trusted_refs, "Recipe.from_script")
    if not isinstance(text, str):
        raise _script_error(0, f"a script is text, not a {type(text).__name__}")
    try:
        tree = ast.parse(text, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _script_error(getattr(exc, "lineno", None) or 0,
                            f"not Python: {type(exc).__name__}: {exc}") from None

    def resolve(ref: str) -> Any:
        return resolve_untrusted(ref, trusted_refs, trust_code)

    imports: set[str] = set()
    created = False
    entries: list[RecipeEntry] = []
    for stmt in tree.body:
        line = stmt.lineno
        if not created and isinstance(stmt, ast.Import) and \
                all(alias.asname is None for alias in stmt.names):
            imports.update(alias.name for alias in stmt.names)
            continue
        if not created and isinstance(stmt, ast.Assign) and \
                ast.unparse(stmt) == "sch = torchloom.create_schedule(model)" and \
                "torchloom" in imports:
            created = True
            continue
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        target = call.func if isinstance(call, ast.Call) else None
        node = target.value if isinstance(target, ast.Attribute) else None
        if not (created and isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == "sch" and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            raise _script_error(line, "not a recipe statement: "
                                f"{short_repr(ast.unparse(stmt))}",
                                fix="a recipe script is import lines, "
                                "'sch = torchloom.create_schedule(model)', then "
                                "sch['path'].primitive(...) calls")
        assert isinstance(call, ast.Call) and isinstance(target, ast.Attribute)
        try:
            if any(isinstance(a, ast.Starred) for a in call.args) or \
                    any(k.arg is None for k in call.keywords):
                raise Refused("*args and **kwargs are not recipe arguments", {},
                               "write each argument out")
            args = [_literal(a, imports, resolve) for a in call.args]
            kwargs = {cast(str, k.arg): _literal(k.value, imports, resolve) for k in call.keywords}
            _check_fields(target.attr, node.slice.value, args, kwargs)
            _check_places(target.attr, args, kwargs, trusted_refs, trust_code)
        except Refused as exc:
            raise _script_error(line, exc.problem, exc.values, exc.fix) from None
        entries.append(RecipeEntry(target.attr, node.slice.value, tuple(args), kwargs))
    return Recipe(entries)


# --------------------------------------------------------------------------- recording


def _check_call(entry: RecipeEntry) -> Callable[..., Any]:
    """The method to call for ``entry``, after checking its fields, the nesting of its
    values and its arguments against the primitive's signature; raises ``Refused``."""
    if not isinstance(entry, RecipeEntry):
        raise Refused(f"a recipe holds RecipeEntry objects, not a {type(entry).__name__}",
                       {"entry": short_repr(entry)}, "build entries with RecipeEntry(...)")
    _check_fields(entry.primitive, entry.path, entry.args, entry.kwargs)
    for value in (*entry.args, *entry.kwargs.values()):
        _check_depth(value)
    from .registry import PRIMITIVES

    prim = PRIMITIVES[entry.primitive]
    signature = prim.signature
    params = [p for p in signature.parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    valid = [p.name for p in params if p.kind is not p.POSITIONAL_ONLY]
    unknown = [k for k in entry.kwargs if k not in valid]
    if unknown and not takes_any_keyword:
        raise Refused(
            f"{entry.primitive}() has no keyword {unknown[0]!r}",
            {"primitive": entry.primitive, "keyword": unknown[0], "valid": valid},
            f"use one of {', '.join(valid)}" if valid
            else f"{entry.primitive}() takes no keywords: remove {unknown[0]!r}")
    try:
        signature.bind(*entry.args, **entry.kwargs)
    except TypeError as exc:
        raise Refused(
            f"the arguments do not fit {entry.primitive}{prim.signature_text()}: {exc}",
            {"primitive": entry.primitive, "args": len(entry.args),
             "kwargs": sorted(entry.kwargs)},
            f"call it as sch[path].{entry.primitive}{prim.signature_text()}") from None
    return lambda target, *args, **kwargs: prim.call(target, args, kwargs)


def apply_recipe(model: nn.Module, recipe: Recipe | str, group: Any = None, *,
                 trusted_refs: Mapping[str, Any] | None = None,
                 trust_code: bool = False) -> Schedule:
    """Create a schedule of ``model`` and replay ``recipe`` on it.

    ``recipe`` is a :class:`Recipe`, or its JSON text, which is parsed by
    :meth:`Recipe.from_json` with ``trusted_refs`` and ``trust_code`` (untrusted by
    default: see there). Every line is checked before the first is applied (a registered
    primitive, arguments that fit its signature); a line that does not raises a
    :class:`RecipeError` naming it, and the model is untouched. Then every line is tried:
    if some fail (a path that no longer exists, a shape that no longer divides), a
    :class:`RecipeError` lists each failing line with its reason.
    """
    from .schedule import Schedule, create_schedule

    if isinstance(recipe, str):
        recipe = Recipe.from_json(recipe, trusted_refs=trusted_refs, trust_code=trust_code)
    if not isinstance(recipe, Recipe):
        raise RecipeError(
            f"apply_recipe takes a Recipe or its JSON text, not a {type(recipe).__name__}",
            primitive="apply_recipe", values={"recipe": short_repr(recipe)},
            fix="tl.apply_recipe(model, tl.Recipe.from_json(text))")
    calls: list[tuple[RecipeEntry, Callable[..., Any]]] = []
    for number, entry in enumerate(recipe, start=1):
        try:
            calls.append((entry, _check_call(entry)))
        except Refused as exc:
            raise RecipeError(f"recipe line {number}: {exc.problem}", primitive="apply_recipe",
                              values={"line": number, **exc.values}, fix=exc.fix) from None
    sch = create_schedule(model, group=group)
    failures: list[str] = []
    for number, (entry, method) in enumerate(calls, start=1):
        try:
            target = sch[entry.path]
            if not isinstance(target, Schedule):
                raise RecipeError(
                    f"a recipe line names one module; this path matches {len(target)}",
                    path=entry.path, primitive="apply_recipe",
                    fix="write one line per module, as a recorded recipe does")
            method(target, *entry.args, **entry.kwargs)
        except ScheduleError as exc:
            failures.append(f"line {number}: {entry.call_text_safe()}\n        {exc.problem}")
    if failures:
        raise RecipeError(
            f"{len(failures)} of {len(recipe)} recipe lines failed on this model:\n    "
            + "\n    ".join(failures),
            primitive="apply_recipe",
            values={"model": type(model).__name__, "failed_lines": len(failures)},
            fix="apply the recipe to the model it was recorded on, or edit the failing lines",
        )
    return sch
