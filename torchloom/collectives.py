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
=================  ===========================  ==================================

>>> import torch
>>> x = torch.ones(2, 4, requires_grad=True)
>>> all_gather(x, axis=1).shape      # a world of one: identity
torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "all_reduce_raw", "copy_to_group", "all_gather", "reduce_scatter",
           "scatter", "group_size", "group_rank", "count_collectives"]


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


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous().clone()
    _record("all_reduce")
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_raw(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``x`` over ``group`` as a new tensor, outside autograd (for gradient hooks)."""
    return x if group_size(group) == 1 else _all_reduce(x, group)


def _all_gather(x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
    x = x.contiguous()
    _record("all_gather")
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=axis)


def _split(x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[axis] % size != 0:
        raise ValueError(
            f"cannot split axis {axis} of size {x.shape[axis]} into {size} equal slices"
        )
    return x.chunk(size, dim=axis)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
    # all-reduce then slice: gloo has no reduce-scatter; NCCL users lose a little bandwidth.
    return _split(_all_reduce(x, group), axis, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any, reduce_grad: bool) -> torch.Tensor:
        ctx.axis, ctx.group, ctx.reduce_grad = axis, group, reduce_grad
        return _all_gather(x, axis, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.axis, ctx.group), None, None, None
        return _split(grad, ctx.axis, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
        ctx.axis, ctx.group = axis, group
        return _reduce_scatter(x, axis, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.axis, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: int, group: Any) -> torch.Tensor:
        ctx.axis, ctx.group = axis, group
        return _split(x, axis, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.axis, ctx.group), None, None


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
