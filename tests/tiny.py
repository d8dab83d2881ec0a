"""Tiny transformers models for tests (random init, built from configs in code)."""

from __future__ import annotations

import torch
import transformers


def gpt2(seed: int = 0, dropout: float = 0.0, n_layer: int = 2) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def bert(seed: int = 0, dropout: float = 0.0, n_layer: int = 2) -> transformers.BertForMaskedLM:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        num_hidden_layers=n_layer, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=128, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    return transformers.BertForMaskedLM(cfg)


def llama(n_layer: int = 4) -> transformers.LlamaForCausalLM:
    """Four layers by default (room for three pipeline stages); token ids 0 like the others."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def token_batch(seed: int = 1, batch: int = 2, seq: int = 16, vocab: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def gpt_neox(n_layer: int = 4) -> transformers.GPTNeoXForCausalLM:
    """transformers' default GPT-NeoX config with only its sizes changed; its folder
    (``save_pretrained``) stores the head as ``embed_out.weight``, not ``lm_head.weight``."""
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=128, max_position_embeddings=64))
