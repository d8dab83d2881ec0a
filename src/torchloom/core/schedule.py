"""The schedule tree: a node per module, addressed by dotted path.

:func:`create_schedule` builds a :class:`Schedule` that mirrors ``model.named_children()``
all the way down, built-in containers included: a ``ModuleList`` or ``Sequential`` child
is a node whose children are named ``"0"``, ``"1"``, ..., so ``sch["h.0.attn"]`` steps
through ``h``, then ``0``, then ``attn``; ``nn.MultiheadAttention.out_proj`` is a node too.

A path token may hold shell-style wildcards (``*``, ``?``, ``[0-3]``), matched against the
child names of one level: ``sch["h.*.mlp"]`` is a :class:`ScheduleGroup` on which a
primitive applies to every match. A path that matches nothing raises
:class:`~torchloom.core.errors.PathError` with the nearest existing paths.

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 2)))
>>> sch = tl.create_schedule(model)
>>> [path for path, _ in sch.named_schedules()]
['', '0', '1', '2', '2.0']
>>> sch["2.0"].mod
Linear(in_features=8, out_features=2, bias=True)
>>> "2.0" in sch, "2.1" in sch
(True, False)
>>> [s.path for s in sch["*"]]
['0', '1', '2']
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import fnmatch
from typing import TYPE_CHECKING, Any, Iterator

import torch.distributed as dist
from torch import nn

from .errors import BuiltError, NotAModuleError, PathError, PrimitiveNameError
from .primitive_methods import PrimitiveMethods
from .primitive_table import PRIMITIVES
from .recipe_data import Recipe

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Schedule", "ScheduleGroup", "create_schedule", "factory_group", "join_path"]

_FACTORY_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "torchloom_factory_group", default=None)


def factory_group() -> Any:
    """The process group of the schedule node whose ``replace`` factory is running (a
    factory builds its module for that group: a vocabulary-parallel embedding splits the
    vocabulary over the tensor-parallel group, not the world); None outside a factory
    or for the default group.

    >>> factory_group() is None
    True
    """
    return _FACTORY_GROUP.get()


@contextlib.contextmanager
def building_for(group: Any) -> Iterator[None]:
    """Run a ``replace`` factory for the schedule group ``group`` (see
    :func:`factory_group`)."""
    token = _FACTORY_GROUP.set(group)
    try:
        yield
    finally:
        _FACTORY_GROUP.reset(token)

_WILDCARD_CHARS = set("*?[")


def _has_wildcard(token: str) -> bool:
    return any(c in _WILDCARD_CHARS for c in token)


def join_path(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root (``prefix == ""``)."""
    return f"{prefix}.{name}" if prefix else name


