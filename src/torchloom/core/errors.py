"""The one exception family of torchloom.

Every misuse of a schedule raises a :class:`ScheduleError` (or a subclass). A message
always has the same four parts, so that a user can act on it without reading our code:

* where: the schedule path and the primitive, written as the call the user made,
  e.g. ``sch['transformer.h.0.mlp.c_fc'].shard(...)``;
* what went wrong;
* the offending values;
* the fix, as a copy-pasteable line where one exists.

>>> err = ShardError("axis 1 of 'weight' is not divisible by the world size",
...                  path="h.0.mlp", primitive="shard",
...                  values={"shape": (8, 10), "world_size": 4},
...                  fix="shard along axis 0 instead: sch['h.0.mlp'].shard('weight', 0)")
>>> print(err)
sch['h.0.mlp'].shard(...): axis 1 of 'weight' is not divisible by the world size
    values: shape=(8, 10), world_size=4
    fix: shard along axis 0 instead: sch['h.0.mlp'].shard('weight', 0)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ScheduleError",
    "PathError",
    "ShardError",
    "SyncError",
    "ReplaceError",
    "CheckpointError",
    "AnnotateError",
    "RngError",
    "RecipeError",
    "BuildError",
]


def format_location(path: str | None, primitive: str | None) -> str:
    """Render where an error happened, in the schedule language.

    >>> format_location("h.0", "checkpoint")
    "sch['h.0'].checkpoint(...)"
    >>> format_location("", None)
    "sch['']"
    >>> format_location(None, "build")
    'build(...)'
    """
    if path is None:
        return f"{primitive}(...)" if primitive else "torchloom"
    where = f"sch[{path!r}]"
    return f"{where}.{primitive}(...)" if primitive else where


class ScheduleError(Exception):
    """Base class of every error torchloom raises on bad input.

    Attributes:
        problem: what went wrong, one sentence.
        path: the schedule path (``""`` is the root), or None when no schedule is involved.
        primitive: the primitive (or API function) that was called.
        values: the offending values, by name.
        fix: what to do instead.
    """

    def __init__(
        self,
        problem: str,
        *,
        path: str | None = None,
        primitive: str | None = None,
        values: dict[str, Any] | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.path = path
        self.primitive = primitive
        self.values = dict(values or {})
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"{format_location(self.path, self.primitive)}: {self.problem}"]
        if self.values:
            rendered = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
            lines.append(f"    values: {rendered}")
        if self.fix:
            lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:  # keep errors picklable across processes
        return (
            _rebuild_error,
            (type(self), self.problem, self.path, self.primitive, self.values, self.fix),
        )


def _rebuild_error(cls: type[ScheduleError], problem: str, path: str | None, primitive: str | None,
                   values: dict[str, Any], fix: str | None) -> ScheduleError:
    return cls(problem, path=path, primitive=primitive, values=values, fix=fix)


class PathError(ScheduleError, KeyError):
    """A schedule path (or module, parameter or buffer name) that does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return self._render()


class ShardError(ScheduleError):
    """``shard`` cannot slice this tensor as asked."""


class SyncError(ScheduleError):
    """``sync`` was given a mode, operation or combination that is not valid."""


class ReplaceError(ScheduleError):
    """``replace`` / ``replace_all`` cannot perform the swap."""


class CheckpointError(ScheduleError):
    """``checkpoint`` cannot be applied as asked."""


class AnnotateError(ScheduleError):
    """``annotate`` was given a parameter or key it cannot tag."""


class RngError(ScheduleError):
    """A random-number-generator precondition is not met (e.g. no seed for ``fork_rng``)."""


class RecipeError(ScheduleError):
    """A recipe cannot be serialised, parsed, or replayed on this model."""


class BuildError(ScheduleError):
    """``build`` cannot materialise or assemble the model."""


class TraceError(ScheduleError):
    """``trace`` / ``trace_until`` cannot turn the module into a graph (or a graph primitive
    needs a traced module)."""


