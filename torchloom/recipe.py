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
``to_json`` raises a :class:`~torchloom.errors.RecipeError` naming the line.

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

import functools
import importlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from .errors import RecipeError, ScheduleError

if TYPE_CHECKING:
    from .schedule import Schedule

__all__ = ["Recipe", "RecipeEntry", "apply_recipe", "recorded", "import_ref", "ref_of"]

FORMAT_VERSION = 1
F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- references


def ref_of(obj: Any) -> str | None:
    """The import path ``"module:qualname"`` of a function or class, or None if ``obj``
    cannot be found again by importing (lambdas, local functions, instances).

    >>> ref_of(torch.nn.Linear)
    'torch.nn.modules.linear:Linear'
    >>> ref_of(lambda x: x) is None
    True
    """
    if not callable(obj) or not hasattr(obj, "__qualname__") or not hasattr(obj, "__module__"):
        return None
    if isinstance(obj, nn.Module) or functools.partial in type(obj).__mro__:
        return None
    module, qualname = obj.__module__, obj.__qualname__
    if module is None or "<" in qualname:
        return None
    ref = f"{module}:{qualname}"
    try:
        found = import_ref(ref)
    except RecipeError:
        return None
    return ref if found is obj else None


def import_ref(ref: str) -> Any:
    """Import the object named by ``"module:qualname"``.

    >>> import_ref("torch.nn:Linear") is torch.nn.Linear
    True
    """
    module_name, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(
            f"cannot import {ref!r}: {exc}",
            primitive="apply_recipe",
            values={"ref": ref},
            fix="make the function or class importable under that name, or edit the recipe",
        ) from exc
    return obj


# --------------------------------------------------------------------------- values


class _Unserialisable(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.value = value


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise _Unserialisable(value)
        if any(k.startswith("__") and k.endswith("__") for k in value):
            raise _Unserialisable(value)
        return {k: _encode(v) for k, v in value.items()}
    ref = ref_of(value)
    if ref is not None:
        return {"__ref__": ref}
    raise _Unserialisable(value)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__ref__" in value:
            return import_ref(value["__ref__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _python(value: Any, imports: set[str]) -> str:
    """Render a value as Python source, collecting the imports it needs."""
    if isinstance(value, torch.dtype):
        imports.add("torch")
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python(v, imports) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_python(v, imports) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{k!r}: {_python(v, imports)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    ref = ref_of(value)
    if ref is not None:
        module, _, qualname = ref.partition(":")
        imports.add(module)
        return f"{module}.{qualname}"
    raise _Unserialisable(value)


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class RecipeEntry:
    """One recorded primitive call: ``sch[path].<primitive>(*args, **kwargs)``."""

    primitive: str
    path: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

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
    def from_data(data: dict[str, Any]) -> RecipeEntry:
        """Inverse of :meth:`to_data`."""
        return RecipeEntry(
            primitive=data["primitive"],
            path=data["path"],
            args=tuple(_decode(a) for a in data.get("args", [])),
            kwargs={k: _decode(v) for k, v in data.get("kwargs", {}).items()},
        )


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
                    values={"line": number, "argument": _short_repr(exc.value)},
                    fix="pass a module-level factory function (stored by import path) instead "
                    "of an object, e.g. sch[path].replace(mypackage.kernels.make_fused_mlp)",
                ) from None
        return json.dumps({"torchloom_recipe": FORMAT_VERSION, "entries": data}, indent=indent)

    @staticmethod
    def from_json(text: str) -> Recipe:
        """Parse the output of :meth:`to_json`."""
        try:
            data = json.loads(text)
            if data.get("torchloom_recipe") != FORMAT_VERSION:
                raise ValueError(f"unknown format version {data.get('torchloom_recipe')!r}")
            entries = [RecipeEntry.from_data(e) for e in data["entries"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecipeError(
                f"not a torchloom recipe: {exc}",
                primitive="Recipe.from_json",
                values={"text": text[:80]},
                fix="pass the text written by sch.recipe.to_json()",
            ) from exc
        return Recipe(entries)


def _short_repr(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- recording


def recorded(method: F) -> F:
    """Decorate a ``Schedule`` primitive method so each successful outermost call is
    appended to the root's recipe."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        root = self.root
        root._recording_depth += 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            root._recording_depth -= 1
        if root._recording_depth == 0:
            root._recipe.append(RecipeEntry(name, self.path, tuple(args), dict(kwargs)))
        return result

    return wrapper  # type: ignore[return-value]


def apply_recipe(model: nn.Module, recipe: Recipe, group: Any = None) -> Schedule:
    """Create a schedule of ``model`` and replay ``recipe`` on it.

    Every line is tried. If some fail (a path that no longer exists, a shape that no
    longer divides), a :class:`RecipeError` lists each failing line with its reason.
    """
    from .schedule import create_schedule

    sch = create_schedule(model, group=group)
    failures: list[str] = []
    for number, entry in enumerate(recipe, start=1):
        try:
            target = sch[entry.path]
            getattr(target, entry.primitive)(*entry.args, **entry.kwargs)
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
