"""Tests of torchloom.tune: the space, the strategies, pruning, resuming, the command.

The strategy tests use a synthetic, deterministic evaluate (no training); only the cost
model's accuracy test (test_tune_memory.py) trains for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

import torchloom as tl
from torchloom.tune import (
    BinarySearch,
    Database,
    Exhaustive,
    ModelBased,
    Result,
    Space,
    Symbol,
    TuneError,
    Tuner,
    point_key,
)

# --------------------------------------------------------------------------- space


def test_dependent_space_enumerates_in_order() -> None:
    space = Space()
    bs = space.create_symbol("batch_size", [8, 16, 32])
    ckpt = space.create_symbol(
        "ckpt_ratio", lambda p: [0.5, 1.0] if p["batch_size"] >= 16 else [0.0, 0.5, 1.0])
    space.create_symbol("kernel", lambda p: ["eager", "sdpa"] if p["ckpt_ratio"] < 1 else ["sdpa"])
    space.add_constraint(lambda p: not (p["batch_size"] == 32 and p["kernel"] == "eager"))
    assert isinstance(bs, Symbol) and ckpt.is_dependent and not bs.is_dependent
    points = list(space.enumerate())
    assert points == list(space.enumerate())  # deterministic
    assert space.count() == len(points) == 10
    assert [tuple(p.values()) for p in points] == [  # depth-first, values in given order
        (8, 0.0, "eager"), (8, 0.0, "sdpa"), (8, 0.5, "eager"), (8, 0.5, "sdpa"), (8, 1.0, "sdpa"),
        (16, 0.5, "eager"), (16, 0.5, "sdpa"), (16, 1.0, "sdpa"), (32, 0.5, "sdpa"),
        (32, 1.0, "sdpa"),
    ]
    assert {"batch_size": 32, "ckpt_ratio": 0.5, "kernel": "sdpa"} in points
    assert {"batch_size": 32, "ckpt_ratio": 0.5, "kernel": "eager"} not in points
    assert space.contains({"batch_size": 16, "ckpt_ratio": 1.0, "kernel": "sdpa"})
    assert not space.contains({"batch_size": 16, "ckpt_ratio": 0.0, "kernel": "sdpa"})


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda s: (s.create_symbol("a", [1]), s.create_symbol("a", [2])), "defined twice"),
        (lambda s: s.create_symbol("a", []), "no candidate values"),
        (lambda s: s.create_symbol("a", [nn.Linear]), "not a finite JSON scalar"),
        (lambda s: s.create_symbol("a", [float("nan")]), "not a finite JSON scalar"),
        (lambda s: s.create_symbol("a", "abc"), "must be a list"),
        (lambda s: s.create_symbol("not a name", [1]), "identifier"),
        (lambda s: s.add_constraint(3), "constraint must be a function"),
        (lambda s: (s.create_symbol("a", lambda p: [p["b"]]), s.count()), "not fixed before"),
        (lambda s: (s.create_symbol("a", lambda p: 3), s.count()), "not a list"),
        (lambda s: (s.create_symbol("a", lambda p: []), s.count()), "no candidate values"),
        (lambda s: (s.create_symbol("a", [1]), s.add_constraint(lambda p: p["zz"]), s.count()),
         "constraint 0 raised"),
        (lambda s: s.count(), "no symbols"),
    ],
)
def test_bad_space_definitions_raise_tune_errors(build, needle) -> None:
    with pytest.raises(TuneError, match=re.escape(needle)) as info:
        build(Space())
    assert needle in str(info.value)
    assert isinstance(info.value, tl.ScheduleError)
    assert info.value.fix  # every error says what to do


# --------------------------------------------------------------------------- synthetic world

BATCH = [1, 2, 4, 8, 16, 32, 64, 128]
RATIOS = [0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
LIMIT = 40.0  # synthetic memory units


def grid_space() -> Space:
    space = Space()
    space.create_symbol("batch_size", BATCH)
    space.create_symbol("ckpt_ratio", RATIOS)
    return space


def memory(point: dict) -> float:
    """Grows with the batch size, falls with checkpointing."""
    return point["batch_size"] * (1.1 - point["ckpt_ratio"])


def speed(point: dict) -> float:
    """Saturates with the batch size; recompute costs up to a third."""
    b = point["batch_size"]
    return 1000.0 * b / (b + 8) * (1 - point["ckpt_ratio"] / 3)


def tiny_model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])


def schedule(sch: tl.Schedule, point: dict) -> None:
    sch.checkpoint(ratio=point["ckpt_ratio"])


class Synthetic:
    """A deterministic evaluate: out of memory above LIMIT, logs every call."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        self.calls: list[dict] = []
        self.interrupt_after = interrupt_after

    def __call__(self, recipe: tl.Recipe, point: dict) -> Result:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt(f"synthetic interrupt after {self.interrupt_after} trials")
        assert recipe[0].kwargs == {"ratio": point["ckpt_ratio"]}  # the candidate is the point's
        self.calls.append(dict(point))
        if memory(point) > LIMIT:
            return Result(0.0, None, ok=False, error="out of memory")
        return Result(speed(point), int(memory(point)))