class TraceGuardError(TraceError):
    """A traced graph is called with inputs that take another path than the example it was
    traced with (raised at run time by the graph's guards)."""


class PatternError(ScheduleError):
    """``find`` was given a pattern it cannot use, or a match is not valid any more."""


class FuseError(ScheduleError):
    """``fuse`` or ``decompose`` cannot be applied as asked."""


class CompileError(ScheduleError):
    """``compile`` cannot be applied as asked."""


__all__ += ["TraceError", "TraceGuardError", "PatternError", "FuseError", "CompileError"]


class ScheduleMismatchError(ScheduleError):
    """The ranks of a schedule's process group scheduled differently (another recipe, or
    other local parameter shapes); raised by ``build`` and ``Verify`` on every rank."""


__all__ += ["ScheduleMismatchError"]


class CollectiveTimeoutError(ScheduleError):
    """A collective failed or timed out: another rank died, hung, or skipped it. Names the
    rank, the collective and (for the collectives of ``sync``) the schedule path in flight."""


class CollectiveShapeError(ScheduleError, ValueError):
    """A collective cannot split a tensor into equal slices, one per rank of the group."""


class RankFailedError(ScheduleError):
    """A rank of a local launch (:func:`torchloom.runtime.launch.run_ranks`) raised, died or hung;
    the message shows that rank's own error first, then what the other ranks reported."""


__all__ += ["CollectiveTimeoutError", "CollectiveShapeError", "RankFailedError"]


class PretrainedError(ScheduleError):
    """``save_pretrained`` cannot write the Hugging Face folder as asked (a path it must
    not replace, a model without weights, a tensor it cannot gather, a failed write)."""


__all__ += ["PretrainedError"]


class TuneError(ScheduleError):
    """A search space, strategy, database or tuning run was set up wrongly.

    >>> print(TuneError("symbol 'batch_size' is defined twice", primitive="Space.create_symbol",
    ...                 values={"name": "batch_size"}, fix="give the second symbol another name"))
    Space.create_symbol(...): symbol 'batch_size' is defined twice
        values: name='batch_size'
        fix: give the second symbol another name
    """


class TuneDatabaseError(TuneError):
    """A results file the tuner did not write: not SQLite, another program's or another
    schema's database, or a row whose contents the tuner never writes."""


class PlanError(ScheduleError):
    """A model, layout, device profile or option the planner cannot use."""


class LayoutError(PlanError):
    """A :class:`torchloom.Layout` that contradicts itself, the world it runs on or the
    model it spreads (degrees, micro-batches, stage cuts, dtypes); raised by the planner
    as by ``torchloom train`` and :func:`torchloom.parallelize`, before any rank starts."""


__all__ += ["TuneError", "TuneDatabaseError", "PlanError", "LayoutError"]


class ScheduleConfigError(ScheduleError):
    """A schedule knob has a value no built-in schedule can use, or one the schedule of
    this model does not take."""


class TPPlanError(ScheduleError):
    """A transformers parallel plan that torchloom cannot turn into a correct schedule for
    this model (``values`` names the ``style`` and the ``family``)."""


class CheckpointIOError(ScheduleError):
    """A checkpoint directory is missing, incomplete (an interrupted save) or unreadable."""


class CheckpointMismatchError(ScheduleError):
    """A checkpoint does not fit this model / optimizer / world size (or a shard spec does
    not fit the group it is gathered over)."""


class OpsError(ScheduleError):
    """A kernel of :mod:`torchloom.ops` was called with arguments it cannot use."""


class VerificationError(ScheduleError):
    """The scheduled model computes something else than the original (or would)."""


class DataError(ScheduleError):
    """``--data`` cannot be read or tokenised, or holds too little text."""


class TrainOptionError(ScheduleError):
    """An option of ``torchloom train`` (a flag or a key of the TOML file) has a bad value."""


class NonFiniteLossError(ScheduleError):
    """The training loss became NaN or infinite; the run stopped before using it."""


