"""``torchloom plan`` for LoRA fine-tuning (issue 29): the prediction of a LoRA layout
against a real step on two gloo ranks (the storage view of TrainEvaluator, as
tests/test_plan_dist.py measures full fine-tuning): every rank's peak within 10% and the
collectives' bytes equal (the adapters' gradient all-reduces under TP, FSDP2's
reduce-scatters of the adapters' gradients only); and what it says of the optimizer: the
state of the adapters only, under 1% of full fine-tuning's on a Llama shape.
"""

from __future__ import annotations

import pytest

from torchloom.parallel.lora import parse_lora
from torchloom.plan import Layout, predict
from torchloom.plan.validate import check_prediction, measure_many
from torchloom.runtime.launch import raise_first_failure, run_ranks

LORA = "r=16,alpha=32,targets=q_proj,v_proj"


def test_lora_optimizer_state_is_the_adapters_only() -> None:
    lay = Layout(tp=2, micro_batch=2, seq_len=32)
    full = predict("llama", lay, "h100-80gb").roles[0].memory
    lora = predict("llama", lay, "h100-80gb", lora=parse_lora(LORA)).roles[0].memory
    adapters = lora.parameters - full.parameters  # the base is the same tensors
    assert adapters > 0 and lora.gradients == adapters
    assert lora.optimizer < full.optimizer / 5 and lora.peak < full.peak


@pytest.mark.slow
def test_lora_predictions_hold_on_two_ranks() -> None:
    cases = [("llama", Layout(tp=2, micro_batch=2, seq_len=32)),
             ("llama", Layout(dp_shard=2, micro_batch=2, seq_len=32)),
             ("llama", Layout(pp=2, micro_batch=2, n_microbatches=2, seq_len=32))]
    preds = [predict(name, lay, "h100-80gb", lora=parse_lora(LORA)) for name, lay in cases]
    configs = [{"model": name, "layout": lay.to_dict(), "lora": LORA} for name, lay in cases]
    results = run_ranks(measure_many, 2, configs, timeout_s=180)
    raise_first_failure(results, command="plan validation")
    for rank, per_rank in enumerate(results):
        for (name, lay), pred, measured in zip(cases, preds, per_rank):
            check = check_prediction(measured, pred)
            what = f"{name} {lay.describe()} lora rank {rank}"
            assert check["within"], (what, check)
            assert check["collectives_equal"], (what, check)
