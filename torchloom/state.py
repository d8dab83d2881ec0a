"""State dicts and checkpoints of scheduled (tensor-parallel) models.

* :func:`full_state_dict` gathers every sharded tensor back to the original model's keys,
  key order and full shapes, so the result loads with ``load_state_dict(strict=True)``
  into a fresh copy of the unscheduled model.
* :func:`save` / :func:`load` write and read checkpoints with
  ``torch.distributed.checkpoint`` (DCP). The checkpoint holds *full-shape logical
  tensors*: a checkpoint written at tensor-parallel degree 2 loads at 1, 2 or 4.
* :func:`init_distributed` starts a process group with a short timeout, so a rank that
  dies or hangs makes the others fail with a :class:`CollectiveTimeoutError` instead of
  waiting for gloo's default 30 minutes.

Design of the checkpoint (why ShardedTensor, and what it costs):
    A sharded tensor is handed to DCP as a
    ``torch.distributed._shard.sharded_tensor.ShardedTensor`` whose global size is the
    full shape and whose local shards are this rank's pieces, placed at their offsets in
    the full tensor. DTensor's ``Shard(axis)`` placement cannot describe a ``chunks=k``
    layout (a fused q/k/v weight, where rank r holds ``[q_r | k_r | v_r]``, ``k``
    disjoint pieces), while a ShardedTensor may hold several local shards per rank, one
    per block. DCP records every piece as a chunk of one logical full-shape tensor and,
    on load, reads whatever region the new layout asks for (any world size whose
    ``chunks * world_size`` divides the axis). Unsharded tensors are passed as plain
    tensors; DCP writes one copy of each (its plans deduplicate replicas across ranks).

    Memory: saving writes each rank's own shards straight from its tensors, no rank ever
    holds a full tensor; only ``chunks > 1`` tensors (and non-contiguous ones) are copied
    into contiguous pieces first (one extra local copy of those tensors). Loading reads
    into the parameters in place where the local tensor is contiguous and ``chunks == 1``;
    other parameters and all optimizer state are read into new local-sized buffers and then
    copied (one extra local copy of them, freed after ``load``). Optimizer state of a
    sharded parameter has the parameter's shard layout; scalar state (AdamW ``step``) is
    replicated.

    Non-tensor data (the training step, optimizer hyperparameters, non-tensor optimizer
    state) goes in ``torchloom.pt``, written by rank 0 after DCP finished: its presence
    marks a complete checkpoint.

Atomicity: :func:`save` writes into ``path + ".tmp-<id>"`` and renames it to ``path``
only after every rank finished writing (a barrier). A crash leaves the previous
checkpoint at ``path`` untouched and a ``.tmp-<id>`` directory behind (safe to delete);
:func:`load` rejects a directory without the marker. All ranks must see the same file
system (one machine, or a shared file system).

>>> import torch, tempfile, os
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> model(torch.ones(1, 4)).sum().backward(); opt.step()
>>> d = tempfile.mkdtemp()
>>> save(model, opt, os.path.join(d, "ckpt"), step=7)
>>> fresh = torch.nn.Linear(4, 2)
>>> fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
>>> load(fresh, fresh_opt, os.path.join(d, "ckpt"))
7
>>> torch.equal(fresh.weight, model.weight), fresh_opt.param_groups[0]["lr"]
(True, 0.1)
>>> shutil.rmtree(d)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import ScheduleError
from .meta import ShardSpec, shard_spec

__all__ = [
    "CheckpointIOError",
    "CheckpointMismatchError",
    "CollectiveTimeoutError",
    "full_optimizer_state_dict",
    "full_state_dict",
    "guard_collective",
    "init_distributed",
    "load",
    "save",
]

MARKER = "torchloom.pt"
FORMAT = 1
_MODEL = "model."
_OPTIM = "optim."


class CheckpointIOError(ScheduleError):
    """A checkpoint directory is missing, incomplete (an interrupted save) or unreadable."""


class CheckpointMismatchError(ScheduleError):
    """A checkpoint does not fit this model / optimizer / world size."""


class CollectiveTimeoutError(ScheduleError):
    """A collective failed or timed out: another rank died, hung, or skipped it."""


# --------------------------------------------------------------------------- process groups

def _group_timeout(group: Any) -> float | None:
    """The timeout of ``group`` in seconds, if the backend tells it."""
    try:
        pg = group if group is not None else dist.group.WORLD
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except RuntimeError:
                continue
            return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError):  # private API; say less then
        return None
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's notices that do not concern the user: the deprecation of ShardedTensor
    (used on purpose, see the module docstring) and 'saving in a single process'."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _rank(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def init_distributed(backend: str = "gloo", timeout_s: float = 60.0, *,
                     init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None) -> tuple[int, int]:
    """Start the default process group with a short timeout; returns ``(rank, world_size)``.

    A collective that a dead or hung rank never joins then fails after ``timeout_s``
    seconds (gloo's default is 30 minutes); torchloom's state functions wrap such
    failures in :class:`CollectiveTimeoutError` (see :func:`guard_collective`). Without
    ``init_method`` the ``env://`` variables of ``torchrun`` are used. It raises if a
    default group already exists (its timeout could not be applied).

    >>> init_distributed(init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout_s=5)
    (0, 1)
    >>> dist.destroy_process_group()
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise ScheduleError(
            f"timeout_s must be a positive number of seconds, not {timeout_s!r}",
            primitive="init_distributed", values={"timeout_s": timeout_s},
            fix="init_distributed(timeout_s=60)")
    if dist.is_initialized():
        raise ScheduleError(
            "the default process group is already initialised; its timeout cannot be set now",
            primitive="init_distributed",
            values={"timeout_s": timeout_s, "world_size": dist.get_world_size()},
            fix="call init_distributed(...) instead of the first init_process_group(...), or "
            "pass timeout=datetime.timedelta(seconds=...) to that call")
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def guard_collective(name: str, primitive: str, group: Any = None) -> Iterator[None]:
    """Turn a failed or timed-out collective inside the block into a
    :class:`CollectiveTimeoutError` naming the collective, the timeout and the fix.

    >>> with guard_collective("all_gather", "full_state_dict"):
    ...     pass
    """
    start = time.monotonic()
    try:
        yield
    except ScheduleError:
        raise
    except RuntimeError as exc:  # gloo/NCCL report a dead or late peer as RuntimeError
        if not (dist.is_available() and dist.is_initialized()):
            raise
        waited = time.monotonic() - start
        timeout_s = _group_timeout(group)
        timeout = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
        raise CollectiveTimeoutError(
            f"collective {name} failed after {waited:.1f} s (timeout {timeout}): another "
            "rank died, hung, or did not call it",
            primitive=primitive,
            values={"collective": name, "timeout_s": timeout_s, "rank": dist.get_rank(),
                    "waited_s": round(waited, 1), "error": str(exc).splitlines()[0][:300]},
            fix=f"call {primitive}(...) on every rank of the group, in the same order; look "
            "for an error in the other ranks' logs; start the group with "
            "torchloom.state.init_distributed(timeout_s=...) to fail faster",
        ) from exc


# --------------------------------------------------------------------------- full state dict


def _check_spec(key: str, spec: ShardSpec, group: Any, primitive: str) -> None:
    size, rank = _size(group), _rank(group)
    if spec.world_size != size or spec.rank != rank:
        raise CheckpointMismatchError(
            f"{key!r} was sharded for rank {spec.rank} of {spec.world_size}, but this is "
            f"rank {rank} of a group of {size}",
            primitive=primitive,
            values={"key": key, "spec_world_size": spec.world_size, "spec_rank": spec.rank,
                    "group_size": size, "group_rank": rank},
            fix="call it on every rank of the group the model was scheduled with: "
            f"{primitive}(model, ..., group=sch.group)",
        )
    full = spec.full_shape[spec.axis]
    if full % (spec.world_size * spec.chunks) != 0:
        raise CheckpointMismatchError(
            f"axis {spec.axis} of {key!r} (size {full}) does not split into {spec.chunks} "
            f"block(s) of {spec.world_size} equal pieces",
            primitive=primitive,
            values={"key": key, "full_shape": spec.full_shape, "axis": spec.axis,
                    "chunks": spec.chunks, "world_size": spec.world_size},
            fix=f"use a world size that divides {full // spec.chunks}",
        )


def _gather(key: str, tensor: torch.Tensor, spec: ShardSpec, group: Any,
            primitive: str) -> torch.Tensor:
    _check_spec(key, spec, group, primitive)
    local = tensor.detach()
    if spec.world_size == 1:
        return spec.gather([local])
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(spec.world_size)]
    with guard_collective("all_gather", primitive, group):
        dist.all_gather(parts, local, group=group)
    return spec.gather(parts)


