"""``lora(r, alpha, targets)``: low-rank adapters (peft's LoRA layers) on the linear layers
named ``targets`` below the node; everything else below it is frozen.

The adapters are the real library's: ``peft.inject_adapter_in_model`` wraps each target
``nn.Linear`` (or transformers ``Conv1D``) in peft's ``lora.Linear`` (the old module becomes
its ``base_layer``), so the output is ``base(x) + alpha / r * B(A(dropout(x)))``. What
``lora`` adds to peft is what a scheduled model needs:

* **Tensor parallelism.** Apply ``lora`` after ``shard`` / ``sync`` (a wrapped base keeps
  its shards). peft sizes the adapters from the base's local shape, so a column-parallel
  base (output features split) gets ``B`` split with it and a whole ``A``, and a
  row-parallel base (input features split) gets ``A`` split with it and a whole ``B``.
  The split adapter records the :class:`~torchloom.core.meta.ShardSpec` of the base (same
  ranks, same blocks), so gathering, saving and loading see the full ``(r, in)`` /
  ``(out, r)`` tensors. The whole adapter's gradient is a per-rank part (column: each
  rank back-propagates only its output features through ``B``; row: ``A``'s output is a
  partial sum), so it gets ``sync("param_grad", "all_reduce")``; an adapter of a base whose
  gradients are all-reduced already (sequence-parallel replicas) gets the same.
  The base's forward hooks (its ``fwd_post`` all-reduce or reduce-scatter, a ``bwd_post``
  or ``fwd_pre`` sync on its input) move to the peft layer, so the adapter's output is
  reduced with the base's and the adapter's input gradient is summed with the base's.
* **Exact initialisation at any layout.** ``A`` is drawn at its full shape from a
  generator seeded with ``seed`` (targets in module order; uniform in
  ``[-1/sqrt(in), 1/sqrt(in)]``, which is peft's default ``kaiming_uniform_(a=sqrt(5))``)
  and ``B`` is zero (``init="random"``: drawn too), then each rank keeps its slice: every layout starts from the same
  adapters. The adapters are made real (fp32) even when the base is on ``meta``: ``build``
  keeps them and reads or initialises only the base (a weights folder has no adapters).
* **Checkpoint keys.** The base keeps its original key (``q_proj.weight``, not
  ``q_proj.base_layer.weight``) for ``build(weights=...)`` and ``save_pretrained``.

Preconditions:
    * ``peft`` is installed (``pip install "torchloom[peft]"``);
    * ``r >= 1``, ``alpha > 0``, ``0 <= dropout < 1``; ``targets`` are module names
      (peft's rule: a module whose path is a target or ends with ``"." + target``) that
      match at least one ``nn.Linear`` / ``Conv1D`` below the node, and nothing else;
    * no adapters below the node yet; no ``checkpoint``, ``fork_rng``, ``compile`` or
      ``trace`` applied to a target yet (apply ``lora`` after sharding, before those);
    * a tensor-parallel target's base is not a row-parallel layer that adds its bias
      after the reduction, nor a replicated key/value projection (fewer KV heads than
      ranks).

A dropout (``dropout > 0``) draws its mask from the default generator: a row-parallel
adapter's input is split, so its mask is not the one a single process draws (training is
equivalent in distribution, not bit for bit); exact comparisons use ``dropout=0``.

Before / after:

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
>>> sch = tl.create_schedule(model)
>>> sch.lora(r=2, alpha=4, targets=["0"])
>>> type(model[0]).__name__, tuple(model[0].lora_A["default"].weight.shape)
('Linear', (2, 8))
>>> [name for name, p in model.named_parameters() if p.requires_grad]
['0.lora_A.default.weight', '0.lora_B.default.weight']
>>> x = torch.randn(3, 8)
>>> torch.equal(model(x), model[2](model[1](model[0].base_layer(x))))   # B starts at zero
True
>>> sch.recipe[0].call_text()
"sch[''].lora(2, 4, ['0'])"
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..core.errors import LoraError
from ..core.marks import CHECKPOINTED, COMPILED, FORK_RNG, LORA, SYNCS, get_mark, has_mark, set_mark
from ..core.meta import ShardSpec, get_meta, set_tag, shard_spec
from ..core.registry import primitive
from ..runtime.adapters import ADAPTER, TAG, LoraState, is_lora_layer

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "lora"
PEFT_FIX = 'pip install "torchloom[peft]"'

__all__ = ["NAME", "PEFT_FIX", "apply"]

_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _fail(sch: Schedule, problem: str, values: dict[str, Any], fix: str) -> LoraError:
    return LoraError(problem, path=sch.path, primitive=NAME, values=values, fix=fix)


def _peft(sch: Schedule) -> Any:
    try:
        import peft
    except ImportError:
        raise _fail(sch, "LoRA adapters come from the peft library, which is not installed",
                    {"peft": None}, PEFT_FIX) from None
    return peft


def _matches(path: str, targets: Sequence[str]) -> bool:
    return any(path == t or path.endswith("." + t) for t in targets)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _check_args(sch: Schedule, r: Any, alpha: Any, targets: Any, dropout: Any,
                seed: Any) -> None:
    call = f"sch[{sch.path!r}].lora(16, 32, ['q_proj', 'v_proj'])"
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(sch, f"r (the adapters' rank) must be a positive integer, not {r!r}",
                    {"r": r}, call)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or \
            not math.isfinite(alpha) or alpha <= 0:
        raise _fail(sch, f"alpha must be a positive number, not {alpha!r}", {"alpha": alpha},
                    f"{call} (alpha / r scales the adapters' output)")
    if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets or \
            not all(isinstance(t, str) and t and re.fullmatch(r"[\w.]+", t) for t in targets):
        raise _fail(sch, f"targets must be a non-empty list of module names, not {targets!r}",
                    {"targets": targets}, call)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or \
            not 0 <= dropout < 1:
        raise _fail(sch, f"dropout must be in [0, 1), not {dropout!r}", {"dropout": dropout},
                    f"sch[{sch.path!r}].lora(16, 32, ['q_proj'], dropout=0.05)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _fail(sch, f"seed must be an integer, not {seed!r}", {"seed": seed},
                    f"sch[{sch.path!r}].lora(16, 32, ['q_proj'], seed=0)")


def _targets(sch: Schedule, targets: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The modules ``targets`` name below the node, checked."""
    found = [(path, m) for path, m in sch.mod.named_modules() if path and _matches(path, targets)]
    if not found:
        names = sorted({path.rsplit(".", 1)[-1] for path, m in sch.mod.named_modules()
                        if isinstance(m, nn.Linear) or _is_conv1d(m)})
        raise _fail(sch, f"no module below matches the targets {list(targets)}",
                    {"targets": list(targets), "linear_layers": names[:12]},
                    f"name linear layers of the model: targets={names[:2] or ['q_proj']}")
    for path, module in found:
        problem = None
        if is_lora_layer(module) or has_mark(sch.mod, LORA):
            problem = "already has LoRA adapters"
        elif not (isinstance(module, nn.Linear) or _is_conv1d(module)):
            problem = f"is a {type(module).__name__}, not an nn.Linear or Conv1D"
        elif "forward" in module.__dict__ or any(
                has_mark(module, m) for m in (CHECKPOINTED, FORK_RNG, COMPILED)):
            why = ("reduces before adding its bias (a row-parallel layer with a bias)"
                   if type(module.__dict__.get("forward")).__name__ == "_ReduceThenAddBias"
                   else "has its forward wrapped (checkpoint, fork_rng or compile)")
            problem = why
        elif getattr(shard_spec(module.weight), "replicas", 1) > 1:
            problem = "holds key/value heads replicated over ranks (fewer KV heads than ranks)"
        if problem is not None:
            fix = ("leave it out of targets, or apply lora right after sharding (before "
                   "checkpoint / fork_rng / compile / trace)")
            if problem.startswith("holds"):
                fix = "leave k_proj / v_proj out of targets, or use a tp that divides the KV heads"
            raise _fail(sch, f"the target {path!r} {problem}",
                        {"target": path, "module": type(module).__name__,
                         "targets": list(targets)}, fix)
    return found


