"""The built-in schedule of transformers Llama (``LlamaForCausalLM``, ``LlamaModel``)."""

from __future__ import annotations

from ..schedule import Schedule
from ._common import SEQ_AXIS, finish_layers, region, sp_final_norm, sp_norms

__all__ = ["schedule_llama"]


def schedule_llama(sch: Schedule, *, tp: bool = False, sequence_parallel: bool = False,
                   ckpt_ratio: float = 0.0, compile: bool | str = False) -> None:
    """Megatron TP (and SP) over attention (q/k/v -> o) and the gated MLP
    (gate/up -> down), then checkpoint the first ``ckpt_ratio`` of the layers."""
    base = "model." if "model" in sch.child else ""
    if tp:
        for layer in sch[f"{base}layers.*"]:
            region(layer["self_attn"], ["q_proj", "k_proj", "v_proj"], "o_proj",
                   sequence_parallel, input_name="hidden_states")
            region(layer["mlp"], ["gate_proj", "up_proj"], "down_proj", sequence_parallel)
            if sequence_parallel:
                sp_norms([layer["input_layernorm"], layer["post_attention_layernorm"]])
        if sequence_parallel:
            # Scatter at the first layer, not the embedding: LlamaModel derives positions
            # and the causal mask from the embedding output's sequence length.
            sch[f"{base}layers.0"].sync("fwd_pre", "scatter", axis=SEQ_AXIS,
                                        input_name="hidden_states")
            sp_final_norm(sch[f"{base}norm"])
    finish_layers(sch[f"{base}layers"], ckpt_ratio, compile)
