"""The measured counterpart of :func:`torchloom.plan.predict`: a real training step of a
layout on gloo ranks, with the storage view of ``TrainEvaluator`` and every collective
counted.

:func:`measure_rank` is one rank of a run (``torchloom.runtime.launch.run_ranks`` or
``tests/dist.py``'s ``spawn`` starts the ranks): a zoo model built for the layout by
:func:`torchloom.parallelize` on :func:`torchloom.parallel.init_mesh`'s mesh, exactly as
``torchloom train`` builds it (:func:`build_layout`: the built-in schedule at the
layout's tensor parallelism, the stage cuts, the checkpointed layers, FSDP2 / HSDP / DDP
per stage), trained as ``torchloom train`` trains it (a pipeline's schedule step and its
replicas' gradient average; the micro-steps with the data-parallel reduction on the last
only), with AdamW for
``warmup`` steps, then one step measured with a :class:`~torchloom.plan.tracking.Tracker`
that was active since before ``build`` (so the runtime's own storages, DDP's buckets and
the pipeline's receive buffers, are seen), with FSDP2's storage resizes reported. Then
``timed`` steps are timed without tracking.

A step: ``zero_grad(set_to_none=True)``, the micro-batches (gradient accumulation; DDP
synchronises on the last), the optimizer step. The local batch is made once per rank.

Preconditions: a default process group of ``layout.world`` ranks (gloo). A pipeline
rank reads only its stages' weights (the others stay on ``meta``).

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

__all__ = ["build_layout", "check_prediction", "compare", "measure_many", "measure_rank",
           "mesh_labels"]


def _model(name: str, size: str, seq_len: int, seed: int) -> torch.nn.Module:
    from ..schedules import zoo

    overrides: dict[str, Any] = {}
    found = zoo.max_positions(name, size)
    if found is not None:
        overrides[found[0]] = max(found[1], seq_len)
    return zoo.make_model(name, size, seed=seed, **overrides)


def mesh_labels(layout: Layout, mesh: Any) -> dict[str, str]:
    """Process-group name -> the planner's label of its collectives: ``pp``, ``tp``,
    ``dp`` (FSDP2's shards, DDP's replicas, every data-parallel rank, and with context
    parallelism the data-parallel x context-parallel ranks a gradient is averaged or
    sharded over), ``dp_replicate`` (HSDP's replicas) and ``cp``."""
    if mesh is None:
        return {}
    hsdp = layout.dp_mode == "hsdp"
    out: dict[str, str] = {}
    for dim, label in (("pp", "pp"), ("dp", "dp"),
                       ("dp_replicate", "dp_replicate" if hsdp else "dp"),
                       ("dp_shard", "dp"), ("tp", "tp"), ("cp", "cp")):
        if mesh.size(dim) > 1:
            out[mesh.group(dim).group_name] = label
    if layout.cp > 1:
        out[mesh.group("dp_cp").group_name] = "dp"
        if layout.fsdp:
            out[mesh.shard_group().group_name] = "dp"
    return out


def _lora(config: dict[str, Any]) -> Any:
    from ..parallel.lora import parse_lora

    text = config.get("lora")
    return None if text is None else parse_lora(text, seed=config.get("seed", 0),
                                                base_dtype=config.get("lora_base_dtype", "fp32"))


def build_layout(model: torch.nn.Module, layout: Layout, mesh: Any, *, name: str,
                 example: torch.Tensor, weights: str | None = None,
                 knobs: dict[str, Any] | None = None, lora: Any = None) -> Any:
    """``torchloom.parallelize`` of zoo model ``name`` for ``layout``, as ``torchloom
    train`` calls it (the zoo's stacks of layers, the layout's loss on a pipeline's
    last stage): the plan's measurements build every layout through it."""
    from ..parallel.parallelize import create_schedule, parallelize
    from ..schedules import zoo

    sch = create_schedule(model, mesh)
    pipe = layout.pp > 1
    return parallelize(sch, layout, mesh=mesh, weights=weights,
                       example_inputs={"input_ids": example} if pipe else None,
                       knobs=knobs, lora=lora,
                       stacks=zoo.layer_paths(name))


def measure_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """Measure one rank (see the module docstring). ``config``: ``model``, ``size``,
    ``layout`` (a :meth:`Layout.to_dict`), ``warmup`` (default 2), ``timed`` (default 0),
    ``seed``, ``knobs`` (more knobs of the built-in schedule: kernels), ``lora`` (a
    ``--lora`` text: LoRA fine-tuning, :func:`~torchloom.parallel.lora.parse_lora`). Returns
    ``stage`` (the pipeline rank), ``peak``, ``collectives`` (bytes per ``"kind/group"``),
    ``counts``, ``step_s`` (the timed steps) and ``built`` (what
    :func:`torchloom.parallelize` did: ``checkpointed``, ``cut_after``, ``groups``,
    ``fsdp_units``)."""
    from ..parallel.mesh import init_mesh
    from ..runtime.materialise import init_empty_weights

    layout_dict = dict(config["layout"])
    if layout_dict.get("stage_cuts") is not None:
        layout_dict["stage_cuts"] = tuple(layout_dict["stage_cuts"])
    lay = Layout(**layout_dict)
    torch.manual_seed(config.get("seed", 0))
    mesh = init_mesh(lay, "cpu")
    groups = mesh_labels(lay, mesh)
    stage = mesh.local_rank("pp") if mesh is not None else 0
    dp_rank = mesh.local_rank("dp") if mesh is not None else 0
    model: Any = _model(config["model"], config.get("size", "tiny"), lay.seq_len,
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
    rows = lay.micro_steps * lay.micro_batch
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, lay.seq_len), generator=gen)
    extra = {"attention_mask": torch.ones_like(ids)} if "Bert" in type(model).__name__ else {}
    tracker = Tracker(groups, real=True)
    tracker.counting = False
    with fsdp_storage_resizes(tracker), tracker:
        done = build_layout(model, lay, mesh, name=config["model"],
                            example=ids[: lay.micro_batch], weights=weights,
                            knobs=config.get("knobs"), lora=_lora(config))
        built = done.model
        if lay.pp > 1:
            for _, group in done.module.ties:  # the pipeline (under a cp wrapper)
                groups[group.group_name] = "tie"
            tracker.groups = groups
        record = {"checkpointed": list(done.checkpointed), "cut_after": list(done.cut_after),
                  "groups": dict(done.groups), "fsdp_units": list(done.fsdp_units)}
        del model  # (a pipeline's other stages stay on meta in the schedule's model)
        params = list(built.parameters())
        opt = torch.optim.AdamW(done.parameters(), lr=1e-4)  # what trains (LoRA: adapters)
        for t in [*params, *built.buffers(), ids, *extra.values()]:
            tracker.track(t)
        parallel = _Steps(done)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            parallel.run(ids, extra)
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
            "counts": counts, "step_s": times, "built": record,
            "step_median_s": statistics.median(times) if times else None}


class _Steps:
    """One step's micro-batches as ``torchloom train`` runs them on a
    :class:`~torchloom.parallel.parallelize.Parallelized` model: a pipeline's schedule
    step (then the gradient average of its DDP replicas), or the micro-steps with the
    data-parallel reduction skipped on all but the last."""

    def __init__(self, done: Any) -> None:
        self.done = done

    def run(self, ids: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        done, lay = self.done, self.done.layout
        if lay.pp > 1:
            with done.autocast("cpu"):
                done.model.step(ids, target=ids)
            done.reduce_gradients()
            return
        chunks = ids.chunk(lay.micro_steps)
        masks = [m.chunk(lay.micro_steps) for m in extra.values()]
        for i, chunk in enumerate(chunks):
            kw = {k: m[i] for k, m in zip(extra, masks)}
            with done.no_sync(i < len(chunks) - 1), done.autocast("cpu"):
                loss = done.model(input_ids=chunk, labels=chunk, **kw).loss
                loss.backward()
            del loss


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


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Relative error of a predicted peak against a measured one."""
    error = (predicted["peak"] - measured["peak"]) / measured["peak"]
    return {"measured": measured["peak"], "predicted": predicted["peak"],
            "error": round(error, 4)}
