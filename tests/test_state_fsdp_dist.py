"""Checkpoints of FSDP2, HSDP and pipelined models on four gloo ranks (one launch).

A GPT-2 (fused q/k/v, 4 heads) trained two AdamW steps in this process is the reference,
saved here ("single"). On four ranks it is loaded into each layout: TP 2 (the replicas of
data-parallel rank 0 save, ``group=`` the tp group), every rank with the whole model
("ddp", ``group=None``), FSDP 4, TP 2 x FSDP 2 (FSDP chunks of tensor-parallel slices:
pieces of non-contiguous q/k/v blocks) and HSDP 2 x 2 (the latter three: every rank,
``group=None``); each layout saves, and every layout loads every checkpoint. The gathered
full state and full optimizer state equal the reference exactly each time, and this
process loads every checkpoint back too. After one more AdamW step on DTensors (state
made by torch's AdamW), FSDP 4 saves again and one process loads it exactly; TP 2 x FSDP 2
trains on from a load like the reference (the loss after a step). Small odd-sized tensors (empty FSDP shards)
round-trip too.

Pipelines (2 stages x 2 data-parallel ranks): a GPT-2 pipeline (its embedding tied to the
head across the stages) with AdamW state saved into one checkpoint by one replica's
pipeline ranks round-trips exactly, and loads into one process; a Llama pipeline whose
stages are FSDP-sharded over the data-parallel ranks saves with every rank and loads into
the plain pipeline and into one process.

Failure paths, their messages pinned: an FSDP model saved by data-parallel rank 0 with
the tp group (the TP/DDP contract) is refused before anything is written; a pipeline
checkpoint of other shapes (only stage 0 differs) is refused on every rank; ranks whose
optimizers differ refuse to save.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchloom as tl
from tests import tiny, tp_models
from tests.dist import spawn
from tests.tp_models import tp_gpt2
from torchloom.runtime import state as S
from torchloom.runtime.parallel import fully_shard_model

LAYOUTS = ("tp2", "ddp", "fsdp4", "tp2_fsdp2", "hsdp2x2")
TOL = dict(rtol=1e-5, atol=1e-6)


def _adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    batch = tp_models.batch()
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
    return loss.detach()


def _assert_equal(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected), what
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_equal(got[key], value, f"{what}: {key}")
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: {key}"
        else:
            assert got[key] == value, f"{what}: {key}"


def _full(model: nn.Module, opt: torch.optim.Optimizer, group) -> dict:
    return {"model": tl.full_state_dict(model, group),
            "optim": tl.full_optimizer_state_dict(model, opt, group),
            "lr": [g["lr"] for g in opt.param_groups]}


def _local(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's tensors (DTensors' local shards) and optimizer state, by name: equal
    local parts on every rank are equal full tensors, without a collective."""
    def local(t):
        return (t.to_local() if type(t).__name__ == "DTensor" else t).detach().clone()

    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: local(v) for k, v in model.state_dict(keep_vars=True).items()},
            "optim": {names[id(p)]: {k: local(v) for k, v in s.items()}
                      for p, s in opt.state.items()},
            "lr": [g["lr"] for g in opt.param_groups]}


