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
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from ..core.errors import NonFiniteLossError, ScheduleError
from ..core.meta import shard_spec
from ..core.outputs import no_cache_kwargs
from ..core.rules import layer_stacks
from ..parallel import Parallelized, checkpoint_group, create_schedule, init_mesh, parallelize
from ..runtime.collectives import guard_collective
from ..runtime.loop import lr_at, train_step
from ..runtime.materialise import init_empty_weights
from ..runtime.model_check import check_config_sizes, check_fits, format_bytes
from ..runtime.rng import get_rng_tracker, set_random_seed
from ..runtime.state import (
    find_checkpoint,
    load_checkpoint,
    save,
    writable_problem,
)
from ..schedules import zoo
from ..tools import usercode
from . import data
from .jobconfig import FLAGS, RUN_FIELDS, TrainConfig, TrainOptionError
from .train_checkpoints import check_run_dir, compare, run_config

__all__ = ["NonFiniteLossError", "RUN_FIELDS", "TrainConfig", "TrainOptionError", "batch_at",
           "check_config", "count_parameters", "layer_lists", "load_data", "lr_at",
           "make_model", "meta_model", "run_config", "train_rank"]

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


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Corpus:
    """The tokens of a run: ``train`` and (with evaluation) ``held_out``."""

    train: torch.Tensor
    held_out: torch.Tensor | None
    tokenizer: str | None
    """The folder whose tokenizer made the tokens (None: bytes)."""
    description: str
    largest: int | None = None
    """The largest token id, when known without reading the tokens again (``--data``)."""


def load_data(cfg: TrainConfig) -> Corpus:
    """The run's tokens (cached per process; see :mod:`torchloom.apps.data`)."""
    folder = cfg.model if cfg.model_kind == "folder" and data.has_tokenizer(cfg.model) else None
    largest = None
    if cfg.data:
        info = data.token_info(tuple(cfg.data), folder)
        tokens, largest, files = info.tokens, info.largest, info.files
        what = f"{files} file{'s' if files != 1 else ''}"
    else:
        folder = None
        tokens = data.load_corpus()
        what = "Python's standard-library source"
    unit = "tokens (the model folder's tokenizer)" if folder else "tokens (bytes)"
    if cfg.eval_every:
        train, held_out = data.split(tokens, cfg.eval_fraction)
        text = (f"{what}: {tokens.numel():,} {unit}, {held_out.numel():,} held out "
                f"for evaluation")
    else:
        train, held_out = tokens, None
        text = f"{what}: {tokens.numel():,} {unit}"
    return Corpus(train, held_out, folder, text, largest)


