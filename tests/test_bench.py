"""``torchloom bench`` at a tiny size, in-process: the three variants, their keys and sane
values. Timings are printed by the bench, never compared."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from torchloom.bench import VARIANTS, BenchConfig, largest_batch, run_bench
from torchloom.cli import app
from torchloom.errors import ScheduleError

KEYS = {"model", "variant", "tokens_per_s", "peak_activation_bytes", "mfu"}


def test_bench_tiny_gpt2_json_and_plot(tmp_path):
    threads = torch.get_num_threads()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    try:
        # aot_eager: torch.compile with AOT autograd but no inductor codegen (seconds).
        result = CliRunner().invoke(app, [
            "bench", "--models", "gpt2", "--size", "tiny", "--steps", "2", "--budget-mb", "2",
            "--compile-backend", "aot_eager", "--threads", "1",
            "--json", str(out), "--plot", str(png),
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
    assert by["eager"]["speedup_vs_eager"] == 1.0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fixed_ratio_same_batch_saves_less():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = run_bench(BenchConfig(models=["bert"], size="tiny", steps=1, budget_bytes=2**20,
                                     max_batch=2, ckpt_ratio=1.0, variants=("eager", "torchloom")))
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