def _scramble(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Other values everywhere, so that a load visibly writes every tensor."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.25)
    opt.state.clear()
    for g in opt.param_groups:
        g["lr"] = 0.5


# --------------------------------------------------------------------------- the ranks

_MESHES: dict[str, object] = {}


def _mesh(name: str):
    """The device meshes, made once per process (each makes process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if name not in _MESHES:
        if name == "tp_dp":  # tp-fastest: tp groups {0, 1}, {2, 3}; dp groups {0, 2}, {1, 3}
            _MESHES[name] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        elif name == "fsdp4":
            _MESHES[name] = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        elif name == "hsdp":
            _MESHES[name] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        elif name == "pp_dp":  # pp groups {0, 2}, {1, 3}; dp groups {0, 1}, {2, 3}
            _MESHES[name] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return _MESHES[name]


def _build(layout: str):
    """``(model, optimizer, tp group, save group, whether this rank saves)`` of a layout."""
    model = tp_models.gpt2()
    tp_group = None
    if layout in ("tp2", "tp2_fsdp2"):
        mesh = _mesh("tp_dp")
        tp_group = mesh["tp"].get_group()
        sch = tl.create_schedule(model, group=tp_group)
        tp_gpt2(sch, sp=False)
        model, _ = tl.build(sch)
        if layout == "tp2_fsdp2":
            fully_shard_model(model, mesh["dp"])
    elif layout == "fsdp4":
        fully_shard_model(model, _mesh("fsdp4"))
    elif layout == "hsdp2x2":
        fully_shard_model(model, _mesh("hsdp"))
    opt = _adamw(model, lr=0.5)
    if layout == "tp2":  # the TP / DDP contract: data-parallel rank 0's tp group saves
        return model, opt, tp_group, tp_group, dist.get_rank() < 2
    return model, opt, tp_group, None, True


def _save(model, opt, group, saves: bool, path: str, step: int) -> None:
    if saves:
        S.save(model, opt, path, step, group=group)
    dist.barrier()


def _layouts(rank: int, root: str) -> None:
    saved = torch.load(os.path.join(root, "reference.pt"), weights_only=True)
    reference = {k: saved[k] for k in ("model", "optim", "lr")}
    built = {layout: _build(layout) for layout in LAYOUTS}
    if rank == 0:  # really sharded: DTensors, over the meshes asked for
        weight = built["tp2_fsdp2"][0].transformer.h[0].attn.c_attn.weight
        assert type(weight).__name__ == "DTensor" and tl.shard_spec(weight).chunks == 3
        assert weight.to_local().shape == (16, 48)  # rows of dp rank 0, tp rank 0's q/k/v
        hsdp = built["hsdp2x2"][0].transformer.wte.weight
        assert [repr(p) for p in hsdp.placements] == ["Replicate()", "Shard(dim=0)"]
    # the single-process checkpoint into every layout, which then saves its own
    loaded = {}
    for layout, (model, opt, tp_group, group, saves) in built.items():
        assert S.load(model, opt, os.path.join(root, "single"), group=group) == 2, layout
        _assert_equal(_full(model, opt, tp_group), reference, f"single -> {layout}")
        loaded[layout] = _local(model, opt)
        _save(model, opt, group, saves, os.path.join(root, layout), 2)
    # every layout's checkpoint into every layout: the same local parts (the full state,
    # gathered above, is the reference's)
    for layout, (model, opt, _, group, _) in built.items():
        for source in LAYOUTS:
            _scramble(model, opt)
            assert S.load(model, opt, os.path.join(root, source), group=group) == 2
            _assert_equal(_local(model, opt), loaded[layout], f"{source} -> {layout}")
    # one more step on DTensors: AdamW's own DTensor state is saved, one process loads it
    model, opt, _, group, _ = built["fsdp4"]
    _train(model, opt, 1)
    _save(model, opt, group, True, os.path.join(root, "fsdp4"), 3)
    full = _full(model, opt, None)
    assert type(opt.state[model.lm_head.weight]["exp_avg"]).__name__ == "DTensor"
    if rank == 0:
        torch.save(full, os.path.join(root, "fsdp4-step3.pt"))
    # TP 2 x FSDP 2 trains on from the TP 2 checkpoint like the reference
    model, opt, tp_group, group, _ = built["tp2_fsdp2"]
    _scramble(model, opt)
    S.load(model, opt, os.path.join(root, "tp2"), group=group)
    # (the loss after a step: parameters whose gradient is 0 in exact arithmetic, the key
    # bias, take an AdamW step of rounding noise, which differs with the reduction order)
    torch.testing.assert_close(_train(model, opt, 2), saved["next_loss"], **TOL)


def _odd_sizes(rank: int, root: str) -> None:
    """Tensors of 3 and 5 rows on 4 FSDP ranks: uneven and empty shards."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 1))
    expected = copy.deepcopy(model.state_dict())
    fully_shard_model(model, _mesh("fsdp4"), units=["0"])
    path = os.path.join(root, "odd")
    S.save(model, None, path, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    S.load(model, None, path)
    _assert_equal(tl.full_state_dict(model), expected, "odd sizes")


def _fsdp_saved_with_the_tp_group_is_refused(rank: int, root: str) -> None:
    mesh = _mesh("tp_dp")
    model = tp_models.gpt2()
    sch = tl.create_schedule(model, group=mesh["tp"].get_group())
    tp_gpt2(sch, sp=False)
    model, _ = tl.build(sch)
    fully_shard_model(model, mesh["dp"])
    path = os.path.join(root, "refused")
    if rank < 2:  # data-parallel rank 0, as a TP / DDP run saves
        with pytest.raises(S.CheckpointMismatchError) as info:
            S.save(model, None, path, 1, group=mesh["tp"].get_group())
        assert str(info.value) == (
            f"save(...): 'transformer.wte.weight' is a DTensor sharded over ranks "
            f"[{rank}, {rank + 2}] (Shard(dim=0)); ranks [{rank + 2}] of them are not in "
            "the group of this save\n"
            f"    values: key='transformer.wte.weight', mesh_ranks=[{rank}, {rank + 2}], "
            f"group_ranks=[0, 1]\n"
            "    fix: with FSDP or HSDP, call it on every rank of the pipeline stage with "
            "the group of them all (data- x tensor-parallel ranks): save(model, optimizer, "
            "path, step, group=stage_group); else on the ranks of one tensor-parallel "
            "group with group=sch.group")
        assert not os.path.exists(path)
    dist.barrier()


# --------------------------------------------------------------------------- pipelines


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                           target[:, 1:].reshape(-1))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(4))


