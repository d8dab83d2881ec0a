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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import PretrainedError
from ..core.marks import KEY_ORDER, PRETRAINED_INFO, TIED_KEYS, get_mark
from ..core.meta import shard_spec
from .collectives import group_rank, group_size
from .gather import check_spec, gather_shards

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


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class PretrainedInfo:
    """What a Hugging Face folder needs from the original model besides its tensors.

    Attributes:
        config: the model's config object (anything with ``save_pretrained``), or None.
        generation_config: its generation config when the model can generate, else None.
        class_name: the original model class's name (``architectures`` in config.json).
        tied: transformers' declared tied keys, ``{tied key: key it is tied to}``.
    """

    config: Any = None
    generation_config: Any = None
    class_name: str | None = None
    tied: dict[str, str] = field(default_factory=dict)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a ``DistributedDataParallel`` or ``torch.compile`` wrapper."""
    while True:
        inner = getattr(model, "module", None)
        if type(model).__name__ == "DistributedDataParallel" and isinstance(inner, nn.Module):
            model = inner
            continue
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


def _original_class(model: nn.Module) -> type:
    """The user's class of ``model``, under torchloom's traced classes and FSDP2's."""
    import torch.fx as fx

    from ..graph.graph_module import TracedGraphModule

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - FSDP2 ships with torch >= 2.6
        FSDPModule = ()  # type: ignore[assignment,misc]  # noqa: N806
    for cls in type(model).__mro__:
        if (FSDPModule and issubclass(cls, FSDPModule)) or issubclass(cls, TracedGraphModule) \
                or cls is fx.GraphModule:
            continue
        return cls
    return type(model)


def describe_model(model: nn.Module) -> PretrainedInfo:
    """The :class:`PretrainedInfo` of a (scheduled, traced, wrapped) model.

    >>> describe_model(torch.nn.Linear(2, 2)).class_name
    'Linear'
    """
    model = unwrap(model)
    info = get_mark(model, PRETRAINED_INFO)
    if isinstance(info, PretrainedInfo):
        return info
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        config = None
    generation = None
    can_generate = getattr(model, "can_generate", None)
    if config is not None and callable(can_generate):
        try:
            if can_generate():
                generation = getattr(model, "generation_config", None)
        except Exception:  # noqa: BLE001 - a model that cannot tell cannot generate
            generation = None
    tied = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        tied = getattr(model, "_tied_weights_keys", None)
    tied = {str(k): str(v) for k, v in tied.items()} if isinstance(tied, dict) else {}
    return PretrainedInfo(config=config, generation_config=generation,
                          class_name=_original_class(model).__name__, tied=tied)


