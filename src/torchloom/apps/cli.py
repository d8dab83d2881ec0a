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
* ``torchloom generate FOLDER --prompt TEXT``: what a model folder or a peft LoRA adapter
  folder (its base a local folder) answers, greedy or seeded sampling, offline
  (:mod:`torchloom.apps.generate`);
* ``torchloom list-primitives``: the primitives a schedule offers.

A :class:`~torchloom.core.errors.ScheduleError` is printed as its message, without a
traceback, and the command exits with status 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import typer

from ..core import __version__
from ..core.errors import CliOptionError
from ..schedules import zoo
from .cli_bench import bench
from .cli_common import available_cores
from .cli_demo import apply_demo_schedule, demo
from .cli_errors import clean_errors as _clean_errors
from .cli_generate import generate
from .cli_report import Reporter
from .cli_show import list_primitives_command, show, show_model
from .cli_verify import check_verify, run_verify, verify_model, verify_rank

if TYPE_CHECKING:
    from .jobconfig import TrainConfig

__all__ = ["app", "apply_demo_schedule", "check_verify", "main", "show_model", "verify_model",
           "verify_rank"]

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


# --------------------------------------------------------------------------- train


def train_rank_cli(rank: int, cfg: TrainConfig) -> dict[str, Any]:
    """One rank of ``torchloom train``; rank 0 reports (see :class:`~torchloom.apps.cli_report.Reporter`)."""
    from .train import train_rank

    reporter = Reporter(rank, cfg.progress)
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
                                         "model folder's tokenizer, else as bytes; or "
                                         ".jsonl examples ({\"messages\": [...]} or "
                                         "{\"prompt\", \"response\"}: only the responses "
                                         "in the loss). Default: Python's standard-library "
                                         "source."),
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
    cp: int = typer.Option(_train_default("cp"), help="Context-parallel degree (each "
                           "sequence split between the ranks; --seq-len a multiple of 2 cp)."),
    ep: int = typer.Option(_train_default("ep"), help="Expert-parallel degree (of the --dp "
                           "ranks: each holds 1/ep of every mixture-of-experts layer's "
                           "experts)."),
    dp: int = typer.Option(_train_default("dp"), help="Data-parallel degree."),
    dp_mode: str = typer.Option(_train_default("dp_mode"), help="ddp (replicas), fsdp "
                                "(FSDP2 shards over the dp x cp ranks, also with --dp 1 "
                                "--cp N) or hsdp (--dp-replicate groups of shards)."),
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
    stage_cuts: str = typer.Option(None, help="Layers (0-based) after which a pipeline "
                                   "stage ends, comma-separated: 7,15,23 (default: an even "
                                   "split of pp x stages-per-rank stages)."),
    n_microbatches: int = typer.Option(_train_default("n_microbatches"), help="Pipeline "
                                       "micro-batches per step."),
    sp: bool = typer.Option(False, "--sp/--no-sp", help="Sequence parallelism (with --tp > 1)."),
    ckpt_ratio: float = typer.Option(_train_default("ckpt_ratio"),
                                     help="Checkpoint this fraction of the layers."),
    ac: str = typer.Option(None, help="Checkpoint every layer: full (recompute all) or op "
                           "(op-level selective: matrix products and attention kept)."),
    loss: str = typer.Option(_train_default("loss"), help="The cross-entropy: chunked (rows "
                             "a chunk at a time; logits split over --tp where the head "
                             "allows), parallel (split logits, fp32; needs --tp) or full "
                             "(the model's own)."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile each layer "
                                 "(inductor; inside its checkpoint)."),
    float8: bool = typer.Option(False, "--float8", help="Float8 matmuls in the layers "
                                "(torchao; CUDA, compute capability 8.9+)."),
    async_tp: bool = typer.Option(False, "--async-tp", help="Asynchronous tensor "
                                  "parallelism: planner only for now (refused)."),
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
                                        "folder; with --lora the adapter folder (peft's "
                                        "PeftModel.from_pretrained loads it)."),
    lora: str = typer.Option(None, help="LoRA fine-tuning (peft): adapters on the named "
                             "linear layers, the rest frozen, e.g. "
                             "r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]."),
    lora_base_dtype: str = typer.Option(_train_default("lora_base_dtype"), help="With --lora: "
                                        "the frozen base's dtype, fp32 or bf16 (the adapters "
                                        "train in fp32)."),
    merge: bool = typer.Option(False, "--merge", help="With --lora and --save-pretrained: "
                               "also write the merged model to FOLDER/merged."),
    pack: bool = typer.Option(False, "--pack", help="With .jsonl examples: pack them into "
                              "full sequences (position ids restart, no attention across "
                              "examples)."),
    sample_every: int = typer.Option(_train_default("sample_every"), help="Print the model's "
                                     "answer to --sample-prompt every N steps and at the end "
                                     "(0: never)."),
    sample_prompt: str = typer.Option(_train_default("sample_prompt"), help="The prompt of "
                                      "--sample-every (the tokenizer's chat template applies)."),
    sample_tokens: int = typer.Option(_train_default("sample_tokens"), help="Tokens a sample "
                                      "generates (greedy)."),
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
    text, instruction / chat examples (.jsonl) or Python's source, all weights or LoRA
    adapters; resumable bit for bit."""
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
        torch.set_num_threads(max(1, available_cores() // max(1, world)))
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
        if cfg.lora:
            print(f"wrote the adapter to {cfg.save_pretrained} (peft's "
                  "PeftModel.from_pretrained loads it; torchloom generate answers with it)"
                  + (f" and the merged model to {cfg.save_pretrained}/merged" if cfg.merge
                     else ""), flush=True)
        else:
            print(f"wrote {cfg.save_pretrained} (transformers' from_pretrained loads it)",
                  flush=True)


# --------------------------------------------------------------------------- tune, verify


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
    # verify_rank as this module holds it (tests stand another one in)
    run_verify(model, tp, sp, ckpt_ratio, seed, timeout, rank_fn=verify_rank)


def _register_plan() -> None:
    from .plan_cli import plan_command

    app.command("plan")(_clean_errors(plan_command))


# The commands, in the order ``torchloom --help`` lists them.
app.command()(_clean_errors(demo))
app.command()(_clean_errors(show))
app.command("list-primitives")(_clean_errors(list_primitives_command))
app.command()(_clean_errors(train))
app.command()(_clean_errors(tune))
app.command()(_clean_errors(verify))
app.command()(_clean_errors(bench))
app.command()(_clean_errors(generate))
_register_plan()


def main() -> None:
    """Entry point of the ``torchloom`` console script."""
    app()
