"""FSDP2 under a pipeline, step by step: what each forward and backward of a stage gathers,
keeps and frees, as ``torch.distributed.pipelining`` (torch 2.13) runs an FSDP2 stage.

A pipeline stage module is an FSDP2 root of its own, its layers FSDP2 units that reshard
after their forward. The schedule calls every backward with
``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``, and
reduces the gradients once, after the step's last backward (``perform_reduce_grad``).
So, for the layers of one stage:

* a forward on **sharded** layers all-gathers each one and frees it after its forward
  (what the planner's pieces measured without a pipeline do);
* a forward on **unsharded** layers (a backward left them so) gathers nothing and frees
  each layer after its forward;
* a backward on sharded layers all-gathers each one and **keeps** it; on unsharded ones
  it gathers nothing;
* every backward leaves each layer's gradient **unsharded**, accumulated in the
  reduction dtype (fp32 under bf16 mixed precision), not reduce-scattered: the first
  backward allocates those gradients, the later ones add into them;
* after the step's last backward each layer's gradient is reduce-scattered once (the
  sharded gradient appears, the unsharded one is freed) and the layers are resharded.

The stage's root (the embedding of the first stage, the head of the last) does not
reshard after its forward: it is gathered by the first forward and kept to the end
(:func:`~torchloom.plan.fsdp_cost.stage_roots`). The bytes come from the measured pieces
themselves: a layer's gathered parameters are its forward's all-gather output, its
unsharded gradient its backward's reduce-scatter input (:func:`gathered`,
:func:`reduced`).

>>> from collections import Counter
>>> from types import SimpleNamespace as P
>>> layer_f = P(delta=0, rise=150, comm=Counter({("all_gather", "dp", 2, 100): 1}))
>>> layer_b = P(delta=40, rise=300, grads=40,
...             comm=Counter({("all_gather", "dp", 2, 100): 1,
...                           ("reduce_scatter", "dp", 2, 80): 1}))
>>> walk, stage, steps = Walk(1000), StageState(), [(layer_b, layer_f)]
>>> forward(walk, stage, [(layer_f, layer_f)], first=True, last=True)
>>> walk.live, stage.unsharded
(1000, False)
>>> backward(walk, stage, steps); walk.live  # + 100 parameters + 80 unsharded gradients
1180
>>> forward(walk, stage, [(layer_f, layer_f)], True, True); walk.live  # frees the parameters
1080
>>> backward(walk, stage, steps); walk.live  # gathers them again, adds into the gradients
1180
>>> reduce(walk, stage, steps); walk.live    # + 40 sharded gradients - 180
1040
>>> stage.forward_gathers, stage.backward_gathers  # the second forward found them gathered
(1, 2)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

from .fsdp_cost import DP_GROUPS, only_dp

__all__ = ["StageState", "Step", "Walk", "backward", "forward", "gathered",
           "reduce", "reduced", "stage_comm"]

class Piece(Protocol):
    """A measured piece of the step: the bytes it leaves, its rise, its collectives."""

    delta: int
    rise: int
    comm: Counter


class Walk:
    """Live bytes of one rank through its step, and their peak."""

    def __init__(self, base: int) -> None:
        self.live = base
        self.peak = base

    def run(self, piece: Piece, grads_exist: bool = False) -> None:
        """Run ``piece`` (without the gradients it creates, when they exist already)."""
        self.peak = max(self.peak, self.live + piece.rise)
        grads = getattr(piece, "grads", 0)
        self.live += piece.delta - (grads if grads_exist else 0)

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def _dp_gathers(comm: Counter) -> Counter:
    """FSDP2's all-gathers in ``comm``."""
    return Counter({c: num for c, num in only_dp(comm).items() if c[0] == "all_gather"})


def _bytes(piece: Piece, kind: str) -> int:
    return sum(c[3] * num for c, num in only_dp(piece.comm).items() if c[0] == kind)


def gathered(piece: Piece) -> int:
    """The bytes ``piece``'s FSDP2 all-gathers produce (unsharded, in the compute dtype)."""
    return _bytes(piece, "all_gather")


