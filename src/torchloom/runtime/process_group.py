"""Process-group setup: :func:`init_distributed` is the one place torchloom starts a group.

It sets a short collective timeout, so a rank that dies or hangs makes the others fail
with a :class:`~torchloom.core.errors.CollectiveTimeoutError` instead of waiting for
gloo's default 30 minutes, and picks the backend from the device the tensors live on:

>>> backend_for("cpu"), backend_for("cuda:0")
('gloo', 'nccl')

``torchloom.runtime.launch`` (its ranks and ``init_group``) starts groups through it, and
``torchloom.runtime.parallel.init_mesh`` lays its mesh on the device of the group's backend.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import LaunchError

__all__ = ["backend_for", "device_type_of", "init_distributed"]


def backend_for(device: str | torch.device) -> str:
    """The backend for tensors on ``device``: NCCL for CUDA, gloo otherwise (CPU)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_type_of(group: Any = None) -> str:
    """The device type the collectives of ``group`` (default: the default group) run on:
    ``"cuda"`` for an NCCL group, ``"cpu"`` otherwise."""
    return "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"


def init_distributed(backend: str | None = None, timeout_s: float = 60.0, *,
                     device: str | torch.device = "cpu", init_method: str | None = None,
                     rank: int | None = None, world_size: int | None = None,
                     store: Any = None) -> tuple[int, int]:
    """Start the default process group with a short timeout; returns ``(rank, world_size)``.

    A collective that a dead or hung rank never joins then fails after ``timeout_s``
    seconds (gloo's default is 30 minutes); torchloom's state functions wrap such
    failures in :class:`~torchloom.core.errors.CollectiveTimeoutError` (see
    :func:`~torchloom.runtime.collectives.guard_collective`). Without
    ``init_method`` (or ``store``) the ``env://`` variables of ``torchrun`` are used.
    ``backend`` None: :func:`backend_for` the ``device`` the tensors live on (gloo for the
    default ``"cpu"``). It raises if a default group already exists (its timeout could not
    be applied).

    >>> init_distributed(init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout_s=5)
    (0, 1)
    >>> dist.destroy_process_group()
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise LaunchError(
            f"timeout_s must be a positive number of seconds, not {timeout_s!r}",
            primitive="init_distributed", values={"timeout_s": timeout_s},
            fix="init_distributed(timeout_s=60)")
    if dist.is_initialized():
        raise LaunchError(
            "the default process group is already initialised; its timeout cannot be set now",
            primitive="init_distributed",
            values={"timeout_s": timeout_s, "world_size": dist.get_world_size()},
            fix="call init_distributed(...) instead of the first init_process_group(...), or "
            "pass timeout=datetime.timedelta(seconds=...) to that call")
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend or backend_for(device), init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()
