"""The ``torchloom`` command line (also ``python -m torchloom``).

Commands:

* ``torchloom demo``: train a small GPT-2 on the bytes of Python's own standard library
  under a schedule (activation checkpointing on a ratio of the layers), with a progress
  bar, the loss as it falls, and the throughput in tokens/s;
* ``torchloom show MODEL``: state a model's size and print its schedule tree (a zoo model
  at ``--size``, a model folder or a config file), optionally with the demo schedule;
* ``torchloom train``: train a zoo model, a model folder, a config file or your own model
  (``path/to/file.py:factory``, named on the command line only) under its
  built-in schedule on local text, on one process or a (pp, dp, tp) mesh (``torchrun`` or
  local ranks), with evaluation, metrics, checkpoints that resume exactly and a
  ``--save-pretrained`` export; options by flags or a TOML file (:mod:`torchloom.apps.jobconfig`);
* ``torchloom tune MODEL --budget-gb N``: search batch size and checkpoint ratio under a
  memory budget (pruning with the cost model), with a live table, the best recipe and a plot;
* ``torchloom verify MODEL --tp N``: apply the model's schedule inside
  :class:`~torchloom.Verify` on N local ranks and report what was compared; MODEL (a zoo
  name, a folder, a config file or ``path/to/file.py:factory``) is checked before any rank
  starts;
* ``torchloom list-primitives``: the primitives a schedule offers.

A :class:`~torchloom.core.errors.ScheduleError` is printed as its message, without a
traceback, and the command exits with status 2.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from typing import TYPE_CHECKING, Any

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

from ..core import __version__
from ..core.errors import CliOptionError, ScheduleError
from ..core.rules import checkpointed_count
from ..core.schedule import Schedule, create_schedule
from ..core.show import rich_tree
from ..primitives import list_primitives
from ..runtime.build import build
from ..runtime.loop import lr_at, train_step
from ..schedules import zoo
from . import data
from .cli_errors import clean_errors as _clean_errors

if TYPE_CHECKING:
    from .jobconfig import TrainConfig

__all__ = ["app", "main", "apply_demo_schedule"]



app = typer.Typer(
    name="torchloom",
    help="torchloom: a schedule language for progressive optimization of model training.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


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
    summary.add_row(f"loss, last {_plural(len(last), 'step')} (mean)",
                    f"{sum(last) / len(last):.3f}")
    summary.add_row("throughput", f"{steps * tokens_per_step / elapsed:,.0f} tokens/s")
    # checkpoint(ratio=r) on a list of n layers checkpoints the first floor(r * n)
    summary.add_row("checkpointed layers", f"{checkpointed_count(ckpt_ratio, layers)} of {layers}")
    console.print(summary)


def _shape_text(config: Any) -> str:
    """``2 layers, hidden 32, vocabulary 256`` from a transformers config."""
    parts = []
    for key, word in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
                      ("vocab_size", "vocabulary")):
        value = getattr(config, key, None)
        if isinstance(value, int):
            parts.append(f"{value} {word}" if key == "num_hidden_layers" else f"{word} {value}")
    return ", ".join(parts)


def show_model(model: str, size: str) -> tuple[torch.nn.Module, str, list[str]]:
    """The model ``torchloom show`` draws (a folder or config on ``meta``), a sentence
    stating what it is and how large, and its layer lists."""
    from ..runtime.materialise import init_empty_weights
    from .jobconfig import model_kind
    from .train import TrainConfig, count_parameters, layer_lists, meta_model

    kind = model_kind(model)
    if kind == "code":
        from ..tools import usercode

        built = usercode.load(model, meta=True, error=CliOptionError, primitive="torchloom show",
                              flag="MODEL")
        inner = usercode.inner_module(built)
        text = (f"{model}: {type(inner).__name__}, {_count(count_parameters(built))} parameters"
                " (on meta: shapes only)" + (", wrapped in TokenLM (adds the next-token loss)"
                                            if inner is not built else ""))
        return built, text, layer_lists(built)
    if kind in ("folder", "config"):
        cfg = TrainConfig(model=model, seq_len=2)
        built = meta_model(cfg)
        where = "config.json" if kind == "folder" else "config file"
        text = (f"{model}: {type(built).__name__} from its {where} ({_shape_text(built.config)}), "
                f"{_count(count_parameters(built))} parameters (on meta: shapes only)")
        return built, text, layer_lists(built)
    if model not in zoo.list_models() and os.path.isdir(model):
        raise CliOptionError("the folder has no config.json (a transformers model folder, as "
                            "save_pretrained writes it, has one)", primitive="torchloom show",
                            values={"model": model}, fix="torchloom show path/to/model-folder")
    with init_empty_weights():
        zoo.make_model(model, size, seed=0)  # unknown names and sizes raise here
    built = zoo.make_model(model, size, seed=0)
    others = [s for s in zoo.SIZES if s != size]
    text = (f"{model}, zoo size {size!r} ({_shape_text(built.config)}): "
            f"{_count(count_parameters(built))} parameters, randomly initialised"
            + (f"; other sizes: {', '.join(others)} (--size)" if others else ""))
    return built, text, zoo.layer_paths(model)


@app.command()
@_clean_errors
def show(
    model: str = typer.Argument(..., help=f"A zoo model ({', '.join(zoo.list_models())}), a "
                                "transformers model folder, a config.json, or your own model: "
                                "path/to/file.py:factory."),
    size: str = typer.Option("tiny", help=f"Zoo model size: {', '.join(zoo.SIZES)}."),
    ckpt_ratio: float = typer.Option(
        None, min=0.0, max=1.0,
        help="Apply the demo schedule: checkpoint this fraction of the layers."),
) -> None:
    """Print the schedule tree of a model (its size first) and the primitives applied."""
    console = Console()
    built, text, layers = show_model(model, size)
    console.print(escape(text), highlight=False)
    sch = create_schedule(built)
    if ckpt_ratio is not None:
        for path in layers:
            sch[path].checkpoint(ratio=ckpt_ratio)
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


class _Reporter:
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
                  f"{_count(record['parameters'])} parameters ({record['source']}); "
                  f"{record['data']}; {record['device']}, {record['dtype']}, "
                  f"{_plural(record['ranks'], 'rank')}: {record['layout']}; schedule: "
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


def _count(n: int) -> str:
    """``37,824 (37.8 K)``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n:,} ({n / scale:.3g} {unit})"
    return f"{n:,}"


