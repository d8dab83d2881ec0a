"""Bad-input rows for tracing with transformers' defaults (the KV cache), models with meta
weights, and the pipeline split: what a traced module refuses and what tracing a model
without weights cannot do."""

from __future__ import annotations

import torch
import transformers
from torch import nn

import torchloom as tl
from torchloom.core.errors import BuildError, CheckpointError, TraceError, TraceGuardError
from torchloom.runtime.pipeline_split import split_stages


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).train()  # use_cache left at its default (True)


def _ids() -> torch.Tensor:
    return torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def trace_with_an_example_that_asks_for_the_cache():
    tl.create_schedule(_gpt2()).trace(example_inputs={"input_ids": _ids(), "use_cache": True})


def trace_with_a_cache_object_in_the_example():
    model = _gpt2()
    with torch.no_grad():
        past = model(_ids(), use_cache=True).cache
    tl.create_schedule(model).trace(example_inputs={"input_ids": _ids(), "cache": past})


def generate_with_a_cache_on_a_traced_model():
    model = _gpt2()
    tl.create_schedule(model).trace_until("transformer.h.*")
    model.eval()
    with torch.no_grad():
        model(_ids(), use_cache=True)


def checkpointed_layer_with_a_prefilled_cache():
    model = _gpt2()
    with torch.no_grad():
        past = model(_ids(), use_cache=True).cache
    tl.create_schedule(model)["transformer.h.0"].checkpoint()
    model(_ids(), cache=past)


def traced_layer_with_a_prefilled_cache_in_training():
    model = _gpt2()
    with torch.no_grad():
        past = model(_ids(), use_cache=True).cache
    tl.create_schedule(model)["transformer.h.0"].trace()
    model(_ids(), cache=past)


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y if y.sum() > 0 else -y


def trace_a_branch_on_meta_weights():
    with tl.init_empty_weights():
        model = nn.Sequential(_Gate())
    tl.create_schedule(model).trace(flatten=True, example_inputs=(torch.randn(2, 4),))


def verify_with_weights_of_a_real_model(tmp_path):
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    with tl.Verify(sch, (torch.randn(1, 2),), weights=tmp_path):
        pass


def split_without_example_of_a_model_without_config():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    sch = tl.create_schedule(model)
    sch.trace(example_inputs=(torch.randn(1, 2),))
    sch["1"].cut_pipeline_stage()
    split_stages(sch)


CASES = [
    (trace_with_an_example_that_asks_for_the_cache, TraceError,
     r"the example inputs ask for a KV cache; torchloom traces the training path.*"
     r"fix: leave 'use_cache' out of example_inputs"),
    (trace_with_a_cache_object_in_the_example, TraceError,
     r"the example inputs ask for a KV cache.*value='DynamicCache'.*fix: leave 'cache' out "
     r"of example_inputs"),
    (generate_with_a_cache_on_a_traced_model, TraceGuardError,
     r"use_cache=True reached a module that torchloom traced without a cache.*fix: call the "
     r"model with use_cache=False .*an untraced copy"),
    (checkpointed_layer_with_a_prefilled_cache, CheckpointError,
     r"a checkpointed layer got a KV cache holding past positions in training.*"
     r"past_positions=8.*fix: train without a prefilled cache"),
    (traced_layer_with_a_prefilled_cache_in_training, TraceGuardError,
     r"a KV cache holding 8 past positions for this layer reached a module traced without "
     r"one.*fix: train without a prefilled cache .*or keep this module untraced"),
    (trace_a_branch_on_meta_weights, TraceError,
     r"the module's code branches on a tensor value .*meta weights.*fix: keep the module "
     r"that does this opaque: sch\[''\]\.trace\(leaf_modules=\[\.\.\.\]\), or materialise"),
    (verify_with_weights_of_a_real_model, tl.VerificationError,
     r"weights= loads a model built under init_empty_weights; this model already has its "
     r"weights.*fix: drop weights=, or build the model under tl\.init_empty_weights\(\)"),
    (split_without_example_of_a_model_without_config, BuildError,
     r"no example micro-batch: the model has no config.*fix: pass one micro-batch"),
]
