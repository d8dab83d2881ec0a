"""The order in which a pipeline rank runs its micro-batches, and the share of the
pipeline's fill and drain it waits for: the planner's model of every schedule
``torch.distributed.pipelining`` offers.

* ``GPipe``: every forward, then every backward (one stage per rank);
* ``1F1B``: ``stages - stage`` warm-up forwards, then one forward, one backward;
* ``Interleaved1F1B`` (``v`` looped stages per rank: rank ``r`` holds stages ``r``,
  ``r + pp``, ...): torch's order, ``(v - 1) x per_round + 2 (pp - 1 - r)`` warm-up
  forwards over the local stages in rounds of ``per_round`` micro-batches, then one
  forward, one backward; the bubble shrinks to ``1/v`` of 1F1B's;
* ``InterleavedZeroBubble`` and ``ZBVZeroBubble``: the same memory order as interleaved
  1F1B (an approximation: their split backward defers the weight gradients, which hold
  a little more for a little longer), the stages of ZBV placed in a V (rank ``r``:
  stages ``r`` and ``2 pp - 1 - r``); the weight-gradient work fills the bubble, which is
  modelled as a third of the interleaved one for InterleavedZeroBubble (ZB-H1: the fill
  costs ``T_F + T_B - T_W`` per stage instead of ``T_F + T_B + T_W``, with
  ``T_F ~ T_B ~ T_W``) and a sixth for ZBVZeroBubble (ZB-V: its V places the first and
  last stage on one rank, so the drain starts sooner).

>>> order("1F1B", 0, 2, 0, 1, 3)
[('F', 0, 0), ('F', 1, 0), ('B', 0, 0), ('F', 2, 0), ('B', 1, 0), ('B', 2, 0)]
>>> [a for a in order("Interleaved1F1B", 1, 2, 1, 2, 2)]
[('F', 0, 0), ('F', 1, 0), ('F', 0, 1), ('B', 0, 1), ('F', 1, 1), ('B', 1, 1), ('B', 0, 0), ('B', 1, 0)]
>>> bubble_share("1F1B", 1), bubble_share("Interleaved1F1B", 2)
(1.0, 0.5)
"""

from __future__ import annotations

__all__ = ["bubble_share", "order"]

Action = tuple[str, int, int]
"""``(kind, micro-batch, local stage)``: kind ``"F"`` (forward) or ``"B"`` (backward);
the local stage is the index among the rank's stages (0: its first)."""


def _one_stage(schedule: str, stage: int, stages: int, n: int) -> list[Action]:
    if stages == 1:
        return [x for m in range(n) for x in (("F", m, 0), ("B", m, 0))]
    if schedule == "GPipe":
        return [("F", m, 0) for m in range(n)] + [("B", m, 0) for m in range(n)]
    warmup = min(n, stages - stage)
    out: list[Action] = [("F", m, 0) for m in range(warmup)]
    f, b = warmup, 0
    while b < n:
        out.append(("B", b, 0))
        b += 1
        if f < n:
            out.append(("F", f, 0))
            f += 1
    return out


def _interleaved(rank: int, pp: int, v: int, n: int) -> list[Action]:
    rounds = max(1, n // pp)
    per_round = max(1, n // rounds)
    total = n * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)

    def at(k: int, backward: bool) -> Action:
        local = (k // per_round) % v
        m = (k // (per_round * v)) * per_round + k % per_round
        return ("B", m, v - 1 - local) if backward else ("F", m, local)

    out = [at(k, False) for k in range(warmup)]
    for i in range(total - warmup):
        out += [at(warmup + i, False), at(i, True)]
    out += [at(k, True) for k in range(total - warmup, total)]
    return out


def order(schedule: str, rank: int, pp: int, stage: int, per_rank: int,
          n: int) -> list[Action]:
    """The actions of pipeline rank ``rank`` of ``pp`` in one step of ``n`` micro-batches:
    one stage per rank (``stage``: its index) or ``per_rank`` stages (see the module
    docstring)."""
    if per_rank == 1:
        return _one_stage(schedule, stage, pp, n)
    return _interleaved(rank, pp, per_rank, n)


def bubble_share(schedule: str, per_rank: int) -> float:
    """The pipeline's fill and drain as a share of 1F1B's ``(pp - 1)`` micro-batch times
    (see the module docstring)."""
    share = 1.0 / per_rank
    if schedule == "InterleavedZeroBubble":
        return share / 3
    if schedule == "ZBVZeroBubble":
        return share / 6
    return share
