"""``torchloom tune MODEL --budget-gb N``: tune batch size and checkpoint ratio of a zoo model.

:func:`tune_command` is the body of the command; the ``torchloom`` command line wires
it up. It searches batch size x checkpoint ratio (the ratio of each of the model's layer
lists, ``sch[path].checkpoint(ratio=r)``) for a zoo model on the CPU, with

* the memory cost model pruning every candidate over ``budget_gb`` before any runs;
* each remaining candidate trained for a few steps in-process; its measured peak above the
  budget counts as out of memory (``simulate_oom``), as on a device of that size;
* a live table of the trials, the best recipe printed as Python, and the figure of the
  explored space written to ``plot``;
* results in the SQLite file ``db``: run the command again after an interruption and it
  resumes, running no finished trial twice.

Exit status: 0 when a candidate fits, 1 when none does, 2 on bad input, 130 on Ctrl-C.

>>> import inspect
>>> list(inspect.signature(tune_command).parameters)[:5]
['model', 'budget_gb', 'strategy', 'db', 'plot']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from .. import zoo
from ..errors import ScheduleError
from ..schedule import Schedule
from .database import TrialRecord
from .errors import TuneError
from .evaluate import TrainEvaluator
from .memory import CostModel, fake_mode
from .plot import plot_space
from .space import Point, Space
from .strategies import make_strategy
from .tuner import Tuner

__all__ = ["default_ratios", "trial_table", "tune_command"]

MIB = 2**20
GIB = 2**30


def default_ratios(model: str, size: str = "tiny") -> list[float]:
    """``[0, 1/n, ..., 1]`` for a model with ``n`` layers in its (first) layer list: every
    distinct amount of checkpointing.

    >>> default_ratios("gpt2")
    [0.0, 0.5, 1.0]
    """
    with fake_mode():
        built = zoo.make_model(model, size)
        path = zoo.layer_paths(model)[0]
        count = len(built.get_submodule(path))
    return [i / count for i in range(count + 1)]


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def trial_table(records: Sequence[tuple[TrialRecord, bool]], symbols: Sequence[str],
                title: str = "trials") -> Table:
    """A rich table of trials: the point, status, throughput, predicted and measured
    memory and the prediction's error. ``records`` pairs each record with whether it was
    resumed from the database."""
    table = Table(title=title, header_style="bold")
    table.add_column("#", justify="right")
    for name in symbols:
        table.add_column(name, justify="right")
    for name in ("status", "tokens/s", "predicted MiB", "measured MiB", "error"):
        table.add_column(name, justify="right" if name != "status" else "left")
    colours = {"ok": "green", "failed": "red", "pruned": "yellow"}
    for number, (r, resumed) in enumerate(records, start=1):
        err = "-"
        if r.peak_memory_bytes and r.predicted_memory_bytes is not None:
            err = f"{(r.predicted_memory_bytes - r.peak_memory_bytes) / r.peak_memory_bytes:+.1%}"
        status = f"[{colours.get(r.status, 'white')}]{r.status}[/]" + (" (db)" if resumed else "")
        table.add_row(str(number), *[str(r.point.get(s)) for s in symbols], status,
                      f"{r.throughput:.0f}" if r.status == "ok" else "-",
                      _mib(r.predicted_memory_bytes), _mib(r.peak_memory_bytes), err)
    return table


def tune_command(
    model: str,
    budget_gb: float,
    strategy: str = "binary",
    db: str = "torchloom-tune.db",
    plot: str | None = "torchloom-tune.png",
    *,
    size: str = "tiny",
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    ratios: Sequence[float] | None = None,
    seq_len: int = 64,
    trials: int = 10,
    steps: int = 2,
    warmup: int = 2,
    seed: int = 0,
    simulate_oom: bool = True,
    threads: int | None = None,
    console: Console | None = None,
) -> int:
    """Tune a zoo model's batch size and checkpoint ratio under a memory budget.

    Args:
        model: a zoo name (``torchloom.zoo.list_models()``), e.g. ``"gpt2"``.
        budget_gb: memory per rank in GiB (fractions allowed: ``0.05`` is 51 MiB).
        strategy: ``"binary"``, ``"exhaustive"`` or ``"optuna"``.
        db: the SQLite results file; the study inside it is named after model and size.
        plot: where to write the PNG figure of the explored space; None: no figure.
        size: the zoo size.
        batch_sizes: candidate batch sizes.
        ratios: candidate checkpoint ratios (default :func:`default_ratios`).
        seq_len: tokens per sample.
        trials: points to try with ``"optuna"``.
        steps, warmup: measured and untimed training steps per candidate.
        seed: seeds the model, the inputs and the optuna sampler.
        simulate_oom: a measured peak above the budget fails the candidate.
        threads: torch CPU threads while tuning (restored after); None: leave as is. On a
            shared or busy machine 1 thread gives far steadier timings.
        console: where to print (default: a new rich console).

    Returns:
        The exit status (see the module docstring).
    """
    console = console or Console()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _tune(model, budget_gb, strategy, db, plot, size, list(batch_sizes),
                     ratios, seq_len, trials, steps, warmup, seed, simulate_oom, console)
    except ScheduleError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: finished trials are saved in {db}; run the "
                      "same command again to resume")
        return 130
    finally:
        torch.set_num_threads(previous_threads)


def _tune(model: str, budget_gb: float, strategy_name: str, db: str, plot: str | None,
          size: str, batch_sizes: list[int], ratios: Sequence[float] | None, seq_len: int,
          trials: int, steps: int, warmup: int, seed: int, simulate_oom: bool,
          console: Console) -> int:
    if not budget_gb > 0:
        raise TuneError("the memory budget must be positive", primitive="tune",
                        values={"budget_gb": budget_gb}, fix="e.g. --budget-gb 0.05")
    budget = int(budget_gb * GIB)
    paths = zoo.layer_paths(model)
    space = Space()
    space.create_symbol("batch_size", batch_sizes)
    space.create_symbol("ckpt_ratio", list(ratios) if ratios is not None else default_ratios(model, size))
    kwargs: dict[str, Any] = {"n_trials": trials, "seed": seed} if strategy_name == "optuna" else {}
    strategy = make_strategy(strategy_name, **kwargs)

    def make_model() -> Any:
        return zoo.make_model(model, size, seed=seed)

    def make_inputs(built: Any, point: Point) -> dict[str, Any]:
        return zoo.example_inputs(model, built, batch_size=point["batch_size"],
                                  seq_len=seq_len, seed=seed)

    def schedule(sch: Schedule, point: Point) -> None:
        for path in paths:
            sch[path].checkpoint(ratio=point["ckpt_ratio"])

    rows: list[tuple[TrialRecord, bool]] = []
    symbols = list(space.symbols)
    title = f"tuning {model} ({size}) with {strategy.name}, budget {budget / MIB:.0f} MiB"
    console.print(f"{title}: {space.count()} points; results in {db}")
    with Live(trial_table(rows, symbols, title), console=console, refresh_per_second=4) as live:

        def on_trial(record: TrialRecord, resumed: bool) -> None:
            rows.append((record, resumed))
            live.update(trial_table(rows, symbols, title))

        tuner = Tuner(
            space, make_model, schedule,
            TrainEvaluator(make_model, make_inputs, steps=steps, warmup=warmup, seed=seed,
                           memory_limit_bytes=budget if simulate_oom else None),
            cost_model=CostModel(make_model, make_inputs), budget_bytes=budget,
            db=db, study=f"{model}-{size}-seq{seq_len}", on_trial=on_trial)
        try:
            result = tuner.run(strategy)
        finally:
            tuner.close()
    console.line()
    console.print(
        f"{result.evaluations} evaluated, {result.resumed} resumed from {db}, "
        f"{len(result.pruned)} pruned by the cost model, {result.seconds:.1f} s")
    if plot is not None:
        plot_space(result.records, plot, title=title, all_points=list(space.enumerate()))
        console.print(f"figure of the explored space: {plot}")
    if result.best is None:
        console.print("[bold red]no candidate fits the budget[/]: raise --budget-gb or add "
                      "smaller batch sizes")
        return 1
    console.print(f"best: {result.best.point}, {result.best.throughput:.0f} tokens/s")
    console.print(Panel(Syntax(str(result.best_recipe), "python", theme="ansi_dark"),
                        title="best recipe", expand=False))
    return 0
