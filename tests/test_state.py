"""State dicts and checkpoints in a single process (a world of one).

Round trips are exact (``torch.equal``); every error message is pinned. What a save may
write into, crashes at each point of a save, checksums and rotation are in
``test_state_trust.py``.
The multi-rank cases (TP=2 -> 1, 2, 4; a dead rank) are in ``test_state_dist.py``.
"""

from __future__ import annotations

import copy
import os
import re
import shutil

import pytest
import torch
import transformers
from torch import nn

import torchloom as tl
from torchloom.core.meta import ShardSpec, get_meta
from torchloom.runtime import state as S


def gpt2(seed: int = 0, **overrides) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64,
           "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    cfg.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))


def _batch() -> dict:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    model.eval()  # no dropout: the steps are reproducible
    for _ in range(steps):
        opt.zero_grad()
        model(**_batch()).loss.backward()
        opt.step()


def _named_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def _assert_same(model_a, opt_a, model_b, opt_b) -> None:
    a, b = model_a.state_dict(), model_b.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa, sb = _named_state(model_a, opt_a), _named_state(model_b, opt_b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].keys() == sb[name].keys(), name
        for key, value in sa[name].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[name][key]), (name, key)
            else:
                assert value == sb[name][key], (name, key)
    assert opt_a.state_dict()["param_groups"] == opt_b.state_dict()["param_groups"]


@pytest.fixture(scope="module")
def _trained_once(tmp_path_factory):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt)
    path = str(tmp_path_factory.mktemp("trained") / "ckpt")
    S.save(model, opt, path, step=2)
    return model, opt, path


@pytest.fixture
def trained(_trained_once, tmp_path):
    """A GPT-2 and AdamW after two steps and their checkpoint (step 2), each test its own."""
    model, opt, src = _trained_once
    model, opt = copy.deepcopy((model, opt))
    path = str(tmp_path / "ckpt")
    shutil.copytree(src, path)
    return model, opt, path


def _fresh(seed: int = 1, **overrides):
    model = gpt2(seed, **overrides)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


# --------------------------------------------------------------------------- round trips


def test_gpt2_adamw_round_trip_is_exact(trained):
    model, opt, path = trained
    fresh, fresh_opt = _fresh()
    assert not torch.equal(fresh.transformer.wte.weight, model.transformer.wte.weight)
    assert S.load(fresh, fresh_opt, path) == 2
    _assert_same(model, opt, fresh, fresh_opt)
    assert len(_named_state(fresh, fresh_opt)) == len(list(model.parameters()))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    assert set(os.listdir(os.path.dirname(path))) == {"ckpt"}  # no leftovers
    _train(model, opt, 1)
    _train(fresh, fresh_opt, 1)  # and training resumes identically
    _assert_same(model, opt, fresh, fresh_opt)


def test_scheduled_model_round_trip_and_full_state_dict():
    # a world of one: shard records the spec, the slice is the whole tensor
    model = gpt2()
    reference = gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.0.attn.c_attn"].shard("weight", 1, chunks=3)
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    full = S.full_state_dict(model)
    assert list(full) == list(reference.state_dict())
    for key, tensor in reference.state_dict().items():
        assert torch.equal(full[key], tensor), key
    gpt2(3).load_state_dict(full, strict=True)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_sgd_round_trip_and_overwrite(tmp_path, momentum):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    path = tmp_path / "ckpt"
    S.save(model, opt, path, step=1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    S.save(model, opt, path, step=5)  # the newest of the directory's two
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.3, momentum=momentum)
    assert S.load(fresh, fresh_opt, path) == 5
    _assert_same(model, opt, fresh, fresh_opt)


def test_model_only_round_trip(tmp_path):
    model = gpt2()
    S.save(model, None, tmp_path / "ckpt", step=0)
    fresh = gpt2(1)
    assert S.load(fresh, None, tmp_path / "ckpt") == 0
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key


def test_full_optimizer_state_dict_world_of_one(trained):
    model, opt, _ = trained
    full = S.full_optimizer_state_dict(model, opt)
    assert list(full) == [n for n, _ in model.named_parameters()]
    for name, state in _named_state(model, opt).items():
        for key, value in state.items():
            assert torch.equal(full[name][key], value)