def reduced(piece: Piece) -> int:
    """The bytes ``piece``'s FSDP2 reduce-scatters take (unsharded gradients, in the
    reduction dtype)."""
    return _bytes(piece, "reduce_scatter")


@dataclass
class StageState:
    """One stage's FSDP2 state through the step, and what it gathered."""

    unsharded: bool = False
    """Its layers' parameters are gathered (a backward left them so)."""
    accumulating: bool = False
    """Its unsharded gradients exist (since its first backward)."""
    forward_gathers: int = 0
    """Forwards that all-gathered the layers."""
    backward_gathers: int = 0
    """Backwards that all-gathered the layers."""


Step = tuple[Piece, "Piece | None"]
"""A backward piece and, for a layer's, that layer's forward piece (None for the end
pieces: the root's parameters are gathered already)."""


def _forward_edges(layers: Sequence[Piece], first: bool, last: bool) -> tuple[int, int]:
    """What a stage's forward adds before its pieces and frees after them, ``layers`` in
    forward order (see :func:`forward`): the buffer its first layer's piece freed, which is
    not there, and its last layer's, which its root frees."""
    if not layers:
        return 0, 0
    return (0 if first else gathered(layers[0])), (0 if last else gathered(layers[-1]))


def _backward_edge(layers: Sequence[Piece], first: bool, last: bool) -> int:
    """What a stage's backward sets right after its pieces, ``layers`` in forward order
    (see :func:`backward`): the first layer the first stage's pieces freed, the last layer
    the last stage's head piece prefetched."""
    if not layers:
        return 0
    return (gathered(layers[0]) if first else 0) - (gathered(layers[-1]) if last else 0)


def _sharded_grads(piece: Piece, layer: Piece | None, experts: int) -> int:
    """The sharded gradient bytes FSDP2 makes of ``piece``'s gradients (a layer's less the
    ``experts`` it does not manage)."""
    return max(0, getattr(piece, "grads", 0) - (experts if layer is not None else 0))


def forward(walk: Walk, stage: StageState, steps: Sequence[Step], first: bool = False,
            last: bool = False) -> None:
    """One forward of the stage, ``steps`` in order (the embedding's or the head's pieces
    with None, each layer's forward with itself); ``first`` / ``last``: the pipeline's
    first / last stage. On sharded layers the measured pieces run as they are (each
    layer gathered and freed); on unsharded ones (a backward left them so) nothing is
    gathered and each layer is freed after its forward.

    FSDP2 frees a forward all-gather's output buffer at the next all-gather, or as the
    root's forward ends: each measured layer piece holds its own buffer and frees the
    one before it. A stage's first layer has no buffer before it (its piece freed one: it
    is added back), and its root frees its last layer's buffer as its forward ends (the
    last stage's head piece was measured doing so)."""
    before, after = _forward_edges([layer for _, layer in steps if layer is not None], first,
                                   last)
    walk.add(before)
    for piece, layer in steps:
        if layer is None or not stage.unsharded:
            walk.run(piece)
            continue
        own = gathered(layer)  # gathered already: no gather, freed after its forward
        walk.peak = max(walk.peak, walk.live + max(0, piece.rise - own))
        walk.live += piece.delta - own
    walk.add(-after)
    if stage.unsharded:
        stage.unsharded = False
    else:
        stage.forward_gathers += 1


def balance(forwards: Sequence[Step], steps: Sequence[Step], first: bool, last: bool,
            kept: int = 0) -> int:
    """What a stage's backward frees beyond its measured pieces, so that one forward and
    one backward of a micro-batch leave nothing but ``kept`` (the last stage's outputs,
    which the schedule keeps to the step's end): the pieces were measured in one model
    without a pipeline, where some of what a layer saves is freed by another part's piece
    (the head's forward, the embedding's backward), across what are stage boundaries
    here. ``forwards``: the stage's forward as its later forwards run it (the root
    gathered already); ``steps``: its backward (gradients existing)."""
    layers = [layer for _, layer in forwards if layer is not None]
    before, after = _forward_edges(layers, first, last)
    net = sum(p.delta for p, _ in forwards) + before - after + \
        sum(p.delta - getattr(p, "grads", 0) for p, _ in steps) + \
        _backward_edge(layers, first, last)
    return kept - net


