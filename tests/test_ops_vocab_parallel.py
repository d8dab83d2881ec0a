"""Vocabulary-parallel embedding and cross-entropy: a world of one, then two gloo ranks.

The two-rank checks run in one process-group launch (start-up costs seconds, each check
milliseconds). Everything is fp32 on CPU; sums over ranks differ from the single-process
result by round-off only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import torchloom as tl
from tests.dist import spawn
from torchloom.core.errors import ScheduleError, ShardError
from torchloom.ops import (
    VocabParallelEmbedding,
    make_vocab_parallel_embedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from torchloom.ops.vocab_parallel import _vocab_range

WORLD = 2
TOL = dict(rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------- a world of one


def test_embedding_world_of_one_equals_nn_embedding_with_padding():
    torch.manual_seed(0)
    full = nn.Embedding(10, 4, padding_idx=3)
    vp = VocabParallelEmbedding.from_embedding(full)
    assert (vp.vocab_start, vp.vocab_end, vp.local_padding_idx) == (0, 10, 3)
    assert tl.shard_spec(vp.weight) == tl.ShardSpec(axis=0, full_shape=(10, 4),
                                                    world_size=1, rank=0)
    ids = torch.tensor([[0, 3, 9, 3], [1, 1, 5, 0]])
    assert torch.equal(vp(ids), full(ids))
    vp(ids).square().sum().backward()
    full(ids).square().sum().backward()
    assert torch.equal(vp.weight.grad, full.weight.grad)
    assert vp.weight.grad[3].abs().sum() == 0  # the padding row gets no gradient


def test_embedding_keeps_tags_and_negative_padding_idx():
    full = nn.Embedding(8, 2, padding_idx=-1)
    from torchloom.core.meta import get_meta, set_tag
    set_tag(full.weight, "tag", 7)
    vp = VocabParallelEmbedding.from_embedding(full)
    assert vp.padding_idx == 7 and get_meta(vp.weight).tags["tag"] == 7
    assert vp.weight is not full.weight


def test_cross_entropy_world_of_one_equals_f_cross_entropy():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    target = torch.randint(0, 11, (3, 5), generator=gen)
    target[0, 1] = target[2, 4] = -100
    for reduction in ("mean", "sum", "none"):
        logits.grad = ref_logits.grad = None
        loss = vocab_parallel_cross_entropy(logits, target, reduction=reduction)
        ref = F.cross_entropy(ref_logits.reshape(-1, 11), target.reshape(-1),
                              reduction=reduction)
        if reduction == "none":
            ref = ref.reshape(3, 5)
        torch.testing.assert_close(loss, ref, **TOL)
        weight = torch.rand(loss.shape, generator=gen)
        (loss * weight).sum().backward()
        (ref * weight).sum().backward()
        torch.testing.assert_close(logits.grad, ref_logits.grad, **TOL)


def test_cross_entropy_is_stable_for_huge_logits_and_custom_ignore_index():
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]], requires_grad=True)
    target = torch.tensor([0, 7])
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=7)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    assert logits.grad[1].abs().sum() == 0


def test_schedule_replace_with_factory():
    model = nn.Sequential(nn.Embedding(6, 3), nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    sch["0"].replace(make_vocab_parallel_embedding)
    assert isinstance(model[0], VocabParallelEmbedding)
    ids = torch.tensor([[0, 5, 2]])
    assert torch.equal(model(ids), reference(ids))


def test_bad_inputs_raise_shard_errors():
    with pytest.raises(ShardError, match="does not split into 2 equal parts") as err:
        _vocab_range(7, 2, 0, "VocabParallelEmbedding")
    assert "resize_token_embeddings(8)" in str(err.value)
    with pytest.raises(ShardError, match="expected an nn.Embedding"):
        make_vocab_parallel_embedding(nn.Linear(2, 2))
    with pytest.raises(ShardError, match="max_norm=1.0"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(4, 2, max_norm=1.0))
    model = nn.Sequential(nn.Embedding(4, 2))
    tl.create_schedule(model)["0"].shard("weight", 0)
    with pytest.raises(ShardError, match="already sharded"):
        VocabParallelEmbedding.from_embedding(model[0])
    with pytest.raises(ShardError, match="outside the vocabulary"):
        VocabParallelEmbedding(4, 2)(torch.tensor([4]))
    with pytest.raises(ShardError, match="without their last"):
        vocab_parallel_cross_entropy(torch.randn(4, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ShardError, match="unknown reduction"):
        vocab_parallel_cross_entropy(torch.randn(4, 3), torch.zeros(4, dtype=torch.long),
                                     reduction="avg")
    with pytest.raises(ScheduleError, match="integer class ids"):
        vocab_parallel_cross_entropy(torch.randn(4, 3), torch.zeros(4))


# --------------------------------------------------------------------- two ranks



def _check_embedding(rank: int) -> None:
    torch.manual_seed(0)
    full = nn.Embedding(16, 4, padding_idx=9)  # rank 1 owns ids 8..15, its padding row is 1
    vp = VocabParallelEmbedding.from_embedding(full)
    assert (vp.vocab_start, vp.vocab_end) == (8 * rank, 8 * rank + 8)
    assert vp.local_padding_idx == (1 if rank == 1 else None)
    assert tl.shard_spec(vp.weight) == tl.ShardSpec(axis=0, full_shape=(16, 4),
                                                    world_size=2, rank=rank)
    # 8 is the first id of rank 1 (local id 0): it must not be zeroed.
    ids = torch.tensor([[0, 8, 7, 15], [8, 9, 3, 0]])
    out = vp(ids)
    ref = full(ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert out[0, 1].abs().sum() > 0
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    torch.testing.assert_close(vp.weight.grad, full.weight.grad[8 * rank: 8 * rank + 8], **TOL)


def _check_cross_entropy(rank: int) -> None:
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(4, 6, 16, generator=gen) * 3
    target = torch.randint(0, 16, (4, 6), generator=gen)
    target[0, 0] = 8    # the first id of rank 1
    target[1, 2] = 7    # the last id of rank 0
    target[2, 3] = target[3, 5] = -100
    for reduction in ("mean", "sum", "none"):
        ref_logits = full.clone().requires_grad_()
        local = full[..., 8 * rank: 8 * rank + 8].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, reduction=reduction)
        ref = F.cross_entropy(ref_logits.reshape(-1, 16), target.reshape(-1),
                              reduction=reduction).reshape(loss.shape)
        torch.testing.assert_close(loss, ref, **TOL)
        weight = torch.rand(loss.shape, generator=gen)
        (loss * weight).sum().backward()
        (ref * weight).sum().backward()
        torch.testing.assert_close(local.grad, ref_logits.grad[..., 8 * rank: 8 * rank + 8], **TOL)


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                        use_cache=False, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _check_gpt2(rank: int) -> None:
    reference = _tiny_gpt2()
    model = copy.deepcopy(reference)
    assert reference.lm_head.weight is reference.transformer.wte.weight  # tied
    sch = tl.create_schedule(model)
    sch["transformer.wte"].replace(make_vocab_parallel_embedding)
    wte = model.transformer.wte
    assert isinstance(wte, VocabParallelEmbedding) and wte.weight.shape == (64, 32)

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    ids[0, 0], ids[1, 3] = 64, 63  # around the boundary of the two halves
    labels = ids.clone()
    labels[1, 5:7] = -100
    ref_loss = reference(input_ids=ids, labels=labels).loss
    ref_loss.backward()

    with CommDebugMode() as fwd_comm:
        hidden = model.transformer(input_ids=ids).last_hidden_state
        # lm_head is tied to wte: the same local rows give this rank's logits columns.
        logits_local = vocab_parallel_logits(hidden, wte.weight)
        loss = vocab_parallel_cross_entropy(logits_local[:, :-1], labels[:, 1:])
    with CommDebugMode() as bwd_comm:
        loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # The reference gradient of the tied weight sums the embedding and the head parts.
    torch.testing.assert_close(wte.weight.grad,
                               reference.transformer.wte.weight.grad[64 * rank: 64 * rank + 64],
                               rtol=1e-5, atol=1e-5)
    block = model.transformer.h[0].mlp.c_fc.weight.grad
    torch.testing.assert_close(block, reference.transformer.h[0].mlp.c_fc.weight.grad,
                               rtol=1e-5, atol=1e-5)
    # Forward: the embedding's all-reduce, then max and (sum-exp, target logit) for the loss.
    # Backward: only the head's input gradient is summed (copy_to_group).
    assert fwd_comm.get_total_counts() == 3, fwd_comm.get_comm_counts()
    assert bwd_comm.get_total_counts() == 1, bwd_comm.get_comm_counts()
    counts = {str(k): v for k, v in fwd_comm.get_comm_counts().items()}
    assert counts == {"c10d.allreduce_": 3}, counts


def test_vocab_parallel_on_two_ranks():
    spawn(_check_embedding, _check_cross_entropy, _check_gpt2)


def test_the_factory_splits_over_the_schedules_group_not_the_world() -> None:
    """TP 2 x DP 2 (a fake world of 4): the vocabulary is split in 2, over the TP group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torchloom as tl
    from torchloom.ops import make_vocab_parallel_embedding

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        tp_group = dist.new_group([0, 1])
        model = torch.nn.Sequential(torch.nn.Embedding(8, 4))
        sch = tl.create_schedule(model, group=tp_group)
        sch["0"].replace(make_vocab_parallel_embedding)
        assert (model[0].world_size, model[0].vocab_start, model[0].vocab_end) == (2, 0, 4)
        assert model[0].weight.shape == (4, 4)
        plain = torch.nn.Sequential(torch.nn.Embedding(8, 4))
        tl.create_schedule(plain)["0"].replace(make_vocab_parallel_embedding)  # no group
        assert plain[0].world_size == 4  # the default group, as before
    finally:
        dist.destroy_process_group()
