"""The pieces :func:`torchloom.plan.predict.compose` walks: each measured segment of a
step (:class:`~torchloom.plan.units.SegmentCost`) as bytes left and risen, FLOPs, seconds
on a profile and collectives; every layer's forward and backward piece
(:class:`Layers`), and a pipeline stage's, folded or step by step.

>>> from collections import Counter
>>> a = Piece(delta=10, rise=30, flops=5, seconds=1.0, comm=Counter())
>>> b = Piece(delta=-4, rise=20, flops=5, seconds=1.0, comm=Counter())
>>> both = fold([a, b], grads_exist=False)
>>> both.delta, both.rise, less(both, 6).delta
(6, 30, 0)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from .profiles import Profile
from .units import SegmentCost, Units

__all__ = ["ASYNC_TP_HIDDEN", "CAUSAL_SHARE", "COMPILE_TRAFFIC", "FLOAT8_CAST", "Kernels",
           "Layers", "Pair", "Piece", "adjusted", "causal_share", "fold", "less", "piece",
           "seconds", "stage_backward", "stage_forward", "stage_pieces"]

@dataclass
class Piece:
    """A segment as the composition uses it."""

    delta: int
    rise: int
    flops: int
    seconds: float
    comm: Counter
    grads: int = 0  # gradient bytes this backward piece creates the first time
    largest: int = 0  # its largest gradient tensor


Pair = tuple[Piece, "Piece | None"]
"""A piece and, for a layer's, that layer's forward piece (what FSDP2 gathers for it):
a :data:`torchloom.plan.fsdp_pipeline.Step`."""




CAUSAL_SHARE = 0.5
"""The share of a causal attention's counted FLOPs its kernel executes: flash and
memory-efficient attention skip the blocks above the diagonal (FlopCounterMode counts the
whole score matrix). Time only: MFU keeps the counted FLOPs, as torchtitan's does."""
COMPILE_TRAFFIC = 0.5
"""``compile``: the share of an eager layer's element-wise memory traffic a compiled layer
moves (inductor fuses chains of element-wise operators and normalisations into single
kernels, which read their inputs and write their outputs once). An assumption, not
measured: on these CPUs compile is not faster, and the GPU run measures it."""
FLOAT8_CAST = 0.75
"""``float8``: bytes moved to cast a linear product's operands to FP8 (torchao's dynamic
scaling reads the bf16 tensors for their amax and again to cast, and writes one byte per
element), per byte the bf16 product moves; the product itself runs at the profile's fp8
peak with the same efficiency. The layers' linear products only (torchao leaves the output
layer in bf16). An assumption, not measured."""
ASYNC_TP_HIDDEN = 0.8
"""``async_tp``: the share of the sequence-parallel all-gathers and reduce-scatters that
overlap the matrix products they feed or follow (the collectives are split and pipelined
with the product's chunks). An assumption, not measured."""


@dataclass(frozen=True)
class Kernels:
    """How the layers' operators run: compiled, with Float8 linear products."""

    compile: bool = False
    float8: bool = False
    causal_share: float = CAUSAL_SHARE  # of causal attention's counted FLOPs executed


def causal_share(cp: int) -> float:
    """The share of the counted causal-attention FLOPs the kernels execute on one of ``cp``
    context-parallel ranks: half (:data:`CAUSAL_SHARE`) for one; else its query chunks
    ``j = r, 2cp - 1 - r`` (``c = S / 2cp`` tokens) run against ``(j + 1) c`` keys, counted
    ``(2cp + 1) c^2`` scores of which the kernel skips half of each last ``c x c`` block:
    ``2cp / (2cp + 1)``, i.e. ``1 / cp`` of the whole causal attention per rank."""
    return CAUSAL_SHARE if cp <= 1 else 2 * cp / (2 * cp + 1)


def seconds(seg: SegmentCost, profile: Profile, kernels: Kernels = Kernels()) -> float:
    t = 0.0
    bw = profile.memory_bandwidth * profile.memory_efficiency
    for flops, moved, dtype, kind in seg.matmuls:
        peak = profile.flops.get(dtype) or profile.flops.get("fp32", 1.0)
        if kind == "causal":
            flops = round(flops * kernels.causal_share)
        if kernels.float8 and kind == "linear" and "fp8" in profile.flops and \
                dtype in ("bf16", "fp16"):
            peak = profile.flops["fp8"]
            t += FLOAT8_CAST * moved / bw
        efficiency = profile.matmul_efficiency
        if kind in ("causal", "attention") and profile.attention_efficiency is not None:
            efficiency = profile.attention_efficiency
        t += max(flops / (peak * efficiency), moved / bw)
    other = seg.other_bytes * (COMPILE_TRAFFIC if kernels.compile else 1.0)
    return t + other / bw + seg.ops * profile.op_overhead


def comm_of(seg: SegmentCost) -> Counter:
    return Counter((c.kind, c.group, c.size, c.bytes) for c in seg.collectives)


def piece(seg: SegmentCost, profile: Profile, grads: int = 0, largest: int = 0,
           kernels: Kernels = Kernels()) -> Piece:
    return Piece(seg.delta, seg.rise, seg.flops, seconds(seg, profile, kernels),
                  comm_of(seg), grads, largest)


