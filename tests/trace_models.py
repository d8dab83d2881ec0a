"""The trace suite's models (tests/test_trace.py) that other test modules use too.

:func:`llama` is a two-layer Llama with grouped KV heads (4 query, 2 KV) and transformers'
default token ids, built from the seed 0; its vocabulary is :data:`VOCAB`.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB = 128


def llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)
