"""Running checks on several gloo ranks in one process-group launch.

Starting a group costs seconds and each further check milliseconds, so a test file runs
all its multi-rank checks through one :func:`spawn`. A check is a module-level function
``check(rank)``; an exception on any rank fails the test with that rank's traceback.
"""

from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchloom.runtime.launch import free_port

Check = Callable[[int], None]


def _worker(rank: int, world: int, port: int, checks: tuple[Check, ...], timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        for check in checks:
            check(rank)
    finally:
        dist.destroy_process_group()


def spawn(*checks: Check, world: int = 2, timeout_s: float = 60) -> None:
    """Run ``checks`` in order on ``world`` ranks (gloo, CPU)."""
    mp.spawn(_worker, args=(world, free_port(), checks, timeout_s), nprocs=world, join=True)
