"""The ``torchloom`` command line (also ``python -m torchloom``).

Commands:

* ``torchloom demo``: train a small GPT-2 on the bytes of Python's own standard library
  under a schedule (activation checkpointing on a ratio of the layers), with a progress
  bar, the loss as it falls, and the throughput in tokens/s;
* ``torchloom show MODEL``: print the schedule tree of a zoo model, optionally with the
  demo schedule applied;
* ``torchloom train``: train a zoo model under its built-in schedule on one process or a
  (dp, tp) mesh (``torchrun`` or local ranks), saving checkpoints and resuming exactly;
* ``torchloom tune MODEL --budget-gb N``: search batch size and checkpoint ratio under a
  memory budget (pruning with the cost model), with a live table, the best recipe and a plot;
* ``torchloom verify MODEL --tp N``: apply the model's built-in schedule inside
  :class:`~torchloom.Verify` on N local ranks and report what was compared;
* ``torchloom list-primitives``: the primitives a schedule offers.

A :class:`~torchloom.errors.ScheduleError` is printed as its message, without a
traceback, and the command exits with status 2.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from typing import Any, Callable, TypeVar

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.syntax import Syntax
from rich.table import Table

from . import __version__, data, zoo
from .build import build
from .errors import ScheduleError
from .primitives import list_primitives
from .schedule import Schedule, create_schedule
from .show import rich_tree

__all__ = ["app", "main", "apply_demo_schedule"]

F = TypeVar("F", bound=Callable[..., Any])

EXIT_SCHEDULE_ERROR = 2

app = typer.Typer(
    name="torchloom",
    help="torchloom: a schedule language for progressive optimization of model training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _clean_errors(command: F) -> F:
    """Print a ScheduleError as its message (no traceback) and exit with status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ScheduleError as exc:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(EXIT_SCHEDULE_ERROR) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"torchloom {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """torchloom: a schedule language for progressive optimization of model training."""


def apply_demo_schedule(sch: Schedule, model_name: str, ckpt_ratio: float) -> None:
    """The built-in demo schedule: checkpoint the first ``ckpt_ratio`` of the transformer
    layers of each layer stack of a zoo model (``0`` checkpoints none)."""
    for path in zoo.layer_paths(model_name):
        sch[path].checkpoint(ratio=ckpt_ratio)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _default_threads() -> tuple[int, str]:
    """One thread per idle core: torch's OpenMP threads spin while they wait for each other,
    so a thread that has to share its core with another busy process slows every step down
    many times over (measured: 5x-10x on a 2-core machine running other jobs)."""
    cores = _available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return cores, f"{cores} cores"
    threads = max(1, min(cores, cores - round(load)))
    if threads == cores:
        return cores, f"{cores} cores"
    return threads, f"{cores} cores, load {load:.1f}; --threads {cores} to use all"


def _lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of peak."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@app.command()
@_clean_errors
def demo(
    steps: int = typer.Option(200, min=1, help="Training steps."),
    batch_size: int = typer.Option(8, min=1, help="Sequences per step."),
    seq_len: int = typer.Option(128, min=2, help="Bytes per sequence."),
    layers: int = typer.Option(4, min=1, help="GPT-2 layers (n_embd 128, 4 heads)."),
    ckpt_ratio: float = typer.Option(
        0.5, min=0.0, max=1.0,
        help="Fraction of the layers whose activations are checkpointed (0: none)."),
    lr: float = typer.Option(2e-3, min=0.0, help="Peak AdamW learning rate."),
    seed: int = typer.Option(0, help="Seed for the weights, the data windows and dropout."),
    threads: int = typer.Option(
        0, min=0, help="torch threads; 0: one per core that is not busy with other processes."),
) -> None:
    """Train a small GPT-2 on Python's standard-library source bytes under a schedule."""
    console = Console()
    num_threads, why = (threads, "--threads") if threads else _default_threads()
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)

    model = zoo.make_model("gpt2", "small", seed=seed, n_layer=layers,
                           n_positions=max(256, seq_len))
    num_params = sum(p.numel() for p in model.parameters())
    sch = create_schedule(model)
    apply_demo_schedule(sch, "gpt2", ckpt_ratio)
    model, optimizer = build(sch, optimizer=lambda params: torch.optim.AdamW(params, lr=lr))

    corpus_bytes = data.load_corpus().numel()
    console.print(
        f"[bold]torchloom demo[/]: GPT-2 with {_plural(layers, 'layer')}, n_embd 128, "
        f"{num_params / 1e6:.2f}M parameters; {corpus_bytes / 1e6:.1f} MB of Python "
        f"standard-library source as bytes (vocabulary 256); batch {batch_size} x "
        f"{seq_len} tokens; {_plural(num_threads, 'thread')} ({why})"
    )
    console.print(Panel(Syntax(str(sch.recipe), "python", theme="ansi_dark"),
                        title="schedule (sch.recipe)", expand=False))

    batches = data.batches(batch_size, seq_len, seed=seed)
    tokens_per_step = batch_size * seq_len
    report_every = max(1, steps // 10)
    losses: list[float] = []
    window_start, window_tokens = time.perf_counter(), 0
    model.train()

    progress = Progress(
        TextColumn("[bold blue]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [bold]{task.fields[loss]}"),
        TextColumn("{task.fields[speed]} tokens/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    started = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=steps, loss="-", speed="-")
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, steps, lr)
            input_ids, labels = next(batches)
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            losses.append(loss.item())
            window_tokens += tokens_per_step
            now = time.perf_counter()
            speed = (step + 1) * tokens_per_step / (now - started)
            progress.update(task, advance=1, loss=f"{losses[-1]:.3f}", speed=f"{speed:,.0f}")
            if (step + 1) % report_every == 0 or step == 0 or step + 1 == steps:
                recent = losses[-report_every:] if step else losses
                progress.console.print(
                    f"step {step + 1:>5}/{steps}  loss {sum(recent) / len(recent):.3f}  "
                    f"{window_tokens / (now - window_start):,.0f} tokens/s"
                )
                window_start, window_tokens = now, 0
    elapsed = time.perf_counter() - started

    last = losses[-report_every:]
    summary = Table(title="demo summary", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_row("steps", f"{steps}")
    summary.add_row("tokens", f"{steps * tokens_per_step:,}")
    summary.add_row("time", f"{elapsed:.2f} s")
    summary.add_row("loss, step 1", f"{losses[0]:.3f}")
    summary.add_row(f"loss, last {_plural(len(last), 'step')} (mean)",
                    f"{sum(last) / len(last):.3f}")
    summary.add_row("throughput", f"{steps * tokens_per_step / elapsed:,.0f} tokens/s")
    # checkpoint(ratio=r) on a list of n layers checkpoints the first floor(r * n)
    summary.add_row("checkpointed layers", f"{math.floor(ckpt_ratio * layers)} of {layers}")
    console.print(summary)


@app.command()
@_clean_errors
def show(
    model: str = typer.Argument(..., help=f"A zoo model: {', '.join(zoo.list_models())}."),
    size: str = typer.Option("tiny", help=f"Model size: {', '.join(zoo.SIZES)}."),
    ckpt_ratio: float = typer.Option(
        None, min=0.0, max=1.0,
        help="Apply the demo schedule: checkpoint this fraction of the layers."),
) -> None:
    """Print the schedule tree of a zoo model and the primitives applied to it."""
    console = Console()
    sch = create_schedule(zoo.make_model(model, size, seed=0))
    if ckpt_ratio is not None:
        apply_demo_schedule(sch, model, ckpt_ratio)
    console.print(rich_tree(sch))
    if len(sch.recipe):
        console.print(Panel(Syntax(str(sch.recipe), "python", theme="ansi_dark"),
                            title="schedule (sch.recipe)", expand=False))


@app.command("list-primitives")
@_clean_errors
def list_primitives_command() -> None:
    """List the primitives a schedule offers."""
    table = Table(title="torchloom primitives")
    table.add_column("primitive", style="bold cyan")
    table.add_column(escape("call on sch[path]"), overflow="fold")
    table.add_column("what it does")
    for name in list_primitives():
        method = getattr(Schedule, name, None)
        if method is None:
            table.add_row(name, "", "")
            continue
        params = list(inspect.signature(method).parameters.values())[1:]  # drop self
        call = f".{name}({', '.join(_param_text(p) for p in params)})"
        doc = (inspect.getdoc(method) or "").split("\n\n")[0].replace("\n", " ")
        doc = doc.split("; see ")[0].rstrip(".") + "."
        table.add_row(name, escape(call), escape(doc))
    Console().print(table)


def train_rank_cli(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``torchloom train``; rank 0 prints a line per step (the loss in full
    precision, so runs can be compared bit for bit)."""
    from .train import train_rank

    def report(step: int, loss: float, speed: float) -> None:
        if rank == 0:
            print(f"step {step:>5}  loss {loss!r}  {speed:,.0f} tokens/s", flush=True)

    return train_rank(rank, config, on_step=report)


@app.command()
@_clean_errors
def train(
    model: str = typer.Option("gpt2", help=f"A zoo model: {', '.join(zoo.list_models())}."),
    size: str = typer.Option("tiny", help=f"Model size: {', '.join(zoo.SIZES)}."),
    steps: int = typer.Option(20, min=1, help="Total training steps."),
    batch_size: int = typer.Option(8, min=1, help="Sequences per step, over all dp ranks."),
    seq_len: int = typer.Option(64, min=2, help="Tokens (bytes) per sequence."),
    lr: float = typer.Option(1e-3, min=0.0, help="Peak AdamW learning rate."),
    seed: int = typer.Option(0, help="Seed of the weights, the data and dropout."),
    tp: int = typer.Option(1, min=1, help="Tensor-parallel degree."),
    dp: int = typer.Option(1, min=1, help="Data-parallel degree (DDP)."),
    pp: int = typer.Option(1, min=1, help="Pipeline stages (1F1B, 4 micro-batches)."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (with --tp > 1)."),
    ckpt_ratio: float = typer.Option(0.0, min=0.0, max=1.0,
                                     help="Checkpoint this fraction of the layers."),
    save_dir: str = typer.Option(None, help="Save directory: an empty or new directory, or "
                                 "one torchloom made (torchloom.save keeps the 2 newest "
                                 "checkpoints in it)."),
    save_every: int = typer.Option(0, min=0, help="Save every N steps (0: at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete "
                                "checkpoint of --save-dir (its run configuration must match)."),
    allow_config_change: bool = typer.Option(
        False, "--allow-config-change",
        help="With --resume: continue although the checkpoint's run configuration differs."),
    stop_after: int = typer.Option(None, min=1, help="Stop (and save) after this step; the "
                                   "learning-rate schedule stays that of --steps."),
    threads: int = typer.Option(0, min=0, help="torch threads per rank; 0: cores / ranks."),
    timeout: float = typer.Option(120.0, min=1.0, help="Seconds a collective waits for the "
                                  "other ranks; a rank that hangs, raises or dies ends the "
                                  "run soon after."),
) -> None:
    """Train a zoo model under its built-in schedule; resumable bit for bit."""
    from .launch import init_group, raise_first_failure, run_ranks, under_torchrun
    from .train import TrainConfig, check_config

    cfg = TrainConfig(model=model, size=size, steps=steps, batch_size=batch_size,
                      seq_len=seq_len, lr=lr, seed=seed, tp=tp, dp=dp, pp=pp,
                      sequence_parallel=sp, ckpt_ratio=ckpt_ratio, save_dir=save_dir,
                      save_every=save_every, resume=resume,
                      allow_config_change=allow_config_change, stop_after=stop_after)
    check_config(cfg)  # before any rank starts: model, sequence length, save directory
    config = cfg.to_dict()
    world = tp * dp * pp
    if threads:
        torch.set_num_threads(threads)
    elif world == 1 or under_torchrun():
        torch.set_num_threads(max(1, _available_cores() // max(1, world)))
    if under_torchrun():
        init_group(timeout)
        results = [train_rank_cli(torch.distributed.get_rank(), config)]
    else:
        results = run_ranks(train_rank_cli, world, config, timeout_s=timeout)
    # the failing rank's own error first (a ScheduleError's message in full); exit 2
    raise_first_failure(results, command="torchloom train")
    result = results[0]
    if under_torchrun() and torch.distributed.get_rank() != 0:
        return
    if "resumed_step" in result:
        done = result["resumed_step"]
        if result["complete"]:
            print(f"the run in {save_dir} is already complete: its newest checkpoint is of "
                  f"step {done} of --steps {steps}; nothing to train (to train further, "
                  "raise --steps and add --allow-config-change)", flush=True)
        else:
            print(f"the run in {save_dir} is already at step {done}, past --stop-after "
                  f"{stop_after}; nothing to train", flush=True)
        return
    if result["losses"]:
        print(f"trained steps {result['first_step']}..{result['first_step'] + len(result['losses']) - 1}: loss {result['losses'][0]:.4f} -> "
              f"{result['losses'][-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s", flush=True)


@app.command()
@_clean_errors
def tune(
    model: str = typer.Argument(..., help="A zoo model that takes tokens: " + ", ".join(
        m for m in zoo.list_models() if zoo._ZOO[m].kind != "image") + "."),  # noqa: SLF001
    budget_gb: float = typer.Option(..., min=0.0, help="Memory per rank in GiB (0.05 = 51 MiB)."),
    strategy: str = typer.Option("binary", help="binary, exhaustive or optuna."),
    db: str = typer.Option("torchloom-tune.db", help="SQLite results file (resumes)."),
    plot: str = typer.Option("torchloom-tune.png", help="PNG of the explored space ('' for none)."),
    size: str = typer.Option("tiny", help=f"Model size: {', '.join(zoo.SIZES)}."),
    batch_sizes: str = typer.Option("1,2,4,8,16,32,64", help="Candidate batch sizes."),
    seq_len: int = typer.Option(64, min=2, help="Tokens per sample."),
    trials: int = typer.Option(10, min=1, help="Trials for the optuna strategy."),
    steps: int = typer.Option(2, min=1, help="Timed training steps per candidate."),
    seed: int = typer.Option(0, help="Seed of the weights and data."),
    threads: int = typer.Option(0, min=0, help="torch threads; 0: all cores."),
) -> None:
    """Tune a zoo model's batch size and checkpoint ratio under a memory budget."""
    from .tune.cli import tune_command

    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ScheduleError("batch sizes must be integers separated by commas",
                            primitive="torchloom tune", values={"batch_sizes": batch_sizes},
                            fix="--batch-sizes 4,8,16") from None
    # tune_command checks the values (positive sizes, a text model, writable outputs)
    # before any trial, prints the error and returns 2.
    code = tune_command(model, budget_gb, strategy, db, plot or None, size=size,
                        batch_sizes=sizes, seq_len=seq_len, trials=trials, steps=steps,
                        seed=seed, threads=threads or None)
    if code:
        raise typer.Exit(code=code)


def verify_rank(rank: int, model_name: str, tp: int, sequence_parallel: bool,
                ckpt_ratio: float, seed: int) -> dict[str, Any]:
    """One rank of ``torchloom verify``: the built-in schedule under Verify."""
    from . import models
    from .verify import VerificationError, Verify

    model = zoo.make_model(model_name, "tiny", seed=seed)
    if tp > 1:
        # Dropout inside a tensor-parallel region draws per-rank masks (fork_rng), which no
        # single-process model can reproduce: verify the arithmetic with dropout off
        # (nn.Dropout modules, and the plain probabilities some attention modules keep).
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for name in ("dropout", "attention_dropout", "dropout_rate"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)
    inputs = zoo.example_inputs(model_name, model, batch_size=2, seq_len=16)
    sch = create_schedule(model)
    verify = Verify(sch, inputs)
    try:
        with verify:
            models.apply_schedule(sch, tp=True, sequence_parallel=sequence_parallel,
                                  ckpt_ratio=ckpt_ratio)
    except VerificationError as err:
        return {"ok": False, "message": str(err), "stats": verify.stats,
                "primitives": len(sch.recipe)}
    return {"ok": True, "message": "", "stats": verify.stats, "primitives": len(sch.recipe)}


@app.command()
@_clean_errors
def verify(
    model: str = typer.Argument(..., help=f"A zoo model: {', '.join(zoo.list_models())}."),
    tp: int = typer.Option(1, min=1, max=4, help="Tensor-parallel ranks (local gloo processes)."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (needs --tp 2 or more)."),
    ckpt_ratio: float = typer.Option(0.0, min=0.0, max=1.0,
                                     help="Checkpoint this fraction of the layers."),
    seed: int = typer.Option(0, help="Seed of the model's weights and the inputs."),
    timeout: float = typer.Option(120.0, min=1.0, help="Seconds a collective waits for the "
                                  "other ranks; a rank that hangs, raises or dies ends the "
                                  "run within this plus 15 s."),
) -> None:
    """Verify a model's built-in schedule against the unscheduled model (forward outputs,
    input gradients and parameter gradients), on TP local ranks."""
    from .launch import raise_first_failure, run_ranks

    console = Console()
    if sp and tp < 2:
        raise ScheduleError("sequence parallelism needs at least two tensor-parallel ranks",
                            primitive="torchloom verify", values={"tp": tp, "sp": sp},
                            fix=f"torchloom verify {model} --tp 2 --sp")
    console.print(f"verifying the built-in schedule of [bold]{model}[/] (tiny) on {tp} "
                  f"rank{'s' if tp > 1 else ''}{' with sequence parallelism' if sp else ''}...")
    results = run_ranks(verify_rank, tp, model, tp, sp, ckpt_ratio, seed, timeout_s=timeout)
    # The failing rank's own error first (not its peers' "connection closed"); exit 2.
    raise_first_failure(results, command="torchloom verify")
    table = Table(title=f"torchloom verify {model} --tp {tp}{' --sp' if sp else ''}")
    table.add_column("rank")
    for phase in ("forward output", "input gradient", "parameter gradient"):
        table.add_column(f"{phase}s compared", justify="right")
    table.add_column("verdict")
    for rank, result in enumerate(results):
        stats = result["stats"]
        table.add_row(str(rank), *(str(stats.get(p, "-")) for p in
                                   ("forward output", "input gradient", "parameter gradient")),
                      "[green]equal[/]" if result["ok"] else "[red]differs[/]")
    console.print(table)
    if not results[0]["ok"]:
        console.print(escape(results[0]["message"]))
        raise typer.Exit(code=1)
    console.print(f"[green]ok[/]: {results[0]['primitives']} primitive calls, the scheduled model "
                  "computes what the original does")


@app.command()
@_clean_errors
def bench(
    models: str = typer.Option("gpt2,bert", help="Zoo models, separated by commas."),
    size: str = typer.Option("bench", help="Model size: bench (about 13M parameters, 256 "
                             "tokens) or tiny (tests)."),
    steps: int = typer.Option(5, min=1, help="Timed rounds (one step per variant each)."),
    budget_mb: float = typer.Option(200.0, min=0.0,
                                    help="Activation-memory budget in MiB (sets the batches)."),
    max_batch: int = typer.Option(16, min=1, help="Largest batch tried."),
    ckpt_ratio: float = typer.Option(None, min=0.0, max=1.0, help="The schedule's checkpoint "
                                     "ratio; default: measured (see --sweep-steps)."),
    device: str = typer.Option("cpu", help="cpu (fp32) or cuda (bf16 autocast)."),
    compile_backend: str = typer.Option("inductor", help="torch.compile backend."),
    threads: int = typer.Option(
        0, min=0, help="torch threads; 0: one per core that is not busy with other processes."),
    seed: int = typer.Option(0, help="Seed of the weights and the data."),
    schedule_compile: bool = typer.Option(
        True, help="The schedule compiles each transformer layer in place."),
    sweep_steps: int = typer.Option(0, min=0, help="Timed steps per checkpoint-ratio "
                                    "candidate (0: do not measure, see the docs)."),
    json_path: str = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: str = typer.Option(None, help="Write a PNG of the results here."),
) -> None:
    """Train each model a few steps as eager, torch.compile and its torchloom schedule,
    with the batch that fits an activation-memory budget; tokens/s, activations, MFU."""
    import json

    from .bench import BenchConfig, plot_results, run_bench

    console = Console()
    num_threads, why = (threads, "--threads") if threads else _default_threads()
    torch.set_num_threads(num_threads)
    names = [m.strip() for m in models.split(",") if m.strip()]
    cfg = BenchConfig(models=names, size=size, steps=steps,
                      budget_bytes=int(budget_mb * 2**20), max_batch=max_batch,
                      ckpt_ratio=ckpt_ratio, device=device, compile_backend=compile_backend,
                      seed=seed, schedule_compile=schedule_compile, sweep_steps=sweep_steps)
    console.print(f"[bold]torchloom bench[/]: {', '.join(names)} ({size}) on {device}, "
                  f"{_plural(num_threads, 'thread')} ({why}); budget {budget_mb:g} MiB; "
                  f"{_plural(steps, 'timed round')}")
    results = run_bench(cfg, log=lambda line: console.print(f"  {escape(line)}"))
    table = Table(title=f"torchloom bench ({size}, {device}, budget {budget_mb:g} MiB, "
                        f"medians of {steps} rounds)")
    for column in ("model", "variant", "batch", "ckpt", "tok/s", "x eager", "act MiB", "MFU",
                   "compile s"):
        table.add_column(column, justify="left" if column in ("model", "variant") else "right")
    for r in results:
        table.add_row(r["model"], r["variant"], f"{r['batch_size']}", f"{r['ckpt_ratio']:g}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_eager']:.2f}x",
                      f"{r['peak_activation_bytes'] / 2**20:,.1f}"
                      + ("" if r["fits_budget"] else " (over)"),
                      f"{r['mfu']:.1%}", f"{r['compile_s']:.1f}" if "compile_s" in r else "-")
    console.print(table)
    if results:
        console.print(f"MFU = FlopCounterMode FLOPs of a step (forward + backward of the "
                      f"unscheduled model) / (median step time x "
                      f"{results[0]['peak_flops_per_s'] / 1e9:,.1f} GFLOP/s, the best fp32/bf16 "
                      f"matmul rate measured in this run)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        console.print(f"wrote {json_path}")
    if plot:
        plot_results(results, plot)
        console.print(f"wrote {plot}")


def _param_text(param: inspect.Parameter) -> str:
    if param.kind is inspect.Parameter.VAR_KEYWORD:
        return f"**{param.name}"
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        return f"*{param.name}"
    return param.name


def main() -> None:
    """Entry point of the ``torchloom`` console script."""
    app()