def backward(walk: Walk, stage: StageState, steps: Sequence[Step], experts: int = 0,
             first: bool = False, last: bool = False, release: int = 0) -> None:
    """One backward of the stage, ``steps`` in backward order (the head's, the layers' last
    first, the embedding's), each piece followed by what FSDP2 keeps after it: a layer's
    gathered parameters when the layers were sharded, and on the first backward the
    unsharded gradient in place of the sharded one the measured piece made (``experts``:
    the bytes of each layer's gradients FSDP2 does not manage, expert parallelism's whole
    experts, which stay). ``first`` / ``last``: the pipeline's first / last stage;
    ``release``: what the stage frees beyond its pieces (:func:`balance`), a share with
    each layer's backward.

    The measured backward pieces prefetch: the head's gathers the last layer, each
    layer's the layer before it and frees its own, the first layer's only frees. So the
    last stage's pieces leave one layer gathered and the first stage's one freed that
    were not there; both are set right as the backward ends."""
    start = not stage.accumulating
    layers = [layer for _, layer in reversed(steps) if layer is not None]  # forward order
    share = round(release / max(1, len(layers)))  # freed with each layer's backward
    for piece, layer in steps:
        walk.run(piece, grads_exist=not start)
        keep = gathered(layer) if layer is not None and not stage.unsharded else 0
        if start:
            keep += reduced(piece) - _sharded_grads(piece, layer, experts)
        walk.add(keep + (share if layer is not None else 0))
    walk.add(_backward_edge(layers, first, last))
    walk.add(release - share * len(layers))
    if not stage.unsharded:
        stage.backward_gathers += 1
    stage.unsharded = True
    stage.accumulating = True


def reduce(walk: Walk, stage: StageState, steps: Sequence[Step], experts: int = 0) -> None:
    """The step's end for the stage: its gradients reduce-scattered (the sharded ones
    appear while the unsharded ones are still there), then the unsharded gradients and
    parameters freed."""
    if not stage.accumulating:
        return
    walk.add(sum(_sharded_grads(p, layer, experts) for p, layer in steps))
    walk.add(-sum(reduced(p) for p, _ in steps))
    if stage.unsharded:
        walk.add(-sum(gathered(layer) for _, layer in steps if layer is not None))
        stage.unsharded = False
    stage.accumulating = False


def stage_comm(forward: Counter, backward: Counter, layer_forwards: Sequence[Piece],
               roots: Sequence[Piece], stage: StageState, n: int) -> Counter:
    """The collectives of the stage's step under a pipeline of ``n`` micro-batches, from
    its measured forward and backward collectives (once per micro-batch): FSDP2's forward
    all-gathers as often as its forwards gathered, but the root's (in ``roots``: the end
    pieces' forwards) once; in each gathering backward one all-gather per layer of the
    stage (the measured pieces prefetch across stage boundaries: the head's gathers the
    last layer, a stage's first layer the layer before it); FSDP2's reductions once; the
    rest once per micro-batch.

    >>> ag, rs = ("all_gather", "dp", 2, 100), ("reduce_scatter", "dp", 2, 200)
    >>> layer = type("P", (), {"comm": Counter({ag: 1})})()
    >>> stage_comm(Counter({ag: 1}), Counter({ag: 2, rs: 1}), [layer], [],
    ...            StageState(forward_gathers=2, backward_gathers=3), 4)
    Counter({('all_gather', 'dp', 2, 100): 5, ('reduce_scatter', 'dp', 2, 200): 1})
    """
    out: Counter = Counter()
    for c, num in forward.items():
        out[c] += num * (stage.forward_gathers if c[1] in DP_GROUPS else n)
    for root in roots:  # gathered by the first forward, kept to the end
        for c, num in _dp_gathers(root.comm).items():
            out[c] -= num * max(0, stage.forward_gathers - 1)
    for c, num in backward.items():
        if c[1] not in DP_GROUPS:
            out[c] += num * n
        elif c[0] != "all_gather":
            out[c] += num
    for layer in layer_forwards:
        for c, num in _dp_gathers(layer.comm).items():
            out[c] += num * stage.backward_gathers
    return Counter({c: v for c, v in out.items() if v > 0})
