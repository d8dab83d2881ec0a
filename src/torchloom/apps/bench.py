"""``torchloom bench``: eager vs ``torch.compile`` vs a torchloom schedule, side by side.

Each model is trained for a few steps in one process, in three variants:

* ``"eager"``: the transformers model as it is;
* ``"compile"``: the same model under ``torch.compile`` (whole model; the first step,
  which compiles, is excluded from the timings and reported as ``compile_s``);
* ``"torchloom"``: the model's built-in schedule at a layout of one process
  (:func:`torchloom.parallelize` of ``Layout(ckpt_ratio=r)``): each transformer layer
  compiled in place (the ``compile`` primitive; ``schedule_compile=False`` leaves it out)
  and activation checkpointing on a ratio of the layers. The module tree and state-dict keys stay those of the model.

Under a fixed budget for activation memory the schedule buys a larger batch: each
variant runs the largest batch (up to ``max_batch``) whose peak saved-activation bytes fit
``budget_bytes``; tokens/s, activation bytes and MFU are reported per variant. How the
batches, the schedule's candidates, the activation bytes and MFU are measured:
docs/design/bench.md.

>>> SIZES["tiny"], zoo.list_models(SIZES["tiny"].zoo_size)   # torchloom bench --size tiny
(ModelSize(zoo_size='bench-tiny', seq_len=32, ckpt_ratios=None), ['bert', 'gpt2', 'llama'])
>>> SIZES["gpu"].seq_len, SIZES["gpu"].ckpt_ratios   # torchloom bench --size gpu
(1024, (0.0, 0.5, 1.0))
>>> largest_batch(lambda b: 1000 + 300 * b, budget=2500, max_batch=64)
5
>>> largest_batch(lambda b: 1000 + 300 * b, budget=1200, max_batch=64)
0
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.errors import CliOptionError
from ..core.marks import CHECKPOINTED, has_mark
from ..parallel import Layout, create_schedule, parallelize
from ..plan.profiles import matmul_rate
from ..plan.profiles import sync as _sync
from ..runtime.loop import train_step
from ..runtime.memory import count_saved
from ..schedules import zoo

__all__ = [
    "SIZES",
    "VARIANTS",
    "BenchConfig",
    "ModelSize",
    "largest_batch",
    "measure_peak_flops",
    "plot_results",
    "run_bench",
]

VARIANTS = ("eager", "compile", "torchloom")


@dataclass(frozen=True)
class ModelSize:
    """A bench size: the zoo size of its models (:mod:`torchloom.schedules.zoo`) and the
    sequence length they are trained at."""

    zoo_size: str
    seq_len: int
    ckpt_ratios: tuple[float, ...] | None = None
    """The checkpoint ratios whose batch is fitted (None: every ``k / layers``); a shorter
    grid keeps a large size's run short (each ratio is compiled and counted twice)."""


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize("bench-tiny", 32),  # for tests: builds and compiles in seconds
    "bench": ModelSize("bench", 256),  # what one would train on a CPU: about 13M parameters
    # One GPU (``--device cuda``, bf16 autocast): about 300M parameters, real vocabularies;
    # 4 layers keep whole-model compilation short, the width and the batch (``--max-batch
    # 64``, a budget of tens of GiB) fill the device.
    "gpu": ModelSize("gpu", 1024, (0.0, 0.5, 1.0)),
}


@dataclass
class BenchConfig:
    """What ``torchloom bench`` runs (see docs/design/bench.md).

    Attributes:
        models: zoo names, each with the size's zoo size.
        size: a key of :data:`SIZES`.
        steps: timed rounds (one step of each variant per round).
        budget_bytes: the activation-memory budget.
        max_batch: the largest batch tried.
        ckpt_ratio: the schedule's checkpoint ratio; None chooses it by measuring.
        device: ``"cpu"`` (fp32) or ``"cuda"`` (bf16 autocast).
        compile_backend: ``torch.compile``'s backend.
        seed: weights and data.
        variants: which variants to run.
        schedule_compile: the schedule also compiles each transformer layer in place
            (``apply_schedule(..., compile=compile_backend)``).
        sweep_steps: interleaved timed rounds of the schedule's candidates when the
            schedule is chosen by measuring (``ckpt_ratio=None``); 0 does not measure: no
            checkpointing with compiled layers, else the least ratio that doubles eager's
            batch.
    """

    models: Sequence[str] = ("gpt2", "bert")
    size: str = "bench"
    steps: int = 5
    budget_bytes: int = 200 * 2**20
    max_batch: int = 16
    ckpt_ratio: float | None = None
    device: str = "cpu"
    compile_backend: str = "inductor"
    seed: int = 0
    variants: Sequence[str] = VARIANTS
    schedule_compile: bool = True
    sweep_steps: int = 3


