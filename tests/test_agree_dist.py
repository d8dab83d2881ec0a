"""Ranks agree: build and Verify refuse, on every rank, a schedule that differs across ranks.

One 2-rank gloo launch runs every multi-rank check: a rank that shards the fused q/k/v
weight with ``chunks=3`` where the other used 1, a rank that skips one sync, a rank whose
model has other parameter shapes, the same mismatch under ``Verify``; schedules that
agree (arguments that are lambdas and module instances included) build with exactly one
small all-gather; a build for FSDP cannot be rebuilt. A one-process test checks that
build works under the ``fake`` process-group backend used to simulate scale.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import torchloom as tl
from tests import tiny
from tests.dist import spawn
from torchloom.core.errors import BuildError


def _tp_gpt2(rank: int, skip_sync: bool = False) -> tl.Schedule:
    """A Megatron-style TP schedule of the tiny GPT-2's first MLP."""
    sch = tl.create_schedule(tiny.gpt2())
    mlp = sch["transformer.h.0.mlp"]
    mlp["c_fc"].shard("weight", 1)                          # line 1
    mlp["c_fc"].shard("bias", 0)                            # line 2
    if not skip_sync:
        mlp["c_fc"].sync("bwd_post", "all_reduce")          # line 3
    mlp["c_proj"].shard("weight", 0)                        # line 4
    mlp["c_proj"].sync("fwd_post", "all_reduce")            # line 5
    return sch


def _mismatch(rank: int, build, line: int, here: str, there: str) -> str:
    other = 1 - rank
    with pytest.raises(tl.ScheduleMismatchError, match=(
            rf"rank {rank} and rank {other} scheduled differently: recipe line {line} "
            r"differs")) as info:
        build()
    message = str(info.value)
    expected = (f"rank {rank} and rank {other} scheduled differently: recipe line {line} "
                f"differs\n    values: line={line}, this_rank={rank}, this_line={here!r}, "
                f"other_rank={other}, other_line={there!r}")
    assert expected in message, message
    assert message.endswith(
        "fix: apply the same primitives with the same arguments on every rank of the group "
        "(the schedule must not depend on the rank); compare print(sch.recipe) on rank "
        f"{rank} and rank {other}"), message
    return message


def _check_chunks_differ(rank: int) -> None:
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.attn.c_attn"].shard("weight", 1, chunks=3 if rank == 1 else 1)
    texts = {0: "sch['transformer.h.0.attn.c_attn'].shard('weight', 1)",
             1: "sch['transformer.h.0.attn.c_attn'].shard('weight', 1, chunks=3)"}
    message = _mismatch(rank, lambda: tl.build(sch), 1, texts[rank], texts[1 - rank])
    assert message.startswith("build(...): ")
    assert "path='transformer.h.0.attn.c_attn'" in message
    assert not sch.built  # refused before anything was built


def _check_same_call_written_two_ways_agrees(rank: int) -> None:
    sch = tl.create_schedule(tiny.gpt2())
    if rank == 0:
        sch["transformer.h.0.attn.c_attn"].shard("weight", 1)
    else:
        sch["transformer.h.0.attn.c_attn"].shard(param_name="weight", axis=1, chunks=1)
    tl.build(sch)
    assert sch.built


def _check_skipped_sync(rank: int) -> None:
    sch = _tp_gpt2(rank, skip_sync=rank == 1)
    texts = {0: "sch['transformer.h.0.mlp.c_fc'].sync('bwd_post', 'all_reduce')",
             1: "sch['transformer.h.0.mlp.c_proj'].shard('weight', 0)"}
    _mismatch(rank, lambda: tl.build(sch), 3, texts[rank], texts[1 - rank])


def _check_recipe_ends_early(rank: int) -> None:
    sch = _tp_gpt2(rank)
    if rank == 0:
        sch["transformer.h.1"].checkpoint()
    texts = {0: "sch['transformer.h.1'].checkpoint()",
             1: "(nothing: the recipe ends after line 5)"}
    _mismatch(rank, lambda: tl.build(sch), 6, texts[rank], texts[1 - rank])


def _check_other_parameter_shapes(rank: int) -> None:
    sch = tl.create_schedule(tiny.gpt2(n_layer=2 if rank == 0 else 3))
    sch["transformer.h.0"].checkpoint()
    with pytest.raises(tl.ScheduleMismatchError, match=(
            rf"rank {rank} and rank {1 - rank} have the same recipe but other local "
            r"parameters or modules: parameter 27 differs")) as info:
        tl.build(sch)
    message = str(info.value)
    assert f"rank {rank} and rank {1 - rank} have the same recipe but other local " \
        "parameters or modules: parameter 27 differs" in message, message
    # 2 + 12 per layer parameters before ln_f: parameter 27 is where the layer counts part
    texts = {0: "transformer.ln_f.weight: (32,) torch.float32",
             1: "transformer.h.2.ln_1.weight: (32,) torch.float32"}
    assert f"this_parameter={texts[rank]!r}" in message, message
    assert f"other_parameter={texts[1 - rank]!r}" in message, message


