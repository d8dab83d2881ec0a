"""torchloom.plan against real steps on gloo ranks: the predicted peak of every rank within
10% of the measured one (the storage view of TrainEvaluator, from before build: DDP's
buckets, FSDP2's unsharded parameters and a pipeline's buffers included), and the bytes
of every collective (by kind and mesh dimension) equal to the counted ones.

The predictions are made in this process on fake tensors (one measurement of the model
shortened to three layers per degree); the measurements in one launch per world size
(torchloom.launch.run_ranks). The full grid is benchmarks/plan_validate.py.
"""

from __future__ import annotations

import pytest

from torchloom.launch import raise_first_failure, run_ranks
from torchloom.plan import Layout, predict
from torchloom.plan.validate import check_prediction, measure_many

SEQ = 32


def _validate(world: int, cases: list[tuple[str, Layout]]) -> None:
    preds = [predict(name, lay, "h100-80gb") for name, lay in cases]
    configs = [{"model": name, "layout": lay.to_dict()} for name, lay in cases]
    results = run_ranks(measure_many, world, configs, timeout_s=120)
    raise_first_failure(results, command="plan validation")
    for rank, per_rank in enumerate(results):
        for (name, lay), pred, measured in zip(cases, preds, per_rank):
            check = check_prediction(measured, pred)
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
        ("llama", Layout(dp=2, dp_mode="fsdp", micro_batch=2, n_microbatches=2,
                         seq_len=SEQ)),
        ("llama", Layout(pp=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                         ckpt_ratio=1.0)),
    ])


@pytest.mark.slow
def test_four_ranks_composed_layouts():
    _validate(4, [
        ("llama", Layout(tp=2, dp=2, micro_batch=2, seq_len=SEQ, ckpt_ratio=0.5)),
        ("llama", Layout(tp=2, pp=2, n_microbatches=2, micro_batch=2, seq_len=SEQ,
                         pipeline_schedule="GPipe")),
        ("llama", Layout(pp=2, dp=2, n_microbatches=2, micro_batch=2, seq_len=SEQ)),
    ])
