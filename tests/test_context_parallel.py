"""Context parallelism (issue 28) in one process: the sharding and the attention kernel,
the primitive on one rank, and every refusal with its message pinned. The multi-rank
checks are in tests/test_context_parallel_dist.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as T
from torch import nn

import torchloom as tl
from torchloom.core.errors import ContextParallelError, LayoutError
from torchloom.ops.context_parallel import (
    CPState,
    chunk_attention,
    context_parallel_attention,
    shard_index,
)
from torchloom.primitives.context_parallel import attention_modules

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=64, max_position_embeddings=128)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_cover_the_sequence_and_balance_causal_work(cp):
    seq = 8 * cp
    parts = [shard_index(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # under a causal mask position p attends to p + 1 keys: every rank the same total
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def _reference(q, k, v, *, causal=True, window=None, padding=None):
    seq = q.shape[2]
    keep = torch.ones(seq, seq, dtype=torch.bool)
    if causal:
        pos = torch.arange(seq)
        keep = pos[None, :] <= pos[:, None]
        if window is not None:
            keep = keep & (pos[:, None] - pos[None, :] < window)
    mask = keep[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["causal", "window", "padding", "bidirectional"])
def test_chunk_attention_equals_whole_sequence_attention(cp, case):
    torch.manual_seed(0)
    seq = 16 * cp
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, seq, 8, dtype=torch.float64), torch.randn(2, 2, seq, 8,
                                                                        dtype=torch.float64)
    kwargs: dict = {"causal": case != "bidirectional"}
    if case == "window":
        kwargs["window"] = 11  # not a multiple of the chunk: windows start mid-chunk
    if case == "padding":
        pad = torch.ones(2, seq, dtype=torch.bool)
        pad[1, seq - 5:] = False
        kwargs["padding"] = pad
    full = _reference(q, k, v, **kwargs)
    for rank in range(cp):
        index = shard_index(seq, cp, rank)
        out = chunk_attention(q[:, :, index], k, v, cp=cp, rank=rank,
                              is_causal=kwargs["causal"], sliding_window=kwargs.get("window"),
                              key_padding=kwargs.get("padding"))
        torch.testing.assert_close(out, full[:, :, index], rtol=1e-12, atol=1e-12)


def test_a_sequence_the_degree_does_not_divide_is_refused():
    with pytest.raises(ContextParallelError,
                       match=r"a sequence of 30 tokens does not split into 2 x 4 equal chunks"
                       r"(.|\n)*fix: use a sequence length that is a multiple of 8"):
        shard_index(30, cp=4, rank=0)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_one_rank_computes_what_the_model_does(family):
    torch.manual_seed(0)
    if family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**SIZES))
    else:  # a window shorter than the sequence
        model = T.MistralForCausalLM(T.MistralConfig(**SIZES, sliding_window=5))
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    before = model(ids, labels=ids, attention_mask=mask)
    sch = tl.create_schedule(model)
    sch.context_parallel()
    after = model(ids, labels=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(after.logits[keep], before.logits[keep], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after.loss, before.loss)
    assert [name for name, _ in attention_modules(model)] == [
        "model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert "context_parallel" not in tl.list_primitives()  # a process group: not in recipes


def test_applied_twice_is_refused():
    model = T.LlamaForCausalLM(T.LlamaConfig(**SIZES))
    sch = tl.create_schedule(model)
    sch.context_parallel()
    with pytest.raises(ContextParallelError,
                       match=r"context_parallel was already applied to this model(.|\n)*"
                       r"fix: apply it once"):
        sch.context_parallel()


def test_a_module_that_is_not_a_transformers_model_is_refused():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ContextParallelError,
                       match=r"a Sequential is not a transformers model(.|\n)*"
                       r"fix: apply it at the transformers model"):
        sch.context_parallel()


def test_an_attention_that_does_not_call_the_interface_is_refused():
    # GPT-2 with torchloom's own SDPA attention module in place of transformers'
    from torchloom.ops.attention import make_sdpa_gpt2_attention

    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    sch = tl.create_schedule(model)
    sch["transformer.h.0.attn"].replace(make_sdpa_gpt2_attention)
    with pytest.raises(ContextParallelError,
                       match=r"no attention module of GPT2LMHeadModel calls transformers' "
                       r"attention interface(.|\n)*SDPAGPT2Attention(.|\n)*fix: keep the "
                       r"model's own attention classes"):
        sch.context_parallel()


def test_a_full_mask_and_a_cache_are_refused_at_run_time():
    model = T.LlamaForCausalLM(T.LlamaConfig(**SIZES))
    tl.create_schedule(model).context_parallel()
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ContextParallelError,
                       match=r"takes a \(batch, seq\) padding mask, not a full attention mask"
                       r"(.|\n)*attention_mask=\(1, 1, 8, 8\)"):
        model(ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ContextParallelError, match=r"a KV cache was passed"):
        model(ids, past_key_values=T.DynamicCache(config=model.config))
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ContextParallelError,
                       match=r"LlamaAttention: the model built a full attention mask"):
        context_parallel_attention(attn, q, q[:, :2], q[:, :2], torch.ones(1, 1, 8, 8))
    with pytest.raises(ContextParallelError, match=r"its attention takes softcap"):
        context_parallel_attention(attn, q, q[:, :2], q[:, :2], None, softcap=30.0)
    plain = nn.Linear(2, 2)
    with pytest.raises(ContextParallelError, match=r"was not prepared by the context_parallel"):
        context_parallel_attention(plain, q, q[:, :2], q[:, :2], None)
    assert isinstance(tl.core.marks.get_mark(attn, "context_parallel"), CPState)


def test_layout_checks_context_parallelism():
    assert tl.Layout(cp=2, tp=2, sp=True, seq_len=64).describe().startswith("tp2+sp cp2 ")
    with pytest.raises(LayoutError, match=r"each sequence of 30 tokens into 4 equal chunks: "
                       r"seq_len must be a multiple of 2 x cp = 4(.|\n)*fix: seq_len=32"):
        tl.Layout(cp=2, seq_len=30)
    with pytest.raises(LayoutError, match=r"split again by sequence parallelism: seq_len must "
                       r"be a multiple of 2 x cp x tp = 8(.|\n)*fix: seq_len=40"):
        tl.Layout(cp=2, tp=2, sp=True, seq_len=36)
    # inside a pipeline: each stage's sequences split over its context-parallel ranks
    assert tl.Layout(cp=2, pp=2, n_microbatches=2, seq_len=64).describe() == \
        "tp1 cp2 pp2(1F1B x2) dp1(ddp) mb1 ckpt0 fp32"


def test_layout_shard_cp():
    """FSDP2 over the context-parallel ranks alone (torchtitan's dp_shard_cp with dp_shard
    1), and HSDP across replicas of them; refused without cp and with expert parallelism."""
    lay = tl.Layout(cp=4, shard_cp=True)
    assert (lay.fsdp, lay.dp_mode, lay.shards) == (True, "fsdp", 4)
    assert tl.Layout(cp=4).dp_mode == "ddp" and tl.Layout(cp=4).shards == 1
    assert tl.Layout(dp_shard=2, cp=2).shards == 4  # shard_cp or not
    hsdp = tl.Layout(dp_replicate=2, cp=2, shard_cp=True)
    assert hsdp.dp_mode == "hsdp" and hsdp.describe().startswith("tp1 cp2 dp2(hsdp 2x1 over cp)")
    with pytest.raises(LayoutError, match=r"shard_cp shards the weights over the "
                       r"context-parallel ranks; it needs cp > 1(.|\n)*values: shard_cp=True, "
                       r"cp=1(.|\n)*fix: Layout\(cp=2, shard_cp=True\)"):
        tl.Layout(shard_cp=True)
    with pytest.raises(LayoutError, match=r"with FSDP2 over the context-parallel ranks alone "
                       r"\(shard_cp, dp_shard 1\) it is not supported(.|\n)*"
                       r"fix: Layout\(dp_shard=2, cp=2, ep=2\)"):
        tl.Layout(dp_replicate=2, cp=2, ep=2, shard_cp=True)
    with pytest.raises(LayoutError, match=r"shard_cp is True or False(.|\n)*values: "
                       r"shard_cp='yes'"):
        tl.Layout(cp=2, shard_cp="yes")  # e.g. from a TOML or JSON file


def test_train_with_cp_on_too_few_ranks_says_the_launch_to_use():
    from torchloom.apps.train import TrainConfig, train_rank
    from torchloom.core.errors import TrainOptionError

    with pytest.raises(TrainOptionError,
                       match=r"--tp 1 x --cp 2 x --dp 1 x --pp 1 = 2 ranks, but the run has 1"
                       r"(.|\n)*fix: torchrun --nproc-per-node 2 -m torchloom train --tp 1 --cp 2 "
                       r"--dp 1 --pp 1"):
        train_rank(0, TrainConfig(model="llama", cp=2, steps=1, batch_size=2, seq_len=32,
                                  progress=False))
