"""The CUDA path: tests marked ``gpu``, skipped without a CUDA device.

Run them with ``pytest -m gpu tests/test_gpu.py`` (``benchmarks/gpu_check.sh`` does, with
``torchloom bench --device cuda``). ``TORCHLOOM_TEST_DEVICE=cpu`` runs the same checks on
the CPU, to check the tests themselves where no GPU is.

* A scheduled model (built-in schedule, half the layers checkpointed) on CUDA against the
  unscheduled model on the CPU in fp32, at three precisions, within these tolerances
  (norm-wise relative error ``||x - x_ref|| / ||x_ref||`` of the loss, the logits, and
  each parameter's gradient, the reference being the CPU fp32 run):

  ================================  ======  ======  =========
  CUDA precision                    loss    logits  gradients
  ================================  ======  ======  =========
  fp32, TF32 off (torch's default)  1e-5    1e-4    1e-3
  fp32 with TF32 matmuls            2e-3    1e-2    5e-2
  bf16 autocast                     5e-3    5e-2    1.5e-1
  ================================  ======  ======  =========

  fp32 on another device only reorders sums (about 1e-6); TF32 keeps 10 mantissa bits
  (about 5e-4 per product, partly averaging out) and bf16 8 (about 4e-3), compounded
  over a few layers (bf16 autocast on the CPU measured 3e-5, 6e-3 and 1.8e-2). A wrong
  schedule (a missing reduction, a dropped layer, a stale recompute) errs by a sizeable
  fraction of the values: another model's logits and gradients differ by 1.4 and 1.6
  to 1.8. (The loss of a random model is near ``ln(vocab)`` whatever its weights, 0.2%
  apart: the logits and gradients are what tell.)
  Dropout is set to 0 (CUDA and CPU draw different masks; the RNG tests below cover
  dropout on CUDA).
* The RNG tracker and ``fork_rng`` on CUDA: the tracked stream is the seeded generator's,
  the default CUDA and CPU streams are untouched, and a checkpointed ``fork_rng`` module
  replays its dropout masks in the recompute (gradients equal to the uncheckpointed run,
  bit for bit).
* ``build`` from ``meta`` straight to CUDA: every tensor lands on the device, ties kept,
  initialised with the model's own init (statistics), peak device memory near the model's
  size; ``build(weights=folder, device="cuda")`` gives ``from_pretrained``'s logits.
* The ``compile`` primitive on CUDA equals eager CUDA (fp32 within 1e-4 / 1e-3) and runs
  under bf16 autocast.
* ``torchloom train --device cuda`` (bf16 where supported): two steps with evaluation and
  a checkpoint, then one more resumed from it.

One check needs no GPU: the ``gpu`` size of ``torchloom bench`` is well formed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom import schedules
from torchloom.runtime.rng import get_rng_tracker, set_random_seed
from torchloom.schedules import zoo

DEVICE = os.environ.get("TORCHLOOM_TEST_DEVICE", "cuda")
HAVE_DEVICE = DEVICE == "cpu" or (DEVICE.startswith("cuda") and torch.cuda.is_available())
_skip = pytest.mark.skipif(not HAVE_DEVICE, reason="needs CUDA (TORCHLOOM_TEST_DEVICE=cpu "
                           "runs these checks on the CPU)")


def gpu(test):  # noqa: ANN001, ANN201
    """Mark a test ``gpu`` and skip it without the device."""
    return pytest.mark.gpu(_skip(test))

#: (loss, logits, gradients): norm-wise relative error bounds (module docstring).
TOLERANCES = {"fp32": (1e-5, 1e-4, 1e-3), "tf32": (2e-3, 1e-2, 5e-2),
              "bf16": (5e-3, 5e-2, 1.5e-1)}


def _bf16_ok() -> bool:
    return DEVICE == "cpu" or torch.cuda.is_bf16_supported()


@contextlib.contextmanager
def precision(kind: str) -> Iterator[None]:
    """fp32 with TF32 off, fp32 with TF32 matmuls, or bf16 autocast, on DEVICE."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = kind == "tf32"
    try:
        device_type = torch.device(DEVICE).type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=kind == "bf16"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def make(name: str, seed: int = 0, **overrides) -> nn.Module:
    return no_dropout(zoo.make_model(name, "small", seed=seed, **overrides))


def run(model: nn.Module, inputs: dict[str, torch.Tensor], device: str
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss, logits and gradients (by name) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**{k: v.to(device) for k, v in inputs.items()})
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.loss.detach().float().cpu(), out.logits.detach().float().cpu(), grads


# --------------------------------------------------------------------------- CUDA vs CPU


