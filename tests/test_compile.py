"""The ``compile`` primitive: a module's forward under torch.compile, in place.

* outputs and every gradient equal the eager model's (inductor: within 1e-5, fp32);
* the module tree, Parameter objects and state-dict keys are unchanged, a deep copy runs;
* with ``checkpoint`` (applied before or after) the compiled code runs inside the
  checkpoint: saved activations drop, gradients stay equal, and in training the recompute
  draws the same dropout masks as the forward (checkpointed and plain compiled layers give
  the same gradients with dropout on);
* the stack of layers shares one compiled graph;
* the recipe round-trips; misuse raises a CompileError with the message pinned.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom.core.errors import CompileError
from torchloom.core.marks import COMPILED, has_mark
from torchloom.runtime.memory import count_saved
from torchloom.schedules import zoo
from torchloom.tools.testing import verify_recipe_roundtrip

TOL = dict(rtol=1e-5, atol=1e-5)


def _gpt2(dropout: float = 0.0) -> nn.Module:
    return zoo.make_model("gpt2", "tiny", seed=0, resid_pdrop=dropout, embd_pdrop=dropout,
                          attn_pdrop=dropout)


def _inputs(model: nn.Module) -> dict:
    return zoo.example_inputs("gpt2", model, batch_size=2, seq_len=16, seed=1)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def _step(model: nn.Module, inputs: dict, seed: int = 0) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), _grads(model)


def test_compiled_layers_equal_eager_and_keep_the_module_tree():
    reference = _gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    params = [id(p) for p in model.parameters()]
    text = str(model)
    sch["transformer.h.*"].compile()
    assert str(model) == text
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(has_mark(layer, COMPILED) for layer in model.transformer.h)
    inputs = _inputs(model)
    loss, grads = _step(model, inputs)
    ref_loss, ref_grads = _step(reference, inputs)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=f"grad of {name}")
    # Eval mode and no_grad run the compiled layers too.
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**inputs).logits,
                                   reference.eval()(**inputs).logits, **TOL)
    # A deep copy carries the compiled forward, pointing at the copy, and compiles again.
    clone = copy.deepcopy(model)
    assert clone.transformer.h[0].forward.module is clone.transformer.h[0]
    with torch.no_grad():
        torch.testing.assert_close(clone(**inputs).logits, reference(**inputs).logits, **TOL)


def test_the_layers_share_one_graph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].compile(backend="aot_eager")
    counters.clear()
    model(**_inputs(model)).loss.backward()
    assert len(model.transformer.h) == 2
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("order", ["checkpoint-then-compile", "compile-then-checkpoint"])
def test_compile_runs_inside_the_checkpoint(order):
    reference = _gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    steps = [lambda: sch["transformer.h"].checkpoint(ratio=1.0),
             lambda: sch["transformer.h.*"].compile()]
    for step in (steps if order == "checkpoint-then-compile" else steps[::-1]):
        step()
    outer = model.transformer.h[0].forward
    assert "checkpointed forward" in repr(outer)
    assert "compiled forward" in repr(outer.inner)

    inputs = _inputs(model)
    plain = copy.deepcopy(reference)
    tl.create_schedule(plain)["transformer.h.*"].compile()
    with count_saved(model) as saved_ckpt:
        loss = model(**inputs).loss
    with count_saved(plain) as saved_plain:
        plain_loss = plain(**inputs).loss
    assert saved_ckpt.total < saved_plain.total  # the checkpoint keeps only layer inputs
    loss.backward()
    ref_loss, ref_grads = _step(reference, inputs)
    torch.testing.assert_close(loss.detach(), ref_loss, **TOL)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, **TOL,
                                   msg=f"grad of {name}")
    del plain_loss


def test_recompute_draws_the_same_dropout_masks():
    """Training with dropout: a checkpointed compiled layer (whose backward reruns the
    compiled forward) gives the gradients of the plain compiled layer under the same
    seed, and the masks really are random (another seed gives another loss)."""
    base = _gpt2(dropout=0.3)
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    tl.create_schedule(plain)["transformer.h.*"].compile()
    sch = tl.create_schedule(ckpt)
    sch["transformer.h"].checkpoint(ratio=1.0)
    sch["transformer.h.*"].compile()
    inputs = _inputs(base)
    loss, grads = _step(plain, inputs, seed=3)
    ckpt_loss, ckpt_grads = _step(ckpt, inputs, seed=3)
    torch.testing.assert_close(ckpt_loss, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, **TOL, msg=f"grad of {name}")
    other, _ = _step(copy.deepcopy(base).train(), inputs, seed=4)
    assert abs(other - loss) > 1e-4


def test_recipe_round_trip():
    model = _gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h"].checkpoint(ratio=0.5)
    sch["transformer.h.*"].compile(backend="aot_eager", dynamic=False)
    assert str(sch.recipe).splitlines()[-1] == \
        "sch['transformer.h.1'].compile(backend='aot_eager', dynamic=False)"
    verify_recipe_roundtrip(sch, _gpt2, _inputs(model))


def test_fork_rng_stays_outside_the_compiled_code():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    sch = tl.create_schedule(model)
    sch["1"].fork_rng()
    sch["1"].compile(backend="aot_eager")
    assert "fork_rng forward" in repr(model[1].forward)
    assert "compiled forward" in repr(model[1].forward.inner)
    tl.set_random_seed(0, tp_rank=0)
    state = torch.get_rng_state()
    out = model(torch.ones(4, 8))
    assert torch.equal(torch.get_rng_state(), state)  # drawn from the tracker's stream
    assert (out == 0).any()


def _error(fn, match: str) -> CompileError:
    with pytest.raises(CompileError, match=match) as info:
        fn()
    return info.value


def test_errors_are_pinned():
    model = _gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.0"].compile(backend="eager")
    err = _error(lambda: sch["transformer.h.0"].compile(),
                 r"^sch\['transformer\.h\.0'\]\.compile\(\.\.\.\): this module is compiled "
                 r"already\n")
    assert str(err) == (
        "sch['transformer.h.0'].compile(...): this module is compiled already\n"
        "    values: module='GPT2Block'\n"
        "    fix: compile it once: remove the second sch['transformer.h.0'].compile()")
    err = _error(lambda: sch["transformer.h"].compile(),
                 r"^sch\['transformer\.h'\]\.compile\(\.\.\.\): a ModuleList has no forward of "
                 r"its own")
    assert str(err) == (
        "sch['transformer.h'].compile(...): a ModuleList has no forward of its own; its items "
        "are called one by one\n"
        "    values: module='ModuleList'\n"
        "    fix: compile the items: sch['transformer.h.*'].compile()")
    err = _error(lambda: sch["transformer.h.1"].compile(backend="inductr"),
                 r"torch\.compile has no backend 'inductr'")
    assert err.values["backend"] == "inductr" and "inductor" in err.values["backends"]
    assert str(err).startswith(
        "sch['transformer.h.1'].compile(...): torch.compile has no backend 'inductr'")
    assert err.fix == "backend='inductor' (the default), 'aot_eager' or 'eager'"
    err = _error(lambda: sch["transformer.h.1"].compile(mode="fast"),
                 r"torch\.compile has no mode 'fast'")
    assert str(err).startswith("sch['transformer.h.1'].compile(...): torch.compile has no "
                               "mode 'fast'")
    err = _error(lambda: sch["transformer.h.1"].compile(backend=3),
                 r"^sch\['transformer\.h\.1'\]\.compile\(\.\.\.\): backend must be a backend name "
                 r"or a backend callable\n")
    assert err.values == {"backend": "3"}
    err = _error(lambda: sch["transformer.h.1"].compile(dynamic="yes"),
                 r"dynamic must be None, True or False and fullgraph True or False")
    assert err.values == {"dynamic": "'yes'", "fullgraph": "False"}
    layer = model.transformer.h[1]
    layer.forward = lambda *a, **k: type(layer).forward(layer, *a, **k)
    err = _error(lambda: sch["transformer.h.1"].compile(),
                 r"the module's forward was replaced on the instance by something torchloom "
                 r"did not install")
    assert "did not install" in err.problem
    assert err.fix.startswith("compile the module before replacing its forward")
    assert len(sch.recipe) == 1  # failed calls record nothing


def test_group_compile_and_primitive_listing():
    assert "compile" in tl.list_primitives()
    assert issubclass(tl.CompileError, tl.ScheduleError)
    model = _gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].compile(backend="eager")
    assert [e.call_text() for e in sch.recipe] == [
        "sch['transformer.h.0'].compile(backend='eager')",
        "sch['transformer.h.1'].compile(backend='eager')"]


def test_replay_on_a_fresh_model_compiles_it():
    model = _gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].compile(backend="eager")
    fresh = tl.apply_recipe(_gpt2(), sch.recipe)
    assert all(has_mark(layer, COMPILED) for layer in fresh.mod.transformer.h)
    verify = partial(verify_recipe_roundtrip, sch, _gpt2)
    verify(_inputs(model))