def full_state_dict(model: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """The state dict of the original (unscheduled) model: every sharded tensor gathered to
    its full shape under the original key, in the original key order.

    A collective: every rank of ``group`` calls it and gets the whole result. Unsharded
    tensors are returned detached, as ``state_dict()`` returns them; tied weights appear
    under each of their keys (gathered once). The result loads with
    ``load_state_dict(strict=True)`` into a fresh copy of the original model. The keys are
    those of the scheduled model's ``state_dict()``, which are the original's as long as
    every ``replace`` keeps the parameter names (a module swapped for one with other
    parameter names changes them). Cost: one ``all_gather`` per sharded tensor; every rank
    ends up holding the full model.

    >>> import torch, torchloom as tl
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    >>> sch = tl.create_schedule(model)
    >>> sch["0"].shard("weight", 0)
    >>> sd = full_state_dict(model)
    >>> list(sd), tuple(sd["0.weight"].shape)
    (['0.weight', '0.bias'], (6, 4))
    """
    out: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        spec = shard_spec(tensor)
        if spec is None:
            out[key] = tensor.detach()
            continue
        if id(tensor) not in gathered:
            gathered[id(tensor)] = _gather(key, tensor, spec, group, "full_state_dict")
        out[key] = gathered[id(tensor)]
    return out


def _param_names(model: nn.Module) -> dict[int, str]:
    """The first name of every parameter (tied parameters once)."""
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer,
                      primitive: str) -> list[list[tuple[str, torch.Tensor]]]:
    names = _param_names(model)
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        entries = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointMismatchError(
                    f"param_groups[{g}] of the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model",
                    primitive=primitive,
                    values={"group": g, "shape": tuple(p.shape)},
                    fix="make the optimizer from this model's parameters after build: "
                    "model, optimizer = tl.build(sch, optimizer=lambda ps: AdamW(ps))",
                )
            entries.append((names[id(p)], p))
        groups.append(entries)
    return groups


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              group: Any = None) -> dict[str, dict[str, Any]]:
    """The optimizer state by parameter name, with the state of sharded parameters gathered
    to full shape (a collective, like :func:`full_state_dict`).

    >>> import torch
    >>> m = torch.nn.Linear(2, 1, bias=False)
    >>> opt = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.5)
    >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> full_optimizer_state_dict(m, opt)["weight"]["momentum_buffer"].tolist()
    [[1.0, 1.0]]
    """
    out: dict[str, dict[str, Any]] = {}
    for entries in _optimizer_params(model, optimizer, "full_optimizer_state_dict"):
        for name, p in entries:
            spec = shard_spec(p)
            state = {}
            for key, value in optimizer.state.get(p, {}).items():
                if spec is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value = _gather(f"{name}.{key}", value, spec, group,
                                    "full_optimizer_state_dict")
                state[key] = value
            out[name] = state
    return out


