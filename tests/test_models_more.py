"""The built-in OPT, T5 and ViT schedules in one process.

With a world of one, tensor parallelism records its shards and syncs and changes nothing,
and checkpointing recomputes the same values: the scheduled model's outputs and every
gradient equal the unscheduled model's exactly. The recipes survive JSON, printing and
replay. Sequence parallelism, which OPT and T5 cannot run, is refused with a reason.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom import models, zoo
from torchloom.errors import ScheduleError
from torchloom.testing import verify_recipe_roundtrip

# Config overrides that turn off the dropout the modules hold as float attributes.
NO_DROPOUT = {"opt": {"dropout": 0.0, "attention_dropout": 0.0}, "t5": {"dropout_rate": 0.0},
              "vit": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "gpt2": {}, "bert": {}, "llama": {}}

# (zoo name, extra config fields, transformers class to build instead of the zoo's)
CASES = [
    ("gpt2", {}, None),
    ("bert", {}, None),
    ("llama", {}, None),
    ("opt", {}, None),
    ("opt", {}, "OPTModel"),
    ("t5", {}, None),
    ("t5", {"feed_forward_proj": "gated-gelu"}, None),  # DenseGatedActDense: wi_0, wi_1
    ("t5", {}, "T5Model"),
    ("vit", {}, None),
    ("vit", {}, "ViTModel"),
]


def _make(name: str, extra: dict, cls: str | None) -> nn.Module:
    model = zoo.make_model(name, "tiny", seed=0, **NO_DROPOUT[name], **extra)
    if cls is not None:
        import transformers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(transformers, cls)(model.config).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _inputs(name: str, model: nn.Module, cls: str | None) -> dict:
    inputs = zoo.example_inputs(name, model, batch_size=2, seq_len=8)
    if cls == "T5Model":
        return {"input_ids": inputs["input_ids"], "decoder_input_ids": inputs["labels"]}
    if cls is not None:
        inputs.pop("labels")
    return inputs


def _loss(out) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out[0].pow(2).mean()


@pytest.mark.parametrize("name,extra,cls", CASES, ids=lambda v: str(v) if v else "")
def test_schedule_changes_nothing_in_one_process(name, extra, cls):
    reference = _make(name, extra, cls)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, cls)
    sch = tl.create_schedule(model)
    models.apply_schedule(sch, tp=True, ckpt_ratio=0.5)
    assert any(tl.shard_spec(p) is not None for p in model.parameters())
    assert "checkpoint(ratio=0.5)" in str(sch.recipe)

    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=0, atol=0)
    _loss(out).backward()
    _loss(ref_out).backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=0, atol=0,
                                   msg=f"grad of {pname}")

    verify_recipe_roundtrip(sch, partial(_make, name, extra, cls), inputs)


def test_heads_per_rank_factories_are_in_the_recipe():
    sch = tl.create_schedule(_make("t5", {}, None))
    models.apply_schedule(sch, tp=True)
    text = str(sch.recipe)
    assert "relative_attention_bias'].shard('weight', 1)" in text
    assert "EncDecAttention'].sync('bwd_post', 'all_reduce', input_name='key_value_states')" \
        in text
    assert "heads_per_rank" in text
    sch = tl.create_schedule(_make("opt", {}, None))
    models.apply_schedule(sch, tp=True)
    assert "heads_per_rank" in str(sch.recipe)


@pytest.mark.parametrize("name", ["opt", "t5"])
def test_sequence_parallel_is_refused_where_it_cannot_work(name):
    sch = tl.create_schedule(_make(name, {}, None))
    with pytest.raises(ScheduleError) as info:
        models.apply_schedule(sch, tp=True, sequence_parallel=True)
    err = info.value
    assert err.primitive == f"models.schedule_{name}"
    assert err.values["sequence_parallel"] is True
    assert "without sequence_parallel" in err.fix
    assert len(sch.recipe) == 0  # nothing was applied


def test_vit_sequence_parallel_in_one_process():
    reference = _make("vit", {"image_size": 24}, None)
    model = copy.deepcopy(reference)
    inputs = _inputs("vit", reference, None)
    sch = tl.create_schedule(model)
    models.apply_schedule(sch, tp=True, sequence_parallel=True)
    torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits,
                               rtol=0, atol=0)


@pytest.mark.parametrize("name,extra,cls", CASES, ids=lambda v: str(v) if v else "")
def test_compile_knob_keeps_outputs_and_gradients(name, extra, cls):
    """``compile=`` compiles every transformer layer in place (here with aot_eager, which
    captures and differentiates the graph like inductor but runs eager kernels) on top of
    TP and checkpointing; outputs and gradients stay equal."""
    reference = _make(name, extra, cls)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, cls)
    sch = tl.create_schedule(model)
    models.apply_schedule(sch, tp=True, ckpt_ratio=0.5, compile="aot_eager")
    compiled = [path for path, node in sch.named_schedules()
                if getattr(node.mod, "_torchloom_compiled", False)]
    layer_paths = [f"{stack}.{i}" for stack in zoo.layer_paths(name)
                   for i in range(len(model.get_submodule(stack)))] if cls is None else None
    if layer_paths is not None:
        assert compiled == layer_paths
    assert compiled and all("compile('aot_eager')" in line
                            for line in str(sch.recipe).splitlines() if "compile(" in line)
    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-5, atol=1e-6)
    _loss(out).backward()
    _loss(ref_out).backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-6,
                                   msg=f"grad of {pname}")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_kernel_knobs_with_inductor(name):
    """GPT-2 and BERT with torchloom's kernels (SDPA attention, fused blocks) and every
    layer compiled by inductor: outputs and gradients within 1e-5 of the original."""
    reference = _make(name, {}, None)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, None)
    sch = tl.create_schedule(model)
    models.apply_schedule(sch, attention="sdpa", fused=True, ckpt_ratio=0.5, compile=True)
    text = str(sch.recipe)
    assert "make_sdpa_" in text and "make_fused_" in text and ".compile('inductor')" in text
    assert list(model.state_dict()) == list(reference.state_dict())
    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-5, atol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-5,
                                   msg=f"grad of {pname}")


def test_kernel_knob_errors():
    sch = tl.create_schedule(_make("gpt2", {}, None))
    with pytest.raises(ScheduleError) as info:
        models.apply_schedule(sch, tp=True, fused=True)
    assert str(info.value).splitlines()[0] == (
        "sch[''].models.schedule_gpt2(...): the fused blocks compute their projections "
        "without calling the projection modules, so tensor parallelism's sync hooks on those "
        "modules would not run")
    assert info.value.fix.startswith("apply_schedule(sch, tp=True, compile=True)")
    with pytest.raises(ScheduleError) as info:
        models.apply_schedule(sch, attention="flash")
    assert info.value.values == {"attention": "flash", "choices": ["model", "sdpa"]}
    with pytest.raises(ScheduleError) as info:
        models.apply_schedule(sch, tp=True, ckpt_ratio=0.5, compile=1)
    assert info.value.values == {"compile": "1"}
    assert info.value.path == ""
    assert len(sch.recipe) == 0
