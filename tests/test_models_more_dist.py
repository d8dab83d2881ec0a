"""The built-in OPT, T5 and ViT schedules with tensor parallelism on two gloo ranks.

For each tiny zoo model (dropout off): the schedule is applied inside ``tl.Verify``
(forward outputs, input gradients and every parameter gradient against the
single-process model), the logits match the single-process ones within 1e-5, and each
forward and backward runs exactly the expected collectives. T5 also runs with its gated
feed-forward block (wi_0, wi_1 -> wo); ViT also runs sequence parallel (an image of
3 x 3 patches: 10 tokens with the class token, split in two). One process-group launch
runs it all.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom.core.errors import ScheduleError
from torchloom.runtime.collectives import count_collectives
from torchloom.schedules import apply_schedule, zoo

LAYERS = 2  # every tiny zoo model has two layers per stack
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _no_dropout(model: nn.Module) -> nn.Module:
    """nn.Dropout modules off (the attention dropout of OPT and T5 is a float attribute
    from the config: the cases override those config fields)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


# Collectives per step. Megatron TP: one all-reduce after each row-parallel linear in
# forward, one on the input gradient of each region in backward. A T5 decoder block has
# three regions (self-attention, cross-attention, feed-forward); the cross-attention's
# keys and values come from the encoder, so its backward all-reduces that input's
# gradient as well. ViT SP: all-gathers before and reduce-scatters after each region,
# one scatter in and one all-gather out; backward mirrors them (the last all-gather keeps
# its slice), plus one all-reduce per parameter used on sequence slices (two LayerNorms
# and two row biases per layer, the final LayerNorm).
TP_REGIONS = {"opt": 2 * LAYERS, "vit": 2 * LAYERS, "t5": 2 * LAYERS + 3 * LAYERS}
CASES = [
    # (zoo name, config overrides, sequence parallel, forward counts, backward counts)
    ("opt", {"dropout": 0.0, "attention_dropout": 0.0}, False,
     {"all_reduce": TP_REGIONS["opt"]}, {"all_reduce": TP_REGIONS["opt"]}),
    ("t5", {"dropout_rate": 0.0}, False,
     {"all_reduce": TP_REGIONS["t5"]}, {"all_reduce": TP_REGIONS["t5"] + LAYERS}),
    ("t5", {"dropout_rate": 0.0, "feed_forward_proj": "gated-gelu"}, False,
     {"all_reduce": TP_REGIONS["t5"]}, {"all_reduce": TP_REGIONS["t5"] + LAYERS}),
    ("vit", {}, False,
     {"all_reduce": TP_REGIONS["vit"]}, {"all_reduce": TP_REGIONS["vit"]}),
    ("vit", {"image_size": 24}, True,
     {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS},
     {"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS, "all_reduce": 6 * LAYERS + 2}),
]


def _check_case(rank: int, name: str, overrides: dict, sp: bool, fwd: dict, bwd: dict) -> None:
    reference = _no_dropout(zoo.make_model(name, "tiny", seed=0, **overrides))
    model = copy.deepcopy(reference)
    inputs = zoo.example_inputs(name, reference, batch_size=2, seq_len=8)
    sch = tl.create_schedule(model)
    with tl.Verify(sch, inputs):  # static check, then forward and backward comparison
        apply_schedule(sch, tp=True, sequence_parallel=sp)
    assert any(tl.shard_spec(p) is not None for p in model.parameters())

    with count_collectives() as forward:
        out = model(**inputs)
    with count_collectives() as backward:
        out.loss.backward()
    with torch.no_grad():
        ref_logits = reference(**inputs).logits
    torch.testing.assert_close(out.logits, ref_logits, **TOL, msg=f"{name}: logits")
    assert dict(forward) == fwd, (name, sp, dict(forward))
    assert dict(backward) == bwd, (name, sp, dict(backward))


def _check_cases(rank: int) -> None:
    for case in CASES:
        _check_case(rank, *case)
    # 4 x 4 patches and the class token: 17 tokens do not split between two ranks
    sch = tl.create_schedule(zoo.make_model("vit", "tiny", seed=0))
    try:
        apply_schedule(sch, tp=True, sequence_parallel=True)
    except ScheduleError as err:
        assert err.values["tokens"] == 17 and err.values["world_size"] == 2, err.values
    else:
        raise AssertionError("ViT sequence parallelism over 17 tokens was not refused")


def test_opt_t5_vit_tensor_parallel_on_two_ranks():
    spawn(_check_cases)
