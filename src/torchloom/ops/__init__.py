"""Parallel building blocks that a schedule can ``replace`` modules with.

* :class:`VocabParallelEmbedding` (and the factory :func:`make_vocab_parallel_embedding`
  for ``sch[path].replace(...)``): an embedding whose table is split by rows (vocabulary)
  over the tensor-parallel group.
* :func:`vocab_parallel_cross_entropy`: cross-entropy over logits split along the
  vocabulary axis, without gathering them.
* :func:`vocab_parallel_logits`: the logits shard of a language-model head tied to a
  vocab-parallel embedding.
* :func:`sdpa_attention` (explicit ``is_causal``; boolean, additive and padding masks) and
  the factories :func:`make_sdpa_gpt2_attention`, :func:`make_sdpa_bert_self_attention`.
* :class:`FusedBiasGelu`, :class:`FusedBiasDropoutResidualLayerNorm` (``torch.compile``)
  and the factories :func:`make_fused_gpt2_mlp`, :func:`make_fused_bert_intermediate`,
  :func:`make_fused_bert_output` (``*_eager`` variants without compile).
* :func:`make_fused_qkv_bert_self_attention`: one q/k/v projection that loads and saves
  the original ``query``/``key``/``value`` keys.

In a world of one every operation equals its ``torch.nn`` counterpart.

>>> import torch
>>> emb = VocabParallelEmbedding.from_embedding(torch.nn.Embedding(8, 3))
>>> emb(torch.tensor([[0, 7]])).shape
torch.Size([1, 2, 3])
"""

from __future__ import annotations

from .attention import (
    OpsError,
    SDPAAttention,
    SDPABertSelfAttention,
    SDPAGPT2Attention,
    make_sdpa_bert_self_attention,
    make_sdpa_gpt2_attention,
    sdpa_attention,
)
from .fused import (
    FusedBertIntermediate,
    FusedBertOutput,
    FusedBiasDropoutResidualLayerNorm,
    FusedBiasGelu,
    FusedGPT2MLP,
    gelu_approximation,
    make_fused_bert_intermediate,
    make_fused_bert_intermediate_eager,
    make_fused_bert_output,
    make_fused_bert_output_eager,
    make_fused_gpt2_mlp,
    make_fused_gpt2_mlp_eager,
)
from .qkv import FusedQKVBertSelfAttention, make_fused_qkv_bert_self_attention
from .vocab_parallel import (
    VocabParallelEmbedding,
    make_vocab_parallel_embedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)

__all__ = [
    "FusedBertIntermediate",
    "FusedBertOutput",
    "FusedBiasDropoutResidualLayerNorm",
    "FusedBiasGelu",
    "FusedGPT2MLP",
    "FusedQKVBertSelfAttention",
    "OpsError",
    "SDPAAttention",
    "SDPABertSelfAttention",
    "SDPAGPT2Attention",
    "VocabParallelEmbedding",
    "gelu_approximation",
    "make_fused_bert_intermediate",
    "make_fused_bert_intermediate_eager",
    "make_fused_bert_output",
    "make_fused_bert_output_eager",
    "make_fused_gpt2_mlp",
    "make_fused_gpt2_mlp_eager",
    "make_fused_qkv_bert_self_attention",
    "make_sdpa_bert_self_attention",
    "make_sdpa_gpt2_attention",
    "make_vocab_parallel_embedding",
    "sdpa_attention",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]
