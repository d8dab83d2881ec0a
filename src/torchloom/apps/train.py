"""The training loop behind ``torchloom train``: a zoo model, a transformers model folder
or a config file, under its built-in schedule, on one process or a (pp, dp, tp) mesh, on
local text (or Python's own source), with checkpoints that resume exactly.

The model (``--model``, see :mod:`torchloom.apps.jobconfig`):

* a zoo name: the zoo's model, randomly initialised from ``seed`` (its position table
  grown to ``seq_len`` for gpt2, bert and llama);
* a folder with ``config.json`` and weights (``save_pretrained`` output): the model is
  made on ``meta`` (``AutoConfig`` + ``AutoModelForCausalLM.from_config`` under
  :func:`~torchloom.init_empty_weights`), scheduled, and ``build(sch, weights=folder)``
  reads each rank's slices; a tokenizer in the folder tokenises ``--data``;
* a ``.json`` config file: the same, randomly initialised by ``build`` from ``seed``;
* ``path/to/file.py:factory`` (on the command line only): the module the factory returns,
  made after ``torch.manual_seed(seed)`` (a plain module wrapped in
  :class:`~torchloom.tools.usercode.TokenLM`, which adds the next-token loss; a
  transformers model as it is), its contract checked up front on values without data.

The schedule is the class's built-in one, or the one derived from its transformers
tensor-parallel plan (:func:`torchloom.schedules.apply_schedule`: tensor parallelism,
sequence parallelism, checkpointing); a class with neither trains with checkpointing only
(``ckpt_ratio`` on its layer lists) and refuses ``tp``.

A step: ``grad_accum`` forward/backward micro-steps (DDP / FSDP2 synchronise only on the
last one), the mean loss checked for NaN or infinity (a :class:`NonFiniteLossError`
naming the step, raised before the step's optimizer update and before any checkpoint of
it is written), the global gradient norm clipped (``clip_grad``: over every
tensor-parallel shard, FSDP2 shard and pipeline stage), then AdamW (the step of every
command, :func:`torchloom.runtime.loop.train_step`). With ``dtype="bf16"``
the forward runs under bf16 autocast (FSDP2: ``MixedPrecisionPolicy``).

Everything a step depends on is a function of the step number, so a run resumed from
its last checkpoint computes the same losses, bit for bit on CPU, as one never interrupted;
a checkpoint holds the run's configuration, which ``--resume`` checks: docs/design/train.md.

Launch with ``torchrun --nproc-per-node N -m torchloom train --tp T --dp D --pp P``
(N = T x D x P), or without torchrun on CPU: ``torchloom train --tp 2`` starts the ranks
itself (gloo, local).

>>> cfg = TrainConfig(model="gpt2", size="tiny", steps=2, batch_size=2, seq_len=16)
>>> result = train_rank(0, cfg)
>>> len(result["losses"]), result["first_step"]
(2, 1)
>>> [round(lr_at(s, 10, 1.0, warmup=2, decay="linear"), 2) for s in (0, 1, 2, 9)]
[0.5, 1.0, 1.0, 0.21]
"""

from __future__ import annotations

import functools
import json
import math
import os
import resource
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import NonFiniteLossError
from ..core.meta import shard_spec
from ..core.outputs import no_cache_kwargs
from ..parallel import Parallelized, checkpoint_group, create_schedule, init_mesh, parallelize
from ..parallel.lora import parse_lora
from ..runtime.collectives import guard_collective
from ..runtime.loop import lr_at, train_step
from ..runtime.rng import get_rng_tracker, set_random_seed
from ..runtime.state import (
    find_checkpoint,
    load_checkpoint,
    save,
)
from ..schedules import zoo
from ..tools import usercode
from . import chat_data, data
from .jobconfig import RUN_FIELDS, TrainConfig, TrainOptionError
from .train_checkpoints import compare, run_config
from .train_checks import _check_memory as _check_memory
from .train_checks import check_config, check_launch
from .train_examples import CountedLoss, pipeline_loss_sum, sample_answer
from .train_model import (
    _eval_count,
    count_parameters,
    layer_lists,
    layout_text,
    load_data,
    make_model,
    meta_model,
    schedule_source,
    weights_source,
)
from .train_model import _from_config as _from_config
from .train_model import _has_builtin_schedule as _has_builtin_schedule
from .train_model import _hf_config as _hf_config

