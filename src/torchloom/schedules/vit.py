"""The built-in schedule of transformers ViT (``ViTForImageClassification``, ``ViTModel``)."""

from __future__ import annotations

from typing import Any

from ..core.errors import ModelSizeError
from ..core.schedule import Schedule
from ..runtime import collectives as C
from ._common import (
    SEQ_AXIS,
    check_tp_sizes,
    finish_layers,
    node_at,
    region,
    sp_final_norm,
    sp_norms,
    takes,
)
from .config import ScheduleConfig

__all__ = ["schedule_vit"]


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile")
def schedule_vit(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Megatron TP (and SP) over attention (q/k/v -> o_proj) and the MLP (fc1 -> fc2),
    then checkpoint the first ``ckpt_ratio`` of the layers.

    ViT attention reshapes with ``-1`` heads, so sharding the projections is enough.
    Sequence parallelism splits the patch sequence (class token included) between the
    layers; its length, ``(image_size // patch_size) ** 2 + 1``, must divide by the
    group size.
    """
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    base = "vit." if "vit" in sch.child else ""
    if sequence_parallel:
        _check_sequence_split(sch, base)
    if tp:  # before any primitive: a refusal changes nothing
        hf_config: Any = sch.mod.config  # a ViTConfig (typed Tensor | Module by nn.Module)
        check_tp_sizes(sch, "vit", [
            ("num_attention_heads", hf_config.num_attention_heads, f"{base}layers.*.attention",
             "whole attention heads"),
            ("intermediate_size", hf_config.intermediate_size, f"{base}layers.*.mlp",
             "an equal share of the MLP's features")])
        for layer in sch[f"{base}layers.*"]:
            region(node_at(layer, "attention"), ["q_proj", "k_proj", "v_proj"], "o_proj",
                   sequence_parallel)
            region(node_at(layer, "mlp"), ["fc1"], "fc2", sequence_parallel)
            if sequence_parallel:
                sp_norms([layer["layernorm_before"], layer["layernorm_after"]])
        if sequence_parallel:
            sch[f"{base}layers.0"].sync("fwd_pre", "scatter", axis=SEQ_AXIS)
            sp_final_norm(sch[f"{base}layernorm"])
    finish_layers(sch[f"{base}layers"], config)


def _check_sequence_split(sch: Schedule, base: str) -> None:
    config: Any = sch.mod.config  # a ViTConfig (typed Tensor | Module by nn.Module)
    size = config.image_size // config.patch_size
    tokens, world = size * size + 1, C.group_size(sch.group)
    if tokens % world:
        raise ModelSizeError(
            f"sequence parallelism splits ViT's {tokens} tokens ({size} x {size} patches "
            f"and the class token) between {world} ranks, and {world} does not divide them",
            path=f"{base}layers", primitive="schedules.schedule_vit",
            values={"image_size": config.image_size, "patch_size": config.patch_size,
                    "tokens": tokens, "world_size": world},
            fix="pick image_size and patch_size so that (image_size // patch_size) ** 2 + 1 "
            "divides by the group size, or apply_schedule(sch, tp=True) without "
            "sequence_parallel",
        )