# --------------------------------------------------------------------------- errors
# (atomicity, refusals, checksums and discovery: tests/test_state_trust.py)


def test_checkpoint_of_another_model_lists_the_keys(trained):
    _, _, path = trained
    other, other_opt = _fresh(n_layer=1)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): the checkpoint holds another model: its keys differ from the "
            "model's")) as info:
        S.load(other, other_opt, path)
    message = str(info.value)
    assert message.startswith(
        "load(...): the checkpoint holds another model: its keys differ from the model's\n"
        f"    values: path={os.path.join(path, 'step-2')!r}, missing_keys=[], unexpected_keys=['transformer.h.1.ln_1.weight', "
        "'transformer.h.1.ln_1.bias', 'transformer.h.1.attn.c_attn.weight', "
        "'transformer.h.1.attn.c_attn.bias', 'transformer.h.1.attn.c_proj.weight', "
        "'transformer.h.1.attn.c_proj.bias', '... 6 more']\n"), message
    assert message.endswith(
        "    fix: load it into the model it was saved from (same architecture and config), or "
        "load it into that model and copy the matching tensors over")


def test_wrong_full_shapes(trained):
    _, _, path = trained
    other, other_opt = _fresh(vocab_size=256)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): full shapes differ between the checkpoint and the model")) as info:
        S.load(other, other_opt, path)
    assert str(info.value) == (
        "load(...): full shapes differ between the checkpoint and the model\n"
        f"    values: path={os.path.join(path, 'step-2')!r}, shapes (key, checkpoint, model)="
        "[('transformer.wte.weight', (128, 32), (256, 32)), "
        "('lm_head.weight', (128, 32), (256, 32))]\n"
        "    fix: load into a model with the saved configuration (check hidden sizes, vocab "
        "size, number of heads)")


def test_model_sharded_for_another_world_size(trained):
    _, _, path = trained
    model, opt = _fresh()
    weight = model.transformer.h[0].mlp.c_fc.weight
    get_meta(weight).shard = ShardSpec(axis=1, full_shape=(32, 128), world_size=2, rank=0)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): 'transformer.h.0.mlp.c_fc.weight' was sharded for rank 0 of 2, but this "
            "is rank 0 of a group of 1")) as info:
        S.load(model, opt, path)
    assert str(info.value) == (
        "load(...): 'transformer.h.0.mlp.c_fc.weight' was sharded for rank 0 of 2, but this "
        "is rank 0 of a group of 1\n"
        "    values: key='transformer.h.0.mlp.c_fc.weight', spec_world_size=2, spec_rank=0, "
        "group_size=1, group_rank=0\n"
        "    fix: call it on every rank of the group the model was scheduled with: "
        "load(model, ..., group=sch.group)")
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "full_state_dict(...): 'transformer.h.0.mlp.c_fc.weight' was sharded for rank 0 "
            "of 2")) as info:
        S.full_state_dict(model)
    assert str(info.value).startswith("full_state_dict(...): 'transformer.h.0.mlp.c_fc.weight' "
                                      "was sharded for rank 0 of 2")


def test_world_size_that_does_not_divide_the_axis():
    model = nn.Linear(4, 6)
    get_meta(model.weight).shard = ShardSpec(axis=0, full_shape=(6, 4), world_size=1, rank=0,
                                             chunks=4)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "full_state_dict(...): axis 0 of 'weight' (size 6) does not split into 4 block(s) "
            "of 1 equal pieces")) as info:
        S.full_state_dict(model)
    assert str(info.value) == (
        "full_state_dict(...): axis 0 of 'weight' (size 6) does not split into 4 block(s) of "
        "1 equal pieces\n"
        "    values: key='weight', full_shape=(6, 4), axis=0, chunks=4, world_size=1\n"
        "    fix: use a world size that divides 1")