def largest_batch(bytes_at: Callable[[int], float], budget: float, max_batch: int) -> int:
    """The largest batch in ``1..max_batch`` with ``bytes_at(batch) <= budget`` (0: none);
    ``bytes_at`` grows with the batch."""
    best = 0
    for batch in range(1, max_batch + 1):
        if bytes_at(batch) > budget:
            break
        best = batch
    return best


# --------------------------------------------------------------------------- devices


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


def measure_peak_flops(device: torch.device | str = "cpu", size: int | None = None,
                       repeats: int = 3) -> float:
    """The best FLOP/s of ``repeats`` square matmuls (fp32 on CPU, bf16 on CUDA).

    >>> measure_peak_flops("cpu", size=64, repeats=2) > 0
    True
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    return matmul_rate(device, torch.bfloat16 if cuda else torch.float32,
                       size or (4096 if cuda else 2048), repeats)


# --------------------------------------------------------------------------- models


def _make(name: str, size: str, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The zoo model, constructed (and initialised) on ``device``: a large model is not
    initialised on the CPU first; ``"meta"`` allocates nothing."""
    with torch.device(device):
        return zoo.make_model(name, _size(name, size).zoo_size, seed=seed)


def _size(name: str, size: str) -> ModelSize:
    if size not in SIZES:
        raise CliOptionError(f"unknown bench size {size!r}; sizes: {', '.join(SIZES)}",
                            primitive="torchloom bench", values={"size": size},
                            fix="--size bench")
    models = zoo.list_models(SIZES[size].zoo_size)
    if name not in models:
        raise CliOptionError(
            f"torchloom bench has no {name!r} model; it has {', '.join(models)}",
            primitive="torchloom bench", values={"model": name},
            fix=f"--models {','.join(models)}")
    return SIZES[size]


def _layers(model: nn.Module, name: str) -> list[nn.Module]:
    """The transformer layers of a zoo model (the items of its stacks of layers)."""
    layers: list[nn.Module] = []
    for path in zoo.layer_paths(name):
        stack = model.get_submodule(path)
        if isinstance(stack, (nn.ModuleList, nn.Sequential)):
            layers.extend(stack)
    return layers


SCOPES = ("layers", "none", "whole")
"""What a schedule candidate compiles: each transformer layer in place, nothing, or the
whole model (the ``compile`` primitive on the root)."""


def _default_scope(cfg: BenchConfig) -> str:
    return "layers" if cfg.schedule_compile else "none"


def _scheduled(name: str, size: str, cfg: BenchConfig, ratio: float,
               scope: str | None = None) -> nn.Module:
    """The model under its schedule, built by :func:`torchloom.parallelize` at a layout of
    one process that checkpoints the first ``ratio`` of each stack of layers; ``scope``
    (:data:`SCOPES`) says what is compiled with ``cfg.compile_backend``: each layer in
    place (the schedule's ``compile`` knob; the compiled code sits inside the
    checkpoints), nothing, or the whole model (``compile`` on the root, just before the
    build)."""
    model = _make(name, size, cfg.seed, cfg.device)
    sch = create_schedule(model, None)
    scope = scope or _default_scope(cfg)
    knobs: dict[str, Any] = {"compile": cfg.compile_backend} if scope == "layers" else {}

    def compile_whole() -> None:
        sch.compile(backend=cfg.compile_backend)

    done = parallelize(sch, Layout(ckpt_ratio=ratio), device=cfg.device, knobs=knobs,
                       stacks=zoo.layer_paths(name),
                       before_build=compile_whole if scope == "whole" else None)
    built: nn.Module = done.model
    return built


def _reset_compiled() -> None:
    """Forget compiled code (inductor's on-disk cache makes compiling again cheap), so the
    next model compiles for its own batch with static shapes."""
    torch._dynamo.reset()


def _inputs(name: str, model: nn.Module, batch: int, seq_len: int, seed: int,
            device: torch.device) -> dict[str, torch.Tensor]:
    inputs = zoo.example_inputs(name, model, batch_size=batch, seq_len=seq_len, seed=seed)
    return {k: v.to(device) for k, v in inputs.items()}


def _tensors(values: Any) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


