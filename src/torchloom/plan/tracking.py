"""What a training step holds and sends: live storages with marks, and every collective.

:class:`Tracker` is :class:`~torchloom.runtime.memory.LiveBytes` (the storage view of an
allocator that ``TrainEvaluator`` measures with) extended for what a distributed step
does, so that the same class measures a real step on gloo ranks and the planner's step on
fake tensors:

* tensor subclasses (FSDP2's ``DTensor`` parameters and gradients) count the storages of
  their inner tensors;
* FSDP2 keeps the storage of an unsharded parameter and resizes it to zero after use
  (``free_storage`` / ``alloc_storage``): :func:`fsdp_storage_resizes` reports those
  resizes to the tracker, which counts the storage at its current size;
* :meth:`Tracker.mark` cuts the step into segments (the planner's parts: the embedding, each
  layer, the head; forward and backward) and records, per segment, the live bytes at its
  start and end and the peak in between;
* every ``torch.distributed`` collective (the ``c10d`` operators: torchloom's ``sync``
  collectives, DDP's bucket all-reduces, FSDP2's all-gathers and reduce-scatters, a
  pipeline's sends and receives) is logged as a :class:`Collective`: operator, bytes
  and the process group, named by mesh dimension when :attr:`Tracker.groups` says which.

Bytes of a collective: all-reduce and broadcast the tensor; all-gather the gathered
(output) tensor; reduce-scatter the reduced (input) tensor; send and receive the tensor.

Preconditions: the tracker must be active (``with tracker:``) while the tensors it should
see are created; tensors made before are counted with :meth:`Tracker.track`.

>>> import torch
>>> t = Tracker()
>>> with t:
...     a = torch.ones(1000)            # 4000 bytes
...     _ = t.mark("a")
...     b = a * 2                       # 4000 more
...     del b
...     _ = t.mark("b")
>>> [(s.name, s.start, s.end, s.peak) for s in t.segments]
[('a', 0, 4000, 4000), ('b', 4000, 4000, 8000)]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..runtime.memory import LiveBytes

__all__ = ["Collective", "Segment", "Tracker", "collective_bytes", "fsdp_storage_resizes"]

#: c10d operator name -> kind of collective
_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued.

    Attributes:
        kind: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send``,
            ``recv``, ...
        bytes: its payload (see the module docstring).
        group: the mesh dimension of its process group (``"tp"``, ``"dp"``, ``"pp"``), or
            the group's name when the tracker was not told.
        size: the number of ranks in the group.
    """

    kind: str
    bytes: int
    group: str
    size: int


@dataclass
class Segment:
    """Live bytes over a stretch of a step: at its start, at its end, and the peak."""

    name: str
    start: int
    end: int
    peak: int
    collectives: list[Collective]

    @property
    def delta(self) -> int:
        """What the segment leaves alive (negative: what it freed)."""
        return self.end - self.start

    @property
    def rise(self) -> int:
        """The peak above the start."""
        return self.peak - self.start


def _nbytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor):
        t = inner
    return t.numel() * t.element_size()


def _tensors_bytes(value: Any) -> int:
    return sum(_nbytes(t) for t in tree_flatten(value)[0])


def collective_bytes(name: str, args: tuple[Any, ...]) -> tuple[str, int]:
    """``(kind, bytes)`` of a ``c10d`` operator called with ``args`` (see the module
    docstring for what is counted).

    >>> x = torch.ones(4)
    >>> collective_bytes("allreduce_", ([x],))
    ('all_reduce', 16)
    >>> collective_bytes("_allgather_base_", (torch.ones(8), x))
    ('all_gather', 32)
    """
    kind = _KINDS.get(name, name)
    if name in ("allgather_", "allgather_coalesced_", "_allgather_base_",
                "allgather_into_tensor_coalesced_", "gather_"):
        return kind, _tensors_bytes(args[0])
    if name in ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                "alltoall_", "alltoall_base_", "scatter_"):
        return kind, _tensors_bytes(args[1])
    return kind, _tensors_bytes(args[0])


def _group_of(args: tuple[Any, ...]) -> tuple[str, int] | None:
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                if not a._type().name().endswith("ProcessGroup"):  # type: ignore[attr-defined]
                    continue
                pg = dist.ProcessGroup.unbox(a)
            except (AttributeError, RuntimeError):
                continue
            return pg.group_name, pg.size()
        if isinstance(a, dist.ProcessGroup):
            return a.group_name, a.size()
    return None