# --------------------------------------------------------------------------- DCP helpers


def _pieces(spec: ShardSpec) -> list[tuple[int, int, int]]:
    """(rank, block, offset along the axis) of every piece of the full tensor."""
    block = spec.full_shape[spec.axis] // spec.chunks
    piece = block // spec.world_size
    return [(r, c, c * block + r * piece) for r in range(spec.world_size)
            for c in range(spec.chunks)]


def _sharded(local: torch.Tensor, spec: ShardSpec, group: Any) -> Any:
    """A ShardedTensor of full shape whose local shards are this rank's pieces of ``local``
    (views of it where contiguous, else contiguous copies)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    piece = spec.local_shape()[spec.axis] // spec.chunks
    sizes = list(spec.full_shape)
    sizes[spec.axis] = piece
    device = local.device
    metas, shards = [], []
    for r, c, offset in _pieces(spec):
        offsets = [0] * len(sizes)
        offsets[spec.axis] = offset
        global_rank = r if group is None else dist.get_global_rank(group, r)
        meta = ShardMetadata(shard_offsets=offsets, shard_sizes=list(sizes),
                             placement=f"rank:{global_rank}/{device}")
        metas.append(meta)
        if r == spec.rank:
            view = local.detach().narrow(spec.axis, c * piece, piece)
            if not view.is_contiguous():
                view = view.clone(memory_format=torch.contiguous_format)
            shards.append(Shard(tensor=view, metadata=meta))
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    global_md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(spec.full_shape),
                                      tensor_properties=props)
    with _quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, global_md, process_group=group)


def _copy_back(target: Any, local: torch.Tensor, spec: ShardSpec) -> None:
    """Copy the loaded pieces of a ShardedTensor ``target`` into ``local`` (a no-op for
    pieces that are views of it)."""
    piece = spec.local_shape()[spec.axis] // spec.chunks
    with torch.no_grad():
        for c, shard in enumerate(target.local_shards()):
            dst = local.narrow(spec.axis, c * piece, piece)
            if dst.data_ptr() != shard.tensor.data_ptr():
                dst.copy_(shard.tensor)


def _to_save(tensor: torch.Tensor, key: str, group: Any, primitive: str) -> Any:
    spec = shard_spec(tensor)
    if spec is None or spec.world_size == 1:
        if spec is not None:
            _check_spec(key, spec, group, primitive)
        return tensor.detach()
    _check_spec(key, spec, group, primitive)
    return _sharded(tensor, spec, group)


def _state_spec(p: torch.Tensor, value: Any) -> ShardSpec | None:
    spec = shard_spec(p)
    if spec is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
        return spec
    return None


# --------------------------------------------------------------------------- save


@contextlib.contextmanager
def _dcp_errors(primitive: str, path: str, tmp: str | None) -> Iterator[None]:
    """DCP reports a failure on any rank as a ``CheckpointException`` (a BaseException);
    turn it into a :class:`CheckpointIOError` naming the ranks and the first cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = exc.failures
        first = next(iter(failures.values()), None)
        cause = first[0] if isinstance(first, tuple) else first
        values: dict[str, Any] = {"path": path, "failed_ranks": sorted(failures),
                                  "error": f"{type(cause).__name__}: {cause}"[:300]}
        if tmp is not None:
            values["partial"] = tmp
            fix = (f"fix the cause and save again; the previous checkpoint at {path!r} (if "
                   f"any) is intact; delete the partial directory: shutil.rmtree({tmp!r})")
        else:
            fix = "check the files of the checkpoint (permissions, truncation); load an earlier one"
        raise CheckpointIOError(
            f"torch.distributed.checkpoint.{primitive} failed on rank(s) {sorted(failures)}",
            primitive=primitive, values=values, fix=fix) from cause