def adjusted(base: Piece, plus: Piece, minus: Piece) -> Piece:
    """``base`` with the position effect ``plus - minus`` (a piece at the first or last
    place of the stack that was measured on a layer of the other kind)."""
    comm = Counter(base.comm)
    comm.update(plus.comm)
    comm.subtract(minus.comm)
    return Piece(base.delta + plus.delta - minus.delta,
                  max(0, base.rise + plus.rise - minus.rise), base.flops + plus.flops -
                  minus.flops, max(0.0, base.seconds + plus.seconds - minus.seconds),
                  Counter({k: v for k, v in comm.items() if v > 0}), base.grads,
                  base.largest)



class Layers:
    """The forward and backward piece of every layer of the model (by global index): a
    checkpointed (under ``ac="op"``: op-level selective, as measured) or a plain layer's,
    with the first layer's
    position effect (measured on a checkpointed one) moved onto another kind when layer 0
    is not checkpointed."""

    def __init__(self, units: Units, profile: Profile, num_layers: int, n_ckpt: int,
                 kernels: Kernels = Kernels()) -> None:
        seg = units.segments
        grads = units.grads["L2"]
        f = {n: piece(seg[f"{n}.f"], profile, kernels=kernels) for n in ("L0", "L1", "L2")}
        b = {n: piece(seg[f"{n}.b"], profile, grads, units.largest["L2"], kernels)
             for n in ("L0", "L1", "L2")}
        self.fwd: list[Piece] = []
        self.bwd: list[Piece] = []
        # a layer's forward and backward FLOPs without recomputation (model FLOPs)
        plain = f["L2"].flops + b["L2"].flops
        self.model = [plain + (f["L0"].flops + b["L0"].flops - f["L1"].flops - b["L1"].flops
                               if j == 0 else 0) for j in range(num_layers)]
        for j in range(num_layers):
            if j < n_ckpt:
                fw, bw = (f["L0"], b["L0"]) if j == 0 else (f["L1"], b["L1"])
            elif j == 0:
                fw, bw = adjusted(f["L2"], f["L0"], f["L1"]), adjusted(b["L2"], b["L0"],
                                                                        b["L1"])
            else:
                fw, bw = f["L2"], b["L2"]
            self.fwd.append(fw)
            self.bwd.append(bw)


def fold(pieces: list[Piece], grads_exist: bool) -> Piece:
    """One piece for a run of pieces (their net bytes and the peak above the start)."""
    live = peak = 0
    for p in pieces:
        peak = max(peak, live + p.rise)
        live += p.delta - (p.grads if grads_exist else 0)
    comm: Counter = Counter()
    for p in pieces:
        comm.update(p.comm)
    return Piece(live, peak, sum(p.flops for p in pieces), sum(p.seconds for p in pieces),
                  comm, sum(p.grads for p in pieces))


def stage_pieces(mine: range, first: bool, last: bool, layers: Layers,
                  ends: tuple[Piece, Piece, Piece, Piece], head_root: int = 0
                  ) -> tuple[Piece, Piece, Piece]:
    """A stage's forward, first backward (creating its gradients) and later backward: its
    :func:`stage_forward` and :func:`stage_backward` pieces folded. ``head_root``: the
    bytes a last stage's FSDP2 root gathers (:func:`~torchloom.plan.fsdp_cost.stage_roots`)."""
    fwd = [p for p, _ in stage_forward(mine, first, last, layers, ends, (0, head_root), False)]
    bwd = [p for p, _ in stage_backward(mine, first, last, layers, ends)]
    return fold(fwd, False), fold(bwd, False), fold(bwd, True)


def stage_backward(mine: range, first: bool, last: bool, layers: Layers,
                   ends: tuple[Piece, Piece, Piece, Piece]) -> list[Pair]:
    """FSDP2 under a pipeline: a stage's backward pieces in order, each layer's with its
    forward piece (what it gathers), the head's and the embedding's with None."""
    _, e_b, _, h_b = ends
    out: list[Pair] = [(h_b, None)] if last else []
    out += [(layers.bwd[j], layers.fwd[j]) for j in reversed(mine)]
    return out + ([(e_b, None)] if first else [])


def stage_forward(mine: range, first: bool, last: bool, layers: Layers,
                   ends: tuple[Piece, Piece, Piece, Piece], roots: tuple[int, int],
                   later: bool) -> list[Pair]:
    """FSDP2 under a pipeline: a stage's forward pieces (each layer's with itself). The
    first forward gathers the stage's root (``roots``: the embedding's and the head's
    bytes; the head's as the last stage starts); a ``later`` one finds it gathered."""
    e_f, _, h_f, _ = ends
    out: list[Pair] = [(less(e_f, roots[0]) if later else e_f, None)] if first else []
    if last and roots[1] and not later:
        out.append((Piece(roots[1], roots[1], 0, 0.0, Counter()), None))
    out += [(layers.fwd[j], layers.fwd[j]) for j in mine]
    return out + ([(h_f, None)] if last else [])


def less(piece: Piece, nbytes: int) -> Piece:
    """``piece`` allocating ``nbytes`` less."""
    return replace(piece, delta=piece.delta - nbytes, rise=max(0, piece.rise - nbytes))
