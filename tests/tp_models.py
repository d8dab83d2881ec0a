"""The tensor-parallel cases that the two-rank tests share (tests/test_tp_models_dist.py
runs them all; others reuse some).

GPT-2, BERT and Llama models of :data:`LAYERS` layers (fp32, no dropout, seed 0), the
library's built-in Megatron TP / SP schedules wrapped as ``schedule(sch, sp)``
(``tp_gpt2``, ``tp_bert``, ``tp_llama`` and variants), :data:`CASES` pairing them
``(name, model, schedule, sequence parallel, replicated parameters in the sequence-parallel
region)``, and :func:`batch`, the seeded token batch they run on.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers
from torch import nn

import torchloom as tl
from torchloom.schedules import ScheduleConfig
from torchloom.schedules.bert import schedule_bert
from torchloom.schedules.gpt2 import schedule_gpt2, split_qkv_per_rank
from torchloom.schedules.llama import schedule_llama

LAYERS = 2


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=128, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def bert() -> nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def llama_kv4() -> nn.Module:
    """Llama from transformers' default config, only sizes changed (``use_cache`` left on):
    8 query heads and 4 KV heads, so at TP=2 each rank keeps 2 KV heads (GQA with more KV
    heads than ranks; fewer are tested on four ranks in test_gqa_dist.py)."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=128)).train()


# The schedules under test are the library's built-in ones.
gpt2_attention_split = split_qkv_per_rank


def tp_gpt2(sch: tl.Schedule, sp: bool) -> None:
    schedule_gpt2(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp))


def tp_bert(sch: tl.Schedule, sp: bool) -> None:
    schedule_bert(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp))


def tp_llama(sch: tl.Schedule, sp: bool) -> None:
    schedule_llama(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp))


def tp_gpt2_sdpa(sch: tl.Schedule, sp: bool) -> None:
    """torchloom.ops' SDPA attention in place of GPT-2's, then the same TP/SP schedule."""
    schedule_gpt2(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp, attention="sdpa"))


def tp_bert_sdpa(sch: tl.Schedule, sp: bool) -> None:
    schedule_bert(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp, attention="sdpa"))


def tp_gpt2_compiled(sch: tl.Schedule, sp: bool) -> None:
    """Each block compiled around its TP hooks (aot_eager: dynamo capture and AOT
    autograd, as with inductor, without the codegen): the same logits, gradients and
    collective counts as the eager TP schedule."""
    schedule_gpt2(sch, ScheduleConfig.of(sch, tp=True, sequence_parallel=sp, compile="aot_eager"))


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[tl.Schedule, bool], None], bool, int]] = [
    ("gpt2", gpt2, tp_gpt2, False, 0),
    ("gpt2-compiled", gpt2, tp_gpt2_compiled, False, 0),
    ("gpt2-sdpa", gpt2, tp_gpt2_sdpa, False, 0),
    ("bert-sdpa", bert, tp_bert_sdpa, False, 0),
    ("gpt2-sdpa-sp", gpt2, tp_gpt2_sdpa, True, 6 * LAYERS + 2),
    ("bert-sdpa-sp", bert, tp_bert_sdpa, True, 6 * LAYERS),
    ("bert", bert, tp_bert, False, 0),
    ("llama", llama, tp_llama, False, 0),
    ("llama-kv4", llama_kv4, tp_llama, False, 0),
    # GPT-2: ln_1, ln_2 (weight + bias) and both c_proj biases per layer, ln_f's two.
    ("gpt2-sp", gpt2, tp_gpt2, True, 6 * LAYERS + 2),
    # Llama: two RMSNorm weights per layer and the final norm's.
    ("llama-sp", llama, tp_llama, True, 2 * LAYERS + 1),
    ("llama-kv4-sp", llama_kv4, tp_llama, True, 2 * LAYERS + 1),
    # BERT: two LayerNorms (weight + bias) and two row-parallel biases per layer.
    ("bert-sp", bert, tp_bert, True, 6 * LAYERS),
]


def batch() -> dict:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}