class PrimitiveNameError(ScheduleError, AttributeError):
    """A schedule was asked for a primitive (or attribute) it does not have."""


class PrimitiveCallError(ScheduleError, TypeError):
    """A primitive was called with arguments that do not fit its signature."""


__all__ += ["ScheduleConfigError", "TPPlanError", "CheckpointIOError", "CheckpointMismatchError",
            "OpsError", "VerificationError", "DataError", "TrainOptionError",
            "NonFiniteLossError", "PrimitiveNameError", "PrimitiveCallError"]


class ModelSizeError(ScheduleConfigError):
    """A config size (heads, KV heads, features, tokens) that the tensor-parallel or
    sequence-parallel degree must divide, and does not; or a model a knob cannot apply to."""


class NoScheduleError(ScheduleError):
    """A model class without a built-in schedule and without a transformers tp plan."""


class PipelineCutError(ScheduleError):
    """``cut_pipeline_stage`` at a place a stage cannot end (the root, an untraced parent,
    a module the graph does not call, a second cut)."""


class LaunchError(ScheduleError):
    """A process group or a local launch cannot be set up as asked."""


class BuiltError(ScheduleError):
    """A primitive on a schedule that ``build`` has built already."""


class UnknownModelError(ScheduleError):
    """A model or size name the zoo or a command does not know."""


class CliOptionError(ScheduleError):
    """A command-line option (of ``show``, ``tune``, ``verify``, ``bench``) has a bad value."""


class NotAModuleError(ScheduleError, TypeError):
    """A schedule was asked to be made of something that is not an ``nn.Module``."""


__all__ += ["ModelSizeError", "NoScheduleError", "PipelineCutError", "LaunchError",
            "BuiltError", "UnknownModelError", "CliOptionError", "NotAModuleError"]


class ShardArgumentError(ShardError):
    """``shard`` got an argument of the wrong kind (``chunks``, ``tied``)."""


class ShardAxisError(ShardError):
    """``shard``'s axis is out of range for the tensor."""


class ShardSizeError(ShardError):
    """The sharded axis does not split evenly into the ranks (and ``chunks`` blocks)."""


class ShardTiedError(ShardError):
    """The tensor is tied to another module's and ``tied=True`` was not given."""


class ShardTwiceError(ShardError):
    """The tensor is already sharded."""


__all__ += ["ShardArgumentError", "ShardAxisError", "ShardSizeError", "ShardTiedError",
            "ShardTwiceError"]


class ModelConfigError(ScheduleError):
    """A model's config holds a size that is zero, negative or not an integer, or the
    model would not fit this machine's memory for the layout asked for (``build``,
    ``Verify``, ``torchloom train``; never ``plan``)."""


__all__ += ["ModelConfigError"]


class DivideAttrsError(ScheduleError):
    """``divide_attrs`` names an attribute that is not a positive integer of the module,
    or one the group's size does not divide."""


__all__ += ["DivideAttrsError"]


class LossError(ScheduleError):
    """A loss mode (:data:`torchloom.parallel.layout.LOSSES`) that cannot apply to this
    model, these logits or this process group (:mod:`torchloom.ops.loss`)."""


__all__ += ["LossError"]


class ContextParallelError(OpsError):
    """A sequence, model or attention implementation that ``context_parallel`` cannot split
    (:mod:`torchloom.primitives.context_parallel`, :mod:`torchloom.ops.context_parallel`)."""


__all__ += ["ContextParallelError"]


class ExpertParallelError(OpsError):
    """A mixture-of-experts module, routing or layout that ``expert_parallel`` cannot spread
    over ranks (:mod:`torchloom.primitives.expert_parallel`,
    :mod:`torchloom.runtime.expert_dispatch`)."""


__all__ += ["ExpertParallelError"]


class LoraError(ScheduleError):
    """LoRA adapters that ``lora`` cannot add, train or write as asked
    (:mod:`torchloom.primitives.lora`, :mod:`torchloom.runtime.lora_files`)."""


__all__ += ["LoraError"]
