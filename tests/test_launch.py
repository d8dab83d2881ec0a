"""Faults end a local launch, and the failing rank's own error is shown first.

Each multi-rank scenario is one :func:`torchloom.runtime.launch.run_ranks` launch of two gloo
ranks with a short collective timeout (3 s): a rank that hangs (its peer's sync-hook
collective times out, naming the rank, the collective and the schedule path), a rank that
raises (through ``torchloom verify``, which exits non-zero showing that rank's exception
before its peer's "connection closed"), and a rank that dies (SIGKILL).
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import torchloom as tl
from torchloom.core.errors import CollectiveTimeoutError, RankFailedError
from torchloom.runtime import launch

TIMEOUT_S = 3.0


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    """A Megatron-style MLP on two ranks: column- then row-parallel, one sync each way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    sch = tl.create_schedule(model)
    sch["0"].shard("weight", 0)
    sch["0"].shard("bias", 0)
    sch["0"].sync("bwd_post", "all_reduce")
    sch["2"].shard("weight", 1)
    sch["2"].sync("fwd_post", "all_reduce")
    return model, torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def _stuck_for_a_minute() -> None:
    time.sleep(60)  # a minute, not forever: a launcher that waits for it fails the bound


def _hang_in_backward(rank: int) -> dict:
    model, x = _mlp()
    loss = model(x.requires_grad_()).sum()  # both ranks: the forward all-reduce works
    if rank == 1:
        _stuck_for_a_minute()  # alive, but never joins the backward all-reduce
    loss.backward()  # rank 0 waits in sch['0']'s bwd_post all-reduce until the timeout
    return {"ok": True}


def test_a_hung_rank_ends_the_launch_and_is_named_with_where_it_hung():
    start = time.time()
    results = launch.run_ranks(_hang_in_backward, 2, timeout_s=TIMEOUT_S)
    end = time.time()
    waiting, hung = results
    # Start-up (importing torch in each rank) varies with the machine's load; the bound is
    # on the time from the hang (when rank 0 entered the collective) to the launch's end.
    waited = float(re.search(r"waited_s=([0-9.]+)", waiting["error"]).group(1))
    assert waited >= TIMEOUT_S - 0.5, waiting["error"]  # the collective waited its timeout
    hang_began = start + waiting["failed_after_s"] - waited
    assert end - hang_began < TIMEOUT_S + 30, (end - hang_began, results)
    # The peer's collective: CollectiveTimeoutError naming rank, collective, schedule path.
    assert waiting["type"] == "CollectiveTimeoutError" and waiting["cause"] == "collective"
    assert waiting["error"].startswith(
        "sch['0'].sync(...): collective all_reduce (backward) failed after "), waiting["error"]
    assert f"on rank 0 (timeout {TIMEOUT_S:g} s): another rank died, hung" in waiting["error"]
    assert "collective='all_reduce (backward)', timeout_s=3.0, rank=0" in waiting["error"]
    assert "Timed out waiting" in waiting["error"]  # gloo's own first line, kept as a value
    assert not waiting["root_cause"]
    # The hung rank is the root cause, stopped by the launcher, with the stack it was in.
    assert hung["type"] == "RankHung" and hung["cause"] == "hung" and hung["root_cause"]
    assert "_stuck_for_a_minute" in hung["summary"] and "_hang_in_backward" in hung["summary"]
    with pytest.raises(RankFailedError, match=r"^torchloom verify\(\.\.\.\): rank 1 of 2 hung "
                       r"first: rank 1 was still running 3 s after rank 0 failed") as info:
        launch.raise_first_failure(results, command="torchloom verify")
    message = str(info.value)
    assert message.startswith(
        "torchloom verify(...): rank 1 of 2 hung first: rank 1 was still running 3 s after "
        "rank 0 failed, and was stopped by the launcher"), message
    assert message.index("_stuck_for_a_minute") < message.index("rank 0: CollectiveTimeoutError")
    assert "fix: make every rank call the same collectives in the same order" in message


