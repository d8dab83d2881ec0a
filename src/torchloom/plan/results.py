"""What a prediction holds: per-rank :class:`Memory` and :class:`Time`, the collectives
(:class:`CollectiveTotal`), one :class:`RolePrediction` per pipeline rank, and the
:class:`Prediction` of the step (throughput, MFU, HFU, headroom). Made by
:func:`torchloom.plan.predict`.

>>> Memory(1, 1, 2, 0, 0, 3, 7).to_dict()["peak"]
7
>>> Memory(1, 1, 2, 0, 0, 3, 7, reserved=8).reserved, Memory(1, 1, 2, 0, 0, 3, 7).reserved
(8, 7)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..parallel.layout import Layout
from .profiles import Profile

__all__ = ["CollectiveTotal", "Memory", "Prediction", "RolePrediction", "Time"]


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
        peak: the most the rank's tensors hold at once during a step (allocated).
        reserved: what the device's caching allocator holds at that peak (``peak`` times
            the profile's ``allocator_reserve``; equal to ``peak`` on a CPU): what must
            fit, and what ``torch.cuda.max_memory_reserved()`` reports.
    """

    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    inputs: int
    activations: int
    peak: int
    reserved: int = -1

    def __post_init__(self) -> None:
        if self.reserved < 0:
            object.__setattr__(self, "reserved", self.peak)

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
    """One pipeline rank and the stages it holds (every tensor- and data-parallel rank
    of it is alike): ``stage`` is the pipeline rank (the stage itself with one stage per
    rank), ``layers`` the layers of all its stages.

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
        """The largest per-rank peak as the device's allocator reserves it
        (:attr:`Memory.reserved`): what must fit."""
        return max(r.memory.reserved for r in self.roles)

    @property
    def peak_allocated(self) -> int:
        """The largest per-rank peak of the tensors themselves (:attr:`Memory.peak`)."""
        return max(r.memory.peak for r in self.roles)

    @property
    def tokens_per_s(self) -> float:
        """Training throughput of the whole job."""
        return self.layout.tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Throughput per device: :attr:`tokens_per_s` over the layout's ranks (as
        torchtitan reports TPS/GPU)."""
        return self.tokens_per_s / self.layout.world

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
                "peak_gib": self.peak / 2**30, "peak_allocated": self.peak_allocated,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "budget": self.profile.budget, "headroom": self.headroom,
                "step_time": self.step_time, "tokens_per_s": self.tokens_per_s,
                "flops_per_step": self.flops_per_step,
                "model_flops_per_step": self.model_flops_per_step, "mfu": self.mfu,
                "hfu": self.hfu,
                "roles": [r.to_dict() for r in self.roles], "notes": list(self.notes)}
