"""The built-in schedule of transformers T5 (``T5ForConditionalGeneration``, ``T5Model``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.errors import ModelSizeError
from ..core.refs import schedule_safe
from ..core.schedule import Schedule
from ._common import check_tp_sizes, column, finish_layers, node_at, region, row, takes
from .config import ScheduleConfig

__all__ = ["heads_per_rank", "schedule_t5"]


@schedule_safe
def heads_per_rank(old: nn.Module) -> nn.Module:
    """T5 attention builds the zero position bias of layers without a relative bias from
    ``n_heads``; after the column shard a rank holds ``q.out_features // d_kv`` heads."""
    attn: Any = old  # a T5Attention: attributes untyped by nn.Module
    attn.n_heads = attn.q.out_features // attn.key_value_proj_dim
    attn.inner_dim = attn.q.out_features
    return old


def _attention(attn: Schedule, input_name: str | None = None) -> None:
    """q, k, v column parallel and o row parallel: each rank keeps whole heads."""
    for name in ("q", "k", "v"):
        column(node_at(attn, name))
    row(node_at(attn, "o"))
    if "relative_attention_bias" in attn.child:  # one column per head
        attn["relative_attention_bias"].shard("weight", 1)
    attn.replace(heads_per_rank)


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile")
def schedule_t5(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Megatron TP over self-attention, cross-attention (q/k/v -> o) and the feed-forward
    block (wi or wi_0/wi_1 -> wo) of the encoder and decoder blocks, then checkpoint the
    first ``ckpt_ratio`` of each stack's blocks."""
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    stacks = [name for name in ("encoder", "decoder") if name in sch.child]
    if sequence_parallel:
        raise ModelSizeError(
            "T5 derives its relative position bias and attention masks from the sequence "
            "length the first block sees, so the blocks cannot run on sequence slices",
            path=f"{stacks[0]}.block", primitive="schedules.schedule_t5",
            values={"sequence_parallel": True, "model": type(sch.mod).__name__},
            fix="apply_schedule(sch, tp=True) without sequence_parallel",
        )
    if tp:
        hf_config: Any = sch.mod.config  # checked before any primitive: a refusal changes nothing
        check_tp_sizes(sch, "t5", [
            ("num_heads", hf_config.num_heads, f"{stacks[0]}.block.*.layer.0.SelfAttention",
             "whole attention heads"),
            ("d_ff", hf_config.d_ff, f"{stacks[0]}.block.*.layer.*.DenseReluDense",
             "an equal share of the feed-forward features")])
        for stack in stacks:
            for block in sch[f"{stack}.block.*"]:
                layers = node_at(block, "layer")
                self_attn = node_at(layers, "0.SelfAttention")
                _attention(self_attn)
                self_attn.sync("bwd_post", "all_reduce")
                self_attn["o"].sync("fwd_post", "all_reduce")
                if "EncDecAttention" in layers["1"].child:
                    # queries come from the decoder, keys and values from the encoder:
                    # both inputs' gradients are partial sums
                    cross = node_at(layers, "1.EncDecAttention")
                    _attention(cross)
                    cross.sync("bwd_post", "all_reduce")
                    cross.sync("bwd_post", "all_reduce", input_name="key_value_states")
                    cross["o"].sync("fwd_post", "all_reduce")
                ff = node_at(layers, f"{len(layers.child) - 1}.DenseReluDense")
                wi = ["wi_0", "wi_1"] if "wi_0" in ff.child else ["wi"]
                region(ff, wi, "wo", False)
    for stack in stacks:
        finish_layers(sch[f"{stack}.block"], config)