def _move_forward_hooks(base: nn.Module, layer: nn.Module) -> None:
    """The base's forward hooks and syncs, onto the peft layer that now calls it."""
    for attr in _FORWARD_HOOKS:
        hooks = getattr(base, attr, None)
        if hooks:
            getattr(layer, attr).update(hooks)
            hooks.clear()
    syncs = get_mark(base, SYNCS)
    if syncs:
        set_mark(layer, SYNCS, [*get_mark(layer, SYNCS, []), *syncs])
        set_mark(base, SYNCS, [])


def _adapter(full: torch.Tensor, spec: ShardSpec | None, device: torch.device) -> nn.Parameter:
    piece = spec.slice(full).clone() if spec is not None else full
    param = nn.Parameter(piece.to(device), requires_grad=True)
    if spec is not None:
        get_meta(param).shard = spec
    set_tag(param, TAG, True)
    return param


def _like(spec: ShardSpec, axis: int, full_shape: tuple[int, ...]) -> ShardSpec:
    return ShardSpec(axis=axis, full_shape=full_shape, world_size=spec.world_size,
                     rank=spec.rank, chunks=spec.chunks, replicas=spec.replicas,
                     group=spec.group)


@primitive(NAME, errors=(LoraError,))
def apply(sch: Schedule, r: int, alpha: float, targets: list[str], dropout: float = 0.0,
          seed: int = 0, init: str = "zero_b") -> None:
    """Add LoRA adapters of rank ``r`` (scale ``alpha / r``) to the linear layers named
    ``targets`` below ``sch.mod`` and freeze everything else below it. ``init``:
    ``"zero_b"`` (peft's default: the adapted model starts as the base) or ``"random"``
    (``B`` drawn as ``A`` is, from ``[-1/sqrt(r), 1/sqrt(r)]``: for checks, every adapter
    gradient then non-zero)."""
    _check_args(sch, r, alpha, targets, dropout, seed)
    if init not in ("zero_b", "random"):
        raise _fail(sch, f"init must be 'zero_b' or 'random', not {init!r}", {"init": init},
                    f"sch[{sch.path!r}].lora(16, 32, ['q_proj'], init='zero_b')")
    peft = _peft(sch)
    found = _targets(sch, targets)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout),
                             target_modules=list(targets), bias="none",
                             fan_in_fan_out=any(_is_conv1d(m) for _, m in found))
    try:
        peft.inject_adapter_in_model(config, sch.mod)
    except Exception as exc:  # noqa: BLE001 - peft's refusal, with its words
        raise _fail(sch, f"peft cannot add the adapters: {type(exc).__name__}: {exc}",
                    {"targets": list(targets), "r": r}, "check the targets") from None
    generator = torch.Generator().manual_seed(seed)
    partial_grads: list[str] = []
    for path, base in found:
        layer: Any = sch.mod.get_submodule(path)
        if not is_lora_layer(layer) or layer.base_layer is not base:
            raise _fail(sch, f"peft did not wrap the target {path!r}",
                        {"target": path, "module": type(layer).__name__},
                        "name nn.Linear / Conv1D layers in targets")
        _move_forward_hooks(base, layer)
        weight = cast(torch.Tensor, base.weight)
        spec = shard_spec(weight)
        full = tuple(spec.full_shape) if spec is not None else tuple(weight.shape)
        out_axis = 1 if _is_conv1d(base) else 0
        out_full, in_full = full[out_axis], full[1 - out_axis]
        bound = 1 / math.sqrt(in_full)
        a_full = torch.rand((r, in_full), generator=generator, dtype=torch.float32)
        a_full = a_full * (2 * bound) - bound
        if init == "random":
            b_full = torch.rand((out_full, r), generator=generator, dtype=torch.float32)
            b_full = (b_full * 2 - 1) / math.sqrt(r)
        else:
            b_full = torch.zeros((out_full, r), dtype=torch.float32)
        a_spec = b_spec = None
        split = spec is not None and spec.world_size > 1
        if spec is not None and split:
            if spec.axis == out_axis:
                b_spec = _like(spec, 0, (out_full, r))
            else:
                a_spec = _like(spec, 1, (r, in_full))
        device = weight.device if not weight.is_meta else torch.device("cpu")
        layer.lora_A[ADAPTER].weight = _adapter(a_full, a_spec, device)
        layer.lora_B[ADAPTER].weight = _adapter(b_full, b_spec, device)
        reduced = any(s.mode == "param_grad" for s in get_mark(layer, SYNCS, []))
        if split or reduced:
            for name, own in (("lora_A", a_spec), ("lora_B", b_spec)):
                if own is None or reduced:
                    partial_grads.append(f"{path}.{name}.{ADAPTER}")
    set_mark(sch.mod, LORA, LoraState(r=r, alpha=float(alpha), targets=tuple(targets),
                                      dropout=float(dropout), seed=seed, init=init,
                                      layers=tuple(path for path, _ in found)))
    sch.rebuild_children()
    for path in partial_grads:
        sch[path].sync("param_grad", "all_reduce")
