"""``torchloom demo``: train a small GPT-2 on the bytes of Python's own standard library
under a schedule (activation checkpointing on a ratio of the layers, a layout built by
:func:`torchloom.parallelize`), with a progress bar, the loss as it falls, and the
throughput in tokens/s.
"""

from __future__ import annotations

import time

import torch
import typer
from rich.console import Console
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

from ..core.schedule import Schedule
from ..parallel import Layout, create_schedule, parallelize
from ..runtime.loop import lr_at, train_step
from ..schedules import zoo
from . import data
from .cli_common import default_threads, plural

__all__ = ["apply_demo_schedule", "demo"]


def apply_demo_schedule(sch: Schedule, model_name: str, ckpt_ratio: float) -> None:
    """The built-in demo schedule: checkpoint the first ``ckpt_ratio`` of the transformer
    layers of each layer stack of a zoo model (``0`` checkpoints none)."""
    for path in zoo.layer_paths(model_name):
        sch[path].checkpoint(ratio=ckpt_ratio)


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
    num_threads, why = (threads, "--threads") if threads else default_threads()
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)

    model = zoo.make_model("gpt2", "small", seed=seed, n_layer=layers,
                           n_positions=max(256, seq_len))
    num_params = sum(p.numel() for p in model.parameters())
    # the layout of one process that checkpoints the first ckpt_ratio of the layers; the
    # demo's schedule is that checkpointing only (no built-in schedule applied)
    sch = create_schedule(model, None)
    done = parallelize(sch, Layout(ckpt_ratio=ckpt_ratio), apply_schedule=False,
                       stacks=zoo.layer_paths("gpt2"))
    model = done.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    corpus_bytes = data.load_corpus().numel()
    console.print(
        f"[bold]torchloom demo[/]: GPT-2 with {plural(layers, 'layer')}, n_embd 128, "
        f"{num_params / 1e6:.2f}M parameters; {corpus_bytes / 1e6:.1f} MB of Python "
        f"standard-library source as bytes (vocabulary 256); batch {batch_size} x "
        f"{seq_len} tokens; {plural(num_threads, 'thread')} ({why})"
    )
    if len(sch.recipe):  # --ckpt-ratio 0: no primitive
        console.print(Panel(Syntax(str(sch.recipe), "python", theme="ansi_dark"),
                            title="schedule (sch.recipe)", expand=False))

    batches = data.batches(batch_size, seq_len, seed=seed)
    tokens_per_step = batch_size * seq_len
    report_every = max(1, steps // 10)
    losses: list[float] = []
    window_start, window_tokens = time.perf_counter(), 0
    model.train()

    def batch_loss() -> torch.Tensor:
        input_ids, labels = next(batches)
        return model(input_ids=input_ids, labels=labels).loss

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
            loss, _ = train_step(batch_loss, optimizer, lr=lr_at(step, steps, lr), clip=1.0)
            losses.append(loss)
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
    summary.add_row(f"loss, last {plural(len(last), 'step')} (mean)",
                    f"{sum(last) / len(last):.3f}")
    summary.add_row("throughput", f"{steps * tokens_per_step / elapsed:,.0f} tokens/s")
    # checkpoint(ratio=r) on a list of n layers checkpoints the first floor(r * n)
    summary.add_row("checkpointed layers", f"{len(done.checkpointed)} of {layers}")
    console.print(summary)
