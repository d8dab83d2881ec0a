"""The whole original state dict, gathered from ranks that each hold part of it, one tensor
at a time.

Each rank lists the tensors of its state dict under their original keys with their full
shapes (:func:`local_entries`: tensor-parallel shards, FSDP2 shards, fused tensors a
module declares as several checkpoint tensors); the ranks exchange these lists and agree
on one plan (:func:`_plan_for`: the save order, which ranks hold each key, which tied keys
are dropped); then each full tensor is fetched to one rank or to all (:func:`_fetch`).
:func:`gather_full_state_dict` gathers everything to every rank (a pipeline model's
``full_state_dict``); :func:`torchloom.save_pretrained` fetches file by file to rank 0.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 3))
>>> [(e.key, e.shape) for e in local_entries(model, None, "save_pretrained")]
[('0.weight', (3, 2)), ('0.bias', (3,))]
>>> list(gather_full_state_dict(model))
['0.weight', '0.bias']
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import PretrainedError
from ..core.marks import KEY_ORDER, TIED_KEYS, get_mark
from ..core.meta import shard_spec
from .collectives import group_rank, group_size
from .gather import check_spec, gather_full, is_dtensor
from .pretrained_info import describe_model, unwrap

__all__ = ["gather_full_state_dict", "local_entries"]


# --------------------------------------------------------------------------- local entries


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
    """The full tensor of a state-dict entry (:func:`~torchloom.runtime.gather.gather_full`
    with its own shard spec; a spec of one rank holds the whole tensor already)."""
    spec = shard_spec(tensor)
    with torch.no_grad():
        return gather_full(key, tensor, spec if spec is not None and spec.world_size > 1
                           else None, group, primitive)


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
                              id(value), functools.partial(_full, value, key, group, primitive)))
    for name, param in module.named_parameters():
        spec = shard_spec(param)
        if id(param) not in used and ((spec is not None and spec.world_size > 1)
                                      or is_dtensor(param)):
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
