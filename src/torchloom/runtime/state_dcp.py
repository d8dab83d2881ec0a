"""What DCP reads and writes (part of :mod:`torchloom.runtime.state`): every tensor as this
rank's *pieces* of one logical tensor of the full shape, the planners that hand them to
``torch.distributed.checkpoint``, the unpickler of its ``.metadata`` and the checks of
what that metadata claims.

A piece is placed by composing the layouts a tensor may have, innermost first:

* a ``DTensor`` (FSDP2 ``Shard(0)``, HSDP ``(Replicate(), Shard(0))``): its local tensor
  is the block at the offsets DCP's own chunk protocol (``__create_chunk_list__``) gives
  inside the DTensor's global tensor;
* a torchloom :class:`~torchloom.core.meta.ShardSpec` (tensor parallelism): that global
  tensor is this rank's slice of the full tensor, made of ``chunks`` blocks that lie apart
  in it (a fused q/k/v weight); the local block is cut where it crosses from one to the
  next, each part placed in its block.

So FSDP-sharding a tensor-parallel slice gives pieces of the full tensor, whatever the
two layouts; pieces that several ranks hold (replicas) are equal and written once.

>>> from torchloom.core.meta import ShardSpec
>>> spec = ShardSpec(axis=0, full_shape=(12,), world_size=2, rank=1, chunks=3)
>>> local = spec.slice(torch.arange(12))          # [2, 3, 6, 7, 10, 11]
>>> [(at, t.tolist()) for at, t in _tensor_pieces(local, spec, False).pieces]
[((2,), [2, 3]), ((6,), [6, 7]), ((10,), [10, 11])]
>>> [(at, t.tolist()) for at, t in _place(local[1:4], (1,), spec)]   # a block of it
[((3,), [3]), ((6,), [6, 7])]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import CheckpointIOError, CheckpointMismatchError
from ..core.meta import ShardSpec, shard_spec
from .gather import is_dtensor
from .state_files import _clip, _clip_text, _is_int

_MODEL = "model."
_OPTIM = "optim."
GROUP_FIX = ("with FSDP or HSDP, call it on every rank of the pipeline stage with the group of "
             "them all (data- x tensor-parallel ranks): save(model, optimizer, path, step, "
             "group=stage_group); else on the ranks of one tensor-parallel group with "
             "group=sch.group")
"""What to do when the group of a save or load does not fit the model's layout."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's notice 'saving in a single process', which does not concern the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


# --------------------------------------------------------------------------- pieces


@dataclass
class _Pieces:
    """This rank's pieces of one logical tensor of shape ``full_shape``: ``(offsets in the
    full tensor, local tensor)`` each. What the save planner writes and the load planner
    reads into (none: this rank holds nothing of it)."""

    full_shape: torch.Size
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    def at(self, offsets: Any) -> torch.Tensor:
        key = tuple(offsets)
        for where, tensor in self.pieces:
            if where == key:
                return tensor
        raise KeyError(f"no piece at offsets {key}")


def _local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """This rank's block of ``tensor`` and its offsets in it: the local tensor of a DTensor
    (None when this rank is not in its mesh), all of a plain tensor."""
    if not is_dtensor(tensor):
        return tensor.detach(), (0,) * tensor.dim()
    if tensor.device_mesh.get_coordinate() is None:  # type: ignore[attr-defined]
        return None
    chunk = tensor.__create_chunk_list__()[0]  # type: ignore[attr-defined]  # DCP's protocol
    with torch.no_grad():
        local = tensor.to_local().detach()  # type: ignore[attr-defined]
    return local, tuple(int(o) for o in chunk.offsets)


