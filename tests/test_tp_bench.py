"""The tensor-parallel benchmark (benchmarks/tp_bench.py) at tiny sizes: it runs, both
tensor-parallel runs match the single-process model, and the collectives are counted
exactly. Timings are printed, never asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_tp_bench_tiny(tmp_path, capsys):
    layers = 2
    out = tmp_path / "tp.json"
    # The spawned ranks import tp_bench by name: they inherit sys.path at spawn time.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import tp_bench

        result = tp_bench.main([
            "--layers", str(layers), "--hidden", "32", "--heads", "4", "--seq", "16",
            "--batch", "2", "--vocab", "64", "--steps", "2", "--warmup", "1",
            "--check-steps", "3", "--json", str(out),
        ])
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert json.loads(out.read_text()) == result
    assert result["losses_match"]
    tl_run, dt_run = result["runs"]["torchloom"], result["runs"]["dtensor"]
    assert len(result["reference_losses"]) == 3 and len(tl_run["losses"]) == 3
    for run in (tl_run, dt_run):
        assert run["max_loss_diff"] <= 1e-5
        assert run["step_ms"] > 0

    # torchloom, per block: forward, one all-reduce after each row-parallel linear (o,
    # fc2); backward, one all-reduce of the input gradient of the attention (q, k and v
    # share it) and one of fc1's.
    assert tl_run["fwd_collectives"] == 2 * layers
    assert tl_run["bwd_collectives"] == 2 * layers
    assert tl_run["fwd_by_op"] == {"allreduce_": 2 * layers}
    assert tl_run["bwd_by_op"] == {"allreduce_": 2 * layers}
    # the plain torch.distributed counter sees the same calls
    assert tl_run["fwd_dist_calls"] == {"all_reduce": 2 * layers}
    assert tl_run["bwd_dist_calls"] == {"all_reduce": 2 * layers}
    # DTensor: the same forward; backward, each ColwiseParallel (q, k, v, fc1) reduces
    # its own input gradient. Its functional collectives bypass torch.distributed.all_reduce.
    assert dt_run["fwd_by_op"] == {"all_reduce": 2 * layers}
    assert dt_run["bwd_by_op"] == {"all_reduce": 4 * layers}
    assert dt_run["fwd_dist_calls"] == {} and dt_run["bwd_dist_calls"] == {}

    printed = capsys.readouterr().out
    assert "gloo (CPU)" in printed and "DTensor / torchloom step time" in printed
    assert "torch " + result["machine"]["torch"] in printed
