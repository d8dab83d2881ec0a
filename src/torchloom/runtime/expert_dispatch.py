"""Token dispatch for experts spread over ranks (the kernel of
:mod:`torchloom.primitives.expert_parallel`).

A transformers mixture-of-experts block routes each token to ``k`` of ``E`` experts and
calls its experts module as ``experts(hidden_states, top_k_index, top_k_weights)``: the
``(N, H)`` tokens, the ``(N, k)`` chosen experts and their ``(N, k)`` routing weights;
the result is ``sum_k weight_k * expert_k(token)`` per token. Under expert parallelism
rank ``r`` of the ``ep`` ranks holds experts ``r * E / ep .. (r + 1) * E / ep - 1`` and
:func:`dispatch` computes the same result:

1. the ``N * k`` (token, expert) assignments are sorted by expert (stable, so within an
   expert in token order); that groups them by the rank holding the expert;
2. the per-expert counts go to every rank (one small all-to-all), so each rank knows how
   many rows each peer sends it for each of its experts;
3. the assigned tokens travel to their experts' ranks (an all-to-all with variable split
   sizes, differentiable);
4. each rank runs the module's own forward on what it received, with the experts' local
   ids and routing weights of one (so any experts implementation transformers offers,
   ``eager``, ``grouped_mm`` or ``batched_mm``, and any family's activation, bias or
   interleaving stays the model's);
5. the outputs travel back (the reverse all-to-all) and each token's contributions are
   weighted by its routing weights and summed, in expert order, as the single-process
   eager loop adds them.

The router, its top-k, its normalisation and the load-balancing loss run before the
experts module and are untouched. Assignments to an id outside ``0 .. E - 1`` (the
"zero" experts some families route to) contribute nothing, as in the eager loop.
On meta or fake tensors (a pipeline sizing its stages) only the output's shape and dtype
are computed: the split sizes are data; the planner measures fake tensors under
:func:`~torchloom.runtime.expert_routing_model.modeled_routing`, which supplies them. Gradients: autograd sends each row's gradient back by the reverse all-to-all; an
expert's gradient is the sum over every rank's tokens routed to it (the data-parallel
average is :func:`torchloom.parallelize`'s, see :func:`expert_gradients`).

A world of one (no group) computes everything locally:

>>> import torch
>>> from torch import nn
>>> class Experts(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.num_experts = 4
...         self.w = nn.Parameter(torch.randn(4, 3, 3))
...     def forward(self, hidden_states, top_k_index, top_k_weights):
...         out = torch.zeros_like(hidden_states)
...         for slot in range(top_k_index.shape[1]):
...             y = torch.einsum("nh,noh->no", hidden_states, self.w[top_k_index[:, slot]])
...             out += y * top_k_weights[:, slot, None]
...         return out
>>> m = Experts()
>>> x, idx, w = torch.randn(5, 3), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
>>> state = EPState(group=None, size=1, rank=0, num_experts=4)
>>> torch.allclose(dispatch(type(m).forward, m, x, idx, w, state), m(x, idx, w), atol=1e-6)
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..core.errors import ExpertParallelError
from ..core.meta import shard_spec
from . import collectives as C
from .expert_routing_model import modeled_dispatch, modeled_imbalance

__all__ = ["EPState", "dispatch", "expert_gradients", "expert_params", "split_experts"]

_PRIMITIVE = "expert_parallel"


@dataclass
class EPState:
    """What one expert-parallel experts module knows of its group.

    Attributes:
        group: the expert-parallel process group (None: one rank).
        size, rank: its size and this rank's place in it.
        num_experts: the number of experts of the whole module (``E``); this rank holds
            ``E / size`` of them, from ``rank * E / size`` on.
        path: the module's schedule path (for messages).
    """

    group: Any
    size: int
    rank: int
    num_experts: int
    path: str = ""

    def __deepcopy__(self, memo: dict[int, Any]) -> EPState:
        return self  # a copy of the module shares the group

    @property
    def local(self) -> int:
        """Experts per rank."""
        return self.num_experts // self.size


def _check_routing(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                   state: EPState) -> None:
    if index.dim() != 2 or index.shape[0] != x.shape[0] or tuple(weights.shape) != tuple(index.shape):
        raise ExpertParallelError(
            "the experts module was called with routing tensors of unexpected shapes",
            path=state.path, primitive=_PRIMITIVE,
            values={"hidden_states": tuple(x.shape), "top_k_index": tuple(index.shape),
                    "top_k_weights": tuple(weights.shape)},
            fix="call it as transformers' mixture-of-experts blocks do: (tokens, hidden), "
            "(tokens, k) expert ids and (tokens, k) routing weights")


def dispatch(forward: Callable[..., torch.Tensor], module: nn.Module,
             hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor, state: EPState) -> torch.Tensor:
    """The experts module's output for this rank's tokens, with the experts spread over
    ``state``'s group (see the module docstring). ``forward`` is the module's own forward
    (unbound); ``module`` holds this rank's experts."""
    shape = hidden_states.shape
    imbalance = modeled_imbalance()
    if (hidden_states.is_meta or is_fake(hidden_states)) and \
            (imbalance is None or hidden_states.is_meta):
        # sizing a model on meta or fake tensors (a pipeline's stage boundaries): how many
        # tokens each rank receives is data, so only the output's shape and dtype are kept
        return torch.zeros_like(hidden_states) + 0 * top_k_weights.sum().to(hidden_states.dtype)
    x = hidden_states.reshape(-1, shape[-1])
    index = top_k_index.reshape(x.shape[0], -1)
    weights = top_k_weights.reshape(x.shape[0], -1)
    _check_routing(x, index, weights, state)

    def run_local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return _run_local(forward, module, rows, local_ids, weights.dtype)

    if imbalance is not None and is_fake(hidden_states):  # the planner's measurement
        out = modeled_dispatch(run_local, x, index, weights, state, imbalance, shape)
        return out.to(hidden_states.dtype)
    k, experts = index.shape[1], state.num_experts
    flat = index.reshape(-1)
    valid = (flat >= 0) & (flat < experts)
    with torch.no_grad():
        # sorted by expert, stable: within one expert in token order (the eager loop's)
        keyed = torch.where(valid, flat, torch.full_like(flat, experts))
        order = torch.argsort(keyed, stable=True)
        order = order[: int(valid.sum())]
        tokens = order // k
        counts = torch.bincount(flat[order], minlength=experts)  # per expert
    send = counts.view(state.size, state.local).sum(1).tolist()
    if state.size > 1:
        received = torch.empty_like(counts)
        with C.guard_collective("all_to_all", _PRIMITIVE, state.group, path=state.path):
            dist.all_to_all_single(received, counts, group=state.group)
        per_source = received.view(state.size, state.local)  # rows from j, per local expert
    else:
        per_source = counts.view(1, state.local)
    recv = per_source.sum(1).tolist()
    rows = C.all_to_all(x.index_select(0, tokens), send, recv, state.group)
    local_ids = torch.arange(state.local, device=x.device).repeat(state.size)
    local_ids = local_ids.repeat_interleave(per_source.reshape(-1).to(x.device))
    out = run_local(rows, local_ids)
    back = C.all_to_all(out, recv, send, state.group)
    contrib = back * weights.reshape(-1).index_select(0, order)[:, None].to(back.dtype)
    # summed into a tensor of the input's shape (not a view: FSDP2 warns of a module that
    # returns one, since an in-place op on it would skip its backward hook)
    result = torch.zeros(shape, dtype=contrib.dtype, device=x.device)
    result.view(-1, shape[-1]).index_add_(0, tokens, contrib)
    return result.to(hidden_states.dtype)


