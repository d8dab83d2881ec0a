"""``torchloom plan MODEL --gpus N --gpu h100-80gb``: memory per GPU and the fastest layout,
before renting the GPUs.

* With the degrees given (``--tp``, ``--pp``, ``--dp``; one may be left out and is
  derived from ``--gpus`` / ``--cp``, the context-parallel degree, 1 by default;
  ``--ep``, the expert-parallel degree of a mixture of experts, folded into the
  data-parallel ranks, with ``--ep-imbalance`` the routing model's busiest-rank load;
  ``--dp-mode ddp|fsdp|hsdp`` with ``--dp-replicate R`` for
  HSDP; ``--pipeline-schedule`` any of GPipe, 1F1B, Interleaved1F1B,
  InterleavedZeroBubble, ZBVZeroBubble with ``--stages-per-rank``; ``--ckpt-ratio`` or
  ``--ac full|op``): a table per pipeline rank of memory by kind (parameters,
  gradients, optimizer state, runtime buffers, activations, peak) and whether it fits,
  and of time by kind (compute, exposed communication, bubble, optimizer), then the
  collectives of a step.
* Without them: every valid layout (:func:`torchloom.plan.search`), the ``--top`` fastest
  that fit with ``--min-headroom`` (default 10%) of the usable memory free printed with
  their schedule and the command that trains them (or why ``torchloom train`` cannot run
  that layout today).

Both print a legend of the layout notation (``tp2+sp dp4(fsdp) mb4 ckpt1 fp32/bf16``:
:data:`torchloom.parallel.layout.NOTATION`) and of the figures, warn about a layout that
leaves under 10% of the usable memory free, and report model FLOPs utilisation (MFU: the
step's FLOPs without recomputation) beside hardware FLOPs utilisation (HFU: the FLOPs
executed, checkpointed layers' recomputation included).

``--json PATH`` writes the predictions, ``--plot PATH`` a PNG (the searched layouts by
peak memory and throughput; with degrees given, memory by kind per stage). ``--measure``
plans for this machine instead of ``--gpu`` (:func:`torchloom.plan.measure_local`).

Register it on the ``torchloom`` command line with::

    from .plan.cli import plan_command
    app.command("plan")(clean_errors(plan_command))

>>> from typer.testing import CliRunner
>>> result = CliRunner().invoke(app, ["gpt2", "--gpus", "2", "--tp", "2", "--seq-len", "32"])
>>> result.exit_code, "train it: torchrun" in result.output
(0, True)
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..core.errors import PlanError
from ..parallel.layout import shards_cp
from ..plan.layout import NOTATION, Layout, data_parallel
from ..plan.predict import HEADROOM, Prediction, predict
from ..plan.profiles import PROFILES, Profile, get_profile, measure_local
from ..plan.search import SearchResult, search
from ..plan.spec import ModelSpec, code_spec, model_spec
from .cli_errors import clean_errors
from .plan_plots import plot_roles, plot_search

__all__ = ["app", "plan_command", "main", "train_command", "schedule_text", "plot_search",
           "plot_roles", "legend", "headroom_warning", "layout_code", "plan_layout"]

GIB = 2**30
_DTYPES = {  # --dtype -> (param dtype, mixed precision)
    "fp32": ("fp32", None), "bf16": ("fp32", "bf16"), "fp16": ("fp32", "fp16"),
    "bf16-params": ("bf16", None),
}


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps them above one."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _secs(t: float) -> str:
    if t == 0:
        return "0"
    if t < 1e-3:
        return f"{t * 1e6:.1f} us"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def train_command(spec: ModelSpec, layout: Layout, device: str = "cuda",
                  gpus_per_node: int = 8) -> tuple[str | None, str | None]:
    """The ``torchloom train`` command of ``layout`` (``torchrun`` for several ranks), or
    None and why ``torchloom train`` refuses the layout today.

    >>> cmd, why = train_command(model_spec("llama"), Layout(tp=2, dp_replicate=2,
    ...                                                      micro_batch=2))
    >>> cmd.split(" -m ")[1]
    'torchloom train --model llama --size tiny --batch-size 4 --seq-len 128 --tp 2 --dp 2 --dp-mode ddp --device cuda'
    """
    from .jobconfig import TrainConfig, TrainOptionError

    if spec.command is None:
        return None, "the model is a Python class: train it with torchloom.build in Python"
    if layout.param_dtype != "fp32":
        return None, f"torchloom train keeps fp32 weights (--dtype fp32 or bf16), not " \
                     f"{layout.param_dtype}"
    if layout.mixed_precision not in (None, "fp32", "bf16"):
        return None, f"torchloom train has no {layout.mixed_precision} autocast"
    if layout.async_tp:
        return None, "torchloom train does not build asynchronous tensor parallelism yet " \
                     "(the planner models it); plan without --async-tp for a command"
    bf16 = layout.mixed_precision == "bf16"
    fields: dict[str, Any] = {"model": spec.command, "batch_size": layout.batch_size,
                              "seq_len": layout.seq_len, "tp": layout.tp, "dp": layout.dp,
                              "cp": layout.cp, "ep": layout.ep,
                              "pp": layout.pp, "dp_mode": layout.dp_mode,
                              "dtype": "bf16" if bf16 else "fp32",
                              "sequence_parallel": layout.sp,
                              "ckpt_ratio": float(layout.ckpt_ratio), "ac": layout.ac,
                              "device": device}
    if layout.dp_mode == "hsdp":
        fields["dp_replicate"] = layout.dp_replicate
    if spec.size is not None:
        fields["size"] = spec.size
    if layout.pp > 1:
        fields.update(n_microbatches=layout.n_microbatches, grad_accum=layout.grad_accum,
                      pipeline_schedule=layout.pipeline_schedule,
                      stages_per_rank=layout.stages_per_rank, stage_cuts=layout.stage_cuts)
    else:
        fields["grad_accum"] = layout.micro_steps
    try:
        TrainConfig(**fields)
    except TrainOptionError as err:
        return None, err.problem
    flags = ["--model", spec.command]
    if spec.size is not None:
        flags += ["--size", spec.size]
    flags += ["--batch-size", str(layout.batch_size), "--seq-len", str(layout.seq_len)]
    for name in ("tp", "cp", "dp", "ep", "pp"):
        if getattr(layout, name) > 1:
            flags += [f"--{name}", str(getattr(layout, name))]
    if layout.dp > 1 or layout.fsdp:
        flags += ["--dp-mode", layout.dp_mode]
    if layout.dp_mode == "hsdp":
        flags += ["--dp-replicate", str(layout.dp_replicate)]
    if layout.pp > 1:
        if layout.pipeline_schedule != "1F1B":
            flags += ["--pipeline-schedule", layout.pipeline_schedule]
        if layout.stages_per_rank is not None:
            flags += ["--stages-per-rank", str(layout.stages_per_rank)]
        if layout.stage_cuts is not None:
            flags += ["--stage-cuts", ",".join(map(str, layout.stage_cuts))]
        flags += ["--n-microbatches", str(layout.n_microbatches)]
        if layout.grad_accum > 1:
            flags += ["--grad-accum", str(layout.grad_accum)]
    elif layout.micro_steps > 1:
        flags += ["--grad-accum", str(layout.micro_steps)]
    if layout.sp:
        flags.append("--sp")
    if layout.ac:
        flags += ["--ac", layout.ac]
    elif layout.ckpt_ratio:
        flags += ["--ckpt-ratio", f"{layout.ckpt_ratio:g}"]
    if bf16:
        flags += ["--dtype", "bf16"]
    if layout.loss != "chunked":
        flags += ["--loss", layout.loss]
    for on, flag in ((layout.compile, "--compile"), (layout.float8, "--float8"),
                     (layout.async_tp, "--async-tp")):
        if on:
            flags.append(flag)
    flags += ["--device", device]
    world = layout.world
    nodes = max(1, -(-world // gpus_per_node))
    per_node = min(world, gpus_per_node)
    launch = f"torchrun --nnodes {nodes} --nproc-per-node {per_node}" if world > 1 else "python"
    return f"{launch} -m torchloom train {shlex.join(flags)}", None


def layout_code(layout: Layout) -> str:
    """The layout as the Python that makes it (the fields that differ from the defaults).

    >>> layout_code(Layout(dp_shard=8, tp=8, pp=8, n_microbatches=8,
    ...                    pipeline_schedule="Interleaved1F1B"))
    "Layout(dp_shard=8, tp=8, pp=8, pipeline_schedule='Interleaved1F1B', n_microbatches=8)"
    """
    import dataclasses

    args = [f"{f.name}={getattr(layout, f.name)!r}" for f in dataclasses.fields(layout)
            if getattr(layout, f.name) != f.default]
    return f"Layout({', '.join(args)})"


def schedule_text(layout: Layout) -> str:
    """How the layout is built, as Python: :func:`torchloom.parallelize` of the model's
    schedule on the layout's mesh (what ``torchloom train`` runs)."""
    lines = [f"layout = tl.{layout_code(layout)}",
             "mesh = tl.parallel.init_mesh(layout)",
             "done = tl.parallelize(tl.parallel.create_schedule(model, mesh), layout, "
             "mesh=mesh" + (", example_inputs=..., loss_fn=..." if layout.pp > 1 else "") + ")"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- output


def _roles_table(p: Prediction) -> Table:
    lay = p.layout
    table = Table(title=f"{p.model} on {lay.world} x {p.profile.name}: {lay.describe()}, "
                        f"batch {lay.batch_size} x {lay.seq_len} tokens; memory per GPU")
    for col in ("stage", "ranks", "layers", "params", "grads", "optim. state", "buffers",
                "activations", "peak", "fits"):
        table.add_column(col, justify="left" if col in ("stage", "fits") else "right")
    for r in p.roles:
        m = r.memory
        fits = "[green]yes[/]" if r.fits else f"[red]no[/] (> {_gib(p.profile.budget)})"
        table.add_row(str(r.stage), str(r.ranks), str(r.layers), _gib(m.parameters),
                      _gib(m.gradients), _gib(m.optimizer), _gib(m.buffers),
                      _gib(m.activations), _gib(m.peak), fits)
    return table


def _time_table(p: Prediction) -> Table:
    table = Table(title="time per step")
    for col in ("stage", "compute", "exposed comm.", "bubble", "optimizer", "step"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in p.roles:
        t = r.time
        table.add_row(str(r.stage), _secs(t.compute), _secs(t.communication), _secs(t.bubble),
                      _secs(t.optimizer), _secs(t.step))
    return table


def _collectives_table(p: Prediction) -> Table:
    table = Table(title="collectives per step, per rank of each stage")
    for col in ("stage", "kind", "group", "count", "bytes", "time"):
        table.add_column(col, justify="right" if col in ("count", "bytes", "time") else "left")
    for r in p.roles:
        for c in r.collectives:
            table.add_row(str(r.stage), c.kind, c.group, str(c.count), _gib(c.bytes),
                          _secs(c.seconds))
    return table


def _summary(p: Prediction) -> str:
    model = p.model_flops_per_step / 1e12
    hardware = p.flops_per_step / 1e12
    flops = (f"{model:,.3g} TFLOP per step" if p.model_flops_per_step == p.flops_per_step
             else f"{model:,.3g} model / {hardware:,.3g} executed TFLOP per step")
    return (f"step {_secs(p.step_time)}, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, "
            f"HFU {p.hfu:.1%}, {flops}, peak {_gib(p.peak)} of "
            f"{_gib(p.profile.budget)} usable ({p.headroom:.1%} headroom)")


def headroom_warning(p: Prediction) -> str | None:
    """The warning for a layout that fits but leaves under :data:`HEADROOM` of the usable
    memory free (None otherwise)."""
    if not p.fits or p.headroom >= HEADROOM:
        return None
    return (f"warning: {p.layout.describe()} leaves {p.headroom:.1%} headroom (peak "
            f"{_gib(p.peak)} of {_gib(p.profile.budget)} usable), under {HEADROOM:.0%}: "
            "allocator fragmentation and communication buffers the plan does not count may "
            "not fit")


def legend() -> str:
    """What the layout notation and the figures of ``torchloom plan`` mean."""
    lines = ["layout notation:"]
    lines += [f"  {token:<14} {meaning}" for token, meaning in NOTATION]
    lines += [
        "figures:",
        "  peak           the most memory one GPU holds in a step; usable = the device's "
        "memory x the profile's usable share",
        "  headroom       1 - peak / usable: the share of the usable memory left free",
        "  MFU            model FLOPs utilisation: FLOPs of the step without recomputation "
        "(6 x params x tokens + attention) / (step time x peak FLOP/s of all GPUs)",
        "  HFU            hardware FLOPs utilisation: the FLOPs executed, checkpointed "
        "layers' recomputation included, / the same; HFU >= MFU",
    ]
    return "\n".join(lines)


def _fits_text(p: Prediction, min_headroom: float) -> str:
    if not p.fits:
        return "[red]no[/]"
    if p.headroom < max(min_headroom, HEADROOM):
        return "[yellow]tight[/]"
    return "[green]yes[/]"


def _search_table(result: SearchResult, top: int, profile: Profile) -> Table:
    need = f" with {result.min_headroom:.0%} headroom" if result.min_headroom > 0 else ""
    table = Table(title=f"the fastest layouts that fit{need} ({len(result.ranked)} "
                        f"predicted, {len(result.rejected)} refused, {result.seconds:.1f} s)")
    for col in ("#", "layout", "peak", "headroom", "fits", "step", "tokens/s", "MFU", "HFU",
                "bubble"):
        table.add_column(col, justify="left" if col in ("layout", "fits") else "right")
    for i, p in enumerate(result.ranked[:top]):
        bubble = max(r.time.bubble for r in p.roles)
        table.add_row(str(i + 1), p.layout.describe(), _gib(p.peak), f"{p.headroom:.1%}",
                      _fits_text(p, result.min_headroom), _secs(p.step_time),
                      f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.hfu:.1%}", _secs(bubble))
    return table


# --------------------------------------------------------------------------- command


def _degrees(gpus: int, tp: int | None, pp: int | None, dp: int | None
             ) -> tuple[int, int, int] | None:
    given = [x for x in (tp, pp, dp) if x is not None]
    if len(given) < 2:
        return None
    known = 1
    for x in given:
        known *= x
    if len(given) == 3:
        if known != gpus:
            raise PlanError(f"tp x pp x dp = {tp} x {pp} x {dp} = {known} is not --gpus {gpus}",
                            primitive="torchloom plan", values={"tp": tp, "pp": pp, "dp": dp,
                                                                "gpus": gpus},
                            fix="give degrees whose product is --gpus, or leave one out")
        return tp, pp, dp  # type: ignore[return-value]
    if gpus % known:
        raise PlanError(f"--gpus {gpus} does not divide by the degrees given ({known})",
                        primitive="torchloom plan", values={"tp": tp, "pp": pp, "dp": dp,
                                                            "gpus": gpus},
                        fix="give degrees that divide --gpus")
    rest = gpus // known
    return (tp or rest, pp or rest, dp or rest)


def plan_layout(spec: ModelSpec, *, tp: int, pp: int, dp: int, dp_mode: str | None,
                dp_replicate: int | None, micro_steps: int, **fields: Any) -> Layout:
    """The layout of the command line's degrees: ``--dp N --dp-mode ddp|fsdp`` (or
    ``hsdp`` with ``--dp-replicate R``) as the two data-parallel fields (with ``--cp``,
    FSDP2 and HSDP shard over the dp x cp ranks: ``shard_cp``), the micro-steps
    as the pipeline's micro-batches (``pp > 1``) or gradient accumulation; the stage cuts
    of an uneven split when the layers do not divide into the stages (the even split
    :func:`~torchloom.core.rules.even_cuts` gives)."""
    if dp_replicate is not None or dp_mode == "hsdp":
        if dp_replicate is None or dp % dp_replicate or dp // dp_replicate < 2:
            raise PlanError(f"HSDP splits the {dp} data-parallel ranks into --dp-replicate "
                            f"replica groups of two or more FSDP2 shards, and "
                            f"--dp-replicate {dp_replicate} does not",
                            primitive="torchloom plan",
                            values={"dp": dp, "dp_replicate": dp_replicate},
                            fix=f"--dp-replicate R with R dividing {dp} and {dp} / R >= 2, "
                            "e.g. --dp-replicate 2" if dp % 2 == 0 and dp >= 4 else
                            "--dp-mode fsdp, or a --dp of four or more")
        data: dict[str, Any] = {"dp_replicate": dp_replicate, "dp_shard": dp // dp_replicate}
    else:
        data = dict(data_parallel(dp, dp_mode or "ddp"))
    if shards_cp(dp_mode, fields.get("cp", 1)):
        data["shard_cp"] = True
    steps: dict[str, Any] = ({"n_microbatches": micro_steps} if pp > 1
                             else {"grad_accum": micro_steps})
    if pp == 1:
        fields["stages_per_rank"] = None  # a schedule's stages are for a pipeline
    layout = Layout(tp=tp, pp=pp, **data, **steps, **fields)
    layers = spec.num_layers
    if layout.stages > 1 and layers % layout.stages and layers >= layout.stages:
        layout = layout.replace(stage_cuts=tuple(layout.cuts(layers)))
    return layout


def plan_command(
    model: str = typer.Argument(..., help="A zoo model (gpt2, llama, opt, bert), a config.json "
                                "or a folder with one (e.g. a Llama-2-70B config), or "
                                "path/to/file.py:factory returning a transformers model."),
    gpus: int = typer.Option(..., min=1, help="Devices to plan for."),
    gpu: str = typer.Option("h100-80gb", help=f"Device profile: {', '.join(PROFILES)}."),
    measure: bool = typer.Option(False, "--measure", help="Measure this machine and plan "
                                 "for it instead of --gpu."),
    size: str = typer.Option("tiny", help="Zoo size (zoo models only)."),
    seq_len: int = typer.Option(1024, min=2, help="Tokens per sequence."),
    batch_size: int = typer.Option(None, min=1, help="Sequences per optimizer step over all "
                                   "ranks (default: one per GPU)."),
    tp: int = typer.Option(None, min=1, help="Tensor-parallel degree."),
    cp: int = typer.Option(1, min=1, help="Context-parallel degree (each sequence split "
                           "between cp ranks; no pipeline): the other degrees share --gpus / "
                           "cp ranks."),
    ep: int = typer.Option(None, min=1, help="Expert-parallel degree (each rank holds "
                           "1/ep of a mixture of experts' experts; folded into the "
                           "data-parallel ranks, no pipeline). Default: searched for a "
                           "mixture of experts, 1 with degrees given."),
    ep_imbalance: float = typer.Option(1.0, "--ep-imbalance", min=1.0, help="Routing "
                                       "imbalance under expert parallelism: the busiest "
                                       "rank's share of the routed tokens over the average "
                                       "(1: balanced)."),
    lora: str = typer.Option(None, help="Plan LoRA fine-tuning (peft adapters, the base "
                             "frozen), e.g. r=16,alpha=32,targets=q_proj,v_proj: the "
                             "optimizer state and gradients of the adapters only."),
    lora_base_dtype: str = typer.Option("fp32", "--lora-base-dtype", help="With --lora: the "
                                        "frozen base's dtype, fp32 or bf16."),
    pp: int = typer.Option(None, min=1, help="Pipeline stages."),
    dp: int = typer.Option(None, min=1, help="Data-parallel degree."),
    dp_mode: str = typer.Option(None, help="ddp, fsdp or hsdp (default: ddp and fsdp "
                                "searched; ddp with degrees given)."),
    dp_replicate: int = typer.Option(None, "--dp-replicate", min=2, help="HSDP: the replica "
                                     "groups of the --dp ranks (each of --dp / R FSDP2 "
                                     "shards); implies --dp-mode hsdp."),
    sp: bool = typer.Option(None, "--sp/--no-sp", help="Sequence parallelism (default: on "
                            "with tensor parallelism)."),
    ckpt_ratio: float = typer.Option(None, min=0.0, max=1.0, help="Checkpointed share of the "
                                     "layers (default: 0, 0.5 and 1 searched; 0 with degrees)."),
    ac: str = typer.Option(None, "--ac", help="Activation checkpointing of every layer: full "
                           "(recompute all) or op (op-level selective: matrix products and "
                           "attention kept); instead of --ckpt-ratio."),
    micro_batch: int = typer.Option(None, min=1, help="Sequences per micro-batch (default: "
                                    "1, 2, 4, 8 searched; the largest that divides the local "
                                    "batch up to 8 with degrees)."),
    pipeline_schedule: str = typer.Option("1F1B", help="GPipe, 1F1B, Interleaved1F1B, "
                                          "InterleavedZeroBubble or ZBVZeroBubble."),
    stages_per_rank: int = typer.Option(None, "--stages-per-rank", min=1, help="Stages per "
                                        "pipeline rank (default 2 for the interleaved and "
                                        "zero-bubble schedules, else 1)."),
    dtype: str = typer.Option(None, help="fp32; bf16 or fp16 (fp32 weights, autocast); "
                              "bf16-params (everything bf16). Default: bf16 where the device "
                              "has it, else fp16 (fp32 on a CPU)."),
    optimizer: str = typer.Option("adamw", help="adamw, adam, sgd-momentum or sgd."),
    loss: str = typer.Option("chunked", "--loss", help="The cross-entropy: chunked "
                             "(torchloom's default: over row chunks, vocabulary-sharded "
                             "under TP), parallel (vocabulary-sharded fp32 logits, "
                             "torchtitan's loss parallel; TP only) or full (the model's own "
                             "loss on full fp32 logits)."),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile each layer (its "
                                  "effect is a documented assumption of the planner)."),
    float8: bool = typer.Option(False, "--float8", help="Float8 linear layers (torchao; a "
                                "documented assumption of the planner)."),
    async_tp: bool = typer.Option(False, "--async-tp", help="Asynchronous tensor "
                                  "parallelism (needs --tp > 1, --sp and --compile)."),
    top: int = typer.Option(5, min=1, help="Layouts printed by a search."),
    measure_top: int = typer.Option(0, "--measure-top", min=0, help="After a search, train "
                                    "the N best predicted layouts that fit for a few steps "
                                    "on local gloo ranks (a zoo model, fp32: use with "
                                    "--measure) and choose by measurement."),
    measure_compile: str = typer.Option(None, "--measure-compile", help="With --measure-top: "
                                        "also measure each layout with its layers compiled "
                                        "by this torch.compile backend (e.g. inductor)."),
    min_headroom: float = typer.Option(HEADROOM, "--min-headroom", min=0.0, max=0.99,
                                       help="The share of the usable memory a layout must "
                                       "leave free at its peak to be ranked among the "
                                       "fastest (0: every layout that fits)."),
    json_path: str = typer.Option(None, "--json", help="Write the predictions as JSON here "
                                  "('-' for standard output)."),
    plot: str = typer.Option(None, help="Write a PNG here."),
) -> None:
    """Predict per-GPU memory and step time of a model's layouts on N devices, and find the
    fastest that fits (all on fake tensors in this process: no GPU needed)."""
    console = Console(stderr=json_path == "-")
    from ..parallel.lora import parse_lora

    lora_spec = parse_lora(lora, base_dtype=lora_base_dtype) if lora else None
    if lora_spec is not None and measure_top:
        raise PlanError("--measure-top measures full fine-tuning only for now",
                        primitive="torchloom plan", values={"lora": lora,
                                                            "measure_top": measure_top},
                        fix="plan with --lora without --measure-top (tests/test_plan_lora.py "
                        "checks LoRA predictions against measured steps)")
    profile = measure_local() if measure else get_profile(gpu)
    if dtype is None:
        dtype = "bf16" if "bf16" in profile.flops and not measure else \
            ("fp16" if "fp16" in profile.flops and not measure else "fp32")
    if dtype not in _DTYPES:
        raise PlanError(f"unknown --dtype {dtype!r}", primitive="torchloom plan",
                        values={"dtype": dtype, "dtypes": list(_DTYPES)}, fix="--dtype bf16")
    param_dtype, mixed = _DTYPES[dtype]
    batch = batch_size or gpus
    from ..tools.usercode import looks_like_code

    if looks_like_code(model):  # the user's own code, named here on the command line
        if measure_top:
            raise PlanError(
                f"--measure-top {measure_top} with {model}: the measurement trains zoo models "
                "on local ranks", primitive="torchloom plan",
                values={"model": model, "measure_top": measure_top},
                fix=f"plan without --measure-top, then measure a layout with torchloom train "
                f"--model {model} and its degrees")
        spec = code_spec(model, seq_len=seq_len)
    else:
        spec = model_spec(model, size=size, seq_len=seq_len)
    common = dict(param_dtype=param_dtype, mixed_precision=mixed, optimizer=optimizer,
                  compile=compile_, float8=float8)
    extra = dict(loss=loss, async_tp=async_tp)
    if gpus % cp:
        raise PlanError(f"--gpus {gpus} does not divide by --cp {cp}", primitive="torchloom plan",
                        values={"gpus": gpus, "cp": cp}, fix="a --cp that divides --gpus")
    degrees = _degrees(gpus // cp, tp, pp, dp)
    extra["cp"] = cp
    extra["ep"] = ep if ep is not None or degrees is None else 1
    device = "cpu" if profile.name.startswith("local-cpu") else "cuda"
    payload: dict[str, Any]
    if degrees is not None:
        t, p_, d = degrees
        if batch % d:
            raise PlanError(f"a batch of {batch} sequences does not split between {d} "
                            "data-parallel ranks", primitive="torchloom plan",
                            values={"batch_size": batch, "dp": d},
                            fix=f"--batch-size {d * max(1, batch // d)}")
        local = batch // d
        fitting = [m for m in (1, 2, 4, 8) if local % m == 0 and local // m >= p_]
        mb = micro_batch or (max(fitting) if fitting else 1)
        if local % mb:
            raise PlanError(f"the local batch of {local} sequences does not split into "
                            f"micro-batches of {mb}", primitive="torchloom plan",
                            values={"local_batch": local, "micro_batch": mb},
                            fix="a --micro-batch dividing the batch per data-parallel rank")
        layout = plan_layout(spec, tp=t, pp=p_, dp=d, dp_mode=dp_mode,
                             dp_replicate=dp_replicate, sp=t > 1 if sp is None else sp,
                             pipeline_schedule=pipeline_schedule,
                             stages_per_rank=stages_per_rank, micro_steps=local // mb,
                             micro_batch=mb, seq_len=seq_len, ckpt_ratio=ckpt_ratio or 0.0,
                             ac=ac, **common, **extra)
        if layout.stage_cuts is not None:
            console.print(f"note: {spec.num_layers} layers do not split evenly into "
                          f"{layout.stages} stages: cut after layers {list(layout.stage_cuts)}"
                          " (Layout(stage_cuts=...), torchloom train --stage-cuts)")
        with console.status("measuring the pieces of a step on fake tensors..."):
            pred = predict(spec, layout, profile, imbalance=ep_imbalance, lora=lora_spec)
        console.print(_roles_table(pred))
        console.print(_time_table(pred))
        console.print(_collectives_table(pred))
        console.print(_summary(pred))
        warning = headroom_warning(pred)
        if warning:
            console.print(f"[yellow]{escape(warning)}[/]")
        for note in pred.notes:
            console.print(f"note: {note}")
        cmd, why = train_command(spec, layout, device, profile.gpus_per_node)
        if lora_spec is not None and cmd:
            cmd += f" --lora {lora_spec.text()}" + (
                f" --lora-base-dtype {lora_spec.base_dtype}"
                if lora_spec.base_dtype != "fp32" else "")
        console.print(f"train it: {cmd}" if cmd else f"torchloom train cannot run it: {why}")
        console.print(legend(), markup=False, highlight=False)
        payload = {"peak_gib": pred.peak / GIB,
                   "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu, **pred.to_dict()}
        if plot:
            plot_roles(pred, plot)
            console.print(f"wrote {plot}")
    else:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        space: dict[str, Any] = dict(common, **extra, tp=tp, pp=pp, dp=dp,
                                     dp_mode=dp_mode, sp=sp,
                                     dp_replicate=dp_replicate, ac=ac,
                                     pipeline_schedule=pipeline_schedule,
                                     stages_per_rank=stages_per_rank)
        if ckpt_ratio is not None:
            space["ckpt_ratios"] = (ckpt_ratio,)
        if micro_batch is not None:
            space["micro_batches"] = (micro_batch,)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("planning", total=None)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=what)

            result = search(spec, gpus, profile, batch_size=batch, seq_len=seq_len,
                            progress=progress, min_headroom=min_headroom,
                            imbalance=ep_imbalance, lora=lora_spec, **space)
        console.print(_search_table(result, top, profile))
        for i, p in enumerate([p for p in result.ranked if result.eligible(p)][:top]):
            cmd, why = train_command(spec, p.layout, device, profile.gpus_per_node)
            if lora_spec is not None and cmd:
                cmd += f" --lora {lora_spec.text()}" + (
                    f" --lora-base-dtype {lora_spec.base_dtype}"
                if lora_spec.base_dtype != "fp32" else "")
            console.print(f"[bold]#{i + 1}[/] {p.layout.describe()}: {_summary(p)}")
            warning = headroom_warning(p)
            if warning:
                console.print(f"    [yellow]{escape(warning)}[/]")
            console.print("    " + schedule_text(p.layout).replace("\n", "\n    "))
            console.print(f"    train it: {cmd}" if cmd else
                          f"    torchloom train cannot run it: {why}")
        tight = [p for p in result.ranked if p.fits and not result.eligible(p)]
        if result.best is None and tight:
            console.print(f"[yellow]no layout that fits leaves {result.min_headroom:.0%} "
                          f"headroom[/]: the fastest of the {len(tight)} that fit with less "
                          f"is {tight[0].layout.describe()} ({tight[0].headroom:.1%} headroom"
                          f"); --min-headroom 0 ranks them, or try more GPUs, --ckpt-ratio 1 "
                          "or a smaller --batch-size")
        elif result.best is None:
            console.print("[red]no layout fits[/]: the closest is "
                          + (result.ranked[0].layout.describe() if result.ranked else "none")
                          + "; try more GPUs, --ckpt-ratio 1, a smaller --batch-size or a "
                          "larger device")
        kernels = [{}, {"compile": measure_compile}] if measure_compile else [{}]
        measured = _measure_top(model, size, gpus, profile, batch, seq_len, measure_top,
                                kernels, space, console) if measure_top else None
        console.print(legend(), markup=False, highlight=False)
        payload = {"model": spec.name, "gpus": gpus, "profile": profile.name,
                   "measured": measured, "min_headroom": min_headroom,
                   "batch_size": batch, "seq_len": seq_len, "seconds": result.seconds,
                   "ranked": [p.to_dict() for p in result.ranked[:max(top, 20)]],
                   "predicted": len(result.ranked),
                   "refused": [{"layout": lay.describe(), "why": why}
                               for lay, why in result.rejected]}
        if plot:
            plot_search(result, plot, f"{spec.name} on {gpus} x {profile.name}",
                        profile.budget)
            console.print(f"wrote {plot}")
    if json_path:
        text = json.dumps(payload, indent=1, default=str)
        if json_path == "-":
            print(text)
        else:
            with open(json_path, "w") as fh:
                fh.write(text)
            console.print(f"wrote {json_path}")


def _measure_top(model: str, size: str, gpus: int, profile: Profile, batch: int,
                 seq_len: int, count: int, kernels: list[dict[str, Any]],
                 space: dict[str, Any], console: Console) -> list[dict[str, Any]]:
    """``--measure-top``: :func:`torchloom.tune.tune_layouts` on local ranks; a table of
    the measured layouts, the chosen one marked."""
    from ..tune import tune_layouts

    with console.status(f"training the {count} best predicted layouts on {gpus} local "
                        "ranks..."):
        tuned = tune_layouts(model, gpus, profile, batch_size=batch, seq_len=seq_len,
                             measure_top=count, kernels=kernels, size=size, **space)
    table = Table(title=f"measured on {gpus} local gloo ranks (fp32)")
    for column in ("layout", "kernels", "predicted tok/s", "measured tok/s",
                   "predicted peak", "measured peak", "chosen"):
        table.add_column(column, justify="left" if column in ("layout", "kernels")
                         else "right")
    rows = []
    for t in tuned.measured:
        chosen = t is tuned.best
        kernel_text = ", ".join(f"{k}={v}" for k, v in t.kernels.items()) or "-"
        table.add_row(t.layout.describe(), kernel_text, f"{t.predicted_tokens_per_s:,.0f}",
                      f"{t.measured_tokens_per_s:,.0f}", _gib(t.predicted_peak or 0),
                      _gib(t.measured_peak or 0), "yes" if chosen else "")
        rows.append({"layout": t.layout.to_dict(), "kernels": t.kernels,
                     "predicted_tokens_per_s":
                     t.predicted_tokens_per_s, "measured_tokens_per_s": t.measured_tokens_per_s,
                     "predicted_peak": t.predicted_peak, "measured_peak": t.measured_peak,
                     "chosen": chosen})
    console.print(table)
    for t in tuned.trials:
        if t.status == "failed":
            console.print(f"[red]failed[/]: {t.layout.describe()}: {escape(t.reason or '')}")
    return rows


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="torchloom plan: per-GPU memory and step time of a model's layouts.")
app.command()(clean_errors(plan_command))


def main(argv: list[str] | None = None) -> None:
    """``python -m torchloom.apps.plan_cli MODEL --gpus N ...``."""
    app(args=argv, prog_name="torchloom plan")


if __name__ == "__main__":  # pragma: no cover
    main()
