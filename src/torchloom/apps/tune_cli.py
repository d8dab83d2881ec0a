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

Every argument is checked before the first trial (:func:`check_arguments`): a model
the command can feed (text models: :func:`tunable_models`), positive batch sizes,
ratios in [0, 1], and output paths that can be written (``db`` and ``plot`` in existing
folders, not folders themselves, not the same file), so that a typo costs nothing.

Exit status: 0 when a candidate fits, 1 when none does, 2 on bad input, 130 on Ctrl-C.

>>> import inspect
>>> list(inspect.signature(tune_command).parameters)[:5]
['model', 'budget_gb', 'strategy', 'db', 'plot']
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from ..core.errors import ScheduleError, TuneDatabaseError, TuneError
from ..core.schedule import Schedule
from ..runtime.memory import CostModel, fake_mode
from ..schedules import zoo
from ..tune.database import TrialRecord, check_database_path
from ..tune.evaluate import TrainEvaluator
from ..tune.plot import plot_space
from ..tune.space import Point, Space
from ..tune.strategies import make_strategy
from ..tune.tuner import Tuner

__all__ = ["check_arguments", "default_ratios", "trial_table", "tunable_models", "tune_command"]

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
        stack: Any = built.get_submodule(path)
        count = len(stack)
    return [i / count for i in range(count + 1)]


def tunable_models() -> list[str]:
    """The zoo models the command can tune: those whose inputs are token ids (the
    command measures tokens per second on random tokens; ViT takes images).

    >>> tunable_models()
    ['bert', 'gpt2', 'llama', 'opt', 't5']
    """
    return zoo.list_models(text=True)


def _check_output(path: str, option: str) -> None:
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        problem, fix = "is a folder", f"name a file in it: {option} {target / 'torchloom-tune.png'}"
    elif not folder.is_dir():
        problem = f"is in a folder that does not exist ({str(folder)!r})"
        fix = f"create it first (mkdir -p {folder}) or write beside: {option} {target.name}"
    elif not os.access(folder, os.W_OK):
        problem = f"is in a folder this process cannot write ({str(folder)!r})"
        fix = f"write it elsewhere, e.g. {option} {target.name}"
    else:
        return
    raise TuneError(f"the output {option} {path!r} {problem}", primitive="torchloom tune",
                    values={option.lstrip("-"): path}, fix=fix)


def check_arguments(model: str, budget_gb: float, db: str, plot: str | None,
                    batch_sizes: Sequence[int], ratios: Sequence[float] | None = None) -> None:
    """Raise :class:`~torchloom.tune.TuneError` for arguments :func:`tune_command` cannot
    use, before any model is built or trial run.

    >>> check_arguments("gpt2", 0.05, "tune.db", None, [0, -4])
    Traceback (most recent call last):
    ...
    torchloom.core.errors.TuneError: torchloom tune(...): batch sizes must be positive integers
        values: batch_sizes=[0, -4]
        fix: --batch-sizes 1,2,4,8
    """
    models = tunable_models()
    if model not in models:
        known = model in zoo.list_models()
        problem = (f"cannot tune {model!r}: it takes images (pixel_values), and this command "
                   "feeds token ids" if known else f"unknown model {model!r}")
        raise TuneError(f"{problem}; the command tunes {', '.join(models)}",
                        primitive="torchloom tune", values={"model": model, "models": models},
                        fix=f"tune one of them, e.g. torchloom tune "
                        f"{'gpt2' if 'gpt2' in models else models[0]} --budget-gb {budget_gb:g}")
    if not isinstance(budget_gb, (int, float)) or not budget_gb > 0:
        raise TuneError("the memory budget must be positive", primitive="tune",
                        values={"budget_gb": budget_gb}, fix="e.g. --budget-gb 0.05")
    sizes = list(batch_sizes)
    if not sizes or not all(type(b) is int and b > 0 for b in sizes):
        raise TuneError("batch sizes must be positive integers", primitive="torchloom tune",
                        values={"batch_sizes": sizes}, fix="--batch-sizes 1,2,4,8")
    if ratios is not None and (not list(ratios) or not all(
            isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in ratios)):
        raise TuneError("checkpoint ratios must lie in [0, 1]", primitive="torchloom tune",
                        values={"ratios": list(ratios)}, fix="ratios=[0.0, 0.5, 1.0]")
    try:
        check_database_path(db)
    except TuneDatabaseError as exc:
        raise TuneError(exc.problem, primitive="torchloom tune", values={"db": db},
                        fix=exc.fix) from None
    if plot is not None:
        _check_output(plot, "--plot")
        if os.path.realpath(plot) == os.path.realpath(db):
            raise TuneError("the figure would overwrite the results database",
                            primitive="torchloom tune", values={"db": db, "plot": plot},
                            fix="--plot torchloom-tune.png (another file than --db)")


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
        model: a zoo model that takes tokens (:func:`tunable_models`), e.g. ``"gpt2"``.
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
    check_arguments(model, budget_gb, db, plot, batch_sizes, ratios)
    budget = int(budget_gb * GIB)
    paths = zoo.layer_paths(model)
    space = Space()
    space.create_symbol("batch_size", batch_sizes)
    space.create_symbol("ckpt_ratio", list(ratios) if ratios is not None else default_ratios(model, size))
    kwargs: dict[str, Any] = {"n_trials": trials, "seed": seed} if strategy_name == "optuna" else {}
    strategy = make_strategy(strategy_name, **kwargs)

    def make_model() -> Any:
        return zoo.make_model(model, size, seed=seed)

    def make_inputs(built: Any, point: Mapping[str, Any]) -> dict[str, Any]:
        return zoo.example_inputs(model, built, batch_size=point["batch_size"],
                                  seq_len=seq_len, seed=seed)

    def schedule(sch: Schedule, point: Point) -> None:
        for path in paths:
            sch[path].checkpoint(ratio=point["ckpt_ratio"])

    rows: list[tuple[TrialRecord, bool]] = []
    symbols = list(space.symbols)
    title = f"tuning {model} ({size}) with {strategy.name}, budget {budget / MIB:.0f} MiB"
    console.print(f"{title}: {space.count()} points; results in {db}")
    live = Live(trial_table(rows, symbols, title), console=console, refresh_per_second=4)

    def on_trial(record: TrialRecord, resumed: bool) -> None:
        rows.append((record, resumed))
        live.update(trial_table(rows, symbols, title))

    # The database is opened (and checked) before the live table starts.
    tuner = Tuner(
        space, make_model, schedule,
        TrainEvaluator(make_model, make_inputs, steps=steps, warmup=warmup, seed=seed,
                       memory_limit_bytes=budget if simulate_oom else None),
        cost_model=CostModel(make_model, make_inputs), budget_bytes=budget,
        db=db, study=f"{model}-{size}-seq{seq_len}", on_trial=on_trial)
    try:
        with live:
            result = tuner.run(strategy)
    finally:
        tuner.close()
    console.line()
    console.print(
        f"{result.evaluations} evaluated, {result.resumed} resumed from {db}, "
        f"{len(result.pruned)} pruned by the cost model, {result.seconds:.1f} s")
    if result.discarded:
        console.print(f"[yellow]{result.discarded} stored trials of {db} did not hold this "
                      "schedule's recipe[/]: they were run again and replaced")
    if result.remeasured:
        console.print(f"the best trial read from {db} was measured again before it is "
                      f"reported ({result.remeasured} run)")
    for note in result.notes:
        console.print(f"[yellow]{note}[/]")
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