def _eval_count(cfg: TrainConfig, corpus: Corpus) -> int:
    """Evaluation batches that fit the held-out tokens."""
    assert corpus.held_out is not None
    windows = corpus.held_out.numel() // cfg.seq_len
    return min(cfg.eval_batches, windows // cfg.batch_size)


def _check_data(cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
    if corpus.train.numel() <= cfg.seq_len:
        raise data.DataError(
            f"the training text holds {corpus.train.numel():,} tokens, not more than one "
            f"window of --seq-len {cfg.seq_len}", primitive=_PRIMITIVE,
            values={"data": list(cfg.data), "tokens": corpus.train.numel(),
                    "seq_len": cfg.seq_len},
            fix="add text, or use a shorter --seq-len")
    if corpus.held_out is not None and _eval_count(cfg, corpus) < 1:
        need = cfg.batch_size * cfg.seq_len
        raise data.DataError(
            f"the held-out split holds {corpus.held_out.numel():,} tokens, fewer than one "
            f"evaluation batch of --batch-size {cfg.batch_size} x --seq-len {cfg.seq_len} = "
            f"{need:,}", primitive=_PRIMITIVE,
            values={"eval_fraction": cfg.eval_fraction, "held_out": corpus.held_out.numel()},
            fix="raise --eval-fraction, add text, or lower --batch-size / --seq-len")
    if corpus.largest is not None:  # --data: recorded while the token file was written
        largest = max(corpus.largest, 0)
    else:
        largest = int(corpus.train.max()) if corpus.train.numel() else 0
        if corpus.held_out is not None and corpus.held_out.numel():
            largest = max(largest, int(corpus.held_out.max()))
    if largest >= vocab_size:
        source = "the model folder's tokenizer" if corpus.tokenizer else "bytes"
        raise data.DataError(
            f"the text has token id {largest}, but the model's vocabulary has {vocab_size} "
            f"entries (tokens: {source})", primitive=_PRIMITIVE,
            values={"model": cfg.model, "vocab_size": vocab_size, "largest_token": largest},
            fix="use the tokenizer the model was trained with (in its folder), or a model "
            f"with vocab_size > {largest}")


# --------------------------------------------------------------------------- the model


def _hf_config(cfg: TrainConfig) -> Any:
    """The transformers config of a folder or config-file model."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(cfg.model, local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a user's file
        raise TrainOptionError(
            f"--model {cfg.model!r}: the config does not load: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}", primitive=_PRIMITIVE,
            values={"model": cfg.model},
            fix="pass a folder written by save_pretrained, or a config.json of a "
            "transformers model (model_type set)") from None
    source = os.path.join(cfg.model, "config.json") if cfg.model_kind == "folder" else cfg.model
    check_config_sizes(config, source=source, primitive=_PRIMITIVE)
    return config


def _from_config(cfg: TrainConfig, config: Any) -> nn.Module:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise TrainOptionError(
            f"--model {cfg.model!r}: {type(config).__name__} is not a causal language "
            f"model transformers can build ({str(exc).splitlines()[0]})",
            primitive=_PRIMITIVE, values={"model": cfg.model,
                                          "model_type": getattr(config, "model_type", None)},
            fix="train a causal LM (gpt2, llama, opt, ...): AutoModelForCausalLM must know "
            "its config") from None
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model.train()


def meta_model(cfg: TrainConfig) -> nn.Module:
    """The run's model on ``meta`` (nothing allocated): for checks, sizes and FLOPs."""
    if cfg.model_kind == "code":
        return usercode.load(cfg.model, meta=True, check=False)
    with init_empty_weights():
        if cfg.model_kind == "zoo":
            return zoo.make_model(cfg.model, cfg.size, seed=cfg.seed,
                                  **_positions(cfg.model, cfg.size, cfg.seq_len))
        return _from_config(cfg, _hf_config(cfg))


def make_model(cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, str | None]:
    """The model to schedule, and the weights folder ``build`` reads (None: initialise).

    A zoo model is real (initialised from ``seed``) and on ``device``; a folder or config
    model is on ``meta`` except its buffers, which are moved to ``device``. A folder with
    no weight files (a ``config.json`` only) is initialised at random, as a config file. A
    code model is what its factory makes after ``torch.manual_seed(seed)``, on ``device``
    (parameters it left on ``meta`` are initialised by ``build``)."""
    if cfg.model_kind == "code":
        torch.manual_seed(cfg.seed)
        model = usercode.load(cfg.model, check=False)
        return (model.to(device) if device.type != "cpu" and not any(
            p.is_meta for p in model.parameters()) else model), None
    if cfg.model_kind == "zoo":
        model = zoo.make_model(cfg.model, cfg.size, seed=cfg.seed,
                               **_positions(cfg.model, cfg.size, cfg.seq_len))
        return (model.to(device) if device.type != "cpu" else model), None
    model = meta_model(cfg)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    return model, weights_folder(cfg)


def weights_folder(cfg: TrainConfig) -> str | None:
    """The folder ``build`` reads the weights from: ``--model`` when it is a folder holding
    weight files, else None (random initialisation)."""
    from ..runtime.weights import weight_listing

    if cfg.model_kind == "folder" and weight_listing(cfg.model) is not None:
        return cfg.model
    return None


def weights_source(cfg: TrainConfig) -> str:
    """Where the run's weights come from, for the banner: ``"weights: FOLDER (N tensors)"``
    or ``"random init"`` (a zoo model, a config, a folder without weight files)."""
    if cfg.model_kind == "code":
        return f"made by {cfg.model}, seed {cfg.seed}"
    folder = weights_folder(cfg)
    if folder is None:
        return "random init"
    from ..runtime.weights import open_weights

    with open_weights(folder, _PRIMITIVE) as source:
        count = len(source.files)
    return f"weights: {folder} ({count} tensors)"


def layout_text(cfg: TrainConfig) -> str:
    """How the run spreads a step, for the banner: the degrees and the batch rule.

    >>> layout_text(TrainConfig(tp=2, sequence_parallel=True, dp=2, dp_mode="fsdp",
    ...                         batch_size=8, grad_accum=2))
    'tp2+sp x dp2 (fsdp), 8 sequences a step = 2 ranks x 2 micro-steps x 2'
    >>> layout_text(TrainConfig(pp=2, batch_size=8))
    'pp2 (1F1B, 4 micro-batches), 8 sequences a step'
    """
    parts = []
    if cfg.tp > 1:
        parts.append(f"tp{cfg.tp}{'+sp' if cfg.sequence_parallel else ''}")
    if cfg.pp > 1:
        accum = f" = {cfg.n_microbatches} x {cfg.grad_accum} accumulated" \
            if cfg.grad_accum > 1 else ""
        per_rank = cfg.layout().per_rank
        virtual = f", {per_rank} stages a rank" if per_rank > 1 else ""
        parts.append(f"pp{cfg.pp} ({cfg.pipeline_schedule}, {cfg.n_microbatches * cfg.grad_accum} "
                     f"micro-batches{accum}{virtual})")
    if cfg.dp > 1:
        mode = (f"hsdp: {cfg.dp_replicate} replicas x {cfg.dp // cfg.dp_replicate} shards"
                if cfg.dp_mode == "hsdp" else cfg.dp_mode)
        parts.append(f"dp{cfg.dp} ({mode})")
    text = " x ".join(parts) or "one rank"
    text += f", {cfg.batch_size} sequences a step"
    if cfg.pp == 1 and (cfg.dp > 1 or cfg.grad_accum > 1):
        text += (f" = {_plural_text(cfg.dp, 'rank')} x {_plural_text(cfg.grad_accum, 'micro-step')}"
                 f" x {cfg.micro_batch()}")
    return text


def _plural_text(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def schedule_source(model: nn.Module) -> str:
    """Where the run's schedule comes from, for the banner: a built-in schedule, one derived
    from transformers' tensor-parallel plan, or the automatic checkpoint/compile schedule of
    the model's stacks of layers."""
    model = usercode.inner_module(model)
    try:
        fn = schedules.schedule_for(model)
    except ScheduleError:
        return "no schedule (the model has no stack of layers)"
    if fn is schedules.schedule_hf_plan:
        return f"derived from transformers' tensor-parallel plan of {type(model).__name__}"
    if fn is schedules.schedule_layers:
        return "automatic (checkpoint and compile of the layer stacks)"
    return f"built-in {fn.__name__}"


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` (tied ones once; works on ``meta``)."""
    return sum(p.numel() for p in model.parameters())


def layer_lists(model: nn.Module, name: str | None = None) -> list[str]:
    """The paths of the model's stacks of layers: the zoo's for a zoo ``name``, else
    :func:`~torchloom.core.rules.layer_stacks`.

    >>> layer_lists(zoo.make_model("llama"))
    ['model.layers']
    """
    if name is not None and name in zoo.list_models():
        return zoo.layer_paths(name)
    return layer_stacks(model)


def _has_builtin_schedule(model: nn.Module, knob: str | None = None) -> bool:
    """Whether ``model`` has a schedule (built-in, derived or automatic) that takes
    ``knob`` (any schedule when None); for a user's module wrapped in a
    :class:`~torchloom.tools.usercode.TokenLM`, the schedule of the module itself."""
    try:
        fn = schedules.schedule_for(usercode.inner_module(model))
    except ScheduleError:
        return False
    return knob is None or knob in getattr(fn, "knobs", (knob,))


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
        raise TrainOptionError(
            f"--seq-len {seq_len} is longer than the {limit} positions of {model} ({size}): "
            f"config field {key} = {limit}",
            primitive=_PRIMITIVE,
            values={"model": model, "size": size, "seq_len": seq_len, key: limit},
            fix=f"torchloom train --model {model} --size {size} --seq-len {limit}")
    return {}


def _hf_positions(cfg: TrainConfig, config: Any) -> None:
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and cfg.seq_len > limit:
            raise TrainOptionError(
                f"--seq-len {cfg.seq_len} is longer than the {limit} positions of "
                f"{cfg.model}: config field {key} = {limit}", primitive=_PRIMITIVE,
                values={"model": cfg.model, "seq_len": cfg.seq_len, key: limit},
                fix=f"--seq-len {limit}")


def _text_models() -> list[str]:
    return [m for m in zoo.list_models() if zoo._entry(m, _PRIMITIVE).kind != "image"]


# --------------------------------------------------------------------------- checks up front


def check_config(cfg: TrainConfig) -> None:
    """What can be checked before any rank starts, after the options themselves
    (:class:`TrainConfig` checked those): the model takes tokens and has a config that
    loads with positive sizes and fits this machine's memory for the layout
    (:func:`_check_memory`), the sequence fits its positions, the pipeline splits its layers, the data holds
    enough tokens of the model's vocabulary, the device exists, the outputs may be
    written, and ``--resume`` has something to resume (or a run without it would not
    write over another run's checkpoints). Reads files only; raises a
    :class:`ScheduleError` (exit status 2 on the command line).
    """
    if cfg.model_kind == "zoo" and zoo._entry(cfg.model, _PRIMITIVE).kind == "image":
        supported = _text_models()
        raise TrainOptionError(
            f"torchloom train feeds token windows of text, and {cfg.model} takes images",
            primitive=_PRIMITIVE, values={"model": cfg.model, "supported": supported},
            fix=f"train one of {', '.join(supported)}: torchloom train --model gpt2; train "
            f"{cfg.model} in Python with image batches (zoo.example_inputs({cfg.model!r}, model))")
    config = None
    if cfg.model_kind == "zoo":
        _positions(cfg.model, cfg.size, cfg.seq_len)
    elif cfg.model_kind != "code":
        config = _hf_config(cfg)  # its sizes are positive integers
        _hf_positions(cfg, config)
    _check_device(cfg)
    if config is not None:  # on the meta device: before meta_model, which allocates buffers
        with torch.device("meta"):
            _check_memory(cfg, _from_config(cfg, config))
    model = meta_model(cfg)
    if cfg.model_kind == "code":  # made once: its memory, then one forward without data
        _check_memory(cfg, model)
        usercode.check_contract(model, cfg.model, cfg.seq_len)
    _check_model(cfg, model)
    _check_data(cfg, load_data(cfg), int(model.get_input_embeddings().num_embeddings))
    _check_outputs(cfg)
    if cfg.save_dir:
        check_run_dir(cfg)


def _check_model(cfg: TrainConfig, model: nn.Module) -> None:
    inner = usercode.inner_module(model)
    if cfg.tp > 1 and not _has_builtin_schedule(model, "tp"):
        raise TrainOptionError(
            f"--tp {cfg.tp}: {type(inner).__name__} has no built-in schedule and transformers "
            "declares no tensor-parallel plan for it",
            primitive=_PRIMITIVE, values={"model": cfg.model, "class": type(inner).__name__,
                                          "supported": schedules.supported()},
            fix="train it with --dp (or --pp), or register a schedule: "
            "torchloom.schedules.register_schedule(name, fn)" + (
                f" (in {cfg.model.rpartition(':')[0]}, for class {type(inner).__name__}, "
                "taking the tp knob)" if cfg.model_kind == "code" else ""))
    if cfg.save_pretrained and isinstance(model, usercode.TokenLM):
        raise TrainOptionError(
            f"--save-pretrained {cfg.save_pretrained!r}: {cfg.model} made a "
            f"{type(inner).__name__}, not a transformers model: there is no transformers "
            "folder (config.json and its class) to write", primitive=_PRIMITIVE,
            values={"model": cfg.model, "class": type(inner).__name__},
            fix="keep the trained weights with --save-dir (torchloom.load reads them back "
            "into the module), or return a transformers model from the factory")
    if cfg.pp == 1:
        return
    layers = layer_lists(model, cfg.model)
    if len(layers) != 1:
        raise TrainOptionError(
            f"{cfg.model} has {len(layers)} layer lists; the command line pipelines one",
            primitive=_PRIMITIVE, values={"model": cfg.model, "layers": layers},
            fix="pipeline gpt2, bert or llama, or cut the stages by hand in Python")
    count = len(model.get_submodule(layers[0]))
    if count % cfg.pp:
        raise TrainOptionError(
            f"{count} layers do not split evenly into {cfg.pp} stages",
            primitive=_PRIMITIVE, values={"layers": count, "pp": cfg.pp},
            fix=f"use --pp dividing {count}")


ADAMW_COPIES = 4
"""Copies of the parameters a training rank keeps: the weights, their gradients and
AdamW's two states (all of the parameters' dtype): the steady part of the planner's
per-rank memory, activations left out (so the estimate is a lower bound)."""


def _check_memory(cfg: TrainConfig, model: nn.Module) -> None:
    """The run's parameters, gradients and AdamW states per rank (divided by the layout's
    sharding: tp, pp, and dp under FSDP) fit the memory available now: on --device cpu
    times the ranks on this machine, against ``MemAvailable``; on cuda against the free
    memory of this rank's GPU. Counted on ``model`` made without allocating (a folder or
    config model made entirely on the meta device, a code model's factory run under
    ``init_empty_weights``); a zoo model's sizes are fixed and not checked."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    shards = cfg.tp * cfg.pp * (cfg.dp if cfg.dp_mode == "fsdp" else 1)
    per_rank = ADAMW_COPIES * total // shards
    if cfg.device == "cpu":
        local, device = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or cfg.world, "cpu"
    else:
        local, device = 1, f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}"
    check_fits(per_rank * local, device, primitive=_PRIMITIVE,
               what=f"training {cfg.model} ({format_bytes(total)} of parameters; weights, "
               f"gradients and AdamW states: {format_bytes(per_rank)} per rank, "
               f"{local} rank{'s' if local != 1 else ''} on this device)",
               values={"model": cfg.model, "parameters": count_parameters(model),
                       "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "dp_mode": cfg.dp_mode},
               fix="train a smaller config (hidden size, layers, vocabulary), shard it over "
               "more machines (torchrun --nnodes with --tp / --pp / --dp-mode fsdp), or "
               "estimate a layout first: torchloom plan")


def _check_device(cfg: TrainConfig) -> None:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainOptionError(
            "--device cuda: no CUDA device is available to this torch "
            f"({torch.__version__})", primitive=_PRIMITIVE,
            values={"device": "cuda", "torch": torch.__version__},
            fix="--device cpu (in a TOML file: device = 'cpu')")


def check_launch(cfg: TrainConfig, torchrun: bool) -> None:
    """What the launch mode needs: several CUDA ranks need torchrun (the local launcher
    starts gloo ranks on CPU)."""
    if cfg.device == "cuda" and cfg.world > 1 and not torchrun:
        raise TrainOptionError(
            f"--device cuda with {cfg.world} ranks: the local launcher starts gloo ranks "
            "for CPU; start CUDA ranks with torchrun (NCCL, one GPU per rank)",
            primitive=_PRIMITIVE, values={"device": "cuda", "ranks": cfg.world},
            fix=f"torchrun --nproc-per-node {cfg.world} -m torchloom train --device cuda "
            f"--tp {cfg.tp} --dp {cfg.dp} --pp {cfg.pp} ...")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_outputs(cfg: TrainConfig) -> None:
    for name in ("metrics", "tensorboard", "save_pretrained"):
        value = getattr(cfg, name)
        if value and cfg.save_dir and _inside(value, cfg.save_dir):
            raise TrainOptionError(
                f"{FLAGS[name]} {value!r} is inside --save-dir {cfg.save_dir!r}, which holds "
                "only checkpoints (a save refuses a directory with other files)",
                primitive=_PRIMITIVE, values={name: value, "save_dir": cfg.save_dir},
                fix=f"{FLAGS[name]} {os.path.join(os.path.dirname(os.path.normpath(cfg.save_dir)) or '.', os.path.basename(value))}")
    if cfg.metrics and os.path.isdir(cfg.metrics):
        raise TrainOptionError(
            f"--metrics {cfg.metrics!r} is a folder; metrics are written to a file",
            primitive=_PRIMITIVE, values={"metrics": cfg.metrics},
            fix=f"--metrics {os.path.join(cfg.metrics, 'metrics.jsonl')}")
    if cfg.save_pretrained:
        from ..runtime.pretrained import _path_problem

        problem = _path_problem(os.path.normpath(cfg.save_pretrained))
        if problem is not None:
            raise TrainOptionError(
                f"--save-pretrained {cfg.save_pretrained!r}: {problem.problem}",
                primitive=_PRIMITIVE, values=problem.values,
                fix="--save-pretrained runs/exported (a new or empty folder, or one holding "
                "only a previous save_pretrained output)")
        unwritable = writable_problem(os.path.normpath(cfg.save_pretrained))
        if unwritable is not None:  # a read-only disk fails now, not after the training
            raise TrainOptionError(
                f"--save-pretrained {cfg.save_pretrained!r} cannot be written: {unwritable}",
                primitive=_PRIMITIVE, values={"save_pretrained": cfg.save_pretrained},
                fix="--save-pretrained /scratch/exported (a folder on a writable file system)")


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
            f"--tp {cfg.tp} x --dp {cfg.dp} x --pp {cfg.pp} = {cfg.world} ranks, but the run "
            f"has {world}", primitive=_PRIMITIVE,
            values={"tp": cfg.tp, "dp": cfg.dp, "pp": cfg.pp, "world_size": world},
            fix=f"torchrun --nproc-per-node {cfg.world} -m torchloom train --tp {cfg.tp} "
            f"--dp {cfg.dp} --pp {cfg.pp}")
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
    from torch.utils.flop_counter import FlopCounterMode

    from ..graph.fake import _tensors_on_meta, fake_values, value_mode

    try:
        model = meta_model(cfg)
        ids = torch.zeros(1, cfg.seq_len, dtype=torch.long)
        # fake values: transformers skips its data-dependent checks on them (no .item())
        mode = value_mode(model, ids)
        counter = FlopCounterMode(display=False)
        with _tensors_on_meta(model, True), mode, counter:
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
        self.tp_group = self.dp_group = self.pp_group = self.stage_group = None
        self.tp_rank = self.dp_rank = self.pp_rank = 0
        if self.mesh is not None:
            self.tp_group, self.dp_group, self.pp_group, self.stage_group = (
                self.mesh.group(d) for d in ("tp", "dp", "pp", "stage"))
            self.tp_rank, self.dp_rank, self.pp_rank = (
                self.mesh.local_rank(d) for d in ("tp", "dp", "pp"))
        self.corpus = load_data(cfg)
        self.fsdp = cfg.fsdp
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

    def dp_mean(self, value: torch.Tensor) -> float:
        if self.cfg.dp == 1:
            return float(value)
        total = value.detach().clone().to(self.device)
        with guard_collective("all_reduce", _PRIMITIVE, self.dp_group):
            dist.all_reduce(total, group=self.dp_group)
        return float(total) / self.cfg.dp

    def grad_norm(self, params: list[nn.Parameter], tied: dict[int, int]) -> torch.Tensor:
        """The global L2 norm of the gradients: tensor-parallel shards summed over the tp
        group, FSDP2 shards over the dp group, stages over the pp group; a weight tied
        across ``n`` stages counted once (``tied``: id -> n)."""
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq = grad.detach().double().pow(2).sum() / tied.get(id(p), 1)
            spec = shard_spec(p)
            if spec is not None and spec.world_size > 1:
                sharded += sq
            else:
                replicated += sq
        both = torch.stack([sharded, replicated])
        if self.fsdp:
            with guard_collective("all_reduce", _PRIMITIVE, self.dp_group):
                dist.all_reduce(both, group=self.dp_group)
        if self.cfg.tp > 1:
            with guard_collective("all_reduce", _PRIMITIVE, self.tp_group):
                dist.all_reduce(both[:1], group=self.tp_group)
        total = both.sum()
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
                                   config=config)
        if self.world > 1:
            with guard_collective("barrier", _PRIMITIVE):
                dist.barrier()

    def save_pretrained(self, model: nn.Module) -> None:
        from ..runtime.pretrained import save_pretrained

        save_pretrained(model, self.cfg.save_pretrained, group=self.tp_group)
        if self.rank == 0 and self.corpus.tokenizer:
            data.load_tokenizer(self.corpus.tokenizer).save_pretrained(self.cfg.save_pretrained)

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
        example = loss_fn = None
        if cfg.pp > 1:
            micro = data.window_batch(self.corpus.train, 0, self.layout.micro_batch,
                                      cfg.seq_len, cfg.seed).to(self.device)
            example, loss_fn = {"input_ids": micro}, next_token_loss

        def seed() -> None:
            if cfg.model_kind != "zoo":
                torch.manual_seed(cfg.seed)  # random init of a config model is the seed's

        inner = usercode.inner_module(model)
        built = parallelize(
            sch, self.layout, mesh=self.mesh, device=self.device, weights=weights,
            strict=not cfg.allow_missing, example_inputs=example, loss_fn=loss_fn,
            schedule_at="model" if inner is not model else "",
            stacks=_zoo_stacks(cfg, model), before_build=seed)
        self.built = built
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
                self.maybe_save(module, optimizer, config, step, last)
            if cfg.save_pretrained and last == cfg.steps:
                self.save_pretrained(module if cfg.pp > 1 else model)
        finally:
            metrics.close()
        elapsed = time.perf_counter() - started
        return {"losses": losses, "first_step": first, "eval_losses": evals,
                "tokens_per_s": len(losses) * tokens_per_step / elapsed if elapsed > 0 else 0.0}

    def step(self, model: Any, step: int) -> float:
        """Forward and backward of the step's micro-batches; the mean loss over all ranks."""
        cfg = self.cfg
        chunks = self.local_batch(step).chunk(cfg.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, ids in enumerate(chunks):
            with self.no_sync(model, i < len(chunks) - 1), self.autocast():
                loss = _step_loss(model, ids)
            (loss / cfg.grad_accum if cfg.grad_accum > 1 else loss).backward()
            total = total + loss.detach().float()
        return self.dp_mean(total / cfg.grad_accum if cfg.grad_accum > 1 else total)

    def no_sync(self, model: Any, skip: bool) -> Any:
        """Skip the data-parallel gradient reduction of a micro-step that is not the last."""
        assert self.built is not None
        return self.built.no_sync(skip)

    def pipeline_step(self, pipe: Any, step: int) -> float:
        ids = self.local_batch(step)
        with self.autocast():
            loss = pipe.step(ids, target=ids)
        value = torch.zeros((), device=self.device) if loss is None else loss.detach().clone()
        last = dist.get_global_rank(self.pp_group, self.cfg.pp - 1)
        with guard_collective("broadcast", _PRIMITIVE, self.pp_group):
            dist.broadcast(value, src=last, group=self.pp_group)
        assert self.built is not None
        self.built.reduce_gradients()  # DDP replicas of a pipeline (FSDP2 reduces itself)
        return self.dp_mean(value)

    @torch.no_grad()
    def evaluate(self, model: Any) -> float:
        """The mean loss over the held-out windows (dropout off), over all ranks."""
        cfg = self.cfg
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

    def pipeline_eval_loss(self, pipe: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = pipe(ids)
        value = (next_token_loss(logits, ids).detach() if logits is not None
                 else torch.zeros((), device=self.device))
        last = dist.get_global_rank(self.pp_group, self.cfg.pp - 1)
        with guard_collective("broadcast", _PRIMITIVE, self.pp_group):
            dist.broadcast(value, src=last, group=self.pp_group)
        return value


def _zoo_stacks(cfg: TrainConfig, model: nn.Module) -> list[str] | None:
    """A zoo model's stacks of layers as the zoo names them (None: found by
    :func:`~torchloom.core.rules.layer_stacks`)."""
    return zoo.layer_paths(cfg.model) if cfg.model_kind == "zoo" else None


def _step_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of one batch of token windows."""
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
    """The causal-LM loss transformers computes from ``labels``, on the last stage."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), target[:, 1:].reshape(-1))
