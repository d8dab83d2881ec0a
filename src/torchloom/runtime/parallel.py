"""Device meshes and data-parallel wrapping (the last step of ``build``).

A run with several kinds of parallelism lays its ranks out on a mesh of named dimensions
(:mod:`torchloom.runtime.mesh`): :func:`init_mesh` makes it for ``pp`` x ``dp`` x ``tp``,
the schedule takes the tensor-parallel group (``create_schedule(model,
group=mesh["tp"].get_group())``) and ``build`` wraps the model for data parallelism on the
``"dp"`` dimension:

* ``target="ddp"``: :class:`torch.nn.parallel.DistributedDataParallel` on the dp group:
  gradients are averaged across the dp ranks after backward;
* ``target="fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``, the ZeRO-3
  analogue): each transformer layer (every item of each stack of layers,
  :func:`~torchloom.core.rules.layer_stacks`, or the paths given) and then the root is sharded over the dp ranks; parameters become ``DTensor``
  shards, gathered for compute and re-sharded after use; gradients are reduce-scattered.

Tensor-parallel shards compose with both: a dp group's ranks hold the same tensor-parallel
slice, so averaging (or FSDP-sharding) over dp leaves the tp layout intact. torchloom's
tensor metadata (shard specs, tags) is carried over to the parameters FSDP2 creates.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2))
>>> wrap_data_parallel(model, None, None) is model   # no target: nothing to do
True
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch.distributed as dist
from torch import nn

from ..core.errors import BuildError
from ..core.meta import copy_meta
from ..core.rules import layer_stacks
from .mesh import DIMS, Mesh, make_mesh

__all__ = ["MESH_DIMS", "init_mesh", "wrap_data_parallel", "DP_TARGETS"]

MESH_DIMS = DIMS
DP_TARGETS = ("ddp", "fsdp")


def init_mesh(dp: int = 1, tp: int = 1, pp: int = 1, device_type: str | None = None) -> Mesh:
    """The :class:`~torchloom.runtime.mesh.Mesh` of ``pp`` stages, ``dp`` data-parallel
    replicas and ``tp`` tensor-parallel ranks over the default process group (which must
    already be initialised, e.g. by ``torchrun``): :func:`~torchloom.runtime.mesh.make_mesh`
    with ``dp_replicate=dp``. ``mesh["tp"]``, ``mesh["dp"]`` and ``mesh["pp"]`` are its
    1-D meshes. Ranks are laid out tp-fastest: ranks ``0..tp-1`` form the first
    tensor-parallel group. ``device_type`` None: the device of the group's backend.
    For HSDP, context or expert parallelism, describe the run with a
    :class:`torchloom.Layout` and use :func:`torchloom.parallel.init_mesh`.
    """
    return make_mesh(pp=pp, dp_replicate=dp, tp=tp, device_type=device_type)


def _dp_mesh(mesh: Any) -> Any:
    """What FSDP2 shards over and DDP averages over: a :class:`Mesh`'s data-parallel
    view (HSDP's 2-D mesh for FSDP2 when it has one), or a 1-D mesh as given."""
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        return mesh
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["dp"] if "dp" in names and len(names) > 1 else mesh


def _default_units(model: nn.Module) -> list[str]:
    """Every layer of the model's stacks (:func:`~torchloom.core.rules.layer_stacks`)."""
    units = []
    for name in layer_stacks(model):
        stack = model.get_submodule(name) if name else model
        if isinstance(stack, (nn.ModuleList, nn.Sequential)):  # what layer_stacks finds
            units += [f"{name}.{i}" if name else str(i) for i in range(len(stack))]
    return units


def fully_shard_model(model: nn.Module, mesh: Any, units: list[str] | None = None,
                      mp_policy: Any = None,
                      ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` of each unit (default: every layer of the model's layer lists)
    and of the root, on ``mesh`` (the data-parallel mesh), with ``mp_policy`` if given;
    the torchloom metadata of each parameter (its shard spec)
    carries over. ``ignored``: parameters FSDP2 leaves whole and unreduced (the experts of
    expert parallelism, each rank its own)."""
    from torch.distributed.fsdp import fully_shard

    before = dict(model.named_parameters())
    names = [n for n, _ in model.named_modules() if n]
    patterns = units if units is not None else _default_units(model)
    chosen = []
    for pattern in patterns:
        found = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not found:
            raise BuildError(
                f"the FSDP unit {pattern!r} matches no module",
                primitive="build", values={"fsdp_units": patterns},
                fix="give module paths (wildcards allowed), e.g. fsdp_units=['transformer.h.*']",
            )
        chosen += [n for n in found if n not in chosen]
    if isinstance(mesh, Mesh):
        mesh = mesh.fsdp_mesh
    kwargs: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if ignored:
        kwargs["ignored_params"] = ignored
    for name in chosen:
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    for name, param in model.named_parameters():
        if name in before:
            copy_meta(before[name], param)
    return model


def wrap_data_parallel(model: nn.Module, target: str | None, mesh: Any,
                       fsdp_units: list[str] | None = None) -> nn.Module:
    """Wrap ``model`` for ``target`` (``"ddp"``, ``"fsdp"`` or None) on the dp dimension of
    ``mesh`` (None: every rank of the default group is a data-parallel rank)."""
    if target is None:
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise BuildError(
            f"target {target!r} needs an initialised process group",
            primitive="build", values={"target": target},
            fix="start with torchrun (or torch.distributed.init_process_group) first, or "
            "build with target=None for one process",
        )
    dp_mesh = _dp_mesh(mesh)
    if target == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        group = (dp_mesh.group(dp_mesh.grad_view) if isinstance(dp_mesh, Mesh) else
                 dp_mesh.get_group() if dp_mesh is not None else None)
        # find_unused_parameters: a parameter that gets no gradient in a step (a vision
        # tower on a text batch, an expert no token was routed to) would otherwise stop DDP
        # from reducing the buckets after it, leaving each rank's own gradients there
        return DistributedDataParallel(model, process_group=group, find_unused_parameters=True)
    return fully_shard_model(model, dp_mesh, fsdp_units)
