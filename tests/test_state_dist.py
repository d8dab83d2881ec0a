"""State dicts and checkpoints across world sizes, on gloo ranks.

* TP=2 GPT-2 (Megatron schedule of ``tests.tp_models``): ``full_state_dict``
  equals the reference model's ``state_dict`` exactly, key order included, and loads into a
  fresh transformers model with ``strict=True``;
* a checkpoint saved at TP=2 with AdamW state after two steps loads back at TP=2 (local
  shards and optimizer state exact), at TP=1 in a separate single process, and at TP=4
  (exact against the gathered full tensors);
* two ranks refuse a directory of user files alike, and both name a damaged file of
  rank 1's (the checksums are split over the ranks) and fall back to the previous step;
* a rank that exits without joining a collective makes the other fail within the timeout
  with a :class:`~torchloom.runtime.state.CollectiveTimeoutError`.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # imported before forking, see _launch
import torch.multiprocessing as mp
import transformers
from torch import nn

import torchloom as tl
from tests import tp_models
from tests.tp_models import gpt2, tp_gpt2
from torchloom.runtime import state as S
from torchloom.runtime.launch import free_port as _free_port

# The workers are forked (each sets torch.set_num_threads(1), see ENVIRONMENT.md): they
# inherit the imported modules instead of importing torch and transformers again, which
# takes seconds per process on two cores. Load the lazily imported parts first.
transformers.GPT2LMHeadModel  # noqa: B018


def _launch(fn, nprocs: int, *args) -> None:
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="fork")


def _scheduled_gpt2(seed: int = 0) -> nn.Module:
    model = gpt2()
    if seed:  # other weights, so that a load visibly changes them
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    sch = tl.create_schedule(model)
    tp_gpt2(sch, sp=False)
    model, _ = tl.build(sch)
    return model


def _adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    batch = tp_models.batch()
    for _ in range(steps):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    with torch.no_grad():
        return model(**batch).loss


def _named_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, state in a.items():
        assert state.keys() == b[name].keys(), name
        for key, value in state.items():
            assert torch.equal(value, b[name][key]), (name, key)


def _tp2_worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    S.init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                       timeout_s=60)
    try:
        reference = gpt2()
        model = _scheduled_gpt2()
        assert tl.shard_spec(model.transformer.h[0].attn.c_attn.weight).chunks == 3
        full = S.full_state_dict(model)
        expected = reference.state_dict()
        assert list(full) == list(expected)
        for key in expected:
            assert full[key].shape == expected[key].shape, key
            assert torch.equal(full[key], expected[key]), key
        fresh = transformers.GPT2LMHeadModel(reference.config)
        fresh.load_state_dict(full, strict=True)

        opt = _adamw(model)
        _train(model, opt, 2)
        ckpt = os.path.join(root, "ckpt")
        S.save(model, opt, ckpt, step=2)
        full = S.full_state_dict(model)
        full_opt = S.full_optimizer_state_dict(model, opt)
        if rank == 0:
            torch.save({"model": full, "optim": full_opt}, os.path.join(root, "full.pt"))

        # TP=2 -> TP=2: exact local shards and optimizer state, step and hyperparameters.
        other = _scheduled_gpt2(seed=3)
        other_opt = _adamw(other, lr=0.5)
        assert S.load(other, other_opt, ckpt) == 2
        theirs = dict(other.state_dict(keep_vars=True))
        for key, tensor in model.state_dict(keep_vars=True).items():
            assert torch.equal(theirs[key], tensor), key
            assert tl.shard_spec(theirs[key]) == tl.shard_spec(tensor), key
        _assert_state_equal(_named_state(model, opt), _named_state(other, other_opt))
        assert other_opt.param_groups[0]["lr"] == 1e-2
        assert other.lm_head.weight is other.transformer.wte.weight
        # training resumes identically
        assert torch.equal(_train(model, opt, 1), _train(other, other_opt, 1))
        _trust_checks(rank, model, opt, root)
    finally:
        dist.destroy_process_group()


def _trust_checks(rank: int, model: nn.Module, opt: torch.optim.Optimizer, root: str) -> None:
    """On two ranks: a refusal and a damaged file are seen alike by both ranks (rank 0
    decides, the checksums are split over the ranks and gathered)."""
    import warnings

    foreign = os.path.join(root, "foreign")
    if rank == 0:
        os.makedirs(foreign)
        with open(os.path.join(foreign, "notes.txt"), "w") as f:
            f.write("mine")
    dist.barrier()
    try:
        S.save(model, opt, foreign, step=3)
        raise AssertionError("saved into a directory of user files")
    except S.CheckpointIOError as exc:
        assert str(exc).startswith("save(...): the directory holds files torchloom did not "
                                   "write"), str(exc)
    assert os.listdir(foreign) == ["notes.txt"]

    run = os.path.join(root, "trust")
    S.save(model, opt, run, step=3)
    state3 = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1)
    S.save(model, opt, run, step=4)
    shards = sorted(f for f in os.listdir(os.path.join(run, "step-4")) if f.endswith(".distcp"))
    assert len(shards) == 2, shards  # one file per rank
    dist.barrier()
    if rank == 0:  # damage rank 1's file: rank 1 or rank 0 checks it, both must know
        with open(os.path.join(run, "step-4", shards[1]), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    other = _scheduled_gpt2(seed=7)
    other_opt = _adamw(other)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert S.load(other, other_opt, run) == 3
    said = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0), said  # rank 0 tells
    if rank == 0:
        assert f"file {shards[1]!r} does not match the SHA-256 checksum" in said[0], said
    for key, tensor in other.state_dict().items():
        assert torch.equal(tensor, state3[key]), key
    try:
        S.load(other, other_opt, run, step=4)
        raise AssertionError("loaded a damaged checkpoint")
    except S.CheckpointIOError as exc:
        assert str(exc).startswith(f"load(...): checkpoint 'step-4' (step 4) is damaged: file "
                                   f"{shards[1]!r} does not match"), str(exc)


def _tp4_worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    S.init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                       timeout_s=60)
    try:
        saved = torch.load(os.path.join(root, "full.pt"), weights_only=True)
        model = _scheduled_gpt2(seed=5)
        opt = _adamw(model, lr=0.5)
        assert S.load(model, opt, os.path.join(root, "ckpt")) == 2
        sharded = 0
        for key, tensor in model.state_dict(keep_vars=True).items():
            spec = tl.shard_spec(tensor)
            expected = saved["model"][key]
            if spec is not None:
                sharded += 1
                assert (spec.world_size, spec.rank) == (4, rank)
                expected = spec.slice(expected)
            assert torch.equal(tensor, expected), key
        assert sharded > 0
        names = dict(model.named_parameters())
        for name, state in _named_state(model, opt).items():
            spec = tl.shard_spec(names[name])
            for key, value in state.items():
                expected = saved["optim"][name][key]
                if spec is not None and key != "step":
                    expected = spec.slice(expected)
                assert torch.equal(value, expected), (name, key)
        assert S.full_optimizer_state_dict(model, opt).keys() == saved["optim"].keys()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("state_dist"))
    _launch(_tp2_worker, 2, _free_port(), root)
    return root


def test_tp2_full_state_dict_and_checkpoint_round_trip_at_tp2_and_tp1(tp2_checkpoint: str):
    # TP=1: a separate single process (no process group) loads the TP=2 checkpoint.
    assert not dist.is_initialized()
    saved = torch.load(os.path.join(tp2_checkpoint, "full.pt"), weights_only=True)
    model = gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = _adamw(model, lr=0.5)
    path = os.path.join(tp2_checkpoint, "ckpt")
    stored = torch.distributed.checkpoint.FileSystemReader(
        os.path.join(path, "step-2")).read_metadata()
    c_attn = stored.state_dict_metadata["model.transformer.h.0.attn.c_attn.weight"]
    assert tuple(c_attn.size) == (32, 96)  # full shape, written as 2 ranks x 3 q/k/v pieces
    assert sorted(tuple(c.offsets) for c in c_attn.chunks) == [(0, 16 * i) for i in range(6)]
    assert S.load(model, opt, path) == 2
    state = model.state_dict()
    assert list(state) == list(saved["model"])
    for key, tensor in state.items():
        assert torch.equal(tensor, saved["model"][key]), key
    _assert_state_equal(_named_state(model, opt), saved["optim"])
    assert opt.param_groups[0]["lr"] == 1e-2


def test_tp2_checkpoint_loads_at_tp4(tp2_checkpoint: str):
    _launch(_tp4_worker, 4, _free_port(), tp2_checkpoint)


TIMEOUT_S = 5.0


def _dead_rank_worker(rank: int, port: int, mode: str) -> None:
    torch.set_num_threads(1)
    S.init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                       timeout_s=TIMEOUT_S)
    model = nn.Sequential(nn.Linear(4, 8))
    tl.create_schedule(model)["0"].shard("weight", 0)
    dist.barrier()
    if rank == 1:
        if mode == "hang":  # alive, but never joins the gather below
            time.sleep(TIMEOUT_S + 1)
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(S.CollectiveTimeoutError, match=re.escape(
            "full_state_dict(...): collective all_gather failed after")) as info:
        S.full_state_dict(model)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 3, elapsed
    if mode == "hang":  # it waited for the timeout (an exited peer is noticed at once)
        assert elapsed > TIMEOUT_S - 1, elapsed
    message = str(info.value)
    assert message.startswith("full_state_dict(...): collective all_gather failed after"), message
    assert f"(timeout {TIMEOUT_S:g} s): another rank died, hung, or did not call it" in message
    assert "'collective': 'all_gather'" not in message  # values are rendered as key=value
    assert "collective='all_gather', timeout_s=5.0, rank=0" in message, message
    assert "fix: call full_state_dict(...) on every rank of the group" in message, message
    os._exit(0)  # the group is broken: skip its teardown


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_rank_fails_the_collective_within_the_timeout(mode: str):
    start = time.monotonic()
    _launch(_dead_rank_worker, 2, _free_port(), mode)
    assert time.monotonic() - start < TIMEOUT_S + 10
