"""The built-in schedule of transformers GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.refs import schedule_safe
from ..core.schedule import Schedule
from ..ops.attention import make_sdpa_gpt2_attention
from ..ops.fused import make_fused_gpt2_mlp
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

__all__ = ["schedule_gpt2", "split_qkv_per_rank"]


@schedule_safe
def split_qkv_per_rank(old: nn.Module) -> nn.Module:
    """GPT-2 attention splits ``c_attn``'s output into q, k, v of ``split_size`` each; after
    the ``chunks=3`` shard a rank's output is ``[q_r | k_r | v_r]``, a third of ``nf``."""
    attn: Any = old  # a GPT2Attention: attributes untyped by nn.Module
    attn.split_size = attn.c_attn.nf // 3
    return old


@takes("tp", "sequence_parallel", "ckpt_ratio", "attention", "fused", "compile")
def schedule_gpt2(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Kernels (``attention="sdpa"``: :class:`torchloom.ops.SDPAGPT2Attention`;
    ``fused``: the MLP's bias+GeLU and bias+dropout fused), Megatron TP (and SP) over
    attention and MLP, checkpoint the first ``ckpt_ratio`` of the blocks, then compile each
    block (``compile``)."""
    base = "transformer." if "transformer" in sch.child else ""
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    if tp:  # before any primitive: a refusal changes nothing
        hf_config: Any = sch.mod.config  # a GPT2Config (typed Tensor | Module by nn.Module)
        sizes = [("n_head", hf_config.n_head, f"{base}h.*.attn", "whole attention heads")]
        if hf_config.n_inner is not None:  # None: 4 * n_embd, which the heads check covers
            sizes.append(("n_inner", hf_config.n_inner, f"{base}h.*.mlp",
                          "an equal share of the MLP's features"))
        check_tp_sizes(sch, "gpt2", sizes)
    if config.attention == "sdpa":
        sch[f"{base}h.*.attn"].replace(make_sdpa_gpt2_attention)
    if config.fused:
        sch[f"{base}h.*.mlp"].replace(make_fused_gpt2_mlp)
    if tp:
        for block in sch[f"{base}h.*"]:
            region(node_at(block, "attn"), ["c_attn"], "c_proj", sequence_parallel, chunks=3)
            block["attn"].replace(split_qkv_per_rank)
            region(node_at(block, "mlp"), ["c_fc"], "c_proj", sequence_parallel)
            if sequence_parallel:
                sp_norms([block["ln_1"], block["ln_2"]])
        if sequence_parallel:
            sch[f"{base}drop"].sync("fwd_post", "scatter", axis=SEQ_AXIS)
            sp_final_norm(sch[f"{base}ln_f"])
    finish_layers(sch[f"{base}h"], config)
