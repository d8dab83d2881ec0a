"""``torchloom bench`` at a tiny size, in-process: the three variants, their keys and sane
values. Timings are printed by the bench, never compared."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from torchloom.apps.bench import (
    VARIANTS,
    BenchConfig,
    _candidates,
    _Choice,
    _choices,
    _Fit,
    _sweep,
    largest_batch,
    run_bench,
)
from torchloom.apps.cli import app
from torchloom.core.errors import ScheduleError

KEYS = {"model", "variant", "tokens_per_s", "peak_activation_bytes", "mfu"}


def test_bench_tiny_gpt2_json_and_plot(tmp_path):
    threads = torch.get_num_threads()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    try:
        # aot_eager: torch.compile with AOT autograd but no inductor codegen (seconds).
        result = CliRunner().invoke(app, [
            "bench", "--models", "gpt2", "--size", "tiny", "--steps", "2", "--budget-mb", "2",
            "--compile-backend", "aot_eager", "--threads", "1", "--no-schedule-compile",
            "--sweep-steps", "0", "--json", str(out), "--plot", str(png),
        ])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "torchloom bench" in result.output
    rows = json.loads(out.read_text())
    assert [(r["model"], r["variant"]) for r in rows] == [("gpt2", v) for v in VARIANTS]
    by = {r["variant"]: r for r in rows}
    for row in rows:
        assert KEYS <= set(row)
        assert row["tokens_per_s"] > 0
        assert 0 < row["mfu"] < 1.5
        assert row["peak_activation_bytes"] > 0
        assert row["saved_activation_bytes"] <= row["peak_activation_bytes"]
        assert len(row["step_s_all"]) == 2
        assert row["model_flops_per_step"] > 0
    assert by["torchloom"]["ckpt_ratio"] > 0
    # Per sequence, the schedule saves fewer bytes, so it runs a larger batch in the budget.
    per_seq = {v: r["peak_activation_bytes"] / r["batch_size"] for v, r in by.items()}
    assert per_seq["torchloom"] < per_seq["eager"]
    assert by["torchloom"]["batch_size"] > by["eager"]["batch_size"]
    for row in (by["eager"], by["torchloom"]):
        assert row["fits_budget"] and row["peak_activation_bytes"] <= 2 * 2**20
    assert by["compile"]["compile_s"] > 0
    # Plain layers: the least ratio that doubles eager's batch (no sweep by default).
    assert by["torchloom"]["schedule"] == {"ckpt_ratio": by["torchloom"]["ckpt_ratio"],
                                           "compile": False, "compile_scope": "none",
                                           "chosen_by": "default"}
    assert "compile_s" not in by["torchloom"] and by["torchloom"]["ckpt_sweep"] == []
    batches = by["torchloom"]["ckpt_batches"]
    assert batches["0"] < by["torchloom"]["batch_size"] == batches[
        f"{by['torchloom']['ckpt_ratio']:g}"]
    assert list(batches.values()) == sorted(batches.values())  # more checkpointing, more batch
    assert by["eager"]["speedup_vs_eager"] == 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fixed_ratio_same_batch_saves_less():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run_bench(BenchConfig(models=["bert"], size="tiny", steps=1, budget_bytes=2**20,
                                     max_batch=2, ckpt_ratio=1.0, variants=("eager", "torchloom"),
                                     schedule_compile=False))
    finally:
        torch.set_num_threads(threads)
    eager, sched = rows
    assert (eager["variant"], sched["variant"]) == ("eager", "torchloom")
    assert eager["batch_size"] == sched["batch_size"] == 2  # max_batch caps both
    assert sched["saved_activation_bytes"] < eager["saved_activation_bytes"]
    assert sched["peak_activation_bytes"] <= eager["peak_activation_bytes"]


def test_bad_model_is_a_schedule_error():
    with pytest.raises(ScheduleError, match="no 'opt' model"):
        run_bench(BenchConfig(models=["opt"], size="tiny", steps=1))


def test_largest_batch():
    assert largest_batch(lambda b: 10 * b, 35, 8) == 3
    assert largest_batch(lambda b: 10 * b, 1000, 8) == 8


def _fit(ratio: float, batch: int) -> _Fit:
    return _Fit(ratio, lambda b: float(b), batch)


def test_candidates_are_no_checkpointing_and_the_least_doubling_ratio():
    eager = _fit(0.0, 2)
    fits = [_fit(0.0, 3), _fit(0.25, 3), _fit(0.5, 4), _fit(0.75, 6), _fit(1.0, 9)]
    cfg = BenchConfig()
    assert [(f.ratio, f.batch) for f in _candidates(eager, fits, cfg)] == [(0.0, 3), (0.5, 4)]
    # Nothing doubles eager's batch: the largest batch, with the least ratio that gets it.
    fits = [_fit(0.0, 3), _fit(0.5, 3), _fit(1.0, 3)]
    assert [(f.ratio, f.batch) for f in _candidates(_fit(0.0, 3), fits, cfg)] == [(0.0, 3)]
    # A given ratio is the only candidate.
    cfg = BenchConfig(ckpt_ratio=0.75)
    fits = [_fit(0.0, 3), _fit(0.75, 6)]
    assert [(f.ratio, f.batch) for f in _candidates(eager, fits, cfg)] == [(0.75, 6)]


def test_the_measured_choice_includes_the_baselines_equivalents():
    eager = _fit(0.0, 2)
    fits = [_fit(0.0, 3), _fit(0.5, 4), _fit(1.0, 9)]
    assert _choices(eager, fits, BenchConfig(sweep_steps=2)) == [
        _Choice("layers", 0.0, 3), _Choice("layers", 0.5, 4), _Choice("none", 0.0, 2),
        _Choice("whole", 0.0, 2)]
    # not measured: only the schedule's own candidates; no compilation: nothing compiled
    assert _choices(eager, fits, BenchConfig(sweep_steps=0)) == [
        _Choice("layers", 0.0, 3), _Choice("layers", 0.5, 4)]
    assert _choices(eager, fits, BenchConfig(schedule_compile=False)) == [
        _Choice("none", 0.0, 3), _Choice("none", 0.5, 4), _Choice("none", 0.0, 2)]
    # a given ratio is not chosen
    fits = [_fit(0.0, 3), _fit(0.75, 6)]
    assert _choices(eager, fits, BenchConfig(ckpt_ratio=0.75)) == [_Choice("layers", 0.75, 6)]


def test_sweep_times_every_candidate():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = BenchConfig(models=["gpt2"], size="tiny", compile_backend="aot_eager",
                          sweep_steps=2)
        lines: list[str] = []
        choices = [_Choice("none", 0.0, 1), _Choice("none", 1.0, 2), _Choice("whole", 0.0, 1)]
        out = _sweep("gpt2", cfg, choices, torch.device("cpu"), lines.append)
    finally:
        torch.set_num_threads(threads)
    assert [c for c, _ in out] == choices
    assert all(tps > 0 for _, tps in out)
    assert lines[1] == f"gpt2: schedule candidate (nothing compiled, ckpt ratio 1, batch 2): " \
                       f"{out[1][1]:,.0f} tokens/s"
    assert _sweep("gpt2", BenchConfig(sweep_steps=0), choices, torch.device("cpu"),
                  lines.append) == []


def test_the_schedule_row_is_the_fastest_measured_candidate():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lines: list[str] = []
        rows = run_bench(BenchConfig(models=["gpt2"], size="tiny", steps=1,
                                     budget_bytes=2 * 2**20, compile_backend="aot_eager",
                                     sweep_steps=1, variants=("eager", "torchloom")),
                         log=lines.append)
    finally:
        torch.set_num_threads(threads)
    sched = rows[1]
    sweep = sched["ckpt_sweep"]
    assert {c["compile_scope"] for c in sweep} == {"layers", "none", "whole"}
    best = max(sweep, key=lambda c: c["tokens_per_s"])
    assert sched["schedule"]["chosen_by"] == "measurement"
    assert (sched["schedule"]["compile_scope"], sched["ckpt_ratio"], sched["batch_size"]) == (
        best["compile_scope"], best["ckpt_ratio"], best["batch_size"])
    assert any(line.startswith("gpt2: chosen by measurement: ") for line in lines)


def test_compiled_layers_run_without_checkpoints_by_default():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run_bench(BenchConfig(models=["gpt2"], size="tiny", steps=1,
                                     budget_bytes=2 * 2**20, compile_backend="aot_eager",
                                     sweep_steps=0, variants=("eager", "torchloom")))
    finally:
        torch.set_num_threads(threads)
    sched = rows[1]
    assert sched["schedule"] == {"ckpt_ratio": 0.0, "compile": "aot_eager",
                                 "compile_scope": "layers", "chosen_by": "default"}
    assert sched["compile_s"] > 0 and sched["fits_budget"]
    assert sched["batch_size"] == sched["ckpt_batches"]["0"]


def test_the_schedule_variant_is_built_by_parallelize():
    """The bench's schedule is the layout ``Layout(ckpt_ratio=r)`` that
    ``torchloom.parallelize`` builds: the layers it checkpoints are the layout's, each
    compiled in place (or the root compiled, for the whole-model candidate)."""
    from torchloom.apps.bench import _layers, _scheduled
    from torchloom.core.marks import CHECKPOINTED, COMPILED, has_mark
    from torchloom.parallel import Layout

    cfg = BenchConfig(models=["llama"], size="tiny", compile_backend="eager")
    model = _scheduled("llama", "tiny", cfg, 0.5, "layers")
    layers = _layers(model, "llama")
    marked = [has_mark(layer, CHECKPOINTED) for layer in layers]
    assert sum(marked) == Layout(ckpt_ratio=0.5).checkpointed(len(layers)) >= 1
    assert marked == sorted(marked, reverse=True)  # the first ones
    assert all(has_mark(layer, COMPILED) for layer in layers)
    whole = _scheduled("llama", "tiny", cfg, 0.0, "whole")
    assert has_mark(whole, COMPILED)
    assert not any(has_mark(layer, COMPILED) for layer in _layers(whole, "llama"))
