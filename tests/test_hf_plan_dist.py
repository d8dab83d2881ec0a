"""Schedules derived from transformers' parallel plans, at TP=2 on two gloo ranks.

For each family below (transformers' default config, only sizes changed): the derived
schedule (:func:`torchloom.schedules.hf_plan.from_hf_plan`, checkpoint ratio 0.5, sequence
parallelism where the plan allows it) is applied inside ``tl.Verify`` (the static check,
then every module's output, input gradient and parameter gradient against the
single-process model), then the built model trains two SGD steps whose losses equal the
single-process model's. The families cover dense attention with grouped KV heads, biases,
tied embeddings, fewer KV heads than ranks (replicated), gathered (``colwise_gather_output`` / ``rowwise_split_input``) layouts,
per-head norms (``replicated_with_grad_allreduce``), mixture-of-experts blocks (experts
split within, shared experts), multi-head latent attention, an encoder, an
encoder-decoder and a vision encoder, plus a plan passed by the user.

Also: Verify's static check accepts a column-parallel Linear resharded with
``sync("fwd_post", "RS->SR")`` (issue 15 item 1), and the collectives per step of the
derived and the hand-written Llama schedules (both sum the attention block's input
gradient once, not once per q/k/v projection: the derived one with
``sync("bwd_post", "all_reduce", shared=True)`` on the siblings). One launch runs it all.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import torchloom as tl
from tests.dist import spawn
from tests.hf_plan_models import (
    LAYERS,
    esmc,
    gemma,
    gemma4_vision,
    llama,
    minicpm3,
    mistral,
    mixtral,
    olmo2,
    patches,
    phi3,
    qwen2,
    qwen2_moe,
    qwen2_mqa,
    qwen3,
    starcoder2,
    t5gemma,
    text,
    ultrabert,
)
from torchloom import schedules
from torchloom.runtime.collectives import count_collectives
from torchloom.schedules import ScheduleConfig
from torchloom.schedules.hf_plan import from_hf_plan, tp_plan_of
from torchloom.schedules.llama import schedule_llama

TOL = {"rtol": 1e-5, "atol": 1e-5}


def esmc_gathered_plan(model: nn.Module) -> dict[str, str]:
    """ESMC's q/k norms normalise all heads at once, so its own plan (q/k/v column
    parallel) is refused; gathering q/k/v, as OLMo-2's plan does, is correct."""
    plan = tp_plan_of(model)
    for name in ("q_proj", "k_proj", "v_proj"):
        plan[f"esmc.layers.*.self_attn.{name}"] = "colwise_gather_output"
    plan["esmc.layers.*.self_attn.o_proj"] = "rowwise_split_input"
    return plan


