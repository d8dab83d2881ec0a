"""Reading a Hugging Face weights folder: which tensors it holds, and slices of them.

:class:`WeightsSource` opens a folder (safetensors, sharded with an index, or
``pytorch_model.bin`` through ``torch.load(weights_only=True)``), reads the key, file,
shape and dtype of every stored tensor from the headers, and reads one region of a
tensor at a time. Everything read is untrusted: an index may only name files inside its
folder, every listed tensor must be in its file, a file that does not open is a
:class:`~torchloom.core.errors.CheckpointIOError`. Which model tensor each stored tensor
feeds is :mod:`torchloom.runtime.weights_plan`; see docs/design/weights.md.

>>> import os, tempfile
>>> from safetensors.torch import save_file
>>> d = tempfile.mkdtemp()
>>> save_file({"w": torch.arange(6.0).reshape(2, 3)}, os.path.join(d, "model.safetensors"))
>>> with open_weights(d) as source:
...     print(source.listing, source.shapes, source.read("w", (slice(1, 2),)))
model.safetensors {'w': (2, 3)} tensor([[3., 4., 5.]])
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..core.errors import CheckpointIOError, CheckpointMismatchError
from . import state as _state

__all__ = ["WeightsSource", "open_weights", "weight_listing", "is_torchloom_checkpoint"]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_FILE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"

_SAFE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN or infinity: its minimum and maximum are finite (a NaN
    propagates into both). One reduction, no temporary of the tensor's size
    (``torch.isfinite`` would make an absolute copy and two masks).

    >>> _all_finite(torch.tensor([1.0, -2.0])), _all_finite(torch.tensor([1.0, float("nan")]))
    (True, False)
    """
    if t.numel() == 0 or t.is_complex():
        return t.numel() == 0 or bool(torch.isfinite(t).all())
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _short(items: list[Any], n: int = 6) -> list[Any]:
    return items if len(items) <= n else items[:n] + [f"... {len(items) - n} more"]


def _io_error(problem: str, values: dict[str, Any], fix: str,
              primitive: str) -> CheckpointIOError:
    return CheckpointIOError(problem, primitive=primitive, values=values, fix=fix)


