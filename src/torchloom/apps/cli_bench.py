"""``torchloom bench``: the command line of :mod:`torchloom.apps.bench` (eager vs
``torch.compile`` vs the model's torchloom schedule, under an activation-memory budget)."""

from __future__ import annotations

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .cli_common import default_threads, plural

__all__ = ["bench"]


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
    sweep_steps: int = typer.Option(3, min=0, help="Interleaved timed rounds that choose the "
                                    "schedule among its candidates (compiled layers with and "
                                    "without checkpointing, nothing compiled, the whole model "
                                    "compiled); 0: do not measure, see the docs."),
    json_path: str = typer.Option(None, "--json", help="Write the results as JSON here."),
    plot: str = typer.Option(None, help="Write a PNG of the results here."),
) -> None:
    """Train each model a few steps as eager, torch.compile and its torchloom schedule,
    with the batch that fits an activation-memory budget; tokens/s, activations, MFU."""
    import json

    from .bench import BenchConfig, plot_results, run_bench

    console = Console()
    num_threads, why = (threads, "--threads") if threads else default_threads()
    torch.set_num_threads(num_threads)
    names = [m.strip() for m in models.split(",") if m.strip()]
    cfg = BenchConfig(models=names, size=size, steps=steps,
                      budget_bytes=int(budget_mb * 2**20), max_batch=max_batch,
                      ckpt_ratio=ckpt_ratio, device=device, compile_backend=compile_backend,
                      seed=seed, schedule_compile=schedule_compile, sweep_steps=sweep_steps)
    console.print(f"[bold]torchloom bench[/]: {', '.join(names)} ({size}) on {device}, "
                  f"{plural(num_threads, 'thread')} ({why}); budget {budget_mb:g} MiB; "
                  f"{plural(steps, 'timed round')}")
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
