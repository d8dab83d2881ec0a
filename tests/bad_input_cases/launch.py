"""Bad-input rows: the local launcher (issue 13 item 5).

A collective timeout that is not a positive number, a rank function that cannot be sent
to a spawned rank (a lambda), and the one error a failed launch
turns into (:func:`torchloom.runtime.launch.raise_first_failure`): the failing rank's own error
first, whether it raised a ScheduleError, hung, or died.
"""

from __future__ import annotations

from typing import Callable

from torchloom.core.errors import RankFailedError, ScheduleError
from torchloom.runtime import launch


def _noop(rank: int) -> None:
    return None


def launch_timeout_zero():
    launch.run_ranks(_noop, 2, timeout_s=0)


def launch_timeout_a_string():
    launch.run_ranks(_noop, 2, timeout_s="5")


def launch_a_lambda():
    launch.run_ranks(lambda rank: rank, 2, timeout_s=5)


def launch_rank_raised_a_schedule_error():
    message = ("sch['h.0'].shard(...): axis 1 of 'weight' is not divisible by the world size\n"
               "    fix: shard along axis 0 instead")
    launch.raise_first_failure([
        {"error": "Connection closed by peer", "type": "CollectiveTimeoutError",
         "schedule_error": True, "cause": "collective", "failed_after_s": 0.5},
        {"error": message, "type": "ShardError", "schedule_error": True, "cause": "raised",
         "failed_after_s": 0.7}], command="torchloom train")


def launch_rank_hung():
    launch.raise_first_failure([
        {"error": "collective all_reduce failed", "type": "CollectiveTimeoutError",
         "schedule_error": True, "cause": "collective", "failed_after_s": 5.0},
        {"error": "rank 1 was still running 10 s after rank 0 failed", "type": "RankHung",
         "schedule_error": False, "cause": "hung", "failed_after_s": 15.0,
         "summary": 'stopped here (most recent call first):\nFile "train.py", line 9 in step'}])


CASES: list[tuple[Callable, type, str]] = [
    (launch_timeout_zero, ScheduleError,
     r"^run_ranks\(\.\.\.\): timeout_s must be a positive number of seconds, not 0\n.*"
     r"fix: run_ranks\(fn, world_size, \.\.\., timeout_s=120\)"),
    (launch_timeout_a_string, ScheduleError,
     r"timeout_s must be a positive number of seconds, not '5'"),
    (launch_a_lambda, ScheduleError,
     r"^run_ranks\(\.\.\.\): cannot send the rank function or its arguments to a spawned "
     r"rank: .*values: fn='launch_a_lambda\.<locals>\.<lambda>'.*fix: pass a module-level "
     r"function \(not a lambda or a local function\)"),
    (launch_rank_raised_a_schedule_error, RankFailedError,
     r"^torchloom train\(\.\.\.\): rank 1 of 2 failed first with this error:\n"
     r"      sch\['h\.0'\]\.shard\(\.\.\.\): axis 1 of 'weight' is not divisible.*"
     r"then:\n +rank 0: CollectiveTimeoutError: Connection closed by peer  "
     r"\(a consequence of rank 1\)"
     r".*values: rank=1, type='ShardError', cause='raised', world_size=2, failed=2"
     r".*fix: fix rank 1's own error shown first .*its message says how"),
    (launch_rank_hung, RankFailedError,
     r"^run_ranks\(\.\.\.\): rank 1 of 2 hung first: rank 1 was still running 10 s after "
     r"rank 0 failed\n    stopped here \(most recent call first\):\n.*line 9 in step"
     r".*fix: make every rank call the same collectives in the same order"),
]
