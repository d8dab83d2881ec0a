"""The built-in schedule of transformers BERT (``BertForMaskedLM``, ``BertModel``, ...)."""

from __future__ import annotations

from typing import Any

from ..core.schedule import Schedule
from ..ops.attention import make_sdpa_bert_self_attention
from ..ops.fused import make_fused_bert_intermediate, make_fused_bert_output
from ._common import (
    SEQ_AXIS,
    check_tp_sizes,
    column,
    finish_layers,
    node_at,
    row,
    sp_norms,
    takes,
)
from .config import ScheduleConfig

__all__ = ["schedule_bert"]


@takes("tp", "sequence_parallel", "ckpt_ratio", "attention", "fused", "compile")
def schedule_bert(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Kernels (``attention="sdpa"``: :class:`torchloom.ops.SDPABertSelfAttention`;
    ``fused``: bias+GeLU and bias+dropout+residual+LayerNorm fused), Megatron TP (and SP)
    over self-attention and the feed-forward block, checkpoint the first ``ckpt_ratio`` of
    the layers, then compile each layer (``compile``)."""
    base = "bert.encoder" if "bert" in sch.child else "encoder"
    layers = sch[f"{base}.layer"]
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    if tp:  # before any primitive: a refusal changes nothing
        hf_config: Any = sch.mod.config  # a BertConfig (typed Tensor | Module by nn.Module)
        check_tp_sizes(sch, "bert", [
            ("num_attention_heads", hf_config.num_attention_heads,
             f"{base}.layer.*.attention.self", "whole attention heads"),
            ("intermediate_size", hf_config.intermediate_size, f"{base}.layer.*.intermediate",
             "an equal share of the feed-forward features")])
    if config.attention == "sdpa":
        sch[f"{base}.layer.*.attention.self"].replace(make_sdpa_bert_self_attention)
    if config.fused:
        sch[f"{base}.layer.*.intermediate"].replace(make_fused_bert_intermediate)
        sch[f"{base}.layer.*.output"].replace(make_fused_bert_output)
        sch[f"{base}.layer.*.attention.output"].replace(make_fused_bert_output)
    if tp:
        for layer in sch[f"{base}.layer.*"]:
            # self-attention: q, k, v column parallel, the output dense row parallel; the
            # region spans two sibling modules, so its syncs sit on their parent.
            for name in ("query", "key", "value"):
                column(node_at(layer, f"attention.self.{name}"))
            row(node_at(layer, "attention.output.dense"))
            # the feed-forward block: intermediate.dense column, output.dense row
            column(node_at(layer, "intermediate.dense"))
            row(node_at(layer, "output.dense"))
            for entry, out in (("attention.self", "attention.output.dense"),
                               ("intermediate", "output.dense")):
                if sequence_parallel:
                    layer[entry].sync("fwd_pre", "all_gather", axis=SEQ_AXIS)
                    layer[out].sync("fwd_post", "reduce_scatter", axis=SEQ_AXIS)
                    layer[out].sync("param_grad", "all_reduce")
                else:
                    layer[entry].sync("bwd_post", "all_reduce")
                    layer[out].sync("fwd_post", "all_reduce")
            if sequence_parallel:
                sp_norms([layer["attention.output.LayerNorm"], layer["output.LayerNorm"]])
        if sequence_parallel:
            first, last = layers["0"], layers[str(len(layers.child) - 1)]
            first.sync("fwd_pre", "scatter", axis=SEQ_AXIS)
            last.sync("fwd_post", "all_gather", axis=SEQ_AXIS, tensor_parallel_output_grad=False)
    finish_layers(layers, config)



