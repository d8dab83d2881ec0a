"""Tensor and sequence parallelism of transformers models on two gloo ranks.

GPT-2 (Conv1D, fused q/k/v), BERT and Llama, attention and MLP sharded Megatron-style by
the built-in schedules (:mod:`torchloom.schedules`, only ``shard`` + ``sync``), against the
single-process model with the same weights:

* logits equal within 1e-5 (fp32; the ranks add partial products in another order);
* every sharded parameter's gradient equals the matching slice of the reference
  gradient, every replicated one the reference gradient (1e-5);
* three SGD steps later the losses still match;
* the collectives per forward and per backward are exactly the expected numbers.

The same for sequence parallelism. One process-group launch runs it all.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from torch import nn

import torchloom as tl
from tests import tp_models
from tests.dist import spawn
from tests.tp_models import CASES, LAYERS, gpt2, llama, tp_gpt2, tp_llama
from torchloom.runtime.collectives import count_collectives

WORLD = 2
TOL = dict(rtol=1e-5, atol=1e-5)


# Collectives per step. Megatron TP: per layer, one all-reduce after each row-parallel
# linear in forward, one on the input gradient of each column-parallel block in backward.
# SP: per layer, forward all-gathers before attention and MLP and reduce-scatters after
# them (a real reduce-scatter, gloo has one); backward mirrors them (all-gather's backward
# reduce-scatters and vice versa; the final all-gather keeps its slice), plus one
# all-reduce per replicated parameter in the sequence-parallel region.
def expected_counts(sp: bool, sp_params: int) -> tuple[dict, dict]:
    if not sp:
        return {"all_reduce": 2 * LAYERS}, {"all_reduce": 2 * LAYERS}
    forward = {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS}
    backward = {"reduce_scatter": 2 * LAYERS, "all_gather": 2 * LAYERS + 1}
    if sp_params:
        backward["all_reduce"] = sp_params
    return forward, backward


def _check_case(rank: int, name: str, make, schedule, sp: bool, sp_params: int) -> None:
    reference = make()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    schedule(sch, sp)
    model, _ = tl.build(sch)
    batch = tp_models.batch()

    with count_collectives() as forward:
        out = model(**batch)
    with torch.no_grad():
        ref_logits = reference(**batch).logits
    torch.testing.assert_close(out.logits, ref_logits, **TOL, msg=f"{name}: logits")
    with count_collectives() as backward:
        out.loss.backward()
    reference(**batch).loss.backward()
    fwd_expected, bwd_expected = expected_counts(sp, sp_params)
    assert dict(forward) == fwd_expected, (name, dict(forward))
    assert dict(backward) == bwd_expected, (name, dict(backward))

    ref_params = dict(reference.named_parameters())
    sharded = 0
    for pname, param in model.named_parameters():
        spec = tl.shard_spec(param)
        expected = ref_params[pname].grad
        if spec is not None:
            sharded += 1
            assert spec.rank == rank and spec.world_size == WORLD
            expected = spec.slice(expected)
        torch.testing.assert_close(param.grad, expected, **TOL, msg=f"{name}: grad of {pname}")
    assert sharded > 0

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(**batch).loss
        ref_loss = reference(**batch).loss
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{name}: loss after step {step}")
        loss.backward()
        ref_loss.backward()


def _check_dropout(rank: int) -> None:
    """Dropout outside the sharded regions draws the same masks as the single-process
    model (the default generator stays in step on every rank); dropout inside a sharded
    region under fork_rng draws per-rank masks and leaves the default generator alone."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=128, n_positions=64,
            use_cache=False, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0))

    reference = make()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    tp_gpt2(sch, sp=False)
    batch = tp_models.batch()
    tl.set_random_seed(7, tp_rank=rank)
    loss = model(**batch).loss
    torch.manual_seed(7)
    ref_loss = reference(**batch).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)
    with torch.no_grad():  # dropout really ran: the loss without it is another number
        assert abs(reference.eval()(**batch).loss - ref_loss) > 1e-3

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    sch = tl.create_schedule(mlp)
    sch["0"].shard("weight", 0)  # column parallel
    sch["0"].shard("bias", 0)
    sch["0"].sync("bwd_post", "all_reduce")
    sch["2"].shard("weight", 1)  # row parallel (the bias stays whole)
    sch["2"].sync("fwd_post", "all_reduce")
    sch["1"].fork_rng()
    tl.set_random_seed(3, tp_rank=rank)
    hidden = mlp[1](torch.ones(4, 8))
    masks = [torch.empty_like(hidden) for _ in range(WORLD)]
    dist.all_gather(masks, hidden)
    assert not torch.equal(masks[0], masks[1])  # per-rank masks in the sharded region
    states = [torch.empty_like(torch.get_rng_state()) for _ in range(WORLD)]
    dist.all_gather(states, torch.get_rng_state())
    assert torch.equal(states[0], states[1])  # the default generator is still in step


def _check_traced_after_sharding(rank: int) -> None:
    """Tracing after shard + sync (Slapo lost the shard metadata there and added the
    row-parallel bias once per rank): the traced, sharded model still equals the
    reference, forward and backward, with the same collectives."""
    for make, schedule, levels in ((gpt2, tp_gpt2, "transformer.h.*"),
                                   (llama, tp_llama, "model.layers.*")):
        reference = make()
        model = copy.deepcopy(reference)
        sch = tl.create_schedule(model)
        schedule(sch, False)
        batch = tp_models.batch()
        sch.trace_until(levels, example_inputs=batch)
        assert any(tl.shard_spec(p) is not None for p in model.parameters())
        with count_collectives() as forward:
            out = model(**batch)
        torch.testing.assert_close(out.logits, reference(**batch).logits, **TOL)
        with count_collectives() as backward:
            out.loss.backward()
        reference(**batch).loss.backward()
        assert dict(forward) == dict(backward) == {"all_reduce": 2 * LAYERS}
        ref_params = dict(reference.named_parameters())
        for pname, param in model.named_parameters():
            spec = tl.shard_spec(param)
            expected = spec.slice(ref_params[pname].grad) if spec else ref_params[pname].grad
            torch.testing.assert_close(param.grad, expected, **TOL, msg=pname)


def _check_cases(rank: int) -> None:
    for case in CASES:
        _check_case(rank, *case)


def test_megatron_tp_and_sp_on_gpt2_bert_llama():
    spawn(_check_cases, _check_dropout, _check_traced_after_sharding)
