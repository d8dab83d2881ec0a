"""Full state dicts of scheduled (tensor-parallel) models.

:func:`full_state_dict` gathers every sharded tensor back to the original model's keys,
key order and full shapes, so the result loads with ``load_state_dict(strict=True)`` into
a fresh copy of the unscheduled model; :func:`full_optimizer_state_dict` does the same for
the optimizer state. Both are collectives over the group the model was scheduled with.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import CheckpointMismatchError
from ..core.meta import ShardSpec, shard_spec
from .collectives import group_rank, group_size, guard_collective

__all__ = ["CheckpointMismatchError", "full_optimizer_state_dict", "full_state_dict"]


def check_spec(key: str, spec: ShardSpec, group: Any, primitive: str, *,
               within: bool = False) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``spec`` is a slice for this rank of
    ``group`` (its world size and rank) of an axis that splits evenly. ``within``: the
    group may also be a multiple of the tensor-parallel group (every rank of a pipeline
    stage, data-parallel ranks included, as a save of an FSDP model calls it); the rank
    cannot be checked then (DCP checks that the pieces make up each tensor). A spec with
    a group of its own (the experts' weights) is checked against that group."""
    if spec.group is not None and not within:
        group = spec.group
    size, rank = group_size(group), group_rank(group)
    stage = within and size % spec.world_size == 0 and (
        size > spec.world_size or spec.group is not None)
    if not stage and (spec.world_size != size or spec.rank != rank):
        raise CheckpointMismatchError(
            f"{key!r} was sharded for rank {spec.rank} of {spec.world_size}, but this is "
            f"rank {rank} of a group of {size}",
            primitive=primitive,
            values={"key": key, "spec_world_size": spec.world_size, "spec_rank": spec.rank,
                    "group_size": size, "group_rank": rank},
            fix="call it on every rank of the group the model was scheduled with: "
            f"{primitive}(model, ..., group=sch.group)",
        )
    full = spec.full_shape[spec.axis]
    if full % (spec.pieces * spec.chunks) != 0:
        raise CheckpointMismatchError(
            f"axis {spec.axis} of {key!r} (size {full}) does not split into {spec.chunks} "
            f"block(s) of {spec.pieces} equal pieces",
            primitive=primitive,
            values={"key": key, "full_shape": spec.full_shape, "axis": spec.axis,
                    "chunks": spec.chunks, "world_size": spec.world_size},
            fix=f"use a world size that divides {full // spec.chunks}",
        )


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter or
    its optimizer state).

    >>> is_dtensor(torch.zeros(2))
    False
    """
    if not isinstance(tensor, torch.Tensor) or type(tensor) is torch.Tensor \
            or type(tensor) is nn.Parameter:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def gather_full(key: str, tensor: torch.Tensor, spec: ShardSpec | None, group: Any,
                primitive: str) -> torch.Tensor:
    """The full tensor of ``tensor``: the shards of a DTensor (FSDP2, HSDP) gathered over
    its mesh, then the tensor-parallel pieces of ``spec`` (its shard spec, or None) over
    ``group``; a collective over both (every data-parallel rank calls it too)."""
    local = tensor.detach()
    if is_dtensor(local):
        with torch.no_grad(), guard_collective("DTensor.full_tensor", primitive):
            local = local.full_tensor()  # type: ignore[attr-defined]
    if spec is None:
        return local
    return gather_shards(key, local, spec, group, primitive)


def gather_shards(key: str, tensor: torch.Tensor, spec: ShardSpec, group: Any,
                  primitive: str) -> torch.Tensor:
    """The full tensor of this rank's tensor-parallel piece ``tensor`` (shard spec
    ``spec``): the pieces of every rank of ``group`` (of the spec's own group when it has
    one) gathered (a collective)."""
    if spec.group is not None:
        group = spec.group
    check_spec(key, spec, group, primitive)
    local = tensor.detach()
    if spec.world_size == 1:
        return spec.gather([local])
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(spec.world_size)]
    with guard_collective("all_gather", primitive, group):
        dist.all_gather(parts, local, group=group)
    return spec.gather(parts)


def full_state_dict(model: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """The state dict of the original (unscheduled) model: every sharded tensor gathered to
    its full shape under the original key, in the original key order.

    A collective: every rank of ``group`` calls it and gets the whole result; with FSDP2
    or HSDP (``DTensor`` parameters) every rank of the data-parallel mesh calls it too,
    each with its tensor-parallel ``group``. Unsharded
    tensors are returned detached, as ``state_dict()`` returns them; tied weights appear
    under each of their keys (gathered once). The result loads with
    ``load_state_dict(strict=True)`` into a fresh copy of the original model. The keys are
    those of the scheduled model's ``state_dict()``, which are the original's as long as
    every ``replace`` keeps the parameter names (a module swapped for one with other
    parameter names changes them). Cost: one ``all_gather`` per sharded tensor; every rank
    ends up holding the full model.

    >>> import torch, torchloom as tl
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    >>> sch = tl.create_schedule(model)
    >>> sch["0"].shard("weight", 0)
    >>> sd = full_state_dict(model)
    >>> list(sd), tuple(sd["0.weight"].shape)
    (['0.weight', '0.bias'], (6, 4))
    """
    whole = getattr(type(model), "full_state_dict", None)  # a PipelineModel's method
    if callable(whole):  # gathered over the pipeline ranks too
        return whole(model, group)
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if shard_spec(tensor) is None and not is_dtensor(tensor):
            out[key] = tensor.detach()
            continue
        if id(tensor) not in gathered:
            gathered[id(tensor)] = gather_full(key, tensor, shard_spec(tensor), group,
                                               "full_state_dict")
        out[key] = gathered[id(tensor)]
    return out


def _param_names(model: nn.Module) -> dict[int, str]:
    """The first name of every parameter (tied parameters once)."""
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer,
                      primitive: str) -> list[list[tuple[str, torch.Tensor]]]:
    names = _param_names(model)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        entries = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointMismatchError(
                    f"param_groups[{g}] of the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model",
                    primitive=primitive,
                    values={"group": g, "shape": tuple(p.shape)},
                    fix="make the optimizer from this model's parameters after build: "
                    "model, optimizer = tl.build(sch, optimizer=lambda ps: AdamW(ps))",
                )
            entries.append((names[id(p)], p))
        groups.append(entries)
    return groups


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              group: Any = None) -> dict[str, dict[str, Any]]:
    """The optimizer state by parameter name, with the state of sharded parameters gathered
    to full shape (a collective, like :func:`full_state_dict`: with FSDP2 or HSDP every
    rank calls it). Of a pipeline, the state of this rank's stages.

    >>> import torch
    >>> m = torch.nn.Linear(2, 1, bias=False)
    >>> opt = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5)
    >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> full_optimizer_state_dict(m, opt)["weight"]["momentum_buffer"].tolist()
    [[1.0, 1.0]]
    """
    out: dict[str, dict[str, Any]] = {}
    for entries in _optimizer_params(model, optimizer, "full_optimizer_state_dict"):
        for name, p in entries:
            spec = shard_spec(p)
            state = {}
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    pass
                elif spec is not None and value.shape == p.shape:  # its parameter's slice
                    value = gather_full(f"{name}.{key}", value, spec, group,
                                        "full_optimizer_state_dict")
                elif is_dtensor(value):
                    value = gather_full(f"{name}.{key}", value, None, group,
                                        "full_optimizer_state_dict")
                state[key] = value
            out[name] = state
    return out
