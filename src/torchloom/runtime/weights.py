"""Pretrained weights into a scheduled model: each rank reads only the slices it keeps.

:func:`torchloom.build` with ``weights=PATH`` uses this module; :func:`load_weights` is the
same reader for any sub-module tree (a pipeline stage, a block), given its key prefix.

PATH is a Hugging Face folder (safetensors, sharded with an index, or pytorch_model.bin
through torch.load(weights_only=True)) or a torchloom checkpoint. Keys are renamed as
transformers' from_pretrained renames them; each rank reads only the ranges of its shard;
everything read is untrusted and checked: see docs/design/weights.md.

>>> import os, tempfile, torch, torchloom as tl
>>> from safetensors.torch import save_file
>>> d = tempfile.mkdtemp()
>>> src = torch.nn.Linear(4, 6)
>>> save_file({k: v.contiguous() for k, v in src.state_dict().items()},
...           os.path.join(d, "model.safetensors"))
>>> with tl.init_empty_weights():
...     model = torch.nn.Sequential(torch.nn.Linear(4, 6))
>>> sch = tl.create_schedule(model)
>>> report = load_weights(model[0], d)        # the sub-module under key prefix ""
>>> torch.equal(model[0].weight, src.weight), report.loaded
(True, ['weight', 'bias'])
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..core.meta import ShardSpec, shard_spec
from ..core.schedule import join_path
from . import state as _state
from .gather import CheckpointMismatchError
from .state import CheckpointIOError

__all__ = [
    "WeightsSource",
    "WeightsPlan",
    "LoadReport",
    "open_weights",
    "weight_listing",
    "is_torchloom_checkpoint",
    "model_keys",
    "load_weights",
]

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


# --------------------------------------------------------------------------- model keys


@dataclass
class ModelTensor:
    """One tensor of a module tree, under every key it has (tied tensors: several)."""

    tensor: torch.Tensor
    keys: list[str] = field(default_factory=list)
    persistent: bool = True
    parts: dict[str, tuple[list[str], int]] = field(default_factory=dict)  # key -> parts


def model_keys(module: nn.Module, prefix: str = "") -> list[ModelTensor]:
    """Every parameter and buffer of ``module`` with its checkpoint keys (``prefix`` +
    its dotted name; ``state_dict`` order), tied tensors once with all their keys. A
    module's ``torchloom_checkpoint_parts()`` says which of its tensors a checkpoint stores
    as several parts.

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    >>> [t.keys[0] for t in model_keys(m, "net")][:3]
    ['net.0.weight', 'net.0.bias', 'net.1.weight']
    """
    out: dict[int, ModelTensor] = {}
    declared_parts: list[tuple[torch.Tensor, str, tuple[list[str], int]]] = []
    for path, mod in module.named_modules(prefix=prefix):
        declared = getattr(mod, "torchloom_checkpoint_parts", None)
        if callable(declared):
            for name, (names, axis) in declared().items():
                try:
                    tensor = mod.get_parameter(name)
                except AttributeError:
                    try:
                        tensor = mod.get_buffer(name)
                    except AttributeError:
                        continue
                declared_parts.append(
                    (tensor, join_path(path, name), ([join_path(path, n) for n in names], axis)))
        tensors: list[tuple[str, torch.Tensor, bool]] = [
            (n, p, True) for n, p in mod._parameters.items() if p is not None]
        tensors += [(n, b, n not in mod._non_persistent_buffers_set)
                    for n, b in mod._buffers.items() if b is not None]
        for name, tensor, persistent in tensors:
            entry = out.get(id(tensor))
            if entry is None:
                entry = out[id(tensor)] = ModelTensor(tensor, persistent=persistent)
            entry.keys.append(join_path(path, name))
    for tensor, key, value in declared_parts:
        if id(tensor) in out:
            out[id(tensor)].parts[key] = value
    return list(out.values())


# --------------------------------------------------------------------------- key mapping


def _legacy_rename(key: str) -> str:
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
        "LayerNorm.beta", "LayerNorm.bias")


Rename = Callable[[str, dict[str, Any]], tuple[str, Any]]


def _renamer(root: nn.Module | None) -> Rename:
    """``rename(checkpoint_key, expected) -> (model_key, converter)``: transformers'
    ``from_pretrained`` renaming for a transformers model, else the legacy names and the
    base-model prefix rule (the same rule, written out). ``converter`` is None, or
    ``(WeightConverter, source pattern)`` when the tensor is converted on load."""
    prefix = getattr(root, "base_model_prefix", None) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # transformers is optional
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is not None and isinstance(root, PreTrainedModel):
        transforms = get_model_conversion_mapping(root)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]

        def rename_hf(key: str, expected: dict[str, Any]) -> tuple[str, Any]:
            new, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if new not in expected and key in expected:
                new, pattern = rename_source_key(key, [], [], prefix, expected)
            if pattern is None:
                return new, None
            owner = next((c for c in converters if pattern in c.source_patterns), None)
            return new, (owner, pattern)

        return rename_hf

    def rename(key: str, expected: dict[str, Any]) -> tuple[str, Any]:
        new = _legacy_rename(key)
        if new not in expected and key in expected:
            new = key
        if prefix is not None:
            stripped = new[len(prefix) + 1:] if new.startswith(prefix + ".") else None
            if stripped is not None and stripped in expected:
                new = stripped
            elif f"{prefix}.{new}" in expected:
                new = f"{prefix}.{new}"
        return new, None

    return rename


# --------------------------------------------------------------------------- the plan


@dataclass
class Located:
    """Where one model tensor's values are: one or several checkpoint tensors
    concatenated along ``axis``; or, for merged experts (``experts`` set), one checkpoint
    tensor per (pattern, expert): block ``[e, segment p]`` of the model's tensor is expert
    ``e``'s tensor of pattern ``p``, the segments laid along ``axis`` (0 when there is one
    pattern)."""

    model_key: str
    parts: list[tuple[str, tuple[int, ...]]]   # (checkpoint key, shape)
    axis: int
    experts: list[list[str]] | None = None     # [pattern][expert] -> checkpoint key


@dataclass
class _Merge:
    """The checkpoint tensors a merged-experts model tensor is made of."""

    converter: Any
    keys: dict[str, dict[int, str]] = field(default_factory=dict)  # pattern -> expert -> key

    def concat_axis(self) -> int | None:
        """The axis the patterns are concatenated along (None: one pattern), or -1 when
        the conversion is not the experts merge torchloom reads."""
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in self.converter.operations]
        if ops == [("MergeModulelist", 0)]:
            return None
        if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" \
                and isinstance(ops[1][1], int) and ops[1][1] >= 1:
            return ops[1][1]
        return -1


def _expert_index(pattern: str, key: str) -> int | None:
    """The number a ``*`` of ``pattern`` stands for in ``key`` (None: no match, or a
    pattern without a ``*``, as a converter that splits or concatenates named tensors)."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    return int(match.group(1)) if match and match.re.groups else None


