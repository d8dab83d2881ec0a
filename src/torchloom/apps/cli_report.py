"""What ``torchloom train`` prints: rank 0's lines per step and evaluation, and a live
progress bar on a terminal."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .cli_common import count_text, plural

__all__ = ["Reporter"]


class Reporter:
    """Rank 0's view of a run: a line per step and per evaluation (the loss in full
    precision, so runs can be compared bit for bit) and, on a terminal, a live progress
    bar with the loss, tokens/s, MFU and memory."""

    def __init__(self, rank: int, show_bar: bool) -> None:
        self.rank = rank
        self.console = Console(soft_wrap=True, highlight=False)
        self.progress: Progress | None = None
        self.task: Any = None
        self.show_bar = show_bar and rank == 0 and self.console.is_terminal

    def __call__(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        kind = record["kind"]
        if kind == "start":
            self.start(record)
        elif kind == "step":
            self.step(record)
        elif kind == "resume":
            changes = record["layout_changes"]
            self.line(f"resumed step {record['step']} from {record['checkpoint']}" + (
                f"; the layout changed ({', '.join(changes)}): the checkpoint was resharded "
                "on load" if changes else ""))
        elif kind == "sample":
            self.line(f"sample step {record['step']:>5}  > {record['prompt']}\n"
                      f"{record['answer']}")
        elif kind == "eval":
            loss = record["eval_loss"]
            ppl = math.exp(loss) if loss < 50 else float("inf")
            self.line(f"eval  step {record['step']:>5}  loss {loss!r}  perplexity {ppl:,.2f}")

    def line(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def start(self, record: dict[str, Any]) -> None:
        self.line(f"training {record['model']}: {record['class']}, "
                  f"{count_text(record['parameters'])} parameters ({record['source']}); "
                  f"{record['data']}; {record['device']}, {record['dtype']}, "
                  f"{plural(record['ranks'], 'rank')}: {record['layout']}; schedule: "
                  f"{record['schedule']}")
        if self.show_bar:
            self.progress = Progress(
                TextColumn("[bold blue]training"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [bold]{task.fields[loss]}"),
                TextColumn("{task.fields[speed]} tok/s"), TextColumn("MFU {task.fields[mfu]}"),
                TextColumn("{task.fields[mem]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console)
            self.progress.start()

    def step(self, r: dict[str, Any]) -> None:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        norm = f"  grad norm {r['grad_norm']:.3g}" if r["grad_norm"] is not None else ""
        self.line(f"step {r['step']:>5}  loss {r['loss']!r}  {r['tokens_per_s']:,.0f} "
                  f"tokens/s  lr {r['lr']:.3g}{norm}  MFU {mfu}  "
                  f"mem {r['memory_mib']:,.0f} MiB")
        if self.progress is not None:
            if self.task is None:
                self.task = self.progress.add_task("train", total=r["steps"],
                                                   completed=r["step"] - 1, loss="-",
                                                   speed="-", mfu="-", mem="-")
            self.progress.update(self.task, completed=r["step"], loss=f"{r['loss']:.4f}",
                                 speed=f"{r['tokens_per_s']:,.0f}", mfu=mfu,
                                 mem=f"{r['memory_mib']:,.0f} MiB")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
