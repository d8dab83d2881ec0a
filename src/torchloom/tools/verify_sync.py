"""How :class:`~torchloom.tools.verify.Verify` gives every rank the same starting point:
broadcasts from a group's first rank, and the weights of an expert-parallel model taken
from its reference (each rank's experts sliced from the full ones).

>>> import torch
>>> from torch import nn
>>> model, reference = nn.Linear(2, 2), nn.Linear(2, 2)
>>> align_experts(model, reference, group=None, param_map={}, path="") is None  # no group: nothing
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.meta import shard_spec
from ..runtime import collectives as C


def broadcast_in(group: Any, tensors: list[torch.Tensor], path: str) -> None:
    """Broadcast ``tensors`` in place from rank 0 of ``group`` (the default group if None)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with C.guard_collective("broadcast", "Verify", group, path=path):
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=group)


def align_experts(model: nn.Module, reference: nn.Module, group: Any,
                  param_map: dict[str, str], path: str) -> None:
    """Start every expert-parallel rank of ``group`` from the group's rank 0's weights:
    the reference's are broadcast, each rank's experts (tensors split over ``group``) are
    sliced from them, and the rest of ``model`` is broadcast. ``param_map`` maps a name in
    ``model`` to its name in ``reference`` where they differ. Without a group (one
    process, no expert parallelism) nothing changes."""
    if group is None:
        return None
    with torch.no_grad():
        broadcast_in(group, [t.data for t in (*reference.parameters(), *reference.buffers())],
                     path)
        full: dict[str, torch.Tensor] = dict(reference.named_parameters(remove_duplicate=False))
        full.update(dict(reference.named_buffers(remove_duplicate=False)))
        rest = []
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            spec = shard_spec(tensor)
            source = full.get(param_map.get(name, name))
            if spec is not None and spec.group is not None and source is not None \
                    and tuple(source.shape) == tuple(spec.full_shape):
                tensor.data.copy_(spec.slice(source))
            else:
                rest.append(tensor.data)
        broadcast_in(group, rest, path)
    return None
