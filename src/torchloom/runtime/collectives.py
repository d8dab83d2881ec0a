"""Differentiable collectives for tensor and sequence parallelism.

Each operation is an autograd function whose backward is the matching collective, so
gradients flow through every ``sync`` (Slapo's reshards lost them). They use plain
``torch.distributed`` calls, so the same code runs on gloo (CPU) and NCCL (CUDA). With a
world of one (no process group, or a group of size one) every operation is the identity.

=================  ===========================  ==================================
operation          forward                      backward
=================  ===========================  ==================================
``all_reduce``     sum over ranks               identity
``copy_to_group``  identity                     sum over ranks (all-reduce)
``all_gather``     concatenate along ``axis``   reduce-scatter (or keep own slice)
``reduce_scatter`` sum, keep own slice          all-gather
``scatter``        keep own slice of ``axis``   all-gather
``all_to_all``     rows to ranks, by counts     the reverse all-to-all
=================  ===========================  ==================================

A reduce-scatter is one ``dist.reduce_scatter_single`` (gloo has it too): each rank
receives only its slice of the sum, the bandwidth of half an all-reduce.
:func:`count_collectives` counts each by its kind (``all_reduce``, ``all_gather``,
``reduce_scatter``).

A collective that fails (a peer died, hung past the process group's timeout, or never
called it) raises :class:`~torchloom.core.errors.CollectiveTimeoutError` naming this rank, the
collective and, inside a ``sync`` hook (or any :func:`collective_site` block), the schedule
path of the module in flight; a backward collective names the path its forward ran under.

>>> import torch
>>> x = torch.ones(2, 4, requires_grad=True)
>>> all_gather(x, axis=1).shape      # a world of one: identity
torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from contextvars import ContextVar
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..core.errors import CollectiveShapeError, CollectiveTimeoutError, ScheduleError

__all__ = ["all_reduce", "all_reduce_raw", "copy_to_group", "all_gather", "reduce_scatter",
           "scatter", "all_to_all", "group_size", "group_rank", "count_collectives", "collective_site",
           "guard_collective", "group_timeout"]

#: (schedule path, primitive) of the collective in flight; set by ``sync`` hooks.
Site = tuple["str | None", str]
_site: ContextVar[Site | None] = ContextVar("torchloom_collective_site", default=None)


def group_size(group: Any = None) -> int:
    """World size of ``group`` (1 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """Rank in ``group`` (0 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_timeout(group: Any = None) -> float | None:
    """The timeout of ``group`` in seconds, if the backend tells it (None otherwise)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        if pg is None:  # no default group
            return None
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except RuntimeError:
                continue
            return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError):  # private API; say less then
        return None
    return None


@contextlib.contextmanager
def collective_site(path: str | None, primitive: str = "sync") -> Iterator[None]:
    """Name the schedule path (and primitive) of the collectives issued inside the block,
    so that a failed one says which module was in flight. ``sync`` hooks use it; the
    backward of a collective keeps the site of its forward.

    >>> with collective_site("h.0.mlp"):
    ...     _site.get()
    ('h.0.mlp', 'sync')
    """
    token = _site.set((path, primitive))
    try:
        yield
    finally:
        _site.reset(token)


_SYNC_FIX = ("run the same model, schedule and input shapes on every rank of the group (a "
             "rank that raised, died, or skipped this module's forward or backward leaves its "
             "peers waiting here); read the first failing rank's own error (torchloom's local "
             "launcher prints it first); if a rank is only slow, raise the timeout: "
             "init_distributed(timeout_s=...) or --timeout SECONDS on the command line")


@contextlib.contextmanager
def guard_collective(name: str, primitive: str, group: Any = None, *, path: str | None = None,
                     fix: str | None = None) -> Iterator[None]:
    """Turn a failed or timed-out collective inside the block into a
    :class:`~torchloom.core.errors.CollectiveTimeoutError` naming the collective, this rank, the
    timeout, the schedule ``path`` (when given) and the fix. Errors that are already a
    ``ScheduleError`` pass unchanged, and so does everything without a process group.

    >>> with guard_collective("all_gather", "full_state_dict"):
    ...     pass
    """
    start = time.monotonic()
    try:
        yield
    except ScheduleError:
        raise
    except RuntimeError as exc:  # gloo/NCCL report a dead or late peer as RuntimeError
        if not (dist.is_available() and dist.is_initialized()):
            raise
        waited = time.monotonic() - start
        timeout_s = group_timeout(group)
        timeout = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
        rank = dist.get_rank()
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise CollectiveTimeoutError(
            f"collective {name} failed after {waited:.1f} s on rank {rank} (timeout "
            f"{timeout}): another rank died, hung, or did not call it (or called it with "
            "other shapes)",
            path=path, primitive=primitive,
            values={"collective": name, "timeout_s": timeout_s, "rank": rank,
                    "waited_s": round(waited, 1), "error": lines[0][:300]},
            fix=fix or f"call {primitive}(...) on every rank of the group, in the same order; "
            "look for an error in the other ranks' logs; start the group with "
            "torchloom.runtime.state.init_distributed(timeout_s=...) to fail faster",
        ) from exc


def _guard(name: str, group: Any, site: Site | None) -> contextlib.AbstractContextManager[None]:
    if site is None:
        return guard_collective(name, name.split(" ")[0], group)
    path, primitive = site
    return guard_collective(name, primitive, group, path=path,
                            fix=_SYNC_FIX if primitive == "sync" else None)