def test_optimizer_errors(tmp_path, trained):
    model, _, path = trained
    S.save(model, None, tmp_path / "model-only", step=1)
    fresh, fresh_opt = _fresh()
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): the checkpoint holds no optimizer state")) as info:
        S.load(fresh, fresh_opt, tmp_path / "model-only")
    assert str(info.value) == (
        "load(...): the checkpoint holds no optimizer state\n"
        f"    values: path={str(tmp_path / 'model-only' / 'step-1')!r}\n"
        "    fix: load(model, None, path), or save with the optimizer: "
        "save(model, optimizer, path, step)")

    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): the checkpoint holds the state of another optimizer class")) as info:
        S.load(fresh, sgd, path)
    assert str(info.value) == (
        "load(...): the checkpoint holds the state of another optimizer class\n"
        f"    values: path={os.path.join(path, 'step-2')!r}, checkpoint='AdamW', optimizer='SGD'\n"
        "    fix: load it into a AdamW optimizer")

    params = list(fresh.parameters())
    split = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "load(...): the optimizer's parameter groups differ from the checkpoint's")) as info:
        S.load(fresh, split, path)
    message = str(info.value)
    assert message.startswith(
        "load(...): the optimizer's parameter groups differ from the checkpoint's\n"
        f"    values: path={os.path.join(path, 'step-2')!r}, optimizer_groups=[['transformer.wte.weight', "
        "'transformer.wpe.weight'], ['transformer.h.0.ln_1.weight', "), message
    assert message.endswith(
        "    fix: make the optimizer with the same parameter groups, in the same order, as "
        "the one that was saved")

    stranger = torch.optim.AdamW([nn.Parameter(torch.zeros(3, 5))])
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "save(...): param_groups[0] of the optimizer holds a parameter of shape (3, 5) that "
            "is not a parameter of the model")) as info:
        S.save(fresh, stranger, tmp_path / "x", step=0)
    assert str(info.value) == (
        "save(...): param_groups[0] of the optimizer holds a parameter of shape (3, 5) that "
        "is not a parameter of the model\n"
        "    values: group=0, shape=(3, 5)\n"
        "    fix: make the optimizer from this model's parameters after build: "
        "model, optimizer = tl.build(sch, optimizer=lambda ps: AdamW(ps))")
    assert not os.path.exists(tmp_path / "x")


def test_bad_arguments(tmp_path):
    model, opt = _fresh()
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "save(...): step must be a non-negative int, not 2.5")) as info:
        S.save(model, opt, tmp_path / "c", step=2.5)
    assert str(info.value) == (
        "save(...): step must be a non-negative int, not 2.5\n"
        "    values: step=2.5\n"
        "    fix: save(model, optimizer, path, step=int(step))")
    with pytest.raises(tl.ScheduleError, match=re.escape(
            "init_distributed(...): timeout_s must be a positive number of seconds, "
            "not 0")) as info:
        S.init_distributed(timeout_s=0)
    assert str(info.value) == (
        "init_distributed(...): timeout_s must be a positive number of seconds, not 0\n"
        "    values: timeout_s=0\n"
        "    fix: init_distributed(timeout_s=60)")


def test_init_distributed_twice_raises():
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert S.init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                              timeout_s=5) == (0, 1)
    try:
        with pytest.raises(tl.ScheduleError, match=re.escape(
                "init_distributed(...): the default process group is already initialised")) as info:
            S.init_distributed(timeout_s=5)
        assert str(info.value) == (
            "init_distributed(...): the default process group is already initialised; its "
            "timeout cannot be set now\n"
            "    values: timeout_s=5, world_size=1\n"
            "    fix: call init_distributed(...) instead of the first init_process_group(...), "
            "or pass timeout=datetime.timedelta(seconds=...) to that call")
        # a group of one: the state functions work and issue no collective
        model = nn.Linear(4, 6)
        tl.create_schedule(model).shard("weight", 0)
        assert torch.equal(S.full_state_dict(model)["weight"], model.weight)
    finally:
        dist.destroy_process_group()


def test_errors_pickle():
    import pickle

    err = S.CollectiveTimeoutError("x", primitive="load", values={"a": 1}, fix="y")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is S.CollectiveTimeoutError and str(again) == str(err)
