"""The device mesh of a :class:`~torchloom.parallel.layout.Layout`.

:func:`init_mesh` lays the default process group's ranks out as the layout says, on a
:class:`~torchloom.runtime.mesh.Mesh` with the dimensions ``pp``, ``dp_replicate``,
``dp_shard``, ``cp``, ``tp`` and the flattened ``dp`` and ``stage`` views. One rank: no
mesh (None). Every group a layout's pieces use comes from it (:func:`group_of`).

>>> import torch.distributed as dist
>>> from torch.testing._internal.distributed.fake_pg import FakeStore
>>> from torchloom.parallel.layout import Layout
>>> dist.init_process_group("fake", rank=6, world_size=8, store=FakeStore())
>>> mesh = init_mesh(Layout(pp=2, dp_replicate=2, tp=2, n_microbatches=2), "cpu")
>>> mesh.local_rank("pp"), mesh.local_rank("dp"), mesh.local_rank("tp")
(1, 1, 0)
>>> dist.destroy_process_group()
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..core.errors import LayoutError
from ..runtime.mesh import Mesh, make_mesh
from .layout import Layout

__all__ = ["PIECES", "checkpoint_group", "group_of", "init_mesh"]

PIECES = {"schedule": "tp", "pipeline": "pp", "data": "dp", "fsdp": "dp_shard",
          "context": "cp", "experts": "ep", "checkpoint": "model"}
"""Which mesh dimension each piece of a layout runs its collectives on: the schedule's
tensor-parallel syncs (and the vocabulary-parallel embedding and loss), the pipeline's
sends, the data-parallel gradient average and batch split, FSDP2's shards (with HSDP's
replicas), the context-parallel exchange of keys and values (its ranks also average
gradients with the data-parallel ones: the mesh's ``dp_cp`` view), the experts'
all-to-all dispatch (the ``ep`` groups of data-parallel ranks), the checkpoint written by one data-parallel replica (without FSDP2; with it
every rank writes: :func:`checkpoint_group`)."""


def init_mesh(layout: Layout | None = None, device_type: str | None = None, *,
              dp: int | None = None, tp: int | None = None,
              pp: int | None = None) -> Mesh | None:
    """The mesh of ``layout`` over the default process group (None for one rank without
    a group). Raises :class:`~torchloom.core.errors.LayoutError` when the layout's degrees
    do not multiply to the world size.

    ``init_mesh(dp=..., tp=..., pp=...)`` (the form before layouts) is
    ``init_mesh(Layout(dp_replicate=dp, tp=tp, pp=pp))``; it always returns a mesh, since
    a group must already be initialised."""
    if layout is None:
        from ..runtime.parallel import init_mesh as _degrees_mesh

        return _degrees_mesh(dp=dp or 1, tp=tp or 1, pp=pp or 1, device_type=device_type)
    if (dp, tp, pp) != (None, None, None):
        raise LayoutError("init_mesh was given a layout and degrees", primitive="init_mesh",
                          values={"dp": dp, "tp": tp, "pp": pp},
                          fix="give the degrees in the layout: Layout(dp_shard=..., tp=...)")
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    layout.check_world(world)
    if world == 1:
        return None
    return make_mesh(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
                     cp=layout.cp, tp=layout.tp, ep=layout.ep, device_type=device_type)


def group_of(mesh: Mesh | None, piece: str) -> Any:
    """The process group ``piece`` (a key of :data:`PIECES`) uses: None without a mesh or
    when its dimension has one rank."""
    if piece not in PIECES:
        raise LayoutError(f"no piece {piece!r}", primitive="group_of",
                          values={"piece": piece, "pieces": list(PIECES)},
                          fix=f"one of {', '.join(PIECES)}")
    if mesh is None or mesh.size(PIECES[piece]) == 1:
        return None
    return mesh.group(PIECES[piece])


def checkpoint_group(layout: Layout, mesh: Mesh | None) -> tuple[Any, bool]:
    """``(group, writes)``: the group this rank saves and loads a run's checkpoint with
    (:func:`torchloom.save` / :func:`torchloom.load`), and whether it writes.

    Without FSDP2 the data-parallel replicas hold the same tensors: the ranks of replica
    0 (its pipeline x tensor-parallel ranks, the mesh's ``model`` view; of context-parallel
    rank 0, since those ranks hold the same tensors too) write one checkpoint of the whole
    model, and every replica loads it over its own ``model`` group. With FSDP2 or HSDP each rank holds its own shards: every rank writes and
    loads, over the default group (None). One checkpoint for every layout, so a run
    resumes into another layout by loading it (resharded on load)."""
    if mesh is None:
        return None, True
    if layout.fsdp or layout.ep > 1:
        return None, True
    return mesh.group("model"), mesh.local_rank("dp") == 0 and mesh.local_rank("cp") == 0
