"""One layout, one path: ``torchloom train`` (``_Run.build``) and the planner's
measurement (:func:`torchloom.plan.validate.build_layout`) both build through
:func:`torchloom.parallelize`, and for the same layout they checkpoint the same modules,
cut after the same layers, shard the same FSDP2 units and use the same groups; the
planner's counts (checkpointed layers, stage cuts) are the ones parallelize applies.

One process for a one-rank layout; one launch of four gloo ranks for a pipeline of two
stages with FSDP2 over two shards (tests/dist.py's ``spawn``).
"""

from __future__ import annotations

import torch

from torchloom.apps.jobconfig import TrainConfig
from torchloom.core.rules import checkpointed_count, even_cuts
from torchloom.plan import Layout
from torchloom.plan.validate import build_layout
from torchloom.schedules import zoo

from .dist import spawn

SEQ = 32


def _record(done) -> dict:
    return {"checkpointed": list(done.checkpointed), "cut_after": list(done.cut_after),
            "groups": dict(done.groups), "fsdp_units": sorted(done.fsdp_units),
            "stacks": list(done.stacks)}


def _train_path(cfg: TrainConfig, rank: int, world: int) -> dict:
    from torchloom.apps import train

    run = train._Run(cfg, rank, world, None)
    run.build()
    assert run.built is not None
    return {**_record(run.built), "layout": run.layout}


def _plan_path(cfg: TrainConfig, layout: Layout) -> dict:
    from torchloom.parallel import init_mesh

    mesh = init_mesh(layout, "cpu")
    model = zoo.make_model(cfg.model, cfg.size, seed=cfg.seed)
    example = torch.zeros(layout.micro_batch, layout.seq_len, dtype=torch.long)
    return _record(build_layout(model, layout, mesh, name=cfg.model, example=example))


def _same(cfg: TrainConfig, rank: int, world: int) -> dict:
    train = _train_path(cfg, rank, world)
    layout = train.pop("layout")
    plan = _plan_path(cfg, layout)
    assert train == plan, (train, plan)
    return plan


def test_ckpt_ratio_counts_agree_between_planner_and_parallelize():
    # the drift: 29 layers wrapped, 28 counted; one rule now (core.rules)
    assert Layout(ckpt_ratio=0.29).checkpointed(100) == checkpointed_count(0.29, 100) == 29
    assert Layout(pp=2, n_microbatches=2).cuts(8) == even_cuts(8, 2) == [3]
    cfg = TrainConfig(model="llama", size="small", batch_size=2, seq_len=SEQ, steps=1,
                      ckpt_ratio=0.5, device="cpu", progress=False)
    got = _same(cfg, 0, 1)
    layers = len(zoo.make_model("llama", "small").get_submodule(got["stacks"][0]))
    assert len(got["checkpointed"]) == Layout(ckpt_ratio=0.5).checkpointed(layers) == 2
    assert got["checkpointed"] == [f"{got['stacks'][0]}.{i}" for i in range(2)]


_PIPE = {"model": "llama", "size": "small", "batch_size": 8, "seq_len": SEQ, "steps": 1,
         "pp": 2, "dp": 2, "dp_mode": "fsdp", "n_microbatches": 2, "ckpt_ratio": 0.5,
         "device": "cpu", "progress": False}


def _pipeline_fsdp(rank: int) -> None:
    cfg = TrainConfig(**_PIPE)
    got = _same(cfg, rank, 4)
    stack = got["stacks"][0]
    layout = cfg.layout()
    # the planner's stage cuts and checkpoint count are what parallelize applied
    assert got["cut_after"] == [f"{stack}.{c}" for c in layout.cuts(4)] == [f"{stack}.1"]
    assert len(got["checkpointed"]) == layout.checkpointed(4) == 2
    assert got["groups"] == {"pipeline": "pp", "fsdp": "dp_shard", "data": "dp"}
    assert got["fsdp_units"]  # this rank's stage's layers


def test_train_and_plan_paths_build_a_pipeline_with_fsdp_alike():
    spawn(_pipeline_fsdp, world=4, timeout_s=240)
