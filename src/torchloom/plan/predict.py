"""Per-rank memory, FLOPs, collectives and step time of a layout, composed from measured
pieces.

:func:`predict` measures the pieces of a step once (:mod:`torchloom.plan.units`: the
embedding part, a checkpointed and a plain layer, the head, each forward and backward, on
fake tensors as rank 0 of a fake process group of the layout's tensor-parallel and FSDP
degrees) and composes, for one representative rank of every distinct role (each
pipeline stage; the tensor- and data-parallel ranks of a stage are alike):

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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .layout import OPTIMIZERS, Layout, check_model
from .profiles import Profile, get_profile
from .spec import ModelSpec, model_spec
from .units import (
    Crossing,
    ScheduleFn,
    SegmentCost,
    UnitKey,
    Units,
    crossing,
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
    k = (*_spec_key(spec, schedule), key.tp, key.sp, key.micro_batch, key.seq_len,
         key.param_dtype)
    if k not in _CROSSINGS:
        _CROSSINGS[k] = crossing(spec, key, schedule)
    return _CROSSINGS[k]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds.

    Attributes:
        parameters, gradients, optimizer: the model's state as this rank holds it.
        buffers: what the runtime keeps besides: DDP's gradient buckets, a pipeline's
            receive buffers and the gradients left on them, its last stage's outputs, the
            model's buffers.
        inputs: the step's token ids.
        activations: the rest at the peak: saved activations, recomputation,
            temporaries, unsharded FSDP2 parameters (``peak`` minus the others).
        peak: the most the rank holds at once during a step (what must fit).
    """

    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    inputs: int
    activations: int
    peak: int

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Time:
    """Seconds of one step on one rank.

    Attributes:
        compute: its own forward and backward work (roofline).
        communication: collectives not hidden behind compute (tensor-parallel syncs,
            pipeline sends, data-parallel reductions that outlast the backward).
        bubble: waiting for other pipeline stages.
        optimizer: the optimizer step.
        step: the step as the slowest rank sets it (the same for every rank).
    """

    compute: float
    communication: float
    bubble: float
    optimizer: float
    step: float

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CollectiveTotal:
    """Every collective of one kind over one mesh dimension in a step, on one rank."""

    kind: str
    group: str
    count: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RolePrediction:
    """One pipeline stage (every rank of it is alike).

    ``flops``: the FLOPs one rank of the stage executes in a step (checkpointed layers'
    recomputation included); ``model_flops``: the same step's FLOPs without
    recomputation (what :attr:`Prediction.mfu` counts).
    """

    stage: int
    ranks: int
    layers: int
    memory: Memory
    flops: int
    collectives: tuple[CollectiveTotal, ...]
    time: Time
    fits: bool
    model_flops: int = 0

    def collective_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes per (kind, mesh dimension)."""
        out: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            out[(c.kind, c.group)] = out.get((c.kind, c.group), 0) + c.bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "ranks": self.ranks, "layers": self.layers,
                "memory": self.memory.to_dict(), "flops": self.flops,
                "model_flops": self.model_flops,
                "collectives": [c.to_dict() for c in self.collectives],
                "time": self.time.to_dict(), "fits": self.fits}


@dataclass(frozen=True)
class Prediction:
    """What a layout costs: per role, and for the step.

    ``flops_per_step``: the FLOPs the whole job executes in a step, as FlopCounterMode
    counts them, checkpointed layers' recomputation included (hardware FLOPs, for
    :attr:`hfu`); ``model_flops_per_step``: the same step without recomputation (model
    FLOPs, for :attr:`mfu`): 6 N per token for the N parameters that take part in matmuls
    (a forward and two backward products each), plus attention's score and value
    products. Without checkpointing the two are equal.
    """

    model: str
    layout: Layout
    profile: Profile
    roles: tuple[RolePrediction, ...]
    step_time: float
    flops_per_step: int
    notes: tuple[str, ...] = field(default=())
    model_flops_per_step: int = 0

    @property
    def fits(self) -> bool:
        """Whether every rank's peak fits the profile's memory budget."""
        return all(r.fits for r in self.roles)

    @property
    def peak(self) -> int:
        """The largest per-rank peak."""
        return max(r.memory.peak for r in self.roles)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the whole job."""
        return self.layout.tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def headroom(self) -> float:
        """The share of the profile's usable memory left free at the largest per-rank
        peak: ``1 - peak / budget`` (negative when the layout does not fit)."""
        return 1.0 - self.peak / self.profile.budget

    def _utilisation(self, flops: int) -> float:
        peak = self.profile.flops.get(self.layout.compute_dtype, 0.0) * self.layout.world
        return flops / (self.step_time * peak) if peak and self.step_time else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs (:attr:`model_flops_per_step`, no
        recomputation) over step time times the world's peak in the compute dtype."""
        return self._utilisation(self.model_flops_per_step)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: the FLOPs executed (:attr:`flops_per_step`,
        recomputation included) over step time times the world's peak in the compute
        dtype; at least :attr:`mfu`."""
        return self._utilisation(self.flops_per_step)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "layout": self.layout.to_dict(),
                "profile": self.profile.name, "fits": self.fits, "peak": self.peak,
                "budget": self.profile.budget, "headroom": self.headroom,
                "step_time": self.step_time, "tokens_per_s": self.tokens_per_s,
                "flops_per_step": self.flops_per_step,
                "model_flops_per_step": self.model_flops_per_step, "mfu": self.mfu,
                "hfu": self.hfu,
                "roles": [r.to_dict() for r in self.roles], "notes": list(self.notes)}


# --------------------------------------------------------------------------- pieces


@dataclass
class _Piece:
    """A segment as the composition uses it."""

    delta: int
    rise: int
    flops: int
    seconds: float
    comm: Counter
    grads: int = 0  # gradient bytes this backward piece creates the first time
    largest: int = 0  # its largest gradient tensor


OPTIMIZER_OPS = 12
"""Operators a single-tensor Adam/AdamW step dispatches per parameter tensor."""


def _seconds(seg: SegmentCost, profile: Profile) -> float:
    t = 0.0
    bw = profile.memory_bandwidth * profile.memory_efficiency
    for flops, moved, dtype in seg.matmuls:
        peak = profile.flops.get(dtype) or profile.flops.get("fp32", 1.0)
        t += max(flops / (peak * profile.matmul_efficiency), moved / bw)
    return t + seg.other_bytes / bw + seg.ops * profile.op_overhead


def _comm(seg: SegmentCost) -> Counter:
    return Counter((c.kind, c.group, c.size, c.bytes) for c in seg.collectives)


def _piece(seg: SegmentCost, profile: Profile, grads: int = 0, largest: int = 0) -> _Piece:
    return _Piece(seg.delta, seg.rise, seg.flops, _seconds(seg, profile), _comm(seg), grads,
                  largest)


def _adjusted(base: _Piece, plus: _Piece, minus: _Piece) -> _Piece:
    """``base`` with the position effect ``plus - minus`` (a piece at the first or last
    place of the stack that was measured on a layer of the other kind)."""
    comm = Counter(base.comm)
    comm.update(plus.comm)
    comm.subtract(minus.comm)
    return _Piece(base.delta + plus.delta - minus.delta,
                  max(0, base.rise + plus.rise - minus.rise), base.flops + plus.flops -
                  minus.flops, max(0.0, base.seconds + plus.seconds - minus.seconds),
                  Counter({k: v for k, v in comm.items() if v > 0}), base.grads,
                  base.largest)


class _Layers:
    """The forward and backward piece of every layer of the model (by global index): a
    checkpointed or a plain layer's, with the first layer's position effect (measured on a
    checkpointed one) moved onto a plain one when layer 0 is plain."""

    def __init__(self, units: Units, profile: Profile, num_layers: int, n_ckpt: int) -> None:
        seg = units.segments
        grads = units.grads["L2"]
        f = {n: _piece(seg[f"{n}.f"], profile) for n in ("L0", "L1", "L2")}
        b = {n: _piece(seg[f"{n}.b"], profile, grads, units.largest["L2"])
             for n in ("L0", "L1", "L2")}
        self.fwd: list[_Piece] = []
        self.bwd: list[_Piece] = []
        # a layer's forward and backward FLOPs without recomputation (model FLOPs)
        plain = f["L2"].flops + b["L2"].flops
        self.model = [plain + (f["L0"].flops + b["L0"].flops - f["L1"].flops - b["L1"].flops
                               if j == 0 else 0) for j in range(num_layers)]
        for j in range(num_layers):
            if j < n_ckpt:
                fw, bw = (f["L0"], b["L0"]) if j == 0 else (f["L1"], b["L1"])
            elif j == 0:
                fw, bw = _adjusted(f["L2"], f["L0"], f["L1"]), _adjusted(b["L2"], b["L0"],
                                                                        b["L1"])
            else:
                fw, bw = f["L2"], b["L2"]
            self.fwd.append(fw)
            self.bwd.append(bw)


# --------------------------------------------------------------------------- walk


class _Walk:
    """Live bytes of one rank through its step."""

    def __init__(self, base: int) -> None:
        self.live = base
        self.peak = base

    def run(self, piece: _Piece, grads_exist: bool = False) -> None:
        self.peak = max(self.peak, self.live + piece.rise)
        self.live += piece.delta - (piece.grads if grads_exist else 0)

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def _order(schedule: str, stage: int, stages: int, n: int) -> list[tuple[str, int]]:
    """The forward ("F") / backward ("B") order of ``stage``'s micro-batches, as
    torch.distributed.pipelining runs it (1F1B: ``stages - stage`` warm-up forwards)."""
    if stages == 1 or schedule == "GPipe":
        if stages == 1:
            return [x for m in range(n) for x in (("F", m), ("B", m))]
        return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
    warmup = min(n, stages - stage)
    order = [("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while b < n:
        order.append(("B", b))
        b += 1
        if f < n:
            order.append(("F", f))
            f += 1
    return order


def _ring(kind: str, size: int, nbytes: int, link: float) -> float:
    if size <= 1 or link == float("inf"):
        return 0.0
    if kind == "all_reduce":
        return 2 * (size - 1) / size * nbytes / link
    if kind in ("all_gather", "reduce_scatter"):
        return (size - 1) / size * nbytes / link
    return nbytes / link


def predict(model: Any, layout: Layout, profile: str | Profile = "h100-80gb", *,
            schedule: ScheduleFn | None = None, size: str = "tiny") -> Prediction:
    """Predict every role of ``layout`` for ``model`` on ``profile`` (see the module
    docstring). ``model``: a zoo name (with ``size``), a config path, a model class
    (``model_spec``), or a :class:`~torchloom.plan.spec.ModelSpec`. ``schedule``:
    ``fn(sch, knobs)`` applied instead of the built-in schedule (``knobs``: ``tp``,
    ``sequence_parallel``, ``ckpt_ratio``); it must give the layers the same layout at
    every depth.

    Raises:
        PlanError: a layout the model cannot take, a dtype the profile lacks, a model the
            planner does not support.
    """
    spec = model_spec(model, size=size, seq_len=layout.seq_len)
    prof = get_profile(profile)
    check_model(layout, spec)
    prof.peak_flops(layout.compute_dtype)  # refuse a dtype the device cannot compute in
    fsdp = layout.dp if layout.dp_mode == "fsdp" and layout.dp > 1 else 1
    key = UnitKey(layout.tp, layout.sp, layout.micro_batch, layout.seq_len,
                  layout.param_dtype, layout.mixed_precision, fsdp,
                  "model" if layout.pp == 1 else "next_token")
    units = units_for(spec, key, schedule)
    cross = _crossing_for(spec, key, schedule) if layout.pp > 1 else None
    return compose(spec, layout, prof, units, cross)


def _fold(pieces: list[_Piece], grads_exist: bool) -> _Piece:
    """One piece for a run of pieces (their net bytes and the peak above the start)."""
    live = peak = 0
    for p in pieces:
        peak = max(peak, live + p.rise)
        live += p.delta - (p.grads if grads_exist else 0)
    comm: Counter = Counter()
    for p in pieces:
        comm.update(p.comm)
    return _Piece(live, peak, sum(p.flops for p in pieces), sum(p.seconds for p in pieces),
                  comm, sum(p.grads for p in pieces))


@dataclass
class _Role:
    """What composing one stage gives, before the step time is known."""

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
                 ) -> tuple[tuple[CollectiveTotal, ...], float, float, float]:
    """Totals per (kind, group) and seconds: tensor-parallel, pipeline, data-parallel."""
    stride = {"tp": 1, "dp": layout.tp, "pp": layout.tp * layout.dp}
    merged: dict[tuple[str, str], list[float]] = {}
    times = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    for (kind, group, gsize, nbytes), count in sorted(comm.items()):
        if group == "tie":  # the first and the last stage, (pp - 1) * tp * dp ranks apart
            link = profile.link(2, layout.tp * layout.dp * max(1, layout.pp - 1))
        else:
            link = profile.link(gsize, stride.get(group, 1))
        secs = count * (_ring(kind, gsize, nbytes, link * profile.link_efficiency)
                        + profile.collective_latency)
        times["tp" if group == "tp" else "pp" if group == "pp" else "dp"] += secs
        slot = merged.setdefault((kind, group), [0, 0, 0.0])
        slot[0] += count
        slot[1] += count * nbytes
        slot[2] += secs
    totals = tuple(CollectiveTotal(kind, group, int(c), int(b), t)
                   for (kind, group), (c, b, t) in sorted(merged.items()))
    return totals, times["tp"], times["pp"], times["dp"]


def compose(spec: ModelSpec, layout: Layout, profile: Profile, units: Units,
            cross: Crossing | None) -> Prediction:
    """Compose a prediction from a measurement (see :func:`predict`)."""
    L = spec.num_layers
    layers = _Layers(units, profile, L, layout.checkpointed(L))
    seg = units.segments
    e_f = _piece(seg["E.f"], profile)
    e_b = _piece(seg["E.b"], profile, units.grads["E"], units.largest["E"])
    h_f = _piece(seg["H.f"], profile)
    h_b = _piece(seg["H.b"], profile, units.grads["H"] - units.shared, units.largest["H"])
    bounds = [-1, *layout.cuts(L), L - 1]
    roles = [_compose_stage(k, range(bounds[k] + 1, bounds[k + 1] + 1), spec, layout,
                            profile, units, cross, layers, (e_f, e_b, h_f, h_b))
             for k in range(layout.pp)]
    n, pp = layout.n_microbatches, layout.pp
    slowest = max(r.per_microbatch for r in roles)
    pipe = (n + pp - 1) * slowest if pp > 1 else n * slowest
    step = pipe + max(r.after for r in roles)
    out = []
    for r in roles:
        bubble = max(0.0, pipe - n * r.per_microbatch)
        out.append(RolePrediction(r.stage, layout.tp * layout.dp, r.layers, r.memory, r.flops,
                                  r.totals, Time(r.compute, r.exposed, bubble, r.optimizer,
                                                 step), r.memory.peak <= profile.budget,
                                  r.model_flops))
    total_flops = sum(r.flops for r in out) * layout.tp * layout.dp
    model_flops = sum(r.model_flops for r in out) * layout.tp * layout.dp
    notes = []
    fsdp = units.key.fsdp > 1
    if layout.mixed_precision and fsdp:
        notes.append("FSDP2 MixedPrecisionPolicy: all-gathers and compute in "
                     f"{layout.mixed_precision}, gradients reduced in {layout.param_dtype}")
    if fsdp and n > 1:
        notes.append("FSDP2 reduce-scatters every micro-step (its default); torchloom train "
                     "--grad-accum skips it on all but the last and keeps unsharded gradients")
    return Prediction(spec.name, layout, profile, tuple(out), step, total_flops, tuple(notes),
                      model_flops)


def _compose_stage(k: int, mine: range, spec: ModelSpec, layout: Layout, profile: Profile,
                   units: Units, cross: Crossing | None, layers: _Layers,
                   ends: tuple[_Piece, _Piece, _Piece, _Piece]) -> _Role:
    e_f, e_b, h_f, h_b = ends
    pp, n = layout.pp, layout.n_microbatches
    first, last = k == 0, k == pp - 1
    fsdp = units.key.fsdp > 1
    ddp = layout.dp > 1 and not fsdp
    # ---- what the rank holds
    params = len(mine) * units.params["L2"]
    grads = len(mine) * units.grads["L2"]
    tensors = len(mine) * units.param_tensors["L2"]
    largest = units.largest["L2"] if len(mine) else 0
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
    optimizer = states * params + (STEP_BYTES * tensors if states else 0)
    model_buffers = units.buffers["E"] + len(mine) * units.buffers["L"]
    ids_bytes = n * layout.micro_batch * layout.seq_len * 8
    if spec.kind == "masked" and pp == 1:
        ids_bytes *= 2  # the attention mask
    runtime = grads if ddp and pp == 1 else 0  # DDP's gradient buckets
    cross_in = cross_out = float_in = float_out = 0
    if cross is not None:
        if not first:
            cross_in, float_in = cross.forward_bytes(k - 1), cross.backward_bytes(k - 1)
            runtime += n * cross_in  # receive buffers, one per micro-batch
        if not last:
            cross_out, float_out = cross.forward_bytes(k), cross.backward_bytes(k)
            runtime += n * float_out  # gradient receive buffers, one per micro-batch
    outputs = n * units.leftover if cross is not None and last else 0
    # ---- the walk: the last stage's outputs of the previous step are dropped first
    base = params + optimizer + model_buffers + runtime + ids_bytes
    walk = _Walk(base + outputs)
    walk.add(-outputs)
    fwd = ([e_f] if first else []) + [layers.fwd[j] for j in mine] + ([h_f] if last else [])
    bwd = ([h_b] if last else []) + [layers.bwd[j] for j in reversed(mine)] + \
        ([e_b] if first else [])
    f_all, b_first, b_next = _fold(fwd, False), _fold(bwd, False), _fold(bwd, True)
    order = _order(layout.pipeline_schedule, k, pp, n)
    gpipe = layout.pipeline_schedule == "GPipe"
    warmup = next((i for i, (a, _) in enumerate(order) if a == "B"), len(order))
    last_f = max(i for i, (a, _) in enumerate(order) if a == "F")
    held_sends = held_grads = 0
    grads_done = False
    for i, (action, m) in enumerate(order):
        if action == "F":
            walk.run(f_all)
            continue
        if held_sends and not gpipe and i - 1 > last_f:
            walk.add(-held_sends * cross_out)  # 1F1B's cool-down releases the send
            held_sends = 0
        walk.run(b_next if grads_done else b_first)
        grads_done = True
        if pp == 1:
            walk.add(-units.leftover)  # the training loop drops the outputs
            continue
        if not first:
            # the input gradient, held for its send: torch.distributed.pipelining drops it
            # after the next backward (GPipe: at the end of the step)
            if held_grads and not gpipe:
                walk.add(-held_grads * float_in)
                held_grads = 0
            walk.add(float_in)
            held_grads += 1
        if not last and (gpipe or (warmup >= 2 and m == warmup - 2)):
            # a sent forward output stays alive after its backward: GPipe waits for
            # every send at the end of the step; 1F1B holds one warm-up send
            walk.add(cross_out)
            held_sends += 1
    walk.add(-held_grads * float_in - held_sends * cross_out)
    if outputs:
        # the last stage's outputs (in the walk since their forwards, kept until the next
        # step starts) are concatenated at the end of the step: one more copy, briefly
        walk.add(outputs)
        walk.add(-outputs)
    impl = profile.optimizer_impl if not fsdp else "single"
    transient = (params if impl == "foreach" else 2 * largest) if states else 0
    walk.add(transient)
    walk.add(-transient)
    peak = walk.peak
    buffers = model_buffers + runtime + outputs
    activations = max(0, peak - params - grads - optimizer - buffers - ids_bytes)
    memory = Memory(params, grads, optimizer, buffers, ids_bytes, activations, peak)
    # ---- work and communication
    flops = n * (f_all.flops + b_first.flops)
    model_flops = n * (sum(layers.model[j] for j in mine)
                       + (e_f.flops + e_b.flops if first else 0)
                       + (h_f.flops + h_b.flops if last else 0))
    compute_mb = f_all.seconds + b_first.seconds
    comm: Counter = Counter()
    for c, count in (f_all.comm + b_first.comm).items():
        comm[c] += count * n
    if ddp:
        comm[("all_reduce", "dp", layout.dp, grads)] += 1  # DDP's buckets; a pipeline's loop
        if pp == 1 and model_buffers:
            # DDP broadcasts the buffers in a forward that follows a synchronised backward:
            # once per step (the first micro-step's; no_sync skips the others)
            comm[("broadcast", "dp", layout.dp, model_buffers)] += 1
    if cross is not None:
        if not last:
            comm[("send", "pp", pp, cross_out)] += n
            if float_out:
                comm[("recv", "pp", pp, float_out)] += n
        if not first:
            comm[("recv", "pp", pp, cross_in)] += n
            if float_in:
                comm[("send", "pp", pp, float_in)] += n
        if (first or last) and units.shared:
            comm[("all_reduce", "tie", 2, units.shared)] += 1
    totals, tp_time, p2p_time, dp_time = _collectives(comm, layout, profile)
    bwd_compute = n * b_first.seconds
    if profile.overlap:
        dp_exposed = max(dp_time - bwd_compute, dp_time / max(1, len(mine) + 1))
    else:
        dp_exposed = dp_time
    opt_time = OPTIMIZER_TRAFFIC * params / (profile.memory_bandwidth *
                                             profile.memory_efficiency) if states else 0.0
    if states and impl == "single":  # a dozen operators per parameter tensor
        opt_time += OPTIMIZER_OPS * tensors * profile.op_overhead
    return _Role(k, len(mine), memory, flops, model_flops, totals, n * compute_mb,
                 compute_mb + (tp_time + p2p_time) / n, tp_time + p2p_time + dp_exposed,
                 dp_exposed + opt_time, opt_time)