def _check_replaced_module_arguments_differ(rank: int) -> None:
    """The probe: rank 0 replaced a module with Dropout(0.1), rank 1 with Dropout(0.9)."""
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp.dropout"].replace(nn.Dropout(0.1 if rank == 0 else 0.9))
    with pytest.raises(tl.ScheduleMismatchError, match=(
            rf"rank {rank} and rank {1 - rank} scheduled differently: recipe line 1 "
            r"differs")) as info:
        tl.build(sch)
    message = str(info.value)
    assert "Dropout(p=0.1, inplace=False) train" in message and "Dropout(p=0.9" in message, message


def _dropout_for_this_rank(old: nn.Module) -> nn.Module:
    return nn.Dropout(0.1 if dist.get_rank() == 0 else 0.9)


def _check_factory_that_depends_on_the_rank(rank: int) -> None:
    """The same recipe line (a factory), but the modules it made differ."""
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp.dropout"].replace(_dropout_for_this_rank)
    with pytest.raises(tl.ScheduleMismatchError, match=(
            rf"rank {rank} and rank {1 - rank} have the same recipe but other local "
            r"parameters or modules: module \d+ \(its class or configuration\) differs")) as info:
        tl.build(sch)
    texts = {0: "transformer.h.0.mlp.dropout: Dropout(p=0.1, inplace=False) train",
             1: "transformer.h.0.mlp.dropout: Dropout(p=0.9, inplace=False) train"}
    assert f"this_parameter={texts[rank]!r}" in str(info.value), str(info.value)


def _check_verify_mismatch(rank: int) -> None:
    sch = tl.create_schedule(tiny.gpt2())
    ids = tiny.token_batch()["input_ids"]
    texts = {0: "sch['transformer.h.0.attn.c_proj'].shard('weight', 0)",
             1: "sch['transformer.h.0.mlp.c_proj'].shard('weight', 0)"}
    layer = "attn" if rank == 0 else "mlp"

    def run() -> None:
        with tl.Verify(sch, (ids,)):
            sch[f"transformer.h.0.{layer}.c_proj"].shard("weight", 0)
            sch[f"transformer.h.0.{layer}.c_proj"].sync("fwd_post", "all_reduce")

    message = _mismatch(rank, run, 1, texts[rank], texts[1 - rank])
    assert message.startswith("sch[''].Verify(...): ")


def _check_agreeing_schedules_build_with_one_small_all_gather(rank: int) -> None:
    reference = tiny.gpt2()
    sch = _tp_gpt2(rank)
    # arguments that are not data render the same on every rank (no memory addresses)
    sch["transformer.h.1.mlp.act"].replace(nn.GELU(approximate="tanh"))
    reference.transformer.h[1].mlp.act = nn.GELU(approximate="tanh")
    sch["transformer.h.1.attn"].replace(lambda old: old)
    sch["transformer.h.1.ln_1"].sync("fwd_post", lambda module, args, output: output)
    with CommDebugMode() as comm:
        model, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    assert counts == {"c10d.allgather_": 1}, counts
    assert sch.built and model.transformer.h[0].mlp.c_fc.weight.shape == (32, 64)
    # and the built TP model computes what the unscheduled one does
    batch = tiny.token_batch()
    torch.testing.assert_close(model(**batch).loss, reference(**batch).loss,
                               rtol=1e-5, atol=1e-6)


def _check_fsdp_build_cannot_be_rebuilt(rank: int) -> None:
    sch = tl.create_schedule(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    tl.build(sch, target="fsdp", fsdp_units=["0"])
    with pytest.raises(BuildError, match=re.escape(
            "a schedule built for FSDP cannot be rebuilt: fully_shard replaced its "
            "parameters by sharded DTensors in place")):
        tl.build(sch, target="fsdp", rebuild=True)
    with pytest.raises(BuildError, match="this schedule was already built"):
        tl.build(sch)


def test_ranks_that_scheduled_differently_all_raise_naming_the_line():
    spawn(_check_chunks_differ, _check_same_call_written_two_ways_agrees, _check_skipped_sync, _check_recipe_ends_early,
          _check_other_parameter_shapes, _check_replaced_module_arguments_differ,
          _check_factory_that_depends_on_the_rank, _check_verify_mismatch,
          _check_agreeing_schedules_build_with_one_small_all_gather,
          _check_fsdp_build_cannot_be_rebuilt, timeout_s=60)


def test_build_under_the_fake_backend_used_for_scale_simulation():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        with tl.init_empty_weights():
            model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        sch = tl.create_schedule(model)
        assert (sch.world_size, sch.rank) == (8, 0)
        sch["0"].shard("weight", 0)
        sch["0"].shard("bias", 0)
        sch["0"].sync("bwd_post", "all_reduce")
        sch["2"].shard("weight", 1)
        sch["2"].sync("fwd_post", "all_reduce")
        torch.manual_seed(3)
        with CommDebugMode() as comm:
            built, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        assert comm.get_total_counts() == 0  # the agreement check is skipped on "fake"
        assert sch.built and built[0].weight.shape == (4, 16) and built[2].weight.shape == (16, 4)
        torch.manual_seed(3)
        full = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        assert torch.equal(built[0].weight, full[0].weight[:4])  # rank 0's rows
        assert torch.equal(built[2].weight, full[2].weight[:, :4])
        assert built(torch.ones(2, 16)).shape == (2, 16)  # fake collectives do nothing
    finally:
        dist.destroy_process_group()
