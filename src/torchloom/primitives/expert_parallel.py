"""``expert_parallel(group)``: spread the experts of every mixture-of-experts module over the
ranks of ``group``.

Applied at a module, it finds the experts modules at or under it
(:func:`experts_modules`: the modules transformers' ``base_model_ep_plan`` names, or,
without a plan, every module called as ``experts(hidden_states, top_k_index,
top_k_weights)`` that holds its experts' weights stacked along a leading dimension, as
every transformers family decorated with ``use_experts_implementation`` does: Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss, ...), and for each one:

* **weights**: every parameter and buffer with one entry per expert (leading dimension
  ``num_experts``: ``gate_up_proj``, ``down_proj``, their biases, and those of its
  submodules, such as Ergo's per-expert ``post_expert_norm.weight``) keeps rank ``r``'s
  ``num_experts / ep`` experts, ``r * E / ep`` on; the record is a
  :class:`~torchloom.core.meta.ShardSpec` of axis 0 over ``group`` (so ``build(weights=)``
  reads only this rank's experts, and ``gather`` / ``save`` / ``save_pretrained`` put the
  full tensors back under their single-process keys). ``num_experts`` becomes the local
  count.
* **forward**: :func:`~torchloom.runtime.expert_dispatch.dispatch` sends each of this
  rank's (token, expert) assignments to the rank holding the expert (all-to-all with
  variable split sizes), runs the module's own forward there on its local experts, sends
  the results back and sums them with the routing weights. The router, top-k, capacity
  or dropless policy and the load-balancing loss are the model's, untouched.

Each rank of ``group`` computes its own tokens (the expert-parallel ranks are
data-parallel ranks, torchtitan's layout): an expert's gradient is the sum over every
rank's tokens routed to it. :func:`torchloom.parallelize` averages it with the
data-parallel ranks that hold the same experts
(:meth:`~torchloom.parallel.parallelize.Parallelized.reduce_gradients`).

Not recorded in a recipe: a process group does not serialise, and ``parallelize``
applies the primitive from ``Layout.ep`` over the mesh's ``ep`` group.

Preconditions:
    * at least one experts module at or under the module; each is called with
      ``(hidden_states, top_k_index, top_k_weights)``;
    * the group's size divides every module's number of experts;
    * the experts' weights are whole (not split by tensor parallelism, not FSDP2
      shards) and the primitive was not applied to them before.

Before / after (one rank: every expert stays, the output is the model's own):

>>> import torch, torchloom as tl
>>> from transformers import MixtralConfig, MixtralForCausalLM
>>> cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
...                     num_local_experts=4, num_experts_per_tok=2)
>>> model = MixtralForCausalLM(cfg).eval()
>>> ids = torch.randint(0, 64, (2, 8))
>>> before = model(ids).logits
>>> sch = tl.create_schedule(model)
>>> sch.expert_parallel()
>>> [name for name, _ in experts_modules(model)]
['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
>>> tl.shard_spec(model.model.layers[0].mlp.experts.gate_up_proj)
ShardSpec(axis=0, full_shape=(4, 128, 32), world_size=1, rank=0, chunks=1)
>>> torch.allclose(before, model(ids).logits, atol=1e-5)
True
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..core.errors import ExpertParallelError
from ..core.marks import EXPERT_PARALLEL, get_mark, has_mark, set_mark
from ..core.meta import ShardSpec, copy_meta, get_meta, shard_spec
from ..core.registry import primitive
from ..runtime import collectives as C
from ..runtime.expert_dispatch import EPState, dispatch, expert_params

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "expert_parallel"
ROUTING = ("hidden_states", "top_k_index", "top_k_weights")
"""The arguments transformers' mixture-of-experts blocks call their experts module with."""
ROUTING_ALIASES = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"))
"""The names the (tokens, k) expert ids and routing weights go by after the hidden states
(gpt-oss calls them ``router_indices`` and ``routing_weights``), in that order."""

__all__ = ["NAME", "ROUTING", "apply", "experts_modules", "num_experts_of"]


def _routing_names(module: nn.Module) -> tuple[str, str] | None:
    """The names of the module's routing arguments (one of :data:`ROUTING_ALIASES`), if
    its forward takes ``(hidden_states, ids, weights)``."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    if params[1:2] != ["hidden_states"]:
        return None
    pair = tuple(params[2:4])
    return pair if pair in ROUTING_ALIASES else None


def _takes_routing(module: nn.Module) -> bool:
    return _routing_names(module) is not None


def num_experts_of(module: nn.Module) -> int | None:
    """The number of experts of an experts module: its ``num_experts`` (the whole count,
    kept before ``expert_parallel`` makes it the local one), else the leading dimension
    of its ``gate_up_proj`` / ``up_proj``."""
    state = get_mark(module, EXPERT_PARALLEL)
    if isinstance(state, EPState):
        return state.num_experts
    count = getattr(module, "num_experts", None)
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    for name in ("gate_up_proj", "up_proj"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 3:
            return int(weight.shape[0])
    return None


def _plan_patterns(model: nn.Module) -> list[re.Pattern[str]]:
    """The module paths transformers' ``base_model_ep_plan`` of ``model`` names (its keys
    that are modules, not parameters), as patterns over full module paths."""
    config = getattr(model, "config", None)
    plans = []
    for cfg in (config, getattr(config, "text_config", None)):
        plan = getattr(cfg, "base_model_ep_plan", None)
        if isinstance(plan, dict):
            plans.append(plan)
    found = []
    for plan in plans:
        for key, style in plan.items():
            if style in ("grouped_gemm",):  # a parameter's entry
                continue
            body = r"\.".join(r"\d+" if part == "*" else re.escape(part)
                              for part in str(key).split("."))
            found.append(re.compile(rf"(^|.*\.){body}$"))
    return found


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` (paths relative to it): those its transformers
    ``base_model_ep_plan`` names that take the routing arguments, or, where no plan names
    any, every module that takes them (:data:`ROUTING`) and holds a parameter with one
    entry per expert."""
    patterns = _plan_patterns(model)
    planned = [(name, m) for name, m in model.named_modules()
               if patterns and any(p.match(name) for p in patterns) and _takes_routing(m)]
    if planned:
        return planned
    found = []
    for name, module in model.named_modules():
        if not _takes_routing(module):
            continue
        count = num_experts_of(module)
        if count is not None and expert_params(module, count):
            found.append((name, module))
    return found


