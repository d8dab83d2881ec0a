"""Where a module's output lives across tensor-parallel ranks, derived from its shards.

A placement is one of:

* ``Placement.replicate()``: every rank holds the whole value;
* ``Placement.shard(axis)``: each rank holds a slice along activation ``axis``;
* ``Placement.partial()``: each rank holds a summand; the value is their sum.

:func:`output_placement` reads the :class:`~torchloom.core.meta.ShardSpec` records on a
module's own parameters (they live on the tensors, so the answer survives ``replace``
and tracing) and applies the rule of the module's type:

==================  =========================  ==============================
module              sharded weight axis        output
==================  =========================  ==============================
``nn.Linear``       0 (out features)           shard(-1)  (column parallel)
``nn.Linear``       1 (in features)            partial    (row parallel)
HF ``Conv1D``       1 (out features)           shard(-1)
HF ``Conv1D``       0 (in features)            partial
``nn.Embedding``    1 (embedding dim)          shard(-1)
``nn.Embedding``    0 (vocabulary rows)        partial    (each rank looks up its rows)
``nn.Conv2d``       0 (out channels)           shard(1)
``nn.Conv2d``       1 (in channels)            partial
norms (BatchNorm)   0 (channels)               shard(1)
``nn.LayerNorm``    0 (normalized features)    shard(-1)
==================  =========================  ==============================

A module of another type, or one with no sharded parameter, has an unknown placement
(None): torchloom does not guess.

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
>>> sch = tl.create_schedule(model)
>>> sch["0"].shard("weight", 0)
>>> sch["1"].shard("weight", 1)
>>> output_placement(model[0]), output_placement(model[1])
(Placement(kind='shard', axis=-1), Placement(kind='partial', axis=None))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from .meta import shard_spec

__all__ = ["Placement", "output_placement"]


@dataclass(frozen=True)
class Placement:
    """Replicated, sharded along an activation axis, or a partial sum."""

    kind: Literal["replicate", "shard", "partial"]
    axis: int | None = None

    @staticmethod
    def replicate() -> Placement:
        return Placement("replicate")

    @staticmethod
    def shard(axis: int) -> Placement:
        return Placement("shard", axis)

    @staticmethod
    def partial() -> Placement:
        return Placement("partial")

    def __str__(self) -> str:
        return f"shard(axis={self.axis})" if self.kind == "shard" else self.kind


# module class name -> {weight axis: output placement}
_RULES: dict[str, dict[int, Placement]] = {
    "Linear": {0: Placement.shard(-1), 1: Placement.partial()},
    "Conv1D": {1: Placement.shard(-1), 0: Placement.partial()},
    "Embedding": {1: Placement.shard(-1), 0: Placement.partial()},
    "Conv2d": {0: Placement.shard(1), 1: Placement.partial()},
    "_BatchNorm": {0: Placement.shard(1)},
    "LayerNorm": {0: Placement.shard(-1)},
}


def output_placement(module: nn.Module) -> Placement | None:
    """The placement of ``module``'s output implied by its sharded weight, or None when
    the module's type has no rule or its weight is not sharded. A peft LoRA layer (its
    ``base_layer`` and adapters summed) has its base's placement."""
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module) and isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
        return output_placement(base)
    weight = module._parameters.get("weight")
    spec = shard_spec(weight) if weight is not None else None
    if spec is None:
        return None
    for cls in type(module).__mro__:
        rule = _RULES.get(cls.__name__)
        if rule is not None:
            return rule.get(spec.axis)
    return None