__all__ = ["NonFiniteLossError", "RUN_FIELDS", "TrainConfig", "TrainOptionError", "batch_at",
           "check_config", "check_launch", "count_parameters", "layer_lists", "load_data",
           "lr_at", "make_model", "meta_model", "run_config", "schedule_source", "train_rank"]

_PRIMITIVE = "torchloom train"
Report = Callable[[dict[str, Any]], None]


# --------------------------------------------------------------------------- schedule of a step


def _lr(cfg: TrainConfig, step: int) -> float:
    return lr_at(step - 1, cfg.steps, cfg.lr, warmup=cfg.warmup(), decay=cfg.lr_decay,
                 min_ratio=cfg.min_lr_ratio)


def batch_at(step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """The token windows of step ``step`` (``batch_size`` x ``seq_len``) of the default
    corpus (Python's source), a function of ``(seed, step)`` only."""
    return data.window_batch(data.load_corpus(), step, batch_size, seq_len, seed)


# --------------------------------------------------------------------------- a rank


def _device(cfg: TrainConfig, rank: int) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def train_rank(rank: int, cfg: TrainConfig, report: Report | None = None) -> dict[str, Any]:
    """Train on this rank (the process group, if any, is already initialised).

    Returns ``{"losses": [...], "first_step": s, "tokens_per_s": x, "eval_losses":
    {step: loss}}``: the losses of the steps this call ran (numbered from ``first_step``).
    ``report(record)`` is called on every rank with a dict: ``{"kind": "start", ...}``
    once training begins (the model, its parameter count, the data), ``{"kind": "step",
    "step", "steps", "loss", "lr", "tokens_per_s", "mfu", "memory_mib", "grad_norm"}``
    after each step and ``{"kind": "eval", "step", "eval_loss"}`` after each evaluation.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfg.world != world:
        raise TrainOptionError(
            f"--tp {cfg.tp} x --cp {cfg.cp} x --dp {cfg.dp} x --pp {cfg.pp} = {cfg.world} ranks, "
            f"but the run has {world}", primitive=_PRIMITIVE,
            values={"tp": cfg.tp, "cp": cfg.cp, "dp": cfg.dp, "pp": cfg.pp, "world_size": world},
            fix=f"torchrun --nproc-per-node {cfg.world} -m torchloom train --tp {cfg.tp} "
            f"--cp {cfg.cp} --dp {cfg.dp} --pp {cfg.pp}")
    if world == 1:
        check_config(cfg)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(cfg.deterministic or was_deterministic,
                                       warn_only=cfg.device == "cuda")
    try:
        return _Run(cfg, rank, world, report).run()
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


class _Metrics:
    """Rank 0's metrics outputs: a JSONL file (appended) and TensorBoard events."""

    def __init__(self, cfg: TrainConfig, rank: int) -> None:
        self.file = self.writer = None
        if rank != 0:
            return
        if cfg.metrics:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics)), exist_ok=True)
            self.file = open(cfg.metrics, "a", encoding="utf-8")  # noqa: SIM115
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(cfg.tensorboard)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({**record, "time": time.time()}) + "\n")
            self.file.flush()
        if self.writer is not None:
            prefix = "eval" if record["kind"] == "eval" else "train"
            for key, value in record.items():
                if isinstance(value, float) and key not in ("step", "steps"):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


