"""Checkpoints of scheduled (tensor-parallel) models (``torchloom.state``).

:func:`save` / :func:`load` write and read checkpoints with ``torch.distributed.checkpoint``
(DCP). The checkpoint holds *full-shape logical tensors*: a checkpoint written at
tensor-parallel degree 2 loads at 1, 2 or 4. ``torchloom.state`` also holds
:func:`full_state_dict` / :func:`full_optimizer_state_dict` (defined in
:mod:`torchloom.runtime.gather`) and :func:`init_distributed` (in
:mod:`torchloom.runtime.process_group`).

The format (pieces of full-shape tensors through DCP planners), the memory it takes, the
layout of a save directory, its atomicity and what the checksums do and do not protect
against are described in docs/design/checkpoints.md. In short: a save never writes into a
directory holding anything else, a crash leaves the previous checkpoint loadable, every
file is checked against its SHA-256 before it is read, and loading a checkpoint from an
untrusted source is running its code as far as the unpicklers allow.

>>> import torch, tempfile, os
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> model(torch.ones(1, 4)).sum().backward(); opt.step()
>>> d = tempfile.mkdtemp()
>>> os.path.basename(save(model, opt, os.path.join(d, "run"), step=7))
'step-7'
>>> sorted(os.listdir(os.path.join(d, "run")))
['step-7', 'torchloom-checkpoints.json']
>>> fresh = torch.nn.Linear(4, 2)
>>> fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
>>> load(fresh, fresh_opt, os.path.join(d, "run"))
7
>>> torch.equal(fresh.weight, model.weight), fresh_opt.param_groups[0]["lr"]
(True, 0.1)
>>> shutil.rmtree(d)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Defined elsewhere, importable here (torchloom.state): CollectiveTimeoutError,
# guard_collective (the sync hooks' collectives use it too), the process group and the
# full state dicts.
from ..core.errors import CheckpointIOError, CollectiveTimeoutError, ScheduleError
from ..core.meta import ShardSpec, shard_spec
from .collectives import group_rank, group_size, guard_collective
from .gather import (
    CheckpointMismatchError,
    _optimizer_params,
    check_spec,
    full_optimizer_state_dict,
    full_state_dict,
)
from .process_group import init_distributed

__all__ = [
    "Checkpoint",
    "CheckpointIOError",
    "CheckpointMismatchError",
    "CollectiveTimeoutError",
    "check_save_dir",
    "check_writable",
    "writable_problem",
    "describe_dir",
    "find_checkpoint",
    "full_optimizer_state_dict",
    "full_state_dict",
    "guard_collective",
    "init_distributed",
    "list_checkpoints",
    "load",
    "load_checkpoint",
    "save",
]

FORMAT = 2
"""The checkpoint format this torchloom writes and reads (1: one pickled marker per
directory, before checksums; not read any more)."""
_MODEL = "model."
_OPTIM = "optim."


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's notice 'saving in a single process', which does not concern the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


# --------------------------------------------------------------------------- DCP helpers


@dataclass
class _Pieces:
    """This rank's pieces of one logical tensor of shape ``full_shape``: ``(offsets in the
    full tensor, local tensor)`` each. What :class:`_SavePlanner` writes and
    :class:`_LoadPlanner` reads into."""

    full_shape: torch.Size
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    def at(self, offsets: Any) -> torch.Tensor:
        key = tuple(offsets)
        for where, tensor in self.pieces:
            if where == key:
                return tensor
        raise KeyError(f"no piece at offsets {key}")


def _pieces(local: torch.Tensor, spec: ShardSpec, contiguous: bool) -> _Pieces:
    """This rank's pieces of ``local`` (a tensor sharded as ``spec``): one per block, views
    of it (contiguous copies of non-contiguous ones when ``contiguous``)."""
    block = spec.full_shape[spec.axis] // spec.chunks
    piece = block // spec.pieces
    out = []
    for c in range(spec.chunks):
        offsets = [0] * len(spec.full_shape)
        offsets[spec.axis] = c * block + spec.piece * piece
        view = local.detach().narrow(spec.axis, c * piece, piece)
        if contiguous and not view.is_contiguous():
            view = view.clone(memory_format=torch.contiguous_format)
        out.append((tuple(offsets), view))
    return _Pieces(torch.Size(spec.full_shape), out)


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
            for fqn, value in self.pieces.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size())
                          for offsets, t in value.pieces]
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return dataclasses.replace(plan, items=[*plan.items, *items])

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            value = self.pieces.get(read_item.dest_index.fqn)
            if value is None:
                return super().resolve_tensor(read_item)
            return _narrow(value.at(read_item.dest_index.offset), read_item.dest_offsets,
                           read_item.lengths)

    return SavePlanner, LoadPlanner


def _to_save(tensor: torch.Tensor, key: str, group: Any, primitive: str) -> Any:
    spec = shard_spec(tensor)
    if spec is None or spec.world_size == 1:
        if spec is not None:
            check_spec(key, spec, group, primitive)
        return tensor.detach()
    check_spec(key, spec, group, primitive)
    return _pieces(tensor, spec, contiguous=True)


def _state_spec(p: torch.Tensor, value: Any) -> ShardSpec | None:
    spec = shard_spec(p)
    if spec is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
        return spec
    return None


# --------------------------------------------------------------------------- checkpoint files

DIR_MARKER = "torchloom-checkpoints.json"
"""The file that marks a save directory as torchloom's; it also points at the newest
checkpoint (replaced atomically after each save)."""
STEP_MARKER = "torchloom.json"
"""The marker of one checkpoint (``step-N/torchloom.json``): step, optimizer layout, run
configuration and the SHA-256 of every file; written last, so its presence marks a
complete checkpoint."""
_OLD_MARKER = "torchloom.pt"  # format 1: one checkpoint per directory, a pickled marker
_KIND_DIR = "torchloom checkpoint directory"
_KIND_STEP = "torchloom checkpoint"
_MAX_MARKER_BYTES = 16 * 2**20
"""The largest checkpoint marker read (a marker lists every tensor's name and every
file's checksum: about 250 bytes per tensor, so 16 MiB holds some 60 000 tensors)."""
_MAX_POINTER_BYTES = 64 * 2**10
"""The largest pointer file read (torchloom writes about 150 bytes)."""
_MAX_OPTIMIZER_STATES = 64
"""The most tensor states one parameter may have in a checkpoint (AdamW has 3)."""
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_RE = re.compile(r"\.tmp-step-(\d+)-([0-9a-f]{12})")
_OLD_RE = re.compile(r"\.old-step-(\d+)-([0-9a-f]{12})")
_JSON_TMP_RE = re.compile(r"(?:torchloom-checkpoints|torchloom)\.json\.tmp-[0-9a-f]{12}")
_DCP_FILE_RE = re.compile(r"\.metadata|__\d+_\d+\.distcp")
_DCP_TMP_RE = re.compile(r"\.metadata\.tmp")
_DAMAGED_RE = re.compile(r"\.damaged-step-(\d+)-([0-9a-f]{12})")


def _clip_text(text: str, limit: int = 200) -> str:
    """``text`` cut to about ``limit`` characters: what an error quotes of a file's content
    stays short, whatever the file holds."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _clip(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut like :func:`_clip_text`."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit
        text = f"<{type(value).__name__}>"
    return _clip_text(text, limit)


def _save_fix(primitive: str) -> str:
    if primitive == "save":
        return "save into a new directory: torchloom.save(model, optimizer, 'checkpoints/run1', step)"
    return "pass a new or empty directory: --save-dir runs/run1"


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint of a save directory (see :func:`find_checkpoint`).

    Attributes:
        path: its directory (``<save dir>/step-N``, or a temporary name a save left behind
            when it crashed after the checkpoint was complete).
        step: the step it was saved at.
        serial: its position in the save order of the directory (larger is newer).
        config: the run configuration saved with it (``save(..., config=...)``), or None.
        world_size: the size of the group that saved it.
        verified: whether the checksums of its files were checked (by
            :func:`find_checkpoint`; :func:`list_checkpoints` does not read the files).
    """

    path: str
    step: int
    serial: int
    config: dict[str, Any] | None
    world_size: int
    verified: bool = False
    marker: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The checkpoint's folder name, e.g. ``'step-8'``."""
        return os.path.basename(self.path)


class _NotData(Exception):
    def __init__(self, where: str, value: Any) -> None:
        super().__init__(where)
        self.where, self.value = where, value


def _to_json(value: Any, where: str) -> Any:
    """``value`` as JSON data: tuples and small tensors are tagged, anything else that is
    not plain data raises ``_NotData``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if (isinstance(value, dict) and all(isinstance(k, str) for k in value)
            and "__tuple__" not in value and "__tensor__" not in value):
        return {k: _to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() <= 64 and not value.is_complex():
        return {"__tensor__": value.detach().cpu().tolist(),
                "dtype": str(value.dtype).removeprefix("torch.")}
    raise _NotData(where, value)


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(_from_json(v) for v in value["__tuple__"])
        if set(value) == {"__tensor__", "dtype"}:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {_clip(value['dtype'])}")
            return torch.tensor(value["__tensor__"], dtype=dtype)
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every file system syncs directories
        pass
    finally:
        os.close(fd)


def _write_json_atomic(file: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``file``: a temporary beside it, flushed and fsynced, then
    ``os.replace`` d over it (readers see the old or the new file, never a part)."""
    tmp = f"{file}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except Exception:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(file) or ".")


def _read_json(file: str, limit: int = _MAX_MARKER_BYTES) -> Any:
    """Parse a JSON file we are about to trust nothing of: its size is checked before it
    is read (and no more than ``limit`` bytes are read), errors are short."""
    info = os.stat(file)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("it is not a regular file")
    size = info.st_size
    if size > limit:
        raise ValueError(f"it has {size} bytes, more than such a file can have ({limit})")
    with open(file, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since
        raise ValueError(f"it has more than {limit} bytes, more than such a file can have")
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(_clip_text(f"{type(exc).__name__}: {exc}")) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dir_marker(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """The save directory's marker, or ``(None, problem)``."""
    file = os.path.join(path, DIR_MARKER)
    if not os.path.lexists(file):
        return None, "no marker"
    if os.path.islink(file) or not os.path.isfile(file):
        return None, f"{DIR_MARKER!r} is not a regular file"
    try:
        marker = _read_json(file, _MAX_POINTER_BYTES)
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{DIR_MARKER!r} is not readable JSON ({_clip_text(str(exc))})"
    if not isinstance(marker, dict) or marker.get("torchloom") != _KIND_DIR:
        return None, f"{DIR_MARKER!r} is not a torchloom marker"
    if marker.get("format") != FORMAT:
        return None, (f"{DIR_MARKER!r} is of format {_clip(marker.get('format'))}; this "
                      f"torchloom writes format {FORMAT}")
    if not _is_int(marker.get("serial")):
        return None, f"{DIR_MARKER!r} has no serial number"
    if not isinstance(marker.get("latest"), (str, type(None))):
        return None, f"{DIR_MARKER!r} names no checkpoint folder"
    return marker, None


def _marker_problem(marker: Any, name: str) -> str | None:
    """What is wrong with a checkpoint marker read from a file (None if nothing)."""
    if not isinstance(marker, dict) or marker.get("torchloom") != _KIND_STEP:
        return "not a torchloom checkpoint marker"
    if marker.get("format") != FORMAT:
        return f"format {_clip(marker.get('format'))}; this torchloom reads format {FORMAT}"
    for key in ("step", "serial", "world_size"):
        if not _is_int(marker.get(key)) or marker[key] < 0:
            return f"{key} is not a non-negative integer"
    expected = [_STEP_RE, _TMP_RE, _OLD_RE]
    for pattern in expected:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) != marker["step"]:
            return f"it records step {_clip(marker['step'])}, its folder is named {name!r}"
    files = marker.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "it lists no files"
    for file, entry in files.items():
        if not isinstance(file, str) or not _DCP_FILE_RE.fullmatch(file):
            return f"it lists a file that is not a checkpoint file: {str(file)[:80]!r}"
        if len(file) > 64:
            return f"it lists a file name of {len(file)} characters: {file[:40]!r}..."
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])
                or not _is_int(entry.get("bytes")) or entry["bytes"] < 0):
            return f"the checksum entry of {file!r} is malformed"
    keys = marker.get("model_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return "model_keys is not a list of names"
    if not isinstance(marker.get("has_optimizer"), bool):
        return "has_optimizer is not a boolean"
    if not isinstance(marker.get("optimizer_class"), (str, type(None))):
        return "optimizer_class is not a name"
    groups = marker.get("param_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(isinstance(p, str) for p in g["params"]) for g in groups):
        return "param_groups is malformed"
    tensor_state = marker.get("tensor_state")
    if not isinstance(tensor_state, dict) or not all(
            isinstance(v, list) and all(isinstance(k, str) for k in v)
            and len(set(v)) == len(v) for v in tensor_state.values()):
        return "tensor_state is malformed"
    crowded = [name for name, v in tensor_state.items() if len(v) > _MAX_OPTIMIZER_STATES]
    if crowded:
        return (f"tensor_state lists more than {_MAX_OPTIMIZER_STATES} states of parameter "
                f"{_clip(crowded[0])}")
    other = marker.get("other_state")
    if not isinstance(other, dict) or not all(isinstance(v, dict) for v in other.values()):
        return "other_state is malformed"
    if not isinstance(marker.get("config"), (dict, type(None))):
        return "config is not a mapping"
    return None


def _read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint in folder ``path`` from its marker (raises CheckpointIOError)."""
    file = os.path.join(path, STEP_MARKER)
    try:
        if os.path.islink(file):
            raise ValueError("it is a symbolic link")
        marker = _read_json(file)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointIOError(
            f"cannot read the marker {STEP_MARKER!r} of checkpoint {os.path.basename(path)!r}: "
            f"{_clip_text(str(exc))}", primitive="load", values={"path": path},
            fix="the checkpoint is damaged; load an earlier one: load(model, optimizer, "
            "save_dir, step=...)") from exc
    problem = _marker_problem(marker, os.path.basename(path))
    if problem is not None:
        raise CheckpointIOError(
            f"the marker {STEP_MARKER!r} of checkpoint {os.path.basename(path)!r} is not "
            f"valid: {problem}", primitive="load", values={"path": path},
            fix="write checkpoints with torchloom.save; load an earlier one")
    return Checkpoint(path=path, step=marker["step"], serial=marker["serial"],
                      config=marker.get("config"), world_size=marker["world_size"],
                      marker=marker)


def _ours_inside(path: str) -> bool:
    """Whether a folder holds only files a save writes (so it may be deleted)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    for entry in entries:
        full = os.path.join(path, entry)
        if os.path.islink(full) or not os.path.isfile(full):
            return False
        if not (_DCP_FILE_RE.fullmatch(entry) or _DCP_TMP_RE.fullmatch(entry)
                or entry == STEP_MARKER or _JSON_TMP_RE.fullmatch(entry)):
            return False
    return True


def _remove_ours(path: str) -> None:
    """Delete a checkpoint folder this code wrote; anything else in it: leave and warn."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    if not _ours_inside(path):
        warnings.warn(f"torchloom.save: left {path!r} in place: it holds files torchloom "
                      "did not write", stacklevel=3)
        return
    shutil.rmtree(path, ignore_errors=True)


def _describe(path: str, limit: int = 10) -> list[str]:
    """What a directory holds, for error messages: each entry with what torchloom makes
    of it."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return [f"(unreadable: {exc.strerror})"]
    out = []
    for entry in entries[:limit]:
        full = os.path.join(path, entry)
        note = ""
        if os.path.islink(full):
            note = " (symbolic link)"
        elif entry == DIR_MARKER:
            note = " (the torchloom marker)"
        elif entry == _OLD_MARKER:
            note = " (a checkpoint of torchloom format 1)"
        elif _TMP_RE.fullmatch(entry):
            complete = os.path.isfile(os.path.join(full, STEP_MARKER))
            note = " (interrupted save, complete)" if complete else " (interrupted save)"
        elif _DAMAGED_RE.fullmatch(entry):
            note = " (set aside at a resume: damaged)"
        elif _OLD_RE.fullmatch(entry) or _STEP_RE.fullmatch(entry):
            complete = os.path.isfile(os.path.join(full, STEP_MARKER))
            note = "" if complete else " (no marker: incomplete or damaged)"
        elif os.path.isdir(full):
            note = "/"
        out.append(entry + note)
    if len(entries) > limit:
        out.append(f"... {len(entries) - limit} more")
    return out or ["(empty)"]


def _scan(path: str) -> tuple[list[Checkpoint], list[str]]:
    """The complete checkpoints of a save directory, newest first, and the problems of the
    folders that should have been checkpoints (damaged markers)."""
    found: list[Checkpoint] = []
    problems: list[str] = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        kind = ("step" if _STEP_RE.fullmatch(entry) else "tmp" if _TMP_RE.fullmatch(entry)
                else "old" if _OLD_RE.fullmatch(entry) else None)
        if kind is None or os.path.islink(full) or not os.path.isdir(full):
            continue
        if not os.path.lexists(os.path.join(full, STEP_MARKER)):
            if kind != "tmp":  # a temporary without a marker is an interrupted save
                problems.append(f"{entry}: no marker {STEP_MARKER!r}")
            continue
        try:
            found.append(_read_checkpoint(full))
        except CheckpointIOError as exc:
            problems.append(f"{entry}: {exc.problem}")
    found.sort(key=lambda c: (c.serial, c.name.startswith("step-")), reverse=True)
    return found, problems


def list_checkpoints(path: str | os.PathLike) -> list[Checkpoint]:
    """The complete checkpoints in save directory ``path``, newest first (by save order),
    read from their markers only (no checksum is checked: :func:`find_checkpoint` does).
    An empty list when ``path`` does not exist or holds none; a single checkpoint folder
    (``<dir>/step-N``) gives itself.

    >>> import torch, tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "run")
    >>> m = torch.nn.Linear(2, 2)
    >>> for step in (1, 2, 3):
    ...     _ = save(m, None, d, step)
    >>> [(c.name, c.step) for c in list_checkpoints(d)]   # keep=2: the two newest
    [('step-3', 3), ('step-2', 2)]
    >>> shutil.rmtree(os.path.dirname(d))
    """
    path = os.path.normpath(os.fspath(path))
    if not os.path.isdir(path):
        return []
    if os.path.lexists(os.path.join(path, STEP_MARKER)):
        try:
            return [_read_checkpoint(path)]
        except CheckpointIOError:
            return []
    return _scan(path)[0]


def describe_dir(path: str | os.PathLike) -> list[str]:
    """What a directory holds, as torchloom sees it (for messages): its first entries, each
    noted as a complete checkpoint, an interrupted save, torchloom's marker, ...

    >>> describe_dir("/nonexistent-dir")
    ['(missing)']
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        return ["(missing)"]
    if not os.path.isdir(path):
        return ["(a file, not a directory)"]
    return _describe(path)


# --------------------------------------------------------------------------- save


def _refusal(path: str, primitive: str) -> CheckpointIOError | None:
    """Why ``save`` must not write into ``path`` (None if it may)."""
    values: dict[str, Any] = {"path": path}
    save_fix = _save_fix(primitive)
    if path in (".", "..") or os.path.basename(path) in (".", ".."):
        return CheckpointIOError(
            "refusing to save into the current directory (or its parent): a save directory "
            "holds only checkpoints", primitive=primitive, values=values, fix=save_fix)
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if real == cwd or cwd.startswith(real.rstrip(os.sep) + os.sep) or real == os.sep:
        return CheckpointIOError(
            "refusing to save into the current directory or one above it: a save directory "
            "holds only checkpoints", primitive=primitive,
            values={**values, "resolves_to": real}, fix=save_fix)
    if os.path.islink(path):
        return CheckpointIOError(
            "the save directory is a symbolic link; torchloom writes only into a real "
            "directory it can check", primitive=primitive,
            values={**values, "link_to": os.readlink(path)},
            fix=f"pass the directory itself: --save-dir {real}" if primitive != "save" else
            f"pass the directory itself: save(model, optimizer, {real!r}, step)")
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return CheckpointIOError(
            "the save path is a file, not a directory; torchloom does not replace it",
            primitive=primitive, values=values, fix=save_fix)
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return CheckpointIOError(
            f"cannot list the save directory: {exc.strerror}", primitive=primitive,
            values=values, fix="fix its permissions, or " + save_fix)
    if all(_JSON_TMP_RE.fullmatch(e) for e in entries):
        return None  # empty, or a claim that crashed before its marker was in place
    marker, problem = _dir_marker(path)
    if marker is not None:
        return None
    if _OLD_MARKER in entries:
        return CheckpointIOError(
            f"the directory holds a checkpoint of torchloom's format 1 ({_OLD_MARKER!r}); "
            f"this torchloom writes format {FORMAT} and does not replace it",
            primitive=primitive, values={**values, "contents": _describe(path, 6)},
            fix=save_fix + "; or delete the old checkpoint: shutil.rmtree(path)")
    if DIR_MARKER in entries:
        return CheckpointIOError(
            f"the directory's marker is not one torchloom wrote: {problem}",
            primitive=primitive, values={**values, "contents": _describe(path, 6)},
            fix=save_fix)
    if _recoverable(path, entries):
        return None  # its pointer was deleted: the next save writes it again
    return CheckpointIOError(
        "the directory holds files torchloom did not write; a save writes only into an "
        "empty directory or one torchloom made", primitive=primitive,
        values={**values, "contents": _describe(path, 6)}, fix=save_fix)


def _recoverable(path: str, entries: list[str]) -> bool:
    """Whether a directory without its pointer file is a save directory whose pointer was
    deleted: it holds nothing but what saves write (``step-N`` checkpoints, complete and
    matching their checksums; temporaries of saves; folders set aside at a resume) and at
    least one complete checkpoint. Reads every checkpoint's files once."""
    complete = False
    for entry in entries:
        full = os.path.join(path, entry)
        if _JSON_TMP_RE.fullmatch(entry) and os.path.isfile(full) and not os.path.islink(full):
            continue
        if os.path.islink(full) or not os.path.isdir(full):
            return False
        if _DAMAGED_RE.fullmatch(entry):
            continue  # never removed by torchloom: nothing of it is at risk
        if not (_STEP_RE.fullmatch(entry) or _TMP_RE.fullmatch(entry)
                or _OLD_RE.fullmatch(entry)) or not _ours_inside(full):
            return False
        if _STEP_RE.fullmatch(entry):
            try:
                ckpt = _read_checkpoint(full)
            except CheckpointIOError:
                return False
            files = ckpt.marker["files"]
            if any(_file_problem(full, name, files[name]) for name in sorted(files)):
                return False
            complete = True
    return complete


def writable_problem(path: str) -> str | None:
    """Why nothing can be written at ``path`` (a folder, made if missing), or None: a probe
    file is created (``O_CREAT | O_EXCL``) and removed in it, or in its nearest existing
    parent when it is missing. Permission bits do not tell (root ignores them; a
    read-only file system does not show in them), a real write does."""
    folder = os.path.abspath(path)
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder!r} is a file, not a folder: nothing can be created under it"
    probe = os.path.join(folder, f".torchloom-probe-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return f"cannot create a file in {folder!r}: {exc.strerror or exc}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(probe)
    return None


def check_writable(path: str | os.PathLike, primitive: str = "save") -> None:
    """Raise :class:`CheckpointIOError` unless a save can write into ``path`` (see
    :func:`writable_problem`); ``torchloom train`` checks its ``--save-dir`` so before
    the first step.

    >>> check_writable("/proc/torchloom-run")
    Traceback (most recent call last):
    ...
    torchloom.core.errors.CheckpointIOError: save(...): the save directory cannot be written: ...
    """
    path = os.path.normpath(os.fspath(path))
    problem = writable_problem(path)
    if problem is not None:
        raise CheckpointIOError(
            f"the save directory cannot be written: {problem}", primitive=primitive,
            values={"path": path},
            fix="pass a directory on a writable file system: --save-dir /scratch/runs/run1"
            if primitive != "save" else "save into a writable directory: "
            "torchloom.save(model, optimizer, '/scratch/runs/run1', step)")


def check_save_dir(path: str | os.PathLike, primitive: str = "save") -> None:
    """Raise :class:`CheckpointIOError` if :func:`save` would refuse ``path``; reads only.

    A save directory is missing (it will be made), empty, or one torchloom made (it holds
    ``torchloom-checkpoints.json``). A directory of other files, a regular file, a symbolic
    link, ``.`` or the current directory is refused: a save never deletes or replaces
    anything it did not write.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> check_save_dir(os.path.join(d, "run"))            # missing: fine
    >>> open(os.path.join(d, "notes.txt"), "w").close()
    >>> check_save_dir(d)
    Traceback (most recent call last):
    ...
    torchloom.core.errors.CheckpointIOError: save(...): the directory holds files torchloom did not write; ...
    >>> shutil.rmtree(d)
    """
    error = _refusal(os.path.normpath(os.fspath(path)), primitive)
    if error is not None:
        raise error


def _claim(path: str, step: int) -> None:
    """Make ``path`` a save directory (rank 0), or raise if it is not one we may use (or
    if its ``step-N`` folder, which this save replaces, is not a checkpoint of ours)."""
    error = _refusal(path, "save")
    if error is not None:
        raise error
    final = os.path.join(path, f"step-{step}")
    if os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)
                                   or not _ours_inside(final)):
        raise CheckpointIOError(
            f"'step-{step}' in the save directory is not a torchloom checkpoint (it holds "
            "other files); the save of that step would replace it",
            primitive="save", values={"path": path, "contents": _describe(final, 6)},
            fix=f"move it out of the way, or {_save_fix('save')}")
    if not os.path.lexists(path):
        try:
            os.makedirs(path)
        except OSError as exc:
            raise CheckpointIOError(
                f"cannot create the save directory: {exc.strerror}", primitive="save",
                values={"path": path}, fix="fix the parent's permissions, or " + _save_fix("save")
            ) from exc
    if _dir_marker(path)[0] is None:
        steps = sorted(e for e in os.listdir(path) if _STEP_RE.fullmatch(e))
        if steps:  # _refusal found them complete: the pointer was deleted
            warnings.warn(
                f"torchloom.save: {path!r} had lost its pointer file {DIR_MARKER!r}; its "
                f"complete checkpoints ({', '.join(steps[:6])}) were checked against their "
                "checksums and the pointer is written again", stacklevel=3)
        for entry in os.listdir(path):  # a crashed claim's temporary
            if _JSON_TMP_RE.fullmatch(entry):
                os.remove(os.path.join(path, entry))
        _write_json_atomic(os.path.join(path, DIR_MARKER), {
            "torchloom": _KIND_DIR, "format": FORMAT, "latest": None, "step": None,
            "serial": 0})


