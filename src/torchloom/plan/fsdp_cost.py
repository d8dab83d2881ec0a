"""What FSDP2 adds to a predicted step: how often its collectives run, the unsharded
bytes a gathered layer holds, and the next layer's prefetch (used by
:mod:`torchloom.plan.predict`).

>>> fsdp_times(("all_gather", "dp", 2, 1024), backward=False, fsdp=True, pp=1, n=4, before=0)
4
>>> fsdp_times(("reduce_scatter", "dp", 2, 1024), backward=True, fsdp=True, pp=1, n=4, before=0)
1
"""

from __future__ import annotations

from .layout import Layout
from .profiles import Profile
from .units import Units

__all__ = ["DP_GROUPS", "fsdp_times", "prefetch_bytes", "stage_param_bytes", "unsharded_ratio"]

#: The mesh groups over which data-parallel gradients are reduced.
DP_GROUPS = frozenset({"dp", "dp_replicate", "ep_replicas"})


def prefetch_bytes(layout: Layout, profile: Profile, units: Units) -> int:
    """FSDP2 on a device that overlaps communication: the next layer's all-gather is
    issued while the current layer computes (its copy stream runs ahead), so one more
    layer's unsharded parameters, in the compute dtype, are live at the peak than the
    measurement (which runs the collectives in line) holds. None on a CPU."""
    if layout.dp_shard == 1 or not profile.overlap:
        return 0
    gathered = units.params["L2"] - units.extra.get("expert_params", 0)  # experts: whole
    return round((1.0 + unsharded_ratio(layout, units)) * gathered)


def fsdp_times(c: tuple[str, str, int, int], backward: bool, fsdp: bool, pp: int, n: int,
               before: int) -> int:
    """How often a collective measured once per micro-batch runs in a step. FSDP2's
    (``dp`` groups): under a pipeline, the all-gathers of the forwards before a stage's
    first backward and of that backward, and one reduction at the end; without one, the
    all-gathers of every micro-step and the reduction of the last (``no_sync``, as
    ``torchloom train`` accumulates). Everything else: once per micro-batch."""
    if not fsdp or c[1] not in DP_GROUPS:
        return n
    if pp > 1:
        return before if not backward else 1
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
