"""The knobs of the built-in schedules, checked once, when they are made.

Every built-in schedule takes a :class:`ScheduleConfig`; :func:`torchloom.schedules.apply_schedule`
makes one from keyword knobs. A value no schedule can use (a negative ratio, an unknown
attention kernel, sequence parallelism without tensor parallelism) is refused here, before
any primitive is applied; what depends on the model (sizes the degree must divide) is
checked by the schedule itself.

>>> ScheduleConfig(tp=2, sequence_parallel=True, ckpt_ratio=0.5)
ScheduleConfig(tp=2, sequence_parallel=True, ckpt_ratio=0.5, compile=False, attention='model', fused=False, vocab_parallel=True, loss_parallel=False)
>>> ScheduleConfig(ckpt_ratio=2)
Traceback (most recent call last):
torchloom.core.errors.ScheduleConfigError: schedules.apply_schedule(...): ckpt_ratio must be a number from 0 to 1, not 2
    values: ckpt_ratio=2
    fix: apply_schedule(sch, ckpt_ratio=0.5) checkpoints the first half of the layers
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import ScheduleConfigError

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["ATTENTION", "KNOBS", "ScheduleConfig", "ScheduleConfigError"]

ATTENTION = ("model", "sdpa")  # the attention kernel choices of GPT-2 and BERT
_PRIMITIVE = "schedules.apply_schedule"


@dataclass(frozen=True)
class ScheduleConfig:
    """What a built-in schedule does; each field is a knob of ``apply_schedule``."""

    tp: int = 1
    """Tensor-parallel degree (1: none). It must be the size of the schedule's group, or the
    group is a world of one, where the primitives are recorded and change nothing."""
    sequence_parallel: bool = False
    """Split the activations between tensor-parallel regions along the sequence (needs tp)."""
    ckpt_ratio: float = 0.0
    """Checkpoint the first ``ckpt_ratio`` of each stack of layers (0 to 1)."""
    compile: bool | str = False
    """Compile each layer: True for inductor, or a ``torch.compile`` backend name."""
    attention: str = "model"
    """``"model"`` (the model's own) or ``"sdpa"`` (:mod:`torchloom.ops`; GPT-2 and BERT)."""
    fused: bool = False
    """The fused MLP kernels of :mod:`torchloom.ops` (GPT-2 and BERT; not with tp)."""
    vocab_parallel: bool = True
    """Derived schedules: split the embeddings and the head between the ranks too."""
    loss_parallel: bool = False
    """Split the head (``lm_head``, untied) along the vocabulary and keep its output split:
    each rank's logits hold ``V / tp`` columns, for a vocabulary-parallel loss
    (:mod:`torchloom.ops.loss`; the schedule installs it as the model's
    ``loss_function``). Llama's and the derived schedules; needs tp."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str, str]] = [
            ("tp", type(self.tp) is int and self.tp >= 1, "a positive int (the degree)",
             "apply_schedule(sch, tp=2) for two tensor-parallel ranks"),
            ("sequence_parallel", isinstance(self.sequence_parallel, bool), "True or False",
             "apply_schedule(sch, tp=2, sequence_parallel=True)"),
            ("ckpt_ratio", type(self.ckpt_ratio) in (int, float) and 0 <= self.ckpt_ratio <= 1,
             "a number from 0 to 1",
             "apply_schedule(sch, ckpt_ratio=0.5) checkpoints the first half of the layers"),
            ("compile", isinstance(self.compile, (bool, str)),
             "True, False or a torch.compile backend name", "apply_schedule(sch, compile=True)"),
            ("fused", isinstance(self.fused, bool), "True or False",
             "apply_schedule(sch, fused=True)"),
            ("vocab_parallel", isinstance(self.vocab_parallel, bool), "True or False",
             "apply_schedule(sch, tp=2, vocab_parallel=False)"),
            ("loss_parallel", isinstance(self.loss_parallel, bool), "True or False",
             "apply_schedule(sch, tp=2, loss_parallel=True)"),
        ]
        for name, ok, what, fix in checks:
            if not ok:
                value = getattr(self, name)
                raise ScheduleConfigError(f"{name} must be {what}, not {value!r}",
                                          primitive=_PRIMITIVE, values={name: value}, fix=fix)
        if self.attention not in ATTENTION:
            raise ScheduleConfigError(
                f"unknown attention kernel {self.attention!r}", primitive=_PRIMITIVE,
                values={"attention": self.attention, "choices": list(ATTENTION)},
                fix="attention='sdpa' (torchloom.ops) or attention='model' (keep the model's)")
        if self.sequence_parallel and self.tp == 1:
            raise ScheduleConfigError(
                "sequence parallelism splits the activations between tensor-parallel regions; "
                "it needs tp=True (a degree above 1)", primitive=_PRIMITIVE, values={"sequence_parallel": True, "tp": 1},
                fix="apply_schedule(sch, tp=True, sequence_parallel=True)")
        if self.loss_parallel and self.tp == 1:
            raise ScheduleConfigError(
                "loss parallelism splits the logits between tensor-parallel ranks; it needs "
                "tp=True (a degree above 1)", primitive=_PRIMITIVE,
                values={"loss_parallel": True, "tp": 1},
                fix="apply_schedule(sch, tp=True, loss_parallel=True)")
        if self.fused and self.tp > 1:
            raise ScheduleConfigError(
                "the fused blocks compute their projections without calling the projection "
                "modules, so tensor parallelism's sync hooks on those modules would not run",
                primitive=_PRIMITIVE, values={"fused": True, "tp": self.tp},
                fix="apply_schedule(sch, tp=True, compile=True) fuses inside each layer and "
                "keeps the hooks")

    @classmethod
    def of(cls, sch: Schedule, **knobs: Any) -> ScheduleConfig:
        """A config from keyword knobs, where ``tp=True`` means the size of ``sch``'s group
        (2 in a world of one, so that the primitives are recorded) and ``tp=False`` none."""
        tp = knobs.get("tp", 1)
        if isinstance(tp, bool):
            knobs["tp"] = max(sch.world_size, 2) if tp else 1
        return cls(**knobs)

    def tp_over(self, sch: Schedule) -> bool:
        """Whether to apply tensor parallelism over ``sch``'s group; refuses a degree that
        is not the group's size."""
        if self.tp > 1 and sch.world_size not in (1, self.tp):
            raise ScheduleConfigError(
                f"tp={self.tp}, and the schedule's tensor-parallel group has "
                f"{sch.world_size} ranks", path=sch.path, primitive=_PRIMITIVE,
                values={"tp": self.tp, "group_size": sch.world_size},
                fix=f"apply_schedule(sch, tp={sch.world_size}), or make the schedule over a "
                f"group of {self.tp}: tl.create_schedule(model, group=...)")
        return self.tp > 1

    def changed(self) -> dict[str, Any]:
        """The knobs that differ from their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


#: The knob names, in the order error messages list them.
KNOBS = tuple(f.name for f in dataclasses.fields(ScheduleConfig))