class WeightsPlan:
    """Which checkpoint tensors feed which model tensors, checked before any read.

    Build it with :meth:`for_module`; then :meth:`locate` a tensor and :meth:`read` this
    rank's part of it."""

    def __init__(self, source: WeightsSource, root: nn.Module | None,
                 expected: list[ModelTensor], primitive: str) -> None:
        self.source = source
        self.primitive = primitive
        self.expected = expected
        lookup: dict[str, Any] = {}
        for t in expected:
            if not t.persistent:
                continue
            for key in t.keys:
                parts = t.parts.get(key)
                for k in (parts[0] if parts else [key]):
                    lookup[k] = True
        rename = _renamer(root)
        self.by_model_key: dict[str, str] = {}
        self.converted: dict[str, str] = {}
        self.merges: dict[str, _Merge] = {}
        self.unexpected: list[str] = []
        for ck in source.files:
            mk, conversion = rename(ck, lookup)
            if mk in lookup:
                if conversion is not None:
                    self.converted[mk] = ck
                    converter, pattern = conversion
                    index = _expert_index(pattern, ck)
                    if converter is not None and index is not None:
                        merge = self.merges.setdefault(mk, _Merge(converter))
                        merge.keys.setdefault(pattern, {})[index] = ck
                else:
                    self.by_model_key.setdefault(mk, ck)
            else:
                self.unexpected.append(ck)

    @classmethod
    def for_module(cls, module: nn.Module, source: WeightsSource, *, prefix: str = "",
                   root: nn.Module | None = None, primitive: str = "load_weights"
                   ) -> WeightsPlan:
        """The plan for ``module`` whose keys start with ``prefix`` inside ``root`` (the
        whole model, used for the renaming rules and the base-model prefix; default
        ``module``)."""
        root = module if root is None else root
        if root is module:
            everything = model_keys(module, prefix)
        else:
            everything = model_keys(root, "")
        plan = cls(source, root, everything, primitive)
        if root is not module:
            plan.expected = model_keys(module, prefix)
        return plan

    def _refuse_conversion(self, key: str) -> None:
        raise _mismatch(
            "transformers converts this checkpoint tensor when it loads it (a "
            "WeightConverter), which build(weights=...) does not do",
            {"key": key, "checkpoint_key": self.converted[key], "path": self.source.path},
            "load the model with from_pretrained (real weights), then schedule and build it",
            self.primitive)

    def locate(self, t: ModelTensor, full_shape: tuple[int, ...]) -> Located | None:
        """Where ``t``'s values are, or None if the checkpoint lacks them. Raises
        :class:`CheckpointMismatchError` on a shape mismatch, naming both shapes."""
        for key in t.keys:
            parts = t.parts.get(key)
            if parts is None:
                if key in self.converted:
                    return self._locate_merge(key, full_shape)
                ck = self.by_model_key.get(key)
                if ck is None:
                    continue
                self._check_shape(key, ck, self.source.shapes[ck], full_shape)
                return Located(key, [(ck, self.source.shapes[ck])], 0)
            names, axis = parts
            found = [self.by_model_key.get(n) for n in names]
            for n in names:
                if n in self.converted:
                    self._refuse_conversion(n)
            if all(ck is None for ck in found):
                continue
            if any(ck is None for ck in found):
                missing = [n for n, ck in zip(names, found) if ck is None]
                raise _mismatch(
                    f"{key!r} is read from {len(names)} checkpoint tensors and some are "
                    "missing",
                    {"key": key, "missing_keys": missing, "path": self.source.path},
                    "load a checkpoint of the model the schedule was made from (all of "
                    f"{names})", self.primitive)
            shapes = [self.source.shapes[ck] for ck in found]  # type: ignore[index]
            total = list(shapes[0])
            total[axis] = sum(s[axis] for s in shapes)
            ok = all(len(s) == len(shapes[0]) and all(
                a == b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != axis)
                for s in shapes)
            if not ok or tuple(total) != tuple(full_shape):
                raise _mismatch(
                    f"the checkpoint's parts of {key!r} do not make the model's shape",
                    {"key": key, "checkpoint_keys": found, "file":
                     os.path.basename(self.source.files[found[0]]),  # type: ignore[index]
                     "checkpoint_shapes": shapes, "model_shape": tuple(full_shape)},
                    "load a checkpoint with the model's configuration (hidden sizes, "
                    "heads, vocabulary)", self.primitive)
            return Located(key, [(ck, s) for ck, s in zip(found, shapes)], axis)  # type: ignore[misc]
        return None

    def _locate_merge(self, key: str, full_shape: tuple[int, ...]) -> Located:
        """The merged-experts tensor ``key`` (see :class:`Located`), after checking that
        the conversion is the experts merge, every expert is there and the shapes make
        the model's."""
        merge = self.merges.get(key)
        axis = merge.concat_axis() if merge is not None else -1
        if merge is None or axis == -1:
            self._refuse_conversion(key)
        assert merge is not None
        patterns = list(merge.converter.source_patterns)
        experts = full_shape[0] if full_shape else 0
        table: list[list[str]] = []
        for pattern in patterns:
            found = merge.keys.get(pattern, {})
            missing = [e for e in range(experts) if e not in found]
            if missing or len(found) != experts:
                raise _mismatch(
                    f"{key!r} merges {experts} experts' tensors, and the checkpoint's "
                    f"{pattern!r} has experts {sorted(found)}",
                    {"key": key, "pattern": pattern, "missing_experts": _short(missing),
                     "path": self.source.path},
                    "load a checkpoint of the model the schedule was made from (same "
                    "number of experts)", self.primitive)
            table.append([found[e] for e in range(experts)])
        shapes = [self.source.shapes[row[0]] for row in table]
        seg_axis = (axis or 1) - 1  # the patterns' axis in an expert's tensor
        total = list(shapes[0])
        if axis is not None:
            total[seg_axis] = sum(s[seg_axis] for s in shapes)
        same = all(self.source.shapes[ck] == shapes[i] for i, row in enumerate(table)
                   for ck in row) and all(len(s) == len(shapes[0]) and all(
                       a == b for d, (a, b) in enumerate(zip(s, shapes[0])) if d != seg_axis)
                       for s in shapes)
        if not same or (experts, *total) != tuple(full_shape):
            raise _mismatch(
                f"the checkpoint's expert tensors do not make the model's {key!r}",
                {"key": key, "experts": experts, "patterns": patterns,
                 "checkpoint_shapes": shapes, "model_shape": tuple(full_shape)},
                "load a checkpoint with the model's configuration (experts, hidden and "
                "expert sizes)", self.primitive)
        parts = [(row[0], shapes[i]) for i, row in enumerate(table)]
        return Located(key, parts, axis or 0, experts=table)

    def _read_merge(self, loc: Located, spec: ShardSpec | None, out: torch.Tensor) -> None:
        """``read`` of a merged-experts tensor: each (expert, pattern) block's
        intersection with this rank's ranges, read from that expert's tensor."""
        assert loc.experts is not None
        data = out.detach()
        ndim = data.dim()
        c = loc.axis if len(loc.experts) > 1 else None
        segs: list[tuple[int, int]] = []
        start = 0
        for _, shape in loc.parts:
            width = shape[c - 1] if c is not None else 0
            segs.append((start, width))
            start += width
        ranges = list(spec.ranges()) if spec is not None else [(0, None)]
        axis = spec.axis if spec is not None else None
        local = 0
        for lo, hi in ranges:
            for p, row in enumerate(loc.experts):
                off, width = segs[p]
                for e, ck in enumerate(row):
                    if axis is None:
                        x, y, begin = 0, 0, 0
                    elif axis == 0:
                        x, y, begin = max(lo, e), min(hi, e + 1), e
                    elif axis == c:
                        x, y, begin = max(lo, off), min(hi, off + width), off
                    else:
                        x, y, begin = lo, hi, 0
                    if axis is not None and x >= y:
                        continue
                    src: tuple[slice, ...] = ()
                    if axis is not None and axis != 0:
                        src = (slice(None),) * (axis - 1) + (slice(x - begin, y - begin),)
                    dest = [slice(None)] * ndim
                    dest[0] = slice(e, e + 1) if axis != 0 else \
                        slice(local + e - lo, local + e - lo + 1)
                    if c is not None and axis != c:
                        dest[c] = slice(off, off + width)
                    if axis is not None and axis != 0:
                        dest[axis] = slice(local + x - lo, local + y - lo)
                    piece = self._piece(loc, out, ck, src)
                    data[tuple(dest)].copy_(piece.unsqueeze(0))
                    del piece
            if axis is not None:
                local += hi - lo

    def _piece(self, loc: Located, out: torch.Tensor, ck: str,
               index: tuple[slice, ...]) -> torch.Tensor:
        """``source.read(ck, index)``, checked: integer (or bool) data is never cast into a
        floating tensor nor the reverse, and floating data holds no NaN or infinity."""
        stored = self.source.dtypes.get(ck)
        file = os.path.basename(self.source.files[ck])
        if isinstance(stored, torch.dtype) and _is_float(stored) != _is_float(out.dtype):
            raise _mismatch(
                f"the checkpoint's {ck!r} holds {str(stored).removeprefix('torch.')} data "
                f"and the model's {loc.model_key!r} is {str(out.dtype).removeprefix('torch.')}"
                f": {'integer' if not _is_float(stored) else 'floating-point'} values are "
                "not cast into a "
                f"{'floating-point' if _is_float(out.dtype) else 'integer'} tensor",
                {"key": loc.model_key, "checkpoint_key": ck, "file": file,
                 "checkpoint_dtype": str(stored), "model_dtype": str(out.dtype),
                 "path": self.source.path},
                "the file does not hold this model's weights, or was converted wrongly: "
                "write it again with save_pretrained from the trained model", self.primitive)
        piece = self.source.read(ck, index)
        if _is_float(piece.dtype) and not _all_finite(piece):
            raise _io_error(
                f"the checkpoint's {ck!r} holds NaN or infinite values",
                {"key": loc.model_key, "checkpoint_key": ck, "file": file,
                 "path": self.source.path},
                "the weights are damaged (a diverged run saved them?): load an earlier "
                "checkpoint, or write the folder again from a healthy model", self.primitive)
        return piece

    def _check_shape(self, key: str, ck: str, shape: tuple[int, ...],
                     full_shape: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(full_shape):
            raise _mismatch(
                f"the checkpoint's {ck!r} has another shape than the model's {key!r}",
                {"key": key, "file": os.path.basename(self.source.files[ck]),
                 "checkpoint_shape": tuple(shape), "model_shape": tuple(full_shape)},
                "load a checkpoint with the model's configuration (hidden sizes, heads, "
                "vocabulary), or build the model from that checkpoint's config: "
                "AutoConfig.from_pretrained(path)", self.primitive)

    def read(self, loc: Located, spec: ShardSpec | None, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (this rank's local shape, any dtype and device) with this rank's
        part of ``loc``: only the ranges of ``spec`` are read (all of it when None)."""
        if loc.experts is not None:
            self._read_merge(loc, spec, out)
            return out
        offsets = []
        start = 0
        for _, shape in loc.parts:
            offsets.append(start)
            start += shape[loc.axis] if shape else 1
        ndim = len(loc.parts[0][1])

        def idx(axis: int, lo: int, hi: int) -> tuple[slice, ...]:
            return (slice(None),) * axis + (slice(lo, hi),)

        data = out.detach()
        if spec is None:
            for (ck, shape), off in zip(loc.parts, offsets):
                piece = self._piece(loc, out, ck, ())
                if len(loc.parts) == 1:
                    data.copy_(piece)
                else:
                    data.narrow(loc.axis, off, shape[loc.axis]).copy_(piece)
                del piece
            return out
        local = 0
        for lo, hi in spec.ranges():
            width = hi - lo
            if spec.axis == loc.axis or len(loc.parts) == 1:
                for (ck, shape), off in zip(loc.parts, offsets):
                    size = shape[loc.axis] if ndim else 1
                    if len(loc.parts) == 1:
                        a, b = lo, hi
                    else:
                        a, b = max(lo, off), min(hi, off + size)
                        if a >= b:
                            continue
                        a, b = a - off, b - off
                    piece = self._piece(loc, out, ck, idx(spec.axis, a, b))
                    dest = local + (a + (off if len(loc.parts) > 1 else 0) - lo)
                    data.narrow(spec.axis, dest, b - a).copy_(piece)
                    del piece
            else:
                for (ck, shape), off in zip(loc.parts, offsets):
                    piece = self._piece(loc, out, ck, idx(spec.axis, lo, hi))
                    data.narrow(spec.axis, local, width).narrow(
                        loc.axis, off, shape[loc.axis]).copy_(piece)
                    del piece
            local += width
        return out


# --------------------------------------------------------------------------- one-call load


@dataclass
class LoadReport:
    """What :func:`load_weights` did, by model key (relative to the prefix)."""

    loaded: list[str]
    missing: list[str]
    unexpected: list[str]


def warn_missing(missing: list[str], path: str, primitive: str) -> None:
    """The one warning for tensors that the checkpoint lacks (they are initialised);
    only with ``strict=False`` (by default they are refused, :func:`refuse_missing`)."""
    if missing:
        warnings.warn(
            f"{primitive}: {len(missing)} tensor(s) are not in {path}: {_short(missing)}; "
            "those that were on meta were initialised by the model's init code, real ones "
            "kept their values (strict=False). fix: leave strict at its default (True) to "
            "make this an error, or load a checkpoint that holds them",
            UserWarning, stacklevel=3)


def refuse_missing(missing: list[str], path: str, primitive: str,
                   source: WeightsSource | None = None,
                   unmatched: list[str] | None = None) -> None:
    """The error for tensors of the model that the folder lacks (``strict=True``, the
    default): the keys, the file that lists the folder's tensors, and the folder's
    tensors that matched no key of the model (often the missing ones under another name)."""
    if missing:
        values: dict[str, Any] = {"missing_keys": _short(missing), "path": path}
        if source is not None and source.listing:
            values["file"] = source.listing
        if unmatched:
            values["unmatched_checkpoint_keys"] = _short(list(unmatched))
        raise _mismatch(
            f"{len(missing)} tensor(s) of the model are not in the checkpoint: "
            f"{_short(missing, 3)} (strict=True, the default)",
            values,
            "load a folder saved from this model (build the model from the folder's "
            "config: AutoConfig.from_pretrained(path)); to train those tensors from "
            "random initialisation instead, pass strict=False to build / load_weights "
            "(torchloom train: --allow-missing)", primitive)


def _iter_slots(module: nn.Module, tensor: torch.Tensor) -> Iterator[tuple[nn.Module, str, bool]]:
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is tensor:
                yield mod, name, True
        for name, b in mod._buffers.items():
            if b is tensor:
                yield mod, name, False


def load_weights(module: nn.Module, path: str | os.PathLike, *, prefix: str = "",
                 root: nn.Module | None = None, strict: bool = True,
                 device: str | torch.device = "cpu") -> LoadReport:
    """Load the tensors of ``module`` (keys ``prefix`` + dotted name inside ``root``) from
    the Hugging Face folder ``path``, each rank reading only its slices.

    A real tensor is overwritten in place (same object); a ``meta`` tensor is replaced
    in every slot that holds it by a new tensor on ``device`` (same Parameter class,
    ``requires_grad``, attributes, shard spec and tags). A tensor the checkpoint lacks is
    a :class:`CheckpointMismatchError` naming its key and the folder's file (raised before
    anything is read); with ``strict=False`` it is left as it is, listed in
    :attr:`LoadReport.missing` and in one warning.
    ``root``: the whole model ``module`` belongs to, for the key renaming rules (default
    ``module``). This is how a pipeline build can load one stage:
    ``load_weights(stage_module, path, prefix="transformer.h.2", root=model)``.
    """
    from .materialise import _param_like

    primitive = "load_weights"
    dev = torch.device(device)
    with open_weights(path, primitive) as source:
        plan = WeightsPlan.for_module(module, source, prefix=prefix, root=root,
                                      primitive=primitive)
        todo: list[tuple[ModelTensor, Located]] = []
        missing: list[str] = []
        for t in plan.expected:
            spec = shard_spec(t.tensor)
            full = tuple(spec.full_shape) if spec is not None else tuple(t.tensor.shape)
            loc = plan.locate(t, full) if t.persistent else None
            if loc is not None:
                todo.append((t, loc))
            elif t.persistent:
                missing.append(t.keys[0])
        cut = len(prefix) + 1 if prefix else 0
        if strict:
            refuse_missing([k[cut:] for k in missing], os.fspath(path), primitive, source,
                           plan.unexpected)
        with torch.no_grad():
            for t, loc in todo:
                spec = shard_spec(t.tensor)
                if spec is not None and spec.world_size == 1:
                    spec = None
                if t.tensor.is_meta:
                    data = torch.empty(t.tensor.shape, dtype=t.tensor.dtype, device=dev)
                    plan.read(loc, spec, data)
                    new = _param_like(t.tensor, data)
                    for mod, name, is_param in list(_iter_slots(module, t.tensor)):
                        (mod._parameters if is_param else mod._buffers)[name] = new
                else:
                    plan.read(loc, spec, t.tensor)
        report = LoadReport(loaded=[loc.model_key[cut:] for _, loc in todo],
                            missing=[k[cut:] for k in missing], unexpected=[])
        if not prefix:
            report.unexpected = list(plan.unexpected)
    warn_missing(report.missing, os.fspath(path), primitive)
    return report