class Schedule(PrimitiveMethods):
    """One node of the schedule tree.

    Attributes:
        mod: the module at this node (primitives may swap it).
        name: the key in the parent's ``child`` dict (``""`` for the root).
        path: dotted path from the root (``""`` for the root).
        parent: the parent node, or None at the root.
        child: the child nodes by name, in ``named_children()`` order.
        group: the tensor-parallel process group (None: the default group, if any).
        world_size, rank: size of, and rank in, ``group``; 1 and 0 without torch.distributed.
    """

    def __init__(
        self,
        mod: nn.Module,
        name: str = "",
        path: str = "",
        parent: Schedule | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        if not isinstance(mod, nn.Module):
            raise NotAModuleError(
                f"a schedule is made of an nn.Module, not a {type(mod).__name__}",
                path=path,
                primitive="create_schedule",
                values={"mod": type(mod).__name__},
                fix="pass the model itself: torchloom.create_schedule(model)",
            )
        self.mod = mod
        self.name = name
        self.path = path
        self.parent = parent
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world_size, self.rank = 1, 0
        self.child: dict[str, Schedule] = {}
        if parent is None:
            self._recipe = Recipe()
            self._recording_depth = 0
            self._built = False  # set by build(), with the target it built for
            self._built_target: str | None = None
        self.rebuild_children()

    # ------------------------------------------------------------------ tree

    def rebuild_children(self) -> None:
        """Re-create the child nodes from ``self.mod.named_children()``.

        Primitives that swap ``self.mod`` call this; user code rarely needs to.
        """
        # _modules rather than named_children(): a module registered in two slots (the same
        # layer twice in a ModuleList) gets a node per slot, as every slot is addressable.
        self.child = {
            name: Schedule(sub, name, join_path(self.path, name), self, self.group)
            for name, sub in self.mod._modules.items()
            if sub is not None
        }

    def sync_children(self) -> None:
        """Bring the child nodes in line with ``self.mod._modules`` keeping the existing
        nodes (by name) and updating their ``mod``; used after a primitive rebuilt the
        module in place of the old one (``trace``) or added sub-modules (``fuse``)."""
        synced: dict[str, Schedule] = {}
        for name, sub in self.mod._modules.items():
            if sub is None:
                continue
            node = self.child.get(name)
            if node is None:
                node = Schedule(sub, name, join_path(self.path, name), self, self.group)
            else:
                node.mod = sub
                node.sync_children()
            synced[name] = node
        self.child = synced

    @property
    def root(self) -> Schedule:
        """The root node of this tree."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    @property
    def recipe(self) -> Recipe:
        """The recipe of the whole tree (kept at the root)."""
        return self.root._recipe

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """Pre-order ``(relative dotted path, node)`` pairs, this node first as ``prefix``."""
        yield prefix, self
        for name, sub in self.child.items():
            yield from sub.named_schedules(join_path(prefix, name))

    def get_module(self, name: str) -> nn.Module:
        """The sub-module at dotted ``name`` relative to this node (``""`` is ``self.mod``)."""
        try:
            return self.mod.get_submodule(name)
        except AttributeError:
            names = [n for n, _ in self.mod.named_modules() if n]
            raise PathError(
                f"module {self.mod.__class__.__name__} has no sub-module {name!r}",
                path=self.path,
                primitive="get_module",
                values={"name": name, "nearest": difflib.get_close_matches(name, names, n=3)},
                fix="use a name from self.mod.named_modules()",
            ) from None

    def _resolve(self, path: str) -> list[Schedule]:
        if path == "":
            return [self]
        nodes = [self]
        for depth, token in enumerate(path.split(".")):
            found: list[Schedule] = []
            for node in nodes:
                if _has_wildcard(token):
                    found += [c for n, c in node.child.items() if fnmatch.fnmatchcase(n, token)]
                elif token in node.child:
                    found.append(node.child[token])
            if not found:
                self._raise_missing(path, ".".join(path.split(".")[: depth + 1]))
            nodes = found
        return nodes

    def _raise_missing(self, path: str, failed_prefix: str) -> None:
        known = [p for p, _ in self.named_schedules() if p]
        nearest = difflib.get_close_matches(path, known, n=5, cutoff=0.5)
        parent_prefix = failed_prefix.rpartition(".")[0]
        if not nearest:
            nearest = [p for p in known if p.rpartition(".")[0] == parent_prefix][:5]
        raise PathError(
            f"no module matches this path (nothing at {join_path(self.path, failed_prefix)!r})",
            path=join_path(self.path, path),
            values={"nearest": [join_path(self.path, p) for p in nearest]},
            fix="use one of the nearest paths; print(sch) shows the whole tree",
        )

    def __getitem__(self, path: str) -> Schedule | ScheduleGroup:
        """The node at dotted ``path`` below this one; a :class:`ScheduleGroup` if the path
        has wildcards."""
        if not isinstance(path, str):
            raise PathError(
                f"a schedule path is a dotted string, not a {type(path).__name__}",
                path=self.path,
                primitive="__getitem__",
                values={"path": path},
                fix='write sch["h.0"] for item 0 of a ModuleList named h',
            )
        nodes = self._resolve(path)
        if any(_has_wildcard(t) for t in path.split(".")):
            return ScheduleGroup(nodes, pattern=join_path(self.path, path))
        return nodes[0]

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        try:
            self._resolve(path)
        except PathError:
            return False
        return True

    def __iter__(self) -> Iterator[Schedule]:
        return iter(self.child.values())

    def __repr__(self) -> str:
        return f"Schedule(path={self.path!r}, mod={type(self.mod).__name__})"

    def __str__(self) -> str:
        from .show import render_tree

        return render_tree(self)

    # ------------------------------------------------------------------ built or not

    @property
    def built(self) -> bool:
        """Whether :func:`torchloom.build` has built this schedule (its root); a built
        schedule takes no more primitives."""
        return self.root._built

    def refuse_if_built(self, primitive: str) -> None:
        """Raise when ``primitive`` is called (outermost, not from inside another
        primitive) on a schedule that ``build`` has built: the parameters it creates or
        replaces would not be in the optimizer, the data-parallel wrapper or the pipeline
        stages that build made. Called by the registry for every primitive call."""
        root = self.root
        if not root._built or root._recording_depth > 0:
            return
        raise BuiltError(
            f"this schedule was already built; {primitive} after build would not reach the "
            "model build returned (its optimizer, data-parallel wrapper or pipeline stages "
            "hold the parameters as they were)",
            path=self.path,
            primitive=primitive,
            values={"primitive": primitive, "built_for_target": root._built_target},
            fix="apply every primitive before torchloom.build(sch); to change a built "
            "model's schedule, replay it on a fresh model and build that: "
            "sch = torchloom.apply_recipe(make_model(), old_sch.recipe); "
            f"sch[{self.path!r}].{primitive}(...); model, opt = torchloom.build(sch)",
        )

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name the node does not have: a primitive's name is a method
        (installed by :mod:`torchloom.core.registry`); anything else is a typo."""
        _no_such_primitive(self.__dict__.get("path", ""), name)


def _no_such_primitive(path: str, name: str) -> None:
    if name.startswith("_"):
        raise AttributeError(name)
    near = difflib.get_close_matches(name, list(PRIMITIVES), n=1)
    raise PrimitiveNameError(
        f"a schedule has no primitive or attribute {name!r}", path=path, primitive=name,
        values={"name": name},
        fix=f"did you mean sch[...].{near[0]}(...)?" if near else
        f"use one of {', '.join(sorted(PRIMITIVES))}")


class ScheduleGroup(PrimitiveMethods):
    """The nodes a wildcard path matched; a primitive called on the group is applied to
    each node in tree order (and recorded once per node).

    >>> import torch, torchloom as tl
    >>> from torch import nn
    >>> blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2)) for _ in range(3))
    >>> sch = tl.create_schedule(nn.Sequential(blocks))
    >>> group = sch["0.*.0"]
    >>> group.paths
    ['0.0.0', '0.1.0', '0.2.0']
    >>> group.annotate("weight", "tag", 1)
    >>> len(sch.recipe)
    3
    """

    def __init__(self, nodes: list[Schedule], pattern: str) -> None:
        self.nodes = nodes
        self.pattern = pattern

    @property
    def paths(self) -> list[str]:
        """The paths of the matched nodes."""
        return [n.path for n in self.nodes]

    def __iter__(self) -> Iterator[Schedule]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, path: str) -> ScheduleGroup:
        """The same relative path below every node of the group."""
        found: list[Schedule] = []
        for node in self.nodes:
            sub = node[path]
            found += sub.nodes if isinstance(sub, ScheduleGroup) else [sub]
        return ScheduleGroup(found, pattern=join_path(self.pattern, path))

    def __repr__(self) -> str:
        return f"ScheduleGroup({self.pattern!r}, {len(self.nodes)} nodes)"

    def __getattr__(self, name: str) -> Any:
        _no_such_primitive(self.__dict__.get("pattern", ""), name)


def create_schedule(model: nn.Module, group: ProcessGroup | None = None) -> Schedule:
    """Make the schedule tree of ``model``; the model is changed in place by primitives.

    Args:
        model: any ``nn.Module``.
        group: the tensor-parallel process group; None means the default group when
            ``torch.distributed`` is initialised, and a world of one otherwise.
    """
    return Schedule(model, group=group)