def train_rank_cli(rank: int, cfg: TrainConfig) -> dict[str, Any]:
    """One rank of ``torchloom train``; rank 0 reports (see :class:`_Reporter`)."""
    from .train import train_rank

    reporter = _Reporter(rank, cfg.progress)
    try:
        return train_rank(rank, cfg, report=reporter)
    finally:
        reporter.close()


def _start_group(device: str, timeout: float) -> None:
    """The process group of a torchrun launch: NCCL for --device cuda, gloo for cpu."""
    from ..runtime.process_group import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed(timeout_s=timeout, device=device)


def _end_group() -> None:
    """Every rank of a torchrun launch finished: wait for the others, then close the group,
    so that no rank exits while a peer still holds a connection to it (a gloo process
    whose peers left first could abort at exit: "terminate called without an active
    exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _train_default(name: str) -> Any:
    from .jobconfig import TrainConfig

    return TrainConfig.__dataclass_fields__[name].default


@app.command()
@_clean_errors
def train(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", help="A TOML file of options (keys named "
                               "as the flags, e.g. batch-size = 8); flags given here win."),
    model: str = typer.Option(_train_default("model"), help="A zoo model ("
                              f"{', '.join(zoo.list_models())}), a transformers model folder "
                              "(config.json + weights, e.g. save_pretrained output), a "
                              "config.json (random init), or your own model: "
                              "path/to/file.py:factory (a function returning an nn.Module "
                              "mapping token ids to logits, or a transformers model; not "
                              "from a --config file)."),
    size: str = typer.Option(_train_default("size"), help=f"Zoo model size: "
                             f"{', '.join(zoo.SIZES)}."),
    data_paths: list[str] = typer.Option(None, "--data", help="A text file or folder (every "
                                         "file below it); repeat for more. Tokenised by the "
                                         "model folder's tokenizer, else as bytes. Default: "
                                         "Python's standard-library source."),
    eval_fraction: float = typer.Option(_train_default("eval_fraction"), help="With "
                                        "--eval-every: the share of the tokens (the tail) held "
                                        "out for evaluation."),
    eval_every: int = typer.Option(_train_default("eval_every"), help="Evaluate the held-out "
                                   "loss every N steps and at the last step (0: never)."),
    eval_batches: int = typer.Option(_train_default("eval_batches"), help="Held-out batches "
                                     "per evaluation (fewer if they do not fit)."),
    steps: int = typer.Option(_train_default("steps"), help="Total training steps."),
    batch_size: int = typer.Option(_train_default("batch_size"), help="Sequences per step, "
                                   "over all dp ranks and accumulation micro-steps."),
    grad_accum: int = typer.Option(_train_default("grad_accum"), help="Gradient accumulation "
                                   "micro-steps per optimizer step."),
    seq_len: int = typer.Option(_train_default("seq_len"), help="Tokens per sequence."),
    lr: float = typer.Option(_train_default("lr"), help="Peak AdamW learning rate."),
    warmup_steps: int = typer.Option(None, help="Linear warm-up steps (default: 10% of "
                                     "--steps)."),
    lr_decay: str = typer.Option(_train_default("lr_decay"), help="After warm-up: cosine, "
                                 "linear or constant."),
    min_lr_ratio: float = typer.Option(_train_default("min_lr_ratio"), help="The decay ends "
                                       "at this fraction of --lr."),
    weight_decay: float = typer.Option(_train_default("weight_decay"), help="AdamW weight "
                                       "decay."),
    clip_grad: float = typer.Option(_train_default("clip_grad"), help="Clip the global "
                                    "gradient norm to this (0: off)."),
    seed: int = typer.Option(_train_default("seed"), help="Seed of the weights, the data and "
                             "dropout."),
    device: str = typer.Option(_train_default("device"), help="cpu (gloo) or cuda (NCCL, one "
                               "GPU per local rank)."),
    dtype: str = typer.Option(_train_default("dtype"), help="fp32, or bf16 (autocast; FSDP2 "
                              "mixed precision with --dp-mode fsdp)."),
    tp: int = typer.Option(_train_default("tp"), help="Tensor-parallel degree."),
    dp: int = typer.Option(_train_default("dp"), help="Data-parallel degree."),
    dp_mode: str = typer.Option(_train_default("dp_mode"), help="ddp (replicas), fsdp "
                                "(FSDP2 shards) or hsdp (--dp-replicate groups of shards)."),
    dp_replicate: int = typer.Option(_train_default("dp_replicate"), help="With --dp-mode "
                                     "hsdp: replica groups (the --dp ranks are R groups of "
                                     "dp / R FSDP2 shards)."),
    pp: int = typer.Option(_train_default("pp"), help="Pipeline ranks."),
    pipeline_schedule: str = typer.Option(_train_default("pipeline_schedule"),
                                          help="GPipe, 1F1B, Interleaved1F1B, "
                                          "InterleavedZeroBubble or ZBVZeroBubble."),
    stages_per_rank: int = typer.Option(None, help="Pipeline stages per rank (default 2 "
                                        "for the interleaved and zero-bubble schedules, "
                                        "else 1)."),
    n_microbatches: int = typer.Option(_train_default("n_microbatches"), help="Pipeline "
                                       "micro-batches per step."),
    sp: bool = typer.Option(False, "--sp/--no-sp", help="Sequence parallelism (with --tp > 1)."),
    ckpt_ratio: float = typer.Option(_train_default("ckpt_ratio"),
                                     help="Checkpoint this fraction of the layers."),
    ac: str = typer.Option(None, help="Checkpoint every layer: full (recompute all) or op "
                           "(op-level selective: matrix products and attention kept)."),
    save_dir: str = typer.Option(None, help="Save directory: an empty or new directory, or "
                                 "one torchloom made (torchloom.save keeps the 2 newest "
                                 "checkpoints in it)."),
    save_every: int = typer.Option(_train_default("save_every"), help="Save every N steps "
                                   "(0: at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete "
                                "checkpoint of --save-dir (its run configuration must match)."),
    allow_config_change: bool = typer.Option(
        False, "--allow-config-change",
        help="With --resume: continue although the checkpoint's run configuration differs."),
    allow_missing: bool = typer.Option(
        False, "--allow-missing",
        help="A model folder whose weight files lack some of the model's tensors: "
        "initialise those at random (by default an error naming them)."),
    stop_after: int = typer.Option(None, help="Stop (and save) after this step; the "
                                   "learning-rate schedule stays that of --steps."),
    save_pretrained: str = typer.Option(None, help="At the end, write the trained model (and "
                                        "the folder's tokenizer) here as a transformers "
                                        "folder."),
    metrics: str = typer.Option(None, help="Append one JSON line per step and per "
                                "evaluation to this file."),
    tensorboard: str = typer.Option(None, help="Also write TensorBoard events here (needs "
                                    "tensorboard installed)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A live progress "
                                  "bar on a terminal."),
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic",
                                       help="torch.use_deterministic_algorithms."),
    threads: int = typer.Option(_train_default("threads"), help="torch threads per rank; 0: "
                                "cores / ranks."),
    timeout: float = typer.Option(_train_default("timeout"), help="Seconds a collective "
                                  "waits for the other ranks; a rank that hangs, raises or "
                                  "dies ends the run soon after."),
) -> None:
    """Train a zoo model, a model folder or a config under its built-in schedule, on local
    text or Python's source; resumable bit for bit."""
    from ..runtime import launch
    from .jobconfig import options
    from .train import check_config, check_launch

    values = dict(ctx.params)
    values.pop("config")
    values["data"] = values.pop("data_paths") or ()
    values["sequence_parallel"] = values.pop("sp")
    source = {"data": "data_paths", "sequence_parallel": "sp"}
    # typer vendors its own click: compare the parameter source by name
    given = {k: v for k, v in values.items()
             if getattr(ctx.get_parameter_source(source.get(k, k)), "name", "") in
             ("COMMANDLINE", "ENVIRONMENT")}
    cfg = options(config, given)  # checks every value before anything else
    check_config(cfg)  # model, data, device, outputs, save directory
    check_launch(cfg, launch.under_torchrun())
    world = cfg.world
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    elif world == 1 or launch.under_torchrun():
        torch.set_num_threads(max(1, _available_cores() // max(1, world)))
    rank = 0
    if launch.under_torchrun():
        _start_group(cfg.device, cfg.timeout)
        rank = torch.distributed.get_rank()
        results = [train_rank_cli(rank, cfg)]
        _end_group()
    else:
        results = launch.run_ranks(train_rank_cli, world, cfg, timeout_s=cfg.timeout)
    # the failing rank's own error first (a ScheduleError's message in full); exit 2
    launch.raise_first_failure(results, command="torchloom train")
    result = results[0]
    if rank != 0:
        return
    if "resumed_step" in result:
        done = result["resumed_step"]
        if result["complete"]:
            print(f"the run in {cfg.save_dir} is already complete: its newest checkpoint is "
                  f"of step {done} of --steps {cfg.steps}; nothing to train (to train "
                  "further, raise --steps and add --allow-config-change)", flush=True)
        else:
            print(f"the run in {cfg.save_dir} is already at step {done}, past --stop-after "
                  f"{cfg.stop_after}; nothing to train", flush=True)
        return
    first, losses = result["first_step"], result["losses"]
    if losses:
        print(f"trained steps {first}..{first + len(losses) - 1}: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    for step, loss in sorted(result.get("eval_losses", {}).items(), key=lambda kv: int(kv[0])):
        if int(step) == first + len(losses) - 1:
            print(f"held-out loss at step {step}: {loss:.4f}", flush=True)
    if cfg.save_pretrained and losses and first + len(losses) - 1 == cfg.steps:
        print(f"wrote {cfg.save_pretrained} (transformers' from_pretrained loads it)",
              flush=True)


@app.command()
@_clean_errors
def tune(
    model: str = typer.Argument(..., help="A zoo model that takes tokens: " + ", ".join(
        zoo.list_models(text=True)) + "."),
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
    from .tune_cli import tune_command

    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise CliOptionError("batch sizes must be integers separated by commas",
                            primitive="torchloom tune", values={"batch_sizes": batch_sizes},
                            fix="--batch-sizes 4,8,16") from None
    # tune_command checks the values (positive sizes, a text model, writable outputs)
    # before any trial, prints the error and returns 2.
    code = tune_command(model, budget_gb, strategy, db, plot or None, size=size,
                        batch_sizes=sizes, seq_len=seq_len, trials=trials, steps=steps,
                        seed=seed, threads=threads or None)
    if code:
        raise typer.Exit(code=code)


_VERIFY = "torchloom verify"


def _verify_error(exc: ScheduleError) -> CliOptionError:
    """A train-side model error, told as ``torchloom verify``'s (MODEL, not --model)."""
    problem = exc.problem.replace("--model ", "MODEL ", 1)
    return CliOptionError(problem, primitive=_VERIFY, values=exc.values,
                          fix=(exc.fix or "").replace("--model ", "torchloom verify "))


def verify_model(model_name: str, seed: int = 0, *, meta: bool = False) -> torch.nn.Module:
    """The model ``torchloom verify`` schedules: a zoo model (tiny), a folder's or config
    file's transformers model (random initialisation from ``seed``: Verify compares the
    scheduled model with the unscheduled one, whatever the weights), or the model of
    ``FILE.py:factory`` (a plain module in its :class:`~torchloom.tools.usercode.TokenLM`);
    ``meta``: on the meta device (nothing allocated), for the checks up front."""
    from ..runtime.materialise import init_empty_weights
    from ..tools import usercode
    from .jobconfig import TrainConfig, model_kind
    from .train import _from_config, _hf_config

    kind = model_kind(model_name)
    if kind == "code":
        torch.manual_seed(seed)
        return usercode.load(model_name, meta=meta, check=False, error=CliOptionError,
                             primitive=_VERIFY, flag="MODEL")
    if kind in ("folder", "config"):
        cfg = TrainConfig(model=model_name, seq_len=16, seed=seed)
        try:
            config = _hf_config(cfg)
            torch.manual_seed(seed)
            with init_empty_weights() if meta else contextlib.nullcontext():
                return _from_config(cfg, config)
        except ScheduleError as exc:
            raise _verify_error(exc) from None
    if meta:
        with init_empty_weights():
            return zoo.make_model(model_name, "tiny", seed=seed)
    return zoo.make_model(model_name, "tiny", seed=seed)


def _verify_inputs(model_name: str, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    if model_name in zoo.list_models():
        return zoo.example_inputs(model_name, model, batch_size=2, seq_len=16, seed=seed)
    from ..core.outputs import no_cache_kwargs

    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), **no_cache_kwargs(model)}


def _verify_knobs(model: torch.nn.Module, tp: int, sp: bool,
                  ckpt_ratio: float) -> dict[str, Any]:
    """The knobs of the model's schedule: tp and sp only for one that takes them."""
    from .train import _has_builtin_schedule

    knobs: dict[str, Any] = {"ckpt_ratio": ckpt_ratio}
    if _has_builtin_schedule(model, "tp"):
        knobs.update(tp=True, sequence_parallel=sp)
    return knobs


def check_verify(model_name: str, tp: int, sp: bool) -> tuple[torch.nn.Module, str]:
    """What ``torchloom verify`` checks before any rank starts: MODEL is a zoo name, a model
    folder, a config file or ``FILE.py:factory`` whose contract holds; its model has a
    schedule, one taking tensor parallelism if ``tp > 1``; it fits this machine's memory
    on ``tp`` ranks. Returns the model on ``meta`` and where its schedule comes from."""
    from ..runtime.model_check import check_fits, format_bytes
    from ..tools import usercode
    from .jobconfig import model_kind
    from .train import _has_builtin_schedule, count_parameters, schedule_source

    if sp and tp < 2:
        raise CliOptionError("sequence parallelism needs at least two tensor-parallel ranks",
                             primitive=_VERIFY, values={"tp": tp, "sp": sp},
                             fix=f"torchloom verify {model_name} --tp 2 --sp")
    kind = model_kind(model_name)
    if kind is None:
        if usercode.looks_like_code(model_name):
            usercode.CodeSpec.parse(model_name, error=CliOptionError, primitive=_VERIFY,
                                    flag="MODEL")
        if os.path.isdir(model_name):
            raise CliOptionError(
                "the folder has no config.json (a transformers model folder, as "
                "save_pretrained writes it, has one)", primitive=_VERIFY,
                values={"model": model_name, "contents": sorted(os.listdir(model_name))[:8]},
                fix="torchloom verify path/to/model-folder")
        import difflib

        near = difflib.get_close_matches(model_name, zoo.list_models(), n=1)
        raise CliOptionError(
            f"MODEL {model_name!r}: not a zoo model, a model folder (with config.json), a "
            "config .json file or FILE.py:factory", primitive=_VERIFY,
            values={"model": model_name, "zoo": zoo.list_models()},
            fix=f"torchloom verify {near[0] if near else 'gpt2'}, torchloom verify "
            "path/to/folder, or torchloom verify path/to/model.py:make_model")
    model = verify_model(model_name, meta=True)
    if kind == "code":
        usercode.check_contract(model, model_name, 16, error=CliOptionError,
                                primitive=_VERIFY, flag="MODEL")
    inner = usercode.inner_module(model)
    if not _has_builtin_schedule(model):
        raise CliOptionError(
            f"{type(inner).__name__} has no schedule to verify: no built-in schedule, no "
            "transformers tensor-parallel plan and no stack of layers (a ModuleList or "
            "Sequential of two or more modules of one class)", primitive=_VERIFY,
            values={"model": model_name, "class": type(inner).__name__},
            fix="write its schedule with primitives and verify it in Python: with "
            "torchloom.Verify(sch, inputs): ... (README, 'Verify')")
    if tp > 1 and not _has_builtin_schedule(model, "tp"):
        raise CliOptionError(
            f"--tp {tp}: {type(inner).__name__} has only a schedule without tensor "
            f"parallelism, {schedule_source(model)}: no built-in schedule, and transformers "
            "declares no tensor-parallel plan for it", primitive=_VERIFY,
            values={"model": model_name, "class": type(inner).__name__, "tp": tp},
            fix=f"verify its automatic schedule on one rank: torchloom verify {model_name} "
            "--ckpt-ratio 0.5; or register a schedule taking tp: "
            "torchloom.schedules.register_schedule(name, fn)")
    if kind != "zoo":
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in
                                                            model.parameters()}.values())
        # per rank: the reference and the scheduled copy, with their gradients
        need = 4 * total * tp
        check_fits(need, "cpu", primitive=_VERIFY,
                   what=f"verifying {model_name} ({format_bytes(total)} of parameters; two "
                   f"copies with gradients on each of {tp} rank{'s' if tp > 1 else ''})",
                   values={"model": model_name, "parameters": count_parameters(model),
                           "tp": tp},
                   fix="verify a smaller config of the same class (fewer layers, a smaller "
                   "hidden size): the schedule is the same")
    return model, schedule_source(model)


def verify_rank(rank: int, model_name: str, tp: int, sequence_parallel: bool,
                ckpt_ratio: float, seed: int) -> dict[str, Any]:
    """One rank of ``torchloom verify``: the model's schedule under Verify."""
    from .. import schedules
    from ..tools import usercode
    from ..tools.verify import VerificationError, Verify

    model = verify_model(model_name, seed)
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
    inputs = _verify_inputs(model_name, model, seed)
    knobs = _verify_knobs(model, tp, sequence_parallel, ckpt_ratio)
    sch = create_schedule(model)
    verify = Verify(sch, inputs)
    try:
        with verify:
            schedules.apply_schedule(usercode.schedule_root(sch), **knobs)
    except VerificationError as err:
        return {"ok": False, "message": str(err), "stats": verify.stats,
                "primitives": len(sch.recipe)}
    return {"ok": True, "message": "", "stats": verify.stats, "primitives": len(sch.recipe)}


@app.command()
@_clean_errors
def verify(
    model: str = typer.Argument(..., help=f"A zoo model ({', '.join(zoo.list_models())}), a "
                                "transformers model folder or config.json (random init), or "
                                "your own model: path/to/file.py:factory."),
    tp: int = typer.Option(1, min=1, max=4, help="Tensor-parallel ranks (local gloo processes)."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (needs --tp 2 or more)."),
    ckpt_ratio: float = typer.Option(0.0, min=0.0, max=1.0,
                                     help="Checkpoint this fraction of the layers."),
    seed: int = typer.Option(0, help="Seed of the model's weights and the inputs."),
    timeout: float = typer.Option(120.0, min=1.0, help="Seconds a collective waits for the "
                                  "other ranks; a rank that hangs, raises or dies ends the "
                                  "run within this plus 15 s."),
) -> None:
    """Verify a model's schedule (built-in, derived from transformers' plan, or automatic)
    against the unscheduled model (forward outputs, input gradients and parameter
    gradients), on TP local ranks. MODEL is checked before any rank starts."""
    from ..runtime.launch import raise_first_failure, run_ranks

    console = Console()
    _, source = check_verify(model, tp, sp)
    what = f"{model} (tiny)" if model in zoo.list_models() else model
    console.print(f"verifying [bold]{escape(what)}[/] on {tp} rank{'s' if tp > 1 else ''}"
                  f"{' with sequence parallelism' if sp else ''}; schedule: "
                  f"{escape(source)}...")
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


def _register_plan() -> None:
    from .plan_cli import plan_command

    app.command("plan")(_clean_errors(plan_command))


_register_plan()


def main() -> None:
    """Entry point of the ``torchloom`` console script."""
    app()
