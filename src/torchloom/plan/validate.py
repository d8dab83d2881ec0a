"""The measured counterpart of :func:`torchloom.plan.predict`: a real training step of a
layout on gloo ranks, with the storage view of ``TrainEvaluator`` and every collective
counted.

:func:`measure_rank` is one rank of a run (``torchloom.runtime.launch.run_ranks`` or
``tests/dist.py``'s ``spawn`` starts the ranks): a zoo model, scheduled with its built-in
schedule over the mesh's tensor-parallel group, built for the layout (DDP, FSDP2, or a
pipeline of even stages run with the layout's schedule, its data-parallel replicas
all-reducing their gradients as ``torchloom train`` does), trained with AdamW for
``warmup`` steps, then one step measured with a :class:`~torchloom.plan.tracking.Tracker`
that was active since before ``build`` (so the runtime's own storages, DDP's buckets and
the pipeline's receive buffers, are seen), with FSDP2's storage resizes reported. Then
``timed`` steps are timed without tracking.

A step: ``zero_grad(set_to_none=True)``, the micro-batches (gradient accumulation; DDP
synchronises on the last), the optimizer step. The local batch is made once per rank.

Preconditions: a default process group of ``layout.world`` ranks (gloo); the rank's
references to the whole model are dropped after ``build`` (a pipeline rank keeps only its
stages).

>>> compare({"peak": 100}, {"peak": 110})["error"]   # (predicted - measured) / measured
0.1
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from .layout import Layout
from .tracking import Tracker, fsdp_storage_resizes
from .units import next_token_loss

__all__ = ["measure_rank", "measure_many", "compare", "check_prediction"]


def _model(name: str, size: str, seq_len: int, seed: int) -> torch.nn.Module:
    from ..schedules import zoo

    overrides: dict[str, Any] = {}
    found = zoo.max_positions(name, size)
    if found is not None:
        overrides[found[0]] = max(found[1], seq_len)
    return zoo.make_model(name, size, seed=seed, **overrides)


def measure_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """Measure one rank (see the module docstring). ``config``: ``model``, ``size``,
    ``layout`` (a :meth:`Layout.to_dict`), ``warmup`` (default 2), ``timed`` (default 0),
    ``seed``, ``knobs`` (more knobs of the built-in schedule: kernels). Returns
    ``stage``, ``peak``, ``collectives`` (bytes per ``"kind/group"``),
    ``counts`` and ``step_s`` (the timed steps)."""
    from .. import schedules
    from ..core.schedule import create_schedule
    from ..runtime.build import build
    from ..runtime.materialise import init_empty_weights
    from ..runtime.parallel import init_mesh

    layout_dict = dict(config["layout"])
    if layout_dict.get("stage_cuts") is not None:
        layout_dict["stage_cuts"] = tuple(layout_dict["stage_cuts"])
    lay = Layout(**layout_dict)
    torch.manual_seed(config.get("seed", 0))
    mesh = init_mesh(dp=lay.dp, tp=lay.tp, pp=lay.pp)
    groups = {mesh[d].get_group().group_name: d for d in ("pp", "dp", "tp")}
    stage = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    model = _model(config["model"], config.get("size", "tiny"), lay.seq_len,
                   config.get("seed", 0))
    if lay.param_dtype != "fp32":
        model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[lay.param_dtype])
    weights = None
    if lay.pp > 1:
        # the at-scale route: the model on meta, each rank reading only its stages'
        # weights (building a real model instead keeps every stage's weights alive on
        # every rank in this version: a module reference outlives the split)
        box = [tempfile.mkdtemp(prefix="torchloom-plan-") if dist.get_rank() == 0 else None]
        if dist.get_rank() == 0:
            model.save_pretrained(box[0])  # transformers writes on the main rank only
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
        weights = box[0]
        config_obj = model.config
        with init_empty_weights():
            model = type(model)(config_obj)
        model.train()
    sch = create_schedule(model, group=mesh["tp"].get_group() if lay.tp > 1 else None)
    # a pipeline checkpoints after the cuts: trace_until cannot reach checkpointed
    # layers (they are leaves), so `torchloom train --pp 2 --ckpt-ratio 0.5` fails today
    knobs: dict[str, Any] = {"ckpt_ratio": lay.ckpt_ratio} if lay.pp == 1 else {}
    if lay.tp > 1:
        knobs["tp"] = True
    if lay.sp:
        knobs["sequence_parallel"] = True
    knobs.update(config.get("knobs") or {})  # kernel knobs (compile, attention, ...)
    schedules.apply_schedule(sch, **knobs)
    rows = lay.n_microbatches * lay.micro_batch
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, lay.seq_len), generator=gen)
    extra = {"attention_mask": torch.ones_like(ids)} if "Bert" in type(model).__name__ else {}
    tracker = Tracker(groups, real=True)
    tracker.counting = False
    with fsdp_storage_resizes(tracker), tracker:
        if lay.pp > 1:
            from ..schedules import zoo

            layers = zoo.layer_paths(config["model"])[0]
            count = len(sch[layers].child)
            micro = ids[: lay.micro_batch]
            sch.trace_until(f"{layers}.*", example_inputs={"input_ids": micro})
            for cut in lay.cuts(count):
                sch[f"{layers}.{cut}"].cut_pipeline_stage()
            if lay.ckpt_ratio:
                sch[layers].checkpoint(ratio=lay.ckpt_ratio)
            built, _ = build(sch, target="pipeline", mesh=mesh, schedule=lay.pipeline_schedule,
                             n_microbatches=lay.n_microbatches, loss_fn=next_token_loss,
                             example_inputs=(micro,), weights=weights)
            for _, group in built.ties:
                groups[group.group_name] = "tie"
            tracker.groups = groups
        else:
            target = None if lay.dp == 1 else lay.dp_mode
            built, _ = build(sch, target=target, mesh=mesh if target else None)
        del model, sch
        params = list(built.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4)
        for t in [*params, *built.buffers(), ids, *extra.values()]:
            tracker.track(t)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            if lay.pp > 1:
                built.step(ids, target=ids)
                if lay.dp > 1:
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            else:
                chunks = ids.chunk(lay.n_microbatches)
                masks = [m.chunk(lay.n_microbatches) for m in extra.values()]
                for i, chunk in enumerate(chunks):
                    kw = {k: m[i] for k, m in zip(extra, masks)}
                    sync = i == len(chunks) - 1 or lay.dp == 1 or lay.dp_mode != "ddp"
                    ctx = built.no_sync() if not sync else _null()
                    with ctx:
                        loss = built(input_ids=chunk, labels=chunk, **kw).loss
                        loss.backward()
                    del loss
            opt.step()

        for _ in range(config.get("warmup", 2)):
            step()
        gc.collect()  # garbage in reference cycles (the pipeline runtime makes some)
        tracker.reset()
        tracker.counting = True
        step()
        tracker.counting = False
        peak = tracker.peak
    if weights is not None:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(weights, ignore_errors=True)
    collectives: dict[str, int] = {}
    counts: dict[str, int] = {}
    for c in tracker.collectives:
        name = f"{c.kind}/{c.group}"
        collectives[name] = collectives.get(name, 0) + c.bytes
        counts[name] = counts.get(name, 0) + 1
    times = []
    for _ in range(config.get("timed", 0)):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return {"rank": rank, "stage": stage, "peak": peak, "collectives": collectives,
            "counts": counts, "step_s": times,
            "step_median_s": statistics.median(times) if times else None}


def measure_many(rank: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`measure_rank` of each config in turn (one launch for many layouts); without
    a process group (``run_ranks`` with one rank runs in this process) a gloo group of one
    rank is made for the run."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        out = []
        for config in configs:
            out.append(measure_rank(rank, config))
            dist.barrier()
        return out
    finally:
        if own:
            dist.destroy_process_group()


def check_prediction(measured: dict[str, Any], prediction: Any,
                     tolerance: float = 0.10) -> dict[str, Any]:
    """Compare one rank's measurement with the prediction of its stage: the relative
    error of the peak, whether it is within ``tolerance``, and the collective bytes per
    ``kind/group`` of both (equal when ``collectives_equal``)."""
    role = prediction.roles[measured["stage"]]
    predicted = {f"{k}/{g}": b for (k, g), b in role.collective_bytes().items()}
    error = (role.memory.peak - measured["peak"]) / measured["peak"]
    return {"stage": measured["stage"], "measured": measured["peak"],
            "predicted": role.memory.peak, "error": error,
            "within": abs(error) <= tolerance, "collectives_measured": measured["collectives"],
            "collectives_predicted": predicted,
            "collectives_equal": predicted == measured["collectives"]}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Relative error of a predicted peak against a measured one."""
    error = (predicted["peak"] - measured["peak"]) / measured["peak"]
    return {"measured": measured["peak"], "predicted": predicted["peak"],
            "error": round(error, 4)}