def run(strategy, evaluate=None, **kwargs):
    evaluate = evaluate or Synthetic()
    result = Tuner(grid_space(), tiny_model, schedule, evaluate, **kwargs).run(strategy)
    return result, evaluate


def test_binary_search_finds_the_exhaustive_best_with_a_third_of_the_evaluations() -> None:
    full, full_eval = run(Exhaustive())
    assert len(full_eval.calls) == grid_space().count() == 72
    binary, binary_eval = run(BinarySearch())
    assert binary.best is not None and full.best is not None
    assert binary.best.throughput >= 0.95 * full.best.throughput
    assert binary.best.point == full.best.point == {"batch_size": 32, "ckpt_ratio": 0.0}
    assert binary.evaluations == len(binary_eval.calls) <= 72 // 3
    assert len({point_key(p) for p in binary_eval.calls}) == len(binary_eval.calls)  # no repeats


def test_binary_search_handles_dependent_ratios_and_other_symbols() -> None:
    space = Space()
    space.create_symbol("tp", [1, 2])
    space.create_symbol("batch_size", [4, 8, 16, 32, 64])
    space.create_symbol("ckpt_ratio", lambda p: RATIOS if p["batch_size"] >= 16 else [0.0])
    seen = Synthetic()

    def evaluate(recipe: tl.Recipe, point: dict) -> Result:
        scaled = {**point, "batch_size": point["batch_size"] // point["tp"]}
        return seen(recipe, scaled) if memory(scaled) <= LIMIT else Result(0, ok=False)

    result = Tuner(space, tiny_model, schedule, evaluate).run("binary")
    full = Tuner(space, tiny_model, schedule, evaluate).run("exhaustive")
    assert full.evaluations == space.count() == 58
    assert result.best is not None and result.best.throughput == full.best.throughput
    assert {r.point["tp"] for r in result.records} == {1, 2}  # each tp searched
    assert result.evaluations <= space.count() // 3


def test_model_based_strategy_is_seeded_and_budgeted() -> None:
    first, first_eval = run(ModelBased(n_trials=12, seed=3))
    _, second_eval = run(ModelBased(n_trials=12, seed=3))
    assert first_eval.calls == second_eval.calls  # same seed, same proposals
    assert first.evaluations == 12
    full, _ = run(Exhaustive())
    assert first.best is not None and first.best.throughput >= 0.6 * full.best.throughput


def test_strategy_errors() -> None:
    space = Space()
    space.create_symbol("bs", [1, 2])
    with pytest.raises(TuneError, match="needs symbols"):
        Tuner(space, tiny_model, lambda s, p: None, Synthetic()).run("binary")
    with pytest.raises(TuneError, match="unknown strategy"):
        Tuner(space, tiny_model, lambda s, p: None, Synthetic()).run("annealing")


def test_a_failing_candidate_is_recorded_and_the_search_goes_on() -> None:
    def evaluate(recipe: tl.Recipe, point: dict) -> Result:
        if point["ckpt_ratio"] == 0.5:
            raise RuntimeError("kernel exploded")
        return Result(speed(point))

    result, _ = run(Exhaustive(), evaluate=evaluate)
    failed = [r for r in result.records if r.status == "failed"]
    assert len(failed) == len(BATCH) and "kernel exploded" in failed[0].error
    assert result.best is not None and result.best.point["ckpt_ratio"] == 0.0


def test_candidates_must_be_data() -> None:
    space = Space()
    space.create_symbol("a", [1])

    def bad(sch: tl.Schedule, point: dict) -> None:
        sch["0"].replace(nn.Linear(4, 4))  # an instance: not data

    with pytest.raises(TuneError, match="must be data") as info:
        Tuner(space, tiny_model, bad, Synthetic()).run("exhaustive")
    assert "import path" in info.value.fix


# --------------------------------------------------------------------------- pruning


def test_no_candidate_the_cost_model_rules_out_is_run(tmp_path: Path) -> None:
    predicted: dict[str, float] = {}

    def cost_model(recipe: tl.Recipe, point: dict) -> int:
        predicted[point_key(point)] = memory(point)
        return int(memory(point) * 1000)

    for strategy in ("exhaustive", "binary", "optuna"):
        evaluate = Synthetic()
        db = tmp_path / f"{strategy}.db"
        result, _ = run(strategy, evaluate, cost_model=cost_model, budget_bytes=int(LIMIT * 1000),
                        db=db)
        assert evaluate.calls and all(memory(p) <= LIMIT for p in evaluate.calls)
        over = {point_key(p) for p in grid_space().enumerate() if memory(p) > LIMIT}
        assert over and {r.key for r in result.pruned} == over  # all found before any run
        rows = Database(db).load()
        assert {r.key for r in rows if r.status == "pruned"} == over
        assert all(r.peak_memory_bytes is None for r in rows if r.status == "pruned")


def test_real_cost_model_prunes_before_evaluation() -> None:
    from tests.test_tune_memory import gpt2, gpt2_inputs, gpt2_schedule

    space = Space()
    space.create_symbol("batch_size", [2, 32])
    space.create_symbol("ckpt_ratio", [0.0, 1.0])
    cost = tl.tune.CostModel(gpt2, gpt2_inputs)
    budget = 30 * 2**20
    seen: list[dict] = []

    def evaluate(recipe: tl.Recipe, point: dict) -> Result:
        seen.append(point)
        return Result(float(point["batch_size"]))

    result = Tuner(space, gpt2, gpt2_schedule, evaluate, cost_model=cost,
                   budget_bytes=budget).run("exhaustive")
    assert [r.point for r in result.pruned] == [{"batch_size": 32, "ckpt_ratio": 0.0}]
    assert len(seen) == 3 and {"batch_size": 32, "ckpt_ratio": 0.0} not in seen
    assert all(r.predicted_memory_bytes <= budget for r in result.records if r.status == "ok")


def test_a_larger_budget_runs_points_pruned_before(tmp_path: Path) -> None:
    def cost_model(recipe: tl.Recipe, point: dict) -> int:
        return int(memory(point) * 1000)

    db = tmp_path / "budget.db"
    small, small_eval = run("exhaustive", cost_model=cost_model, budget_bytes=20_000, db=db)
    large, large_eval = run("exhaustive", cost_model=cost_model, budget_bytes=40_000, db=db)
    assert all(20 < memory(p) <= 40 for p in large_eval.calls)  # only the newly allowed
    assert len(small_eval.calls) + len(large_eval.calls) == sum(
        memory(p) <= 40 for p in grid_space().enumerate())
    assert large.resumed == len(small_eval.calls) + len(large.pruned)
    assert large.best.throughput > small.best.throughput


def test_a_strategy_cannot_ask_for_a_point_outside_the_space() -> None:
    tuner = Tuner(grid_space(), tiny_model, schedule, Synthetic())
    with pytest.raises(TuneError, match="not in the space"):
        tuner.trial({"batch_size": 3, "ckpt_ratio": 0.0})


# --------------------------------------------------------------------------- resuming


@pytest.mark.parametrize("strategy", ["exhaustive", "binary", "optuna"])
def test_interrupted_run_resumes_without_repeating_trials(tmp_path: Path, strategy: str) -> None:
    def make(s: str):
        return ModelBased(n_trials=15, seed=1) if s == "optuna" else s

    reference, reference_eval = run(make(strategy))
    stop = max(2, len(reference_eval.calls) // 2)
    db = tmp_path / "trials.db"
    first = Synthetic(interrupt_after=stop)
    with pytest.raises(KeyboardInterrupt, match=rf"^synthetic interrupt after {stop} trials$"):
        run(make(strategy), first, db=db)
    assert len(first.calls) == stop
    assert len(Database(db).load()) == stop  # every finished trial was committed

    second = Synthetic()
    resumed, _ = run(make(strategy), second, db=db)
    # a best read from the database is measured once more, after the search
    trials = second.calls[:len(second.calls) - resumed.remeasured]
    assert second.calls[len(trials):] == ([resumed.best.point] if resumed.remeasured else [])
    done = {point_key(p) for p in first.calls}
    assert not done & {point_key(p) for p in trials}  # nothing ran twice
    assert resumed.resumed == stop
    assert len(first.calls) + len(trials) == len(reference_eval.calls)
    assert resumed.best.point == reference.best.point
    assert resumed.best.throughput == reference.best.throughput
    assert sorted(r.key for r in resumed.records) == sorted(r.key for r in reference.records)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from tests.test_tune import Synthetic, run
    evaluate = Synthetic()
    real = evaluate.__call__
    def killing(recipe, point):
        if len(evaluate.calls) == {kill_after}:
            os.kill(os.getpid(), signal.SIGKILL)   # no cleanup, no commit of this trial
        return real(recipe, point)
    result, _ = run("exhaustive", killing, db={db!r})
    print("finished", result.best.point)
    """
)


def test_sigkill_loses_no_finished_trial(tmp_path: Path) -> None:
    db = str(tmp_path / "killed.db")
    root = str(Path(__file__).resolve().parent.parent)
    script = KILL_SCRIPT.format(root=root, kill_after=10, db=db)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rows = Database(db).load()
    assert len(rows) == 10 and all(r.finished for r in rows)
    second = Synthetic()
    resumed, _ = run("exhaustive", second, db=db)
    reference, _ = run("exhaustive")
    trials = second.calls[:len(second.calls) - resumed.remeasured]
    assert len(trials) == 72 - 10
    assert not {r.key for r in rows} & {point_key(p) for p in trials}
    assert resumed.best.point == reference.best.point
    assert json.loads(rows[0].recipe)["entries"][0]["primitive"] == "checkpoint"


# --------------------------------------------------------------------------- the command


def test_tune_command_prints_table_best_recipe_and_plot(tmp_path: Path) -> None:
    from rich.console import Console

    from torchloom.apps.tune_cli import tune_command

    console = Console(record=True, width=120, force_terminal=False)
    db, plot = str(tmp_path / "tune.db"), str(tmp_path / "space.png")
    status = tune_command("gpt2", 0.004, "binary", db, plot, batch_sizes=(2, 4, 64),
                          seq_len=16, steps=1, warmup=0, threads=1, console=console)
    text = console.export_text()
    assert status == 0, text
    assert "pruned" in text and "ok" in text  # the table
    assert "sch['transformer.h'].checkpoint(ratio=" in text  # the best recipe, as Python
    assert Path(plot).stat().st_size > 10_000
    rows = Database(db, study="gpt2-tiny-seq16").load()
    assert {r.status for r in rows} == {"ok", "pruned"}
    again = tune_command("gpt2", 0.004, "binary", db, None, batch_sizes=(2, 4, 64),
                         seq_len=16, steps=1, warmup=0, threads=1, console=console)
    assert again == 0 and "0 evaluated" in console.export_text()  # all resumed
    assert tune_command("gpt2", -1, "binary", db, None, console=console) == 2
