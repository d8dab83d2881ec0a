"""The expert-parallel zoo sweep: every mixture-of-experts family of transformers that
builds from a tiny config, at expert parallelism 2 on two gloo ranks, against one process.

A family is a ``CONFIG_MAPPING`` key with a model class (:func:`zoo_sweep.discover`'s
rules, without asking for a tensor-parallel plan) that looks like a mixture of experts:
its config or a sub-config carries ``base_model_ep_plan``, or has a number of experts
(``num_experts``, ``num_local_experts``, ... above 1), or its tiny model (on the meta
device) has an experts module torchloom's finder finds (only tried where its modeling
code names ``top_k_index``, transformers' routing argument). For each family,
on each of the two ranks (:func:`run_ep`):

1. the tiny model of :func:`zoo_sweep.tiny_config` (4 experts, 2 routed per token; fp32,
   training mode) with every dropout probability of its config set to 0, and its
   mixture of experts switched on where the defaults build a dense model (``is_moe`` or
   ``enable_moe_block`` off, every layer in ``mlp_only_layers``); rank 0's
   weights are broadcast (a family whose initialisation leaves memory uninitialised
   would otherwise differ between the ranks);
2. the **reference**, in one process: it computes the loss on each rank's batch
   (rank ``r``'s batch is :func:`zoo_sweep.example_inputs` of seed ``seed + 1 + r``, the
   random state seeded the same before each forward) and the gradient of their mean
   (what data parallelism averages);
3. the same model built again, ``parallelize(create_schedule(model, mesh),
   Layout(dp_replicate=2, ep=2))``: each rank keeps ``E / 2`` experts of every experts
   module (checked: every split tensor's leading dimension, and ``num_experts``); the
   rest is replicated by DDP;
4. one forward and backward of the rank's batch, then ``reduce_gradients()``; the loss
   must equal the reference's on that batch within ``LOSS_RTOL`` relative, and every
   gradient the reference's (an expert tensor: the rank's slice, ``tl.shard_spec``)
   within ``GRAD_RTOL`` / ``GRAD_ATOL`` elementwise. The ranks exchange their results
   so both report the same row (the worst relative error over both). Where a dropout
   is left that the config does not name (a hard-coded probability), only finiteness
   is checked. When the comparison fails, the same step at ``Layout(dp_replicate=2)``
   (no expert parallelism) and at ``Layout(dp_shard=2, ep=2)`` (expert parallelism over
   FSDP2) tells a failure of expert parallelism from one of the data parallelism under
   it (the row's ``reason``, ``controls``).

Outcomes: ``passed``; ``refused`` (``parallelize`` raised ``ExpertParallelError``: no
experts module found, or experts that do not split evenly - torchloom declines, naming
why); ``failed`` (anything else: an error, or numbers that differ); ``does not build``
(the tiny model itself fails to build or run in one process).

Usage (through the zoo sweep's launcher, which gives each family in lock-step to the two
ranks, with ``--timeout`` per family)::

    python benchmarks/zoo_sweep.py --layouts ep --timeout 120     # every MoE family
    python benchmarks/ep_sweep.py --families mixtral,olmoe --json out.json
    python benchmarks/ep_sweep.py --ci                            # mixtral, qwen3_moe, olmoe
    python benchmarks/ep_sweep.py --list

>>> reason({"stage": "parallelize", "error": "ExpertParallelError: 3 experts of 'a.b' "
...         "do not split evenly over 2 expert-parallel ranks"})
"ExpertParallelError: N experts of '…' do not split evenly over N expert-parallel ranks"
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import math
import os
import platform
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from zoo_sweep import (
    _EXPERTS,
    NOT_BUILDING,
    SEQ,
    TARGET,
    WORLD,
    Family,
    _cell,
    _culprit,
    _first_line,
    _get,
    _machine,
    _quiet,
    _write_results,
    example_inputs,
    has_dropout,
    loss_of,
    model_class_for,
    model_class_of,
    parse_args,
    sweep,
    tiny_config,
)

EP = 2
#: the loss of each rank against the reference's on that rank's batch: relative
LOSS_RTOL = 1e-5
#: every gradient, elementwise: |a - b| <= GRAD_ATOL + GRAD_RTOL * |b| (fp32)
GRAD_RTOL, GRAD_ATOL = 1e-5, 2e-6
#: ``--ci --layouts ep``: the plan-named experts of Mixtral, Qwen3-MoE and OLMoE
EP_CI_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")

# ----------------------------------------------------------------------- discovery


def _ep_plan_holder(config_cls: type, depth: int = 0) -> str | None:
    """Where ``config_cls`` carries an expert-parallel plan: "config", a sub-config path,
    or None."""
    if getattr(config_cls, "base_model_ep_plan", None):
        return "config"
    if depth > 2:
        return None
    for name, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            inner = _ep_plan_holder(sub, depth + 1)
            if inner is not None:
                return name if inner == "config" else f"{name}.{inner}"
    return None


def _expert_count(config: Any, depth: int = 0) -> int | None:
    """The largest number of experts ``config`` or a sub-config names (None: none)."""
    counts = [v for v in (_get(config, n) for n in _EXPERTS)
              if isinstance(v, int) and not isinstance(v, bool) and v > 1]
    if depth < 3:
        for value in vars(config).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                inner = _expert_count(value, depth + 1)
                if inner:
                    counts.append(inner)
    return max(counts) if counts else None


@functools.lru_cache(maxsize=None)
def _routes_experts(package: str) -> bool:
    """Whether the modeling code of ``package`` (``transformers.models.x``) calls an
    experts module with transformers' routing arguments (``top_k_index``)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in Path(folder).glob("modeling_*.py"):
            if "top_k_index" in path.read_text(errors="replace"):
                return True
    return False


