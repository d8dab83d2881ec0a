"""The notes a prediction carries (:attr:`~torchloom.plan.results.Prediction.notes`): what
the planner assumes of how the layout runs, one sentence each.

>>> from torchloom.plan import Layout
>>> from torchloom.plan.units import UnitKey, Units
>>> units = Units(UnitKey(fsdp=2, mixed_precision="bf16"), {}, {}, 0, {}, {}, {}, {}, 0, 0, 0)
>>> layout_notes(Layout(dp_shard=2, mixed_precision="bf16"), units)[0]
'FSDP2 MixedPrecisionPolicy: all-gathers and compute in bf16, gradients reduced in fp32'
"""

from __future__ import annotations

from .layout import Layout
from .pipeline import bubble_share
from .units import Units

__all__ = ["layout_notes"]


def layout_notes(layout: Layout, units: Units) -> tuple[str, ...]:
    """What a prediction of ``layout`` (measured as ``units``) assumes about how it runs,
    in sentences: FSDP2's mixed precision and gradient accumulation, HSDP, context and
    expert parallelism, the interleaved schedules."""
    notes = []
    fsdp = units.key.sharded
    n = layout.micro_steps
    if units.key.mixed_precision and fsdp:
        reduce = layout.reduce_dtype or layout.param_dtype
        notes.append("FSDP2 MixedPrecisionPolicy: all-gathers and compute in "
                     f"{units.key.mixed_precision}, gradients reduced in {reduce}")
    if fsdp and n > 1 and layout.pp == 1:
        notes.append("FSDP2 with gradient accumulation: reduce-scatters on the last "
                     "micro-step only (as torchloom train runs it) and keeps unsharded "
                     "gradients between")
    if fsdp and layout.pp > 1:
        notes.append("FSDP2 under a pipeline: a stage's parameters stay unsharded from its "
                     "first backward and its gradients accumulate unsharded until the "
                     "step's end (torch.distributed.pipelining), then reduce-scatter once")
    if layout.dp_mode == "hsdp":
        notes.append(f"HSDP: sharded over {layout.dp_shard * layout.cp} ranks, gradients "
                     f"all-reduced across {layout.dp_replicate} replicas")
    if layout.cp > 1:
        shard = (f"FSDP2 shards over dp_shard x cp = {layout.dp_shard * layout.cp} ranks"
                 if layout.fsdp else f"DDP over dp x cp = {layout.dp * layout.cp}")
        notes.append(f"context parallelism: {layout.seq_len // layout.cp} of "
                     f"{layout.seq_len} tokens per rank; each layer all-gathers K and V "
                     f"over {layout.cp} ranks (not overlapped with compute); {shard}")
    if layout.ep > 1:
        outside = "the layers' FSDP2 units" if fsdp else "DDP"
        share = layout.dp * layout.cp // layout.ep
        held = ("every rank holds its experts alone" if share == 1 else
                f"the experts FSDP2-sharded over the {share} ranks holding the same ones"
                if units.extra.get("experts_sharded") else
                f"expert gradients all-reduced over the {share} ranks holding the same ones")
        notes.append(f"expert parallelism: E / {layout.ep} experts per rank, outside "
                     f"{outside}; tokens dispatched by all-to-all over {layout.ep} ranks "
                     f"(in line), the busiest receiving {units.key.imbalance:g} x the "
                     f"average; {held}")
    if layout.pp > 1 and layout.per_rank > 1:
        notes.append(f"{layout.pipeline_schedule}: {layout.per_rank} stages per rank; "
                     "the bubble is "
                     f"{bubble_share(layout.pipeline_schedule, layout.per_rank):.2g} of "
                     "1F1B's")
    return tuple(notes)
