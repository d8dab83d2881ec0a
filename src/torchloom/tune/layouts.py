"""Tuning the layout: tensor, sequence, pipeline and data parallelism, the checkpoint ratio
and the micro-batch of a model on N devices, chosen by measurement among the candidates
the planner ranks first.

:func:`tune_layouts`

1. enumerates every layout the model can take on ``gpus`` devices for the global batch
   (:func:`torchloom.plan.enumerate_layouts`: the dependent space, where the pipeline
   degrees depend on the tensor-parallel one, the data-parallel degree on both, sequence
   parallelism on tensor parallelism, the micro-batch sizes on the local batch, and the
   heads, KV heads, layers and batch must divide);
2. predicts each one on fake tensors (:func:`torchloom.plan.search`) and prunes every
   layout whose predicted peak on its busiest rank is over the budget, before anything
   runs: no trial is ever over the budget by prediction;
3. orders the rest by predicted throughput and measures only the first ``measure_top``
   with real training steps, each with every kernel variant of ``kernels`` (knobs of the
   model's built-in schedule the planner does not model, e.g. ``{"compile": "inductor"}``
   or GPT-2's ``{"attention": "sdpa"}``; pipelines run the plain variant only): by
   default :func:`measure_on_local_ranks`, ``gpus`` gloo ranks of this machine, the model
   built for the layout by :func:`torchloom.parallelize` exactly as ``torchloom train``
   builds it (:func:`torchloom.plan.validate.build_layout`), ``warmup`` steps then
   ``timed`` timed ones;
4. returns every layout with its prediction and, for the measured ones, the measured
   tokens/s and per-rank peak; :attr:`LayoutTuneResult.best` is the fastest measured.

Measurement decides, the plan only orders and prunes: a plan whose step times rank two
layouts wrongly costs a measurement, never a wrong choice among those measured.

>>> from torchloom.plan import Layout
>>> r = LayoutTrial(Layout(tp=2), {}, predicted_tokens_per_s=10.0, predicted_peak=5, status="ok",
...                 measured_tokens_per_s=8.0, measured_peak=6)
>>> LayoutTuneResult([r], budget_bytes=10).best is r
True
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import TuneError

if TYPE_CHECKING:  # torchloom.plan imports torchloom.tune.memory: imported on use here
    from ..plan import Layout, Prediction, Profile

__all__ = ["LayoutTrial", "LayoutTuneResult", "measure_on_local_ranks", "tune_layouts"]

Measure = Callable[["Layout", dict[str, Any]], dict[str, Any]]
"""``measure(layout, kernel_knobs) -> {"tokens_per_s": ..., "peak": ...}``."""


@dataclass
class LayoutTrial:
    """One layout of a tuning run.

    Attributes:
        layout: the layout.
        kernels: the kernel knobs it ran with (measured trials; ``{}``: none).
        predicted_tokens_per_s, predicted_peak: the plan's figures (peak bytes of the
            busiest rank).
        status: ``"pruned"`` (predicted over the budget: never run), ``"refused"`` (the
            model cannot take it), ``"not measured"`` (fits, ranked below
            ``measure_top``), ``"ok"`` (measured) or ``"failed"`` (the run raised).
        measured_tokens_per_s, measured_peak: what the run measured (``"ok"`` only).
        reason: why it was pruned, refused or failed.
    """

    layout: Layout
    kernels: dict[str, Any] = field(default_factory=dict)
    predicted_tokens_per_s: float | None = None
    predicted_peak: int | None = None
    status: str = "not measured"
    measured_tokens_per_s: float | None = None
    measured_peak: int | None = None
    reason: str | None = None


@dataclass
class LayoutTuneResult:
    """Every layout of a run (measured ones first, in the order they were measured)."""

    trials: list[LayoutTrial]
    budget_bytes: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> list[LayoutTrial]:
        return [t for t in self.trials if t.status == "ok"]

    @property
    def best(self) -> LayoutTrial | None:
        """The measured layout with the most tokens/s (None when none ran)."""
        return max(self.measured, key=lambda t: t.measured_tokens_per_s or 0.0, default=None)

    @property
    def over_budget(self) -> list[LayoutTrial]:
        """Measured layouts whose measured peak exceeded the budget (the plan under-
        predicted them)."""
        return [t for t in self.measured if (t.measured_peak or 0) > self.budget_bytes]


def measure_on_local_ranks(model: str, *, batch_size: int, size: str = "tiny",
                           warmup: int = 1, timed: int = 3, timeout_s: float = 300.0,
                           ) -> Measure:
    """A measurement for :func:`tune_layouts`: a layout trained on ``layout.world`` gloo
    ranks of this machine in fp32, with the kernel knobs given to the built-in schedule
    (one launch; :func:`torchloom.plan.validate.measure_many`), returning
    ``tokens_per_s`` (the global batch over the median of the slowest rank's timed steps)
    and ``peak`` (the largest rank's peak of live storages). ``model`` is a zoo name."""
    def measure(layout: Layout, knobs: dict[str, Any]) -> dict[str, Any]:
        from ..plan.validate import measure_many
        from ..runtime.launch import raise_first_failure, run_ranks

        if layout.mixed_precision not in (None, layout.param_dtype):
            raise TuneError(
                f"the local measurement runs fp32 steps, and the layout asks for "
                f"{layout.mixed_precision} autocast", primitive="tune_layouts",
                values={"layout": layout.describe(), "mixed_precision": layout.mixed_precision},
                fix="tune_layouts(..., mixed_precision=None), or pass measure= a function "
                "that runs the layouts on their devices")
        config = {"model": model, "size": size, "layout": layout.to_dict(), "warmup": warmup,
                  "timed": timed, "knobs": dict(knobs)}
        per_rank = run_ranks(measure_many, layout.world, [config], timeout_s=timeout_s)
        raise_first_failure(per_rank, command="tune_layouts")
        runs = [ranks[0] for ranks in per_rank]
        steps = [max(r["step_s"][k] for r in runs) for k in range(timed)]
        return {"tokens_per_s": batch_size * layout.seq_len / statistics.median(steps),
                "peak": max(r["peak"] for r in runs)}

    return measure


def tune_layouts(model: Any, gpus: int, profile: str | Profile = "h100-80gb", *,
                 batch_size: int, seq_len: int, budget_bytes: int | None = None,
                 measure_top: int = 3, kernels: Sequence[dict[str, Any]] = ({},),
                 measure: Measure | None = None, size: str = "tiny",
                 **space: Any) -> LayoutTuneResult:
    """Choose the layout of ``model`` on ``gpus`` devices (see the module docstring).

    Args:
        model: a zoo name, a config path, a model class or a ``ModelSpec`` (the
            planner's); the default measurement needs a zoo name.
        profile: the device the plan predicts for (``measure_local()`` for this machine).
        budget_bytes: memory per device; default the profile's usable memory.
        measure_top: how many of the best-predicted layouts that fit run for real.
        kernels: the kernel variants each measured layout runs with (knobs of the
            built-in schedule, e.g. ``({}, {"compile": "inductor"})``); a pipeline runs
            the plain one (``{}``) only.
        measure: ``fn(layout, kernel_knobs) -> {"tokens_per_s", "peak"}``; default
            :func:`measure_on_local_ranks` of ``model``.
        space: keyword arguments of :func:`torchloom.plan.enumerate_layouts` (fixed
            degrees, ``dp_mode`` ddp / fsdp / hsdp, ``dp_replicate``,
            ``pipeline_schedule``, ``stages_per_rank``, ``ckpt_ratios`` or ``ac``,
            ``micro_batches``, dtypes).

    Raises:
        TuneError: ``measure_top`` below 1, or no layout fits the budget.
        PlanError: what the planner refuses (a batch no layout takes, an unknown model).
    """
    from ..plan import PlanError, get_profile, search

    if measure_top < 1:
        raise TuneError(f"measure_top={measure_top}: at least one layout must be measured",
                        primitive="tune_layouts", values={"measure_top": measure_top},
                        fix="measure_top=3")
    prof = get_profile(profile)
    if budget_bytes is not None:
        # the planner's fit is against the profile's usable memory: make that the budget
        prof = dataclasses.replace(prof, memory_bytes=budget_bytes, usable_memory=1.0)
    found = search(model, gpus, prof, batch_size=batch_size, seq_len=seq_len, size=size,
                   **space)
    budget = prof.budget
    trials: list[LayoutTrial] = []
    fitting: list[Prediction] = [p for p in found.ranked if p.fits]
    for lay, why in found.rejected:
        status = "pruned" if "alone need" in why else "refused"
        trials.append(LayoutTrial(lay, {}, status=status, reason=why))
    for p in found.ranked:
        if not p.fits:
            trials.append(LayoutTrial(p.layout, {}, p.tokens_per_s, p.peak, "pruned",
                                      reason=f"predicted peak {p.peak / 2**20:,.1f} MiB > "
                                             f"budget {budget / 2**20:,.1f} MiB"))
    if not fitting:
        raise TuneError(
            f"no layout of {gpus} devices fits {budget / 2**20:,.1f} MiB per device by "
            "prediction", primitive="tune_layouts",
            values={"gpus": gpus, "budget_bytes": budget, "predicted": len(found.ranked),
                    "smallest_peak": min((p.peak for p in found.ranked), default=None)},
            fix="a larger budget_bytes, more devices, a smaller batch_size or seq_len, or "
                "ckpt_ratios=(1.0,)")
    chosen = fitting[:measure_top]
    run = measure or measure_on_local_ranks(model, batch_size=batch_size, size=size)
    variants = [dict(k) for k in kernels] or [{}]
    measured: list[LayoutTrial] = []
    for p in chosen:
        for knobs in variants:
            if knobs and p.layout.pp > 1:
                continue  # the pipeline's tracer runs the model's own code
            trial = LayoutTrial(p.layout, knobs, p.tokens_per_s, p.peak)
            try:
                figures = run(p.layout, knobs)
            except (PlanError, TuneError):
                raise
            except Exception as exc:  # noqa: BLE001 - a failed run is a failed trial
                trial.status, trial.reason = "failed", f"{type(exc).__name__}: {exc}"
            else:
                trial.status = "ok"
                trial.measured_tokens_per_s = float(figures["tokens_per_s"])
                trial.measured_peak = int(figures["peak"])
            measured.append(trial)
    rest = [LayoutTrial(p.layout, {}, p.tokens_per_s, p.peak) for p in fitting[measure_top:]]
    return LayoutTuneResult([*measured, *rest, *trials], budget, found.seconds)
