"""Checkpoint files (part of :mod:`torchloom.runtime.state`): names, size limits, the JSON
markers and their checks, checksums.

A save directory holds the pointer :data:`DIR_MARKER` and ``step-N`` folders, each with
DCP's files and its marker :data:`STEP_MARKER` (step, optimizer layout, configuration and
the SHA-256 of every file). Everything read from a file is checked here before it is
trusted: its size first, then its structure (:func:`_marker_problem`).

>>> _to_json((1, torch.tensor([2.0])), "x")
{'__tuple__': [1, {'__tensor__': [2.0], 'dtype': 'float32'}]}
>>> _from_json(_to_json((1, "a"), "x"))
(1, 'a')
>>> _clip_text("x" * 300, 10)
'xxxxxxxxxx... (300 characters)'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from ..core.errors import CheckpointIOError

FORMAT = 2
"""The checkpoint format this torchloom writes and reads (1: one pickled marker per
directory, before checksums; not read any more)."""

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


def _is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` (not a ``bool``)."""
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


def _sha256(file: str) -> tuple[str, int]:
    with open(file, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return digest, os.fstat(f.fileno()).st_size


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
