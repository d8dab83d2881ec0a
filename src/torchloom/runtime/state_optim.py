"""The optimizer in a checkpoint (part of :mod:`torchloom.runtime.state`): its layout in
the marker, its tensor state in DCP, and the match of a saved layout to an optimizer at
load time.

The marker holds the optimizer's parameter groups (hyperparameters and parameter names),
which tensor states each parameter has and its other (non-tensor) state. The ranks of a
save may hold different parameters (the stages of a pipeline): each rank's layout is
gathered and merged, the parameter names of a group in rank order, each once. At load
time a rank's optimizer must have the saved number of groups and each of its parameters
must be in its saved group, under one of its names (a weight tied across pipeline stages
is ``transformer.wte.weight`` on one and ``lm_head.weight`` on another); an optimizer of
a whole model (not a pipeline's rank) must hold every saved parameter too.

>>> a = {"has_optimizer": True, "optimizer_class": "SGD", "model_keys": ["w"],
...      "param_groups": [{"lr": 0.1, "params": ["w"]}], "tensor_state": {}, "other_state": {}}
>>> b = dict(a, model_keys=["v"], param_groups=[{"lr": 0.1, "params": ["v"]}])
>>> merged = _merge_layouts([a, b, b])
>>> merged["model_keys"], merged["param_groups"]
(['w', 'v'], [{'lr': 0.1, 'params': ['w', 'v']}])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointIOError
from ..core.marks import TIED_KEYS, get_mark
from ..core.meta import shard_spec
from .gather import _optimizer_params, is_dtensor
from .state_dcp import (
    _OPTIM,
    _check_state_size,
    _expected_full,
    _mismatch,
    _shorten,
    _tensor_pieces,
)
from .state_files import _clip, _clip_text, _from_json, _NotData, _to_json


def _state_to_save(p: torch.Tensor, value: torch.Tensor) -> Any:
    """What DCP writes of the optimizer state ``value`` of parameter ``p``: the pieces of
    a state of the parameter's shape (its slice, its FSDP shard), a DTensor's pieces, or
    the tensor (a scalar, a state of another shape)."""
    spec = shard_spec(p) if value.shape == p.shape else None
    if is_dtensor(value) or (spec is not None and spec.world_size > 1):
        return _tensor_pieces(value, spec, contiguous=True)
    return value.detach()


def collect_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's optimizer tensors for DCP (``optim.state.<name>.<key>``) and its layout
    for the marker (see :func:`_merge_layouts`)."""
    state: dict[str, Any] = {}
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
                        state[f"{_OPTIM}state.{name}.{key}"] = _state_to_save(p, value)
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
    layout = {
        "model_keys": list(model.state_dict().keys()), "has_optimizer": optimizer is not None,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "param_groups": groups_json, "tensor_state": tensor_state, "other_state": other_json,
    }
    return state, layout


def _merge_layouts(layouts: list[dict[str, Any]]) -> dict[str, Any]:
    """One layout from every rank's (in rank order): the model keys and each group's
    parameters of all ranks, each once; raises :class:`CheckpointIOError` when the ranks'
    optimizers differ in class, number of groups or hyperparameters (every rank computes
    the same, so every rank raises it)."""
    first = layouts[0]

    def differ(what: str, values: dict[str, Any]) -> CheckpointIOError:
        return CheckpointIOError(
            f"the optimizers of the group's ranks differ: {what}", primitive="save",
            values=values, fix="make the optimizer alike on every rank (same class, same "
            "parameter groups and hyperparameters), e.g. AdamW(model.parameters(), lr=1e-3)")

    model_keys = list(dict.fromkeys(k for lay in layouts for k in lay["model_keys"]))
    merged = dict(first, model_keys=model_keys)
    for rank, lay in enumerate(layouts):
        if (lay["has_optimizer"], lay["optimizer_class"]) != (
                first["has_optimizer"], first["optimizer_class"]):
            raise differ("one passes another optimizer (or none)",
                         {"rank 0": first["optimizer_class"],
                          f"rank {rank}": lay["optimizer_class"]})
        if len(lay["param_groups"]) != len(first["param_groups"]):
            raise differ("their numbers of parameter groups",
                         {"rank 0": len(first["param_groups"]),
                          f"rank {rank}": len(lay["param_groups"])})
        for g, (mine, theirs) in enumerate(zip(first["param_groups"], lay["param_groups"],
                                               strict=True)):
            hyper = {k: v for k, v in mine.items() if k != "params"}
            other = {k: v for k, v in theirs.items() if k != "params"}
            if hyper != other:
                keys = sorted(k for k in hyper.keys() | other.keys()
                              if hyper.get(k) != other.get(k))
                raise differ(f"the hyperparameters of group {g}",
                             {"keys": keys[:6], "rank 0": [_clip(hyper.get(k)) for k in keys[:6]],
                              f"rank {rank}": [_clip(other.get(k)) for k in keys[:6]]})
    groups = []
    for g, saved in enumerate(first["param_groups"]):
        names = [n for lay in layouts for n in lay["param_groups"][g]["params"]]
        groups.append(dict(saved, params=list(dict.fromkeys(names))))
    tensor_state: dict[str, list[str]] = {}
    other_state: dict[str, Any] = {}
    for lay in layouts:
        for name, keys in lay["tensor_state"].items():
            known = tensor_state.setdefault(name, [])
            known += [k for k in keys if k not in known]
        for name, values in lay["other_state"].items():
            other_state.setdefault(name, values)
    merged.update(param_groups=groups, tensor_state=tensor_state, other_state=other_state)
    return merged


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (its first name first): tied names, and the names of
    a pipeline's weight tied across stages (the model's ``TIED_KEYS`` mark)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = get_mark(model, TIED_KEYS, []) or []
    for group in tied:
        for known in names.values():
            if any(n in known for n in group):
                known += [n for n in group if n not in known]
    return names


