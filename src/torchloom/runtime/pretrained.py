"""Pretrained weights out: :func:`save_pretrained` writes a Hugging Face folder from any
layout of a scheduled model.

The folder is what transformers' own save_pretrained writes for the unmodified model
(original keys at full shape, config, generation config, sharded safetensors with an
index), from one process, TP/SP, DDP, FSDP2 or a pipeline. It is collective (every rank
calls it), gathers one tensor at a time, only rank 0 writes, and an existing PATH is
replaced only if it holds nothing but such a folder: the details, with the measured memory
bound, are in docs/design/save_pretrained.md.

>>> import os, tempfile, torch
>>> from safetensors.torch import load_file
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
>>> d = os.path.join(tempfile.mkdtemp(), "out")
>>> save_pretrained(model, d)
>>> sorted(os.listdir(d))
['model.safetensors']
>>> torch.equal(load_file(os.path.join(d, "model.safetensors"))["1.weight"], model[1].weight)
True
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import PretrainedError
from .adapter_files import adapter_keys, merged_plan
from .collectives import group_rank, group_size
from .gather_plan import _dtype, _Entry, _fetch, _Plan, _plan_for, gather_full_state_dict
from .gather_plan import local_entries as local_entries
from .pretrained_info import PretrainedInfo, describe_model
from .pretrained_info import unwrap as unwrap

# Writing a folder is in layers: pretrained_info (the model's config and class) <
# gather_plan (the ranks' tensors, gathered one at a time) < pretrained (the folder).
__all__ = ["save_pretrained", "PretrainedInfo", "describe_model", "gather_full_state_dict",
           "is_output_name"]

SAFE_FILE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PATTERN = "model{suffix}.safetensors"
_FIX_PATH = "pass a new folder: tl.save_pretrained(model, 'runs/exported'), or move the " \
    "other files out of it"


def is_output_name(name: str) -> bool:
    """Whether ``name`` is a file name :func:`save_pretrained` writes.

    >>> is_output_name("model-00002-of-00003.safetensors"), is_output_name("tokenizer.json")
    (True, False)
    """
    return name in (SAFE_FILE, SAFE_INDEX, CONFIG_FILE, GENERATION_FILE) or \
        _SHARD_RE.fullmatch(name) is not None


# --------------------------------------------------------------------------- the folder


def _parse_size(max_shard_size: Any) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
        value = None
    elif isinstance(max_shard_size, int):
        value = max_shard_size
    else:
        try:
            value = parse_size_to_int(max_shard_size)
        except (ValueError, TypeError):
            value = None
    if value is None or value <= 0:
        raise PretrainedError(
            f"max_shard_size must be a positive number of bytes or a size such as '5GB', "
            f"not {max_shard_size!r}", primitive="save_pretrained",
            values={"max_shard_size": max_shard_size},
            fix='tl.save_pretrained(model, path, max_shard_size="5GB")')
    return int(value)


def _path_problem(path: str) -> PretrainedError | None:
    """Why ``path`` must not be written (None if it may: missing, empty, or a folder of
    nothing but this function's output)."""
    values: dict[str, Any] = {"path": path}
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if real == cwd or cwd.startswith(real.rstrip(os.sep) + os.sep) or real == os.sep:
        return PretrainedError(
            "refusing to replace the current directory or one above it",
            primitive="save_pretrained", values={**values, "resolves_to": real}, fix=_FIX_PATH)
    if os.path.islink(path):
        return PretrainedError(
            "the path is a symbolic link; save_pretrained replaces only a real folder",
            primitive="save_pretrained", values={**values, "link_to": os.readlink(path)},
            fix=f"pass the folder itself: tl.save_pretrained(model, {real!r})")
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return PretrainedError(
            "the path is a file, not a folder; save_pretrained does not replace it",
            primitive="save_pretrained", values=values, fix=_FIX_PATH)
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return PretrainedError(f"cannot list the folder: {exc.strerror}",
                               primitive="save_pretrained", values=values, fix=_FIX_PATH)
    others = [e for e in entries if not (is_output_name(e) and
                                         os.path.isfile(os.path.join(path, e)) and
                                         not os.path.islink(os.path.join(path, e)))]
    if others:
        shown = others[:6] + ([f"... {len(others) - 6} more"] if len(others) > 6 else [])
        return PretrainedError(
            "the folder holds files save_pretrained does not write; it replaces only an empty "
            "folder or a previous save_pretrained output", primitive="save_pretrained",
            values={**values, "other_files": shown}, fix=_FIX_PATH)
    return None


def _prepared(value: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its storage (safetensors refuses shared or strided ones)."""
    value = value.detach().to("cpu")
    if (not value.is_contiguous() or value.storage_offset() != 0 or
            value.untyped_storage().nbytes() != value.numel() * value.element_size()):
        value = value.clone(memory_format=torch.contiguous_format)
    return value


def _write_configs(info: PretrainedInfo, folder: str, dtype: torch.dtype | None) -> None:
    if info.config is None:
        return
    config = copy.deepcopy(info.config)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    if info.class_name:
        config.architectures = [info.class_name]
    config.save_pretrained(folder)
    if info.generation_config is not None:
        info.generation_config.save_pretrained(folder)


def _files(plan: _Plan, max_bytes: int) -> tuple[dict[str, list[str]], int]:
    from huggingface_hub import split_state_dict_into_shards_factory

    kept = {k: int(torch.Size(plan.shape[k]).numel()) * _dtype(plan.dtype[k]).itemsize
            for k in plan.order if k not in plan.dropped}
    split = split_state_dict_into_shards_factory(
        kept, get_storage_size=lambda n: n, filename_pattern=_PATTERN,
        max_shard_size=max_bytes)
    return dict(split.filename_to_tensors), int(split.metadata["total_size"])


def _replace(path: str, tmp: str) -> None:
    """Move the finished ``tmp`` to ``path`` (replacing a previous output there)."""
    problem = _path_problem(path)  # checked again: files may have appeared meanwhile
    if problem is not None:
        raise problem
    old = None
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_folder(plan: _Plan, local: dict[str, _Entry], info: PretrainedInfo, path: str,
                  tmp: str, max_bytes: int) -> PretrainedError | None:
    """Gather and write, file by file (every rank runs it; rank 0 writes). Returns the
    error rank 0 met (None elsewhere)."""
    from safetensors.torch import save_file

    writer = group_rank() == 0
    failure: Exception | None = None
    files, total_size = _files(plan, max_bytes)
    sharded = len(files) > 1
    for filename, keys in files.items():
        tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            value = _fetch(plan, local, key, to=0)
            if writer and value is not None:
                tensors[key] = _prepared(value)
            del value
        if writer and failure is None:
            try:
                save_file(tensors, os.path.join(tmp, filename), metadata={"format": "pt"})
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                failure = exc
        tensors.clear()
    if not writer:
        return None
    if failure is not None:
        return _write_error(failure, path)
    try:
        kept = [k for k in plan.order if k not in plan.dropped]
        floating = [_dtype(plan.dtype[k]) for k in kept if plan.is_param[k]
                    and _dtype(plan.dtype[k]).is_floating_point]
        _write_configs(info, tmp, floating[0] if floating else None)
        if sharded:
            total_parameters = sum(torch.Size(plan.shape[k]).numel() for k in kept
                                   if plan.is_param[k])
            index = {"metadata": {"total_parameters": total_parameters,
                                  "total_size": total_size},
                     "weight_map": {k: name for name, keys in files.items() for k in keys}}
            with open(os.path.join(tmp, SAFE_INDEX), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _replace(path, tmp)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        return _write_error(exc, path)
    return None


def _write_error(exc: Exception, path: str) -> PretrainedError:
    if isinstance(exc, PretrainedError):
        return exc
    return PretrainedError(
        f"writing the folder failed on rank 0: {type(exc).__name__}: {exc}"[:500],
        primitive="save_pretrained", values={"path": path},
        fix="fix the cause (disk space, permissions) and save again; the previous folder at "
        "the path, if any, is untouched")


def save_pretrained(model: nn.Module, path: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB", group: Any = None,
                    merge_adapters: bool = False) -> None:
    """Write ``model`` (scheduled, sharded, pipelined or plain) as a Hugging Face folder at
    ``path`` that transformers' ``from_pretrained`` loads into the unmodified model class.

    A collective of the default process group (see the module docstring for what is
    written, the memory bound and the replacement rule).

    Args:
        model: the built model (``tl.build``'s result: a module, a DDP wrapper, an FSDP2
            module or a :class:`~torchloom.runtime.pipeline.PipelineModel`).
        path: the output folder (made, or replaced if it holds only a previous output).
        max_shard_size: the largest safetensors file, in bytes or as ``"5GB"``,
            ``"500MB"``...: the same split as transformers'; it also bounds what rank 0
            holds at once.
        group: the tensor-parallel group the model was scheduled with (``sch.group``;
            None: the default group).
        merge_adapters: a model with LoRA adapters (the ``lora`` primitive) is written
            merged: each adapted weight ``W + alpha / r * B @ A`` under its original key
            (:func:`~torchloom.runtime.adapter_files.merged_plan`). Without it such a
            model is refused (``torchloom.save_adapter`` writes the adapters alone).

    Raises:
        PretrainedError: on every rank, for a path it must not replace, a bad
            ``max_shard_size``, a model without weights (meta tensors), ranks that disagree
            on a tensor's shape, or a write that failed on rank 0 (the previous folder at
            ``path``, if any, is then untouched).
    """
    primitive = "save_pretrained"
    if not isinstance(model, nn.Module):
        raise PretrainedError(
            f"save_pretrained takes the built model, not a {type(model).__name__}",
            primitive=primitive, values={"model": type(model).__name__},
            fix="model, opt = tl.build(sch); tl.save_pretrained(model, path)")
    max_bytes = _parse_size(max_shard_size)
    path = os.path.normpath(os.fspath(path))
    tmp = None
    verdict: PretrainedError | None = None
    if group_rank() == 0:
        verdict = _path_problem(path)
        if verdict is None:
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                os.makedirs(tmp)
            except OSError as exc:
                verdict = PretrainedError(
                    f"cannot create {tmp!r}: {exc.strerror}", primitive=primitive,
                    values={"path": path}, fix="fix the parent folder's permissions, or " +
                    _FIX_PATH)
    try:
        plan, local, extras = _plan_for(model, group, primitive, extra=verdict)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if extras[0] is not None:
        raise extras[0]
    if adapter_keys(plan):
        if not merge_adapters:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise PretrainedError(
                f"the model has LoRA adapters ({len(adapter_keys(plan))} layers): a Hugging "
                "Face folder of the model class has no place for them", primitive=primitive,
                values={"path": path, "adapted_layers": sorted(adapter_keys(plan))[:3]},
                fix="write the adapters: torchloom.save_adapter(model, path), or the merged "
                "model: torchloom.save_pretrained(model, path, merge_adapters=True)")
        plan, local = merged_plan(plan, local, model)
    info = describe_model(model)
    failure = _write_folder(plan, local, info, path, tmp or "", max_bytes)
    if group_size() > 1:
        from .collectives import guard_collective

        box: list[Any] = [failure]
        with guard_collective("broadcast_object_list", primitive):
            dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure
