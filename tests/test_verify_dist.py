"""Verify on two gloo ranks: planted schedule bugs are caught and named; correct
Megatron schedules of GPT-2, BERT and Llama (TP and SP) pass with no false alarm.

Each planted bug is one line wrong in an otherwise correct GPT-2 TP schedule. The table
says which check catches it: the static check before anything runs, or the differential
run (forward or backward). One process-group launch runs every case; all ranks must agree.
"""

from __future__ import annotations

import torch
from torch import nn

import torchloom as tl
from tests.dist import spawn
from tests.helpers import UnseededCheckpoint
from tests.tp_models import CASES, gpt2, gpt2_attention_split
from torchloom.runtime import collectives as C
from torchloom.schedules._common import column, row

WORLD = 2


def user_all_reduce(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A user's own all-reduce hook: correct on its own, but on a module with a bias the
    bias has already been added on every rank."""
    return C.all_reduce(output)


def gpt2_tp(sch: tl.Schedule, bug: str | None = None) -> None:
    """The Megatron GPT-2 schedule, with one planted bug (or none)."""
    for i in range(2):
        block = sch[f"transformer.h.{i}"]
        column(block["attn.c_attn"], chunks=3)
        block["attn"].replace(gpt2_attention_split)
        row(block["attn.c_proj"])
        block["attn"].sync("bwd_post", "all_reduce")
        block["attn.c_proj"].sync("fwd_post", "all_reduce")
        if i == 1 and bug == "wrong shard axis":  # row-style shard of a column module
            block["mlp.c_fc"].shard("weight", 0)
        elif i == 1 and bug == "column output fed to an unsharded module":
            column(block["mlp.c_fc"])
        else:
            column(block["mlp.c_fc"])
        if not (i == 1 and bug == "column output fed to an unsharded module"):
            row(block["mlp.c_proj"])
        if not (i == 1 and bug == "missing bwd_post all_reduce"):
            block["mlp"].sync("bwd_post", "all_reduce")
        if i == 1 and bug == "missing fwd_post all_reduce":
            pass
        elif i == 1 and bug == "bias added before the reduction":
            block["mlp.c_proj"].sync("fwd_post", user_all_reduce)
        elif not (i == 1 and bug == "column output fed to an unsharded module"):
            block["mlp.c_proj"].sync("fwd_post", "all_reduce")
        if i == 1 and bug == "sharded norm weight":
            block["ln_2"].shard("weight", 0)
            block["ln_2"].shard("bias", 0)
        if i == 1 and bug == "wrong replacement":
            block["mlp.act"].replace(nn.ReLU())
        if i == 1 and bug == "checkpoint with unseeded dropout":
            block.replace(UnseededCheckpoint(block.mod))


# (bug, static check on?, expected path, expected phase or static rule)
PLANTED: list[tuple[str, bool, str, str]] = [
    ("missing fwd_post all_reduce", True, "transformer.h.1.mlp.c_proj", "partial never reduced"),
    ("missing fwd_post all_reduce", False, "transformer.h.1.mlp.c_proj", "forward output"),
    ("missing bwd_post all_reduce", True, "transformer.h.1.mlp.c_fc", "gradient left partial"),
    ("missing bwd_post all_reduce", False, "transformer.h.1.mlp", "input gradient"),
    ("wrong shard axis", True, "transformer.h.1.mlp.c_fc", "partial never reduced"),
    ("bias added before the reduction", True, "transformer.h.1.mlp.c_proj", "bias before reduction"),
    ("bias added before the reduction", False, "transformer.h.1.mlp.c_proj", "forward output"),
    ("sharded norm weight", True, "transformer.h.1.ln_2", "sharded norm"),
    ("column output fed to an unsharded module", True, "transformer.h.1.mlp.c_fc",
     "sharded output never consumed"),
    ("column output fed to an unsharded module", False, "transformer.h.1.mlp.c_proj", "forward"),
    ("wrong replacement", True, "transformer.h.1.mlp.act", "forward output"),
    ("checkpoint with unseeded dropout", True, "transformer.h.1", "input gradient"),
]


def _inputs() -> dict:
    return {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(9))}


def _dropout_gpt2() -> nn.Module:
    model = gpt2()
    for block in model.transformer.h:  # residual dropout: outside the sharded regions
        block.attn.resid_dropout.p = 0.2
        block.mlp.dropout.p = 0.2
    return model


def _trained_biases(model: nn.Module) -> nn.Module:
    """GPT-2 initialises biases to zero, which hides bias bugs; a trained model has not."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _run_planted(rank: int) -> None:
    for bug, static, path, what in PLANTED:
        model = _trained_biases(_dropout_gpt2() if "dropout" in bug else gpt2())
        sch = tl.create_schedule(model)
        try:
            with tl.Verify(sch, _inputs(), static_check=static):
                gpt2_tp(sch, bug)
        except tl.VerificationError as err:
            assert err.path == path, (bug, static, err.path, str(err))
            text = str(err)
            if static:
                assert what in err.problem, (bug, text)
            else:
                assert err.values["phase"] == what, (bug, text)
        else:
            raise AssertionError(f"planted bug not caught: {bug} (static check {static})")


def _run_correct(rank: int) -> None:
    model = _trained_biases(_dropout_gpt2())
    sch = tl.create_schedule(model)
    with tl.Verify(sch, _inputs()):
        gpt2_tp(sch)
    for _name, make, schedule, sp, _ in CASES:
        sch = tl.create_schedule(make())
        with tl.Verify(sch, _inputs()):
            schedule(sch, sp)


def test_planted_bugs_are_caught_and_correct_schedules_pass():
    assert len({bug for bug, *_ in PLANTED}) >= 8
    spawn(_run_correct, _run_planted)



