"""Transformers models with their DEFAULT configs (only the sizes shrunk; ``use_cache`` left
True, dropout on) train under checkpointing, tracing, pipeline splitting, ``Verify`` and
the built-in schedules, equal to the unscheduled model.

The project's other tests and its zoo set ``use_cache=False``; these do not. With the
default, a transformers model builds a KV cache even in training: a checkpointed layer
runs without it (one warning, as transformers' ``GradientCheckpointingLayer`` does), and a
traced module computes the training path without it (a cache where one would be used is
refused with the fix).

Equality is exact (``rtol=0``) except where the unscheduled model rounds differently
itself: T5 with and without its cache (keys concatenated into the cache are contiguous;
3.7e-8 between two runs of the *unscheduled* model with and without ``use_cache``), and a
traced Llama (its gradients differ from the eager model's by up to 2.2e-8 also with
``use_cache=False`` and before this change: the traced graph accumulates the rotary
embedding's gradient in another order). Those compare with ``rtol=1e-5, atol=1e-6``, and T5
also exactly against the unscheduled model called with ``use_cache=False``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchloom as tl
from tests.default_models import LAYERS, batch, default_model
from torchloom import schedules
from torchloom.core.errors import CheckpointError, TraceError, TraceGuardError
from torchloom.graph import guards, tracing
from torchloom.runtime.pipeline_split import replay_stages, split_stages

MODELS = ("gpt2", "bert", "llama", "opt", "t5", "vit")
CACHED = {"gpt2", "llama", "opt", "t5"}  # make a KV cache in training by default
INEXACT = {"llama", "t5"}  # see the module docstring


def step(model: torch.nn.Module, inputs: dict, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """One seeded forward and backward: the loss and every gradient by name."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**inputs)
    loss = out.loss if out.loss is not None else out.logits.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def assert_same(got: tuple, want: tuple, exact: bool = True) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert sorted(grads) == sorted(ref_grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=name)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    guards._WARNED.clear()  # one-time warnings: each test sees its own first one
    yield


# --------------------------------------------------------------------------- checkpoint