class Tracker(LiveBytes):
    """Live storages, segments and collectives of a step (see the module docstring).

    Attributes:
        groups: process-group name -> mesh dimension, for naming collectives.
        segments: the segments closed by :meth:`mark`, in order.
        collectives: every collective since the tracker was made (or :meth:`reset`).
        counting: collectives are logged only while this is True.
        real: count only tensors with memory behind them (not ``meta`` or fake tensors):
            for measuring a real step while meta models and tracing values are about.
    """

    def __init__(self, groups: dict[str, str] | None = None, real: bool = False) -> None:
        super().__init__()
        self.groups = dict(groups or {})
        self.real = real
        self.segments: list[Segment] = []
        self.collectives: list[Collective] = []
        self.counting = True
        self._start = 0
        self._peak = 0
        self._pending: list[Collective] = []
        self._storages: dict[int, Any] = {}

    # ---- storages

    def track(self, tensor: Any) -> None:
        """Count ``tensor``'s storage (the inner tensors' for a wrapper subclass such as
        ``DTensor``) from now until it is freed."""
        if not isinstance(tensor, torch.Tensor):
            return
        if self.real and (tensor.is_meta or _is_fake(tensor)):
            return  # no memory behind it (a meta model's other stages, tracing values)
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter and \
                hasattr(tensor, "__tensor_flatten__") and not _is_fake(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                self.track(getattr(tensor, name))
            return
        before = self.current
        super().track(tensor)
        if self.current != before:
            self._peak = max(self._peak, self.current)

    def resized(self, tensor: torch.Tensor, nbytes: int) -> None:
        """The storage of ``tensor`` now holds ``nbytes`` (FSDP2's resizes)."""
        key = tensor.untyped_storage()._cdata
        if key not in self._live:
            self.track(tensor)
            if key not in self._live:
                return
        self.current += nbytes - self._live[key]
        self._live[key] = nbytes
        self.peak = max(self.peak, self.current)
        self._peak = max(self._peak, self.current)

    def reset_peak(self) -> None:
        """Start a new peak (and a new segment) from the live bytes now."""
        self.peak = self.current
        self._start = self.current
        self._peak = self.current
        self._pending = []

    def reset(self) -> None:
        """Forget the segments and collectives (the live storages stay counted)."""
        self.segments = []
        self.collectives = []
        self.reset_peak()

    def mark(self, name: str) -> Segment:
        """Close the current segment under ``name`` and start the next one."""
        seg = Segment(name, self._start, self.current, max(self._peak, self.current),
                      self._pending)
        self.segments.append(seg)
        self._start = self.current
        self._peak = self.current
        self._pending = []
        return seg

    # ---- dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        namespace = getattr(func, "namespace", "")
        if namespace == "c10d" and self.counting:
            name = func._schema.name.split("::")[-1]
            if name in _KINDS:
                kind, size = collective_bytes(name, args)
                group = _group_of(args)
                gname, gsize = group if group is not None else ("world", 1)
                c = Collective(kind, size, self.groups.get(gname, gname), gsize)
                self.collectives.append(c)
                self._pending.append(c)
        before = self.current
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current != before:
            self._peak = max(self._peak, self.current)
        return out


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def fsdp_storage_resizes(tracker: Tracker) -> Iterator[None]:
    """Report FSDP2's storage resizes of unsharded parameters to ``tracker`` inside the
    block (its ``alloc_storage`` / ``free_storage`` helpers are wrapped; restored after).

    >>> with fsdp_storage_resizes(Tracker()):
    ...     pass
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:  # no FSDP2 in this torch: nothing to report
        yield
        return
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        tracker.resized(tensor, tensor.untyped_storage().nbytes())

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resized(tensor, 0)

    modules = [_fsdp_param, _fsdp_param_group]
    saved = [(m, {n: getattr(m, n) for n in ("alloc_storage", "free_storage") if hasattr(m, n)})
             for m in modules]
    try:
        for m, names in saved:
            if "alloc_storage" in names:
                m.alloc_storage = alloc_storage  # type: ignore[attr-defined]
            if "free_storage" in names:
                m.free_storage = free_storage  # type: ignore[attr-defined]
        yield
    finally:
        for m, names in saved:
            for n, fn in names.items():
                setattr(m, n, fn)
