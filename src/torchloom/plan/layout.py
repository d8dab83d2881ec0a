"""What the planner adds to :class:`torchloom.Layout`: the checks that need the model.

The layout itself is :class:`torchloom.parallel.layout.Layout` (``torchloom.plan.Layout``
is that class): the degrees ``dp_replicate``, ``dp_shard``, ``tp`` (with ``sp``), ``pp``
(with its ``pipeline_schedule``, ``stages_per_rank`` and ``stage_cuts``), the
micro-batches, the checkpointing (``ckpt_ratio``, ``ac``), the dtypes and the optimizer.
It checks itself when made (:class:`~torchloom.core.errors.LayoutError`, a
:class:`~torchloom.core.errors.PlanError`); :func:`check_model` refuses what the model
cannot take, with the same rules as :func:`torchloom.parallelize` (the stage split of
:meth:`Layout.check_layers`).

>>> from torchloom.plan.spec import model_spec
>>> check_model(Layout(tp=2), model_spec("llama"))
>>> check_model(Layout(tp=4), model_spec("llama"))
Traceback (most recent call last):
...
torchloom.core.errors.PlanError: plan(...): tensor parallelism gives each of the 4 ranks whole attention heads, and 2 heads do not divide
    values: heads=2, tp=4
    fix: tp in [1, 2]
"""

from __future__ import annotations

from typing import Any

from ..core.errors import PlanError
from ..parallel.layout import (
    AC_MODES,
    DP_MODES,
    NOTATION,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    Layout,
    data_parallel,
)
from .spec import ModelSpec

__all__ = ["AC_MODES", "DP_MODES", "Layout", "NOTATION", "OPTIMIZERS", "PIPELINE_SCHEDULES",
           "SCHEDULES", "check_model", "data_parallel"]

SCHEDULES = PIPELINE_SCHEDULES
"""The pipeline schedules the planner models (every one ``torch.distributed.pipelining``
offers)."""
_PRIMITIVE = "plan"


def _fail(problem: str, values: dict[str, Any], fix: str) -> PlanError:
    return PlanError(problem, primitive=_PRIMITIVE, values=values, fix=fix)


def check_model(layout: Layout, spec: ModelSpec) -> None:
    """Refuse a layout the model cannot take: layers that do not split into the stages
    (:meth:`Layout.check_layers`, as :func:`torchloom.parallelize` refuses them), heads,
    KV heads and MLP features that tensor parallelism cannot share (the built-in
    schedule's own rules; the schedule checks them again when applied), experts that
    expert parallelism cannot share (none declared by the config, or a number ``ep`` does
    not divide)."""
    layout.check_layers(spec.num_layers)
    if layout.ep > 1:
        experts = spec.attr("num_local_experts", "num_experts", "n_routed_experts")
        if not isinstance(experts, int) or experts < 2:
            raise _fail(f"expert parallelism needs a mixture of experts, and "
                        f"{spec.model_class.__name__}'s config declares no experts",
                        {"model": spec.model_class.__name__, "ep": layout.ep}, "ep=1")
        if experts % layout.ep:
            raise _fail(f"{experts} experts do not split evenly between {layout.ep} "
                        "expert-parallel ranks", {"num_experts": experts, "ep": layout.ep},
                        f"ep in {[d for d in range(1, experts + 1) if experts % d == 0]}")
    if layout.tp > 1:
        heads, kv = spec.heads, spec.kv_heads
        if heads % layout.tp:
            raise _fail(f"tensor parallelism gives each of the {layout.tp} ranks whole "
                        f"attention heads, and {heads} heads do not divide",
                        {"heads": heads, "tp": layout.tp},
                        f"tp in {[d for d in range(1, heads + 1) if heads % d == 0]}")
        if kv % layout.tp and layout.tp % kv:
            raise _fail(f"{kv} KV heads are neither a multiple nor a divisor of tp="
                        f"{layout.tp}", {"kv_heads": kv, "tp": layout.tp},
                        f"tp dividing {kv} or a multiple of it dividing {heads}")
        inter = spec.attr("intermediate_size", "n_inner", "ffn_dim")
        if isinstance(inter, int) and inter % layout.tp:
            raise _fail(f"the MLP's {inter} features do not divide between {layout.tp} ranks",
                        {"intermediate_size": inter, "tp": layout.tp},
                        "a tp dividing the MLP size")