@pytest.mark.parametrize("name", MODELS)
def test_builtin_schedule_at_ratio_half_trains_like_the_model(name):
    model = default_model(name)
    assert getattr(model.config, "use_cache", False) is (name != "vit")
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, ckpt_ratio=0.5)
    assert sch.recipe[-1].call_text() == f"sch[{LAYERS[name]!r}].checkpoint(ratio=0.5)"
    inputs = batch(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(model, inputs)
        again = step(model, inputs)
    cache_warnings = [w for w in caught if "caching is incompatible" in str(w.message)]
    assert len(cache_warnings) == (1 if name in CACHED else 0)
    want = step(reference, inputs)
    assert_same(got, want, exact=name != "t5")
    assert_same(again, want, exact=name != "t5")
    if name == "t5":  # the fix the warning gives works for T5 too (its decoder config)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = step(model, {**inputs, "use_cache": False})
        assert_same(got, step(reference, {**inputs, "use_cache": False}))


def test_a_checkpointed_layer_runs_without_the_cache_and_says_so_once():
    model = default_model("gpt2")
    reference = copy.deepcopy(model)
    tl.create_schedule(model)["transformer.h.*"].checkpoint()
    ids = batch("gpt2")["input_ids"]
    with pytest.warns(UserWarning, match=r"caching is incompatible with activation "
                      r"checkpointing in GPT2Block \(at 'transformer\.h\.0' and the other "
                      r"checkpointed GPT2Block layers\): running them in training with "
                      r"cache=None, use_cache=False, as transformers does under gradient "
                      r"checkpointing\. Pass use_cache=False to the model call"):
        out = model(ids, labels=ids, use_cache=True)
    out.loss.backward()
    assert out.cache.get_seq_length() == 0  # no checkpointed layer wrote into it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        model(ids, labels=ids).loss.backward()
    torch.manual_seed(0)
    ref_loss = reference(ids, labels=ids).loss
    torch.manual_seed(0)
    assert torch.equal(model(ids, labels=ids).loss, ref_loss)
    with torch.no_grad():  # no checkpoint without gradients: generation keeps its cache
        assert model(ids, use_cache=True).cache.get_seq_length() == 16


def test_a_prefilled_cache_is_refused_by_a_checkpointed_layer():
    model = default_model("gpt2")
    ids = batch("gpt2")["input_ids"]
    with torch.no_grad():
        past = model(ids, use_cache=True).cache
    tl.create_schedule(model)["transformer.h.*"].checkpoint()
    with pytest.raises(
        CheckpointError,
        match=r"^sch\['transformer\.h\.0'\]\.checkpoint\(\.\.\.\): a checkpointed layer got a "
        r"KV cache holding past positions in training; .*\n    values: argument=1, "
        r"cache='DynamicCache', past_positions=16\n    fix: train without a prefilled cache: "
        r"model\(\.\.\., use_cache=False\) and no cache argument, or do not checkpoint this "
        r"layer$",
    ):
        model(ids, cache=past, labels=ids)


def test_checkpoint_of_a_traced_subgraph_on_a_default_model():
    model = default_model("gpt2")
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    attn = sch["transformer.h.0.attn"]
    attn.trace()  # inputs captured from a run of the whole model (without its cache)
    matches = attn.find(lambda node: node.target is F.scaled_dot_product_attention)
    assert len(matches) == 1
    attn.checkpoint(subgraph=matches[0])
    inputs = batch("gpt2")
    with pytest.warns(UserWarning, match=r"transformer\.h\.0\.attn: a KV cache is not used by "
                      r"a module traced without a cache in training"):
        got = step(model, inputs)
    assert_same(got, step(reference, inputs))


# --------------------------------------------------------------------------- trace


@pytest.mark.parametrize("name", MODELS)
def test_trace_until_the_layers_trains_like_the_model(name):
    model = default_model(name)
    reference = copy.deepcopy(model)
    inputs = batch(name)
    sch = tl.create_schedule(model)
    sch.trace_until(f"{LAYERS[name]}.*", example_inputs=inputs)
    assert tracing.is_traced(model) and tracing.is_traced(sch[f"{LAYERS[name]}.1"].mod)
    got = step(model, inputs)
    assert_same(got, step(reference, inputs), exact=name not in INEXACT)
    if name == "t5":  # exact against the model run without its cache
        assert_same(got, step(reference, {**inputs, "use_cache": False}))
    schedules.apply_schedule(sch, ckpt_ratio=0.5)  # the built-in schedule on the traced model
    assert_same(step(model, inputs), got)


def test_trace_until_without_example_inputs_on_the_default_gpt2():
    model = default_model("gpt2")
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h")  # was: TraceError ... argument of type DynamicCache
    assert [n.target for n in sch["transformer"].mod.graph.nodes
            if n.op == "call_module" and n.target.startswith("h.")] == ["h.0", "h.1"]
    ids = batch("gpt2")["input_ids"]
    for run in (model, reference):  # the example was the plain call: logits, no labels
        torch.manual_seed(0)
        run(ids).logits.pow(2).mean().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param.grad, ref.grad), name
    model.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_traced_default_model_in_eval_refuses_a_cache_with_the_fix():
    model = default_model("gpt2")
    reference = copy.deepcopy(model).eval()
    ids = batch("gpt2")["input_ids"]
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": ids})
    model.eval()
    with torch.no_grad():
        out = model(ids)  # use_cache None: the config says True, the graph returns none
        want = reference(ids)
    assert torch.equal(out.logits, want.logits) and out.cache is None
    fix = (r"\n    fix: call the model with use_cache=False and without a cache argument \(a "
           r"traced module never fills or returns a KV cache\); to generate with a cache, use "
           r"an untraced copy: ref = copy\.deepcopy\(model\) before tracing, then "
           r"ref\.load_state_dict\(model\.state_dict\(\)\)$")
    with torch.no_grad(), pytest.raises(
        TraceGuardError,
        match=r"^sch\[''\]\.trace\(\.\.\.\): a KV cache reached a module that torchloom traced "
        r"without a cache: the graph computes without past keys and does not fill the cache\n"
        r"    values: argument='cache', now='DynamicCache', training=False, "
        r"grad_enabled=False" + fix,
    ):
        model(ids, cache=want.cache)
    with torch.no_grad(), pytest.raises(TraceGuardError, match=r"(?s)use_cache=True reached" +
                                        r".*argument='use_cache', now=True.*" + fix):
        model(ids, use_cache=True)
    # in training, use_cache=True is not used (one warning), the result is unchanged
    model.train(), reference.train()
    with pytest.warns(UserWarning, match="use_cache=True is not used by a module traced"):
        torch.manual_seed(0)
        logits = model(ids, use_cache=True).logits
    torch.manual_seed(0)
    assert torch.equal(logits, reference(ids).logits)  # dropout on, the same masks


