"""torchloom.plan against real steps on gloo ranks: the predicted peak of every rank within
10% of the measured one (the storage view of TrainEvaluator, from before build: DDP's
buckets, FSDP2's unsharded parameters and a pipeline's buffers included), and the bytes
of every collective (by kind and mesh dimension) equal to the counted ones.

The predictions are made in this process on fake tensors (one measurement of the model
shortened to three layers per degree); the measurements in one launch per world size
(torchloom.runtime.launch.run_ranks). The full grid is benchmarks/plan_validate.py.
"""

from __future__ import annotations

import pytest

from torchloom.plan import Layout, predict
from torchloom.plan.validate import check_prediction, measure_many
from torchloom.runtime.launch import raise_first_failure, run_ranks

SEQ = 32


def _validate(world: int, cases: list[tuple[str, Layout] | tuple[str, Layout, float]]
              ) -> None:
    """Each case: a model, a layout and optionally the peak's tolerance (default 10%)."""
    preds = [predict(case[0], case[1], "h100-80gb") for case in cases]
    configs = [{"model": case[0], "layout": case[1].to_dict()} for case in cases]
    results = run_ranks(measure_many, world, configs, timeout_s=120)
    raise_first_failure(results, command="plan validation")
    for rank, per_rank in enumerate(results):
        for case, pred, measured in zip(cases, preds, per_rank):
            name, lay = case[0], case[1]
            check = check_prediction(measured, pred, case[2] if len(case) > 2 else 0.10)
            what = f"{name} {lay.describe()} rank {rank}"
            assert check["within"], (what, check)
            assert check["collectives_equal"], (what, check)


def test_two_ranks_sequence_parallel():
    _validate(2, [
        ("gpt2", Layout(tp=2, sp=True, micro_batch=4, seq_len=SEQ, ckpt_ratio=0.5)),
    ])


@pytest.mark.slow
def test_two_ranks_fsdp_and_pipeline():
    _validate(2, [
        ("llama", Layout(dp_shard=2, micro_batch=2, n_microbatches=2,
                         seq_len=SEQ)),
        ("llama", Layout(pp=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                         ckpt_ratio=1.0)),
        # context parallelism alone: DDP over the cp ranks, and FSDP2 over them (shard_cp;
        # the gradients' group is its own, apart from the K / V exchange's)
        ("llama", Layout(cp=2, micro_batch=2, seq_len=SEQ)),
        ("llama", Layout(cp=2, shard_cp=True, micro_batch=2, grad_accum=2, seq_len=SEQ,
                         mixed_precision="bf16")),
    ])


@pytest.mark.slow
def test_four_ranks_composed_layouts():
    _validate(4, [
        ("llama", Layout(tp=2, dp_replicate=2, micro_batch=2, seq_len=SEQ, ckpt_ratio=0.5)),
        ("llama", Layout(tp=2, pp=2, n_microbatches=2, micro_batch=2, seq_len=SEQ,
                         pipeline_schedule="GPipe")),
        ("llama", Layout(pp=2, dp_replicate=2, n_microbatches=2, micro_batch=2, seq_len=SEQ)),
        # context parallelism inside the pipeline: K / V gathers, the loss summed over cp,
        # the gradients averaged over dp x cp
        ("llama", Layout(pp=2, cp=2, n_microbatches=2, micro_batch=2, seq_len=SEQ)),
        # FSDP2 under a pipeline, bf16 stages under its mixed precision: what crosses the
        # cut is bf16; each stage is an FSDP2 root of its own (torchloom.plan.fsdp_pipeline)
        ("llama", Layout(pp=2, dp_shard=2, n_microbatches=2, micro_batch=2, seq_len=SEQ,
                         mixed_precision="bf16")),
        # ... in fp32 over four micro-batches: a forward after a backward finds the layers
        # gathered, the next backward gathers them again (the all-gathers counted)
        ("llama", Layout(pp=2, dp_shard=2, n_microbatches=4, micro_batch=2, seq_len=SEQ)),
    ])


def test_tune_layouts_measures_the_best_predicted_and_never_runs_over_budget():
    # the layouts of 2 ranks for a tiny Llama; a budget at the median predicted peak
    from torchloom.plan import search
    from torchloom.tune import tune_layouts

    # fp32 layouts: the local measurement runs no autocast
    space = {"ckpt_ratios": (0.0, 1.0), "micro_batches": (1, 2), "mixed_precision": None}
    found = search("llama", 2, "h100-80gb", batch_size=4, seq_len=SEQ, **space)
    peaks = sorted(p.peak for p in found.ranked)
    budget = peaks[len(peaks) // 2]
    result = tune_layouts("llama", 2, "h100-80gb", batch_size=4, seq_len=SEQ,
                          budget_bytes=budget, measure_top=2, **space)
    pruned = [t for t in result.trials if t.status == "pruned"]
    assert pruned and all(t.predicted_peak > budget for t in pruned)
    fitting = sorted((p for p in found.ranked if p.peak <= budget),
                     key=lambda p: -p.tokens_per_s)
    assert [t.layout for t in result.measured] == [p.layout for p in fitting[:2]]
    for t in result.measured:
        assert t.measured_tokens_per_s > 0
        # the plan's peak is within 10% of the run's (tests above), so nothing measured
        # runs far over the budget
        assert abs(t.measured_peak - t.predicted_peak) <= 0.1 * t.measured_peak
    assert result.best is max(result.measured, key=lambda t: t.measured_tokens_per_s)
    assert {t.status for t in result.trials} <= {"ok", "pruned", "not measured", "refused"}


def test_plan_cli_measure_top_trains_the_best_predicted_layout(tmp_path):
    import json

    from typer.testing import CliRunner

    from torchloom.apps.plan_cli import app

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["llama", "--gpus", "2", "--dtype", "fp32", "--seq-len",
                                      str(SEQ), "--batch-size", "4", "--ckpt-ratio", "0",
                                      "--micro-batch", "2", "--measure-top", "1", "--json",
                                      str(out)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "measured on 2 local gloo ranks (fp32)" in result.output
    data = json.loads(out.read_text())
    (row,) = data["measured"]
    best = next(r for r in data["ranked"] if r["fits"])
    assert row["chosen"] and row["layout"] == best["layout"]
    assert row["measured_tokens_per_s"] > 0 and row["measured_peak"] > 0