def _share(value: Any, group: Any, primitive: str) -> Any:
    """``value`` of the group's rank 0, on every rank."""
    if group_size(group) == 1:
        return value
    box = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with guard_collective("broadcast_object_list", primitive, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _gather_all(value: Any, group: Any, primitive: str) -> list[Any]:
    if group_size(group) == 1:
        return [value]
    out: list[Any] = [None] * group_size(group)
    with guard_collective("all_gather_object", primitive, group):
        dist.all_gather_object(out, value, group=group)
    return out


def _on_rank0(fn: Callable[[], Any], group: Any, primitive: str) -> Any:
    """Run ``fn`` on the group's rank 0 and give every rank its result; an exception there
    is raised on every rank (the same CheckpointIOError, or one naming it)."""
    if group_size(group) == 1:
        return fn()
    result: Any = None
    error: Exception | None = None
    if group_rank(group) == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, re-raised
            error = exc
    shared = _share((result, error if isinstance(error, ScheduleError) else
                     None if error is None else f"{type(error).__name__}: {error}"),
                    group, primitive)
    if error is not None:
        raise error
    result, remote = shared
    if isinstance(remote, ScheduleError):
        raise remote
    if remote is not None:
        raise CheckpointIOError(f"rank 0 of the group failed: {remote}", primitive=primitive,
                                values={"rank": group_rank(group)},
                                fix="see rank 0's error; fix its cause and run again")
    return result


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
        if partial:
            fix = ("fix the cause (disk space, permissions) and save again; the partial files "
                   "were removed and the previous checkpoints in the directory are intact")
        else:
            fix = "check the files of the checkpoint (permissions, truncation); load an earlier one"
        raise CheckpointIOError(
            f"torch.distributed.checkpoint.{primitive} failed on rank(s) {sorted(failures)}",
            primitive=primitive, values=values, fix=fix) from cause


def _write_dcp(state: dict[str, Any], tmp: str, path: str, group: Any) -> None:
    """Every rank writes its pieces into the temporary folder ``tmp`` (DCP)."""
    import torch.distributed.checkpoint as dcp

    with _dcp_errors("save", path, True), \
            guard_collective("torch.distributed.checkpoint.save", "save", group), _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_planners()[0](),
                 process_group=group, no_dist=not dist.is_initialized())


