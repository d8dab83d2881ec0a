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

import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..core.meta import shard_spec
from .empty_init import _param_like
from .weights_plan import Located, ModelTensor, WeightsPlan, model_keys
from .weights_source import (
    WeightsSource,
    _mismatch,
    _short,
    is_torchloom_checkpoint,
    open_weights,
    weight_listing,
)

# The reader is in layers: weights_source (the folder) < weights_plan (keys, shapes,
# slices) < weights (load_weights, the missing-tensor rules). The public names of all
# three are importable from here.
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
                        slots: dict[str, Any] = mod._parameters if is_param else mod._buffers
                        slots[name] = new
                else:
                    plan.read(loc, spec, t.tensor)
        report = LoadReport(loaded=[loc.model_key[cut:] for _, loc in todo],
                            missing=[k[cut:] for k in missing], unexpected=[])
        if not prefix:
            report.unexpected = list(plan.unexpected)
    warn_missing(report.missing, os.fspath(path), primitive)
    return report
