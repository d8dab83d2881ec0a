"""The routing the planner assumes when it measures an expert-parallel step on fake
tensors: :func:`modeled_routing`.

On fake tensors the split sizes of the token dispatch are data the planner does not
have, so :func:`~torchloom.runtime.expert_dispatch.dispatch` would only keep the output's
shape. Under ``modeled_routing(imbalance)`` it runs the real path instead with split
sizes chosen by a model: the measured rank sends its ``tokens x k`` (token, expert)
assignments evenly to the ``ep`` ranks and receives ``imbalance`` times its even share
(``imbalance = 1``: perfectly balanced routing; ``1.25``: the busiest rank, which the
step waits for, gets a quarter more than the average), spread evenly over its local
experts. Everything else is the real dispatch: both all-to-alls of the rows and the one
of the counts (each counted with its bytes), the module's own forward on the received
rows (its FLOPs and the activations it keeps), the weighted sum.

>>> with modeled_routing(1.5):
...     modeled_imbalance()
1.5
>>> modeled_imbalance() is None
True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..core.errors import ExpertParallelError
from . import collectives as C

if TYPE_CHECKING:
    from .expert_dispatch import EPState

__all__ = ["modeled_routing", "modeled_imbalance", "modeled_dispatch"]

_IMBALANCE: ContextVar[float | None] = ContextVar("torchloom_ep_imbalance", default=None)


@contextlib.contextmanager
def modeled_routing(imbalance: float = 1.0) -> Iterator[None]:
    """Dispatch fake tensors by the routing model (see the module docstring);
    ``imbalance`` >= 1 is the busiest rank's load over the average."""
    if not (math.isfinite(imbalance) and imbalance >= 1.0):
        raise ExpertParallelError(
            "the routing imbalance is the busiest rank's load over the average",
            primitive="expert_parallel", values={"imbalance": imbalance},
            fix="give a finite 1.0 (balanced) or more")
    token = _IMBALANCE.set(float(imbalance))
    try:
        yield
    finally:
        _IMBALANCE.reset(token)


def modeled_imbalance() -> float | None:
    """The imbalance of the active :func:`modeled_routing` (None: none is active)."""
    return _IMBALANCE.get()


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def modeled_dispatch(run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     state: EPState, imbalance: float, shape: torch.Size) -> torch.Tensor:
    """The expert-parallel output of ``x`` (tokens x hidden) routed by ``index`` /
    ``weights`` (tokens x k) under the routing model, in ``shape`` (the input's);
    ``run_local(rows, local_ids)`` runs the module's forward on the rows this rank
    received."""
    n, k = index.shape
    sent = n * k
    received = max(1, round(sent * imbalance))
    send, recv = _even(sent, state.size), _even(received, state.size)
    counts = torch.zeros(state.num_experts, dtype=torch.long, device=x.device)
    if state.size > 1:
        with C.guard_collective("all_to_all", "expert_parallel", state.group, path=state.path):
            dist.all_to_all_single(torch.empty_like(counts), counts, group=state.group)
    tokens = torch.arange(sent, device=x.device) // k
    rows = C.all_to_all(x.index_select(0, tokens), send, recv, state.group)
    local_ids = torch.arange(received, device=x.device) * state.local // received
    out = run_local(rows, local_ids)
    back = C.all_to_all(out, recv, send, state.group)
    contrib = back * weights.reshape(-1)[:, None].to(back.dtype)
    result = torch.zeros(shape, dtype=contrib.dtype, device=x.device)
    result.view(-1, x.shape[-1]).index_add_(0, tokens, contrib)
    return result