def _write_marker(directory: str, marker: dict[str, Any]) -> None:
    tmp = os.path.join(directory, MARKER + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MARKER))


def _broadcast_id(group: Any) -> str:
    token = [uuid.uuid4().hex[:12]]
    if _size(group) > 1:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with guard_collective("broadcast_object_list", "save", group):
            dist.broadcast_object_list(token, src=src, group=group)
    return token[0]


def _barrier(group: Any, primitive: str) -> None:
    if _size(group) > 1:
        with guard_collective("barrier", primitive, group):
            dist.barrier(group=group)


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
         step: int, *, group: Any = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``, if given) and ``step`` to the
    directory ``path``, atomically, with full-shape logical tensors.

    A collective: every rank of ``group`` (the tensor-parallel group the model was
    scheduled with) calls it with the same ``path``. An existing checkpoint at ``path`` is
    replaced only after the new one is complete.
    """
    import torch.distributed.checkpoint as dcp

    path = os.path.normpath(os.fspath(path))
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointIOError(
            f"step must be an int, not {step!r}", primitive="save",
            values={"step": step}, fix="save(model, optimizer, path, step=int(step))")
    state: dict[str, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        state[_MODEL + key] = _to_save(tensor, key, group, "save")
    groups_md: list[dict[str, Any]] = []
    other_state: dict[str, dict[str, Any]] = {}
    tensor_state: dict[str, list[str]] = {}
    if optimizer is not None:
        params = _optimizer_params(model, optimizer, "save")
        for group_entries, pg in zip(params, optimizer.param_groups, strict=True):
            hyper = {k: v for k, v in pg.items() if k != "params"}
            hyper["params"] = [name for name, _ in group_entries]
            groups_md.append(hyper)
            for name, p in group_entries:
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        spec = _state_spec(p, value)
                        full_key = f"{_OPTIM}state.{name}.{key}"
                        if spec is not None and spec.world_size > 1:
                            state[full_key] = _sharded(value, spec, group)
                        else:
                            state[full_key] = value.detach()
                        tensor_state.setdefault(name, []).append(key)
                    else:
                        other_state.setdefault(name, {})[key] = value
    marker = {
        "format": FORMAT, "step": step, "world_size": _size(group),
        "model_keys": list(model.state_dict().keys()), "has_optimizer": optimizer is not None,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "param_groups": groups_md, "tensor_state": tensor_state, "other_state": other_state,
    }
    tmp = f"{path}.tmp-{_broadcast_id(group)}"
    rank = _rank(group)
    with _dcp_errors("save", path, tmp), \
            guard_collective("torch.distributed.checkpoint.save", "save", group), _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group,
                 no_dist=not dist.is_initialized())
    if rank == 0:
        _write_marker(tmp, marker)
    _barrier(group, "save")
    if rank == 0:
        old = None
        if os.path.lexists(path):
            old = f"{path}.old-{os.path.basename(tmp).rsplit('-', 1)[1]}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    _barrier(group, "save")


# --------------------------------------------------------------------------- load


def _read_marker(path: str) -> dict[str, Any]:
    fix_missing = ("pass the directory given to torchloom.state.save(model, optimizer, path, "
                   "step)")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path))
        base = os.path.basename(path)
        leftovers = sorted(p for p in (os.listdir(parent) if os.path.isdir(parent) else [])
                           if p.startswith((base + ".tmp-", base + ".old-")))
        values: dict[str, Any] = {"path": path}
        fix = fix_missing
        if leftovers:
            values["interrupted_saves"] = leftovers
            complete = [p for p in leftovers if os.path.isfile(os.path.join(parent, p, MARKER))]
            if complete:  # a crash between save's two renames
                fix = (f"a complete checkpoint was left at {complete[-1]!r} by an interrupted "
                       f"save; move it into place: os.rename({os.path.join(parent, complete[-1])!r}"
                       f", {path!r})")
        raise CheckpointIOError(
            "no checkpoint at this path" + (" (only interrupted saves)" if leftovers else ""),
            primitive="load", values=values, fix=fix)
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointIOError(
            f"incomplete checkpoint: {MARKER!r} or '.metadata' is missing (a save was "
            "interrupted before it finished)",
            primitive="load",
            values={"path": path, "files": sorted(os.listdir(path))[:8]},
            fix="load the previous complete checkpoint (save renames a finished checkpoint "
            "into place), and delete this directory: shutil.rmtree(path)")
    try:
        marker = torch.load(marker_path, weights_only=True)
    except Exception as exc:  # any unreadable marker is the same problem
        raise CheckpointIOError(
            f"cannot read {MARKER!r}: {exc}", primitive="load", values={"path": path},
            fix="the checkpoint is damaged; load an earlier one") from exc
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointIOError(
            f"{MARKER!r} is not a torchloom checkpoint marker of format {FORMAT}",
            primitive="load",
            values={"path": path,
                    "format": marker.get("format") if isinstance(marker, dict) else None},
            fix="write the checkpoint with torchloom.state.save")
    return marker


def _expected_full(tensor: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(tensor)
    return tuple(spec.full_shape) if spec is not None else tuple(tensor.shape)


def _mismatch(problem: str, values: dict[str, Any], fix: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(problem, primitive="load", values=values, fix=fix)


def _shorten(items: list[Any], n: int = 6) -> list[Any]:
    return items if len(items) <= n else items[:n] + [f"... {len(items) - n} more"]


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
         *, group: Any = None) -> int:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``) in
    their current layout, whatever the world size at save time; returns the saved step.

    A collective: every rank of ``group`` calls it. The model must have the checkpoint's
    keys and full shapes; the optimizer must be over the same parameters, in the same
    groups. Raises :class:`CheckpointIOError` for a missing or incomplete checkpoint and
    :class:`CheckpointMismatchError` for one that does not fit.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.normpath(os.fspath(path))
    marker = _read_marker(path)
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointIOError(
            f"cannot read the DCP metadata: {exc}", primitive="load", values={"path": path},
            fix="the checkpoint is damaged; load an earlier one") from exc

    def saved_shape(key: str) -> tuple[int, ...] | None:
        md = metadata.get(key)
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    model_state = model.state_dict(keep_vars=True)
    saved_keys = [k[len(_MODEL):] for k in metadata if k.startswith(_MODEL)]
    missing = [k for k in model_state if _MODEL + k not in metadata]
    unexpected = [k for k in saved_keys if k not in model_state]
    if missing or unexpected:
        raise _mismatch(
            "the checkpoint holds another model: its keys differ from the model's",
            {"path": path, "missing_keys": _shorten(missing),
             "unexpected_keys": _shorten(unexpected)},
            "load it into the model it was saved from (same architecture and config), or "
            "load it into that model and copy the matching tensors over")
    wrong = [(k, saved_shape(_MODEL + k), _expected_full(t)) for k, t in model_state.items()
             if saved_shape(_MODEL + k) != _expected_full(t)]
    if wrong:
        raise _mismatch(
            "full shapes differ between the checkpoint and the model",
            {"path": path, "shapes (key, checkpoint, model)": _shorten(wrong)},
            "load into a model with the saved configuration (check hidden sizes, vocab size, "
            "number of heads)")

    targets: dict[str, Any] = {}
    copies: list[tuple[Any, torch.Tensor, ShardSpec | None]] = []
    for key, tensor in model_state.items():
        spec = shard_spec(tensor)
        if spec is not None:
            _check_spec(key, spec, group, "load")
        if spec is None or spec.world_size == 1:
            local = tensor.detach()
            target = local if local.is_contiguous() else torch.empty_like(
                local, memory_format=torch.contiguous_format)
        else:
            target = _sharded(tensor, spec, group)
        targets[_MODEL + key] = target
        copies.append((target, tensor, spec if spec is not None and spec.world_size > 1 else None))

    optim_loads: list[tuple[int, str, str, Any, torch.Tensor | None, ShardSpec | None]] = []
    if optimizer is not None:
        if not marker.get("has_optimizer"):
            raise _mismatch(
                "the checkpoint holds no optimizer state", {"path": path},
                "load(model, None, path), or save with the optimizer: "
                "save(model, optimizer, path, step)")
        params = _optimizer_params(model, optimizer, "load")
        saved_groups = marker["param_groups"]
        now = [[name for name, _ in entries] for entries in params]
        then = [list(g["params"]) for g in saved_groups]
        if now != then:
            raise _mismatch(
                "the optimizer's parameter groups differ from the checkpoint's",
                {"path": path, "optimizer_groups": [_shorten(g, 3) for g in now],
                 "checkpoint_groups": [_shorten(g, 3) for g in then]},
                "make the optimizer with the same parameter groups, in the same order, as "
                "the one that was saved")
        if marker.get("optimizer_class") != type(optimizer).__name__:
            raise _mismatch(
                "the checkpoint holds the state of another optimizer class",
                {"path": path, "checkpoint": marker.get("optimizer_class"),
                 "optimizer": type(optimizer).__name__},
                f"load it into a {marker.get('optimizer_class')} optimizer")
        index = 0
        for entries in params:
            for name, p in entries:
                for key in marker["tensor_state"].get(name, []):
                    full_key = f"{_OPTIM}state.{name}.{key}"
                    md = metadata.get(full_key)
                    if not isinstance(md, TensorStorageMetadata):
                        raise CheckpointIOError(
                            f"optimizer state {full_key!r} is listed but not stored",
                            primitive="load", values={"path": path, "key": full_key},
                            fix="the checkpoint is damaged; load an earlier one")
                    spec = shard_spec(p)
                    dtype = md.properties.dtype
                    if (spec is not None and spec.world_size > 1
                            and tuple(md.size) == spec.full_shape):
                        local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                        target = _sharded(local, spec, group)
                        optim_loads.append((index, name, key, target, local, spec))
                    else:
                        device = p.device if len(md.size) else "cpu"
                        target = torch.zeros(tuple(md.size), dtype=dtype, device=device)
                        optim_loads.append((index, name, key, target, None, None))
                    targets[full_key] = target
                index += 1

    with _dcp_errors("load", path, None), \
            guard_collective("torch.distributed.checkpoint.load", "load", group), _quiet():
        dcp.load(targets, storage_reader=reader, process_group=group,
                 no_dist=not dist.is_initialized())

    with torch.no_grad():
        for target, tensor, spec in copies:
            if spec is not None:
                _copy_back(target, tensor, spec)
            elif target.data_ptr() != tensor.data_ptr():
                tensor.copy_(target)

    if optimizer is not None:
        state: dict[int, dict[str, Any]] = {}
        for index, _name, key, target, local, spec in optim_loads:
            if spec is not None and local is not None:
                _copy_back(target, local, spec)
                value = local
            else:
                value = target
            state.setdefault(index, {})[key] = value
        index = 0
        for entries in _optimizer_params(model, optimizer, "load"):
            for name, _ in entries:
                for key, value in marker["other_state"].get(name, {}).items():
                    state.setdefault(index, {})[key] = value
                index += 1
        groups = []
        start = 0
        for saved in marker["param_groups"]:
            group_sd = dict(saved)
            n = len(saved["params"])
            group_sd["params"] = list(range(start, start + n))
            start += n
            groups.append(group_sd)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return int(marker["step"])
