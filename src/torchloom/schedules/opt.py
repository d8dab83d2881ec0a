"""The built-in schedule of transformers OPT (``OPTForCausalLM``, ``OPTModel``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.errors import ModelSizeError
from ..core.refs import schedule_safe
from ..core.schedule import Schedule
from ._common import check_tp_sizes, column, finish_layers, node_at, region, row, takes
from .config import ScheduleConfig

__all__ = ["heads_per_rank", "schedule_opt"]


@schedule_safe
def heads_per_rank(old: nn.Module) -> nn.Module:
    """OPT attention reshapes q, k, v with ``num_heads``; after the column shard a rank
    holds ``q_proj.out_features // head_dim`` of them."""
    attn: Any = old  # an OPTAttention: attributes untyped by nn.Module
    attn.num_heads = attn.q_proj.out_features // attn.head_dim
    attn.embed_dim = attn.num_heads * attn.head_dim
    return old


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile")
def schedule_opt(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Megatron TP over self-attention (q/k/v -> out_proj) and the MLP (fc1 -> fc2),
    then checkpoint the first ``ckpt_ratio`` of the decoder layers."""
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    base = "model.decoder" if "model" in sch.child else "decoder"
    if sequence_parallel:
        raise ModelSizeError(
            "OPT's decoder layer flattens (batch, sequence) into rows before fc1, so the "
            "MLP's input cannot be all-gathered along the sequence axis (gathered rows "
            "would be ordered by rank, not by position)",
            path=f"{base}.layers", primitive="schedules.schedule_opt",
            values={"sequence_parallel": True, "model": type(sch.mod).__name__},
            fix="apply_schedule(sch, tp=True) without sequence_parallel",
        )
    if tp:
        hf_config: Any = sch.mod.config  # checked before any primitive: a refusal changes nothing
        check_tp_sizes(sch, "opt", [
            ("num_attention_heads", hf_config.num_attention_heads, f"{base}.layers.*.self_attn",
             "whole attention heads"),
            ("ffn_dim", hf_config.ffn_dim, f"{base}.layers.*.fc1",
             "an equal share of the MLP's features")])
        for layer in sch[f"{base}.layers.*"]:
            region(node_at(layer, "self_attn"), ["q_proj", "k_proj", "v_proj"], "out_proj",
                   False, input_name="hidden_states")
            layer["self_attn"].replace(heads_per_rank)
            # fc1 and fc2 sit directly in the layer, so the MLP's syncs go on them
            column(node_at(layer, "fc1"))
            layer["fc1"].sync("bwd_post", "all_reduce")
            row(node_at(layer, "fc2"))
            layer["fc2"].sync("fwd_post", "all_reduce")
    finish_layers(sch[f"{base}.layers"], config)
