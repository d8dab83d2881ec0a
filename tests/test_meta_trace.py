"""Meta all the way: models built under ``tl.init_empty_weights()`` (no weight exists) are
traced, searched, cut and split into pipeline stages, with example inputs or without
(dummy inputs made from the config), and verified, without allocating their weights.

``benchmarks`` are not tests: the 69 B Llama figure is in the notes; here a mid-size config
(1.3 GB of fp32 weights if they existed) checks that the anonymous memory of the process
grows by far less than that while it is traced and split.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import transformers
from torch import nn

import torchloom as tl
from tests.default_models import LAYERS, batch, default_model
from torchloom import schedules
from torchloom.core.errors import BuildError, TraceError
from torchloom.graph import tracing
from torchloom.runtime.pipeline_split import split_stages, tied_weights


def meta_model(name: str) -> nn.Module:
    with tl.init_empty_weights():
        return default_model(name)


def _real(module: nn.Module) -> list[str]:
    """Parameters that are not on meta (none should be)."""
    return [n for n, p in module.named_parameters() if not p.is_meta]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "opt", "t5", "vit"])
def test_trace_until_find_cut_and_split_without_example_inputs(name):
    model = meta_model(name)
    sch = tl.create_schedule(model)
    layers = LAYERS[name]
    sch.trace_until(f"{layers}.*")  # was: Tensor.item() cannot be called on meta tensors
    assert tracing.is_traced(model) and tracing.is_traced(sch[f"{layers}.1"].mod)
    assert [m.path for m in sch.find(re.escape(f"{layers}.1") + "$")] == \
        [layers.rsplit(".", 1)[0] if name != "t5" else "decoder"]
    assert not _real(model)
    if name == "t5":  # a T5 block returns a tuple: no cut between its blocks
        return
    sch[f"{layers}.0"].cut_pipeline_stage()
    stages = split_stages(sch)  # dummy inputs from the config
    assert len(stages.modules) == 2
    assert all(not _real(stage) for stage in stages.modules)
    assert sum(p.numel() for s in stages.modules for p in s.parameters()) >= \
        sum(p.numel() for p in model.parameters())


def test_dummy_inputs_come_from_the_config():
    assert {k: tuple(v.shape) for k, v in tracing.dummy_inputs(meta_model("gpt2")).items()} == \
        {"input_ids": (2, 16)}
    assert {k: tuple(v.shape) for k, v in tracing.dummy_inputs(meta_model("t5")).items()} == \
        {"input_ids": (2, 16), "decoder_input_ids": (2, 16)}
    assert {k: tuple(v.shape) for k, v in tracing.dummy_inputs(meta_model("vit")).items()} == \
        {"pixel_values": (2, 3, 32, 32)}
    assert tracing.dummy_inputs(nn.Linear(2, 2)) is None


def test_trace_a_sub_module_of_a_meta_model_without_example_inputs():
    model = meta_model("llama")
    sch = tl.create_schedule(model)
    attn = sch["model.layers.1.self_attn"]
    attn.trace()  # its inputs are captured from a run of the meta model on fake tensors
    assert tracing.is_traced(attn.mod) and not _real(model)
    assert attn.find(lambda node: node.op == "call_module" and node.target == "q_proj")


def test_tied_weights_of_a_meta_gpt2_cut_in_four():
    model = meta_model("gpt2")
    model.transformer.h.extend(meta_model("gpt2").transformer.h)  # four layers
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*")
    for i in (0, 1, 2):
        sch[f"transformer.h.{i}"].cut_pipeline_stage()
    ties = tied_weights(sch)
    assert len(ties) == 1
    tie = ties[0]
    assert tie.names == ("transformer.wte.weight", "lm_head.weight")
    assert tie.stages == (0, 3) and tie.stage_names == ("transformer.wte.weight",
                                                        "lm_head.weight")
    assert tie.shape == (128, 32)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_verify_a_meta_model_materialises_both_from_the_same_seed(name):
    model = meta_model(name)
    inputs = batch(name)
    sch = tl.create_schedule(model)
    tol = dict(rtol=0, atol=0) if name == "gpt2" else {}  # traced Llama: see test_defaults
    verify = tl.Verify(sch, inputs, **tol)
    with verify:
        sch.trace_until(f"{LAYERS[name]}.*", example_inputs=inputs)
        schedules.apply_schedule(sch, ckpt_ratio=0.5)
        sch[f"{LAYERS[name]}.0"].cut_pipeline_stage()
    assert verify.stats["parameter gradient"] == len(list(model.parameters()))
    assert not _real(model)  # put back on meta: build it as planned
    torch.manual_seed(0)
    built, _ = tl.build(sch)
    assert not any(p.is_meta for p in built.parameters())


def test_verify_a_meta_model_catches_a_wrong_schedule_and_leaves_it_meta():
    model = meta_model("gpt2")
    sch = tl.create_schedule(model)
    with pytest.raises(tl.VerificationError, match=r"^sch\['transformer\.h\.1\.mlp\.act'\]"
                       r"\.Verify\(\.\.\.\): the forward output differs"):
        with tl.Verify(sch, {"input_ids": batch("gpt2")["input_ids"]}):
            sch["transformer.h.1.mlp.act"].replace(nn.ReLU())
    assert not _real(model)


def test_a_branch_on_a_value_of_meta_weights_is_refused_with_the_fix():
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return y if y.sum() > 0 else -y

    with tl.init_empty_weights():
        model = nn.Sequential(Gate())
    sch = tl.create_schedule(model)
    with pytest.raises(
        TraceError,
        match=r"^sch\[''\]\.trace\(\.\.\.\): the module's code branches on a tensor value "
        r"\(test_meta_trace\.py:\d+\), and this model's tensors have no values \(meta "
        r"weights: the model was built under init_empty_weights\)\n    values: "
        r"value='Tensor\(\)'\n    fix: keep the module that does this opaque: "
        r"sch\[''\]\.trace\(leaf_modules=\[\.\.\.\]\), or materialise the weights first: "
        r"tl\.build\(sch\), then trace$",
    ):
        sch.trace(flatten=True, example_inputs=(torch.randn(2, 4),))
    sch.trace(flatten=True, leaf_modules=["Gate"], example_inputs=(torch.randn(2, 4),))


def test_split_without_example_inputs_needs_a_config():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    sch = tl.create_schedule(model)
    sch.trace(example_inputs=(torch.randn(1, 2),))
    sch["1"].cut_pipeline_stage()
    with pytest.raises(BuildError, match=r"(?s)no example micro-batch: the model has no config .*"
                       r"fix: pass one micro-batch: example_inputs="):
        split_stages(sch)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+) kB", f.read()).group(1)) * 1024


def test_a_mid_size_meta_llama_traces_and_splits_without_allocating_it():
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632,
                                   num_attention_heads=16, num_key_value_heads=4,
                                   num_hidden_layers=4, vocab_size=32000)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)

    start = _rss_anon()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with tl.init_empty_weights():
            model = transformers.LlamaForCausalLM(cfg)
        sch = tl.create_schedule(model)
        sch.trace_until("model.layers.*")
        sch["model.layers.1"].cut_pipeline_stage()
        stages = split_stages(sch)
    finally:
        stop.set()
        sampler.join()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 1.2e9 and len(stages.modules) == 2
    assert peak[0] - start < weights / 8, (peak[0] - start, weights)
