"""Grouped-query attention under the built-in Llama TP schedule, on four gloo ranks.

Llama from transformers' default config (sizes shrunk, ``use_cache`` at its default),
8 query heads, against the single-process model with the same weights:

* 2 KV heads at TP=4 (each KV head replicated on 2 ranks), plain TP and sequence
  parallel: logits, every parameter's gradient (a replicated k_proj / v_proj gradient
  equals the full model's slice for that head, so it was summed over exactly the two
  ranks sharing the head), the losses of two SGD steps later, the sharing ranks' copies
  still equal, the collectives counted, the recipe replayed;
* multi-query attention (1 KV head) at TP=2 on two TP groups {0, 1} and {2, 3}: the
  gradient sums run over the schedule's group, not over all four ranks (which would
  double them);
* a model built from ``init_empty_weights`` at TP=4: ``full_state_dict`` gathers the
  replicated KV weights to their original shape and equals the unscheduled model built
  from the same seed, and its gradients equal that model's; with ``init="local"`` the
  ranks sharing a KV head draw the same values; ``tl.save`` writes one copy
  of each KV head, which loads into the unscheduled model and back into the TP=4 layout.

One 4-rank process-group launch runs it all.
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom import schedules
from torchloom.runtime.collectives import count_collectives
from torchloom.tools.check import check
from torchloom.tools.testing import verify_recipe_roundtrip

WORLD = 4
LAYERS = 2
TOL = dict(rtol=1e-5, atol=1e-5)


def config(kv: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                    num_attention_heads=8, num_key_value_heads=kv,
                                    num_hidden_layers=LAYERS, vocab_size=128)


def llama(kv: int) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config(kv)).train()


def _batch() -> dict:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _compare(name: str, model: nn.Module, reference: nn.Module, tp: int, rank: int,
             replicas: int) -> None:
    """Every gradient of ``model`` equals the matching slice of ``reference``'s."""
    ref_params = dict(reference.named_parameters())
    shared = 0
    for pname, param in model.named_parameters():
        spec = tl.shard_spec(param)
        expected = ref_params[pname].grad
        if spec is not None:
            assert spec.world_size == tp and spec.rank == rank
            if pname.endswith(("k_proj.weight", "v_proj.weight")):
                assert spec.replicas == replicas and spec.piece == rank // replicas
                assert param.shape[0] == 64 // 8  # one KV head: head_dim rows
                shared += 1
            expected = spec.slice(expected)
        torch.testing.assert_close(param.grad, expected, **TOL, msg=f"{name}: grad of {pname}")
    assert shared == 2 * LAYERS


def _train_and_compare(name: str, kv: int, sp: bool, rank: int, group=None) -> nn.Module:
    tp = dist.get_world_size(group)
    replicas = tp // kv
    reference = llama(kv)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model, group=group)
    schedules.apply_schedule(sch, tp=True, sequence_parallel=sp)
    assert check(sch).ok, check(sch)
    model, _ = tl.build(sch)
    batch = _batch()
    with count_collectives() as forward:
        out = model(**batch)
    ref_out = reference(**batch)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL, msg=f"{name}: logits")
    with count_collectives() as backward:
        out.loss.backward()
    ref_out.loss.backward()
    # per layer: forward all-reduces after o_proj and down_proj; backward the attention's
    # and the MLP's input gradients, plus one gradient sum for each of k_proj and v_proj
    if not sp:
        assert dict(forward) == {"all_reduce": 2 * LAYERS}, (name, dict(forward))
        assert dict(backward) == {"all_reduce": 4 * LAYERS}, (name, dict(backward))
    else:  # SP adds the norms' gradient all-reduces (2 per layer and the final norm); the
        # input gradients of the attention and the MLP are reduce-scattered instead
        assert backward["all_reduce"] == (2 * LAYERS + 1) + 2 * LAYERS, (name, dict(backward))
        assert backward["reduce_scatter"] == 2 * LAYERS, (name, dict(backward))
    _compare(name, model, reference, tp, rank, replicas)

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = model(**batch).loss, reference(**batch).loss
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{name}: loss after {step}")
        loss.backward()
        ref_loss.backward()
    # the ranks sharing a KV head still hold the same values, equal to the reference's
    weight = model.model.layers[0].self_attn.k_proj.weight.detach().contiguous()
    copies = [torch.empty_like(weight) for _ in range(tp)]
    dist.all_gather(copies, weight, group=group)
    local = dist.get_rank(group)
    for r in range(tp):
        if r // replicas == local // replicas:
            torch.testing.assert_close(copies[r], weight, rtol=0, atol=0)
    spec = tl.shard_spec(model.model.layers[0].self_attn.k_proj.weight)
    torch.testing.assert_close(
        weight, spec.slice(reference.model.layers[0].self_attn.k_proj.weight.detach()), **TOL)
    return model


