"""Data parallelism: build(target="ddp" | "fsdp"), alone on two ranks and composed with
tensor parallelism on a 2 x 2 mesh.

Each data-parallel rank trains on its half of the batch; after backward every parameter's
gradient must equal the gradient of the full-batch mean loss of the single-process model
(the sharded ones: the matching slice), and one optimizer step later the models agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchloom as tl
from tests.dist import spawn
from tests.tp_models import gpt2, llama
from torchloom.runtime.parallel import init_mesh
from torchloom.schedules import apply_schedule

TOL = dict(rtol=1e-5, atol=1e-6)


def _batch(rows: int = 4) -> dict:
    ids = torch.randint(0, 128, (rows, 8), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids.clone()}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _check_grads(model: nn.Module, reference: nn.Module, what: str) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        grad = _local(param.grad)
        expected = ref[name].grad
        spec = tl.shard_spec(param)
        if spec is not None:
            expected = spec.slice(expected)
        torch.testing.assert_close(grad, expected, **TOL, msg=f"{what}: grad of {name}")


def _data_parallel(rank: int, target: str, make) -> None:
    reference = make()
    sch = tl.create_schedule(copy.deepcopy(reference), group=None)
    model, opt = tl.build(sch, target=target, mesh=init_mesh(dp=2),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    batch = _batch()
    half = {k: v.chunk(2)[rank] for k, v in batch.items()}
    model(**half).loss.backward()
    reference(**batch).loss.backward()
    _check_grads(model, reference, target)
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    with torch.no_grad():
        loss, ref_loss = model(**half).loss, reference(**half).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)


def _ddp(rank: int) -> None:
    _data_parallel(rank, "ddp", gpt2)
    _data_parallel(rank, "ddp", llama)


def _fsdp(rank: int) -> None:
    _data_parallel(rank, "fsdp", gpt2)
    _data_parallel(rank, "fsdp", llama)


def _mesh_errors(rank: int) -> None:
    with pytest.raises(tl.BuildError, match=r"the mesh pp x dp_replicate x dp_shard x cp x tp = "
                                             r"1 x 3 x 1 x 1 x 1 = 3 does not cover the 2 ranks"):
        init_mesh(dp=3)


def test_ddp_and_fsdp_give_the_full_batch_gradients():
    spawn(_ddp, _fsdp, _mesh_errors)


def _tp_dp(rank: int, target: str) -> None:
    mesh = init_mesh(dp=2, tp=2)
    dp_rank = mesh["dp"].get_local_rank()
    reference = gpt2()
    sch = tl.create_schedule(copy.deepcopy(reference), group=mesh["tp"].get_group())
    assert sch.world_size == 2 and sch.rank == mesh["tp"].get_local_rank()
    apply_schedule(sch, tp=True)
    model, _ = tl.build(sch, target=target, mesh=mesh)
    batch = _batch()
    half = {k: v.chunk(2)[dp_rank] for k, v in batch.items()}
    out = model(**half)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, reference(**half).logits, **TOL)
    out.loss.backward()
    reference(**batch).loss.backward()
    _check_grads(model, reference, f"tp x dp ({target})")
    dist.barrier()


def _tp_dp_both(rank: int) -> None:
    _tp_dp(rank, "ddp")
    _tp_dp(rank, "fsdp")


def _schedules_with_data_parallel(rank: int) -> None:
    """pp 2 x dp 2 (a 4-layer Llama, two stages per rank): the zero-bubble schedules with
    DDP, and Interleaved1F1B with FSDP2, train as Interleaved1F1B with DDP (three steps of
    losses). With FSDP2 the zero-bubble schedules are refused: torch 2.13 left a stage's
    weight gradients unreduced there (its losses differed from the second step)."""
    from torchloom.apps.train import TrainConfig, TrainOptionError, train_rank

    common = dict(model="llama", size="small", steps=3, batch_size=8, seq_len=32,
                  progress=False, pp=2, dp=2, n_microbatches=4)
    reference = train_rank(rank, TrainConfig(pipeline_schedule="Interleaved1F1B", **common))
    for schedule, mode in (("InterleavedZeroBubble", "ddp"), ("ZBVZeroBubble", "ddp"),
                           ("Interleaved1F1B", "fsdp")):
        got = train_rank(rank, TrainConfig(pipeline_schedule=schedule, dp_mode=mode, **common))
        torch.testing.assert_close(torch.tensor(got["losses"]),
                                   torch.tensor(reference["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m, s=schedule, d=mode: f"{s} x {d}: {m}")
    with pytest.raises(TrainOptionError, match="ZBVZeroBubble with FSDP2 loses weight "
                                               "gradients"):
        TrainConfig(pipeline_schedule="ZBVZeroBubble", dp_mode="fsdp", **common)


def _four_ranks(rank: int) -> None:
    _tp_dp_both(rank)
    _schedules_with_data_parallel(rank)


@pytest.mark.slow
def test_tensor_parallel_composed_with_data_parallel_on_four_ranks():
    spawn(_four_ranks, world=4)
