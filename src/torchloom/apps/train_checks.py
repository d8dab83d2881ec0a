"""What ``torchloom train`` checks before any rank starts (:func:`check_config`,
:func:`check_launch`): the model takes tokens and fits the machine for the layout, the
sequence fits its positions, the data hold enough tokens, the device exists, the outputs
may be written, and ``--resume`` has something to resume. Reads files only; raises a
:class:`~torchloom.core.errors.ScheduleError` (exit status 2 on the command line).
"""


from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from .. import schedules
from ..core.errors import LayoutError, ScheduleError
from ..runtime.model_check import check_fits, format_bytes
from ..runtime.state import (
    writable_problem,
)
from ..schedules import zoo
from ..tools import usercode
from .jobconfig import FLAGS, TrainConfig, TrainOptionError
from .train_checkpoints import check_run_dir
from .train_model import (
    _check_data,
    _from_config,
    _has_builtin_schedule,
    _hf_config,
    _hf_positions,
    _positions,
    _text_models,
    count_parameters,
    layer_lists,
    load_data,
    meta_model,
)

__all__ = ["ADAMW_COPIES", "check_config", "check_launch"]

_PRIMITIVE = "torchloom train"


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
    get_embeddings: Callable[[], nn.Module] = getattr(model, "get_input_embeddings")  # noqa: B009
    vocab = int(getattr(get_embeddings(), "num_embeddings"))  # noqa: B009
    _check_data(cfg, load_data(cfg), vocab)
    if cfg.pack:
        _check_pack(cfg, model)
    _check_outputs(cfg)
    if cfg.save_dir:
        check_run_dir(cfg)


def _check_pack(cfg: TrainConfig, model: nn.Module) -> None:
    """Packed examples need attention that keeps them apart, and a layout that passes
    their position ids to every layer."""
    from . import chat_data

    chat_data.check_packing(usercode.inner_module(model))
    if cfg.pp > 1 or cfg.cp > 1:
        raise TrainOptionError(
            f"--pack with --pp {cfg.pp} --cp {cfg.cp}: a pipeline's stages and context "
            "parallelism's split do not carry the packed examples' position ids",
            primitive=_PRIMITIVE, values={"pack": True, "pp": cfg.pp, "cp": cfg.cp},
            fix="leave --pack out (examples padded one a row), or train with --tp / --dp")


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
    if cfg.tp > 1 and cfg.model_kind != "code":
        _check_tp_sizes(cfg)
    if cfg.pp == 1:
        return
    layers = layer_lists(model, cfg.model)
    if len(layers) != 1:
        raise TrainOptionError(
            f"{cfg.model} has {len(layers)} layer lists; the command line pipelines one",
            primitive=_PRIMITIVE, values={"model": cfg.model, "layers": layers},
            fix="pipeline gpt2, bert or llama, or cut the stages by hand in Python")
    count = len(list(model.get_submodule(layers[0]).children()))
    layout = cfg.layout()
    try:
        layout.check_layers(count)  # the rule parallelize applies
    except LayoutError as exc:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        fix = (f"--stage-cuts naming {layout.stages - 1} increasing layers from 0 to "
               f"{count - 2}" if cfg.stage_cuts else
               f"--pp x --stages-per-rank dividing {count}: one of {divisors}; or an uneven "
               "split with --stage-cuts")
        raise TrainOptionError(
            f"--pp {cfg.pp}: {exc.problem}", primitive=_PRIMITIVE,
            values={"layers": count, "pp": cfg.pp, "stages_per_rank": layout.per_rank},
            fix=fix) from None


def _check_tp_sizes(cfg: TrainConfig) -> None:
    """Heads, KV heads and MLP features that ``--tp`` cannot share, before any rank starts
    (the planner's rules, :func:`torchloom.plan.layout.check_model`; the schedule checks
    them again when applied). A config the planner cannot read is left to the schedule."""
    from ..plan.layout import check_model
    from ..plan.spec import model_spec

    try:
        spec = model_spec(cfg.model, cfg.size, cfg.seq_len)
    except Exception:  # noqa: BLE001 - a config the planner does not read: the ranks check
        return
    try:
        check_model(cfg.layout().replace(pp=1, stages_per_rank=None, stage_cuts=None,
                                          n_microbatches=1), spec)
    except ScheduleError as exc:
        raise TrainOptionError(f"--tp {cfg.tp}: {exc.problem}", primitive=_PRIMITIVE,
                               values={"model": cfg.model, **exc.values},
                               fix=f"--{exc.fix}" if (exc.fix or "").startswith("tp ")
                               else exc.fix
                               ) from None
    except (AttributeError, KeyError, TypeError, ValueError):
        return  # a size the config does not name: the schedule checks it in the ranks


ADAMW_COPIES = 4
"""Copies of the parameters a training rank keeps: the weights, their gradients and
AdamW's two states (all of the parameters' dtype): the steady part of the planner's
per-rank memory, activations left out (so the estimate is a lower bound)."""


def _check_memory(cfg: TrainConfig, model: nn.Module) -> None:
    """The run's parameters, gradients and AdamW states per rank (divided by the layout's
    sharding: tp, pp, and dp_shard under FSDP / HSDP) fit the memory available now: on --device cpu
    times the ranks on this machine, against ``MemAvailable``; on cuda against the free
    memory of this rank's GPU. Counted on ``model`` made without allocating (a folder or
    config model made entirely on the meta device, a code model's factory run under
    ``init_empty_weights``); a zoo model's sizes are fixed and not checked."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    layout = cfg.layout()
    shards = layout.tp * layout.pp * layout.dp_shard  # HSDP: shards within a replica
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
    if cfg.float8:  # what the device lacks (TrainConfig refused --float8 off CUDA)
        from ..ops.float8 import FIX, float8_problem

        problem = float8_problem(cfg.device)
        if problem is not None:
            raise TrainOptionError(f"--float8: {problem[0]}", primitive=_PRIMITIVE,
                                   values={"float8": True, **problem[1]},
                                   fix=f"{FIX} (leave --float8 out)")


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