def loss_of(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    hidden = output.last_hidden_state
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
    return (hidden * weights).sum()


# (family, model, inputs, sequence parallel, plan or None)
FAMILIES: list[tuple[str, Callable[[], nn.Module], Callable[[], dict], bool, Any]] = [
    ("llama", llama, text, True, None),
    ("qwen2", qwen2, text, True, None),
    ("mistral", mistral, text, False, None),
    ("qwen2_mqa", qwen2_mqa, text, True, None),
    ("gemma", gemma, text, True, None),
    ("phi3", phi3, text, True, None),
    ("qwen3", qwen3, text, False, None),
    ("olmo2", olmo2, text, True, None),
    ("starcoder2", starcoder2, text, False, None),
    ("mixtral", mixtral, text, False, None),
    ("qwen2_moe", qwen2_moe, text, False, None),
    ("minicpm3", minicpm3, text, True, None),
    ("ultrabert", ultrabert, text, True, None),
    ("t5gemma", t5gemma, lambda: text(seq2seq=True), False, None),
    ("gemma4_vision", gemma4_vision, patches, True, None),
    ("esmc", esmc, text, False, esmc_gathered_plan),
]


def _check_family(rank: int, family: str, make, inputs, sp: bool, plan) -> None:
    torch.manual_seed(0)
    model = make().train()
    reference = copy.deepcopy(model)
    batch = inputs()
    sch = tl.create_schedule(model)
    knobs = {"plan": plan(model)} if plan is not None else {}
    verify = tl.Verify(sch, batch)
    with verify:  # static check, then outputs and gradients against one process
        from_hf_plan(sch, sequence_parallel=sp, ckpt_ratio=0.5, **knobs)
    assert verify.stats["parameter gradient"] > 0, family
    assert any(e.primitive == "shard" for e in sch.recipe), family
    assert any(e.primitive == "checkpoint" for e in sch.recipe), family
    if family == "qwen2_mqa":  # the one KV head is replicated, its gradients summed
        lines = [e.call_text() for e in sch.recipe]
        attn = "model.layers.0.self_attn"
        assert f"sch['{attn}'].replace(torchloom.schedules.llama.replicate_kv_heads)" in lines
        assert f"sch['{attn}.k_proj.grad_sum'].sync('bwd_post', 'all_reduce')" in lines

    model, _ = tl.build(sch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        loss, ref_loss = loss_of(model(**batch)), loss_of(reference(**batch))
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{family}: loss at step {step}")
        loss.backward()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _check_families(rank: int) -> None:
    for family, make, inputs, sp, plan in FAMILIES:
        _check_family(rank, family, make, inputs, sp, plan)


def _check_apply_schedule(rank: int) -> None:
    """schedules.apply_schedule picks the derived schedule for a class without a
    hand-written one (Qwen2), with the built-in schedules' knobs."""
    torch.manual_seed(0)
    sch = tl.create_schedule(qwen2())
    with tl.Verify(sch, text()):
        schedules.apply_schedule(sch, tp=True, sequence_parallel=True, ckpt_ratio=1.0)
    assert schedules.schedule_for(sch.mod).__name__ == "schedule_hf_plan"


def _check_reshard_column(rank: int) -> None:
    """A column-parallel Linear whose output is resharded to whole features on a slice
    of the sequence (``RS->SR``), consumed by an unsharded Linear on that slice, then
    gathered: the static check accepts it and the outputs and gradients match."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    sch = tl.create_schedule(mlp)
    with tl.Verify(sch, (torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)),)):
        sch["0"].shard("weight", 0)
        sch["0"].shard("bias", 0)
        sch["0"].sync("bwd_post", "all_reduce")
        sch["0"].sync("fwd_post", "RS->SR")
        sch["2"].sync("param_grad", "all_reduce")  # used on a slice of the sequence
        sch["2"].sync("fwd_post", "SR->RR")


def _counts(schedule: Callable[[tl.Schedule], None]) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = llama().train()
    sch = tl.create_schedule(model)
    schedule(sch)
    model, _ = tl.build(sch)
    with count_collectives() as forward:
        loss = model(**text()).loss
    with count_collectives() as backward:
        loss.backward()
    return dict(forward), dict(backward)


# Per step at TP=2 with LAYERS layers. Hand-written: one all-reduce after each row-parallel
# module in forward, one per region (attention, MLP) on the input gradient in backward.
# Derived: the plan's vocabulary-parallel embedding (one all-reduce) and gathered head
# (one all-gather; its backward keeps this rank's slice), and in backward one all-reduce
# per group of column-parallel siblings reading the same input (q, k and v; gate and up:
# shared=True) and one for the head's input. Before the siblings shared it, the backward
# took one per column-parallel module: 5 * LAYERS + 1 (5 * LAYERS with the vocabulary whole).
HAND = ({"all_reduce": 2 * LAYERS}, {"all_reduce": 2 * LAYERS})
DERIVED = ({"all_reduce": 2 * LAYERS + 1, "all_gather": 1}, {"all_reduce": 2 * LAYERS + 1})
DERIVED_WHOLE_VOCAB = ({"all_reduce": 2 * LAYERS}, {"all_reduce": 2 * LAYERS})


def _check_collective_counts(rank: int) -> None:
    hand = _counts(lambda sch: schedule_llama(sch, ScheduleConfig.of(sch, tp=True)))
    derived = _counts(lambda sch: from_hf_plan(sch))
    whole = _counts(lambda sch: from_hf_plan(sch, vocab_parallel=False))
    assert hand == HAND, hand
    assert derived == DERIVED, derived
    assert whole == DERIVED_WHOLE_VOCAB, whole
    if rank == 0:
        print(f"\nLlama TP=2, {LAYERS} layers, collectives (forward, backward): "
              f"hand-written {hand}, derived {derived}, derived vocab_parallel=False {whole}")


@pytest.mark.slow
def test_derived_schedules_verify_and_train_at_tp2():
    assert len(FAMILIES) >= 10
    spawn(_check_reshard_column, _check_collective_counts, _check_apply_schedule,
          _check_families, timeout_s=120)