class _Dispatching:
    """An experts module's forward under expert parallelism (an instance attribute that
    shadows the class's forward)."""

    def __init__(self, module: nn.Module, forward: Any, state: EPState) -> None:
        self.module, self.forward, self.state = module, forward, state
        self.names = _routing_names(module) or ROUTING[1:]

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        values = list(args)
        for name in self.names[len(values):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
        if len(values) != 2 or kwargs:
            raise ExpertParallelError(
                "the experts module was called with other arguments than the routing ones",
                path=self.state.path, primitive=NAME,
                values={"positional": 1 + len(args), "keywords": sorted(kwargs),
                        "routing": list(self.names)},
                fix=f"expert parallelism dispatches (hidden_states, {', '.join(self.names)})"
                " only; train this model without it (ep=1)")
        return dispatch(self.forward, self.module, hidden_states, values[0], values[1],
                        self.state)


def _fail(sch: Schedule, what: str, values: dict[str, Any], fix: str) -> ExpertParallelError:
    return ExpertParallelError(what, path=sch.path, primitive=NAME, values=values, fix=fix)


def _check(sch: Schedule, found: list[tuple[str, nn.Module]], size: int) -> None:
    if not found:
        raise _fail(sch, f"no mixture-of-experts module under {type(sch.mod).__name__}: "
                    "nothing is called as experts(hidden_states, top_k_index, top_k_weights) "
                    "with weights stacked per expert", {"module": type(sch.mod).__name__},
                    "apply it at a model with experts (Mixtral, Qwen3-MoE, ...), or train "
                    "without expert parallelism (ep=1)")
    for name, module in found:
        path = f"{sch.path}.{name}" if sch.path and name else (name or sch.path)
        if has_mark(module, EXPERT_PARALLEL):
            raise _fail(sch, f"the experts of {path!r} are already spread over ranks",
                        {"module": path}, "apply expert_parallel once")
        count = num_experts_of(module)
        if count is None or count % size:
            raise _fail(sch, f"{count} experts of {path!r} do not split evenly over "
                        f"{size} expert-parallel ranks",
                        {"module": path, "num_experts": count, "ep": size},
                        f"an expert-parallel degree that divides {count}")
        for pname in expert_params(module, count):
            tensor = getattr(*_owner(module, pname))
            spec = shard_spec(tensor)
            if spec is not None and spec.world_size > 1 or type(tensor).__name__ == "DTensor":
                raise _fail(sch, f"{path}.{pname} is already split (tensor parallelism "
                            "splits each expert; FSDP2 shards it): expert parallelism needs "
                            "the experts whole", {"parameter": f"{path}.{pname}",
                                                  "split": repr(spec)},
                            "apply expert_parallel before FSDP2, and do not split the experts "
                            "with the tensor-parallel plan (Layout(ep=...) keeps them whole)")


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding the tensor ``name`` (relative to ``module``, maybe in a
    submodule) and the tensor's own name there."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _split(module: nn.Module, names: list[str], spec_of: Any) -> None:
    for name in names:
        owner, pname = _owner(module, name)
        tensor = getattr(owner, pname)
        spec = spec_of(tuple(tensor.shape))
        with torch.no_grad():
            piece = spec.slice(tensor.detach()).clone()
        new: torch.Tensor
        if pname in owner._parameters:
            new = nn.Parameter(piece, requires_grad=tensor.requires_grad)
        else:
            new = piece
        copy_meta(tensor, new)
        get_meta(new).shard = spec
        if pname in owner._parameters:
            owner._parameters[pname] = cast(nn.Parameter, new)
        else:
            owner._buffers[pname] = new


@primitive(NAME, errors=(ExpertParallelError,), recorded=False)
def apply(sch: Schedule, group: Any = None) -> None:
    """Spread the experts of every experts module at or under ``sch`` over ``group``
    (None: the default group, or one rank without torch.distributed)."""
    found = experts_modules(sch.mod)
    size, rank = C.group_size(group), C.group_rank(group)
    _check(sch, found, size)
    for name, module in found:
        count = cast(int, num_experts_of(module))
        path = f"{sch.path}.{name}" if sch.path and name else (name or sch.path)
        state = EPState(group=group, size=size, rank=rank, num_experts=count, path=path)

        def spec_of(shape: tuple[int, ...]) -> ShardSpec:
            return ShardSpec(axis=0, full_shape=shape, world_size=size, rank=rank, group=group)

        _split(module, expert_params(module, count), spec_of)
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = count // size  # type: ignore[assignment]
        module.forward = _Dispatching(module, type(module).forward, state)
        set_mark(module, EXPERT_PARALLEL, state)
