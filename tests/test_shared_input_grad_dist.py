"""Column-parallel siblings that read one tensor all-reduce its gradient once (issue 26).

The schedule derived from a transformers plan puts ``sync("bwd_post", "all_reduce",
shared=True)`` on q_proj, k_proj and v_proj (gate_proj and up_proj): the siblings handed
the same tensor in one call of their parent pass it through one ``copy_to_group``, so
autograd sums their parts of its gradient first and the backward all-reduces once
(before: once per projection, 5 per Llama layer instead of 2).

On two gloo ranks: one Llama decoder layer's attention and MLP each all-reduce their
input gradient once in backward, and every gradient equals the unsharded model's; the
whole model's backward all-reduces with checkpointing, sequence parallelism and
``compile`` (dynamo traces the hooks); Verify (with its recording hooks, under which the
siblings reduce their own) and a recipe replay. In one process: the refusals and the
static check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import torchloom as tl
from tests.dist import spawn
from tests.hf_plan_models import DENSE, LAYERS, text
from torchloom.core.errors import SyncError
from torchloom.core.marks import SYNCS, get_mark
from torchloom.runtime.collectives import count_collectives
from torchloom.schedules.hf_plan import from_hf_plan
from torchloom.tools.check import check

TOL = {"rtol": 1e-5, "atol": 1e-5}
SIBLINGS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")


def llama(layers: int = LAYERS) -> nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(**{**DENSE, "num_hidden_layers": layers})).train()


def _compare_grads(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient equals the reference's (a sharded one, its slice)."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        spec = tl.shard_spec(param)
        if spec is not None:
            expected = spec.slice(expected)
        torch.testing.assert_close(param.grad, expected, **TOL, msg=f"grad of {name}")


def _check_one_layer(rank: int) -> None:
    """Attention and MLP of one decoder layer at TP=2: one backward all-reduce each
    (q/k/v: 1, gate/up: 1), input and parameter gradients equal to one process."""
    torch.manual_seed(0)
    reference = llama(1)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    from_hf_plan(sch, vocab_parallel=False)
    lines = [e.call_text() for e in sch.recipe]
    for name in SIBLINGS:
        line = f"sch['model.layers.0.{name}'].sync('bwd_post', 'all_reduce', shared=True)"
        assert line in lines, lines
    model, _ = tl.build(sch)
    layer, ref_layer = model.model.layers[0], reference.model.layers[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, DENSE["hidden_size"], generator=gen)
    rope = reference.model.rotary_emb(x, torch.arange(8)[None])

    def attention(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return module(h, position_embeddings=rope, attention_mask=None)[0]

    def mlp(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return module(h)

    for name, run in (("self_attn", attention), ("mlp", mlp)):
        h, ref_h = x.clone().requires_grad_(), x.clone().requires_grad_()
        with count_collectives() as forward:
            out = run(getattr(layer, name), h)
        ref_out = run(getattr(ref_layer, name), ref_h)
        torch.testing.assert_close(out, ref_out, **TOL, msg=f"{name}: output")
        weights = torch.randn(out.shape, generator=gen)
        with count_collectives() as backward:
            (out * weights).sum().backward()
        (ref_out * weights).sum().backward()
        assert dict(forward) == {"all_reduce": 1}, (name, dict(forward))  # the row module's
        assert dict(backward) == {"all_reduce": 1}, (name, dict(backward))
        torch.testing.assert_close(h.grad, ref_h.grad, **TOL, msg=f"{name}: input gradient")
    _compare_grads(layer, ref_layer)


# Backward all-reduces per step at TP=2 with LAYERS layers (the head is gathered and its
# input gradient all-reduced: + 1). Before the siblings shared it: 5 per layer, not 2.
# Checkpointing adds the recompute's forward all-reduces: torch's non-reentrant checkpoint
# stops recomputing once the saved tensors are back, before down_proj's all-reduce, so one
# per layer (o_proj's). Sequence parallelism adds the norms' parameter-gradient all-reduces
# (2 per layer) and turns the row modules' forward reduce-scatters into backward all-gathers.
CASES = [
    ({}, {"all_reduce": 2 * LAYERS + 1}),
    ({"ckpt_ratio": 1.0}, {"all_reduce": 2 * LAYERS + 1 + LAYERS}),
    ({"sequence_parallel": True},
     {"all_reduce": 2 * LAYERS + 1 + 2 * LAYERS, "all_gather": 2 * LAYERS + 1}),
    ({"compile": "eager"}, {"all_reduce": 2 * LAYERS + 1}),
]


def _check_whole_model(rank: int) -> None:
    for knobs, expected in CASES:
        torch.manual_seed(0)
        reference = llama()
        model = copy.deepcopy(reference)
        sch = tl.create_schedule(model)
        from_hf_plan(sch, **knobs)
        model, _ = tl.build(sch)
        batch = text()
        loss = model(**batch).loss
        with count_collectives() as backward:
            loss.backward()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{knobs}: loss")
        assert dict(backward) == expected, (knobs, dict(backward))
        _compare_grads(model, reference)


def _check_verify_and_replay(rank: int) -> None:
    """Under Verify each sibling is handed its own recorded view and reduces its own
    (still exact); the recipe replays onto a fresh model with the same syncs."""
    torch.manual_seed(0)
    model = llama()
    fresh = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    with tl.Verify(sch, text()):
        from_hf_plan(sch, sequence_parallel=True)
    replayed = tl.apply_recipe(fresh, sch.recipe)
    for (name, module), (_, again) in zip(model.named_modules(), replayed.mod.named_modules()):
        ours = [s.describe() for s in get_mark(module, SYNCS, [])]
        assert ours == [s.describe() for s in get_mark(again, SYNCS, [])], name
    q = model.model.layers[0].self_attn.q_proj
    assert "bwd_post all_reduce(shared)" in [s.describe() for s in get_mark(q, SYNCS)]


@pytest.mark.slow
def test_column_siblings_reduce_their_input_gradient_once():
    spawn(_check_one_layer, _check_whole_model, _check_verify_and_replay, timeout_s=180)


# --------------------------------------------------------------------------- one process


def test_shared_sync_passes_the_static_check():
    sch = tl.create_schedule(llama(1))
    from_hf_plan(sch)
    assert check(sch).ok, check(sch)


@pytest.mark.parametrize("call, message", [
    (lambda sch: sch["0"].sync("fwd_post", "all_reduce", shared=True),
     "applies to sync\\('bwd_post', 'all_reduce'\\) only"),
    (lambda sch: sch.sync("bwd_post", "all_reduce", shared=True), "root of the schedule"),
    (lambda sch: sch["0"].sync("bwd_post", "all_reduce", shared="yes"),
     "shared must be True or False"),
])
def test_shared_sync_refusals(call, message):
    sch = tl.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(SyncError, match=message) as info:
        call(sch)
    assert info.value.fix


def test_shared_sync_is_refused_twice_and_beside_the_plain_one():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    sch["0"].sync("bwd_post", "all_reduce", shared=True)
    for shared in (True, False):
        with pytest.raises(SyncError, match="already has this sync"):
            sch["0"].sync("bwd_post", "all_reduce", shared=shared)


def test_a_deep_copy_shares_within_itself():
    """copy.deepcopy of a scheduled model: the copy's siblings use the copy's scope (the
    one its parent opens), not the original's."""
    from torchloom.primitives.sync_shared import SharedReduce, scope_of

    model = llama(1)
    from_hf_plan(tl.create_schedule(model))
    clone = copy.deepcopy(model)
    for root in (model, clone):
        attn = root.model.layers[0].self_attn
        scopes = [h.op.scope for name in ("q_proj", "k_proj", "v_proj")
                  for h in getattr(attn, name)._forward_pre_hooks.values()
                  if isinstance(getattr(h, "op", None), SharedReduce)]
        assert len(scopes) == 3 and all(s is scope_of(attn) for s in scopes)
    assert scope_of(clone.model.layers[0].self_attn) is not \
        scope_of(model.model.layers[0].self_attn)
