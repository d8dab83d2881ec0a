"""LoRA adapters out of any layout: :func:`save_adapter` writes the folder peft's
``PeftModel.from_pretrained`` loads (``adapter_model.safetensors`` and
``adapter_config.json``), and :func:`merged_plan` lets :func:`torchloom.save_pretrained`
write the merged model (each adapted weight ``W + alpha / r * B @ A``, under its original
key, the adapters left out).

Both gather only what they write, one tensor at a time, with the plan
:func:`torchloom.save_pretrained` uses (:mod:`torchloom.runtime.gather_plan`): the
adapters' tensor-parallel, FSDP2 or pipeline pieces (a few MiB for a 70B model at
``r=16``) to rank 0; for the merged model each base weight and its two adapters, merged
on rank 0 in fp32 and written in the base's dtype. Collective over the default group
(every rank calls them); only rank 0 writes.

Keys: the adapter of layer ``X`` is ``base_model.model.X.lora_A.weight`` /
``...lora_B.weight`` (peft's form for a causal LM: no adapter name), at full shape.

>>> import os, tempfile, torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> tl.create_schedule(model).lora(r=2, alpha=4, targets=["0"])
>>> folder = os.path.join(tempfile.mkdtemp(), "adapter")
>>> save_adapter(model, folder)
>>> sorted(os.listdir(folder))
['adapter_config.json', 'adapter_model.safetensors']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import LoraError
from .adapters import ADAPTER, lora_state
from .collectives import group_rank, group_size
from .gather_plan import _Entry, _exchange, _fetch, _Plan, _plan_for
from .pretrained_info import unwrap

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "adapter_keys", "merged_plan", "save_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PRIMITIVE = "save_adapter"
_ADAPTER_KEY = re.compile(rf"^(.+)\.lora_([AB])\.{ADAPTER}\.weight$")
_KEEP_BESIDE = re.compile(r"^(tokenizer.*|special_tokens_map\.json|vocab\.json|merges\.txt|"
                          r"chat_template\.jinja|added_tokens\.json|README\.md|merged)$")


def adapter_keys(plan: _Plan) -> dict[str, tuple[str, str]]:
    """Layer path -> (its ``lora_A`` key, its ``lora_B`` key), from a gather plan."""
    found: dict[str, dict[str, str]] = {}
    for key in plan.order:
        match = _ADAPTER_KEY.match(key)
        if match:
            found.setdefault(match.group(1), {})[match.group(2)] = key
    return {layer: (keys["A"], keys["B"]) for layer, keys in found.items()
            if "A" in keys and "B" in keys}


def _agreed_state(model: nn.Module) -> Any:
    found = lora_state(unwrap(model))
    states = [s for s in _exchange(found[1] if found else None, _PRIMITIVE) if s is not None]
    if not states:
        raise LoraError("the model has no LoRA adapters to write", primitive=_PRIMITIVE,
                        values={"model": type(unwrap(model)).__name__},
                        fix="add them first: sch.lora(16, 32, ['q_proj', 'v_proj']), or "
                        "write the whole model with torchloom.save_pretrained")
    return states[0]


def _conv1d_layers(model: nn.Module) -> set[str]:
    mine = sorted(path for path, m in unwrap(model).named_modules()
                  if type(getattr(m, "base_layer", None)).__name__ == "Conv1D")
    return {p for rows in _exchange(mine, _PRIMITIVE) for p in rows}


def merged_plan(plan: _Plan, local: dict[str, _Entry], model: nn.Module
                ) -> tuple[_Plan, dict[str, _Entry]]:
    """The plan and entries of the merged model: each LoRA layer's base tensors under their
    original keys (``X.base_layer.weight`` -> ``X.weight``), the weight fetched as
    ``W + scaling * B @ A`` (fp32, cast back to ``W``'s dtype), the adapters dropped.
    Collective (every rank calls it with its own plan)."""
    layers = adapter_keys(plan)
    if not layers:
        return plan, local
    state = _agreed_state(model)
    conv1d = _conv1d_layers(model)
    rename: dict[str, str] = {}
    for layer in layers:
        prefix = f"{layer}.base_layer."
        for key in plan.order:
            if key.startswith(prefix):
                rename[key] = layer + "." + key[len(prefix):]
    skip = {k for pair in layers.values() for k in pair}
    order = [rename.get(k, k) for k in plan.order if k not in skip]

    def moved(table: dict[str, Any]) -> dict[str, Any]:
        return {rename.get(k, k): v for k, v in table.items() if k not in skip}

    new_plan = _Plan(order, moved(plan.shape), moved(plan.dtype), moved(plan.is_param),
                     moved(plan.holders), {rename.get(k, k) for k in plan.dropped})
    new_local: dict[str, _Entry] = {}
    for key, entry in local.items():
        if key in skip:
            continue
        new_key = rename.get(key, key)
        layer = new_key.rsplit(".", 1)[0]
        if key.endswith(".base_layer.weight") and layer in layers:
            a_key, b_key = layers[layer]
            entry = replace(entry, fetch=_merged_fetch(entry, local[a_key], local[b_key],
                                                       state.scaling, layer in conv1d))
        new_local[new_key] = replace(entry, key=new_key)
    return new_plan, new_local


def _merged_fetch(base: _Entry, a: _Entry, b: _Entry, scaling: float, conv1d: bool) -> Any:
    def fetch() -> torch.Tensor:
        weight, down, up = base.fetch(), a.fetch(), b.fetch()
        delta = up.float() @ down.float() * scaling
        return (weight.float() + (delta.T if conv1d else delta)).to(weight.dtype)

    return fetch


def _config(state: Any, base_model: str | None) -> dict[str, Any]:
    import peft

    config = peft.LoraConfig(r=state.r, lora_alpha=state.alpha, lora_dropout=state.dropout,
                             target_modules=sorted(state.targets), bias="none",
                             task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    out = config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()}


def _path_problem(path: str) -> LoraError | None:
    if os.path.isdir(path):
        others = [n for n in os.listdir(path)
                  if n not in (ADAPTER_FILE, ADAPTER_CONFIG) and not _KEEP_BESIDE.match(n)]
        if others:
            return LoraError(
                f"{path!r} holds other files ({', '.join(sorted(others)[:5])}): an adapter "
                "folder replaces only a previous adapter", primitive=_PRIMITIVE,
                values={"path": path, "files": sorted(others)[:5]},
                fix="pass a new folder, or move those files out of it")
    elif os.path.exists(path):
        return LoraError(f"{path!r} is a file, not a folder", primitive=_PRIMITIVE,
                         values={"path": path}, fix="pass a folder path")
    return None


def save_adapter(model: nn.Module, path: str | os.PathLike, *, group: Any = None,
                 base_model: str | None = None) -> None:
    """Write the LoRA adapters of ``model`` (built, any layout) as a peft adapter folder at
    ``path``: ``PeftModel.from_pretrained(base, path)`` loads them into the unmodified
    model. ``base_model`` is recorded as ``base_model_name_or_path`` (the folder the base
    weights come from). A collective of the default group; rank 0 writes; ``group`` is the
    tensor-parallel group the model was scheduled with.

    Raises:
        LoraError: the model has no adapters, or ``path`` holds other files (on every
            rank).
    """
    from safetensors.torch import save_file

    path = os.path.normpath(os.fspath(path))
    problem = _path_problem(path) if group_rank() == 0 else None
    plan, local, problems = _plan_for(model, group, _PRIMITIVE, extra=problem)
    if problems[0] is not None:
        raise problems[0]
    state = _agreed_state(model)
    layers = adapter_keys(plan)
    tensors: dict[str, torch.Tensor] = {}
    for layer, (a_key, b_key) in layers.items():
        for key, name in ((a_key, "lora_A"), (b_key, "lora_B")):
            value = _fetch(plan, local, key, to=0)
            if value is not None and group_rank() == 0:
                tensors[f"base_model.model.{layer}.{name}.weight"] = \
                    value.detach().to("cpu").contiguous().clone()
    failure: Exception | None = None
    if group_rank() == 0:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            os.makedirs(tmp)
            save_file(tensors, os.path.join(tmp, ADAPTER_FILE), metadata={"format": "pt"})
            with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
                json.dump(_config(state, base_model), f, indent=2, sort_keys=True)
                f.write("\n")
            os.makedirs(path, exist_ok=True)
            for name in (ADAPTER_FILE, ADAPTER_CONFIG):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            failure = LoraError(f"writing {path!r} failed: {type(exc).__name__}: {exc}",
                                primitive=_PRIMITIVE, values={"path": path},
                                fix="check the folder's permissions and free space")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if group_size() > 1:
        from .collectives import guard_collective

        box: list[Any] = [failure]
        with guard_collective("broadcast_object_list", _PRIMITIVE):
            dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        raise failure
