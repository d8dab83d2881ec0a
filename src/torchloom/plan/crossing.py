"""What a pipeline sends over a stage boundary, for the planner
(:func:`torchloom.plan.predict` times the sends and sizes the receive buffers from it):
the model shortened to three layers on meta, split at two cuts on fake values.

>>> from torchloom.plan import model_spec
>>> from torchloom.plan.units import UnitKey
>>> c = crossing(model_spec("llama", seq_len=16), UnitKey(micro_batch=2, seq_len=16))
>>> c.first == c.middle, c.forward_bytes(0) >= c.backward_bytes(0) > 0
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.causal_mask import unpacked_sequences
from .opcost import grouped_mm_on_fake
from .spec import DTYPES, ModelSpec
from .units import ScheduleFn, UnitKey, apply_knobs, fake_params, fake_world

__all__ = ["Crossing", "crossing"]


@dataclass(frozen=True)
class Crossing:
    """What a pipeline sends over one stage boundary per micro-batch.

    Attributes:
        first: from the first stage (after the embedding and its layers): (shape, dtype,
            whether a gradient is sent back for it) per tensor.
        middle: over a boundary between two later stages.
    """

    first: tuple[tuple[tuple[int, ...], str, bool], ...]
    middle: tuple[tuple[tuple[int, ...], str, bool], ...]

    @staticmethod
    def _bytes(items: tuple[tuple[tuple[int, ...], str, bool], ...], floats: bool) -> int:
        total = 0
        for shape, dtype, is_float in items:
            if floats and not is_float:
                continue
            n = 1
            for s in shape:
                n *= s
            total += n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        return total

    def forward_bytes(self, boundary: int) -> int:
        """Bytes sent forward over boundary ``boundary`` (0: after the first stage)."""
        return self._bytes(self.first if boundary == 0 else self.middle, False)

    def backward_bytes(self, boundary: int) -> int:
        """Bytes of the gradients sent back over it (for the tensors that need one)."""
        return self._bytes(self.first if boundary == 0 else self.middle, True)


def crossing(spec: ModelSpec, key: UnitKey, schedule: ScheduleFn | None = None,
             positions: bool = False) -> Crossing:
    """The tensors that cross a stage boundary (see :class:`Crossing`): a 3-layer model
    on meta, scheduled like the measurement, traced to its layers, cut after layers 0 and
    1 and split on fake values; in the compute dtype where FSDP2's mixed precision makes
    the stages compute in it (``torchloom.parallelize`` sends them so). ``positions``: the
    model takes each micro-batch's ``position_ids`` too, as a context-parallel pipeline
    gives them (this rank's positions; what the stages derive from them then has the
    micro-batch's rows)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..core.schedule import create_schedule
    from ..runtime.parallel import init_mesh
    from ..runtime.pipeline_split import split_stages

    with fake_world(key.tp), grouped_mm_on_fake():
        mesh = init_mesh(tp=key.tp, device_type="cpu")
        model = spec.build(depth=3, dtype=DTYPES[key.param_dtype])
        sch = create_schedule(model, group=mesh["tp"].get_group() if key.tp > 1 else None)
        knobs: dict[str, Any] = {}
        if key.tp > 1:
            knobs["tp"] = True
        if key.sp:
            knobs["sequence_parallel"] = True
        apply_knobs(sch, spec, knobs, schedule)
        shape = (key.micro_batch, key.seq_len)
        example = {"input_ids": torch.zeros(shape, dtype=torch.long)}
        if positions:
            example["position_ids"] = torch.arange(key.seq_len).expand(shape).contiguous()
        with unpacked_sequences():  # as parallelize traces a pipeline
            sch.trace_until(f"{spec.layers}.*", example_inputs=example)
        sch[f"{spec.layers}.0"].cut_pipeline_stage()
        sch[f"{spec.layers}.1"].cut_pipeline_stage()
        mixed = key.sharded and key.mixed_precision not in (None, key.param_dtype)
        send = DTYPES[key.mixed_precision] if mixed and key.mixed_precision else None
        stages = split_stages(sch, dict(example) if positions else (example["input_ids"],),
                              send)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for stage in stages.modules:
            fake_params(stage, mode)
        with mode:
            inputs = {"input_ids": torch.zeros(shape, dtype=torch.long)}
            if positions:
                inputs["position_ids"] = torch.arange(key.seq_len).expand(shape).contiguous()
            first = stages.modules[0](**inputs)
            # what the next stage receives: a leaf that needs a gradient where the sent
            # tensor needs one (the runtime sizes its buffers from the sent tensors)
            # (in the parameters' dtype: the stages here compute in it, no FSDP2 casts)
            received = [(t.detach().to(DTYPES[key.param_dtype]) if t.is_floating_point() else t.detach())
                        .requires_grad_(t.requires_grad) for t in first]
            second = stages.modules[1](*received)

    def describe(values: Any) -> tuple[tuple[tuple[int, ...], str, bool], ...]:
        # (shape, dtype, whether a gradient comes back for it)
        return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."),
                      bool(t.requires_grad)) for t in values if isinstance(t, torch.Tensor))

    return Crossing(describe(first), describe(second))
