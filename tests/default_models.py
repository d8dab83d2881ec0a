"""Transformers models from their DEFAULT configs, only the sizes shrunk, and their inputs.

:func:`default_model` builds one family (``gpt2``, ``bert``, ``llama``, ``opt``, ``t5``,
``vit``) in training mode with ``use_cache`` and dropout left at transformers' defaults,
from the seed 0; :data:`LAYERS` names each family's layer stack and :func:`batch` makes
a seeded batch for it. tests/test_defaults.py explains why these configs are tested.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 128


def default_model(name: str) -> torch.nn.Module:
    """A model from transformers' default config with only its sizes changed, in training."""
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                      n_positions=64)
        return transformers.GPT2LMHeadModel(cfg).train()
    if name == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=64)
        return transformers.BertForMaskedLM(cfg).train()
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg).train()
    if name == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64,
                                     word_embed_proj_dim=32)
        return transformers.OPTForCausalLM(cfg).train()
    if name == "t5":
        cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=16,
                                    num_heads=2, d_ff=64, vocab_size=VOCAB)
        return transformers.T5ForConditionalGeneration(cfg).train()
    assert name == "vit"
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                 intermediate_size=64, image_size=32, patch_size=8)
    return transformers.ViTForImageClassification(cfg).train()


LAYERS = {"gpt2": "transformer.h", "bert": "bert.encoder.layer", "llama": "model.layers",
          "opt": "model.decoder.layers", "t5": "decoder.block", "vit": "vit.layers"}


def batch(name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen),
                "labels": torch.tensor([0, 1])}
    ids = torch.randint(2, VOCAB, (2, 16), generator=gen)
    if name == "t5":  # the default T5Config has no decoder_start_token_id to shift labels
        return {"input_ids": ids, "decoder_input_ids": torch.randint(2, VOCAB, (2, 8),
                                                                       generator=gen)}
    return {"input_ids": ids, "labels": ids.clone()}
