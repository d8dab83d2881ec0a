"""The primitive registry: each primitive declares itself once, here.

A primitive module decorates its ``apply(sch, ...)`` with :func:`primitive`, giving its
name and the error classes it raises. The registry then

* installs a method of that name and signature on :class:`~torchloom.core.schedule.Schedule`
  and on :class:`~torchloom.core.schedule.ScheduleGroup` (which applies it to every node),
* and records each outermost call in the root's recipe in one canonical form: the call
  is bound to the signature, required parameters are recorded by position, optional ones
  by keyword and only when they differ from their defaults. ``shard("w", 0)``,
  ``shard("w", axis=0)`` and ``shard("w", 0, chunks=1)`` record the same line.

The table it fills, :data:`PRIMITIVES`, lives in :mod:`torchloom.core.primitive_table`
(below the schedule and the recipe, which read it) and is importable from here.

>>> import torch, torchloom as tl
>>> sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
>>> sch["0"].annotate(key="tag", value=1, param_name="weight", overwrite=False)
>>> sch.recipe[0].args, sch.recipe[0].kwargs
(('weight', 'tag', 1), {})
>>> [e.__name__ for e in PRIMITIVES["shard"].errors]  # one class per way it fails
['ShardArgumentError', 'ShardAxisError', 'ShardSizeError', 'ShardTiedError', 'ShardTwiceError']
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import PrimitiveCallError, ScheduleError
from .primitive_table import PRIMITIVES, list_primitives
from .recipe_data import RecipeEntry
from .schedule import Schedule, ScheduleGroup

__all__ = ["PRIMITIVES", "Primitive", "PrimitiveCallError", "list_primitives", "primitive"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Primitive:
    """One registered primitive.

    Attributes:
        name: the method name on ``Schedule`` and in recipes.
        apply: ``apply(sch, ...)``, the function that does the work.
        errors: the error classes it raises (documentation and tests).
        recorded: whether calls go into the recipe (``find`` only reads the schedule).
        record_as: per parameter, how its value is recorded (``f(sch, value)``), for
            values that are recorded in another form than they are given (matches).
        group_check: called with the group and the bound arguments before a group call.
    """

    name: str
    apply: Callable[..., Any]
    errors: tuple[type[ScheduleError], ...] = ()
    recorded: bool = True
    record_as: Mapping[str, Callable[[Schedule, Any], Any]] = field(default_factory=dict)
    group_check: Callable[[ScheduleGroup, inspect.BoundArguments], None] | None = None

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The signature of the method: ``apply``'s without its schedule parameter."""
        params = list(inspect.signature(self.apply).parameters.values())[1:]
        return inspect.Signature(params)

    def bind(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> inspect.BoundArguments:
        """``args`` and ``kwargs`` bound to the signature, or a PrimitiveCallError."""
        try:
            return self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise PrimitiveCallError(
                f"the arguments do not fit {self.name}{self.signature_text()}: {exc}",
                path=path, primitive=self.name,
                values={"args": len(args), "kwargs": sorted(kwargs)},
                fix=f"call it as sch[{path!r}].{self.name}{self.signature_text()}") from None

    def signature_text(self) -> str:
        """``(a, b, c=1, *, d=False)``: the parameters without annotations."""
        parts: list[str] = []
        for p in self.signature.parameters.values():
            if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in parts):
                parts.append("*")
            prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
            default = "" if p.default is p.empty else f"={p.default!r}"
            parts.append(f"{prefix}{p.name}{default}")
        return f"({', '.join(parts)})"

    def canonical(self, sch: Schedule, bound: inspect.BoundArguments
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The recorded form of a bound call (see the module docstring)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in self.signature.parameters.values():
            if p.name not in bound.arguments:
                continue
            value = bound.arguments[p.name]
            if p.name in self.record_as:
                value = self.record_as[p.name](sch, value)
            if p.kind is p.VAR_KEYWORD:
                kwargs.update(value)
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(value)
            elif p.default is p.empty and p.kind is not p.KEYWORD_ONLY:
                args.append(value)
            elif p.default is p.empty or not _same(value, p.default):
                kwargs[p.name] = value
        return tuple(args), kwargs

    def call(self, sch: Schedule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the primitive on ``sch``; record it if it is the outermost call."""
        bound = self.bind(sch.path, args, kwargs)
        if not self.recorded:
            return self.apply(sch, *bound.args, **bound.kwargs)
        root = sch.root
        sch.refuse_if_built(self.name)
        entry = RecipeEntry(self.name, sch.path, *self.canonical(sch, bound))
        root._recording_depth += 1
        try:
            result = self.apply(sch, *bound.args, **bound.kwargs)
        finally:
            root._recording_depth -= 1
        if root._recording_depth == 0:
            root._recipe.append(entry)
        return result


def _same(value: Any, default: Any) -> bool:
    """Whether ``value`` is the parameter's default (``0`` and ``False`` are not ``None``)."""
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 - a value without a boolean ==, e.g. a tensor
        return False


def primitive(name: str, *, errors: tuple[type[ScheduleError], ...] = (),
              recorded: bool = True,
              record_as: Mapping[str, Callable[[Schedule, Any], Any]] | None = None,
              group_check: Callable[[ScheduleGroup, inspect.BoundArguments], None] | None = None,
              ) -> Callable[[F], F]:
    """Register the decorated ``apply(sch, ...)`` as the primitive ``name`` and install
    its ``Schedule`` and ``ScheduleGroup`` methods."""
    def register(apply: F) -> F:
        prim = Primitive(name, apply, tuple(errors), recorded, dict(record_as or {}),
                         group_check)
        PRIMITIVES[name] = prim
        setattr(Schedule, name, _node_method(prim))
        setattr(ScheduleGroup, name, _group_method(prim))
        return apply

    return register


def _describe(method: Callable[..., Any], prim: Primitive, owner: str, doc: str) -> None:
    method.__name__ = prim.name
    method.__qualname__ = f"{owner}.{prim.name}"
    method.__module__ = prim.apply.__module__
    method.__doc__ = doc
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = prim.signature.replace(  # type: ignore[attr-defined]
        parameters=[self_param, *prim.signature.parameters.values()])


def _node_method(prim: Primitive) -> Callable[..., Any]:
    def method(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        return prim.call(self, args, kwargs)

    summary = (inspect.getdoc(prim.apply) or "").split("\n\n")[0]
    _describe(method, prim, "Schedule", f"{summary}\n\nSee :mod:`{prim.apply.__module__}`.")
    return method


def _group_method(prim: Primitive) -> Callable[..., Any]:
    def method(self: ScheduleGroup, *args: Any, **kwargs: Any) -> Any:
        bound = prim.bind(self.pattern, args, kwargs)
        if prim.group_check is not None:
            prim.group_check(self, bound)
        results = [prim.call(node, args, kwargs) for node in self.nodes]
        if all(r is None for r in results):
            return None
        return [item for r in results for item in r]

    _describe(method, prim, "ScheduleGroup",
              f"``{prim.name}`` on every node of the group, in tree order (the results of "
              f"the nodes in one list, where it returns one).\n\nSee :mod:`{prim.apply.__module__}`.")
    return method
