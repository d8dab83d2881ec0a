"""replace and replace_all: module swap, hooks of every kind, numerics, errors."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.helpers import (
    ExplicitMLP,
    TanhGelu,
    make_explicit_mlp,
    make_tanh_gelu,
    make_tanh_gelu_at,
)
from torchloom.core.marks import CHECKPOINTED, FORK_RNG, has_mark
from torchloom.tools.testing import verify_recipe_roundtrip


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_replace_keeps_outputs_and_gradients_of_gpt2():
    reference = tiny.gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.*.mlp"].replace(make_explicit_mlp)
    assert isinstance(model.transformer.h[1].mlp, ExplicitMLP)
    assert sch["transformer.h.1.mlp.c_fc"].mod is model.transformer.h[1].mlp.c_fc
    batch = tiny.token_batch()
    loss, grads = _loss_and_grads(model, batch)
    ref_loss, ref_grads = _loss_and_grads(reference, batch)
    # Same parameters, same math in another order of operations: fp32 round-off only.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()  # state-dict keys are stable
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)
    verify_recipe_roundtrip(sch, tiny.gpt2, (batch["input_ids"],))


def test_replace_all_on_bert():
    reference = tiny.bert()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    act_type = type(model.bert.encoder.layer[0].intermediate.intermediate_act_fn)
    sch.replace_all(act_type, make_tanh_gelu_at)
    assert len(sch.recipe) == 1
    # BERT's default act is exact GELU; the tanh form differs slightly.
    batch = tiny.token_batch()
    loss, _ = _loss_and_grads(model, batch)
    ref_loss, _ = _loss_and_grads(reference, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    assert all(isinstance(layer.intermediate.intermediate_act_fn, TanhGelu)
               for layer in model.bert.encoder.layer)
    verify_recipe_roundtrip(sch, tiny.bert, (batch["input_ids"],))


def test_every_kind_of_hook_is_carried_over():
    model = nn.Sequential(nn.Linear(3, 3))
    old = model[0]
    calls: list[str] = []
    handles = [
        old.register_forward_pre_hook(lambda m, a: calls.append("pre")),
        old.register_forward_pre_hook(lambda m, a, k: calls.append("pre_kw"), with_kwargs=True),
        old.register_forward_hook(lambda m, a, o: calls.append("post")),
        old.register_forward_hook(lambda m, a, k, o: calls.append("post_kw"), with_kwargs=True),
        old.register_forward_hook(lambda m, a, o: calls.append("always"), always_call=True),
        old.register_full_backward_pre_hook(lambda m, g: calls.append("bwd_pre")),
        old.register_full_backward_hook(lambda m, gi, go: calls.append("bwd")),
        old.register_state_dict_post_hook(lambda m, sd, p, lm: calls.append("sd_post")),
        old.register_state_dict_pre_hook(lambda m, p, kv: calls.append("sd_pre")),
        old.register_load_state_dict_pre_hook(lambda *a: calls.append("load_pre")),
        old.register_load_state_dict_post_hook(lambda m, k: calls.append("load_post")),
    ]
    sch = tl.create_schedule(model)
    new = nn.Linear(3, 3)
    sch["0"].replace(new)
    assert model[0] is new
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()
    state = model.state_dict()
    model.load_state_dict(state)
    assert calls == ["pre", "pre_kw", "post", "post_kw", "always", "bwd_pre", "bwd",
                     "sd_pre", "sd_post", "load_pre", "load_post"]
    for handle in handles:  # the user's handles still remove the hooks from the new module
        handle.remove()
    calls.clear()
    model(x).sum().backward()
    assert calls == []


def test_training_mode_and_shard_metadata_survive_replace():
    model = tiny.gpt2()
    model.eval()
    sch = tl.create_schedule(model)
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "colwise", True)
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    new = model.transformer.h[0].mlp
    assert not new.training
    spec = tl.shard_spec(new.c_fc.weight)
    assert spec == tl.ShardSpec(axis=1, full_shape=(32, 128), world_size=1, rank=0)
    assert new.c_fc.weight.colwise is True


def test_replace_root():
    model = nn.Linear(2, 2)
    sch = tl.create_schedule(model)
    sch.replace(make_tanh_gelu)
    assert isinstance(sch.mod, TanhGelu)
    built, optimizer = tl.build(sch)
    assert built is sch.mod and optimizer is None


def test_replace_errors():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(tl.ReplaceError, match=re.escape(
            "sch['0'].replace(...): replace needs an nn.Module or a factory, not a int")):
        sch["0"].replace(3)
    with pytest.raises(tl.ReplaceError, match="the factory returned a str, not an nn.Module"):
        sch["0"].replace(lambda old: "nope")
    with pytest.raises(tl.ReplaceError, match="a whole-module replace keeps the node's name"):
        sch["0"].replace(nn.ReLU(), name="other")
    with pytest.raises(tl.ReplaceError, match="replacing a subgraph .* needs a traced module"):
        sch["0"].replace(nn.ReLU(), target_ops=[object()])
    assert len(sch.recipe) == 0  # failed calls are not recorded


def test_replace_all_errors():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(tl.ReplaceError, match=r"no module below this node is a GELU"):
        sch.replace_all(nn.GELU, make_tanh_gelu_at)
    with pytest.raises(tl.ReplaceError, match="module_type must be an nn.Module subclass"):
        sch.replace_all("GELU", make_tanh_gelu_at)


def test_checkpoint_and_fork_rng_follow_a_replaced_module():
    model = tiny.gpt2(dropout=0.1)
    sch = tl.create_schedule(model)
    sch["transformer.h.0.mlp"].fork_rng()
    sch["transformer.h.0.mlp"].checkpoint()
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    new = model.transformer.h[0].mlp
    assert has_mark(new, CHECKPOINTED) and has_mark(new, FORK_RNG)
    # A factory that keeps the old (already checkpointed) module inside adds nothing.
    sch["transformer.h.1.mlp"].checkpoint()
    sch["transformer.h.1.mlp"].replace(lambda old: old)
    assert has_mark(model.transformer.h[1].mlp, CHECKPOINTED)
    tl.set_random_seed(0)
    model(**tiny.token_batch()).loss.backward()
