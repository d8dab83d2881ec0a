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
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import data, models, zoo
from .build import build
from .errors import ScheduleError
from .rng import get_rng_tracker, set_random_seed
from .schedule import create_schedule
from .state import load, save

__all__ = ["TrainConfig", "train_rank", "batch_at", "lr_at"]


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
    if cfg.resume and not cfg.save_dir:
        raise ScheduleError(
            "--resume needs the checkpoint directory", primitive="torchloom train",
            values={"resume": True, "save_dir": None},
            fix="torchloom train --save-dir runs/gpt2 --resume",
        )


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
                           **_positions(cfg.model, cfg.seq_len))
    sch = create_schedule(model, group=tp_group)
    models.apply_schedule(sch, tp=cfg.tp > 1, sequence_parallel=cfg.sequence_parallel,
                          ckpt_ratio=cfg.ckpt_ratio)
    module = sch.mod
    if cfg.pp > 1:
        return _train_pipeline(cfg, sch, mesh, on_step)
    model, optimizer = build(sch, target="ddp" if cfg.dp > 1 else None, mesh=mesh,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=cfg.lr))
    assert optimizer is not None

    first_step = 1
    if cfg.resume and cfg.save_dir and (Path(cfg.save_dir) / "torchloom.pt").exists():
        first_step = load(module, optimizer, cfg.save_dir, group=tp_group) + 1

    losses: list[float] = []
    local = cfg.batch_size // cfg.dp
    started = time.perf_counter()
    model.train()
    last = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    for step in range(first_step, last + 1):
        # Everything random in a step is a function of (seed, step): resumable exactly.
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        if get_rng_tracker().is_seeded() or cfg.tp > 1:
            get_rng_tracker().reset()
            set_random_seed(cfg.seed * 1_000_003 + step, tp_rank=tp_rank, dp_rank=dp_rank)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, cfg.steps, cfg.lr)
        ids = batch_at(step, cfg.batch_size, cfg.seq_len, cfg.seed)[dp_rank * local:(dp_rank + 1) * local]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = _global_mean(loss.detach(), cfg.dp, mesh)
        losses.append(value)
        speed = (step - first_step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
        if on_step is not None:
            on_step(step, value, speed)
        if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == last):
            # Data-parallel replicas hold the same state: the first one writes it.
            if dp_rank == 0:
                save(module, optimizer, cfg.save_dir, step, group=tp_group)
            if cfg.dp > 1:
                dist.barrier()
    elapsed = time.perf_counter() - started
    tokens = len(losses) * cfg.batch_size * cfg.seq_len
    return {"losses": losses, "first_step": first_step,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}


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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = torch.zeros(()) if loss is None else loss.detach().clone()
        dist.broadcast(value, src=last, group=pp_group)
        losses.append(float(value))
        speed = step * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
        if on_step is not None:
            on_step(step, losses[-1], speed)
    elapsed = time.perf_counter() - started
    return {"losses": losses, "first_step": 1,
            "tokens_per_s": len(losses) * cfg.batch_size * cfg.seq_len / elapsed}


def _positions(model: str, seq_len: int) -> dict[str, int]:
    key = {"gpt2": "n_positions", "bert": "max_position_embeddings",
           "llama": "max_position_embeddings"}.get(model)
    return {key: max(128, seq_len)} if key else {}


def _global_mean(loss: torch.Tensor, dp: int, mesh: Any) -> float:
    if dp == 1:
        return float(loss)
    total = loss.clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    return float(total) / dp