def _pipe(make, layers: str, lr: float = 1e-2):
    """Two stages (cut after layer 1) on the pipeline group of this data-parallel rank."""
    mesh = _mesh("pp_dp")
    ids = _ids()
    sch = tl.create_schedule(make())
    sch.trace_until(f"{layers}.*", example_inputs={"input_ids": ids[:2]})
    sch[f"{layers}.1"].cut_pipeline_stage()
    pipe, _ = tl.build(sch, target="pipeline", mesh=mesh, schedule="1F1B", n_microbatches=4,
                       loss_fn=_next_token_loss, example_inputs=(ids[:2],))
    return pipe, mesh


def _gpt2_positions(n: int) -> nn.Module:
    config = tiny.gpt2(n_layer=4).config
    config.n_positions = n
    return type(tiny.gpt2(n_layer=4))(config)


def _local_state(pipe: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's parameters and optimizer state by name, DTensors gathered."""
    def full(t):
        return t.full_tensor() if type(t).__name__ == "DTensor" else t.detach().clone()

    names = {id(p): n for n, p in pipe.named_parameters()}
    return {"model": {k: full(v) for k, v in pipe.state_dict().items()},
            "optim": {names[id(p)]: {k: full(v) if isinstance(v, torch.Tensor) else v
                                     for k, v in s.items()} for p, s in opt.state.items()}}


def _pipelines(rank: int, root: str) -> None:
    dp_rank = rank % 2  # rank = 2 * pp + dp
    pipe, mesh = _pipe(lambda: tiny.gpt2(n_layer=4), "transformer.h")
    pp_group = mesh["pp"].get_group()
    opt = _adamw(pipe)
    ids = _ids()
    pipe.step(ids, target=ids)
    opt.step()
    mine = _local_state(pipe, opt)
    path = os.path.join(root, "pipe")
    if dp_rank == 0:  # one replica's pipeline writes the whole model into one checkpoint
        S.save(pipe, opt, path, 1, group=pp_group)
    dist.barrier()
    full = tl.full_state_dict(pipe)
    if rank == 0:
        torch.save(full, os.path.join(root, "pipe-full.pt"))
    if dp_rank == 0:
        torch.save(mine["optim"], os.path.join(root, f"pipe-optim-{rank}.pt"))
    other, _ = _pipe(lambda: tiny.gpt2(seed=3, n_layer=4), "transformer.h")
    other_opt = _adamw(other, lr=0.5)
    assert S.load(other, other_opt, path, group=pp_group) == 1
    _assert_equal(_local_state(other, other_opt), mine, "pipeline round trip")
    assert other_opt.param_groups[0]["lr"] == 1e-2

    # a checkpoint of other shapes (only stage 0 holds the position embedding): every rank
    small, _ = _pipe(functools.partial(_gpt2_positions, 32), "transformer.h")
    with pytest.raises(S.CheckpointMismatchError) as info:
        S.load(small, _adamw(small), path, group=pp_group)
    assert str(info.value) == (
        "load(...): full shapes differ between the checkpoint and the model\n"
        f"    values: path={os.path.join(path, 'step-1')!r}, shapes (key, checkpoint, "
        "model)=[('transformer.wpe.weight', (64, 32), (32, 32))]\n"
        "    fix: load into a model with the saved configuration (check hidden sizes, vocab "
        "size, number of heads)")
    # ranks whose optimizers differ do not save
    odd = _adamw(pipe, lr=1e-2 if rank < 2 else 2e-2)
    with pytest.raises(S.CheckpointIOError) as info:
        S.save(pipe, odd, os.path.join(root, "pipe-odd"), 1)
    assert str(info.value) == (
        "save(...): the optimizers of the group's ranks differ: the hyperparameters of "
        "group 0\n"
        "    values: keys=['lr'], rank 0=['0.01'], rank 2=['0.02']\n"
        "    fix: make the optimizer alike on every rank (same class, same parameter groups "
        "and hyperparameters), e.g. AdamW(model.parameters(), lr=1e-3)")
    assert not os.path.exists(os.path.join(root, "pipe-odd"))

    # stages FSDP-sharded over the data-parallel ranks: every rank saves
    fsdp, _ = _pipe(tiny.llama, "model.layers")
    for module in fsdp.stage_modules:
        fully_shard_model(module, mesh["dp"], units=[])
    fsdp_opt = _adamw(fsdp)
    fsdp.step(ids, target=ids)
    fsdp_opt.step()
    assert all(type(p).__name__ == "DTensor" for p in fsdp.parameters())
    llama_path = os.path.join(root, "pipe-fsdp")
    S.save(fsdp, fsdp_opt, llama_path, 1)
    expected = _local_state(fsdp, fsdp_opt)
    if dp_rank == 0:
        torch.save(expected, os.path.join(root, f"pipe-fsdp-{rank}.pt"))
    plain, _ = _pipe(tiny.llama, "model.layers")
    plain_opt = _adamw(plain, lr=0.5)
    assert S.load(plain, plain_opt, llama_path, group=pp_group) == 1
    _assert_equal(_local_state(plain, plain_opt), expected, "fsdp pipeline -> pipeline")


# --------------------------------------------------------------------------- the test


def _one_process(root: str, name: str, expected: dict, step: int = 2) -> None:
    model = tp_models.gpt2()
    opt = _adamw(model, lr=0.5)
    _scramble(model, opt)
    assert S.load(model, opt, os.path.join(root, name), step=step) == step
    _assert_equal(_full(model, opt, None), expected, f"{name} -> one process")


def test_fsdp_hsdp_tp_and_pipeline_checkpoints_load_into_each_other(tmp_path):
    root = str(tmp_path)
    model = tp_models.gpt2()
    opt = _adamw(model)
    _train(model, opt, 2)
    S.save(model, opt, os.path.join(root, "single"), 2)
    reference = _full(model, opt, None)
    ahead, ahead_opt = copy.deepcopy((model, opt))
    torch.save({**reference, "next_loss": _train(ahead, ahead_opt, 2)},
               os.path.join(root, "reference.pt"))

    spawn(*(functools.partial(check, root=root) for check in (
        _layouts, _odd_sizes, _fsdp_saved_with_the_tp_group_is_refused, _pipelines)),
        world=4, timeout_s=120)

    for layout in LAYOUTS:
        _one_process(root, layout, reference)
    _one_process(root, "fsdp4", torch.load(os.path.join(root, "fsdp4-step3.pt"),
                                           weights_only=True), step=3)

    # the pipelines' checkpoints in one process: weights and optimizer state
    whole = tiny.gpt2(seed=5, n_layer=4)
    whole_opt = _adamw(whole, lr=0.5)
    assert S.load(whole, whole_opt, os.path.join(root, "pipe")) == 1
    _assert_equal(whole.state_dict(), torch.load(os.path.join(root, "pipe-full.pt"),
                                                 weights_only=True), "pipeline -> one process")
    saved = {}
    for rank in (0, 2):
        saved.update(torch.load(os.path.join(root, f"pipe-optim-{rank}.pt"), weights_only=True))
    state = tl.full_optimizer_state_dict(whole, whole_opt)
    assert set(state) <= set(saved)  # lm_head.weight: stage 1's name of the tied embedding
    _assert_equal(state, {name: saved[name] for name in state}, "pipeline optimizer")
    llama = tiny.llama()
    llama_opt = _adamw(llama, lr=0.5)
    assert S.load(llama, llama_opt, os.path.join(root, "pipe-fsdp")) == 1
    parts = [torch.load(os.path.join(root, f"pipe-fsdp-{r}.pt"), weights_only=True)
             for r in (0, 2)]
    weights = llama.state_dict()
    state = tl.full_optimizer_state_dict(llama, llama_opt)
    for part in parts:
        for key, value in part["model"].items():
            assert torch.equal(weights[key], value), key
        for name, values in part["optim"].items():
            _assert_equal(state[name], values, f"fsdp pipeline -> one process: {name}")