def _run_local(forward: Callable[..., torch.Tensor], module: nn.Module, rows: torch.Tensor,
               local_ids: torch.Tensor, weights_dtype: torch.dtype) -> torch.Tensor:
    """The module's own forward on the rows this rank received, each routed to one local
    expert with weight one."""
    ones = torch.ones((rows.shape[0], 1), dtype=weights_dtype, device=rows.device)
    weight = next(iter(module.parameters(recurse=False)), None)
    if weight is not None and weight.is_floating_point() and weight.dtype != rows.dtype \
            and not torch.is_autocast_enabled(rows.device.type):
        # the experts are not cast by FSDP2's mixed precision (they are left out of it):
        # they compute in their own dtype, and hand back the tokens' dtype
        return forward(module, rows.to(weight.dtype), local_ids[:, None], ones).to(rows.dtype)
    return forward(module, rows, local_ids[:, None], ones)


def expert_params(module: nn.Module, num_experts: int) -> list[str]:
    """The names (relative to ``module``) of its parameters and buffers with one entry per
    expert (leading dimension ``num_experts``): what expert parallelism splits. Those of
    its submodules count too: a per-expert scale the experts module applies through a
    submodule of its own (Ergo's ``post_expert_norm.weight``, one row per expert,
    indexed by the local expert ids the dispatch hands it) must hold this rank's rows."""
    names = [name for name, p in module.named_parameters()
             if p is not None and p.dim() >= 1 and p.shape[0] == num_experts]
    names += [name for name, b in module.named_buffers()
              if b is not None and b.dim() >= 1 and b.shape[0] == num_experts]
    return names


def split_experts(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` that expert parallelism split (each rank its own
    experts: a shard spec over the ``ep`` group, not the schedule's)."""
    return [p for p in module.parameters()
            if (spec := shard_spec(p)) is not None and spec.group is not None]


def expert_gradients(params: list[nn.Parameter], replica_group: Any, dp: int) -> None:
    """Average the gradients of expert-parallel ``params`` the way data parallelism
    averages the rest: each holds the sum over its expert-parallel ranks' tokens; summed
    over the ranks that hold the same experts (``replica_group``, the data-parallel ranks
    outside the expert-parallel group; None: none) and divided by the ``dp``
    data-parallel ranks, it is the gradient of the mean loss. A parameter no token
    reached gets a zero gradient (every rank calls the same collectives)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if replica_group is not None and C.group_size(replica_group) > 1:
            with C.guard_collective("all_reduce", _PRIMITIVE, replica_group):
                dist.all_reduce(p.grad, group=replica_group)
        if dp > 1:
            p.grad.div_(dp)