def test_a_partly_traced_default_model_in_eval_needs_use_cache_false():
    model = default_model("gpt2").eval()
    reference = copy.deepcopy(model)
    ids = batch("gpt2")["input_ids"]
    tl.create_schedule(model)["transformer.h.0"].trace()
    with torch.no_grad():
        with pytest.raises(TraceGuardError,
                           match=r"(?s)^sch\['transformer\.h\.0'\]\.trace\(\.\.\.\)"
                           r": a KV cache reached .*fix: call the model with use_cache=False"):
            model(ids)  # the untraced GPT2Model makes a cache in eval
        assert torch.equal(model(ids, use_cache=False).logits,
                           reference(ids, use_cache=False).logits)


def test_example_inputs_with_use_cache_false_then_calls_without_it():
    model = default_model("gpt2")
    ids = batch("gpt2")["input_ids"]
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": ids, "use_cache": False})
    model.eval()
    with torch.no_grad():  # was: TraceGuardError ... traced=False, now=None (no fix)
        for flag in ({}, {"use_cache": None}, {"use_cache": False}):
            model(ids, **flag)
    sch["transformer.h.0"].cut_pipeline_stage()
    stages = split_stages(sch, (ids,))  # what build(target="pipeline") runs
    assert len(stages.modules) == 2


def test_example_inputs_that_ask_for_a_cache_are_refused():
    model = default_model("gpt2")
    ids = batch("gpt2")["input_ids"]
    with pytest.raises(
        TraceError,
        match=r"^sch\[''\]\.trace\(\.\.\.\): the example inputs ask for a KV cache; "
        r"torchloom traces the training path, without a cache\n    values: "
        r"argument='use_cache', value=True\n    fix: leave 'use_cache' out of example_inputs "
        r"\(a traced module runs with use_cache=False\)$",
    ):
        tl.create_schedule(model).trace_until(
            "transformer.h.*", example_inputs={"input_ids": ids, "use_cache": True})
    assert not tracing.is_traced(model)


# --------------------------------------------------------------------------- pipeline, Verify


def test_two_stage_split_of_the_default_gpt2_replays_the_model():
    model = default_model("gpt2")
    ids = batch("gpt2")["input_ids"]
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": ids[:1]})
    sch["transformer.h.0"].cut_pipeline_stage()
    stages = split_stages(sch, (ids[:1],))
    assert [(t.names, t.stages) for t in tl.pipeline.tied_weights(sch, (ids[:1],))] == \
        [(("transformer.wte.weight", "lm_head.weight"), (0, 1))]
    model.eval()
    with torch.no_grad():
        staged = stages.modules[1](*stages.modules[0](ids[:1]))
        assert torch.equal(staged, model(ids[:1]).logits)
    model.train()
    (got, want), = replay_stages(stages, (ids[:1],))  # what Verify runs for each cut
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_verify_a_traced_checkpointed_and_cut_default_model(name):
    model = default_model(name)
    inputs = batch(name)
    sch = tl.create_schedule(model)
    verify = tl.Verify(sch, inputs, rtol=0, atol=0)
    with verify:
        sch.trace_until(f"{LAYERS[name]}.*", example_inputs=inputs)
        schedules.apply_schedule(sch, ckpt_ratio=0.5)
        sch[f"{LAYERS[name]}.0"].cut_pipeline_stage()
    assert verify.stats["forward output"] > 20 and verify.stats["parameter gradient"] > 20