@dataclass
class _Saved:
    """Exact saved-activation bytes of one forward (and what its backward adds)."""

    forward: int  # saved when the forward ends
    layers: list[int] = field(default_factory=list)  # new bytes saved by each layer
    before_ckpt: list[int] = field(default_factory=list)  # saved before each ckpt layer

    def peak(self, layer_bytes: float) -> float:
        """The worst moment: the forward's end, or recomputing a checkpointed layer
        (``layer_bytes``: what that layer saves when it is not checkpointed)."""
        return max([self.forward, *(b + layer_bytes for b in self.before_ckpt)])


def _count(model: nn.Module, name: str, step: Callable[[], torch.Tensor], into: list[_Saved],
           hooks: bool = True) -> torch.Tensor:
    """Run ``step`` (a forward returning the loss) counting saved bytes; append the counts
    to ``into`` and return the loss (the caller runs backward, outside the hooks)."""
    handles = []
    layer_bytes: list[int] = []
    before_ckpt: list[int] = []
    with count_saved(model) as saved:
        if hooks:
            starts: dict[int, int] = {}

            def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
                if has_mark(module, CHECKPOINTED):
                    # The checkpoint keeps its inputs for the recompute, outside any hook.
                    for t in _tensors([*args, *kwargs.values()]):
                        key = t.untyped_storage()._cdata
                        if key not in saved.exclude:
                            saved.sizes[key] = t.untyped_storage().nbytes()
                    before_ckpt.append(saved.total)
                starts[id(module)] = saved.total

            def post(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
                layer_bytes.append(saved.total - starts.pop(id(module)))

            for layer in _layers(model, name):
                handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(layer.register_forward_hook(post, with_kwargs=True))
        try:
            loss = step()
        finally:
            for handle in handles:
                handle.remove()
    into.append(_Saved(saved.total, layer_bytes, before_ckpt))
    return loss


def _loss(model: Callable[..., Any], inputs: dict[str, torch.Tensor],
          device: torch.device) -> torch.Tensor:
    with _autocast(device):
        return model(**inputs).loss


_FIT_BATCHES = (2, 3)  # not 1: compiled code specialises size-1 dimensions


def _affine(at_a: float, at_b: float) -> Callable[[int], float]:
    """The affine function of the batch through the counts at :data:`_FIT_BATCHES`."""
    a, b = _FIT_BATCHES
    return lambda n: at_a + (at_b - at_a) * (n - a) / (b - a)


@dataclass
class _Fit:
    """Saved bytes of a checkpoint ratio, as functions of the batch."""

    ratio: float
    peak: Callable[[int], float]
    batch: int


def _fit(name: str, size: str, cfg: BenchConfig, device: torch.device) -> tuple[
        _Fit, list[_Fit], Callable[[int], float]]:
    """Exact counts at batch 2 and 3 of the eager model and of the schedule at each ratio
    ``k / layers`` (or of the size's grid); returns eager's fit, the schedule's fits (ratio
    0 first) and the bytes one layer of the schedule saves when it is not checkpointed, as
    a function of the batch (what recomputing a checkpointed layer saves again)."""
    seq_len = _size(name, size).seq_len
    n_layers = len(_layers(_make(name, size, cfg.seed, "meta"), name))
    grid = _size(name, size).ckpt_ratios
    ratios = ([0.0, cfg.ckpt_ratio] if cfg.ckpt_ratio is not None
              else list(grid) if grid is not None
              else [k / n_layers for k in range(n_layers + 1)])
    counts: dict[float | None, list[_Saved]] = {}
    for ratio in [None, *dict.fromkeys(ratios)]:  # None: the eager model
        model = (_make(name, size, cfg.seed, device) if ratio is None
                 else _scheduled(name, size, cfg, ratio)).to(device)
        counts[ratio] = []
        for batch in _FIT_BATCHES:
            _reset_compiled()  # static shapes at each batch, as in the timed run
            inputs = _inputs(name, model, batch, seq_len, cfg.seed, device)
            _count(model, name, functools.partial(_loss, model, inputs, device), counts[ratio])
        del model
    plain = counts[0.0]
    layer = _affine(max(plain[0].layers), max(plain[1].layers))
    fits = []
    for ratio, (one, two) in counts.items():
        fwd = _affine(one.forward, two.forward)
        before = [_affine(a, b) for a, b in zip(one.before_ckpt, two.before_ckpt)]

        def peak(b: int, fwd: Callable[[int], float] = fwd,
                 before: list[Callable[[int], float]] = before) -> float:
            return max([fwd(b), *(f(b) + layer(b) for f in before)])

        fits.append(_Fit(ratio or 0.0, peak,
                         largest_batch(peak, cfg.budget_bytes, cfg.max_batch)))
    return fits[0], fits[1:], layer


def _candidates(eager: _Fit, fits: list[_Fit], cfg: BenchConfig) -> list[_Fit]:
    """The schedule's checkpoint ratios worth running: the given one; else no
    checkpointing (with the largest batch that fits without it) and the least ratio whose
    batch doubles eager's (the largest batch if none does)."""
    if cfg.ckpt_ratio is not None:
        return [next(f for f in fits if f.ratio == cfg.ckpt_ratio)]
    target = min(cfg.max_batch, 2 * max(1, eager.batch))
    doubling = next((f for f in fits[1:] if f.batch >= target), None)
    if doubling is None and len(fits) > 1:
        doubling = max(fits[1:], key=lambda f: (f.batch, -f.ratio))
    out = [fits[0]] if fits[0].batch >= 1 else []
    if doubling is not None and doubling.batch > fits[0].batch:
        out.append(doubling)
    return out or fits[:1]


@dataclass(frozen=True)
class _Choice:
    """A schedule candidate: what it compiles (:data:`SCOPES`), its checkpoint ratio and
    the batch it runs."""

    scope: str
    ratio: float
    batch: int

    def describe(self) -> str:
        what = {"layers": "layers compiled", "none": "nothing compiled",
                "whole": "whole model compiled"}[self.scope]
        return f"{what}, ckpt ratio {self.ratio:g}, batch {self.batch}"


def _choices(eager: _Fit, fits: list[_Fit], cfg: BenchConfig) -> list[_Choice]:
    """The schedule candidates: :func:`_candidates` with the default compile scope; when
    the schedule is chosen by measuring, also the baselines' equivalents at eager's batch
    (the schedule that applies nothing, and with compilation allowed, the whole model
    compiled), so that the measured choice is never slower than either beyond noise."""
    scope = _default_scope(cfg)
    out = [_Choice(scope, f.ratio, max(1, f.batch)) for f in _candidates(eager, fits, cfg)]
    if cfg.ckpt_ratio is None and cfg.sweep_steps > 0:
        out.append(_Choice("none", 0.0, max(1, eager.batch)))
        if cfg.schedule_compile:
            out.append(_Choice("whole", 0.0, max(1, eager.batch)))
    return list(dict.fromkeys(out))


def _model_flops(name: str, size: str, cfg: BenchConfig, device: torch.device) -> float:
    """FLOPs of one forward and backward of one sequence (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _make(name, size, cfg.seed, device).to(device)
    inputs = _inputs(name, model, 1, _size(name, size).seq_len, cfg.seed, device)
    counter = FlopCounterMode(display=False)
    with counter:
        _loss(model, inputs, device).backward()
    return float(counter.get_total_flops())


def _sweep(name: str, cfg: BenchConfig, choices: list[_Choice], device: torch.device,
           log: Callable[[str], None]) -> list[tuple[_Choice, float]]:
    """Build and warm up (compile) every candidate, then time them in ``cfg.sweep_steps``
    interleaved rounds (the order rotates every round, as in the timed run);
    ``(choice, median tokens/s)`` for each (empty: nothing to choose)."""
    if len(choices) < 2 or cfg.sweep_steps < 1:
        return []
    seq_len = _size(name, cfg.size).seq_len
    runs: list[tuple[_Choice, _Variant, dict[str, torch.Tensor]]] = []
    _reset_compiled()
    for choice in choices:
        model = _scheduled(name, cfg.size, cfg, choice.ratio, choice.scope).to(device)
        v = _Variant("torchloom", model, model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                     choice.batch, choice.ratio)
        inputs = _inputs(name, model, choice.batch, seq_len, cfg.seed, device)
        _step(v, inputs, device)  # compiles
        runs.append((choice, v, inputs))
    for r in range(cfg.sweep_steps):
        shift = r % len(runs)
        for _, v, inputs in runs[shift:] + runs[:shift]:
            v.times.append(_step(v, inputs, device))
    out = []
    for choice, v, _ in runs:
        tps = choice.batch * seq_len / statistics.median(v.times)
        log(f"{name}: schedule candidate ({choice.describe()}): {tps:,.0f} tokens/s")
        out.append((choice, tps))
    del runs
    _reset_compiled()
    return out


# --------------------------------------------------------------------------- the run


@dataclass
class _Variant:
    name: str
    model: nn.Module
    call: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    batch: int
    ratio: float
    times: list[float] = field(default_factory=list)
    saved: _Saved | None = None
    peak_bytes: float = 0.0
    compile_s: float | None = None
    cuda_peak: int | None = None


def _step(v: _Variant, inputs: dict[str, torch.Tensor], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    train_step(functools.partial(_loss, v.call, inputs, device), v.optimizer, read_loss=False)
    _sync(device)
    return time.perf_counter() - start


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda _: None
              ) -> list[dict[str, Any]]:
    """Run the benchmark; one result dict per (model, variant), in model order.

    Keys: ``model``, ``variant``, ``tokens_per_s``, ``peak_activation_bytes``, ``mfu``, and
    ``batch_size``, ``seq_len``, ``ckpt_ratio``, ``step_s`` (median), ``step_s_all``,
    ``speedup_vs_eager``, ``saved_activation_bytes``, ``budget_bytes``, ``fits_budget``,
    ``model_flops_per_step`` (FlopCounterMode), ``flops_6nt_per_step``,
    ``peak_flops_per_s``, ``compile_s`` (compile only), ``cuda_max_memory_allocated``
    (CUDA only), ``parameters``, ``device``, ``threads``.
    """
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliOptionError("--device cuda, but torch sees no CUDA device",
                            primitive="torchloom bench", values={"device": cfg.device},
                            fix="--device cpu")
    unknown = [v for v in cfg.variants if v not in VARIANTS]
    if unknown or "eager" not in cfg.variants:
        raise CliOptionError(f"variants must include eager and be among {', '.join(VARIANTS)}",
                            primitive="torchloom bench", values={"variants": cfg.variants},
                            fix="variants=('eager', 'compile', 'torchloom')")
    results: list[dict[str, Any]] = []
    peaks: list[float] = [measure_peak_flops(device)]
    log(f"peak matmul: {peaks[0] / 1e9:,.1f} GFLOP/s")
    for name in cfg.models:
        spec = _size(name, cfg.size)
        eager_fit, fits, layer_at = _fit(name, cfg.size, cfg, device)
        choices = _choices(eager_fit, fits, cfg)
        log(f"{name}: largest batch under {cfg.budget_bytes / 2**20:,.0f} MiB: eager "
            f"{eager_fit.batch}; schedule " + ", ".join(
                f"ckpt ratio {f.ratio:g}: {f.batch}" for f in fits))
        sweep = _sweep(name, cfg, choices, device, log)
        if sweep:
            chosen = max(sweep, key=lambda c: c[1])[0]
            log(f"{name}: chosen by measurement: {chosen.describe()}")
        else:  # compiled layers alone buy batch; plain layers need the checkpoints
            chosen = choices[0] if cfg.schedule_compile else choices[-1]
        flops_per_seq = _model_flops(name, cfg.size, cfg, device)

        variants: list[_Variant] = []
        _reset_compiled()
        for vname in [v for v in VARIANTS if v in cfg.variants]:
            if vname == "torchloom":
                model = _scheduled(name, cfg.size, cfg, chosen.ratio, chosen.scope)
                batch, ratio = chosen.batch, chosen.ratio
            else:
                model = _make(name, cfg.size, cfg.seed, device)
                batch, ratio = max(1, eager_fit.batch), eager_fit.ratio
            model = model.to(device)
            call: Callable[..., Any] = model
            if vname == "compile":
                call = torch.compile(model, backend=cfg.compile_backend)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            variants.append(_Variant(vname, model, call, opt, batch, ratio))
        n_params = sum(p.numel() for p in variants[0].model.parameters())

        # Warm-up: compile (timed), then one step per variant counting saved bytes.
        for v in variants:
            inputs = _inputs(name, v.model, v.batch, spec.seq_len, cfg.seed, device)
            if v.name == "compile" or (v.name == "torchloom" and chosen.scope != "none"):
                v.compile_s = _step(v, inputs, device)
                log(f"{name}: {v.name}: first step (compiles) {v.compile_s:.1f} s")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            whole = v.name == "compile" or (v.name == "torchloom" and chosen.scope == "whole")
            forward = functools.partial(_loss, v.call, inputs, device)
            counted: list[_Saved] = []
            train_step(functools.partial(_count, v.model, name, forward, counted, hooks=not whole),
                       v.optimizer, read_loss=False)  # backward outside the counting hooks
            if device.type == "cuda":
                v.cuda_peak = torch.cuda.max_memory_allocated(device)
            v.saved = counted[0]
            # Recomputing a checkpointed layer saves what one layer of the schedule saves
            # when not checkpointed, at this batch (counted exactly at batch 2 and 3;
            # affine in the batch).
            v.peak_bytes = v.saved.peak(layer_at(v.batch))

        # Timed rounds: one step per variant, order rotating each round.
        for r in range(cfg.steps):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                inputs = _inputs(name, v.model, v.batch, spec.seq_len, cfg.seed + 1 + r,
                                 device)
                v.times.append(_step(v, inputs, device))
            peaks.append(measure_peak_flops(device))
            log(f"{name}: round {r + 1}/{cfg.steps}: " + ", ".join(
                f"{v.name} {v.times[-1]:.2f} s" for v in variants))

        # The peak is the best the machine showed in this run (a shared machine shows less
        # at times); MFU with it is a lower bound.
        peak_flops = max(peaks)
        eager_tps = None
        for v in variants:
            step_s = statistics.median(v.times)
            tokens = v.batch * spec.seq_len
            tps = tokens / step_s
            eager_tps = eager_tps or tps
            flops = flops_per_seq * v.batch
            row: dict[str, Any] = {
                "model": name,
                "variant": v.name,
                "tokens_per_s": tps,
                "speedup_vs_eager": tps / eager_tps,
                "peak_activation_bytes": round(v.peak_bytes),
                "saved_activation_bytes": v.saved.forward if v.saved else None,
                "budget_bytes": cfg.budget_bytes,
                "fits_budget": v.peak_bytes <= cfg.budget_bytes,
                "mfu": flops / (step_s * peak_flops),
                "batch_size": v.batch,
                "seq_len": spec.seq_len,
                "ckpt_ratio": v.ratio,
                "step_s": step_s,
                "step_s_all": v.times,
                "model_flops_per_step": flops,
                "flops_source": "FlopCounterMode (forward + backward, unscheduled model)",
                "flops_6nt_per_step": 6.0 * n_params * tokens,
                "peak_flops_per_s": peak_flops,
                "peak_flops_per_s_median": statistics.median(peaks),
                "parameters": n_params,
                "device": device.type,
                "dtype": "bf16 autocast" if device.type == "cuda" else "fp32",
                "threads": torch.get_num_threads(),
                "size": cfg.size,
            }
            if v.compile_s is not None:
                row["compile_s"] = v.compile_s
                row["compile_backend"] = cfg.compile_backend
            if v.name == "torchloom":
                row["schedule"] = {"ckpt_ratio": v.ratio,
                                   "compile": cfg.compile_backend
                                   if chosen.scope != "none" else False,
                                   "compile_scope": chosen.scope,
                                   "chosen_by": "measurement" if sweep else "default"}
                row["ckpt_sweep"] = [
                    {"compile_scope": c.scope, "ckpt_ratio": c.ratio, "batch_size": c.batch,
                     "tokens_per_s": tps} for c, tps in sweep]
                row["ckpt_batches"] = {f"{f.ratio:g}": f.batch for f in fits}
            if v.cuda_peak is not None:
                row["cuda_max_memory_allocated"] = v.cuda_peak
            results.append(row)
        del variants
        if hasattr(torch, "_dynamo"):
            torch._dynamo.reset()
    return results


def plot_results(results: list[dict[str, Any]], path: str) -> None:
    """A PNG: tokens/s and peak activation MiB per model and variant (budget dashed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(dict.fromkeys(r["model"] for r in results))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        rows = {r["model"]: r for r in results if r["variant"] == variant}
        xs = [j + i * width for j in range(len(names))]
        tps = [rows[n]["tokens_per_s"] if n in rows else 0 for n in names]
        mib = [rows[n]["peak_activation_bytes"] / 2**20 if n in rows else 0 for n in names]
        labels = [f"b={rows[n]['batch_size']}" if n in rows else "" for n in names]
        bars = axes[0].bar(xs, tps, width, label=variant)
        axes[0].bar_label(bars, labels=labels, fontsize=7)
        axes[1].bar(xs, mib, width, label=variant)
    budget = results[0]["budget_bytes"] / 2**20 if results else 0
    axes[1].axhline(budget, linestyle="--", color="k", label="budget")
    for ax, title in zip(axes, ("throughput (tokens/s)", "peak saved activations (MiB)")):
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
