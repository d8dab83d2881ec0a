"""What FSDP2 adds to a predicted step: how often its collectives run, the unsharded
bytes a gathered layer holds, and the next layer's prefetch (used by
:mod:`torchloom.plan.predict`).

>>> fsdp_times(("all_gather", "dp", 2, 1024), fsdp=True, n=4)
4
>>> fsdp_times(("reduce_scatter", "dp", 2, 1024), fsdp=True, n=4)
1
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Protocol, TypeVar

from .layout import Layout
from .profiles import Profile
from .units import Units

__all__ = ["DP_GROUPS", "fsdp_times", "only_dp", "prefetch_bytes", "root_shares", "scaled_dp",
           "stage_param_bytes", "stage_roots", "unsharded_ratio"]

#: The mesh groups over which data-parallel gradients are reduced.
DP_GROUPS = frozenset({"dp", "dp_replicate", "ep_replicas"})


def prefetch_bytes(layout: Layout, profile: Profile, units: Units) -> int:
    """FSDP2 on a device that overlaps communication: the next layer's all-gather is
    issued while the current layer computes (its copy stream runs ahead), so one more
    layer's unsharded parameters, in the compute dtype, are live at the peak than the
    measurement (which runs the collectives in line) holds. None on a CPU."""
    if not layout.fsdp or not profile.overlap:
        return 0
    gathered = units.params["L2"] - units.extra.get("expert_params", 0)  # experts: whole
    return round((1.0 + unsharded_ratio(layout, units)) * gathered)


def fsdp_times(c: tuple[str, str, int, int], fsdp: bool, n: int) -> int:
    """How often a collective measured once per micro-batch runs in a step of ``n``
    micro-steps without a pipeline: FSDP2's (``dp`` groups) all-gathers every micro-step,
    its reductions on the last (``no_sync``, as ``torchloom train`` accumulates);
    everything else once per micro-batch. (Under a pipeline:
    :func:`~torchloom.plan.fsdp_pipeline.pipeline_times`.)"""
    if not fsdp or c[1] not in DP_GROUPS:
        return n
    return n if c[0] == "all_gather" else 1


def stage_param_bytes(k: int, spans: list[range], count: int, units: Units) -> int:
    """The (sharded) parameter bytes of stage ``k`` on one rank."""
    out = len(spans[k]) * (units.params["L2"] - units.extra.get("expert_params", 0))
    if k == 0:
        out += units.params["E"]
    if k == count - 1:
        out += units.params["H"] - (units.shared if count == 1 else 0)
    return out


def unsharded_ratio(layout: Layout, units: Units) -> float:
    """Unsharded bytes per sharded parameter byte (parameters or gradients): ``dp_shard``
    times the compute dtype's size over the parameter dtype's, minus the shard itself."""
    from .spec import DTYPES

    compute = DTYPES[units.key.mixed_precision or units.key.param_dtype].itemsize
    param = DTYPES[units.key.param_dtype].itemsize
    return max(0.0, layout.dp_shard * layout.cp * compute / param - 1.0)


def root_shares(units: Units) -> tuple[float, float]:
    """The shares of the measured FSDP2 root (the parameters outside the layers: the
    embedding ``E`` and the head ``H``, a weight they share counted once) that a
    pipeline's first and last stage each gather, as a stage is a root of its own: ``E``
    and ``H`` over the whole (a shared weight is in both stages, so the two may sum to
    more than 1)."""
    e, h = units.params["E"], units.params["H"]
    whole = e + h - units.shared
    if whole <= 0:
        return 0.0, 0.0
    return e / whole, h / whole


def scaled_dp(comm: Counter, share: float) -> Counter:
    """``comm`` (collective ``(kind, group, size, bytes)`` -> count) with the bytes of its
    data-parallel collectives scaled by ``share``; the others as they are.

    >>> scaled_dp(Counter({("all_gather", "dp", 2, 100): 1, ("all_reduce", "tp", 2, 8): 3}), 0.25)
    Counter({('all_reduce', 'tp', 2, 8): 3, ('all_gather', 'dp', 2, 25): 1})
    """
    out: Counter = Counter()
    for (kind, group, size, nbytes), count in comm.items():
        scaled = round(nbytes * share) if group in DP_GROUPS else nbytes
        if scaled > 0:
            out[(kind, group, size, scaled)] += count
    return out


def only_dp(comm: Counter) -> Counter:
    """The data-parallel collectives of ``comm``."""
    return Counter({c: n for c, n in comm.items() if c[1] in DP_GROUPS})


class Piece(Protocol):
    """A piece of the predicted step as :mod:`torchloom.plan.predict` composes it: the
    bytes it leaves allocated, its peak above its start, its collectives."""

    delta: int
    rise: int
    comm: Counter


P = TypeVar("P", bound=Piece)


def _changed(piece: P, **values: object) -> P:
    out = copy.copy(piece)
    for name, value in values.items():
        setattr(out, name, value)
    return out


def stage_roots(units: Units, e_f: P, e_b: P, h_f: P, h_b: P
                ) -> tuple[P, P, P, P, int, int]:
    """FSDP2 under a pipeline: each stage module is an FSDP2 root of its own, so the
    measured root (the embedding and the head, gathered as the step starts and freed as
    it ends) splits in two: the first stage gathers and reduces the embedding's part, the
    last stage the head's (a tied weight: both). Returns the end pieces (embedding
    forward and backward, head forward and backward) with the root's data-parallel
    collectives divided so and the head's gathered bytes taken out of the embedding's
    forward, and the gathered bytes of each part, the embedding's and the head's (the
    last stage gathers the head's as its forward starts).
    Neither part is freed by a backward piece: a stage keeps its root gathered until its
    last backward ends (the pipeline schedule reshards it then), and the walk frees both
    at the end of the step."""
    e_share, h_share = root_shares(units)
    gathered = sum(c[3] * n for c, n in e_f.comm.items()
                   if c[0] == "all_gather" and c[1] in DP_GROUPS)
    head = round(gathered * h_share)
    e_f2 = _changed(e_f, delta=e_f.delta - head, rise=max(0, e_f.rise - head),
                    comm=scaled_dp(e_f.comm, e_share))
    e_b2 = _changed(e_b, delta=e_b.delta + gathered, comm=scaled_dp(e_b.comm, e_share))
    h_f2 = _changed(h_f, comm=h_f.comm + only_dp(scaled_dp(e_f.comm, h_share)))
    h_b2 = _changed(h_b, comm=h_b.comm + only_dp(scaled_dp(e_b.comm, h_share)))
    return e_f2, e_b2, h_f2, h_b2, gathered - head, head