def _check_replicated_kv(rank: int) -> None:
    """2 KV heads at TP=4: ranks {0, 1} hold KV head 0, ranks {2, 3} KV head 1."""
    _train_and_compare("kv2-tp4", 2, False, rank)
    _train_and_compare("kv2-tp4-sp", 2, True, rank)
    sch = tl.create_schedule(llama(2))
    schedules.apply_schedule(sch, tp=True)
    text = str(sch.recipe)
    assert "self_attn'].replace(torchloom.schedules.llama.replicate_kv_heads)" in text
    assert "k_proj.grad_sum'].sync('bwd_post', 'all_reduce')" in text
    verify_recipe_roundtrip(sch, lambda: llama(2), _batch())


def _check_mqa_on_subgroups(rank: int) -> None:
    """One KV head at TP=2, in two TP groups: sums over the TP group only."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _train_and_compare("mqa-tp2", 1, False, rank % 2, group=groups[rank // 2])


def _check_meta_build_and_checkpoint(rank: int) -> None:
    torch.manual_seed(3)
    with tl.init_empty_weights():
        plain = transformers.LlamaForCausalLM(config(2))
    plain, _ = tl.build(tl.create_schedule(plain))
    torch.manual_seed(3)
    with tl.init_empty_weights():
        model = transformers.LlamaForCausalLM(config(2))
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True)
    model, _ = tl.build(sch)
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert tuple(k_proj.shape) == (8, 64) and tl.shard_spec(k_proj).full_shape == (16, 64)
    full = tl.full_state_dict(model)
    expected = plain.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)
    # the KV gradient sums survive build's re-creation of the meta parameters
    batch = _batch()
    model(**batch).loss.backward()
    plain(**batch).loss.backward()
    _compare("meta-kv2-tp4", model, plain, WORLD, rank, 2)
    model.zero_grad(set_to_none=True)

    # init="local" draws each piece from its own stream: the sharing ranks agree
    with tl.init_empty_weights():
        local = transformers.LlamaForCausalLM(config(2))
    sch = tl.create_schedule(local)
    schedules.apply_schedule(sch, tp=True)
    local, _ = tl.build(sch, init="local")
    for module in (local.model.layers[0].self_attn.k_proj, local.model.layers[1].self_attn.v_proj):
        weight = module.weight.detach().contiguous()
        copies = [torch.empty_like(weight) for _ in range(WORLD)]
        dist.all_gather(copies, weight)
        assert torch.equal(copies[0], copies[1]) and torch.equal(copies[2], copies[3])
        assert not torch.equal(copies[0], copies[2])

    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    ckpt = f"{path[0]}/ckpt"
    try:
        tl.save(model, None, ckpt, step=1)
        fresh = transformers.LlamaForCausalLM(config(2))  # another init
        tl.load(fresh, None, ckpt)
        for key, value in fresh.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
        again = transformers.LlamaForCausalLM(config(2))
        sch = tl.create_schedule(again)
        schedules.apply_schedule(sch, tp=True)
        again, _ = tl.build(sch)
        tl.load(again, None, ckpt)
        for (key, value), mine in zip(again.state_dict().items(), model.state_dict().values()):
            torch.testing.assert_close(value, mine, rtol=0, atol=0, msg=key)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path[0])


@pytest.mark.slow
def test_gqa_replicated_kv_heads_on_four_ranks():
    spawn(_check_replicated_kv, _check_mqa_on_subgroups, _check_meta_build_and_checkpoint,
          world=WORLD)