def _place(local: torch.Tensor, start: tuple[int, ...], spec: ShardSpec | None
           ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``local``, the block at ``start`` of this rank's slice (``spec``) of a tensor, as
    ``(offsets in the full tensor, view of local)`` pieces: one per block of the slice
    (``spec.chunks``) it crosses; empty ones are left out."""
    if spec is None:
        return [(start, local)] if local.numel() else []
    axis = spec.axis
    block = spec.full_shape[axis] // spec.chunks
    piece = block // spec.pieces
    lo, hi = start[axis], start[axis] + local.shape[axis]
    out = []
    for c in range(spec.chunks):
        a, b = max(lo, c * piece), min(hi, (c + 1) * piece)
        if a >= b:
            continue
        offsets = list(start)
        offsets[axis] = c * block + spec.piece * piece + (a - c * piece)
        view = local.narrow(axis, a - lo, b - a)
        if view.numel():
            out.append((tuple(offsets), view))
    return out


def _tensor_pieces(tensor: torch.Tensor, spec: ShardSpec | None, contiguous: bool) -> _Pieces:
    """This rank's pieces of ``tensor`` (a DTensor or a plain tensor; with ``spec``, a
    tensor-parallel slice of a larger tensor): views of its local tensor, or contiguous
    copies of the non-contiguous ones when ``contiguous`` (what DCP writes)."""
    full = torch.Size(spec.full_shape if spec is not None else tensor.shape)
    found = _local_block(tensor)
    if found is None:
        return _Pieces(full, [])
    pieces = _place(*found, spec)
    if contiguous:
        pieces = [(at, t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format))
                  for at, t in pieces]
    return _Pieces(full, pieces)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if (start, length) != (0, tensor.shape[dim]):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _planners() -> tuple[type, type]:
    """DCP planners that write and read :class:`_Pieces` (DCP's public planner interface:
    ``DefaultSavePlanner``, ``DefaultLoadPlanner``, ``WriteItem``,
    ``create_read_items_for_chunk_list``); every other value goes through DCP's defaults.
    The state dicts are flat (no nesting), so DCP's flattening is off."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    def split(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, _Pieces]]:
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, _Pieces)}
        return {k: v for k, v in state_dict.items() if k not in pieces}, pieces

    class SavePlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                           is_coordinator: bool = False) -> None:
            plain, self.pieces = split(state_dict)
            super().set_up_planner(plain, storage_meta, is_coordinator)

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for fqn, value in self.pieces.items():
                for offsets, tensor in value.pieces:
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk, properties=TensorProperties.create_from_tensor(tensor),
                            size=value.full_shape)))
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        def resolve_data(self, write_item: Any) -> Any:
            value = self.pieces.get(write_item.index.fqn)
            if value is None:
                return super().resolve_data(write_item)
            return value.at(write_item.index.offset)

    class LoadPlanner(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None,
                           is_coordinator: bool = False) -> None:
            plain, self.pieces = split(state_dict)
            super().set_up_planner(plain, metadata, is_coordinator)

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            assert self.metadata is not None  # set up by DCP before the plan
            for fqn, value in self.pieces.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size())
                          for offsets, t in value.pieces]
                md = self.metadata.state_dict_metadata[fqn]
                if not isinstance(md, TensorStorageMetadata):
                    raise ValueError(f"{fqn!r} is not stored as a tensor")
                items += create_read_items_for_chunk_list(fqn, md, chunks)
            return dataclasses.replace(plan, items=[*plan.items, *items])

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            value = self.pieces.get(read_item.dest_index.fqn)
            if value is None:
                return super().resolve_tensor(read_item)
            return _narrow(value.at(read_item.dest_index.offset), read_item.dest_offsets,
                           read_item.lengths)

    return SavePlanner, LoadPlanner


# --------------------------------------------------------------------------- reading


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickle may name: DCP's metadata dataclasses, torch.Size,
    dtypes, layouts and a path; nothing that can run code (made once: it looks through
    ``dir(torch)``)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    objects: list[Any] = [
        metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex,
        metadata.StorageMeta, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo,
        torch.Size, type(pathlib.Path()),
    ]
    allowed = {(o.__module__, o.__qualname__): o for o in objects}
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :func:`_allowed_globals` (no import, no call of
    anything else)."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_globals().get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"'{module}.{name}' is not a DCP metadata type")
        return obj


