"""A :class:`Layout`: how one training step is spread over devices (``torchloom.Layout``).

The one description of a run's parallelism, read by :func:`torchloom.parallelize`, by
``torchloom train``, by the planner and by the tuner. Its dimensions, outermost first, are
the dimensions of the device mesh :func:`~torchloom.parallel.mesh.init_mesh` makes:

* ``pp`` pipeline stages, run by ``pipeline_schedule`` (every schedule
  ``torch.distributed.pipelining`` offers: ``GPipe``, ``1F1B``, ``Interleaved1F1B``,
  ``InterleavedZeroBubble``, ``ZBVZeroBubble``) with ``stages_per_rank`` stages on each
  pipeline rank (default 1 for GPipe and 1F1B, 2 for the others) and the layers after
  which a stage ends (``stage_cuts``; default an even split, :func:`~torchloom.core.rules.even_cuts`);
* ``dp_replicate`` data-parallel replicas and ``dp_shard`` FSDP2 shards: ``dp_shard``
  alone is FSDP (ZeRO-3), ``dp_replicate`` alone is DDP, both above 1 is HSDP (shards
  inside a replica group, replicas across);
* ``cp`` context-parallel ranks: each sequence is split between them (load-balanced
  chunk pairs, :mod:`torchloom.primitives.context_parallel`); they hold the same
  parameters, so gradients are averaged over ``dp_replicate x dp_shard x cp`` and FSDP2
  shards over ``dp_shard x cp`` (torchtitan's layout). With ``dp_shard`` 1 they are DDP
  replicas, unless ``shard_cp``: then FSDP2 shards over the ``cp`` ranks alone (HSDP with
  ``dp_replicate`` > 1), as torchtitan does whenever ``cp`` > 1; ``seq_len`` must be a multiple of
  ``2 cp`` (``2 cp tp`` with sequence parallelism); inside a pipeline, each stage's
  sequences are split over its context-parallel ranks;
* ``ep`` expert-parallel ranks, folded into the data-parallel ones (torchtitan's layout;
  they add no ranks): each group of ``ep`` consecutive data-parallel ranks (inside one
  HSDP replica: ``ep`` divides ``dp_shard``, or ``dp_replicate`` without FSDP2) splits
  every mixture-of-experts module's experts between its ranks and routes each rank's
  tokens to them (:mod:`torchloom.primitives.expert_parallel`); every other weight, and
  the experts across the groups, is data-parallel as before; inside a pipeline, each
  stage's experts are split over the stage's data-parallel ranks; with context
  parallelism, each context-parallel position has its own ep groups;
* ``tp`` tensor-parallel ranks (the schedule's Megatron layout), with ``sp`` sequence
  parallelism between their regions. Tensor-parallel ranks are the innermost (adjacent)
  ranks: the most communication stays on the fastest links.

The step: each data-parallel rank runs ``grad_accum`` x ``n_microbatches`` micro-batches
of ``micro_batch`` sequences of ``seq_len`` tokens (``n_microbatches``: the pipeline's
micro-batches in one schedule step; without a pipeline it multiplies the accumulation
micro-steps), so ``batch_size = dp x grad_accum x n_microbatches x micro_batch``.
Activation checkpointing: the first ``ckpt_ratio`` of each stack of layers
(:func:`~torchloom.core.rules.checkpointed_count`), or ``ac="full"`` (every layer) or
``ac="op"`` (every layer, op-level selective: matrix products and attention are saved,
the cheap element-wise ops recomputed). Precision: the weights, gradients and optimizer
state are ``param_dtype``; ``mixed_precision`` is the compute dtype (autocast, or FSDP2's
``MixedPrecisionPolicy``), ``reduce_dtype`` the dtype gradients are reduced in (default
``param_dtype``).

A Layout checks itself when it is made (:class:`~torchloom.core.errors.LayoutError`,
naming the field, the value and a fix); what depends on the model or the world is checked
by :meth:`Layout.check_world` and by the planner's ``check_model``.

>>> lay = Layout(dp_shard=2, tp=2, pp=2, n_microbatches=4, micro_batch=2, seq_len=128)
>>> lay.world, lay.dp, lay.dp_mode, lay.batch_size, lay.stage_layers(8)
(8, 2, 'fsdp', 16, [4, 4])
>>> lay.describe()
'tp2 pp2(1F1B x4) dp2(fsdp) mb2 ckpt0 fp32'
>>> Layout(dp_replicate=2, dp_shard=2).describe()
'tp1 dp4(hsdp 2x2) mb1 ckpt0 fp32'
>>> lay = Layout(cp=4, shard_cp=True)  # FSDP2 over the context-parallel ranks alone
>>> lay.dp_mode, lay.shards, lay.describe()
('fsdp', 4, 'tp1 cp4 dp1(fsdp over cp) mb1 ckpt0 fp32')
>>> Layout(pp=2, pipeline_schedule="Interleaved1F1B", n_microbatches=4).stages
4
>>> Layout(pp=2, n_microbatches=1)
Traceback (most recent call last):
...
torchloom.core.errors.LayoutError: Layout(...): a pipeline of 2 stages needs at least 2 micro-batches per step
    values: pp=2, n_microbatches=1
    fix: Layout(pp=2, n_microbatches=2)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.errors import LayoutError
from ..core.rules import checkpointed_count, even_cuts
from ..ops.loss import LOSSES
from ..runtime.pipeline import MULTI_STAGE, SCHEDULES, stage_rank

__all__ = ["AC_MODES", "DP_MODES", "DTYPES", "LOSSES", "Layout", "NOTATION", "OPTIMIZERS",
           "PIPELINE_SCHEDULES", "data_parallel", "shards_cp"]

PIPELINE_SCHEDULES = SCHEDULES
"""The pipeline schedules, named as ``torch.distributed.pipelining``'s classes without
``Schedule`` (:data:`torchloom.runtime.pipeline.SCHEDULES`)."""
ZERO_BUBBLE = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that split each backward into its input and its weight part."""
V_SHAPED = frozenset({"ZBVZeroBubble"})
"""Schedules that place stages in a V (rank r holds stages r and 2 pp - 1 - r), with
exactly two stages per rank."""
DP_MODES = ("ddp", "fsdp", "hsdp")
AC_MODES = ("full", "op")
DTYPES = ("fp32", "bf16", "fp16")
#: optimizer name -> states kept per parameter (each of the parameter's dtype and size)
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
_PRIMITIVE = "Layout"
#: what each token of :meth:`Layout.describe` means (``torchloom plan`` prints it)
NOTATION = (
    ("tpN[+sp]", "N tensor-parallel ranks; +sp: sequence parallelism between their regions"),
    ("cpN", "N context-parallel ranks: each sequence split between them"),
    ("epN", "N expert-parallel ranks (of the data-parallel ones): each holds 1/N of every "
            "mixture-of-experts module's experts"),
    ("ppN(S xM[ vV])", "N pipeline ranks run by schedule S over M micro-batches per step; "
                       "vV: V stages per rank"),
    ("accumN", "N gradient-accumulation micro-steps per optimizer step"),
    ("dpN(ddp|fsdp|hsdp RxS)", "N data-parallel ranks: DDP replicas, FSDP2 shards, or "
                               "HSDP (R replicas of S shards)"),
    ("mbN", "N sequences per micro-batch (per rank; batch = dp x micro-steps x mb)"),
    ("ckptR|acfull|acop", "share R of the layers (the first ones) checkpointed; acfull: "
                          "every layer; acop: every layer, op-level selective"),
    ("P[/C]", "P: the dtype of the weights, gradients and optimizer state; /C: the compute "
              "dtype (autocast or FSDP2's policy); without it the layers compute in P"),
    ("loss:M", "the loss when not chunked (the default): full (the model's own, full "
               "logits) or parallel (vocabulary-sharded, fp32)"),
    ("+compile +fp8 +asynctp", "torch.compile of each layer; Float8 linear layers "
                               "(torchao); asynchronous tensor parallelism"),
)


