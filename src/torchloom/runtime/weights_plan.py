"""Which stored tensors feed which model tensors: the plan of a weights load, checked
before anything is read.

:func:`model_keys` lists a module tree's tensors under their checkpoint keys (tied
tensors once, with all their keys; fused tensors with the parts a checkpoint stores).
:class:`WeightsPlan` renames the folder's keys as transformers' ``from_pretrained`` does
(a transformers model's conversion mapping, else the legacy names and the base-model
prefix), :meth:`~WeightsPlan.locate` says where a model tensor's values are (one stored
tensor, several concatenated, or merged experts), refusing any shape that does not make
the model's, and :meth:`~WeightsPlan.read` fills this rank's slice, reading only its
ranges and refusing integer data cast to floating point (or back) and non-finite values.
The folder itself is read by :mod:`torchloom.runtime.weights_source`.

>>> _expert_index("mlp.experts.*.w1.weight", "mlp.experts.7.w1.weight")
7
>>> [t.keys for t in model_keys(nn.Linear(2, 2), "fc")]
[['fc.weight'], ['fc.bias']]
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..core.meta import ShardSpec
from ..core.schedule import join_path
from .adapters import checkpoint_key, lora_layer_paths
from .weights_source import WeightsSource, _all_finite, _io_error, _is_float, _mismatch, _short

__all__ = ["ModelTensor", "Located", "WeightsPlan", "model_keys"]


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
    # a LoRA layer's base keeps the key it had before the wrap (no ".base_layer")
    layers = {join_path(prefix, p) for p in lora_layer_paths(module)}
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
            entry.keys.append(checkpoint_key(join_path(path, name), layers))
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
        hf_root = None
    else:
        hf_root = root if isinstance(root, PreTrainedModel) else None
    if hf_root is not None:
        transforms = get_model_conversion_mapping(hf_root)
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
        # without a spec, one pass over everything (its range is not read then)
        ranges = list(spec.ranges()) if spec is not None else [(0, 0)]
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