_counts: list[Counter[str]] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the collectives torchloom issues inside the block, by name.

    >>> with count_collectives() as counts:
    ...     _ = all_reduce(torch.ones(2))    # a world of one issues nothing
    >>> dict(counts)
    {}
    """
    counts: Counter[str] = Counter()
    _counts.append(counts)
    try:
        yield counts
    finally:
        _counts.remove(counts)


def _record(name: str) -> None:
    for counts in _counts:
        counts[name] += 1


# Every low-level operation takes the site (schedule path, primitive) it runs for and the
# phase: "" in forward, " (backward)" in an autograd backward, " (gradient)" in a hook.

def _all_reduce(x: torch.Tensor, group: Any, site: Site | None, phase: str = "") -> torch.Tensor:
    x = x.contiguous().clone()
    if x.is_meta:  # shapes only
        return x
    _record("all_reduce")
    with _guard("all_reduce" + phase, group, site):
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_raw(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``x`` over ``group`` as a new tensor, outside autograd (for gradient hooks)."""
    return x if group_size(group) == 1 else _all_reduce(x, group, _site.get(), " (gradient)")


def _all_gather(x: torch.Tensor, axis: int, group: Any, site: Site | None,
                phase: str = "") -> torch.Tensor:
    x = x.contiguous()
    if x.is_meta:  # shapes only (a model traced on meta values): nothing to exchange
        return torch.cat([x] * group_size(group), dim=axis)
    _record("all_gather")
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    with _guard("all_gather" + phase, group, site):
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=axis)


def _check_divides(x: torch.Tensor, axis: int, group: Any, site: Site | None) -> int:
    """The group's size, after checking that it divides axis ``axis`` of ``x``."""
    size = group_size(group)
    if x.shape[axis] % size != 0:
        path, primitive = site if site is not None else (None, "scatter")
        raise CollectiveShapeError(
            f"cannot split axis {axis} of size {x.shape[axis]} into {size} equal slices, "
            "one per rank",
            path=path, primitive=primitive,
            values={"shape": tuple(x.shape), "axis": axis, "world_size": size},
            fix=f"make axis {axis} a multiple of {size} (e.g. a sequence length divisible by "
            f"{size} for sequence parallelism), or split another axis",
        )
    return size


def _split(x: torch.Tensor, axis: int, group: Any, site: Site | None) -> torch.Tensor:
    size = _check_divides(x, axis, group, site)
    return x.chunk(size, dim=axis)[group_rank(group)].contiguous()


#: torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor before, now deprecated)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter(x: torch.Tensor, axis: int, group: Any, site: Site | None,
                    phase: str = "") -> torch.Tensor:
    # reduce_scatter_tensor splits dim 0: move the axis there (rank r's slice of dim 0 is
    # then its slice of the axis), and back afterwards.
    size = _check_divides(x, axis, group, site)
    moved = x.movedim(axis, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    if x.is_meta:  # shapes only
        return out.movedim(0, axis).contiguous()
    _record("reduce_scatter")
    with _guard("reduce_scatter" + phase, group, site):
        _REDUCE_SCATTER(out, moved, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, axis).contiguous()


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any,
                site: Site | None, phase: str = "") -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    _record("all_to_all")
    with _guard("all_to_all" + phase, group, site):
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                               group=group)
    return out


_BACKWARD = " (backward)"


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group, _site.get())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.site = group, _site.get()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, ctx.site, _BACKWARD), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any, reduce_grad: bool) -> torch.Tensor:
        ctx.axis, ctx.group, ctx.reduce_grad, ctx.site = axis, group, reduce_grad, _site.get()
        return _all_gather(x, axis, group, ctx.site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return (_reduce_scatter(grad, ctx.axis, ctx.group, ctx.site, _BACKWARD),
                    None, None, None)
        return _split(grad, ctx.axis, ctx.group, ctx.site), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
        ctx.axis, ctx.group, ctx.site = axis, group, _site.get()
        return _reduce_scatter(x, axis, group, ctx.site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.axis, ctx.group, ctx.site, _BACKWARD), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
        ctx.axis, ctx.group, ctx.site = axis, group, _site.get()
        return _split(x, axis, group, ctx.site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.axis, ctx.group, ctx.site, _BACKWARD), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.site = send, recv, group, _site.get()
        return _all_to_all(x, send, recv, group, ctx.site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return (_all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.site, _BACKWARD),
                None, None, None)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int],
               group: Any = None) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group``: the first ``send[0]`` rows to rank 0, the
    next ``send[1]`` to rank 1, ...; the result holds ``recv[j]`` rows from each rank
    ``j``, in rank order (variable split sizes; each rank's ``recv`` is the others'
    ``send`` to it). The backward sends the gradients back the same way.

    >>> all_to_all(torch.ones(3, 2), [3], [3]).shape      # a world of one: identity
    torch.Size([3, 2])
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(send), list(recv), group)


def all_reduce(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``; the gradient passes through unchanged."""
    return x if group_size(group) == 1 else _AllReduce.apply(x, group)


def copy_to_group(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Identity forward; the gradient is summed over the ranks of ``group``."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def all_gather(x: torch.Tensor, axis: int, group: Any = None,
               tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``axis``.

    The backward reduce-scatters the gradient when the consumers of the gathered value
    differ per rank (``tensor_parallel_output_grad=True``, the usual case), or keeps this
    rank's slice when every rank computes the same gradient.
    """
    if group_size(group) == 1:
        return x
    return _AllGather.apply(x, axis, group, tensor_parallel_output_grad)


def reduce_scatter(x: torch.Tensor, axis: int, group: Any = None) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice along ``axis``; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, axis, group)


def scatter(x: torch.Tensor, axis: int, group: Any = None) -> torch.Tensor:
    """Keep this rank's slice of ``x`` along ``axis``; backward all-gathers."""
    return x if group_size(group) == 1 else _Scatter.apply(x, axis, group)
