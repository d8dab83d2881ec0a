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

from collections.abc import Mapping
from typing import Any, Callable

from torch import nn

from .errors import RecipeError, ScheduleError
from .recipe_data import Recipe, RecipeEntry
from .recipe_values import MAX_DEPTH, _check_depth, _check_fields
from .refs import Refused, import_ref, ref_of, resolve_ref, short_repr
from .registry import PRIMITIVES
from .schedule import Schedule, create_schedule

# The recipe is in layers, each importing only those below it:
#   recipe_values (what a line may hold) < recipe_script (reading the printed script)
#   < recipe_data (RecipeEntry, Recipe) < schedule < registry < recipe (replaying).
# The names a recipe user needs are all importable from here.
__all__ = [
    "MAX_DEPTH",
    "Recipe",
    "RecipeEntry",
    "apply_recipe",
    "import_ref",
    "ref_of",
    "resolve_ref",
]


def _check_call(entry: RecipeEntry) -> Callable[..., Any]:
    """The method to call for ``entry``, after checking its fields, the nesting of its
    values and its arguments against the primitive's signature; raises ``Refused``."""
    if not isinstance(entry, RecipeEntry):
        raise Refused(f"a recipe holds RecipeEntry objects, not a {type(entry).__name__}",
                       {"entry": short_repr(entry)}, "build entries with RecipeEntry(...)")
    _check_fields(entry.primitive, entry.path, entry.args, entry.kwargs)
    for value in (*entry.args, *entry.kwargs.values()):
        _check_depth(value)
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
