"""The transformers families of the parallel-plan tests (tests/test_hf_plan.py in one
process, tests/test_hf_plan_dist.py at TP=2), and their inputs.

Each builder makes a family from transformers' default config with only the sizes
changed (:data:`DENSE`: :data:`LAYERS` layers, hidden size 32, 4 query and 2 KV heads,
a vocabulary of 64, unless the family needs otherwise); :func:`text` and
:func:`patches` are the seeded inputs of the text and vision families.
"""

from __future__ import annotations

import torch
import transformers as T
from torch import nn

LAYERS = 2
DENSE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=LAYERS, vocab_size=64)


def llama() -> nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(**DENSE))


def qwen2() -> nn.Module:  # biases on q, k, v
    return T.Qwen2ForCausalLM(T.Qwen2Config(**DENSE))


def mistral() -> nn.Module:
    return T.MistralForCausalLM(T.MistralConfig(**DENSE))


def qwen2_mqa() -> nn.Module:  # one KV head, replicated on both ranks (with its biases)
    return T.Qwen2ForCausalLM(T.Qwen2Config(**{**DENSE, "num_key_value_heads": 1}))


def gemma() -> nn.Module:  # tied embedding and head (one vocabulary-parallel table)
    return T.GemmaForCausalLM(T.GemmaConfig(head_dim=8, **DENSE))


def phi3() -> nn.Module:  # packed q/k/v and gate/up, gathered; outputs split again
    sizes = {k: v for k, v in DENSE.items() if k != "vocab_size"}  # its pad id is 32000
    return T.Phi3ForCausalLM(T.Phi3Config(**sizes))


def qwen3() -> nn.Module:  # per-head q/k norms: replicated_with_grad_allreduce
    return T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=8, **DENSE))


def olmo2() -> nn.Module:  # q/k norms over all heads: q/k/v gathered
    return T.Olmo2ForCausalLM(T.Olmo2Config(**DENSE))


def starcoder2() -> nn.Module:  # biases everywhere (row biases added once), tied
    return T.Starcoder2ForCausalLM(T.Starcoder2Config(**DENSE))


def mixtral() -> nn.Module:  # mixture of experts: packed gate/up experts split within
    return T.MixtralForCausalLM(T.MixtralConfig(num_local_experts=4, **DENSE))


def qwen2_moe() -> nn.Module:  # experts plus a replicated shared expert
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, **DENSE))


def minicpm3() -> nn.Module:  # multi-head latent attention: mla_kv_a_proj
    return T.MiniCPM3ForCausalLM(T.MiniCPM3Config(
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, **{**DENSE, "num_key_value_heads": 4}))


def ultrabert() -> nn.Module:  # an encoder (masked LM), padding row in the embedding
    return T.UltrabertForMaskedLM(T.UltrabertConfig(
        head_dim=8, prediction_head_size=32, **{**DENSE, "num_key_value_heads": 4}))


def t5gemma() -> nn.Module:  # encoder-decoder: two stacks, cross-attention
    sizes = dict(head_dim=8, **DENSE)
    return T.T5GemmaForConditionalGeneration(T.T5GemmaConfig(
        encoder=T.T5GemmaModuleConfig(**sizes), decoder=T.T5GemmaModuleConfig(**sizes),
        vocab_size=64))


def gemma4_vision() -> nn.Module:  # a vision encoder (patches, 2-D positions)
    return T.Gemma4VisionModel(T.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8))


def esmc() -> nn.Module:
    return T.EsmcForMaskedLM(T.EsmcConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8))


# --------------------------------------------------------------------------- inputs


def text(seq2seq: bool = False) -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if seq2seq:
        batch["decoder_input_ids"] = ids.flip(-1)
    return batch


def patches(side: int = 6) -> dict:
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1)
    return {"pixel_values": torch.randn(2, side * side, 3 * 16 * 16,
                                        generator=torch.Generator().manual_seed(5)),
            "pixel_position_ids": grid.reshape(1, side * side, 2).expand(2, -1, -1).contiguous()}