def _safe_reader(path: str) -> Any:
    """DCP's FileSystemReader, reading ``.metadata`` with :class:`_MetadataUnpickler`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(dcp.FileSystemReader):
        read: Metadata | None = None  # the checks before DCP's load read it: once is enough

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = self.read
            if metadata is None:
                with open(os.path.join(path, ".metadata"), "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
                if not isinstance(metadata, Metadata):
                    raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}")
                self.read = metadata
            storage = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return Reader(path)


@contextlib.contextmanager
def _dcp_errors(primitive: str, path: str, partial: bool) -> Iterator[None]:
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
        if partial and isinstance(cause, ValueError) and "validate global plan" in str(cause):
            raise CheckpointMismatchError(
                "the pieces the ranks of the group hold do not make up the model's tensors",
                primitive=primitive, values=values, fix=GROUP_FIX) from cause
        if partial:
            fix = ("fix the cause (disk space, permissions) and save again; the partial files "
                   "were removed and the previous checkpoints in the directory are intact")
        else:
            fix = "check the files of the checkpoint (permissions, truncation); load an earlier one"
        raise CheckpointIOError(
            f"torch.distributed.checkpoint.{primitive} failed on rank(s) {sorted(failures)}",
            primitive=primitive, values=values, fix=fix) from cause


# --------------------------------------------------------------------------- checks of the metadata


def _expected_full(tensor: torch.Tensor) -> tuple[int, ...]:
    spec = shard_spec(tensor)
    return tuple(spec.full_shape) if spec is not None else tuple(tensor.shape)


def _mismatch(problem: str, values: dict[str, Any], fix: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(problem, primitive="load", values=values, fix=fix)


def _short_shape(shape: tuple[Any, ...] | None) -> Any:
    """A shape read from a file, as is when short, else cut to text (errors stay short)."""
    if shape is None or (len(shape) <= 8 and all(_is_int(d) and d < 10**12 for d in shape)):
        return shape
    return _clip_text(str(shape), 60)


def _shorten(items: list[Any], n: int = 6) -> list[Any]:
    return items if len(items) <= n else items[:n] + [f"... {len(items) - n} more"]


def _stored_bytes(metadata: Any, files: dict[str, Any], path: str) -> dict[str, int]:
    """The bytes the checkpoint's files hold for each key of ``metadata``; raises if the
    metadata places a piece outside the file its marker sizes (DCP would read that many
    bytes)."""
    out: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        size = files.get(str(getattr(info, "relative_path", "")), {}).get("bytes", 0)
        if not (_is_int(offset) and _is_int(length) and 0 <= offset
                and 0 <= length <= size - offset):
            raise CheckpointIOError(
                "the DCP metadata places a piece outside its file",
                primitive="load",
                values={"path": path, "key": _clip_text(str(getattr(index, "fqn", "?")), 120),
                        "offset": offset if _is_int(offset) else _clip(offset),
                        "length": length if _is_int(length) else _clip(length),
                        "file_bytes": size},
                fix="the checkpoint is damaged or was not written by torchloom.save; load an "
                "earlier one")
        fqn = str(getattr(index, "fqn", ""))
        out[fqn] = out.get(fqn, 0) + length
    return out


def _check_state_size(key: str, md: Any, name: str, param: torch.Tensor, stored: int,
                      path: str) -> None:
    """Refuse an optimizer state whose shape in the DCP metadata cannot be the state of
    ``param`` (checked before anything is allocated for it): a scalar, the parameter's
    full shape, or a smaller (factored) state, and never more elements than the files
    hold bytes for."""
    shape = tuple(md.size)
    expected = _expected_full(param)
    itemsize = md.properties.dtype.itemsize if isinstance(
        getattr(getattr(md, "properties", None), "dtype", None), torch.dtype) else 0
    valid = all(_is_int(dim) and dim >= 0 for dim in shape)
    numel = math.prod(shape) if valid else -1
    limit = math.prod(expected)
    problem = None
    if not valid or itemsize == 0:
        problem = "its shape or dtype in the DCP metadata is not a tensor's"
    elif shape not in ((), expected) and numel > limit:
        problem = (f"it claims {numel} elements, more than its parameter {_clip(name)} has "
                   f"({limit})")
    elif numel * itemsize > stored:
        problem = (f"it claims {numel * itemsize} bytes, and the checkpoint's files hold "
                   f"{stored} bytes of it")
    if problem is None:
        return
    raise _mismatch(
        f"optimizer state {_clip(key, 120)} does not fit its parameter: {problem}",
        {"path": path, "key": _clip_text(key, 120),
         "checkpoint_shape": _short_shape(shape), "parameter_shape": expected},
        "the checkpoint's '.metadata' is damaged or forged; load an earlier checkpoint: "
        "load(model, optimizer, save_dir, step=...), or load the model alone: "
        "load(model, None, path)")
