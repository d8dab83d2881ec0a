"""The memory cost model against measured peaks, on a tiny GPT-2 trained on the CPU."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchloom as tl
from torchloom.tune import CostModel, Space, TrainEvaluator, Tuner


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gpt2() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=128, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def gpt2_inputs(model: torch.nn.Module, point: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (point["batch_size"], 32), generator=g)
    return {"input_ids": ids, "labels": ids}


def gpt2_schedule(sch: tl.Schedule, point: dict) -> None:
    sch["transformer.h"].checkpoint(ratio=point["ckpt_ratio"])


CONFIGS = [
    {"batch_size": 4, "ckpt_ratio": 0.0},
    {"batch_size": 8, "ckpt_ratio": 0.5},
    {"batch_size": 16, "ckpt_ratio": 1.0},
]


def test_predicted_peak_is_within_15_percent_of_the_measured_one() -> None:
    space = Space()
    space.create_symbol("batch_size", [4])
    tuner = Tuner(space, gpt2, gpt2_schedule, lambda r, p: None)  # only for candidates
    cost = CostModel(gpt2, gpt2_inputs)
    measure = TrainEvaluator(gpt2, gpt2_inputs, steps=1, warmup=0)
    errors = []
    for point in CONFIGS:
        recipe = tuner.candidate(point)
        estimate = cost.predict(recipe, point)
        result = measure(recipe, point)
        assert result.ok and result.peak_memory_bytes
        errors.append(abs(estimate.total - result.peak_memory_bytes) / result.peak_memory_bytes)
        assert estimate.parameters == sum(p.numel() * 4 for p in gpt2().parameters())
    assert max(errors) <= 0.15, errors


def test_checkpointing_lowers_the_predicted_activations() -> None:
    cost = CostModel(gpt2, gpt2_inputs)
    space = Space()
    space.create_symbol("batch_size", [8])
    tuner = Tuner(space, gpt2, gpt2_schedule, lambda r, p: None)
    acts = [cost.predict(tuner.candidate({"batch_size": 8, "ckpt_ratio": r}),
                         {"batch_size": 8, "ckpt_ratio": r}).activations
            for r in (0.0, 0.5, 1.0)]
    assert acts[0] > acts[1] > acts[2]


def test_prediction_allocates_no_real_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    cost = CostModel(gpt2, gpt2_inputs)
    real_empty = torch.empty
    made = []

    def spy(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        fake = isinstance(out, torch._subclasses.fake_tensor.FakeTensor)
        if not fake and out.device.type != "meta":  # fake mode itself works on meta
            made.append(out.shape)
        return out

    monkeypatch.setattr(torch, "empty", spy)
    estimate = cost.predict(tl.Recipe(), {"batch_size": 64})
    assert estimate.activations > 0 and made == []


@pytest.mark.slow
def test_torchrun_evaluator_runs_a_candidate_in_a_job() -> None:
    import os
    from pathlib import Path

    from torchloom.tune.worker import TorchrunEvaluator

    root = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    point = {"batch_size": 4, "ckpt_ratio": 0.5}
    sch = tl.create_schedule(gpt2())
    gpt2_schedule(sch, point)
    job = TorchrunEvaluator(gpt2, gpt2_inputs, nproc=1, steps=1, warmup=0, env=env,
                            timeout_s=120)
    result = job(sch.recipe, point)
    local = TrainEvaluator(gpt2, gpt2_inputs, steps=1, warmup=0)(sch.recipe, point)
    assert result.ok and result.throughput > 0, result.error
    assert result.peak_memory_bytes == local.peak_memory_bytes



def test_a_failing_worker_reports_its_error(tmp_path) -> None:
    import json

    from torchloom.tune import worker

    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({
        "make_model": "tests.test_tune_memory:no_such_function", "make_model_kwargs": {},
        "make_inputs": "tests.test_tune_memory:gpt2_inputs", "make_inputs_kwargs": {},
        "recipe": tl.Recipe().to_json(), "point": {"batch_size": 2}, "steps": 1,
        "warmup": 0, "memory_limit_bytes": None, "seed": 0}))
    with pytest.raises(tl.RecipeError, match=(
            r"cannot import 'tests\.test_tune_memory:no_such_function': .*no_such_function")):
        worker.main([str(spec), str(out)])
    result = json.loads(out.read_text())
    assert result["ok"] is False and "no_such_function" in result["error"]
    assert worker.main([]) == 2
    with pytest.raises(tl.tune.TuneError, match="importable"):
        worker.TorchrunEvaluator(lambda: None, gpt2_inputs)