# --------------------------------------------------------------------------- local entries


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Entry:
    """One tensor of this rank's state dict, under its original key."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    tie: Any
    fetch: Callable[[], torch.Tensor]
    """Collective among the ranks that hold the key: the full tensor."""


def _full(tensor: torch.Tensor, key: str, group: Any, primitive: str) -> torch.Tensor:
    """The full tensor: FSDP2 shards gathered, then tensor-parallel pieces (collectives)."""
    from .collectives import guard_collective

    with torch.no_grad():
        local = tensor.detach()
        if _is_dtensor(local):
            with guard_collective("DTensor.full_tensor", primitive):
                local = local.full_tensor()
        spec = shard_spec(tensor)
        if spec is None or spec.world_size == 1:
            return local
        return gather_shards(key, local, spec, group, primitive)


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(tensor)
    if spec is not None and spec.world_size > 1:
        return tuple(spec.full_shape)
    return tuple(tensor.shape)


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor | None:
    owner_path, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_path) if owner_path else module
    except AttributeError:
        return None
    return owner._parameters.get(attr, owner._buffers.get(attr))


class _Cache:
    """The last fused tensor gathered (its parts are read one after another)."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.value: torch.Tensor | None = None

    def get(self, tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.token != id(tensor):
            self.token, self.value = None, None  # free the previous one first
            self.value, self.token = make(), id(tensor)
        assert self.value is not None
        return self.value


def local_entries(model: nn.Module, group: Any, primitive: str) -> list[_Entry]:
    """This rank's state-dict tensors under their original keys, with full shapes.

    Raises :class:`PretrainedError` for a tensor on the meta device, a non-tensor in the
    state dict, or a sharded parameter that reaches the state dict only through a
    ``state_dict`` hook torchloom cannot map back (its pieces would be written as if full).
    """
    module = unwrap(model)
    state = module.state_dict(keep_vars=True)
    param_ids = {id(p) for p in module.parameters()}
    parts: dict[str, tuple[torch.Tensor, int, int, int, str]] = {}
    for path, sub in module.named_modules():
        declare = getattr(sub, "torchloom_checkpoint_parts", None)
        if not callable(declare):
            continue
        prefix = f"{path}." if path else ""
        for local_name, (names, axis) in declare().items():
            fused = _tensor_at(sub, local_name)
            if fused is None:
                continue
            for i, name in enumerate(names):
                parts[prefix + name] = (fused, int(axis), i, len(names), prefix + local_name)
    cache = _Cache()
    used: set[int] = set()
    entries: list[_Entry] = []
    for key, value in state.items():
        if key in parts:
            fused, axis, index, count, fused_key = parts[key]
            used.add(id(fused))
            full_shape = list(_full_shape(fused))
            if full_shape[axis] % count:
                raise PretrainedError(
                    f"{fused_key!r} (axis {axis} of size {full_shape[axis]}) does not split "
                    f"into the {count} tensors its module declares", primitive=primitive,
                    values={"key": fused_key, "shape": tuple(full_shape), "parts": count},
                    fix="check the module's torchloom_checkpoint_parts()")
            full_shape[axis] //= count
            _validate(fused, fused_key, group, primitive)

            def fetch(fused: torch.Tensor = fused, axis: int = axis, index: int = index,
                      count: int = count, fused_key: str = fused_key) -> torch.Tensor:
                whole = cache.get(fused, lambda: _full(fused, fused_key, group, primitive))
                return whole.chunk(count, dim=axis)[index]

            entries.append(_Entry(key, tuple(full_shape), fused.dtype, id(fused) in param_ids,
                                  (id(fused), index), fetch))
            continue
        if not isinstance(value, torch.Tensor):
            raise PretrainedError(
                f"the state dict holds a {type(value).__name__} under {key!r}; a safetensors "
                "file holds tensors only", primitive=primitive, values={"key": key},
                fix="save that module's extra state separately")
        _validate(value, key, group, primitive)
        used.add(id(value))
        entries.append(_Entry(key, _full_shape(value), value.dtype, id(value) in param_ids,
                              id(value),
                              lambda v=value, k=key: _full(v, k, group, primitive)))
    for name, param in module.named_parameters():
        spec = shard_spec(param)
        if id(param) not in used and ((spec is not None and spec.world_size > 1)
                                      or _is_dtensor(param)):
            raise PretrainedError(
                f"the sharded parameter {name!r} reaches the state dict only through a "
                "state_dict hook, so its gathered value cannot be known",
                primitive=primitive, values={"parameter": name},
                fix="declare how the original model stores it: give its module a method "
                "torchloom_checkpoint_parts() -> {'qkv.weight': (['q.weight', 'k.weight', "
                "'v.weight'], 0)}")
    return entries


def _validate(tensor: torch.Tensor, key: str, group: Any, primitive: str) -> None:
    if tensor.device.type == "meta":
        raise PretrainedError(
            f"{key!r} is on the meta device: the model has no weights yet",
            primitive=primitive, values={"key": key, "shape": tuple(tensor.shape)},
            fix="materialise it first: model, opt = tl.build(sch)")
    spec = shard_spec(tensor)
    if spec is not None and spec.world_size > 1:
        check_spec(key, spec, group, primitive)


# --------------------------------------------------------------------------- the plan


@dataclass
class _Plan:
    order: list[str]
    """Every key of the whole model, in save order (tied keys included)."""
    shape: dict[str, tuple[int, ...]]
    dtype: dict[str, str]
    is_param: dict[str, bool]
    holders: dict[str, list[int]]
    dropped: set[str]
    """Keys not written because they are tied to a written key."""

    def source(self, key: str) -> int:
        return self.holders[key][0]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PretrainedError(f"unknown dtype {name!r}", primitive="save_pretrained",
                              values={"dtype": name}, fix="save tensors of a torch dtype")
    return dtype


def _exchange(payload: Any, primitive: str) -> list[Any]:
    if group_size() == 1:
        return [payload]
    from .collectives import guard_collective

    out: list[Any] = [None] * group_size()
    with guard_collective("all_gather_object", primitive):
        dist.all_gather_object(out, payload)
    return out


def _make_plan(manifests: list[list[tuple]], key_order: list[str] | None,
               tied_groups: list[list[str]], declared: dict[str, str],
               primitive: str) -> _Plan:
    order: list[str] = []
    seen: set[str] = set()
    shape: dict[str, tuple[int, ...]] = {}
    dtype: dict[str, str] = {}
    is_param: dict[str, bool] = {}
    holders: dict[str, list[int]] = {}
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    for rank, rows in enumerate(manifests):
        by_tie: dict[Any, str] = {}
        for key, shp, dt, param, tie in rows:
            if key in shape and (shape[key], dtype[key]) != (tuple(shp), dt):
                raise PretrainedError(
                    f"ranks disagree on {key!r}: rank {holders[key][0]} has {shape[key]} "
                    f"{dtype[key]}, rank {rank} has {tuple(shp)} {dt}",
                    primitive=primitive, values={"key": key},
                    fix="schedule the model the same way on every rank (same recipe)")
            if key not in seen:
                seen.add(key)
                order.append(key)
                parent[key] = key
            shape[key], dtype[key], is_param[key] = tuple(shp), dt, param
            holders.setdefault(key, []).append(rank)
            if tie in by_tie:
                union(by_tie[tie], key)
            else:
                by_tie[tie] = key
    if key_order:
        rank_of = {k: i for i, k in enumerate(key_order)}
        order.sort(key=lambda k: rank_of.get(k, len(rank_of)))
    for names in tied_groups:
        present = [k for k in names if k in parent]
        for k in present[1:]:
            union(present[0], k)
    classes: dict[str, list[str]] = {}
    for key in order:
        classes.setdefault(find(key), []).append(key)
    dropped: set[str] = set()
    for names in classes.values():
        if len(names) < 2:
            continue
        # transformers' rule: drop the declared tied keys, unless all of them are
        found = 0
        for name in sorted(names):
            if name in declared:
                found += 1
                if found < len(names):
                    dropped.add(name)
        rest = [k for k in names if k not in dropped]
        dropped.update(rest[1:])  # undeclared aliases: one copy is enough
    return _Plan(order, shape, dtype, is_param, holders, dropped)


def _plan_for(model: nn.Module, group: Any, primitive: str,
              extra: Any = None) -> tuple[_Plan, dict[str, _Entry], list[Any]]:
    """Exchange the ranks' key lists and make the plan; every rank raises the same error
    if any rank cannot take part. ``extra`` is this rank's additional payload (returned
    for every rank)."""
    error: Exception | None = None
    entries: list[_Entry] = []
    try:
        entries = local_entries(model, group, primitive)
    except PretrainedError as exc:
        error = exc
    rows = [(e.key, e.shape, str(e.dtype), e.is_param, e.tie) for e in entries]
    gathered = _exchange((rows, error, extra), primitive)
    for _, err, _ in gathered:
        if err is not None:
            raise err
    module = unwrap(model)
    info = describe_model(module)
    plan = _make_plan([g[0] for g in gathered], get_mark(module, KEY_ORDER),
                      get_mark(module, TIED_KEYS, []), info.tied, primitive)
    return plan, {e.key: e for e in entries}, [g[2] for g in gathered]


def _fetch(plan: _Plan, local: dict[str, _Entry], key: str, to: int | None) -> torch.Tensor | None:
    """The full tensor of ``key``: on rank ``to`` (None: on every rank); None elsewhere."""
    rank = group_rank()
    value = local[key].fetch() if key in local else None
    src = plan.source(key)
    if group_size() == 1:
        return value
    from .collectives import guard_collective

    if to is None:
        if len(plan.holders[key]) == group_size():  # every rank has it already
            return value
        device = _comm_device()
        if rank == src:
            buf = value.detach().to(device).contiguous()  # type: ignore[union-attr]
        else:
            buf = torch.empty(plan.shape[key], dtype=_dtype(plan.dtype[key]), device=device)
        with guard_collective("broadcast", "full_state_dict"):
            dist.broadcast(buf, src=src)
        return value if value is not None else buf
    if src == to:
        return value if rank == to else None
    if rank == src:
        with guard_collective("send", "save_pretrained"):
            dist.send(value.detach().to(_comm_device()).contiguous(), dst=to)  # type: ignore[union-attr]
        return None
    if rank == to:
        buf = torch.empty(plan.shape[key], dtype=_dtype(plan.dtype[key]), device=_comm_device())
        with guard_collective("recv", "save_pretrained"):
            dist.recv(buf, src=src)
        return buf
    return None


def gather_full_state_dict(model: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """The whole original state dict on every rank, from ranks that each hold part of it
    (a :class:`~torchloom.runtime.pipeline.PipelineModel`): every key gathered over its
    tensor-parallel ``group`` on the ranks that hold it, then broadcast from the first of
    them. Tied keys all appear (equal). A collective of the default process group."""
    plan, local, _ = _plan_for(model, group, "full_state_dict")
    out: dict[str, torch.Tensor] = {}
    for key in plan.order:
        value = _fetch(plan, local, key, None)
        assert value is not None
        out[key] = value
    return out


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
                    max_shard_size: int | str = "5GB", group: Any = None) -> None:
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