def _fail(problem: str, values: dict[str, Any], fix: str) -> LayoutError:
    return LayoutError(problem, primitive=_PRIMITIVE, values=values, fix=fix)


def data_parallel(dp: int, mode: str) -> dict[str, int]:
    """The ``dp_replicate`` / ``dp_shard`` fields of ``dp`` data-parallel ranks in
    ``mode`` ``"ddp"`` or ``"fsdp"`` (the command line's ``--dp N --dp-mode M``).

    >>> data_parallel(4, "fsdp"), data_parallel(2, "ddp")
    ({'dp_replicate': 1, 'dp_shard': 4}, {'dp_replicate': 2, 'dp_shard': 1})
    """
    if mode not in ("ddp", "fsdp"):
        raise _fail(f"unknown data-parallel mode {mode!r}", {"dp_mode": mode},
                    "--dp-mode ddp or --dp-mode fsdp (HSDP: --dp-replicate R --dp-shard S)")
    return {"dp_replicate": dp, "dp_shard": 1} if mode == "ddp" else \
        {"dp_replicate": 1, "dp_shard": dp}


def shards_cp(dp_mode: str | None, cp: int) -> bool:
    """Whether the command line's ``--dp-mode`` beside ``--cp`` shards over the
    context-parallel ranks too (:attr:`Layout.shard_cp`): FSDP2 and HSDP do, also with one
    data-parallel rank; DDP does not.

    >>> shards_cp("fsdp", 8), shards_cp("hsdp", 2), shards_cp("ddp", 8), shards_cp("fsdp", 1)
    (True, True, False, False)
    """
    return cp > 1 and dp_mode in ("fsdp", "hsdp")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One layout (see the module docstring). Frozen; checked when made."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = False
    cp: int = 1
    shard_cp: bool = False
    """FSDP2 over the context-parallel ranks when ``dp_shard`` is 1 (instead of DDP);
    with ``dp_shard`` > 1 FSDP2 shards over ``dp_shard x cp`` anyway."""
    ep: int = 1
    pp: int = 1
    pipeline_schedule: str = "1F1B"
    stages_per_rank: int | None = None
    """Stages per pipeline rank; None: 2 for the multi-stage schedules, else 1."""
    stage_cuts: tuple[int, ...] | None = None
    """Layers (0-based, of the stack) after which a stage ends; None: an even split."""
    n_microbatches: int = 1
    grad_accum: int = 1
    micro_batch: int = 1
    seq_len: int = 128
    ckpt_ratio: float = 0.0
    ac: str | None = None
    """None (``ckpt_ratio`` decides), ``"full"`` or ``"op"``."""
    compile: bool = False
    """``torch.compile`` each layer of the stacks."""
    loss: str = "chunked"
    """How the cross-entropy is computed: one of :data:`LOSSES`."""
    float8: bool = False
    """Float8 matmuls in the layers' linear layers (torchao's float8 training; CUDA)."""
    async_tp: bool = False
    """Asynchronous tensor parallelism (compiled layers overlap the sequence-parallel
    collectives with their matmuls; CUDA, needs ``sp`` and ``compile``)."""
    param_dtype: str = "fp32"
    mixed_precision: str | None = None
    reduce_dtype: str | None = None
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.stage_cuts is not None and not isinstance(self.stage_cuts, tuple):
            object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))
        self.check()

    # ---- derived

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the weights (over ``dp_shard x cp`` ranks): ``dp_shard`` > 1,
        or ``shard_cp`` with ``cp`` > 1."""
        return self.dp_shard > 1 or (self.shard_cp and self.cp > 1)

    @property
    def shards(self) -> int:
        """The ranks FSDP2 shards each weight over (``dp_shard x cp``; 1 without FSDP2)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def dp_mode(self) -> str:
        """``"hsdp"``, ``"fsdp"`` or ``"ddp"`` (also for one data-parallel rank)."""
        if self.fsdp:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp"

    @property
    def world(self) -> int:
        """Ranks: ``pp * dp_replicate * dp_shard * cp * tp`` (``ep`` reuses the
        data-parallel ones)."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def stages(self) -> int:
        """Pipeline stages: ``pp * stages_per_rank``."""
        return self.pp * self.per_rank

    @property
    def per_rank(self) -> int:
        """Stages per pipeline rank (``stages_per_rank`` or the schedule's default)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.pp > 1 and self.pipeline_schedule in MULTI_STAGE else 1

    @property
    def micro_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.n_microbatches * self.grad_accum

    @property
    def batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.dp * self.micro_steps * self.micro_batch

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.batch_size * self.seq_len

    @property
    def compute_dtype(self) -> str:
        """The dtype the layers compute in."""
        return self.mixed_precision or self.param_dtype

    @property
    def checkpoint_ratio(self) -> float:
        """The share of each stack's layers checkpointed (1 under ``ac``)."""
        return 1.0 if self.ac is not None else float(self.ckpt_ratio)

    def replace(self, **changes: Any) -> Layout:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def cuts(self, num_layers: int) -> list[int]:
        """The layers after which a stage ends (``stage_cuts``, or an even split)."""
        if self.stage_cuts is not None:
            return list(self.stage_cuts)
        return even_cuts(num_layers, self.stages)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage."""
        bounds = [-1, *self.cuts(num_layers), num_layers - 1]
        return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]

    def checkpointed(self, num_layers: int) -> int:
        """How many layers (the first ones) of a stack of ``num_layers`` are
        checkpointed (:func:`~torchloom.core.rules.checkpointed_count`)."""
        return checkpointed_count(self.checkpoint_ratio, num_layers)

    def stage_ranks(self) -> list[int]:
        """The pipeline rank of each stage: stage ``k`` on rank ``k mod pp`` (looped), or
        in a V for ZBVZeroBubble.

        >>> Layout(pp=2, pipeline_schedule="ZBVZeroBubble", n_microbatches=4).stage_ranks()
        [0, 1, 1, 0]
        """
        return [stage_rank(k, self.pp, self.pipeline_schedule) for k in range(self.stages)]

    def describe(self) -> str:
        """A one-line name of the layout (its tokens: :data:`NOTATION`)."""
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            virtual = f" v{self.per_rank}" if self.per_rank > 1 else ""
            parts.append(f"pp{self.pp}({self.pipeline_schedule} x{self.micro_steps}{virtual})")
        elif self.micro_steps > 1:
            parts.append(f"accum{self.micro_steps}")
        mode = (f"hsdp {self.dp_replicate}x{self.dp_shard}" if self.dp_mode == "hsdp"
                else self.dp_mode) + (" over cp" if self.dp_shard == 1 and self.fsdp else "")
        parts.append(f"dp{self.dp}({mode})")
        parts.append(f"mb{self.micro_batch}")
        parts.append(f"ac{self.ac}" if self.ac else f"ckpt{self.ckpt_ratio:g}")
        parts.append(self.param_dtype + (f"/{self.mixed_precision}" if self.mixed_precision
                                         else ""))
        if self.loss != "chunked":
            parts.append(f"loss:{self.loss}")
        extras = [name for name, on in (("compile", self.compile), ("fp8", self.float8),
                                        ("asynctp", self.async_tp)) if on]
        return " ".join(parts) + "".join(f" +{e}" for e in extras)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (JSON-ready)."""
        out = dataclasses.asdict(self)
        out["stage_cuts"] = list(self.stage_cuts) if self.stage_cuts is not None else None
        return out

    # ---- checks

    def _check_ep(self) -> None:
        inside, name = ((self.dp_shard, "dp_shard") if self.dp_shard > 1
                        else (self.dp_replicate, "dp_replicate"))
        if inside % self.ep:
            divisors = [d for d in range(2, inside + 1) if inside % d == 0]
            fix = (f"Layout({name}={inside}, ep={divisors[-1]})" if divisors else
                   f"Layout({name}={self.ep}, ep={self.ep})")
            replica = ", inside one HSDP replica" if self.dp_mode == "hsdp" else ""
            raise _fail(f"ep={self.ep} expert-parallel ranks are data-parallel ranks (of "
                        f"{name} = {inside}{replica}), and they do not divide them",
                        {"ep": self.ep, "dp_replicate": self.dp_replicate,
                         "dp_shard": self.dp_shard},
                        f"{fix}, or {name} a multiple of {self.ep}")

    def _check_shard_cp(self) -> None:
        if not isinstance(self.shard_cp, bool):
            raise _fail("shard_cp is True or False", {"shard_cp": self.shard_cp},
                        "Layout(cp=2, shard_cp=True)")
        if self.cp == 1:
            raise _fail("shard_cp shards the weights over the context-parallel ranks; it "
                        "needs cp > 1", {"shard_cp": True, "cp": 1},
                        "Layout(cp=2, shard_cp=True), or dp_shard=N for FSDP2 over "
                        "data-parallel ranks")
        if self.ep > 1 and self.dp_shard == 1:
            raise _fail("expert parallelism folds into the data-parallel ranks; with "
                        "FSDP2 over the context-parallel ranks alone (shard_cp, dp_shard 1) "
                        "it is not supported", {"shard_cp": True, "dp_shard": 1, "ep": self.ep,
                                                "cp": self.cp},
                        f"Layout(dp_shard={self.ep}, cp={self.cp}, ep={self.ep}), or "
                        "shard_cp=False (DDP over the context-parallel ranks)")

    def _check_cp(self) -> None:
        unit = 2 * self.cp * (self.tp if self.sp else 1)
        if self.seq_len % unit:
            what = f"2 x cp x tp = {unit}" if self.sp and self.tp > 1 else f"2 x cp = {unit}"
            raise _fail(f"context parallelism cuts each sequence of {self.seq_len} tokens into "
                        f"{2 * self.cp} equal chunks"
                        + (" split again by sequence parallelism" if unit > 2 * self.cp else "")
                        + f": seq_len must be a multiple of {what}",
                        {"seq_len": self.seq_len, "cp": self.cp, "tp": self.tp, "sp": self.sp},
                        f"seq_len={-(-self.seq_len // unit) * unit}")

    def check(self) -> None:
        """Refuse values that contradict each other (see the module docstring)."""
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "ep", "pp", "n_microbatches",
                     "grad_accum", "micro_batch", "seq_len"):
            value = getattr(self, name)
            if not _positive(value):
                raise _fail(f"{name} must be a positive integer", {name: value},
                            f"Layout({name}=1)")
        if self.ep > 1:
            self._check_ep()
        if self.cp > 1:
            self._check_cp()
        if self.shard_cp:
            self._check_shard_cp()
        if not isinstance(self.ckpt_ratio, (int, float)) or isinstance(self.ckpt_ratio, bool) \
                or not 0 <= self.ckpt_ratio <= 1:
            raise _fail("ckpt_ratio must be a number between 0 and 1 (the share of layers "
                        "that recompute their activations)", {"ckpt_ratio": self.ckpt_ratio},
                        "Layout(ckpt_ratio=0.5)")
        if self.ac is not None and self.ac not in AC_MODES:
            raise _fail(f"unknown activation checkpointing {self.ac!r}",
                        {"ac": self.ac, "modes": list(AC_MODES)},
                        "Layout(ac='full') or Layout(ac='op'), or ckpt_ratio=R")
        if self.ac is not None and self.ckpt_ratio not in (0, 1):
            raise _fail(f"ac={self.ac!r} checkpoints every layer; ckpt_ratio="
                        f"{self.ckpt_ratio} asks for a share of them",
                        {"ac": self.ac, "ckpt_ratio": self.ckpt_ratio},
                        f"Layout(ac={self.ac!r}) or Layout(ckpt_ratio={self.ckpt_ratio})")
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
        self._check_pipeline()
        for name in ("param_dtype",):
            if getattr(self, name) not in DTYPES:
                raise _fail(f"unknown {name} {getattr(self, name)!r}",
                            {name: getattr(self, name), "dtypes": list(DTYPES)},
                            f"Layout({name}='fp32')")
        for name in ("mixed_precision", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise _fail(f"{name} is a dtype of {', '.join(DTYPES)} (or None), not "
                            f"{value!r}", {name: value},
                            f"Layout(param_dtype='fp32', {name}='bf16')")
        if self.loss not in LOSSES:
            raise _fail(f"unknown loss {self.loss!r}", {"loss": self.loss,
                                                       "losses": list(LOSSES)},
                        "Layout(loss='chunked'), 'parallel' or 'full'")
        if self.loss == "parallel" and self.tp == 1:
            raise _fail("loss='parallel' shards the logits over the tensor-parallel ranks; "
                        "it needs tp > 1", {"loss": "parallel", "tp": 1},
                        "Layout(tp=2, loss='parallel'), or loss='chunked' (the default)")
        if self.async_tp and not (self.tp > 1 and self.sp and self.compile):
            raise _fail("async_tp overlaps the sequence-parallel collectives inside compiled "
                        "layers: it needs tp > 1, sp and compile",
                        {"async_tp": True, "tp": self.tp, "sp": self.sp,
                         "compile": self.compile},
                        f"Layout(tp={max(2, self.tp)}, sp=True, compile=True, async_tp=True)")
        if self.optimizer not in OPTIMIZERS:
            raise _fail(f"unknown optimizer {self.optimizer!r}",
                        {"optimizer": self.optimizer, "optimizers": list(OPTIMIZERS)},
                        "Layout(optimizer='adamw')")

    def _check_pipeline(self) -> None:
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise _fail(f"unknown pipeline schedule {self.pipeline_schedule!r}",
                        {"pipeline_schedule": self.pipeline_schedule,
                         "schedules": list(PIPELINE_SCHEDULES)},
                        "Layout(pipeline_schedule='1F1B')")
        if self.stages_per_rank is not None and not _positive(self.stages_per_rank):
            raise _fail("stages_per_rank must be a positive integer",
                        {"stages_per_rank": self.stages_per_rank},
                        "Layout(stages_per_rank=2), or None for the schedule's default")
        multi = self.pipeline_schedule in MULTI_STAGE
        if self.pp > 1 and not multi and self.per_rank != 1:
            raise _fail(f"{self.pipeline_schedule} runs one stage per rank, not "
                        f"{self.per_rank}", {"pipeline_schedule": self.pipeline_schedule,
                                             "stages_per_rank": self.per_rank},
                        f"Layout(stages_per_rank=1), or Layout(pipeline_schedule="
                        f"'Interleaved1F1B', stages_per_rank={self.per_rank})")
        if self.pp > 1 and self.pipeline_schedule in V_SHAPED and self.per_rank != 2:
            raise _fail(f"{self.pipeline_schedule} places two stages on each rank, in a V; "
                        f"not {self.per_rank}", {"stages_per_rank": self.per_rank},
                        "Layout(pipeline_schedule='ZBVZeroBubble', stages_per_rank=2)")
        if self.pp > 1 and self.fsdp and self.pipeline_schedule in ZERO_BUBBLE:
            raise _fail(f"{self.pipeline_schedule} with FSDP2 loses weight gradients: its "
                        "split backward computes a stage's weight gradients after a later "
                        "forward of the stage has resharded its layers, and those gradients "
                        "are never reduce-scattered (measured with torch 2.13: the loss "
                        "after one step differs from DDP's and from Interleaved1F1B's)",
                        {"pipeline_schedule": self.pipeline_schedule, "pp": self.pp,
                         "dp_shard": self.dp_shard, "shard_cp": self.shard_cp},
                        "Layout(pipeline_schedule='Interleaved1F1B') with FSDP2, or "
                        f"{self.pipeline_schedule} with DDP (dp_replicate=N, dp_shard=1)")
        if self.pp > 1 and self.micro_steps < self.pp:
            raise _fail(f"a pipeline of {self.pp} stages needs at least {self.pp} "
                        "micro-batches per step",
                        {"pp": self.pp, "n_microbatches": self.n_microbatches},
                        f"Layout(pp={self.pp}, n_microbatches={self.pp})")
        steps = self.micro_steps
        rounds = max(1, steps // self.pp)
        if self.pp > 1 and self.pipeline_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") \
                and steps % rounds:
            # the schedule runs its micro-batches in rounds of pp
            good = [n for n in range(self.pp, 4 * self.pp + 1) if n % max(1, n // self.pp) == 0]
            raise _fail(f"{self.pipeline_schedule} runs the micro-batches in "
                        f"micro-batches // pp = {rounds} rounds, which must divide them: "
                        f"{steps} micro-batches", {"pp": self.pp, "micro_batches": steps},
                        f"Layout(n_microbatches={next(n for n in good if n >= steps)}), or "
                        "any multiple of pp")
        if self.pp > 1 and self.pipeline_schedule in V_SHAPED and steps < self.stages:
            # fewer, and torch's ZBVZeroBubble schedules micro-batches that do not exist
            raise _fail(f"{self.pipeline_schedule} needs at least as many micro-batches as "
                        f"stages ({self.stages}), not {steps}",
                        {"pp": self.pp, "stages": self.stages, "micro_batches": steps},
                        f"Layout(pp={self.pp}, n_microbatches={self.stages})")
        if self.pp == 1 and self.stages_per_rank not in (None, 1):
            raise _fail("stages_per_rank is for a pipeline (pp > 1)",
                        {"pp": 1, "stages_per_rank": self.stages_per_rank},
                        "Layout(pp=2, pipeline_schedule='Interleaved1F1B', stages_per_rank=2)")
        if self.stage_cuts is not None:
            cuts = list(self.stage_cuts)
            if len(cuts) != self.stages - 1 or cuts != sorted(set(cuts)) or \
                    any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in cuts):
                raise _fail(f"stage_cuts lists the {self.stages - 1} layer(s) after which a "
                            "stage ends, increasing", {"stage_cuts": cuts,
                                                       "stages": self.stages},
                            "stage_cuts=None (an even split), or e.g. stage_cuts=(3,) for "
                            "two stages of 8 layers")

    def check_world(self, world: int) -> None:
        """Refuse a layout whose degrees do not multiply to ``world`` ranks."""
        if self.world != world:
            other = self.world // self.dp
            hint = (f"dp_shard={world // other}" if world % other == 0
                    else f"degrees whose product is {world}")
            raise _fail(f"the layout's degrees pp x dp_replicate x dp_shard x cp x tp = "
                        f"{self.pp} x {self.dp_replicate} x {self.dp_shard} x {self.cp} x "
                        f"{self.tp} = {self.world} do not multiply to the {world} ranks",
                        {"world_size": world, "layout": self.describe()}, hint)

    def check_layers(self, num_layers: int) -> None:
        """Refuse stage cuts that leave a stage without a layer, or an even split that does
        not divide the ``num_layers`` layers (pass ``stage_cuts`` for an uneven one)."""
        if self.stages == 1:
            return
        if self.stage_cuts is None and num_layers % self.stages:
            options = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
            raise _fail(f"{num_layers} layers do not split evenly into {self.stages} stages",
                        {"layers": num_layers, "stages": self.stages},
                        f"pp x stages_per_rank in {options}, or stage_cuts=... for an uneven "
                        "split")
        cuts = self.cuts(num_layers)
        if num_layers < self.stages or (cuts and cuts[-1] >= num_layers - 1):
            raise _fail(f"a stage would have no layer: {self.stages} stages, cuts {cuts}, "
                        f"{num_layers} layers", {"stage_cuts": cuts, "layers": num_layers},
                        f"at most {num_layers} stages, cuts before layer {num_layers - 1}")