def _sha256(file: str) -> tuple[str, int]:
    with open(file, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return digest, os.fstat(f.fileno()).st_size


def _checksums(tmp: str, group: Any) -> dict[str, dict[str, Any]]:
    """SHA-256 and size of every file DCP wrote, the files split over the ranks."""
    names = sorted(e for e in os.listdir(tmp) if _DCP_FILE_RE.fullmatch(e))
    mine = {}
    for name in names[group_rank(group)::group_size(group)]:
        digest, size = _sha256(os.path.join(tmp, name))
        mine[name] = {"sha256": digest, "bytes": size}
    out: dict[str, dict[str, Any]] = {}
    for part in _gather_all(mine, group, "save"):
        out.update(part)
    return dict(sorted(out.items()))


def _next_serial(path: str) -> int:
    marker, _ = _dir_marker(path)
    serials = [marker["serial"]] if marker else []
    serials += [c.serial for c in _scan(path)[0]]
    return max(serials, default=0) + 1


def _write_step_marker(tmp: str, marker: dict[str, Any]) -> None:
    _write_json_atomic(os.path.join(tmp, STEP_MARKER), marker)


def _commit(path: str, tmp: str, step: int) -> str:
    """Rename the complete temporary folder to ``step-N`` (a checkpoint of the same step
    already there is renamed away first and removed by the cleanup)."""
    final = os.path.join(path, f"step-{step}")
    old = None
    if os.path.lexists(final):
        old = os.path.join(path, ".old" + os.path.basename(tmp)[len(".tmp"):])
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except Exception:
        if old is not None:
            os.rename(old, final)
        raise
    _fsync_dir(path)
    return final


def _write_pointer(path: str, checkpoint: str, marker: dict[str, Any]) -> None:
    _write_json_atomic(os.path.join(path, DIR_MARKER), {
        "torchloom": _KIND_DIR, "format": FORMAT, "latest": os.path.basename(checkpoint),
        "step": marker["step"], "serial": marker["serial"]})


def _cleanup(path: str, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (one per step); remove older ones,
    temporaries of interrupted saves and stale marker temporaries. Only folders and files
    named and filled as a save makes them are removed."""
    found, _ = _scan(path)
    kept: list[Checkpoint] = []
    steps: set[int] = set()
    for ckpt in found:  # newest first
        if ckpt.step not in steps and len(kept) < keep:
            kept.append(ckpt)
            steps.add(ckpt.step)
    names = {c.name for c in kept}
    for ckpt in found:
        if ckpt.name not in names:
            _remove_ours(ckpt.path)
    for ckpt in kept:  # a complete checkpoint a crash left under a temporary name
        final = os.path.join(path, f"step-{ckpt.step}")
        if ckpt.name != os.path.basename(final) and not os.path.lexists(final):
            os.rename(ckpt.path, final)
            names.add(os.path.basename(final))
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry in names:
            continue
        if (_TMP_RE.fullmatch(entry) or _OLD_RE.fullmatch(entry)) and os.path.isdir(full):
            _remove_ours(full)
        elif _JSON_TMP_RE.fullmatch(entry) and os.path.isfile(full) \
                and not os.path.islink(full):
            os.remove(full)


def _finish(path: str, tmp: str, marker: dict[str, Any], keep: int) -> str:
    """Rank 0, after every rank wrote its files: the marker (written last: the checkpoint
    is complete from then on), the rename into place, the pointer, the cleanup."""
    marker["serial"] = _next_serial(path)
    _write_step_marker(tmp, marker)
    final = _commit(path, tmp, marker["step"])
    _write_pointer(path, final, marker)
    try:
        _cleanup(path, keep)
    except OSError as exc:  # the checkpoint is saved; leftovers go next time
        warnings.warn(f"torchloom.save: could not remove old files in {path!r}: {exc}",
                      stacklevel=3)
    return final


def _collect(model: nn.Module, optimizer: torch.optim.Optimizer | None, group: Any
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (tensors) and what the marker holds (everything else)."""
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
                            state[full_key] = _pieces(value, spec, contiguous=True)
                        else:
                            state[full_key] = value.detach()
                        tensor_state.setdefault(name, []).append(key)
                    else:
                        other_state.setdefault(name, {})[key] = value
    try:
        groups_json = _to_json(groups_md, "param_groups")
        other_json = _to_json(other_state, "optimizer.state")
    except _NotData as exc:
        raise CheckpointIOError(
            f"optimizer value {exc.where} is a {type(exc.value).__name__}, which a checkpoint "
            "marker cannot hold (numbers, strings, booleans, None, lists, tuples, small "
            "tensors)", primitive="save", values={"where": exc.where},
            fix="keep optimizer hyperparameters plain numbers, e.g. lr=1e-3") from None
    marker = {
        "torchloom": _KIND_STEP, "format": FORMAT, "world_size": group_size(group),
        "model_keys": list(model.state_dict().keys()), "has_optimizer": optimizer is not None,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "param_groups": groups_json, "tensor_state": tensor_state, "other_state": other_json,
    }
    return state, marker


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
         step: int, *, group: Any = None, keep: int = 2,
         config: dict[str, Any] | None = None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``, if given) at ``step`` into the
    save directory ``path``; returns the checkpoint's folder (``path/step-N``).

    A collective: every rank of ``group`` (the tensor-parallel group the model was
    scheduled with) calls it with the same arguments; all ranks must see one file system.

    Preconditions: ``path`` is missing, empty, or a directory torchloom made; anything
    else (other files, a regular file, a symbolic link, ``.``) raises
    :class:`CheckpointIOError` before anything is written (see :func:`check_save_dir`).

    Guarantees: the new checkpoint becomes visible (as ``step-N``, and in the pointer
    ``torchloom-checkpoints.json``) only once complete; a crash at any point leaves the
    previous checkpoints loadable, and :func:`load` finds the newest complete one. A save
    that fails (a full disk) removes its partial files and raises. After a successful
    save the directory holds the ``keep`` newest checkpoints (one per step: saving a step
    again replaces it); older ones and the temporaries of interrupted saves, recognised
    by name and content, are removed. ``config`` (JSON data: numbers, strings, lists,
    dicts) is stored with the checkpoint (:attr:`Checkpoint.config`).

    Cost: besides DCP's write, the files are read back once to record their SHA-256
    (split over the ranks).
    """
    path = os.path.normpath(os.fspath(path))
    if not _is_int(step) or step < 0:
        raise CheckpointIOError(
            f"step must be a non-negative int, not {step!r}", primitive="save",
            values={"step": step}, fix="save(model, optimizer, path, step=int(step))")
    if not _is_int(keep) or keep < 1:
        raise CheckpointIOError(
            f"keep must be a positive int, not {keep!r}", primitive="save",
            values={"keep": keep}, fix="save(model, optimizer, path, step, keep=2)")
    try:
        config_json = None if config is None else _to_json(dict(config), "config")
    except (_NotData, TypeError, ValueError) as exc:
        where = exc.where if isinstance(exc, _NotData) else "config"
        raise CheckpointIOError(
            f"{where} is not JSON data", primitive="save", values={"where": where},
            fix="pass config as a dict of numbers, strings, booleans, None, lists and dicts"
        ) from None
    state, marker = _collect(model, optimizer, group)
    marker.update(step=step, config=config_json)
    token = uuid.uuid4().hex[:12]

    def claim() -> str:
        _claim(path, step)
        return token

    token = _on_rank0(claim, group, "save")
    tmp = os.path.join(path, f".tmp-step-{step}-{token}")
    try:
        _write_dcp(state, tmp, path, group)
        marker["files"] = _checksums(tmp, group)
        return _on_rank0(lambda: _finish(path, tmp, marker, keep), group, "save")
    except Exception as exc:
        if group_rank(group) == 0 and os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # this save's partial files
        if isinstance(exc, OSError):
            raise CheckpointIOError(
                f"writing the checkpoint of step {step} failed: {exc}", primitive="save",
                values={"path": path, "step": step},
                fix="fix the cause (disk space, permissions) and save again; the partial "
                "files were removed and the previous checkpoints are intact") from exc
        raise


# --------------------------------------------------------------------------- load


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickle may name: DCP's metadata dataclasses, torch.Size,
    dtypes, layouts and a path; nothing that can run code."""
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
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with open(os.path.join(path, ".metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def _file_problem(folder: str, name: str, entry: dict[str, Any]) -> str | None:
    file = os.path.join(folder, name)
    if os.path.islink(file):
        return f"file {name!r} is a symbolic link"
    if not os.path.isfile(file):
        return f"file {name!r} is missing"
    size = os.path.getsize(file)  # a file of another size is not read at all
    if size == entry["bytes"]:
        digest, size = _sha256(file)
    if size != entry["bytes"]:
        return f"file {name!r} has {size} bytes, its marker records {_clip(entry['bytes'])}"
    if digest != entry["sha256"]:
        return f"file {name!r} does not match the SHA-256 checksum its marker records"
    return None


def _verify(ckpt: Checkpoint, group: Any) -> str | None:
    """Check the checksum of every file of ``ckpt`` (the files split over the ranks); the
    first problem by file name, the same on every rank, or None."""
    files = ckpt.marker["files"]
    names = sorted(files)
    mine = None
    for name in names[group_rank(group)::group_size(group)]:
        problem = _file_problem(ckpt.path, name, files[name])
        if problem is not None:
            mine = (name, problem)
            break
    found = [p for p in _gather_all(mine, group, "load") if p is not None]
    return min(found)[1] if found else None


def _candidates(path: str, step: int | None, primitive: str
                ) -> tuple[list[Checkpoint], list[str]]:
    """The complete checkpoints ``load`` may take from ``path``, newest first, and the
    warnings to give (damaged folders, a pointer at a missing checkpoint)."""
    missing_fix = "pass the directory given to torchloom.save(model, optimizer, path, step)"
    if not os.path.lexists(path):
        raise CheckpointIOError("no checkpoint at this path", primitive=primitive,
                                values={"path": path}, fix=missing_fix)
    if not os.path.isdir(path):
        raise CheckpointIOError("no checkpoint at this path: it is a file, not a directory",
                                primitive=primitive, values={"path": path}, fix=missing_fix)
    entries = os.listdir(path)
    notes: list[str] = []
    if STEP_MARKER in entries:  # a checkpoint folder itself
        found = [_read_checkpoint(path)]
    elif DIR_MARKER in entries or any(
            _STEP_RE.fullmatch(e) or _TMP_RE.fullmatch(e) or _OLD_RE.fullmatch(e)
            for e in entries):
        found, problems = _scan(path)
        notes += [f"skipped {p}" for p in problems]
        pointer, _ = _dir_marker(path)
        if (pointer and pointer.get("latest") and found and pointer["serial"] > found[0].serial
                and not any(p.startswith(f"{pointer['latest']}:") for p in problems)):
            notes.append(f"the pointer names {_clip(pointer['latest'])} (step "
                         f"{_clip(pointer.get('step'))}), which is missing or damaged")
    elif _OLD_MARKER in entries:
        raise CheckpointIOError(
            f"a checkpoint of torchloom's format 1 ({_OLD_MARKER!r}); this torchloom reads "
            f"format {FORMAT}", primitive=primitive, values={"path": path},
            fix="load it with the torchloom version that wrote it and save it again with "
            "this one into a new directory")
    else:
        raise CheckpointIOError(
            "no checkpoint at this path: the directory holds no torchloom checkpoint",
            primitive=primitive, values={"path": path, "contents": _describe(path, 6)},
            fix=missing_fix)
    if step is not None:
        steps = sorted({c.step for c in found})
        found = [c for c in found if c.step == step]
        if not found:
            raise CheckpointIOError(
                f"no complete checkpoint of step {step} in this directory",
                primitive=primitive, values={"path": path, "steps": steps},
                fix=f"pass one of the saved steps: load(model, optimizer, {path!r}, "
                f"step={steps[-1] if steps else 0})")
    if not found:
        raise CheckpointIOError(
            "no complete checkpoint in this directory (only interrupted or damaged saves)",
            primitive=primitive, values={"path": path, "contents": _describe(path, 6)},
            fix="train from the start (the directory holds nothing loadable), or restore "
            "the checkpoint from a copy")
    return found, notes


def _unusable_steps(path: str) -> list[str]:
    """The ``step-N`` entries of save directory ``path`` that cannot be checkpoints: a
    symbolic link, a file, a folder without a valid marker."""
    out = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if not _STEP_RE.fullmatch(entry):
            continue
        if os.path.islink(full) or not os.path.isdir(full):
            out.append(entry)
            continue
        try:
            _read_checkpoint(full)
        except CheckpointIOError:
            out.append(entry)
    return out


def _set_aside(path: str, names: list[str]) -> list[tuple[str, str]]:
    """Rename each damaged checkpoint folder ``names`` of save directory ``path`` to
    ``.damaged-step-N-<id>`` (kept, never removed by torchloom), so that the save of its
    step can write ``step-N`` again; returns ``(old, new)`` names."""
    moved = []
    for name in names:
        match = _STEP_RE.fullmatch(name) or _TMP_RE.fullmatch(name) or _OLD_RE.fullmatch(name)
        if match is None:
            continue
        new = f".damaged-step-{match.group(1)}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(os.path.join(path, name), os.path.join(path, new))
        except OSError:  # gone already (another process set it aside), or not ours to move
            continue
        moved.append((name, new))
    if moved:
        _fsync_dir(path)
    return moved


def find_checkpoint(path: str | os.PathLike, *, step: int | None = None, group: Any = None,
                    primitive: str = "load", set_aside: bool = False) -> Checkpoint:
    """The newest complete checkpoint in save directory ``path`` (or the one of ``step``)
    whose files match their checksums; a collective over ``group`` (the checksums are
    checked split over its ranks, one read of the checkpoint in all).

    ``path`` may also be one checkpoint's folder (``<dir>/step-N``). A damaged newest
    checkpoint (a file whose checksum differs, a file or marker missing) is skipped with
    a warning naming it and the file, and the previous one is taken; when none is left,
    :class:`CheckpointIOError` names the first damaged file. Raises it too when nothing
    loadable is there (the message lists what the directory holds).

    ``set_aside=True`` (a run that resumes and will save into ``path`` again): once a
    checkpoint is found, the group's rank 0 renames the damaged folders of the directory
    (those skipped, and ``step-N`` entries that are symbolic links, files or folders
    without a valid marker) to ``.damaged-step-N-<id>`` and names them in a warning: they
    are kept, and the run's save of step N can write ``step-N``. Pass it on one group per
    directory (e.g. data-parallel replica 0).
    """
    if step is not None and (not _is_int(step) or step < 0):
        raise CheckpointIOError(
            f"step must be a non-negative int, not {step!r}", primitive=primitive,
            values={"step": step}, fix=f"{primitive}(model, optimizer, path, step=8)")
    path = os.path.normpath(os.fspath(path))
    found, notes = _on_rank0(lambda: _candidates(path, step, primitive), group, primitive)
    damaged: list[tuple[Checkpoint, str]] = []
    for ckpt in found:
        problem = _verify(ckpt, group)
        if problem is None:
            if group_rank(group) == 0:
                for note in notes:
                    warnings.warn(f"torchloom.load: in {path!r}, {note}", stacklevel=2)
                for bad, why in damaged:
                    warnings.warn(
                        f"torchloom.load: checkpoint {bad.path!r} (step {bad.step}) is damaged "
                        f"({why}); loading {ckpt.path!r} (step {ckpt.step}) instead",
                        stacklevel=2)
                if set_aside and os.path.dirname(ckpt.path) == path:
                    names = {b.name for b, _ in damaged} | set(_unusable_steps(path))
                    names.discard(ckpt.name)
                    moved = _set_aside(path, sorted(names))
                    if moved:
                        warnings.warn(
                            f"torchloom.load: in {path!r}, set aside the damaged "
                            + ", ".join(f"{old!r} as {new!r}" for old, new in moved)
                            + " (kept for inspection; delete them when done), so that the "
                            "run's saves can write those steps again", stacklevel=2)
            return dataclasses.replace(ckpt, verified=True)
        damaged.append((ckpt, problem))
    bad, why = damaged[0]
    raise CheckpointIOError(
        f"checkpoint {bad.name!r} (step {bad.step}) is damaged: {why}", primitive=primitive,
        values={"path": bad.path, "damaged": [f"{c.name}: {w}" for c, w in damaged[1:]]}
        if len(damaged) > 1 else {"path": bad.path},
        fix="restore the file from a copy; no complete checkpoint in this directory matches "
        "its checksums")


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
        size = files.get(getattr(info, "relative_path", None), {}).get("bytes", 0)
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


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None,
         path: str | os.PathLike | Checkpoint, *, step: int | None = None,
         group: Any = None) -> int:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``) in
    their current layout, whatever the world size at save time; returns its step.

    ``path`` is a save directory (its newest complete checkpoint is loaded, or the one of
    ``step``), one checkpoint's folder, or a :class:`Checkpoint` from
    :func:`find_checkpoint` (already verified). A collective: every rank of ``group``
    calls it. The model must have the checkpoint's keys and full shapes; the optimizer
    must be over the same parameters, in the same groups. The model's parameters are
    written in place, so it works on a model that is already built and trained. Raises
    :class:`CheckpointIOError` for a missing, incomplete or damaged checkpoint (a file
    whose SHA-256 differs from its marker's is named) and
    :class:`CheckpointMismatchError` for one that does not fit.

    Trust: the checksums catch damage, not forgery. DCP's ``.metadata`` is a pickle; it
    is read only after its checksum matched, with an unpickler that accepts DCP's
    metadata types only and tensors are read with ``torch.load(weights_only=True)``;
    still, treat a checkpoint from an untrusted source like any pickle: loading it is
    running its code, as far as those unpicklers let it.
    """
    if isinstance(path, Checkpoint):
        ckpt = path if path.verified else find_checkpoint(path.path, group=group)
    else:
        ckpt = find_checkpoint(path, step=step, group=group)
    return load_checkpoint(model, optimizer, ckpt, group=group)


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    ckpt: Checkpoint, *, group: Any = None) -> int:
    """Read the verified checkpoint ``ckpt`` (from :func:`find_checkpoint`) into ``model``
    (and ``optimizer``), in place; returns its step. A collective over ``group``. The
    model's parameters must be real tensors (not meta); they keep their identity."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = ckpt.path
    marker = ckpt.marker
    reader = _safe_reader(path)
    try:
        full_metadata = reader.read_metadata()
        metadata = full_metadata.state_dict_metadata
        stored = {info.relative_path for info in (full_metadata.storage_data or {}).values()}
    except Exception as exc:
        raise CheckpointIOError(
            f"cannot read the DCP metadata '.metadata': {type(exc).__name__}: {exc}"[:400],
            primitive="load", values={"path": path},
            fix="the checkpoint is damaged or was not written by torchloom.save; load an "
            "earlier one") from exc
    unlisted = sorted(_clip(p) for p in stored if p not in marker["files"])
    if unlisted:
        raise CheckpointIOError(
            "the DCP metadata names files that the marker has no checksum of",
            primitive="load", values={"path": path, "files": _shorten(unlisted)},
            fix="the checkpoint was not written by torchloom.save; do not load it")
    stored_bytes = _stored_bytes(full_metadata, marker["files"], path)

    def saved_shape(key: str) -> tuple[int, ...] | None:
        md = metadata.get(key)
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    model_state = model.state_dict(keep_vars=True)
    saved_keys = [k[len(_MODEL):] for k in metadata if k.startswith(_MODEL)]
    missing = [k for k in model_state if _MODEL + k not in metadata]
    # a pipeline rank holds some stages: the other stages' keys are not unexpected
    whole = getattr(model, "all_state_dict_keys", None)
    known = set(whole()) if callable(whole) else model_state
    unexpected = [_clip_text(k, 80) for k in saved_keys if k not in known]
    if missing or unexpected:
        raise _mismatch(
            "the checkpoint holds another model: its keys differ from the model's",
            {"path": path, "missing_keys": _shorten(missing),
             "unexpected_keys": _shorten(unexpected)},
            "load it into the model it was saved from (same architecture and config), or "
            "load it into that model and copy the matching tensors over")
    wrong = [(k, _short_shape(saved_shape(_MODEL + k)), _expected_full(t))
             for k, t in model_state.items() if saved_shape(_MODEL + k) != _expected_full(t)]
    if wrong:
        raise _mismatch(
            "full shapes differ between the checkpoint and the model",
            {"path": path, "shapes (key, checkpoint, model)": _shorten(wrong)},
            "load into a model with the saved configuration (check hidden sizes, vocab size, "
            "number of heads)")

    targets: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read buffer, tensor)
    for key, tensor in model_state.items():
        spec = shard_spec(tensor)
        if spec is not None:
            check_spec(key, spec, group, "load")
        if spec is None or spec.world_size == 1:
            local = tensor.detach()
            target = local if local.is_contiguous() else torch.empty_like(
                local, memory_format=torch.contiguous_format)
            if target is not local:
                copies.append((target, tensor))
        else:  # read in place into views of the tensor
            target = _pieces(tensor, spec, contiguous=False)
        targets[_MODEL + key] = target

    optim_loads: list[tuple[int, str, str, torch.Tensor]] = []
    if optimizer is not None:
        if not marker["has_optimizer"]:
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
                {"path": path, "optimizer_groups": _shorten([_shorten(g, 3) for g in now]),
                 "checkpoint_groups": _shorten([_shorten([_clip_text(n, 80) for n in g], 3)
                                                for g in then])},
                "make the optimizer with the same parameter groups, in the same order, as "
                "the one that was saved")
        if marker["optimizer_class"] != type(optimizer).__name__:
            saved_class = _clip_text(str(marker["optimizer_class"]), 80)
            raise _mismatch(
                "the checkpoint holds the state of another optimizer class",
                {"path": path, "checkpoint": saved_class,
                 "optimizer": type(optimizer).__name__},
                f"load it into a {saved_class} optimizer")
        index = 0
        for entries in params:
            for name, p in entries:
                for key in marker["tensor_state"].get(name, []):
                    full_key = f"{_OPTIM}state.{name}.{key}"
                    md = metadata.get(full_key)
                    if not isinstance(md, TensorStorageMetadata):
                        raise CheckpointIOError(
                            f"optimizer state {_clip(full_key)} is listed but not stored",
                            primitive="load", values={"path": path,
                                                      "key": _clip_text(full_key, 120)},
                            fix="the checkpoint is damaged; load an earlier one")
                    _check_state_size(full_key, md, name, p, stored_bytes.get(full_key, 0),
                                      path)
                    spec = shard_spec(p)
                    dtype = md.properties.dtype
                    if (spec is not None and spec.world_size > 1
                            and tuple(md.size) == spec.full_shape):
                        local = torch.zeros(p.shape, dtype=dtype, device=p.device)
                        targets[full_key] = _pieces(local, spec, contiguous=False)
                    else:
                        device = p.device if len(md.size) else "cpu"
                        local = torch.zeros(tuple(md.size), dtype=dtype, device=device)
                        targets[full_key] = local
                    optim_loads.append((index, name, key, local))
                index += 1

    with _dcp_errors("load", path, False), \
            guard_collective("torch.distributed.checkpoint.load", "load", group), _quiet():
        dcp.load(targets, storage_reader=reader, planner=_planners()[1](), process_group=group,
                 no_dist=not dist.is_initialized())

    with torch.no_grad():
        for target, tensor in copies:
            tensor.copy_(target)

    if optimizer is not None:
        try:
            other_state = _from_json(marker["other_state"])
            saved_groups = _from_json(marker["param_groups"])
        except (ValueError, TypeError, RecursionError) as exc:
            raise CheckpointIOError(
                f"the optimizer data of the marker is malformed: {exc}", primitive="load",
                values={"path": path}, fix="the checkpoint is damaged; load an earlier one"
            ) from exc
        state: dict[int, dict[str, Any]] = {}
        for index, _name, key, value in optim_loads:
            state.setdefault(index, {})[key] = value
        index = 0
        for entries in _optimizer_params(model, optimizer, "load"):
            for name, _ in entries:
                for key, value in other_state.get(name, {}).items():
                    state.setdefault(index, {})[key] = value
                index += 1
        groups = []
        start = 0
        for saved in saved_groups:
            group_sd = dict(saved)
            n = len(saved["params"])
            group_sd["params"] = list(range(start, start + n))
            start += n
            groups.append(group_sd)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return int(marker["step"])