def discover_ep() -> tuple[list[Family], list[dict[str, str]]]:
    """Every family that looks like a mixture of experts (see the module docstring) and
    has a model class; and those skipped, with the reason. ``Family.plan_in`` says where
    the expert-parallel plan is ("" where there is none)."""
    families, skipped = _discover_ep()
    return list(families), [dict(s) for s in skipped]


@functools.lru_cache(maxsize=1)
def _discover_ep() -> tuple[tuple[Family, ...], tuple[dict[str, str], ...]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    families: list[Family] = []
    skipped: list[dict[str, str]] = []
    for key in CONFIG_MAPPING.keys():
        try:
            config_cls = CONFIG_MAPPING[key]
        except Exception as err:  # noqa: BLE001 - an optional dependency is missing
            skipped.append({"family": key, "reason": f"config class not importable: {err}"})
            continue
        holder = _ep_plan_holder(config_cls)
        count = None
        if holder is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    count = _expert_count(config_cls())
            except Exception:  # noqa: BLE001 - a config without usable defaults
                count = None
            if not count and not _routes_experts(config_cls.__module__.rpartition(".")[0]):
                continue
        found = model_class_for(key, config_cls)
        if isinstance(found, str):
            skipped.append({"family": key, "reason": found})
            continue
        family = Family(key, config_cls.__name__, found[0], found[1], holder or "")
        # only the modeling code names the routing arguments (a vision or audio model
        # sharing a module with a mixture of experts): the tiny model must have experts
        if holder is None and not count and not _tiny_has_experts(family):
            continue
        families.append(family)
    return tuple(families), tuple(skipped)


def _tiny_has_experts(family: Family) -> bool:
    """Whether the family's tiny model (built on the meta device) has an experts module
    expert parallelism finds."""
    from torchloom.primitives.expert_parallel import experts_modules

    cls = model_class_of(family.model_class)
    if cls is None:
        return False
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = cls(tiny_config(family))
        return bool(experts_modules(model))
    except Exception:  # noqa: BLE001 - does not build: not known to have experts
        return False


# ----------------------------------------------------------------------- one family


@dataclass(frozen=True)
class EpJob:
    """One family at expert parallelism 2 (the launcher calls :meth:`run` on each rank)."""

    family: Family
    layout: str = "ep"

    def run(self, args: argparse.Namespace) -> dict[str, Any]:
        return run_ep(self.family, args.seed)


def _configs(config: Any, prefix: str = "", seen: set[int] | None = None
             ) -> Iterator[tuple[str, Any]]:
    """``config`` and its sub-configs (``text_config``, ...), each once, with the prefix of
    its fields' names."""
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    yield prefix, config
    for name, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            yield from _configs(value, f"{prefix}{name}.", seen)


def _no_dropout(config: Any) -> list[str]:
    """Set every dropout probability of ``config`` and its sub-configs to 0; the fields
    changed."""
    changed = []
    for prefix, sub in _configs(config):
        for name, value in list(vars(sub).items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float) \
                    and value > 0:
                setattr(sub, name, 0.0)
                changed.append(prefix + name)
    return changed


#: switches of a mixture of experts some families' defaults leave off (a dense model)
_MOE_SWITCHES = ("is_moe", "enable_moe_block", "use_moe")
#: sizes such a default leaves None, and the tiny size each gets (a ``TARGET`` key)
_MOE_SIZES = {"num_experts": "experts", "top_k_experts": "top_k",
              "moe_intermediate_size": "moe_intermediate"}


def _moe_on(config: Any) -> list[str]:
    """Switch on the mixture of experts of ``config`` and its sub-configs where the
    defaults build a dense model (a switch above off, or every layer of the tiny model
    in ``mlp_only_layers``: the last one becomes sparse); the fields changed."""
    changed = []
    for prefix, sub in _configs(config):
        if any(_get(sub, n) is False for n in _MOE_SWITCHES):
            for name in _MOE_SWITCHES:
                if _get(sub, name) is False:
                    setattr(sub, name, True)
                    changed.append(prefix + name)
            for name, key in _MOE_SIZES.items():
                if name in vars(sub) and _get(sub, name) is None:
                    setattr(sub, name, TARGET[key])
                    changed.append(prefix + name)
        layers, dense = _get(sub, "num_hidden_layers"), _get(sub, "mlp_only_layers")
        if isinstance(layers, int) and isinstance(dense, list) and layers > 1 \
                and set(range(layers)) <= set(dense):
            sub.mlp_only_layers = [i for i in dense if i < layers - 1]
            changed.append(prefix + "mlp_only_layers")
    return changed


def build_ep_model(family: Family, seed: int = 0) -> tuple[nn.Module, dict[str, list[str]]]:
    """The family's tiny model without dropout and with its mixture of experts on
    (:func:`_moe_on`), initialised from ``seed``, in training mode; and the fields
    changed from the tiny config (``dropout``, ``moe``)."""
    config = tiny_config(family)
    zeroed = {"dropout": _no_dropout(config), "moe": _moe_on(config)}
    model_cls = model_class_of(family.model_class)
    if model_cls is None:
        raise ImportError(f"{family.model_class} cannot be imported")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_cls(config)
    return model.float().train(), zeroed


#: the layouts a family runs at: the sweep's, and when it fails, the same data
#: parallelism without expert parallelism and expert parallelism over FSDP2 (which of the
#: two pieces fails)
LAYOUTS: dict[str, dict[str, Any]] = {
    "ep": {"dp_replicate": WORLD, "ep": EP}, "dp": {"dp_replicate": WORLD},
           "fsdp_ep": {"dp_shard": WORLD, "ep": EP}}
_MESHES: dict[str, Any] = {}


def _layout(kind: str = "ep") -> Any:
    from torchloom.parallel import Layout

    return Layout(**LAYOUTS[kind], seq_len=SEQ)


def _mesh(kind: str = "ep") -> Any:
    """This rank's mesh of the layout (made once: every family uses the same groups)."""
    from torchloom.parallel import init_mesh

    if kind not in _MESHES:
        _MESHES[kind] = init_mesh(_layout(kind), device_type="cpu")
    return _MESHES[kind]


def _same_weights(model: nn.Module) -> bool:
    """Broadcast rank 0's parameters and buffers; whether they already were the same."""
    import torch.distributed as dist

    same = True
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            mine = t.detach().clone()
            dist.broadcast(t.data, src=0)
            if not torch.equal(mine, t.data) and not (mine.isnan() & t.data.isnan()).all():
                same = False
    flags = [None] * WORLD
    dist.all_gather_object(flags, same)
    return all(flags)


def _forward(model: Any, inputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the same draws in the reference and on the rank
    return loss_of(model(**inputs))


def _reference(model: nn.Module, batches: list[dict[str, torch.Tensor]], seed: int
               ) -> tuple[list[float], dict[str, torch.Tensor | None]]:
    """One process: the loss on each rank's batch and the gradients of their mean."""
    model.zero_grad(set_to_none=True)
    losses = [_forward(model, b, seed + 100 + r) for r, b in enumerate(batches)]
    torch.stack(losses).mean().backward()
    return [x.item() for x in losses], {
        n: None if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()}


def _expert_split(done: Any) -> dict[str, Any]:
    """Each experts module's whole and local number of experts; raises when a split
    tensor does not hold ``E / ep`` experts."""
    from torchloom.core.meta import shard_spec
    from torchloom.primitives.expert_parallel import num_experts_of

    whole, local, tensors = set(), set(), 0
    for path in done.experts:
        module = done.module.get_submodule(path)
        count = num_experts_of(module)
        if count is None:
            raise AssertionError(f"{path}: no number of experts")
        whole.add(count)
        local.add(count // EP)
        split = [(n, p, spec) for n, p in module.named_parameters()
                 if (spec := shard_spec(p)) is not None and spec.group is not None]
        if not split:
            raise AssertionError(f"{path}: no tensor split over the expert-parallel ranks")
        for name, p, spec in split:
            tensors += 1
            if p.shape[0] != count // EP or spec.full_shape[0] != count:
                raise AssertionError(f"{path}.{name} holds {p.shape[0]} of "
                                     f"{spec.full_shape[0]} experts, not {count} / {EP}")
        own = getattr(module, "num_experts", None)
        if isinstance(own, int) and own != count // EP:
            raise AssertionError(f"{path}.num_experts is {own}, not {count} / {EP}")
    return {"num_experts": sorted(whole), "experts_per_rank": sorted(local),
            "split_tensors": tensors}


def _compare(done: Any, loss: torch.Tensor, ref_loss: float,
             grads: dict[str, torch.Tensor | None], finite_only: bool) -> dict[str, Any]:
    """This rank's loss and gradients against the reference: the numbers, and what is
    wrong (``problems``; ``loss_ok``, ``bad_grads``: the parameters whose gradient
    differs, ``expert_grads``: how many of those are split over the ranks)."""
    import torchloom as tl

    problems: list[str] = []
    value = loss.item()
    loss_rel = abs(value - ref_loss) / max(abs(ref_loss), 1e-12)
    loss_ok = math.isfinite(value) and (finite_only or loss_rel <= LOSS_RTOL)
    if not loss_ok:
        problems.append(f"loss {value!r} vs one process {ref_loss!r} "
                        f"(relative {loss_rel:.2g})")
    worst, worst_name, bad, expert_bad, checked = 0.0, "", [], 0, 0
    for name, p in done.module.named_parameters():
        if name not in grads:
            problems.append(f"{name}: no such parameter in one process")
            continue
        ref = grads[name]
        if p.grad is None and ref is None:
            continue
        checked += 1
        got = torch.zeros_like(p) if p.grad is None else p.grad.detach()
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        spec = tl.shard_spec(p)
        want = torch.zeros_like(got) if ref is None else (
            spec.slice(ref) if spec is not None and ref.shape != got.shape else ref)
        if want.shape != got.shape:
            problems.append(f"{name}: gradient shape {tuple(got.shape)} vs "
                            f"{tuple(want.shape)}")
            continue
        split = spec is not None and spec.group is not None
        if not bool(torch.isfinite(got).all()):
            bad.append(f"{name} (not finite)")
            expert_bad += split
            continue
        if finite_only:
            continue
        diff = (got - want).abs()
        # relative to the tensor's largest entry, floored at the absolute tolerance (a
        # router gradient of 1e-10, rounding noise in one process too, is not an error)
        rel = float(diff.max() / want.abs().max().clamp_min(GRAD_ATOL)) if diff.numel() else 0.0
        if rel > worst:
            worst, worst_name = rel, name
        if not bool((diff <= GRAD_ATOL + GRAD_RTOL * want.abs()).all()):
            bad.append(f"{name} (max |diff| {float(diff.max()):.2g}, relative {rel:.2g})")
            expert_bad += split
    if bad:
        problems.append(f"{len(bad)} of {checked} gradients differ from one process: "
                        + ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    return {"loss": value, "reference_loss": ref_loss, "loss_rel_err": loss_rel,
            "grad_max_rel_err": worst, "grad_worst": worst_name, "gradients": checked,
            "loss_ok": loss_ok, "bad_grads": len(bad), "expert_grads_bad": expert_bad,
            "problems": problems}


def _step(family: Family, seed: int, batches: list[dict[str, torch.Tensor]],
          ref_losses: list[float], grads: dict[str, torch.Tensor | None], kind: str,
          finite_only: bool, row: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Build the family's model again (rank 0's weights), parallelize it at the layout
    ``kind`` (:data:`LAYOUTS`), one step of the rank's batch and :func:`_compare`; every
    rank's result."""
    import torch.distributed as dist

    from torchloom.parallel import create_schedule, parallelize
    from torchloom.primitives.expert_parallel import experts_modules
    from torchloom.runtime.collectives import count_collectives

    row = {} if row is None else row
    row["stage"] = "build"
    model, _ = build_ep_model(family, seed)
    _same_weights(model)
    row["stage"] = "parallelize"
    ep = LAYOUTS[kind].get("ep", 1)
    if ep > 1 and not experts_modules(model):
        row["experts_seen"] = _experts_seen(model)
    mesh = _mesh(kind)
    done = parallelize(create_schedule(model, mesh), _layout(kind), mesh=mesh)
    if ep > 1:
        row["experts"] = list(done.experts)
        row.update(_expert_split(done))
    row["stage"] = "step"
    rank = mesh.local_rank("dp")
    with count_collectives() as calls:
        loss = _forward(done.model, batches[rank], seed + 100 + rank)
    row["all_to_all"] = calls.get("all_to_all", 0)
    loss.backward()
    done.reduce_gradients()
    row["stage"] = "compare"
    mine = _compare(done, loss, ref_losses[rank], grads, finite_only)
    ranks: list[Any] = [None] * WORLD
    dist.all_gather_object(ranks, mine)  # both rows say the same
    return ranks


def _controls(family: Family, seed: int, batches: list[dict[str, torch.Tensor]],
              ref_losses: list[float], grads: dict[str, torch.Tensor | None],
              finite_only: bool) -> dict[str, Any]:
    """The same step at the other layouts of :data:`LAYOUTS`: ``{kind: every rank's
    problems}`` (a list of lists; the error's first line where one raised)."""
    out: dict[str, Any] = {}
    for kind in ("dp", "fsdp_ep"):
        try:
            ranks = _step(family, seed, batches, ref_losses, grads, kind, finite_only)
            out[kind] = [r["problems"] for r in ranks]
        except Exception as err:  # noqa: BLE001 - the failure reported is the sweep's
            out[kind] = _first_line(err)
    return out


def _why(ranks: list[dict[str, Any]], controls: dict[str, Any], unused: int) -> str:
    """The reason of a comparison that failed, for the table (the numbers are in the
    error), from the layouts of :func:`_controls`."""
    loss = not all(r["loss_ok"] for r in ranks)
    bad = max(r["bad_grads"] for r in ranks)
    what = " and ".join(x for x in ("the loss" if loss else "",
                                    "gradients" if bad else "") if x) or "the results"

    def fine(kind: str) -> bool:
        return isinstance(controls.get(kind), list) and not any(controls[kind])

    fsdp = ("; expert parallelism over FSDP2 (dp_shard=2, ep=2) passes" if fine("fsdp_ep")
            else "; over FSDP2 too")
    if not fine("dp"):
        return (f"{what} differ from one process, and the same without expert parallelism "
                f"(dp_replicate=2 alone: DDP)"
                + ("; some parameters get no gradient (unused in the forward)"
                   if unused else "") + fsdp)
    experts = max(r["expert_grads_bad"] for r in ranks)
    where = "expert tensors among them" if experts else "no expert tensor among them"
    return f"{what} differ from one process under expert parallelism only ({where}){fsdp}"


def _experts_seen(model: nn.Module) -> list[str]:
    """What looks like experts in a model where expert parallelism finds none: the
    classes (an ``Expert`` or ``MoE`` in the name) and the arguments of their forward."""
    top = type(model).__name__
    prefix = re.sub(r"(For[A-Z]\w*|Model)$", "", top)  # the family's ("NllbMoe")
    seen: dict[str, str] = {}
    for word in ("expert", "moe"):  # classes named experts first, else a MoE block
        for module in model.modules():
            name = type(module).__name__
            own = name[len(prefix):] if name.startswith(prefix) else name
            if name in seen or not re.search(word, own, re.IGNORECASE):
                continue
            try:
                params = list(inspect.signature(type(module).forward).parameters)[1:]
            except (TypeError, ValueError):
                continue
            seen[name] = f"{name}({', '.join(params[:3])})"
        if seen:
            break
    return list(seen.values())[:3]


def run_ep(family: Family, seed: int = 0) -> dict[str, Any]:
    """Steps 1-4 of the module docstring on this rank; the row of the table (an exception
    becomes ``stage`` / ``culprit`` / ``error``; ``status`` ``refused`` when
    ``parallelize`` refused expert parallelism). When the comparison fails, the same
    step without expert parallelism (``Layout(dp_replicate=2)``) says whether expert
    parallelism is the cause (``control``)."""
    from torchloom.core.errors import ExpertParallelError

    row: dict[str, Any] = {"family": family.name, "model_class": family.model_class,
                           "plan_in": family.plan_in, "layout": "ep", "status": "failed",
                           "stage": "build", "culprit": "", "error": ""}
    _quiet()
    start = time.perf_counter()
    try:
        model, changed = build_ep_model(family, seed)
        row["dropout_zeroed"], row["moe_switched_on"] = changed["dropout"], changed["moe"]
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row["same_init"] = _same_weights(model)
        row["stage"] = "reference"
        finite_only = has_dropout(model)
        row["loss_check"] = "finite (dropout)" if finite_only else (
            f"loss within {LOSS_RTOL:g} relative, gradients rtol {GRAD_RTOL:g} "
            f"atol {GRAD_ATOL:g}")
        batches = [example_inputs(model, seed + 1 + r) for r in range(WORLD)]
        ref_losses, grads = _reference(model, batches, seed)
        if not all(math.isfinite(x) for x in ref_losses):
            raise FloatingPointError(f"single-process losses not finite: {ref_losses}")
        row["no_gradient"] = sum(1 for g in grads.values() if g is None)
        del model
        ranks = _step(family, seed, batches, ref_losses, grads, "ep", finite_only, row)
        row["per_rank"] = [{k: v for k, v in r.items() if k != "problems"} for r in ranks]
        row["loss_rel_err"] = max(r["loss_rel_err"] for r in ranks)
        row["grad_max_rel_err"] = max(r["grad_max_rel_err"] for r in ranks)
        problems = [f"rank {i}: {p}" for i, r in enumerate(ranks) for p in r["problems"]]
        if problems:
            row["stage"] = "control"
            row["controls"] = _controls(family, seed, batches, ref_losses, grads,
                                        finite_only)
            row["reason"] = _why(ranks, row["controls"], row["no_gradient"])
            row["stage"] = "compare"
            raise AssertionError("; ".join(problems))
        row["status"], row["stage"] = "passed", ""
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table
        row["error"] = _first_line(err)
        row["error_detail"] = str(err)[:2000]
        row["error_type"] = type(err).__name__
        row["culprit"] = _culprit(err)
        if isinstance(err, ExpertParallelError) and row["stage"] == "parallelize":
            row["status"] = "refused"
            if "experts_seen" in row:
                row["reason"] = (
                    "no experts module called as experts(hidden_states, top_k_index, "
                    "top_k_weights): the model's experts take other arguments"
                    if row["experts_seen"] else "no mixture-of-experts layer in the model")
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


# ----------------------------------------------------------------------- the report


_ORDER = ("passed", "failed", "refused", "does not build")


def result_of(row: dict[str, Any]) -> str:
    """passed, refused, failed or does not build."""
    if row["status"] in ("passed", "refused"):
        return row["status"]
    return "does not build" if row.get("stage") in NOT_BUILDING else "failed"


def reason(row: dict[str, Any]) -> str:
    """Why the family failed, to group the failures: the comparison's reason, else the
    error's first line with what names one family (quoted names, numbers) left out."""
    if row.get("reason"):
        return row["reason"]
    text = re.sub(r"'[^']*'", "'…'", row.get("error", ""))
    text = re.sub(r"\b[A-Z]\w*(For\w+|Model)\b", "<model>", text)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)


def ep_counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Families by result, and the failures and refusals by reason."""
    by_result: dict[str, int] = {}
    by_reason: dict[str, dict[str, Any]] = {}
    for r in rows:
        result = result_of(r)
        by_result[result] = by_result.get(result, 0) + 1
        if result != "passed":
            key = f"{result}|{r.get('stage', '')}|{reason(r)}"
            entry = by_reason.setdefault(key, {"result": result, "stage": r.get("stage", ""),
                                               "reason": reason(r), "families": []})
            entry["families"].append(r["family"])
    building = len(rows) - by_result.get("does not build", 0)
    passed = [r for r in rows if r["status"] == "passed"]
    return {"families": len(rows), "building": building, "passed": by_result.get("passed", 0),
            "refused": by_result.get("refused", 0), "failed": by_result.get("failed", 0),
            "not_building": by_result.get("does not build", 0),
            "finite_only": sum(1 for r in passed if r.get("loss_check", "").startswith("fin")),
            "max_loss_rel_err": max((r["loss_rel_err"] for r in passed), default=0.0),
            "max_grad_rel_err": max((r["grad_max_rel_err"] for r in passed), default=0.0),
            "by_reason": sorted(by_reason.values(),
                                key=lambda e: (_ORDER.index(e["result"]),
                                               -len(e["families"]), e["reason"]))}


def ep_markdown(rows: list[dict[str, Any]], skipped: list[dict[str, str]] | None = None,
                header: str = "") -> str:
    """The counts, the failures and refusals by reason, and the table family -> result."""
    c = ep_counts(rows)
    lines = [header] if header else []
    lines += [
        f"Each family's tiny model (4 experts, 2 per token, fp32, training mode, dropout "
        f"0) at `Layout(dp_replicate=2, ep=2)` on 2 gloo ranks, each rank its own batch of "
        f"2 x {SEQ} tokens, one forward, backward and `reduce_gradients()`, against one "
        f"process (the loss on each rank's batch, the gradient of their mean): the loss "
        f"within {LOSS_RTOL:g} relative, every gradient within rtol {GRAD_RTOL:g} / atol "
        f"{GRAD_ATOL:g} (an expert tensor: the rank's slice), each rank holding E / 2 "
        f"experts of every experts module. `refused`: `parallelize` raised "
        f"`ExpertParallelError` (torchloom declines, naming why).",
        "",
        f"**{c['passed']} of {c['building']} mixture-of-experts families that build pass** "
        f"(largest relative error: loss {c['max_loss_rel_err']:.1g}, gradient "
        f"{c['max_grad_rel_err']:.1g}; {c['finite_only']} checked for finiteness only); "
        f"{c['refused']} refused, {c['failed']} failed; {c['not_building']} do not build "
        f"or run from a tiny config.",
        "",
    ]
    if c["by_reason"]:
        lines += ["| result | at | reason | families |", "|---|---|---|---|"]
        for e in c["by_reason"]:
            lines.append("| " + " | ".join(_cell(x) for x in (
                e["result"], e["stage"], e["reason"],
                f"{len(e['families'])}: {', '.join(e['families'])}")) + " |")
        lines.append("")
    lines += ["| family | model class | ep plan in | result | experts modules | E -> per rank "
              "| loss rel. err | grad max rel. err | failed at | error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (_ORDER.index(result_of(r)), r["family"])):
        split = (f"{'/'.join(map(str, r['num_experts']))} -> "
                 f"{'/'.join(map(str, r['experts_per_rank']))}" if r.get("num_experts") else "")
        passed = r["status"] == "passed"
        lines.append("| " + " | ".join(_cell(x) for x in (
            r["family"], r.get("model_class", ""), r.get("plan_in") or "-", result_of(r),
            len(r["experts"]) if "experts" in r else "", split,
            f"{r['loss_rel_err']:.1g}" if "loss_rel_err" in r else "",
            f"{r['grad_max_rel_err']:.1g}" if "grad_max_rel_err" in r else "",
            "" if passed else r.get("stage", ""), "" if passed else _error(r))) + " |")
    if skipped:
        lines += ["", f"Not run ({len(skipped)}): " + "; ".join(
            f"{s['family']} ({s['reason']})" for s in skipped)]
    return "\n".join(lines)


def _error(row: dict[str, Any]) -> str:
    seen = row.get("experts_seen")
    return row.get("error", "") + (f" (the model has {', '.join(seen)})" if seen else "")


def select_ep(args: argparse.Namespace) -> tuple[list[Family], list[dict[str, str]]]:
    """The families the arguments ask for (unknown names are an error)."""
    families, skipped = discover_ep()
    if args.ci and not args.families:
        args.families = list(EP_CI_FAMILIES)
    if args.families:
        known = {f.name: f for f in families}
        unknown = [n for n in args.families if n not in known]
        if unknown:
            raise SystemExit(f"error: not a mixture-of-experts family with a model class: "
                             f"{', '.join(unknown)} (see --list)")
        families, skipped = [known[n] for n in args.families], []
    if args.limit is not None:
        families = families[:args.limit]
    return families, skipped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep (the zoo sweep's arguments; ``--layouts`` is ``ep``), print the
    report, return ``{"rows", "counts", ...}``."""
    import transformers

    args = parse_args(argv)
    args.layouts = ["ep"]
    families, skipped = select_ep(args)
    if args.list:
        for f in families:
            print(f"{f.name:32} {f.model_class:44} ep plan in {f.plan_in or '-'}")
        return {"families": [dataclasses.asdict(f) for f in families]}
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks inherit it
    start = time.perf_counter()
    rows = sweep([EpJob(f) for f in families], args,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - start
    given = argv if argv is not None else sys.argv[1:]
    command = ("python benchmarks/zoo_sweep.py " + " ".join(
        given if "--layouts" in given else ["--layouts", "ep", *given])).strip()
    m = _machine(args)
    header = (f"torchloom expert-parallel sweep, `Layout(dp_replicate=2, ep=2)` on gloo (CPU): "
              f"{len(families)} families in {elapsed / 60:.1f} min on {m['cpus']} CPUs, "
              f"{args.threads} thread(s) per rank; torch {m['torch']}, transformers "
              f"{transformers.__version__}, Python {platform.python_version()}; tiny configs "
              f"of {TARGET['experts']} experts, top {TARGET['top_k']}; `{command}`\n")
    text = ep_markdown(rows, skipped, header)
    print(text)
    result = {"rows": rows, "counts": ep_counts(rows), "skipped": skipped,
              "seconds": round(elapsed, 1), "command": command, "machine": m,
              "launches": max((r.get("launches", 1) for r in rows), default=0)}
    _write_results(args, result, text)
    return result


if __name__ == "__main__":
    import ep_sweep  # the ranks unpickle the jobs by this module's name, not __main__'s

    ep_sweep.main()
