"""Running checks on several gloo ranks in one process-group launch.

Starting a group costs seconds and each further check milliseconds, so a test file runs
all its multi-rank checks through one :func:`spawn`. A check is a module-level function
``check(rank)``; an exception on any rank fails the test with that rank's traceback.

The ranks are started by the library's launcher,
:func:`torchloom.runtime.launch.run_ranks` (gloo, CPU; it also stops a rank that hangs);
a failure is raised as its :class:`~torchloom.RankFailedError`, with the failing rank's
whole traceback attached as a note.
"""

from __future__ import annotations

from typing import Callable

import torch

from torchloom import RankFailedError
from torchloom.runtime.launch import failures, raise_first_failure, run_ranks

Check = Callable[[int], None]


def _run_checks(rank: int, checks: tuple[Check, ...]) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    for check in checks:
        check(rank)


def spawn(*checks: Check, world: int = 2, timeout_s: float = 60) -> None:
    """Run ``checks`` in order on ``world`` ranks (gloo, CPU)."""
    if world < 2:  # run_ranks runs a world of one in this process, without a group
        raise ValueError(f"spawn needs at least 2 ranks, not {world}")
    results = run_ranks(_run_checks, world, checks, timeout_s=timeout_s)
    try:
        raise_first_failure(results, command="tests.dist.spawn")
    except RankFailedError as err:
        root = failures(results)[0]
        if root.get("traceback"):
            err.add_note(f"rank {root.get('rank')}'s traceback:\n{root['traceback']}")
        raise
