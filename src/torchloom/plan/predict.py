"""Per-rank memory, FLOPs, collectives and step time of a layout, composed from measured
pieces.

:func:`predict` measures the pieces of a step once (:mod:`torchloom.plan.units`: the
embedding part, a checkpointed and a plain layer, the head, each forward and backward, on
fake tensors as rank 0 of a fake process group of the layout's tensor-parallel and FSDP
degrees) and composes, for one representative rank of every distinct role (each
pipeline rank, with the one or several stages it holds; the tensor- and data-parallel
ranks of a pipeline rank are alike).

What the composition models beyond the measured pieces:

* **pipelines** of every schedule (:mod:`torchloom.plan.pipeline`: the order of each
  rank's forwards and backwards, with virtual stages for the interleaved and zero-bubble
  schedules, the V placement of ZBVZeroBubble, and the bubble);
* **FSDP2 under a pipeline** (each stage's parameters, gradients and optimizer state
  sharded over ``dp_shard``): as ``torch.distributed.pipelining`` runs it, step by step
  (:mod:`torchloom.plan.fsdp_pipeline`): a forward on sharded layers gathers and frees
  each, a backward gathers them and keeps them, the next forward frees them again; the
  gradients accumulate unsharded (in the reduction dtype) from the first backward to the
  step's end, when each is reduce-scattered once; each stage's root is gathered once;
* **HSDP** (``dp_replicate`` x ``dp_shard``): measured as FSDP2 over the 2-D mesh, the
  gradient all-reduce across the replicas (``dp_replicate``) included;
* **activation checkpointing**: the first ``ckpt_ratio`` of the layers (the rule
  :func:`~torchloom.core.rules.checkpointed_count`, as the ``checkpoint`` primitive
  wraps them), every layer under ``ac="full"``; ``ac="op"`` (op-level selective,
  torchtitan's policy: ``checkpoint(policy="op")``) is measured, its checkpointed layers
  run under that policy;
* **context parallelism** (``cp``; in a pipeline, each stage's ranks): measured with the ``context_parallel``
  primitive on rank 0 of a fake ``cp`` group (its ``S / cp`` tokens, the K / V
  all-gathers and their reduce-scatters, the saved gathered K / V, the loss all-reduce);
  the causal share of the chunks' attention is :func:`causal_share`; the ``cp``
  collectives are timed in line (not overlapped: the attention waits for its keys);
  gradients average over
  ``dp x cp`` (DDP), FSDP2 shards over ``dp_shard x cp``;
* **expert parallelism** (``ep``, folded into the data-parallel ranks, a pipeline
  stage's and each context-parallel position's too): measured with the ``expert_parallel`` primitive on rank 0 of a fake ``ep``
  group, dispatching under
  :func:`~torchloom.runtime.expert_routing_model.modeled_routing` (``imbalance``: the
  busiest rank's share of the routed tokens over the average; the measured rank is that
  one, so its expert FLOPs, kept activations and received rows grow with it). The rank
  holds ``E / ep`` experts (FSDP2 leaves them whole); the all-to-alls (the counts, the
  rows there and back, and back again in backward) are timed in line like tensor
  parallelism, at what the rank sends (``(ep - 1) / ep`` of it leaves the rank); the
  experts' gradients are all-reduced over the ``dp / ep`` ranks that hold the same
  experts (DDP), or FSDP2 shards the experts over those ranks (measured);
* **gradient accumulation**: ``grad_accum x n_microbatches`` micro-batches per step
  (:attr:`~torchloom.parallel.layout.Layout.micro_steps`), run by the pipeline in one
  schedule step as :func:`torchloom.parallelize` builds it.

What each of memory, FLOPs, collectives and time is made of, and why a 70 B model costs
what its first four layers cost to measure: docs/design/plan_predict.md.

>>> from torchloom.plan import Layout
>>> p = predict("llama", Layout(micro_batch=2, seq_len=32), "h100-80gb")
>>> role = p.roles[0]
>>> role.memory.parameters == role.memory.gradients > 0, role.memory.optimizer > 0
(True, True)
>>> role.memory.peak > role.memory.parameters + role.memory.optimizer
True
>>> p.step_time > 0 and p.fits
True
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..core.errors import PlanError
from ..parallel.lora import LoraSpec
from .crossing import Crossing, crossing
from .fsdp_cost import (
    fsdp_times,
    prefetch_bytes,
    stage_param_bytes,
    stage_roots,
    unsharded_ratio,
)
from .fsdp_pipeline import StageState, Walk, balance, stage_comm
from .fsdp_pipeline import backward as fsdp_backward
from .fsdp_pipeline import forward as fsdp_forward
from .fsdp_pipeline import reduce as fsdp_reduce
from .layout import OPTIMIZERS, Layout, check_model
from .notes import layout_notes
from .pieces import (
    ASYNC_TP_HIDDEN,
    Kernels,
    causal_share,
)
from .pieces import Layers as _Layers
from .pieces import Piece as _Piece
from .pieces import piece as _piece
from .pieces import stage_backward as _stage_backward
from .pieces import stage_forward as _stage_forward
from .pieces import stage_pieces as _stage_pieces
from .pipeline import bubble_share, order
from .profiles import Profile, get_profile
from .results import CollectiveTotal, Memory, Prediction, RolePrediction, Time
from .spec import ModelSpec, model_spec
from .units import (
    ScheduleFn,
    UnitKey,
    Units,
    extrapolate,
    measure_units,
)

__all__ = ["Memory", "Time", "CollectiveTotal", "RolePrediction", "Prediction", "predict",
           "units_for", "clear_cache", "HEADROOM"]

HEADROOM = 0.10
"""The share of the usable memory a layout should leave free at its peak (allocator
fragmentation, NCCL's buffers and workspaces the planner does not see):
``torchloom plan`` warns below it and by default ranks only layouts that leave it."""

STEP_BYTES = 4  # AdamW / Adam keep a float32 "step" per parameter tensor
OPTIMIZER_TRAFFIC = 16  # bytes moved per parameter byte by an AdamW step (read + write)
OPTIMIZER_OPS = 12
"""Operators a single-tensor Adam/AdamW step dispatches per parameter tensor."""

_UNITS: dict[tuple[Any, ...], Units] = {}
_CROSSINGS: dict[tuple[Any, ...], Crossing] = {}


def clear_cache() -> None:
    """Forget every measurement (they are kept per model, key and schedule)."""
    _UNITS.clear()
    _CROSSINGS.clear()


def _spec_key(spec: ModelSpec, schedule: ScheduleFn | None) -> tuple[Any, ...]:
    config = json.dumps(spec.config.to_dict(), sort_keys=True, default=str)
    return (spec.model_class.__name__, config, spec.layers, id(schedule) if schedule else None)


def units_for(spec: ModelSpec, key: UnitKey, schedule: ScheduleFn | None = None) -> Units:
    """The measurement of ``key`` (made once, then cached): micro-batches of one and two
    sequences are measured, other sizes extrapolated from them
    (:func:`~torchloom.plan.units.extrapolate`)."""
    k = (*_spec_key(spec, schedule), key)
    if k not in _UNITS:
        made = None
        if key.micro_batch > 2:
            one = units_for(spec, dataclasses.replace(key, micro_batch=1), schedule)
            two = units_for(spec, dataclasses.replace(key, micro_batch=2), schedule)
            made = extrapolate(one, two, key.micro_batch)
        _UNITS[k] = made if made is not None else measure_units(spec, key, schedule)
    return _UNITS[k]


def _crossing_for(spec: ModelSpec, key: UnitKey, schedule: ScheduleFn | None) -> Crossing:
    # with context parallelism the stages exchange this rank's seq_len / cp positions
    seq = key.seq_len // key.cp
    k = (*_spec_key(spec, schedule), key.tp, key.sp, key.micro_batch, seq, key.param_dtype,
         key.mixed_precision, key.sharded, key.cp > 1)
    if k not in _CROSSINGS:
        # (without context parallelism: FSDP2's shards are then dp_shard x cp ranks)
        shards = key.fsdp * key.cp if key.sharded else key.fsdp
        _CROSSINGS[k] = crossing(spec, dataclasses.replace(key, seq_len=seq, cp=1, fsdp=shards,
                                                           shard_cp=False), schedule,
                                 positions=key.cp > 1)
    return _CROSSINGS[k]


# --------------------------------------------------------------------------- walk


def _ring(kind: str, size: int, nbytes: int, link: float) -> float:
    if size <= 1 or link == float("inf"):
        return 0.0
    if kind == "all_reduce":
        return 2 * (size - 1) / size * nbytes / link
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (size - 1) / size * nbytes / link
    return nbytes / link


def check_imbalance(imbalance: float) -> None:
    """Refuse a routing imbalance that is not a finite number of 1 or more."""
    if not (math.isfinite(imbalance) and imbalance >= 1.0):
        raise PlanError("the routing imbalance is the busiest expert-parallel rank's load "
                        "over the average: a finite number of 1 or more",
                        primitive="plan", values={"imbalance": imbalance},
                        fix="imbalance=1.0 (balanced routing), or e.g. 1.25")


def predict(model: Any, layout: Layout, profile: str | Profile = "h100-80gb", *,
            schedule: ScheduleFn | None = None, size: str = "tiny",
            imbalance: float = 1.0, lora: LoraSpec | None = None) -> Prediction:
    """Predict every role of ``layout`` for ``model`` on ``profile`` (see the module
    docstring). ``model``: a zoo name (with ``size``), a config path, a model class
    (``model_spec``), or a :class:`~torchloom.plan.spec.ModelSpec`. ``schedule``:
    ``fn(sch, knobs)`` applied instead of the built-in schedule (``knobs``: ``tp``,
    ``sequence_parallel``, ``ckpt_ratio``); it must give the layers the same layout at
    every depth. ``imbalance``: under expert parallelism, the busiest rank's share of the
    routed tokens over the average (1.0: balanced routing). ``lora``: LoRA fine-tuning
    (:class:`~torchloom.parallel.lora.LoraSpec`, as ``torchloom.parallelize(lora=)``
    builds it): the adapters measured in the layers, the optimizer state and the
    gradients of the adapters only, no weight-gradient products for the frozen base.

    Raises:
        PlanError: a layout the model cannot take (a
            :class:`~torchloom.core.errors.LayoutError` for the stage split), a dtype the
            profile lacks, a model the planner does not support.
    """
    check_imbalance(imbalance)
    spec = model_spec(model, size=size, seq_len=layout.seq_len)
    prof = get_profile(profile)
    check_model(layout, spec)
    prof.peak_flops(layout.compute_dtype)  # refuse a dtype the device cannot compute in
    mixed = layout.mixed_precision if layout.mixed_precision != layout.param_dtype else None
    key = UnitKey(layout.tp, layout.sp, layout.micro_batch, layout.seq_len,
                  layout.param_dtype, mixed, layout.dp_shard,
                  "model" if layout.pp == 1 else "next_token",
                  layout.dp_replicate if layout.fsdp else 1,
                  layout.reduce_dtype if layout.fsdp else None,
                  "op" if layout.ac == "op" else None, layout.loss, layout.cp, layout.ep,
                  float(imbalance) if layout.ep > 1 else 1.0, lora,
                  layout.fsdp and layout.dp_shard == 1)
    units = units_for(spec, key, schedule)
    cross = _crossing_for(spec, key, schedule) if layout.pp > 1 else None
    return compose(spec, layout, prof, units, cross)


@dataclass
class _Role:
    """What composing one pipeline rank gives, before the step time is known."""

    stage: int
    layers: int
    memory: Memory
    flops: int
    model_flops: int
    totals: tuple[CollectiveTotal, ...]
    compute: float
    per_microbatch: float  # compute + exposed tensor-parallel and pipeline communication
    exposed: float         # communication on the critical path (incl. data parallel)
    after: float           # exposed data-parallel communication + optimizer
    optimizer: float


def _collectives(comm: Counter, layout: Layout, profile: Profile
                 ) -> tuple[tuple[CollectiveTotal, ...], float, float, float, float]:
    """Totals per (kind, group) and seconds: tensor-parallel, pipeline, data-parallel,
    context-parallel (the ``cp`` ranks ``tp`` apart: one node when ``tp x cp`` fits).
    Mesh strides: ``tp`` innermost, then ``cp``, ``dp_shard`` (``dp``), ``dp_replicate``,
    ``pp``; the ``ep`` ranks are consecutive data-parallel ranks (``tp x cp`` apart), the
    ``ep_replicas`` every ``ep``-th (their all-to-alls are returned with the context-parallel time: both
    wait in line)."""
    cp = layout.cp
    stride = {"tp": 1, "cp": layout.tp, "dp": layout.tp * cp,
              "dp_replicate": layout.tp * layout.dp_shard * cp, "pp": layout.tp * layout.dp * cp,
              "ep": layout.tp * cp, "ep_replicas": layout.tp * layout.ep * cp}
    if layout.dp_shard == 1 or cp > 1:
        # DDP's replicas (dp x cp) or FSDP2's dp_shard x cp: next to the tp ranks
        stride["dp"] = layout.tp
    merged: dict[tuple[str, str], list[float]] = {}
    times = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0}
    for (kind, group, gsize, nbytes), count in sorted(comm.items()):
        if group == "tie":  # the first and the last stage, (pp - 1) * tp * dp ranks apart
            link = profile.link(2, layout.tp * layout.dp * max(1, layout.pp - 1))
        else:
            link = profile.link(gsize, stride.get(group, 1))
        secs = count * (_ring(kind, gsize, nbytes, link * profile.link_efficiency)
                        + profile.collective_latency)
        times[{"ep": "cp"}.get(group, group) if group in ("tp", "pp", "cp", "ep")
              else "dp"] += secs
        slot = merged.setdefault((kind, group), [0, 0, 0.0])
        slot[0] += count
        slot[1] += count * nbytes
        slot[2] += secs
    totals = tuple(CollectiveTotal(kind, group, int(c), int(b), t)
                   for (kind, group), (c, b, t) in sorted(merged.items()))
    return totals, times["tp"], times["pp"], times["dp"], times["cp"]


def compose(spec: ModelSpec, layout: Layout, profile: Profile, units: Units,
            cross: Crossing | None) -> Prediction:
    """Compose a prediction from a measurement (see :func:`predict`)."""
    L = spec.num_layers
    layers = _Layers(units, profile, L, layout.checkpointed(L),
                     Kernels(layout.compile, layout.float8, causal_share(layout.cp)))
    seg = units.segments
    e_f = _piece(seg["E.f"], profile)
    e_b = _piece(seg["E.b"], profile, units.grads["E"], units.largest["E"])
    h_f = _piece(seg["H.f"], profile)
    h_b = _piece(seg["H.b"], profile, units.grads["H"] - units.shared, units.largest["H"])
    roots = (0, 0)  # FSDP2 under a pipeline: the bytes each end stage's root gathers
    if layout.pp > 1 and units.key.sharded:
        e_f, e_b, h_f, h_b, *gathered = stage_roots(units, e_f, e_b, h_f, h_b)
        roots = (gathered[0], gathered[1])
    bounds = [-1, *layout.cuts(L), L - 1]
    spans = [range(bounds[k] + 1, bounds[k + 1] + 1) for k in range(layout.stages)]
    owner = layout.stage_ranks()
    roles = [_compose_rank(r, [k for k in range(layout.stages) if owner[k] == r], spans,
                           spec, layout, profile, units, cross, layers,
                           (e_f, e_b, h_f, h_b), roots)
             for r in range(layout.pp)]
    n, pp = layout.micro_steps, layout.pp
    slowest = max(r.per_microbatch for r in roles)
    fill = (pp - 1) * slowest * bubble_share(layout.pipeline_schedule, layout.per_rank)
    pipe = n * slowest + fill
    step = pipe + max(r.after for r in roles)
    ranks = layout.tp * layout.dp * layout.cp
    out = []
    for r in roles:
        bubble = max(0.0, pipe - n * r.per_microbatch)
        out.append(RolePrediction(r.stage, ranks, r.layers, r.memory, r.flops,
                                  r.totals, Time(r.compute, r.exposed, bubble, r.optimizer,
                                                 step), r.memory.reserved <= profile.budget,
                                  r.model_flops))
    total_flops = sum(r.flops for r in out) * ranks
    model_flops = sum(r.model_flops for r in out) * ranks
    return Prediction(spec.name, layout, profile, tuple(out), step, total_flops,
                      layout_notes(layout, units), model_flops)


def _trained(units: Units, layers: int, last: bool, params: int, tensors: int,
             largest: int) -> tuple[int, int, int]:
    """The bytes, tensors and largest tensor the optimizer updates on a rank holding
    ``layers`` layers (and the head part if ``last``): every parameter, or with LoRA the
    adapters only (measured per layer and outside the layers)."""
    lora = units.extra.get("trainable")
    if lora is None:
        return params, tensors, largest
    out = layers * lora["L"][0] + (lora["rest"][0] if last else 0)
    count = layers * lora["L"][1] + (lora["rest"][1] if last else 0)
    return out, count, max(lora["L"][2], lora["rest"][2] if last else 0)


def _compose_rank(rank: int, stages: list[int], spans: list[range], spec: ModelSpec,
                  layout: Layout, profile: Profile, units: Units, cross: Crossing | None,
                  layers: _Layers, ends: tuple[_Piece, _Piece, _Piece, _Piece],
                  roots: tuple[int, int] = (0, 0)) -> _Role:
    e_f, e_b, h_f, h_b = ends
    root, head_root = roots  # the embedding's and the head's gathered FSDP2 roots
    pp, n = layout.pp, layout.micro_steps
    count = layout.stages
    first, last = 0 in stages, count - 1 in stages
    fsdp = units.key.sharded
    ddp = layout.dp * layout.cp > 1 and not fsdp  # DDP averages over dp x cp
    mine = [j for k in stages for j in spans[k]]
    # ---- what the rank holds
    params = len(mine) * units.params["L2"]
    grads = len(mine) * units.grads["L2"]
    tensors = len(mine) * units.param_tensors["L2"]
    largest = units.largest["L2"] if mine else 0
    if first:
        params += units.params["E"]
        grads += units.grads["E"]
        tensors += units.param_tensors["E"]
        largest = max(largest, units.largest["E"])
    if last:
        shared = units.shared if first else 0  # a tied weight is held once per rank
        params += units.params["H"] - shared
        grads += units.grads["H"] - shared
        tensors += units.param_tensors["H"] - (1 if shared else 0)
        largest = max(largest, units.largest["H"])
    states = OPTIMIZERS[layout.optimizer]
    trained, trained_tensors, trained_largest = _trained(units, len(mine), last, params,
                                                         tensors, largest)
    optimizer = states * trained + (STEP_BYTES * trained_tensors if states else 0)
    model_buffers = units.buffers["E"] + len(mine) * units.buffers["L"]
    ids_bytes = n * layout.micro_batch * layout.seq_len * 8
    if spec.kind == "masked" and pp == 1:
        ids_bytes *= 2  # the attention mask
    experts = len(mine) * units.extra.get("expert_params", 0)  # whole, E / ep of them
    runtime = grads - experts if ddp and pp == 1 else 0  # DDP's gradient buckets
    sizes: dict[int, tuple[int, int, int, int]] = {}  # stage -> in, float in, out, float out
    for k in stages:
        c_in = f_in = c_out = f_out = 0
        if cross is not None:
            if k > 0:
                c_in, f_in = cross.forward_bytes(k - 1), cross.backward_bytes(k - 1)
                runtime += n * c_in  # receive buffers, one per micro-batch
            if k < count - 1:
                c_out, f_out = cross.forward_bytes(k), cross.backward_bytes(k)
                runtime += n * f_out  # gradient receive buffers, one per micro-batch
        sizes[k] = (c_in, f_in, c_out, f_out)
    outputs = n * units.leftover if cross is not None and last else 0
    # ---- the walk: the last stage's outputs of the previous step are dropped first
    base = params + optimizer + model_buffers + runtime + ids_bytes
    walk = Walk(base + outputs)
    walk.add(-outputs)
    pieces = {k: _stage_pieces(spans[k], k == 0, k == count - 1, layers, ends, head_root)
              for k in stages}
    # FSDP2 under a pipeline: each stage's gathers, kept parameters and unsharded
    # gradients as the schedule runs it (torchloom.plan.fsdp_pipeline); with gradient
    # accumulation and no pipeline, the gradients stay unsharded (no_sync)
    fsdp_pp = fsdp and pp > 1
    state = {k: StageState() for k in stages}
    layer_f = {k: [layers.fwd[j] for j in spans[k]] for k in stages}
    steps = {k: _stage_backward(spans[k], k == 0, k == count - 1, layers, ends)
             for k in stages}
    expert_grads = units.extra.get("expert_params", 0)
    fwd_steps = {k: [_stage_forward(spans[k], k == 0, k == count - 1, layers, ends, roots,
                                    later) for later in (False, True)] for k in stages}
    release = {k: balance(fwd_steps[k][1], steps[k], k == 0, k == count - 1,
                          units.leftover if k == count - 1 else 0)
               if fsdp_pp else 0 for k in stages}
    widen = unsharded_ratio(layout, units) if fsdp and n > 1 and pp == 1 else 0.0
    # a stage's FSDP2 root (the first's: the embedding; the last's: the head) is gathered
    # by its first forward and not freed before a backward: its later forwards do not
    # gather it again (``roots``)
    acts = order(layout.pipeline_schedule, rank, pp, stages[0], layout.per_rank, n)
    gpipe = layout.pipeline_schedule == "GPipe"
    single = layout.per_rank == 1
    warmup = next((i for i, (a, _, _) in enumerate(acts) if a == "B"), len(acts))
    last_f = max(i for i, (a, _, _) in enumerate(acts) if a == "F")
    held_sends = held_grads = 0
    done: set[int] = set()
    forwarded: set[int] = set()
    unsharded = 0
    for i, (action, m, local) in enumerate(acts):
        k = stages[local]
        f_all, b_first, b_next = pieces[k]
        c_in, f_in, c_out, f_out = sizes[k]
        if action == "F":
            if fsdp_pp:  # the root's parameters stay gathered after the first forward
                fsdp_forward(walk, state[k], fwd_steps[k][k in forwarded], k == 0,
                             k == count - 1)
            else:
                walk.run(f_all)
            forwarded.add(k)
            continue
        if single and held_sends and not gpipe and i - 1 > last_f:
            walk.add(-held_sends * c_out)  # 1F1B's cool-down releases the send
            held_sends = 0
        if widen and k not in done:
            extra = round(widen * stage_param_bytes(k, spans, count, units))
            walk.add(extra)
            unsharded += extra
        if fsdp_pp:
            fsdp_backward(walk, state[k], steps[k], expert_grads, k == 0, k == count - 1,
                          release[k])
        else:
            walk.run(b_next if k in done else b_first)
        done.add(k)
        if pp == 1:
            walk.add(-units.leftover)  # the training loop drops the outputs
            continue
        if not single:
            continue  # several stages per rank: sends and held gradients not walked
        if k > 0:
            # the input gradient, held for its send: torch.distributed.pipelining drops it
            # after the next backward (GPipe: at the end of the step)
            if held_grads and not gpipe:
                walk.add(-held_grads * f_in)
                held_grads = 0
            walk.add(f_in)
            held_grads += 1
        if k < count - 1 and (gpipe or (warmup >= 2 and m == warmup - 2)):
            # a sent forward output stays alive after its backward: GPipe waits for
            # every send at the end of the step; 1F1B holds one warm-up send
            walk.add(c_out)
            held_sends += 1
    single_sizes = sizes[stages[0]]
    walk.add(-held_grads * single_sizes[1] - held_sends * single_sizes[2])
    walk.add(-unsharded)
    for k in stages if fsdp_pp else []:  # the gradients reduce-scattered at the end
        fsdp_reduce(walk, state[k], steps[k], expert_grads)
    if fsdp_pp:  # the stages' roots, resharded by their last backward
        walk.add(-(root if first else 0) - (head_root if last else 0))
    if outputs:
        # the last stage's outputs (in the walk since their forwards, kept until the next
        # step starts) are concatenated at the end of the step: one more copy, briefly
        walk.add(outputs)
        walk.add(-outputs)
    impl = profile.optimizer_impl if not fsdp else "single"
    transient = (trained if impl == "foreach" else 2 * trained_largest) if states else 0
    walk.add(transient)
    walk.add(-transient)
    prefetch = prefetch_bytes(layout, profile, units) if mine else 0
    peak = walk.peak + prefetch
    buffers = model_buffers + runtime + outputs + prefetch
    activations = max(0, peak - params - grads - optimizer - buffers - ids_bytes)
    memory = Memory(params, grads, optimizer, buffers, ids_bytes, activations, peak,
                    round(peak * profile.allocator_reserve))
    # ---- work and communication
    flops = n * sum(pieces[k][0].flops + pieces[k][1].flops for k in stages)
    model_flops = n * (sum(layers.model[j] for j in mine)
                       + (e_f.flops + e_b.flops if first else 0)
                       + (h_f.flops + h_b.flops if last else 0))
    compute_mb = sum(pieces[k][0].seconds + pieces[k][1].seconds for k in stages)
    comm: Counter = Counter()
    for k in stages:
        f_all, b_first, _ = pieces[k]
        if fsdp_pp:
            ends_f = ([e_f] if k == 0 else []) + ([h_f] if k == count - 1 else [])
            comm.update(stage_comm(f_all.comm, b_first.comm, layer_f[k], ends_f, state[k], n))
            continue
        for part in (f_all.comm, b_first.comm):
            for c, num in part.items():
                comm[c] += num * fsdp_times(c, fsdp, n)
    comm = Counter({c: v for c, v in comm.items() if v > 0})
    if ddp:
        # DDP's buckets (over dp x cp: the mesh's dp_cp view); a pipeline's loop
        comm[("all_reduce", "dp", layout.dp * layout.cp, grads - experts)] += 1
        if pp == 1:
            # find_unused_parameters: DDP also all-reduces which parameters the step used
            # (an int32 per parameter tensor it manages; the experts are not among them)
            managed = tensors - len(mine) * units.extra.get("expert_tensors", 0)
            comm[("all_reduce", "dp", layout.dp * layout.cp, 4 * managed)] += 1
        if pp == 1 and model_buffers:
            # DDP broadcasts the buffers in a forward that follows a synchronised backward:
            # once per step (the first micro-step's; no_sync skips the others)
            comm[("broadcast", "dp", layout.dp * layout.cp, model_buffers)] += 1
    replicas = layout.dp * layout.cp // layout.ep  # the ranks holding the same experts
    if experts and replicas > 1 and not units.extra.get("experts_sharded"):
        # reduce_gradients: each expert's gradient over the ranks holding the same experts
        comm[("all_reduce", "ep_replicas", replicas, experts)] += 1
    if cross is not None:
        for k in stages:
            c_in, f_in, c_out, f_out = sizes[k]
            if k < count - 1:
                comm[("send", "pp", pp, c_out)] += n
                if f_out:
                    comm[("recv", "pp", pp, f_out)] += n
            if k > 0:
                comm[("recv", "pp", pp, c_in)] += n
                if f_in:
                    comm[("send", "pp", pp, f_in)] += n
        if (first or last) and not (first and last) and units.shared:
            comm[("all_reduce", "tie", 2, units.shared)] += 1
    totals, tp_time, p2p_time, dp_time, cp_time = _collectives(comm, layout, profile)
    if layout.async_tp:
        tp_time *= 1.0 - ASYNC_TP_HIDDEN
    tp_time += cp_time  # the K / V gathers, the token all-to-alls: exposed in line
    bwd_compute = n * sum(pieces[k][1].seconds for k in stages)
    if profile.overlap:
        dp_exposed = max(dp_time - bwd_compute, dp_time / max(1, len(mine) + 1))
    else:
        dp_exposed = dp_time
    opt_time = OPTIMIZER_TRAFFIC * trained / (profile.memory_bandwidth *
                                              profile.memory_efficiency) if states else 0.0
    if states and impl == "single":  # a dozen operators per parameter tensor
        opt_time += OPTIMIZER_OPS * trained_tensors * profile.op_overhead
    return _Role(rank, len(mine), memory, flops, model_flops, totals, n * compute_mb,
                 compute_mb + (tp_time + p2p_time) / n, tp_time + p2p_time + dp_exposed,
                 dp_exposed + opt_time, opt_time)