@pytest.mark.parametrize("kind", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@gpu
def test_scheduled_model_on_cuda_matches_the_cpu_model(name: str, kind: str) -> None:
    if kind == "bf16" and not _bf16_ok():
        pytest.skip("the device has no bf16")
    reference = make(name)
    inputs = zoo.example_inputs(name, reference, batch_size=4, seq_len=64, seed=1)
    scheduled = copy.deepcopy(reference)
    ref_loss, ref_logits, ref_grads = run(reference, inputs, "cpu")

    sch = tl.create_schedule(scheduled)
    schedules.apply_schedule(sch, ckpt_ratio=0.5)
    built, _opt = tl.build(sch)
    built = built.to(DEVICE).train()
    with precision(kind):
        loss, logits, grads = run(built, inputs, DEVICE)
    tol_loss, tol_logits, tol_grads = TOLERANCES[kind]
    assert rel_error(loss, ref_loss) <= tol_loss, (kind, float(loss), float(ref_loss))
    assert rel_error(logits, ref_logits) <= tol_logits, (kind, rel_error(logits, ref_logits))
    assert grads.keys() == ref_grads.keys()
    worst = max(((rel_error(grads[k], ref_grads[k]), k) for k in ref_grads), default=(0.0, ""))
    assert worst[0] <= tol_grads, (kind, worst)


# --------------------------------------------------------------------------- RNG


@gpu
def test_rng_tracker_on_cuda() -> None:
    set_random_seed(11, tp_rank=1)
    tracker = get_rng_tracker()
    device = torch.device(DEVICE)
    cpu_default = torch.get_rng_state()
    dev_default = torch.cuda.get_rng_state() if device.type == "cuda" else None
    with tracker.fork(device=device):
        first = torch.rand(8, device=device)
    with tracker.fork(device=device):  # the stream goes on where it stopped
        second = torch.rand(8, device=device)
    gen = torch.Generator(device=device).manual_seed(11 + 2718 + 1)
    expected = torch.rand(16, device=device, generator=gen)
    assert torch.equal(torch.cat([first, second]), expected)
    assert torch.equal(torch.get_rng_state(), cpu_default)
    if dev_default is not None:
        assert torch.equal(torch.cuda.get_rng_state(), dev_default)
        assert "cuda" in tracker.get_states()["model-parallel"]
    # the default stream draws what its own seed gives, not the tracked stream
    plain = torch.rand(8, device=device)
    assert not torch.equal(plain, first)


class _Block(nn.Module):
    """A dropout inside a (pretend) tensor-parallel region, between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x))))


def _fork_rng_grads(tp_rank: int, checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    sch = tl.create_schedule(model)
    sch["0.drop"].fork_rng()
    sch["1.drop"].fork_rng()
    if checkpoint:
        sch.checkpoint(ratio=1.0)
    model = model.to(DEVICE)
    set_random_seed(5, tp_rank=tp_rank)
    x = torch.randn(16, 32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.detach().clone() for p in model.parameters()]


@gpu
def test_fork_rng_on_cuda_with_checkpoint_replays_the_masks() -> None:
    out0, grads0 = _fork_rng_grads(tp_rank=0, checkpoint=False)
    again, _grads = _fork_rng_grads(tp_rank=0, checkpoint=False)
    out1, _grads = _fork_rng_grads(tp_rank=1, checkpoint=False)
    assert torch.equal(out0, again)          # same seed and rank: same masks
    assert not torch.equal(out0, out1)       # another tensor-parallel rank: other masks
    out_ck, grads_ck = _fork_rng_grads(tp_rank=0, checkpoint=True)
    assert torch.equal(out_ck, out0)         # checkpointing changes nothing ...
    for g, h in zip(grads_ck, grads0, strict=True):
        assert torch.equal(g, h)             # ... the recompute drew the same masks


# --------------------------------------------------------------------------- build


def _gib(n: float) -> float:
    return n / 2**30


@gpu
def test_build_from_meta_straight_to_cuda() -> None:
    import transformers

    config = zoo.make_model("gpt2", "small").config  # the zoo's config (defaults + sizes)
    config.n_layer, config.n_embd, config.n_head = 4, 512, 8
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, ckpt_ratio=0.5)
    device = torch.device(DEVICE)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    built, opt = tl.build(sch, device=device,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    tensors = list(built.parameters()) + list(built.buffers())
    assert tensors and all(t.device.type == device.type for t in tensors)
    assert built.lm_head.weight is built.transformer.wte.weight
    size = sum(p.numel() * p.element_size() for p in built.parameters())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - start
        # one model on the device, plus the largest tensor's temporaries; no copy of it all
        assert peak <= 1.5 * size + 64 * 2**20, (_gib(peak), _gib(size))
    weight = built.transformer.h[0].mlp.c_fc.weight
    std = float(weight.detach().float().std())
    assert abs(std - config.initializer_range) < 0.1 * config.initializer_range, std
    assert torch.isfinite(weight).all()
    inputs = zoo.example_inputs("gpt2", built, batch_size=2, seq_len=32, seed=0)
    losses = []
    for _step in range(3):
        opt.zero_grad()
        loss = built(**{k: v.to(device) for k, v in inputs.items()}).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


@gpu
def test_build_with_weights_straight_to_cuda_gives_from_pretrained_logits(tmp_path: Path
                                                                          ) -> None:
    import transformers

    source = zoo.make_model("llama", "small", seed=3)
    source.save_pretrained(tmp_path / "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama")
    with tl.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, ckpt_ratio=0.5)
    built, _opt = tl.build(sch, weights=str(tmp_path / "llama"), device=DEVICE)
    assert all(p.device.type == torch.device(DEVICE).type for p in built.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), precision("fp32"):
        got = built.eval()(ids.to(DEVICE)).logits
        ref = reference(ids).logits
    assert rel_error(got, ref) <= TOLERANCES["fp32"][1]


# --------------------------------------------------------------------------- compile


@gpu
def test_compile_on_cuda() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = make("llama").to(DEVICE)
    compiled = copy.deepcopy(eager)
    sch = tl.create_schedule(compiled)
    schedules.apply_schedule(sch, compile=True, ckpt_ratio=0.5)
    compiled, _opt = tl.build(sch)
    inputs = zoo.example_inputs("llama", eager, batch_size=4, seq_len=64, seed=2)
    graphs = counters["stats"]["unique_graphs"]
    with precision("fp32"):
        ref = run(eager, inputs, DEVICE)
        got = run(compiled, inputs, DEVICE)
    assert counters["stats"]["unique_graphs"] > graphs  # the layers did compile
    _tl, tol_logits, tol_grads = TOLERANCES["fp32"]
    assert rel_error(got[0], ref[0]) <= tol_logits
    assert rel_error(got[1], ref[1]) <= tol_logits
    for key, grad in ref[2].items():
        assert rel_error(got[2][key], grad) <= tol_grads, key
    if _bf16_ok():
        with precision("bf16"):
            ref = run(eager, inputs, DEVICE)
            got = run(compiled, inputs, DEVICE)
        assert rel_error(got[0], ref[0]) <= TOLERANCES["bf16"][0]
        assert rel_error(got[1], ref[1]) <= TOLERANCES["bf16"][1]
    torch._dynamo.reset()


# --------------------------------------------------------------------------- train


def _train_help() -> str:
    return subprocess.run([sys.executable, "-m", "torchloom", "train", "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"}).stdout


@gpu
def test_train_on_cuda_two_steps_then_resume(tmp_path: Path) -> None:
    if "--device" not in _train_help():
        pytest.skip("this torchloom train has no --device")
    dtype = "bf16" if DEVICE != "cpu" and _bf16_ok() else "fp32"
    metrics = tmp_path / "metrics.jsonl"
    common = [sys.executable, "-m", "torchloom", "train", "--model", "llama", "--device",
              DEVICE, "--dtype", dtype, "--batch-size", "4", "--seq-len", "64",
              "--ckpt-ratio", "0.5", "--eval-every", "2", "--eval-batches", "1",
              "--save-dir", str(tmp_path / "run"), "--metrics", str(metrics), "--no-progress"]
    for extra in (["--steps", "2"], ["--steps", "3", "--resume", "--allow-config-change"]):
        done = subprocess.run(common + extra, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3], steps
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert any(r.get("kind") == "eval" for r in records), records


# --------------------------------------------------------------------------- no GPU needed


def test_the_gpu_bench_size_is_well_formed() -> None:
    """``torchloom bench --size gpu``: every model constructs (on meta), its sequence fits
    its positions, its checkpoint grid is sorted within [0, 1], and it is large enough
    to fill a GPU (hundreds of millions of parameters)."""
    from torchloom.apps import bench

    spec = bench.SIZES["gpu"]
    for name in zoo.list_models(spec.zoo_size):
        model = bench._make(name, "gpu", 0, "meta")
        params = sum(p.numel() for p in model.parameters())
        assert 2e8 < params < 2e9, (name, params)
        positions = zoo.max_positions(name, "small")
        assert positions is not None
        assert spec.seq_len <= getattr(model.config, positions[0])
        grid = spec.ckpt_ratios
        assert grid is not None and list(grid) == sorted(grid) and grid[0] == 0 and grid[-1] == 1
        layers = len(bench._layers(model, name))
        assert all(float(r * layers).is_integer() for r in grid), (name, grid, layers)
