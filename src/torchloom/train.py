"""The training loop behind ``torchloom train``: a zoo model under its built-in schedule,
on one process or on a (dp, tp) mesh, with checkpoints that resume exactly.

Everything a step depends on is a function of the step number, so a run killed at any
point and resumed from its last checkpoint computes the same losses, bit for bit on CPU,
as a run that was never interrupted:

* the batch of step ``s`` is drawn with a generator seeded by ``(seed, s)``;
* the random state (dropout) is re-seeded at the start of every step from ``(seed, s)``
  (per tensor-parallel rank for the ``fork_rng`` state);
* the learning rate is a function of ``s`` (linear warm-up, cosine decay);
* the weights and the optimizer state come from the checkpoint (``torchloom.save``).

A checkpoint also holds the run's configuration (:data:`RUN_FIELDS` and the schedule's
recipe): ``--resume`` with another one refuses, naming the fields that differ (unless
``allow_config_change``), and ``--resume`` where nothing loadable exists refuses naming
the directory and what it holds. A loss that is not finite stops the run with a
:class:`NonFiniteLossError` naming the step, before that step's optimizer update and
before any checkpoint of it is written: the last good checkpoint stays the newest.

Launch with ``torchrun --nproc-per-node N -m torchloom train --tp T --dp D`` (N = T x D), or
without torchrun: ``torchloom train --tp 2`` starts the ranks itself (gloo, local).

>>> cfg = TrainConfig(model="gpt2", size="tiny", steps=2, batch_size=2, seq_len=16)
>>> result = train_rank(0, cfg.to_dict())
>>> len(result["losses"]), result["first_step"]
(2, 1)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import data, models, zoo
from .build import build
from .collectives import guard_collective
from .errors import ScheduleError
from .rng import get_rng_tracker, set_random_seed
from .schedule import create_schedule
from .state import (
    CheckpointIOError,
    CheckpointMismatchError,
    check_save_dir,
    describe_dir,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save,
)

__all__ = ["NonFiniteLossError", "RUN_FIELDS", "TrainConfig", "batch_at", "check_config",
           "lr_at", "run_config", "train_rank"]

RUN_FIELDS = ("model", "size", "steps", "batch_size", "seq_len", "lr", "seed", "tp", "dp",
              "pp", "n_microbatches", "sequence_parallel", "ckpt_ratio", "deterministic")
"""The fields of :class:`TrainConfig` a checkpoint records and ``--resume`` compares (with
the schedule's recipe). Not compared: where and how often to save, ``stop_after``."""

_FLAGS = {"model": "--model", "size": "--size", "steps": "--steps",
          "batch_size": "--batch-size", "seq_len": "--seq-len", "lr": "--lr", "seed": "--seed",
          "tp": "--tp", "dp": "--dp", "pp": "--pp", "ckpt_ratio": "--ckpt-ratio"}
_PRIMITIVE = "torchloom train"


class NonFiniteLossError(ScheduleError):
    """The training loss became NaN or infinite; the run stopped before using it."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    model: str = "gpt2"
    size: str = "tiny"
    steps: int = 20
    batch_size: int = 8
    """Sequences per step over all data-parallel ranks."""
    seq_len: int = 64
    lr: float = 1e-3
    seed: int = 0
    tp: int = 1
    dp: int = 1
    pp: int = 1
    """Pipeline stages (the layers split evenly), run with the 1F1B schedule."""
    n_microbatches: int = 4
    sequence_parallel: bool = False
    ckpt_ratio: float = 0.0
    save_dir: str | None = None
    save_every: int = 0
    """Save after every ``save_every`` steps (0: only at the end, if ``save_dir``)."""
    resume: bool = False
    allow_config_change: bool = False
    """Resume even if the checkpoint was saved by a run with another configuration."""
    stop_after: int | None = None
    """Stop after this step (and save), keeping the learning-rate schedule of ``steps``:
    for jobs that run in slices of a time limit."""
    deterministic: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of peak.

    >>> round(lr_at(0, 100, 1.0), 3), round(lr_at(99, 100, 1.0), 3)
    (0.1, 0.1)
    """
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The token windows of step ``step`` (``batch_size`` x ``seq_len``), a function of
    ``(seed, step)`` only."""
    corpus = data.load_corpus()
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([corpus[s:s + seq_len] for s in starts.tolist()]).long()


def _check(cfg: TrainConfig, world: int) -> None:
    ranks = cfg.tp * cfg.dp * cfg.pp
    if ranks != world:
        raise ScheduleError(
            f"--tp {cfg.tp} x --dp {cfg.dp} x --pp {cfg.pp} = {ranks} ranks, but the run has "
            f"{world}",
            primitive="torchloom train",
            values={"tp": cfg.tp, "dp": cfg.dp, "pp": cfg.pp, "world_size": world},
            fix=f"torchrun --nproc-per-node {ranks} -m torchloom train --tp {cfg.tp} "
            f"--dp {cfg.dp} --pp {cfg.pp}",
        )
    if cfg.pp > 1 and (cfg.save_dir or cfg.dp > 1):
        raise ScheduleError(
            "pipeline runs do not yet combine with checkpoints or data parallelism here",
            primitive="torchloom train",
            values={"pp": cfg.pp, "dp": cfg.dp, "save_dir": cfg.save_dir},
            fix="train the pipeline without --save-dir and --dp, or use --tp / --dp",
        )
    if cfg.pp > 1 and (cfg.batch_size % cfg.n_microbatches):
        raise ScheduleError(
            f"the batch of {cfg.batch_size} does not split into {cfg.n_microbatches} "
            "micro-batches", primitive="torchloom train",
            values={"batch_size": cfg.batch_size, "n_microbatches": cfg.n_microbatches},
            fix=f"use a batch size divisible by {cfg.n_microbatches}",
        )
    if cfg.batch_size % cfg.dp:
        raise ScheduleError(
            f"the batch of {cfg.batch_size} sequences does not split over {cfg.dp} "
            "data-parallel ranks",
            primitive="torchloom train", values={"batch_size": cfg.batch_size, "dp": cfg.dp},
            fix=f"use a batch size divisible by {cfg.dp}",
        )
    check_config(cfg)


def _text_models() -> list[str]:
    return [m for m in zoo.list_models() if zoo._entry(m, _PRIMITIVE).kind != "image"]


def check_config(cfg: TrainConfig) -> None:
    """What can be checked before any rank starts: the model takes tokens, the sequence
    fits its positions, the save directory may be written, and ``--resume`` has something
    to resume (or a run without it would not write over another run's checkpoints).
    Reads files only; raises a :class:`ScheduleError` (exit status 2 on the command line).
    """
    if cfg.resume and not cfg.save_dir:
        raise ScheduleError(
            "--resume needs the checkpoint directory", primitive=_PRIMITIVE,
            values={"resume": True, "save_dir": None},
            fix="torchloom train --save-dir runs/gpt2 --resume",
        )
    kind = zoo._entry(cfg.model, _PRIMITIVE).kind
    if kind == "image":
        supported = _text_models()
        raise ScheduleError(
            f"torchloom train feeds token windows of text, and {cfg.model} takes images",
            primitive=_PRIMITIVE, values={"model": cfg.model, "supported": supported},
            fix=f"train one of {', '.join(supported)}: torchloom train --model gpt2; train "
            f"{cfg.model} in Python with image batches (zoo.example_inputs({cfg.model!r}, model))")
    _positions(cfg.model, cfg.size, cfg.seq_len)
    if not cfg.save_dir:
        return
    check_save_dir(cfg.save_dir, _PRIMITIVE)
    found = list_checkpoints(cfg.save_dir)
    if cfg.resume and not found:
        raise CheckpointIOError(
            "--resume: the save directory holds no complete checkpoint to resume from",
            primitive=_PRIMITIVE,
            values={"save_dir": cfg.save_dir, "contents": describe_dir(cfg.save_dir)},
            fix=f"check the directory name, or start the run without --resume: torchloom "
            f"train --model {cfg.model} --save-dir {cfg.save_dir}")
    if not cfg.resume and found:
        raise CheckpointIOError(
            f"the save directory already holds checkpoints of a run (newest: step "
            f"{found[0].step}); a new run would replace them",
            primitive=_PRIMITIVE,
            values={"save_dir": cfg.save_dir, "checkpoints": [c.name for c in found]},
            fix=f"continue that run: torchloom train --save-dir {cfg.save_dir} --resume; or "
            f"start anew in another directory: --save-dir {cfg.save_dir}-2")
    if cfg.resume and not cfg.allow_config_change:
        # the recipe is compared once the schedule exists (in the ranks)
        _compare(found[0].config, {k: getattr(cfg, k) for k in RUN_FIELDS}, found[0].name,
                 cfg.save_dir, recipe=False)


def run_config(cfg: TrainConfig, recipe: str) -> dict[str, Any]:
    """What a checkpoint of this run records: :data:`RUN_FIELDS` and the recipe text."""
    return {**{k: getattr(cfg, k) for k in RUN_FIELDS}, "recipe": recipe}


def _compare(saved: dict[str, Any] | None, now: dict[str, Any], name: str, save_dir: str,
             recipe: bool = True) -> None:
    """Refuse to resume a checkpoint saved by a run of another configuration."""
    if saved is None:
        raise CheckpointMismatchError(
            f"checkpoint {name!r} holds no run configuration (it was not written by "
            "torchloom train)", primitive=_PRIMITIVE, values={"save_dir": save_dir},
            fix="resume it anyway: add --allow-config-change")
    keys = [k for k in now if recipe or k != "recipe"]
    if recipe:
        keys += [k for k in saved if k not in now]
    differ = [k for k in keys if saved.get(k) != now.get(k)]
    if not differ:
        return
    lines = []
    for k in differ:
        if k == "recipe":
            lines.append("recipe: the schedule differs")
        else:
            lines.append(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now")
    flags = " ".join(f"{_FLAGS[k]} {saved[k]}" for k in differ if k in _FLAGS and k in saved)
    if "sequence_parallel" in differ:
        flags += " --sp" if saved.get("sequence_parallel") else ""
    again = (f"resume with the checkpoint's values: torchloom train --save-dir {save_dir} "
             f"--resume {flags}".rstrip() + "; or ") if flags else ""
    raise CheckpointMismatchError(
        f"checkpoint {name!r} was saved by a run with another configuration: "
        f"{', '.join(differ)}", primitive=_PRIMITIVE,
        values={"save_dir": save_dir, "differences": lines},
        fix=f"{again}continue with the new values: add --allow-config-change")


def train_rank(rank: int, config: dict[str, Any],
               on_step: Callable[[int, float, float], None] | None = None) -> dict[str, Any]:
    """Train on this rank (the process group, if any, is already initialised).

    Returns ``{"losses": [...], "first_step": s, "tokens_per_s": x}``: the losses of the
    steps this call ran (numbered from ``first_step``). ``on_step(step, loss, tokens_per_s)``
    is called after each step (on every rank).
    """
    cfg = TrainConfig(**config)
    world = dist.get_world_size() if dist.is_initialized() else 1
    _check(cfg, world)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(cfg.deterministic or was_deterministic)
    try:
        return _train(cfg, world, rank, on_step)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(cfg: TrainConfig, world: int, rank: int,
           on_step: Callable[[int, float, float], None] | None) -> dict[str, Any]:
    mesh = tp_group = None
    tp_rank = dp_rank = 0
    if world > 1:
        from .parallel import init_mesh

        mesh = init_mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
        tp_group = mesh["tp"].get_group()
        tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()

    model = zoo.make_model(cfg.model, cfg.size, seed=cfg.seed,
                           **_positions(cfg.model, cfg.size, cfg.seq_len))
    sch = create_schedule(model, group=tp_group)
    models.apply_schedule(sch, tp=cfg.tp > 1, sequence_parallel=cfg.sequence_parallel,
                          ckpt_ratio=cfg.ckpt_ratio)
    module = sch.mod
    if cfg.pp > 1:
        return _train_pipeline(cfg, sch, mesh, on_step)
    model, optimizer = build(sch, target="ddp" if cfg.dp > 1 else None, mesh=mesh,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=cfg.lr))
    assert optimizer is not None

    config = run_config(cfg, str(sch.recipe))
    last = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    first_step = 1
    checkpoint = None
    if cfg.resume and cfg.save_dir:
        ckpt = find_checkpoint(cfg.save_dir, group=tp_group, primitive=_PRIMITIVE)
        if not cfg.allow_config_change:
            _compare(ckpt.config, config, ckpt.name, cfg.save_dir)
        checkpoint = ckpt.path
        if ckpt.step >= last:
            return {"losses": [], "first_step": ckpt.step + 1, "tokens_per_s": 0.0,
                    "resumed_step": ckpt.step, "complete": ckpt.step >= cfg.steps}
        first_step = load_checkpoint(module, optimizer, ckpt, group=tp_group) + 1

    losses: list[float] = []
    local = cfg.batch_size // cfg.dp
    started = time.perf_counter()
    model.train()
    for step in range(first_step, last + 1):
        # Everything random in a step is a function of (seed, step): resumable exactly.
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        if get_rng_tracker().is_seeded() or cfg.tp > 1:
            get_rng_tracker().reset()
            set_random_seed(cfg.seed * 1_000_003 + step, tp_rank=tp_rank, dp_rank=dp_rank)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg.steps, cfg.lr)
        ids = batch_at(step, cfg.batch_size, cfg.seq_len, cfg.seed)[dp_rank * local:(dp_rank + 1) * local]
        loss = _step_loss(model, ids)
        loss.backward()
        value = _global_mean(loss.detach(), cfg.dp, mesh)
        _check_finite(value, step, optimizer, cfg, checkpoint)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value)
        speed = (step - first_step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
        if on_step is not None:
            on_step(step, value, speed)
        if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == last):
            # Data-parallel replicas hold the same state: the first one writes it.
            if dp_rank == 0:
                checkpoint = save(module, optimizer, cfg.save_dir, step, group=tp_group,
                                  config=config)
            if cfg.dp > 1:
                with guard_collective("barrier", _PRIMITIVE):
                    dist.barrier()
    elapsed = time.perf_counter() - started
    tokens = len(losses) * cfg.batch_size * cfg.seq_len
    return {"losses": losses, "first_step": first_step,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}


def _step_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch of token windows."""
    return model(input_ids=ids, labels=ids).loss


def _check_finite(value: float, step: int, optimizer: torch.optim.Optimizer,
                  cfg: TrainConfig, checkpoint: str | None) -> None:
    """Stop on a NaN or infinite loss, before the optimizer uses its gradients and before
    any checkpoint of ``step`` is written (every rank sees the same value)."""
    if math.isfinite(value):
        return
    lr = optimizer.param_groups[0]["lr"]
    lower = f"{cfg.lr / 2:g}"
    if cfg.save_dir and checkpoint:
        fix = (f"resume from the last good checkpoint with a lower learning rate: torchloom "
               f"train --save-dir {cfg.save_dir} --resume --lr {lower} --allow-config-change")
    else:
        fix = f"train with a lower learning rate: --lr {lower}"
    raise NonFiniteLossError(
        f"the loss of step {step} is {value}: training stopped before the optimizer step of "
        f"step {step}, and no checkpoint of step {step} was written",
        primitive=_PRIMITIVE,
        values={"step": step, "loss": value, "lr": lr, "last_checkpoint": checkpoint},
        fix=fix)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss transformers computes from ``labels``, on the last stage."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1))


def _train_pipeline(cfg: TrainConfig, sch: Any, mesh: Any,
                    on_step: Callable[[int, float, float], None] | None) -> dict[str, Any]:
    """Cut the layers into ``pp`` even stages and train them with the 1F1B schedule."""
    layers = zoo.layer_paths(cfg.model)
    if len(layers) != 1:
        raise ScheduleError(
            f"{cfg.model} has several layer lists; the command line pipelines one",
            primitive="torchloom train", values={"model": cfg.model, "layers": layers},
            fix="pipeline gpt2, bert or llama, or cut the stages by hand in Python",
        )
    count = len(sch[layers[0]].child)
    if count % cfg.pp:
        raise ScheduleError(
            f"{count} layers do not split evenly into {cfg.pp} stages",
            primitive="torchloom train", values={"layers": count, "pp": cfg.pp},
            fix=f"use --pp dividing {count}",
        )
    micro = batch_at(0, cfg.batch_size // cfg.n_microbatches, cfg.seq_len, cfg.seed)
    sch.trace_until(f"{layers[0]}.*", example_inputs={"input_ids": micro})
    per_stage = count // cfg.pp
    for stage in range(cfg.pp - 1):
        sch[f"{layers[0]}.{(stage + 1) * per_stage - 1}"].cut_pipeline_stage()
    pipe, optimizer = build(sch, target="pipeline", mesh=mesh, schedule="1F1B",
                            n_microbatches=cfg.n_microbatches, loss_fn=next_token_loss,
                            example_inputs=(micro,),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=cfg.lr))
    assert optimizer is not None
    pp_group = mesh["pp"].get_group()
    last = dist.get_global_rank(pp_group, cfg.pp - 1)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(1, (cfg.stop_after or cfg.steps) + 1):
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg.steps, cfg.lr)
        ids = batch_at(step, cfg.batch_size, cfg.seq_len, cfg.seed)
        loss = pipe.step(ids, target=ids)
        value = torch.zeros(()) if loss is None else loss.detach().clone()
        with guard_collective("broadcast", _PRIMITIVE, pp_group):
            dist.broadcast(value, src=last, group=pp_group)
        _check_finite(float(value), step, optimizer, cfg, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(value))
        speed = step * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
        if on_step is not None:
            on_step(step, losses[-1], speed)
    elapsed = time.perf_counter() - started
    return {"losses": losses, "first_step": 1,
            "tokens_per_s": len(losses) * cfg.batch_size * cfg.seq_len / elapsed}


_GROWN = frozenset({"gpt2", "bert", "llama"})
"""Models whose position table ``torchloom train`` lengthens to ``--seq-len``."""


def _positions(model: str, size: str, seq_len: int) -> dict[str, int]:
    """Config overrides for sequences of ``seq_len`` tokens: the position table of gpt2,
    bert and llama grows to fit; other models refuse a sequence longer than theirs."""
    found = zoo.max_positions(model, size)
    if found is None:
        return {}
    key, limit = found
    if model in _GROWN:
        return {key: max(limit, seq_len)}
    if seq_len > limit:
        raise ScheduleError(
            f"--seq-len {seq_len} is longer than the {limit} positions of {model} ({size}): "
            f"config field {key} = {limit}",
            primitive=_PRIMITIVE,
            values={"model": model, "size": size, "seq_len": seq_len, key: limit},
            fix=f"torchloom train --model {model} --size {size} --seq-len {limit}")
    return {}


def _global_mean(loss: torch.Tensor, dp: int, mesh: Any) -> float:
    if dp == 1:
        return float(loss)
    total = loss.clone()
    with guard_collective("all_reduce", _PRIMITIVE, mesh["dp"].get_group()):
        dist.all_reduce(total, group=mesh["dp"].get_group())
    return float(total) / dp