def _memory_mib(device: torch.device) -> float:
    """Peak memory: CUDA allocations on CUDA, this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _flops_per_token(cfg: TrainConfig) -> float | None:
    """FLOPs of one forward and backward per token (FlopCounterMode, on the unscheduled
    model on fake tensors, nothing allocated: recomputation is not useful work); None if it
    cannot be counted."""
    from ..graph.fake import _tensors_on_meta, fake_values, value_mode
    from ..plan.opcost import flop_counter, grouped_mm_on_fake

    try:
        model = meta_model(cfg)
        ids = torch.zeros(1, cfg.seq_len, dtype=torch.long)
        # fake values: transformers skips its data-dependent checks on them (no .item())
        mode = value_mode(model, ids)
        # (with the grouped product of mixtures of experts counted, on fake tensors of
        # any dtype)
        counter = flop_counter()
        with _tensors_on_meta(model, True), mode, grouped_mm_on_fake(), counter:
            ids = fake_values(mode, ids)
            model(input_ids=ids, labels=ids, **no_cache_kwargs(model)).loss.backward()
        return counter.get_total_flops() / cfg.seq_len
    except Exception:  # noqa: BLE001 - a model FlopCounterMode cannot run on meta: no MFU
        return None


class _Run:
    """One rank's run (see :func:`train_rank`)."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, report: Report | None) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.report = report or (lambda record: None)
        self.device = _device(cfg, rank)
        self.layout = cfg.layout()
        self.mesh = init_mesh(self.layout, device_type=cfg.device)
        self.tp_group = self.dp_group = self.pp_group = None
        self.tp_rank = self.dp_rank = 0
        if self.mesh is not None:
            self.tp_group, self.dp_group, self.pp_group = (
                self.mesh.group(d) for d in ("tp", "dp", "pp"))
            self.tp_rank, self.dp_rank = (self.mesh.local_rank(d) for d in ("tp", "dp"))
        self.corpus = load_data(cfg)
        self.examples = self.corpus.examples
        self.lora = (parse_lora(cfg.lora, seed=cfg.seed, base_dtype=cfg.lora_base_dtype)
                     if cfg.lora else None)
        self.fsdp = self.layout.fsdp
        self.built: Parallelized | None = None
        self.checkpoint: str | None = None

    # ---- pieces

    def autocast(self) -> Any:
        assert self.built is not None
        return self.built.autocast(self.device.type)

    def seed_step(self, step: int) -> None:
        # Everything random in a step is a function of (seed, step): resumable exactly.
        torch.manual_seed(self.cfg.seed * 1_000_003 + step)
        if get_rng_tracker().is_seeded() or self.cfg.tp > 1:
            get_rng_tracker().reset()
            set_random_seed(self.cfg.seed * 1_000_003 + step, tp_rank=self.tp_rank,
                            dp_rank=self.dp_rank)

    def local_batch(self, step: int) -> torch.Tensor:
        """This data-parallel rank's share of step ``step``'s windows."""
        cfg = self.cfg
        ids = data.window_batch(self.corpus.train, step, cfg.batch_size, cfg.seq_len, cfg.seed)
        share = cfg.batch_size // cfg.dp
        return ids[self.dp_rank * share:(self.dp_rank + 1) * share].to(self.device)

    def example_batch(self, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This data-parallel rank's share of step ``step``'s examples (``input_ids``,
        ``labels`` with -100 outside the responses, ``position_ids`` when packed), and the
        number of tokens of the whole step that count in the loss (after the shift)."""
        cfg = self.cfg
        batch = chat_data.example_batch(self.examples, step, cfg.batch_size, cfg.seq_len,
                                        cfg.seed)
        counted = (batch["labels"][:, 1:] != -100).sum().to(torch.float32)
        if not cfg.pack:
            del batch["position_ids"]  # whole rows from 0: the model's own positions
        share = cfg.batch_size // cfg.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        return {k: v[lo:hi].to(self.device) for k, v in batch.items()}, counted.to(self.device)

    def dp_mean(self, value: torch.Tensor) -> float:
        if self.cfg.dp == 1:
            return float(value)
        total = value.detach().clone().to(self.device)
        with guard_collective("all_reduce", _PRIMITIVE, self.dp_group):
            dist.all_reduce(total, group=self.dp_group)
        return float(total) / self.cfg.dp

    def grad_norm(self, params: list[nn.Parameter], tied: dict[int, int]) -> torch.Tensor:
        """The global L2 norm of the gradients: tensor-parallel shards summed over the tp
        group, FSDP2 shards over the dp_shard group (HSDP's replicas hold them again), the
        experts of expert parallelism over the ep group (their FSDP2 shards first over the
        ep replicas), stages over the pp group; a weight tied
        across ``n`` stages counted once (``tied``: id -> n)."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        experts_sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq = grad.detach().double().pow(2).sum() / tied.get(id(p), 1)
            spec = shard_spec(p)
            if spec is not None and spec.group is not None:
                if hasattr(p.grad, "to_local"):
                    experts_sharded += sq  # FSDP2 shards of them, over the ep replicas
                else:
                    experts += sq  # this rank's experts, whole
            elif spec is not None and spec.world_size > 1:
                sharded += sq
            else:
                replicated += sq
        if self.cfg.ep > 1 and self.mesh is not None:
            replicas = self.mesh.group("ep_replicas")
            if replicas is not None:
                with guard_collective("all_reduce", _PRIMITIVE, replicas):
                    dist.all_reduce(experts_sharded, group=replicas)
            experts += experts_sharded
            group = self.mesh.group("ep")
            with guard_collective("all_reduce", _PRIMITIVE, group):
                dist.all_reduce(experts, group=group)
        both = torch.stack([sharded, replicated])
        if self.fsdp:
            # FSDP2 shards over dp_shard (x cp); HSDP's replicas hold the same shards again
            shard_group = self.mesh.shard_group() if self.mesh is not None else None
            with guard_collective("all_reduce", _PRIMITIVE, shard_group):
                dist.all_reduce(both, group=shard_group)
        if self.cfg.tp > 1:
            with guard_collective("all_reduce", _PRIMITIVE, self.tp_group):
                dist.all_reduce(both[:1], group=self.tp_group)
        total = both.sum() + experts
        if self.cfg.pp > 1:
            with guard_collective("all_reduce", _PRIMITIVE, self.pp_group):
                dist.all_reduce(total, group=self.pp_group)
        return total.sqrt()

    def clip(self, params: list[nn.Parameter], tied: dict[int, int]) -> float | None:
        if not self.cfg.clip_grad:
            return None
        norm = self.grad_norm(params, tied)
        coef = self.cfg.clip_grad / (float(norm) + 1e-6)
        if coef < 1:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return float(norm)

    def first_step(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                   config: dict[str, Any], last: int) -> int | dict[str, Any]:
        """Load the newest loadable checkpoint (into this run's layout, whatever the
        layout that saved it); the first step to run, or the result of a run that has
        nothing left to do."""
        cfg = self.cfg
        if not (cfg.resume and cfg.save_dir):
            return 1
        group, writes = checkpoint_group(self.layout, self.mesh)
        ckpt = find_checkpoint(cfg.save_dir, group=group, set_aside=writes,
                               primitive=_PRIMITIVE)
        changes: list[str] = []
        if not cfg.allow_config_change:
            changes = compare(ckpt.config, config, ckpt.name, cfg.save_dir)
        self.checkpoint = ckpt.path
        if ckpt.step >= last:
            return {"losses": [], "first_step": ckpt.step + 1, "tokens_per_s": 0.0,
                    "eval_losses": {}, "resumed_step": ckpt.step,
                    "complete": ckpt.step >= cfg.steps}
        step = load_checkpoint(module, optimizer, ckpt, group=group)
        self.report({"kind": "resume", "step": step, "checkpoint": ckpt.path,
                     "layout_changes": changes})
        return step + 1

    def maybe_save(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                   config: dict[str, Any], step: int, last: int) -> None:
        cfg = self.cfg
        if not cfg.save_dir or not ((cfg.save_every and step % cfg.save_every == 0)
                                    or step == last):
            return
        # one checkpoint of the whole model: replica 0's ranks write it (the replicas hold
        # the same tensors), or every rank with FSDP2 (each holds its own shards)
        group, writes = checkpoint_group(self.layout, self.mesh)
        if writes:
            self.checkpoint = save(module, optimizer, cfg.save_dir, step, group=group,
                                   config=config, trainable_only=self.lora is not None)
        if self.world > 1:
            with guard_collective("barrier", _PRIMITIVE):
                dist.barrier()

    def save_pretrained(self, model: nn.Module) -> None:
        """The run's export: the model as a transformers folder; with LoRA the adapter
        folder (peft's form, its base the ``--model`` folder) and, with ``merge``, the
        merged model in ``FOLDER/merged``. The tokenizer goes beside each."""
        from ..runtime.adapter_files import save_adapter
        from ..runtime.pretrained import save_pretrained

        cfg = self.cfg
        folder = cfg.save_pretrained
        assert folder is not None
        written = [folder]
        if self.lora is None:
            save_pretrained(model, folder, group=self.tp_group)
        else:
            base = os.path.abspath(cfg.model) if cfg.model_kind == "folder" else None
            save_adapter(model, folder, group=self.tp_group, base_model=base)
            if cfg.merge:
                written.append(os.path.join(folder, "merged"))
                save_pretrained(model, written[-1], group=self.tp_group, merge_adapters=True)
        if self.rank == 0 and self.corpus.tokenizer:
            tokenizer = data.load_tokenizer(self.corpus.tokenizer)
            for path in written:
                tokenizer.save_pretrained(path)

    def start_record(self, recipe: str) -> dict[str, Any]:
        cfg = self.cfg
        name = f"{cfg.model} ({cfg.size})" if cfg.model_kind == "zoo" else cfg.model
        source = weights_source(cfg)
        whole = meta_model(cfg)
        return {"kind": "start", "model": name,
                "class": type(usercode.inner_module(whole)).__name__,
                "source": source, "parameters": count_parameters(whole),
                "data": self.corpus.description, "device": str(self.device),
                "dtype": cfg.dtype, "ranks": self.world, "layout": layout_text(cfg),
                "schedule": schedule_source(whole), "recipe_lines": recipe.count("\n")}

    def mfu_inputs(self) -> tuple[float | None, float]:
        if self.rank != 0:
            return None, 0.0
        from .bench import measure_peak_flops

        peak = measure_peak_flops(self.device, size=1024 if self.device.type == "cpu" else None)
        return _flops_per_token(self.cfg), peak

    # ---- the run

    def build(self) -> tuple[Any, nn.Module, list[nn.Parameter], dict[int, int], Any]:
        """``(model to call, module to save, parameters, tied, schedule)``: the model under
        the run's layout (:func:`torchloom.parallelize`)."""
        cfg = self.cfg
        model, weights = make_model(cfg, self.device)
        sch = create_schedule(model, self.mesh)
        example = None
        if cfg.pp > 1:
            if self.examples is not None:  # the shape only: examples are padded rows
                micro = torch.zeros((self.layout.micro_batch, cfg.seq_len), dtype=torch.long,
                                    device=self.device)
            else:
                micro = data.window_batch(self.corpus.train, 0, self.layout.micro_batch,
                                          cfg.seq_len, cfg.seed).to(self.device)
            example = {"input_ids": micro}  # the last stage computes the layout's loss

        def seed() -> None:
            if cfg.model_kind != "zoo":
                torch.manual_seed(cfg.seed)  # random init of a config model is the seed's

        inner = usercode.inner_module(model)
        built = parallelize(
            sch, self.layout, mesh=self.mesh, device=self.device, weights=weights,
            strict=not cfg.allow_missing, example_inputs=example,
            schedule_at="model" if inner is not model else "",
            stacks=_zoo_stacks(cfg, model), before_build=seed, lora=self.lora)
        self.built = built
        if cfg.pp > 1 and self.examples is not None:
            # examples: the loss over the step's response tokens, not a mean per micro-batch
            schedule = built.model.schedule
            self.counted_loss = CountedLoss(schedule._loss_fn)
            schedule._loss_fn = self.counted_loss
        return built.model, built.module, built.parameters(), built.ties, sch

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        model, module, params, tied, sch = self.build()
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        recipe = str(sch.recipe)
        config = run_config(cfg, recipe)
        last = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        first = self.first_step(module, optimizer, config, last)
        if isinstance(first, dict):
            return first
        self.report(self.start_record(recipe))
        flops_per_token, peak = self.mfu_inputs()
        metrics = _Metrics(cfg, self.rank)
        losses: list[float] = []
        evals: dict[int, float] = {}
        tokens_per_step = cfg.batch_size * cfg.seq_len
        step_fn = self.pipeline_step if cfg.pp > 1 else self.step
        started = time.perf_counter()
        model.train()
        try:
            for step in range(first, last + 1):
                self.seed_step(step)
                value, norm = train_step(
                    functools.partial(step_fn, model, step), optimizer, lr=_lr(cfg, step),
                    clip=lambda: self.clip(params, tied), check=functools.partial(
                        _check_finite, step=step, optimizer=optimizer, cfg=cfg,
                        checkpoint=self.checkpoint))
                losses.append(value)
                speed = (step - first + 1) * tokens_per_step / (time.perf_counter() - started)
                mfu = (speed * flops_per_token / (peak * self.world)
                       if flops_per_token and peak else None)
                record = {"kind": "step", "step": step, "steps": cfg.steps, "loss": value,
                          "lr": optimizer.param_groups[0]["lr"], "tokens_per_s": speed,
                          "mfu": mfu, "memory_mib": _memory_mib(self.device),
                          "grad_norm": norm}
                metrics.write(record)
                self.report(record)
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    evals[step] = self.evaluate(model)
                    record = {"kind": "eval", "step": step, "eval_loss": evals[step]}
                    metrics.write(record)
                    self.report(record)
                if cfg.sample_every and (step % cfg.sample_every == 0 or step == last):
                    record = {"kind": "sample", "step": step, "prompt": cfg.sample_prompt,
                              "answer": self.sample(model)}
                    metrics.write(record)
                    self.report(record)
                self.maybe_save(module, optimizer, config, step, last)
            if cfg.save_pretrained and last == cfg.steps:
                self.save_pretrained(module if cfg.pp > 1 else model)
        finally:
            metrics.close()
        elapsed = time.perf_counter() - started
        return {"losses": losses, "first_step": first, "eval_losses": evals,
                "tokens_per_s": len(losses) * tokens_per_step / elapsed if elapsed > 0 else 0.0}

    def step(self, model: Any, step: int) -> float:
        """Forward and backward of the step's micro-batches; the mean loss over all ranks
        (with examples: over the step's response tokens, whichever rank holds them)."""
        cfg = self.cfg
        chunks: list[Any]
        items = None
        if self.examples is not None:
            batch, counted = self.example_batch(step)
            # each micro-step's loss: its tokens' sum over the step's count, times the
            # dp x accumulation micro-steps that the averages below divide by
            items = counted / (cfg.dp * cfg.grad_accum)
            parts = {k: v.chunk(cfg.grad_accum) for k, v in batch.items()}
            chunks = [{k: v[i] for k, v in parts.items()} for i in range(cfg.grad_accum)]
        else:
            chunks = list(self.local_batch(step).chunk(cfg.grad_accum))
        total = torch.zeros((), device=self.device)
        for i, ids in enumerate(chunks):
            with self.no_sync(model, i < len(chunks) - 1), self.autocast():
                loss = _step_loss(model, ids) if items is None else _step_loss(model, ids, items)
            (loss / cfg.grad_accum if cfg.grad_accum > 1 else loss).backward()
            total = total + loss.detach().float()
        assert self.built is not None
        self.built.reduce_gradients()  # the experts of expert parallelism (else nothing)
        return self.dp_mean(total / cfg.grad_accum if cfg.grad_accum > 1 else total)

    def no_sync(self, model: Any, skip: bool) -> Any:
        """Skip the data-parallel gradient reduction of a micro-step that is not the last."""
        assert self.built is not None
        return self.built.no_sync(skip)

    def pipeline_step(self, pipe: Any, step: int) -> float:
        if self.examples is not None:
            batch, counted = self.example_batch(step)
            ids, target = batch["input_ids"], batch["labels"]
            assert self.built is not None
            # each micro-batch's loss: its tokens' sum over its share of the step's count
            self.counted_loss.per_micro = counted / (self.cfg.dp * self.layout.micro_steps)
        else:
            ids = target = self.local_batch(step)
        with self.autocast():
            loss = pipe.step(ids, target=target)
        value = self.from_last_stage(None if loss is None else loss.detach().clone())
        assert self.built is not None
        self.built.reduce_gradients()  # DDP replicas of a pipeline (FSDP2 reduces itself)
        return self.dp_mean(value)

    def sample(self, model: Any) -> str:
        """The model's greedy answer to ``sample_prompt`` (:func:`~torchloom.apps.train_examples.sample_answer`)."""
        assert self.built is not None
        return sample_answer(model, self.built, self.cfg, self.corpus.tokenizer, self.device)

    @torch.no_grad()
    def evaluate(self, model: Any) -> float:
        """The mean loss over the held-out windows (dropout off), over all ranks; with
        examples, over the held-out rows' response tokens."""
        cfg = self.cfg
        if self.corpus.held_out_examples is not None:
            return self.evaluate_examples(model)
        assert self.corpus.held_out is not None
        count = _eval_count(cfg, self.corpus)
        windows = data.eval_windows(self.corpus.held_out, count * cfg.batch_size, cfg.seq_len)
        share = cfg.batch_size // cfg.dp
        model.eval()
        try:
            total = torch.zeros((), device=self.device)
            for b in range(count):
                batch = windows[b * cfg.batch_size:(b + 1) * cfg.batch_size]
                ids = batch[self.dp_rank * share:(self.dp_rank + 1) * share].to(self.device)
                if cfg.pp > 1:
                    total = total + self.pipeline_eval_loss(model, ids)
                    continue
                for chunk in ids.chunk(cfg.grad_accum):
                    with self.autocast():
                        total = total + _step_loss(model, chunk).float() / cfg.grad_accum
        finally:
            model.train()
        return self.dp_mean(total / count)

    def evaluate_examples(self, model: Any) -> float:
        """The held-out rows' loss: the sum over their response tokens (each rank its
        share of every batch) over their count."""
        cfg = self.cfg
        held = self.corpus.held_out_examples
        share = cfg.batch_size // cfg.dp
        lo, hi = self.dp_rank * share, (self.dp_rank + 1) * share
        total = torch.zeros((), device=self.device)
        counted = 0
        model.eval()
        try:
            for b in range(_eval_count(cfg, self.corpus)):
                whole = chat_data.eval_batch(held, b, cfg.batch_size, cfg.seq_len)
                counted += int((whole["labels"][:, 1:] != -100).sum())
                if not cfg.pack:
                    del whole["position_ids"]
                batch = {k: v[lo:hi].to(self.device) for k, v in whole.items()}
                if cfg.pp > 1:
                    total = total + self.from_last_stage(pipeline_loss_sum(model, self.built,
                                                                           batch))
                    continue
                one = torch.ones((), device=self.device)
                for i in range(cfg.grad_accum):
                    part = {k: v.chunk(cfg.grad_accum)[i] for k, v in batch.items()}
                    with self.autocast():
                        total = total + _step_loss(model, part, one).float()
        finally:
            model.train()
        return self.dp_mean(total) * cfg.dp / max(counted, 1)

    def pipeline_eval_loss(self, pipe: Any, ids: torch.Tensor) -> torch.Tensor:
        assert self.built is not None
        logits = pipe(ids)
        return self.from_last_stage(None if logits is None
                                    else self.built.next_token_loss(logits, ids).detach())

    def from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """A scalar the rank of the last stage computed (None elsewhere), on every rank of
        the pipeline: the last stage's pipeline rank is ``pp - 1``, or 0 in
        ZBVZeroBubble's V."""
        out = torch.zeros((), device=self.device) if value is None else value
        assert self.pp_group is not None
        last = dist.get_global_rank(self.pp_group, self.layout.stage_ranks()[-1])
        with guard_collective("broadcast", _PRIMITIVE, self.pp_group):
            dist.broadcast(out, src=last, group=self.pp_group)
        return out


def _zoo_stacks(cfg: TrainConfig, model: nn.Module) -> list[str] | None:
    """A zoo model's stacks of layers as the zoo names them (None: found by
    :func:`~torchloom.core.rules.layer_stacks`)."""
    return zoo.layer_paths(cfg.model) if cfg.model_kind == "zoo" else None


def _step_loss(model: nn.Module, ids: torch.Tensor | dict[str, torch.Tensor],
               items: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of one batch of token windows, or of examples (a dict with
    ``labels``; the loss summed over their response tokens and divided by ``items``)."""
    if isinstance(ids, dict):
        return model(**ids, num_items_in_batch=items, **no_cache_kwargs(model)).loss
    return model(input_ids=ids, labels=ids, **no_cache_kwargs(model)).loss


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
    """The causal-LM loss transformers computes from ``labels``, from whole logits (a
    pipeline's last stage computes the layout's, :attr:`Parallelized.next_token_loss`;
    this is its ``loss="full"``)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), target[:, 1:].reshape(-1))
