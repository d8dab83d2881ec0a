"""The ranks of a save or load (part of :mod:`torchloom.runtime.state`): the collectives
over its ``group`` (rank 0 decides and every rank learns it; an error found on any rank
is raised on all) and the check that the group fits the model's layout.

Who calls with which group:

* tensor parallelism, with or without DDP: the ranks of one tensor-parallel group, with
  ``group=sch.group`` (for a save, those of data-parallel rank 0: the replicas hold the
  same tensors);
* FSDP2 or HSDP (``DTensor`` parameters sharded over the data-parallel ranks), alone or
  with tensor parallelism: every rank of the pipeline stage, with ``group`` the process
  group of them all (data- x tensor-parallel ranks; None when they are the whole world);
* a pipeline into one checkpoint: every rank of the pipeline, ``group`` over them all.

Any group that holds whole tensor-parallel groups works (every rank of a DDP job, say):
pieces that several ranks hold are written once. The ranks of a DTensor's mesh must all
be in the group, so a save cannot miss a data-parallel shard:

>>> _group_ranks(None)      # no process group: this process alone
[0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import CheckpointIOError, CheckpointMismatchError, ScheduleError
from ..core.meta import shard_spec
from .collectives import group_rank, group_size, guard_collective
from .gather import check_spec, is_dtensor
from .state_dcp import GROUP_FIX


def _share(value: Any, group: Any, primitive: str) -> Any:
    """``value`` of the group's rank 0, on every rank."""
    if group_size(group) == 1:
        return value
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with guard_collective("broadcast_object_list", primitive, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _gather_all(value: Any, group: Any, primitive: str) -> list[Any]:
    if group_size(group) == 1:
        return [value]
    out: list[Any] = [None] * group_size(group)
    with guard_collective("all_gather_object", primitive, group):
        dist.all_gather_object(out, value, group=group)
    return out


def _on_rank0(fn: Callable[[], Any], group: Any, primitive: str) -> Any:
    """Run ``fn`` on the group's rank 0 and give every rank its result; an exception there
    is raised on every rank (the same CheckpointIOError, or one naming it)."""
    if group_size(group) == 1:
        return fn()
    result: Any = None
    error: Exception | None = None
    if group_rank(group) == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, re-raised
            error = exc
    shared = _share((result, error if isinstance(error, ScheduleError) else
                     None if error is None else f"{type(error).__name__}: {error}"),
                    group, primitive)
    if error is not None:
        raise error
    result, remote = shared
    if isinstance(remote, ScheduleError):
        raise remote
    if remote is not None:
        raise CheckpointIOError(f"rank 0 of the group failed: {remote}", primitive=primitive,
                                values={"rank": group_rank(group)},
                                fix="see rank 0's error; fix its cause and run again")
    return result


def _agree(payload: Any, error: ScheduleError | None, group: Any, primitive: str
           ) -> list[Any]:
    """Every rank's ``payload``, on every rank (one ``all_gather_object``); if any rank
    found an ``error`` (ranks of different pipeline stages check different tensors), every
    rank raises: its own error, else the first failing rank's (before DCP's collectives,
    which the other ranks would wait in until the timeout)."""
    rows = _gather_all((error, payload), group, primitive)
    if error is not None:
        raise error
    for remote, _ in rows:
        if remote is not None:
            raise remote
    return [p for _, p in rows]


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group; no process group: [0])."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def check_layout(key: str, tensor: torch.Tensor, group: Any, ranks: set[int],
                 primitive: str) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``group`` (of global ``ranks``) can
    save or load ``tensor``: its shard spec is for a rank of it (or the group holds whole
    tensor-parallel groups) and, for a DTensor, every rank of its mesh is in it."""
    spec = shard_spec(tensor)
    if spec is not None:
        check_spec(key, spec, group, primitive, within=True)
    if not is_dtensor(tensor):
        return
    mesh = [int(r) for r in tensor.device_mesh.mesh.flatten().tolist()]  # type: ignore[attr-defined]
    outside = sorted(set(mesh) - ranks)
    if outside:
        placements = ", ".join(repr(p) for p in tensor.placements)  # type: ignore[attr-defined]
        raise CheckpointMismatchError(
            f"{key!r} is a DTensor sharded over ranks {mesh[:16]} ({placements}); ranks "
            f"{outside[:16]} of them are not in the group of this {primitive}",
            primitive=primitive,
            values={"key": key, "mesh_ranks": mesh[:16], "group_ranks": sorted(ranks)[:16]},
            fix=GROUP_FIX)
