"""torchloom: a schedule language for progressive optimization of large-model training.

Take an unmodified model, make a schedule of it, apply primitives by module path, build
it, and check it still computes the same thing.

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
>>> sch = tl.create_schedule(model)
>>> sch["0"].checkpoint()
>>> model, optimizer = tl.build(sch)
>>> model(torch.randn(3, 8)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

from . import ops, parallel, schedules
from .core import __version__
from .graph import tracing
from .runtime import pipeline

models = schedules  # the package's name before 0.2: tl.models.apply_schedule still works
from .core.errors import (
    AnnotateError,
    BuildError,
    CheckpointError,
    CollectiveShapeError,
    CompileError,
    DivideAttrsError,
    FuseError,
    LayoutError,
    NoScheduleError,
    PathError,
    PatternError,
    PretrainedError,
    RankFailedError,
    RecipeError,
    ReplaceError,
    RngError,
    ScheduleConfigError,
    ScheduleError,
    ScheduleMismatchError,
    ShardError,
    SyncError,
    TraceError,
    TraceGuardError,
)
from .core.meta import ShardSpec, get_meta, shard_spec
from .core.recipe import Recipe, RecipeEntry, apply_recipe
from .core.schedule import Schedule, ScheduleGroup, create_schedule
from .graph.pattern import Match, ModulePattern, Pattern
from .parallel import Layout, Parallelized, parallelize
from .primitives import list_primitives
from .runtime import state
from .runtime.adapter_files import save_adapter
from .runtime.agree import check_ranks_agree
from .runtime.build import build
from .runtime.gather import CheckpointMismatchError, full_optimizer_state_dict, full_state_dict
from .runtime.materialise import init_empty_weights
from .runtime.pretrained import save_pretrained
from .runtime.process_group import init_distributed
from .runtime.rng import set_random_seed
from .runtime.state import (
    Checkpoint,
    CheckpointIOError,
    CollectiveTimeoutError,
    find_checkpoint,
    list_checkpoints,
    load,
    save,
)
from .runtime.weights import load_weights
from .tools.check import CheckReport, Finding, check
from .tools.verify import VerificationError, Verify


def __getattr__(name: str) -> object:
    # torchloom.tune imports optuna and matplotlib: load it on first use only.
    if name == "tune":
        import importlib

        return importlib.import_module(".tune", __name__)
    raise AttributeError(f"module 'torchloom' has no attribute {name!r}")

__all__ = [
    # modules whose functions are public by module: tl.state.save, tl.pipeline.tied_weights, ...
    "models", "ops", "parallel", "pipeline", "schedules", "state", "tracing",
    "AnnotateError",
    "Layout",
    "LayoutError",
    "Parallelized",
    "parallelize",
    "DivideAttrsError",
    "NoScheduleError",
    "ScheduleConfigError",
    "FuseError",
    "CompileError",
    "Match",
    "ModulePattern",
    "Pattern",
    "PatternError",
    "TraceError",
    "TraceGuardError",
    "Checkpoint",
    "CheckpointIOError",
    "find_checkpoint",
    "list_checkpoints",
    "CheckpointMismatchError",
    "CollectiveTimeoutError",
    "full_optimizer_state_dict",
    "full_state_dict",
    "init_distributed",
    "load",
    "save",
    "state",
    "CheckReport",
    "Finding",
    "VerificationError",
    "Verify",
    "check",
    "ops",
    "parallel",
    "BuildError",
    "CheckpointError",
    "PathError",
    "Recipe",
    "RecipeEntry",
    "RecipeError",
    "ReplaceError",
    "RngError",
    "Schedule",
    "ScheduleError",
    "ScheduleGroup",
    "ShardError",
    "ShardSpec",
    "SyncError",
    "__version__",
    "apply_recipe",
    "load_weights",
    "build",
    "create_schedule",
    "get_meta",
    "init_empty_weights",
    "list_primitives",
    "set_random_seed",
    "shard_spec",
    "ScheduleMismatchError",
    "check_ranks_agree",
    "CollectiveShapeError",
    "RankFailedError",
    "PretrainedError",
    "save_adapter",
    "save_pretrained",
]