def _raise_on_rank_1(rank: int, model_name: str, tp: int, sequence_parallel: bool,
                     ckpt_ratio: float, seed: int) -> dict:
    """Stands in for ``torchloom.apps.cli.verify_rank``: rank 1 raises at once, rank 0 runs a
    scheduled forward whose all-reduce then loses its peer."""
    if rank == 1:
        raise ValueError(f"boom from rank 1 ({model_name}, tp={tp})")
    model, x = _mlp()
    model(x)
    return {"ok": True, "message": "", "stats": {}, "primitives": 0}


def test_a_raising_rank_is_shown_first_and_the_cli_exits_non_zero(monkeypatch):
    import torchloom.apps.cli as cli

    # Ranks are spawned: they unpickle this module-level stand-in by its own name.
    monkeypatch.setattr(cli, "verify_rank", _raise_on_rank_1)
    result = CliRunner().invoke(cli.app, ["verify", "gpt2", "--tp", "2",
                                          "--timeout", str(TIMEOUT_S)])
    output = result.output
    assert result.exit_code == 2, output
    assert "error: torchloom verify(...): rank 1 of 2 failed first: ValueError: boom from " \
           "rank 1 (gpt2, tp=2)" in output, output
    assert 'raise ValueError(f"boom from rank 1 ({model_name}, tp={tp})")' in output
    # Its peer's error comes after it, as a consequence, and names the sync in flight.
    first = output.index("ValueError: boom")
    later = output.index("rank 0: CollectiveTimeoutError: sch['2'].sync(...): collective "
                         "all_reduce failed after")
    assert first < later, output
    assert "fix: fix rank 1's own error shown first" in output


def _killed_on_rank_1(rank: int) -> dict:
    model, x = _mlp()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    model(x)
    return {"ok": True}


def test_a_rank_that_dies_is_named_and_its_peer_ends():
    start = time.time()
    results = launch.run_ranks(_killed_on_rank_1, 2, timeout_s=TIMEOUT_S)
    peer, dead = results
    # The launch ends soon after the death (start-up time aside): its peer does not wait.
    assert time.time() - (start + dead["failed_after_s"]) < TIMEOUT_S + 30, results
    assert dead["type"] == "RankDied" and dead["root_cause"] and dead["exitcode"] == -9
    assert peer["cause"] == "collective" and not peer["root_cause"]
    with pytest.raises(RankFailedError, match=r"^run_ranks\(\.\.\.\): rank 1 of 2 died first: "
                       r"rank 1 was killed by SIGKILL \(often the out-of-memory killer\) "
                       r"before returning a result\n.*then:\n +rank 0: CollectiveTimeoutError"):
        launch.raise_first_failure(results)


def test_failures_order_root_causes_before_consequences():
    results = [
        {"error": "closed", "type": "CollectiveTimeoutError", "cause": "collective",
         "failed_after_s": 1.0},
        {"error": "stopped", "type": "RankHung", "cause": "hung", "failed_after_s": 9.0},
        {"ok": True},
        {"error": "killed", "type": "RankDied", "failed_after_s": 2.0},  # old-style record
    ]
    assert [f["rank"] for f in launch.failures(results)] == [3, 1, 0]
    results.append({"error": "bug", "type": "KeyError", "cause": "raised", "failed_after_s": 5})
    assert [f["rank"] for f in launch.failures(results)] == [4, 3, 1, 0]
    assert launch.failures([{"ok": True}]) == []


def test_collective_failures_are_told_from_causes():
    assert launch._is_collective_failure(RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert launch._is_collective_failure(CollectiveTimeoutError("x", primitive="sync"))
    try:
        try:
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
        except RuntimeError as exc:
            raise KeyError("lost") from exc
    except KeyError as exc:
        assert launch._is_collective_failure(exc)  # raised because of a failed collective
    assert not launch._is_collective_failure(ValueError("boom"))
    assert not launch._is_collective_failure(RuntimeError("shape mismatch"))