def match_groups(model: nn.Module, optimizer: torch.optim.Optimizer, marker: dict[str, Any],
                 path: str) -> list[list[tuple[str, torch.Tensor]]]:
    """The optimizer's parameters by group, each with the name its state has in the
    checkpoint; raises :class:`CheckpointMismatchError` when they do not fit the saved
    groups (see the module docstring)."""
    params = _optimizer_params(model, optimizer, "load")
    then = [list(g["params"]) for g in marker["param_groups"]]
    aliases = _aliases(model)
    whole_keys = getattr(model, "all_state_dict_keys", None)
    ok = len(params) == len(then)
    out: list[list[tuple[str, torch.Tensor]]] = []
    for g, entries in enumerate(params if ok else []):
        saved = set(then[g])
        matched = []
        for name, p in entries:
            found = next((n for n in [name, *aliases.get(id(p), [])] if n in saved), None)
            if found is None:
                ok = False
                break
            matched.append((found, p))
        covered = {n for _, p in entries for n in [*aliases.get(id(p), [])]} | {
            n for n, _ in matched}
        if not callable(whole_keys) and not saved <= covered:
            ok = False  # a whole model's optimizer holds every saved parameter
        elif callable(whole_keys) and not saved <= set(whole_keys()):
            ok = False
        out.append(matched)
    if not ok:
        now = [[name for name, _ in entries] for entries in params]
        raise _mismatch(
            "the optimizer's parameter groups differ from the checkpoint's",
            {"path": path, "optimizer_groups": _shorten([_shorten(g, 3) for g in now]),
             "checkpoint_groups": _shorten([_shorten([_clip_text(n, 80) for n in g], 3)
                                            for g in then])},
            "make the optimizer with the same parameter groups, in the same order, as "
            "the one that was saved")
    return out


def optimizer_targets(groups: list[list[tuple[str, torch.Tensor]]], marker: dict[str, Any],
                      metadata: dict[str, Any], stored_bytes: dict[str, int], path: str,
                      targets: dict[str, Any]) -> list[tuple[int, str, torch.Tensor]]:
    """Add to ``targets`` (what DCP reads into) a new buffer for each saved tensor state of
    the optimizer's parameters ``groups`` (from :func:`match_groups`), each checked
    against its parameter before it is allocated; returns ``(index, key, buffer)``. The
    state of a parameter's shape gets its layout (its slice, a DTensor like it)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    loads: list[tuple[int, str, torch.Tensor]] = []
    index = 0
    for entries in groups:
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
                _check_state_size(full_key, md, name, p, stored_bytes.get(full_key, 0), path)
                spec = shard_spec(p)
                dtype = md.properties.dtype
                shape = tuple(md.size)
                local: torch.Tensor
                if shape and shape == _expected_full(p) and (
                        is_dtensor(p) or (spec is not None and spec.world_size > 1)):
                    with torch.no_grad():
                        local = torch.zeros_like(p, dtype=dtype) if is_dtensor(p) else \
                            torch.zeros(p.shape, dtype=dtype, device=p.device)
                    targets[full_key] = _tensor_pieces(local, spec, contiguous=False)
                else:
                    device = p.device if shape else "cpu"
                    local = torch.zeros(shape, dtype=dtype, device=device)
                    targets[full_key] = local
                loads.append((index, key, local))
            index += 1
    return loads


def load_optimizer(optimizer: torch.optim.Optimizer, groups: list[list[tuple[str, Any]]],
                   marker: dict[str, Any], loads: list[tuple[int, str, torch.Tensor]],
                   path: str) -> None:
    """Hand the read state (``loads``) and the marker's other state and hyperparameters to
    ``optimizer.load_state_dict``."""
    try:
        other_state = _from_json(marker["other_state"])
        saved_groups = _from_json(marker["param_groups"])
    except (ValueError, TypeError, RecursionError) as exc:
        raise CheckpointIOError(
            f"the optimizer data of the marker is malformed: {exc}", primitive="load",
            values={"path": path}, fix="the checkpoint is damaged; load an earlier one"
        ) from exc
    state: dict[int, dict[str, Any]] = {}
    for index, key, value in loads:
        state.setdefault(index, {})[key] = value
    index = 0
    for entries in groups:
        for name, _ in entries:
            for key, value in other_state.get(name, {}).items():
                state.setdefault(index, {})[key] = value
            index += 1
    param_groups = []
    start = 0
    for saved, entries in zip(saved_groups, groups, strict=True):
        group_sd = dict(saved)
        group_sd["params"] = list(range(start, start + len(entries)))
        start += len(entries)
        param_groups.append(group_sd)
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
