"""``shard(param_name, axis)``: keep only this rank's slice of a parameter or buffer.

The tensor is split into ``world_size`` equal slices along ``axis`` and this rank keeps
slice ``rank``. The full shape, axis, rank and world size are recorded as a
:class:`~torchloom.core.meta.ShardSpec` *on the new tensor*, so the record survives
``replace``, tracing and ``build``. Every slot that held the old parameter (tied weights)
receives the new one, so ties are kept. Module attributes that describe the shape are
updated (``Linear.in_features`` / ``out_features``, ``Embedding.num_embeddings`` /
``embedding_dim``, transformers ``Conv1D.nx`` / ``nf``, ``Conv2d.out_channels`` /
``in_channels``, ``BatchNorm.num_features``, ``LayerNorm.normalized_shape``). With a
world of one (no ``torch.distributed``) the slice is the whole tensor and only the record
is added.
Meta tensors (delayed init) are sliced without allocating.

Preconditions:
    * ``param_name`` names a parameter or buffer of this node's module;
    * ``-ndim <= axis < ndim``;
    * the tensor was not sharded before (shard each tensor once);
    * the tensor is not tied to another module, or ``tied=True``;
    * ``size[axis]`` is divisible by the world size.

A tensor *tied* to other modules (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) is one tensor: slicing it for one module slices it for all.
``shard`` therefore refuses it, naming the other paths, unless ``tied=True`` is given;
then every slot receives the same slice (and its module's size attributes are updated),
the layout Megatron-LM uses for a tied embedding and output head (one vocab-parallel
table, axis 0), and the recipe line records ``tied=True``. ``tied=True`` on an untied
tensor is accepted (a recipe can serve a tied and an untied config).

``chunks=k`` treats the axis as ``k`` equal blocks split separately, so a fused q/k/v
projection keeps ``[q_r | k_r | v_r]`` on rank r (its heads of each); the spec records
it and ``build`` / state-dict gathering honour it.

Before / after (a world of one):

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 6))
>>> sch = tl.create_schedule(model)
>>> sch["0"].shard("weight", 0)
>>> tl.shard_spec(model[0].weight)
ShardSpec(axis=0, full_shape=(6, 4), world_size=1, rank=0, chunks=1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..core.errors import (
    ShardArgumentError,
    ShardAxisError,
    ShardSizeError,
    ShardTiedError,
    ShardTwiceError,
)
from ..core.meta import ShardSpec, copy_meta, get_meta, shard_spec
from ..core.registry import primitive
from ._common import find_tensor, owners_of, tied_names

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "shard"

# (module attribute that holds the size of `axis` of `weight`) per module type name.
# module class name -> {weight axis: the attribute that holds that axis's size}; a tuple
# attribute (LayerNorm's normalized_shape) holds the sizes of all the weight's axes.
_SIZE_ATTRS: dict[str, dict[int, str]] = {
    "Linear": {0: "out_features", 1: "in_features"},
    "Embedding": {0: "num_embeddings", 1: "embedding_dim"},
    "Conv1D": {0: "nx", 1: "nf"},  # transformers GPT-2 Conv1D keeps weight as (in, out)
    "_ConvNd": {0: "out_channels", 1: "in_channels"},  # weight is (out, in/groups, ...)
    "_NormBase": {0: "num_features"},  # BatchNorm*, InstanceNorm*
    "LayerNorm": {0: "normalized_shape", 1: "normalized_shape", 2: "normalized_shape"},
    "GroupNorm": {0: "num_channels"},
}


def _update_module_attrs(module: nn.Module, attr: str, axis: int, world_size: int) -> None:
    if attr != "weight":
        return
    for cls in type(module).__mro__:
        rule = _SIZE_ATTRS.get(cls.__name__)
        if rule is None:
            continue
        name = rule.get(axis)
        if name is None:
            return
        value = getattr(module, name, None)
        if isinstance(value, int):
            setattr(module, name, value // world_size)
        elif isinstance(value, tuple) and value and isinstance(value[-1], int):
            # LayerNorm's normalized_shape: the weight covers its trailing dimensions
            offset = len(value) - cast(torch.Tensor, module.weight).dim()
            sizes = list(value)
            sizes[offset + axis] //= world_size
            setattr(module, name, tuple(sizes))
        return


def _check_tie(sch: Schedule, param_name: str, axis: int, owner: nn.Module, attr: str,
               tensor: torch.Tensor, tied: bool) -> None:
    if not isinstance(tied, bool):
        raise ShardArgumentError(
            f"tied must be True or False, not {tied!r}",
            path=sch.path, primitive=NAME, values={"param_name": param_name, "tied": tied},
            fix=f"sch[{sch.path!r}].shard({param_name!r}, {axis!r}, tied=True)",
        )
    others = [name for module, slot, name in tied_names(sch.root.mod, tensor)
              if not (module is owner and slot == attr)]
    if others and not tied:
        raise ShardTiedError(
            f"{param_name!r} is tied to {', '.join(repr(o) for o in others)} (one tensor used "
            "in both places): sharding it here would shard it there too",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "axis": axis, "tied_to": others},
            fix="shard every use of the tied tensor alike (Megatron's tied embedding and "
            "head: one vocab-parallel table): "
            f"sch[{sch.path!r}].shard({param_name!r}, {axis!r}, tied=True); or build the "
            "model untied (transformers: config.tie_word_embeddings = False)",
        )


@primitive(NAME, errors=(ShardArgumentError, ShardAxisError, ShardSizeError, ShardTiedError,
                         ShardTwiceError))
def apply(sch: Schedule, param_name: str, axis: int, chunks: int = 1, *,
          tied: bool = False) -> None:
    """Slice ``param_name`` of ``sch.mod`` along ``axis`` for this rank (each of ``chunks``
    equal blocks separately); a tensor tied to other modules only with ``tied=True``."""
    owner, attr, tensor, is_param = find_tensor(sch, param_name, NAME)
    ndim = tensor.dim()
    if not isinstance(axis, int) or not -ndim <= axis < max(ndim, 1):
        raise ShardAxisError(
            f"axis {axis!r} is out of range for {param_name!r} of shape {tuple(tensor.shape)}",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "axis": axis, "shape": tuple(tensor.shape)},
            fix=f"use an axis in [0, {ndim}): sch[{sch.path!r}].shard({param_name!r}, 0)",
        )
    axis %= ndim
    previous = shard_spec(tensor)
    if previous is not None:
        raise ShardTwiceError(
            f"{param_name!r} is already sharded (along axis {previous.axis})",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "axis": axis, "previous_axis": previous.axis,
                    "full_shape": previous.full_shape},
            fix="shard each tensor once; for a different layout, rebuild the schedule "
            "from a fresh model",
        )
    _check_tie(sch, param_name, axis, owner, attr, tensor, tied)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ShardArgumentError(
            f"chunks must be a positive integer, not {chunks!r}",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "chunks": chunks},
            fix="chunks=3 for a fused q/k/v projection, 1 (the default) otherwise",
        )
    world_size, rank = sch.world_size, sch.rank
    size = tensor.shape[axis]
    if size % (world_size * chunks) != 0:
        if chunks > 1:
            raise ShardSizeError(
                f"size {size} of axis {axis} of {param_name!r} does not split into {chunks} "
                f"blocks of a multiple of the world size {world_size}",
                path=sch.path,
                primitive=NAME,
                values={"param_name": param_name, "axis": axis, "shape": tuple(tensor.shape),
                        "chunks": chunks, "world_size": world_size},
                fix=f"check chunks (3 for q/k/v); each block needs a size divisible by {world_size}",
            )
        raise ShardSizeError(
            f"size {size} of axis {axis} of {param_name!r} is not divisible by the world "
            f"size {world_size}",
            path=sch.path,
            primitive=NAME,
            values={"param_name": param_name, "axis": axis, "shape": tuple(tensor.shape),
                    "world_size": world_size},
            fix="pick an axis whose size divides evenly, pad the tensor (e.g. the vocabulary "
            f"to a multiple of {world_size}), or use a world size that divides {size}",
        )
    spec = ShardSpec(axis=axis, full_shape=tuple(tensor.shape), world_size=world_size,
                     rank=rank, chunks=chunks)
    with torch.no_grad():
        piece = spec.slice(tensor.detach()).clone()
    new: torch.Tensor
    if is_param:
        new = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    else:
        new = piece
    copy_meta(tensor, new)
    get_meta(new).shard = spec
    slots = owners_of(sch.root.mod, tensor) or [(owner, attr, is_param)]
    for module, slot_attr, slot_is_param in slots:
        if slot_is_param:
            module._parameters[slot_attr] = cast(nn.Parameter, new)  # as is_param
        else:
            module._buffers[slot_attr] = new
        _update_module_attrs(module, slot_attr, axis, world_size)
