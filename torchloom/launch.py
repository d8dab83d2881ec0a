"""Run a function on several local processes (one per rank) with a gloo process group.

The command line uses this to start tensor-parallel runs on one machine without
``torchrun``. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the function runs in the
current process instead, on the group ``torchrun`` set up.

Each rank returns a JSON-serialisable value; :func:`run_ranks` returns them in rank
order. An exception in a rank is returned as ``{"error": ..., "type": ..., "schedule_error":
..., "traceback": ...}`` so that the other ranks' results still arrive; a rank that died
without a result (killed, or aborted by gloo when a peer left mid-collective) is reported
with ``"type": "RankDied"``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "under_torchrun", "init_group"]

DEFAULT_TIMEOUT_S = 120


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets the
    ``RANK`` / ``WORLD_SIZE`` environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default process group from the environment (torchrun), with a
    timeout so a dead rank stops the others instead of hanging for gloo's 30 minutes;
    a no-op when a group exists. NCCL when CUDA is present, gloo otherwise."""
    if not dist.is_initialized():
        from .state import init_distributed

        init_distributed("nccl" if torch.cuda.is_available() else "gloo", timeout_s)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any],
            args: tuple, timeout_s: float) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        try:
            result: Any = fn(rank, *args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            from .errors import ScheduleError

            result = {"error": str(exc), "type": type(exc).__name__,
                      "schedule_error": isinstance(exc, ScheduleError),
                      "traceback": traceback.format_exc()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` ranks and return their results.

    ``fn`` must be importable (a module-level function) because ranks are spawned. With
    ``world_size == 1`` and no process group, ``fn(0, *args)`` runs in this process.
    """
    if under_torchrun():
        init_group(timeout_s)
        return [fn(dist.get_rank(), *args)]
    if world_size == 1:
        return [fn(0, *args)]
    with tempfile.TemporaryDirectory(prefix="torchloom-ranks-") as out_dir:
        crash = ""
        try:
            mp.spawn(_worker, args=(world_size, free_port(), out_dir, fn, args, timeout_s),
                     nprocs=world_size, join=True)
        except Exception as exc:  # noqa: BLE001 - a rank died; report what the others said
            crash = f"{type(exc).__name__}: {exc}"
        results = []
        for r in range(world_size):
            path = Path(out_dir, f"rank{r}.json")
            if path.exists():
                results.append(json.loads(path.read_text()))
            else:
                results.append({"error": f"rank {r} ended without a result ({crash})",
                                "type": "RankDied", "schedule_error": False,
                                "traceback": crash})
        return results
