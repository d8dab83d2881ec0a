"""A layout: how a training step is spread over devices, and what each device runs.

A :class:`Layout` holds the degrees of parallelism and the schedule knobs of one step:

* ``tp`` tensor-parallel ranks (the built-in schedule's Megatron layout), with ``sp``
  sequence parallelism between its regions;
* ``pp`` pipeline stages (``stage_cuts``: the layers after which a stage ends, default
  an even split), run by ``pipeline_schedule`` (``"GPipe"`` or ``"1F1B"``) over
  ``n_microbatches`` micro-batches;
* ``dp`` data-parallel replicas, ``dp_mode`` ``"ddp"`` (replicas) or ``"fsdp"`` (FSDP2:
  every layer and the root sharded);
* ``ckpt_ratio``: the share of layers (the first ones) that recompute their activations;
* ``micro_batch`` sequences of ``seq_len`` tokens per micro-batch; without a pipeline
  ``n_microbatches`` is the number of gradient-accumulation micro-steps;
* ``param_dtype`` of the weights (and gradients and optimizer state), and
  ``mixed_precision``: the compute dtype of bf16/fp16 autocast (DDP) or of FSDP2's
  ``MixedPrecisionPolicy`` (all-gathered in it, gradients reduced in ``param_dtype``);
* ``optimizer``: ``"adamw"`` / ``"adam"`` (two states per parameter), ``"sgd-momentum"``
  (one), ``"sgd"`` (none).

The ranks are laid out as ``torchloom.runtime.parallel.init_mesh`` does: a ``(pp, dp, tp)`` mesh,
tensor-parallel ranks adjacent. ``batch_size = dp * n_microbatches * micro_batch``
sequences per optimizer step.

:meth:`Layout.check` refuses a layout that contradicts itself; what depends on the model
(heads, layers) is checked by :func:`check_model`.

>>> lay = Layout(tp=2, pp=2, dp=2, n_microbatches=4, micro_batch=2, seq_len=128)
>>> lay.world, lay.batch_size, lay.stage_layers(8)
(8, 16, [4, 4])
>>> lay.describe()
'tp2 pp2(1F1B x4) dp2(ddp) mb2 ckpt0 fp32'
>>> Layout(pp=2, n_microbatches=1)
Traceback (most recent call last):
...
torchloom.core.errors.PlanError: plan(...): a pipeline of 2 stages needs at least 2 micro-batches per step
    values: pp=2, n_microbatches=1
    fix: Layout(pp=2, n_microbatches=2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.errors import PlanError
from ..core.rules import checkpointed_count, even_cuts
from .spec import DTYPES, ModelSpec

__all__ = ["Layout", "OPTIMIZERS", "SCHEDULES", "DP_MODES", "NOTATION", "check_model"]

SCHEDULES = ("GPipe", "1F1B")
DP_MODES = ("ddp", "fsdp")
#: optimizer name -> states kept per parameter (each of the parameter's dtype and size)
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
_PRIMITIVE = "plan"
#: what each token of :meth:`Layout.describe` means (``torchloom plan`` prints it)
NOTATION = (
    ("tpN[+sp]", "N tensor-parallel ranks; +sp: sequence parallelism between their regions"),
    ("ppN(S xM)", "N pipeline stages run by schedule S (GPipe or 1F1B) over M micro-batches "
                  "per step"),
    ("accumN", "N gradient-accumulation micro-steps per optimizer step (no pipeline)"),
    ("dpN(ddp|fsdp)", "N data-parallel ranks: DDP replicas or FSDP2 shards"),
    ("mbN", "N sequences per micro-batch (per rank; batch = dp x micro-batches x mb)"),
    ("ckptR", "share R of the layers (the first ones) checkpointed: their activations are "
              "recomputed in the backward"),
    ("P[/C]", "P: the dtype of the weights, gradients and optimizer state; /C: the compute "
              "dtype of autocast (bf16, fp16); without it the layers compute in P"),
)


def _fail(problem: str, values: dict[str, Any], fix: str) -> PlanError:
    return PlanError(problem, primitive=_PRIMITIVE, values=values, fix=fix)


@dataclass(frozen=True)
class Layout:
    """One layout (see the module docstring)."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    dp: int = 1
    dp_mode: str = "ddp"
    stage_cuts: tuple[int, ...] | None = None
    pipeline_schedule: str = "1F1B"
    n_microbatches: int = 1
    micro_batch: int = 1
    seq_len: int = 128
    ckpt_ratio: float = 0.0
    param_dtype: str = "fp32"
    mixed_precision: str | None = None
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        self.check()

    # ---- derived

    @property
    def world(self) -> int:
        """Ranks: ``tp * pp * dp``."""
        return self.tp * self.pp * self.dp

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.dp * self.n_microbatches * self.micro_batch

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.batch_size * self.seq_len

    @property
    def compute_dtype(self) -> str:
        """The dtype the layers compute in."""
        return self.mixed_precision or self.param_dtype

    def replace(self, **changes: Any) -> Layout:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage."""
        cuts = self.cuts(num_layers)
        bounds = [-1, *cuts, num_layers - 1]
        return [bounds[i + 1] - bounds[i] for i in range(self.pp)]

    def cuts(self, num_layers: int) -> list[int]:
        """The layers after which a stage ends (``stage_cuts``, or an even split)."""
        if self.stage_cuts is not None:
            return list(self.stage_cuts)
        return even_cuts(num_layers, self.pp)

    def checkpointed(self, num_layers: int) -> int:
        """How many layers (the first ones) are checkpointed: what
        ``checkpoint(ratio=...)`` wraps (:func:`~torchloom.core.rules.checkpointed_count`)."""
        return checkpointed_count(self.ckpt_ratio, num_layers)

    def describe(self) -> str:
        """A one-line name of the layout (its tokens: :data:`NOTATION`)."""
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")]
        if self.pp > 1:
            parts.append(f"pp{self.pp}({self.pipeline_schedule} x{self.n_microbatches})")
        elif self.n_microbatches > 1:
            parts.append(f"accum{self.n_microbatches}")
        parts.append(f"dp{self.dp}({self.dp_mode})")
        parts.append(f"mb{self.micro_batch}")
        parts.append(f"ckpt{self.ckpt_ratio:g}")
        parts.append(self.param_dtype + (f"/{self.mixed_precision}" if self.mixed_precision
                                         else ""))
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready)."""
        out = dataclasses.asdict(self)
        out["stage_cuts"] = list(self.stage_cuts) if self.stage_cuts is not None else None
        return out

    # ---- checks

    def check(self) -> None:
        """Refuse values that contradict each other (see the module docstring)."""
        for name in ("tp", "pp", "dp", "n_microbatches", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(f"{name} must be a positive integer", {name: value},
                            f"Layout({name}=1)")
        if not isinstance(self.ckpt_ratio, (int, float)) or not 0 <= self.ckpt_ratio <= 1:
            raise _fail("ckpt_ratio must be a number between 0 and 1 (the share of layers "
                        "that recompute their activations)", {"ckpt_ratio": self.ckpt_ratio},
                        "Layout(ckpt_ratio=0.5)")
        if self.sp and self.tp == 1:
            raise _fail("sequence parallelism splits activations between tensor-parallel "
                        "ranks; it needs tp > 1", {"sp": True, "tp": 1},
                        "Layout(tp=2, sp=True)")
        if self.sp and self.seq_len % self.tp:
            raise _fail(f"sequence parallelism splits the {self.seq_len} positions between "
                        f"{self.tp} ranks, and they do not divide",
                        {"seq_len": self.seq_len, "tp": self.tp},
                        f"a seq_len divisible by {self.tp}, e.g. "
                        f"{-(-self.seq_len // self.tp) * self.tp}")
        if self.dp_mode not in DP_MODES:
            raise _fail(f"unknown data-parallel mode {self.dp_mode!r}",
                        {"dp_mode": self.dp_mode, "modes": list(DP_MODES)},
                        "Layout(dp_mode='fsdp') or Layout(dp_mode='ddp')")
        if self.pipeline_schedule not in SCHEDULES:
            raise _fail(f"the planner models the pipeline schedules {', '.join(SCHEDULES)}, "
                        f"not {self.pipeline_schedule!r}",
                        {"pipeline_schedule": self.pipeline_schedule},
                        "Layout(pipeline_schedule='1F1B')")
        if self.pp > 1 and self.n_microbatches < self.pp:
            raise _fail(f"a pipeline of {self.pp} stages needs at least {self.pp} "
                        "micro-batches per step",
                        {"pp": self.pp, "n_microbatches": self.n_microbatches},
                        f"Layout(pp={self.pp}, n_microbatches={self.pp})")
        if self.pp > 1 and self.dp > 1 and self.dp_mode == "fsdp":
            raise _fail("a pipeline's data-parallel replicas average their gradients "
                        "(as torchloom train does); FSDP2 under a pipeline is not modelled",
                        {"pp": self.pp, "dp": self.dp, "dp_mode": "fsdp"},
                        "Layout(dp_mode='ddp') with pp > 1")
        for name in ("param_dtype",):
            if getattr(self, name) not in DTYPES:
                raise _fail(f"unknown {name} {getattr(self, name)!r}",
                            {name: getattr(self, name), "dtypes": list(DTYPES)},
                            f"Layout({name}='bf16')")
        if self.mixed_precision is not None and self.mixed_precision not in ("bf16", "fp16"):
            raise _fail(f"mixed_precision is the compute dtype of autocast, 'bf16' or "
                        f"'fp16', not {self.mixed_precision!r}",
                        {"mixed_precision": self.mixed_precision},
                        "Layout(param_dtype='fp32', mixed_precision='bf16')")
        if self.optimizer not in OPTIMIZERS:
            raise _fail(f"unknown optimizer {self.optimizer!r}",
                        {"optimizer": self.optimizer, "optimizers": list(OPTIMIZERS)},
                        "Layout(optimizer='adamw')")
        if self.stage_cuts is not None:
            cuts = list(self.stage_cuts)
            if len(cuts) != self.pp - 1 or cuts != sorted(set(cuts)) or \
                    any(not isinstance(c, int) or c < 0 for c in cuts):
                raise _fail(f"stage_cuts lists the {self.pp - 1} layer(s) after which a "
                            "stage ends, increasing", {"stage_cuts": cuts, "pp": self.pp},
                            "stage_cuts=None (an even split), or e.g. stage_cuts=(3,) for "
                            "pp=2 with 8 layers")


def check_model(layout: Layout, spec: ModelSpec) -> None:
    """Refuse a layout the model cannot take: layers that do not split into the stages,
    heads, KV heads and MLP features that tensor parallelism cannot share (the built-in
    schedule's own rules; the schedule checks them again when applied)."""
    layers = spec.num_layers
    cuts = layout.cuts(layers)
    if layout.stage_cuts is None and layers % layout.pp:
        divisors = [d for d in range(1, layers + 1) if layers % d == 0]
        raise _fail(f"{layers} layers do not split evenly into {layout.pp} stages",
                    {"layers": layers, "pp": layout.pp},
                    f"pp in {divisors}, or stage_cuts=... for an uneven split")
    if cuts and cuts[-1] >= layers - 1:
        raise _fail(f"the last stage would have no layer: cut after layer {cuts[-1]} of "
                    f"{layers}", {"stage_cuts": cuts, "layers": layers},
                    f"cut before layer {layers - 1}")
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