def _mismatch(problem: str, values: dict[str, Any], fix: str,
              primitive: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(problem, primitive=primitive, values=values, fix=fix)


# --------------------------------------------------------------------------- sources


def is_torchloom_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by :func:`torchloom.runtime.state.save` (a save
    directory, or one checkpoint's folder): it holds one of torchloom's marker files."""
    names = [getattr(_state, n, None) for n in ("DIR_MARKER", "STEP_MARKER", "_OLD_MARKER",
                                                 "MARKER")]
    folder = os.fspath(path)
    return any(isinstance(n, str) and os.path.isfile(os.path.join(folder, n)) for n in names)


def _inside(folder: str, name: Any, index: str, primitive: str) -> str:
    """The path of ``name`` (from an index file) inside ``folder``; refuses anything else."""
    if not isinstance(name, str) or not name:
        raise _io_error(f"{index} names a shard file that is not a file name",
                        {"path": folder, "file": name},
                        "write the folder again with save_pretrained", primitive)
    full = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([full, os.path.realpath(folder)]) != os.path.realpath(folder):
        raise _io_error(f"{index} names a file outside the folder",
                        {"path": folder, "file": name},
                        "use an index whose weight_map names files inside its folder",
                        primitive)
    if not os.path.isfile(full):
        raise _io_error(f"{index} names a shard file that does not exist",
                        {"path": folder, "file": name},
                        "copy the whole folder (every file the index names), or write it "
                        "again with save_pretrained", primitive)
    return full


def _read_index(folder: str, index: str, primitive: str) -> dict[str, str]:
    path = os.path.join(folder, index)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise _io_error(f"cannot read {index}: {exc}", {"path": folder},
                        "write the folder again with save_pretrained", primitive) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise _io_error(f"{index} has no weight_map of tensor names to files",
                        {"path": folder, "top_level": sorted(data)[:6]
                         if isinstance(data, dict) else type(data).__name__},
                        "write the folder again with save_pretrained", primitive)
    return {k: _inside(folder, v, index, primitive) for k, v in weight_map.items()}


def weight_listing(path: str | os.PathLike) -> str | None:
    """The file of the folder ``path`` that lists its tensors (``model.safetensors.index.json``,
    ``model.safetensors``, ``pytorch_model.bin.index.json`` or ``pytorch_model.bin``, in
    that order of preference), or None: the folder holds no weight files (a config only,
    whose model is initialised at random).

    >>> import tempfile
    >>> weight_listing(tempfile.mkdtemp()) is None
    True
    """
    folder = os.fspath(path)
    for name in (SAFE_INDEX, SAFE_FILE, BIN_INDEX, BIN_FILE):
        if os.path.isfile(os.path.join(folder, name)):
            return name
    return None


class WeightsSource:
    """An opened Hugging Face weights folder: the key of every stored tensor, its file,
    shape and dtype (read from the headers), and slice reads. Use as a context manager
    (or call :meth:`close`)."""

    def __init__(self, path: str | os.PathLike, primitive: str = "load_weights") -> None:
        self.path = os.fspath(path)
        self.primitive = primitive
        self._handles: dict[str, Any] = {}
        self._bins: dict[str, dict[str, torch.Tensor]] = {}
        self.files: dict[str, str] = {}                 # key -> file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype | str] = {}
        folder = self.path
        if not os.path.isdir(folder):
            raise _io_error("no weights folder at this path", {"path": folder},
                            "pass the folder that save_pretrained wrote (it holds "
                            "config.json and model.safetensors)", primitive)
        #: the file that lists the folder's tensors (an index, or the one weights file)
        self.listing = weight_listing(folder) or ""
        if self.listing == SAFE_INDEX:
            self.kind = "safetensors"
            self.files = _read_index(folder, SAFE_INDEX, primitive)
        elif self.listing == SAFE_FILE:
            self.kind = "safetensors"
            self.files = {}
            self._scan_safetensors(os.path.join(folder, SAFE_FILE), None)
        elif self.listing == BIN_INDEX:
            self.kind = "bin"
            self.files = _read_index(folder, BIN_INDEX, primitive)
        elif self.listing == BIN_FILE:
            self.kind = "bin"
            full = os.path.join(folder, BIN_FILE)
            self.files = {k: full for k in self._bin(full)}
        else:
            raise _io_error(
                "the folder holds no weights: no model.safetensors, "
                "model.safetensors.index.json or pytorch_model.bin",
                {"path": folder, "files": sorted(os.listdir(folder))[:8]},
                "pass a folder written by save_pretrained, or a torchloom checkpoint "
                "written by torchloom.runtime.state.save", primitive)
        if self.kind == "safetensors" and os.path.isfile(os.path.join(folder, SAFE_INDEX)):
            by_file: dict[str, list[str]] = {}
            for key, file in self.files.items():
                by_file.setdefault(file, []).append(key)
            for file, keys in by_file.items():
                self._scan_safetensors(file, keys)
        elif self.kind == "bin":
            for key, file in self.files.items():
                tensors = self._bin(file)
                if key not in tensors:
                    raise self._not_in_file(key, file)
                self.shapes[key] = tuple(tensors[key].shape)
                self.dtypes[key] = tensors[key].dtype

    # ---------------------------------------------------------------- files

    def _not_in_file(self, key: str, file: str) -> CheckpointMismatchError:
        return _mismatch(
            "the index lists a tensor that its file does not hold",
            {"key": key, "file": os.path.basename(file), "path": self.path},
            "the folder is damaged or mixed from two saves: write it again with "
            "save_pretrained", self.primitive)

    def _handle(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            try:
                opener = safe_open(file, framework="pt", device="cpu")
                handle = opener.__enter__()
            except Exception as exc:  # a damaged header or not a safetensors file
                raise _io_error(f"cannot open {os.path.basename(file)}: {exc}",
                                {"path": self.path, "file": os.path.basename(file)},
                                "the file is damaged; write the folder again with "
                                "save_pretrained", self.primitive) from exc
            self._handles[file] = (opener, handle)
            return handle
        return handle[1]

    def _scan_safetensors(self, file: str, keys: list[str] | None) -> None:
        handle = self._handle(file)
        stored = set(handle.keys())
        for key in (sorted(stored) if keys is None else keys):
            if key not in stored:
                raise self._not_in_file(key, file)
            sl = handle.get_slice(key)
            self.files[key] = file
            self.shapes[key] = tuple(int(n) for n in sl.get_shape())
            dtype = sl.get_dtype()
            self.dtypes[key] = _SAFE_DTYPES.get(dtype, dtype)

    def _bin(self, file: str) -> dict[str, torch.Tensor]:
        tensors = self._bins.get(file)
        if tensors is not None:
            return tensors
        try:
            try:
                loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
                loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise _io_error(f"cannot read {os.path.basename(file)} with "
                            f"torch.load(weights_only=True): {exc}",
                            {"path": self.path, "file": os.path.basename(file)},
                            "use a safetensors folder (save_pretrained writes one), or a "
                            ".bin file of plain tensors", self.primitive) from exc
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise _io_error(f"{os.path.basename(file)} is not a dict of named tensors",
                            {"path": self.path, "file": os.path.basename(file)},
                            "use a safetensors folder written by save_pretrained",
                            self.primitive)
        self._bins[file] = loaded
        return loaded

    def close(self) -> None:
        """Close the files (memory maps are released)."""
        for opener, _ in self._handles.values():
            try:
                opener.__exit__(None, None, None)
            except Exception:  # closing is best effort
                pass
        self._handles.clear()
        self._bins.clear()

    def __enter__(self) -> WeightsSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- reads

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The region ``index`` of the stored tensor ``key`` (only that region is read)."""
        file = self.files[key]
        if self.kind == "bin":
            return self._bin(file)[key][index]
        sl = self._handle(file).get_slice(key)
        if not self.shapes[key]:  # a 0-dim tensor cannot be sliced
            return self._handle(file).get_tensor(key)
        return sl[index] if index else sl[:]


def open_weights(path: str | os.PathLike, primitive: str = "load_weights") -> WeightsSource:
    """Open a Hugging Face weights folder (see the module docstring for what it may be)."""
    return WeightsSource(path, primitive)
