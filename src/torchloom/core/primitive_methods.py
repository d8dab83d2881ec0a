"""The primitives as typed methods: what mypy and IDEs see on a schedule.

Every primitive is registered once (:mod:`torchloom.core.registry`), which installs its
implementation on :class:`~torchloom.core.schedule.Schedule` and
:class:`~torchloom.core.schedule.ScheduleGroup`. This class declares the same methods with
their parameters and types, so ``sch["layers.0"].shard("weight", 0)`` is checked by a type
checker and completed by an editor; ``tests/test_registry.py`` checks that every
declaration has exactly its registered primitive's signature. Types of higher layers
(``Match``, ``nn.Module`` patterns) are ``Any`` here: ``core`` imports nothing above it.

>>> import torch, torchloom as tl
>>> sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
>>> type(sch["0"]).shard is PrimitiveMethods.shard   # the registry's implementation
False
>>> PrimitiveMethods.shard.__annotations__["axis"]
'int'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["PrimitiveMethods"]


def _unregistered(name: str) -> NoReturn:
    from .errors import PrimitiveNameError

    raise PrimitiveNameError(
        f"the primitive {name!r} is declared but not registered", primitive=name,
        fix="import torchloom (importing torchloom.primitives registers every primitive)")


class PrimitiveMethods:
    """Typed declarations of the primitives (see the module docstring)."""

    def annotate(self, param_name: str, key: str, value: Any, *,
                 overwrite: bool = False) -> None:
        """Tag a parameter (``torchloom.primitives.annotate``)."""
        _unregistered("annotate")

    def checkpoint(self, ratio: float | None = None, subgraph: Any = None,
                   policy: str | None = None) -> None:
        """Activation checkpointing (``torchloom.primitives.checkpoint``)."""
        _unregistered("checkpoint")

    def compile(self, backend: str | Callable[..., Any] = "inductor", *,
                mode: str | None = None, dynamic: bool | None = None,
                fullgraph: bool = False) -> None:
        """``torch.compile`` in place (``torchloom.primitives.compile``)."""
        _unregistered("compile")

    def context_parallel(self, group: Any = None) -> None:
        """Split every sequence over ``group`` (``torchloom.primitives.context_parallel``)."""
        _unregistered("context_parallel")

    def cut_pipeline_stage(self) -> None:
        """End a pipeline stage after this module (``torchloom.primitives.cut_pipeline_stage``)."""
        _unregistered("cut_pipeline_stage")

    def decompose(self) -> None:
        """Split a Linear into matmul and bias add (``torchloom.primitives.decompose``)."""
        _unregistered("decompose")

    def divide_attrs(self, names: str | Sequence[str]) -> None:
        """Make size attributes this rank's share (``torchloom.primitives.divide_attrs``)."""
        _unregistered("divide_attrs")

    def expert_parallel(self, group: Any = None) -> None:
        """Spread the experts of every mixture-of-experts module here over ``group``
        (``torchloom.primitives.expert_parallel``)."""
        _unregistered("expert_parallel")

    def find(self, pattern: Any) -> Any:
        """Matches of a regex, predicate or pattern (``torchloom.primitives.find``)."""
        _unregistered("find")

    def find_node(self, regex_or_fn: str | Callable[[Any], bool]) -> Any:
        """Matches of a regex or node predicate (``torchloom.primitives.find``)."""
        _unregistered("find_node")

    def find_subgraph(self, pattern: Any) -> Any:
        """Matches of a pattern function or module (``torchloom.primitives.find``)."""
        _unregistered("find_subgraph")

    def fork_rng(self) -> None:
        """Per-rank dropout generator (``torchloom.primitives.fork_rng``)."""
        _unregistered("fork_rng")

    def fuse(self, subgraph: Any, compiler: str | Callable[..., Any] | None = "inductor",
             name: str = "FusedModule") -> None:
        """Compile a found subgraph into one module (``torchloom.primitives.fuse``)."""
        _unregistered("fuse")

    def lora(self, r: int, alpha: float, targets: list[str], dropout: float = 0.0,
             seed: int = 0, init: str = "zero_b") -> None:
        """LoRA adapters on the named linear layers, the rest frozen
        (``torchloom.primitives.lora``)."""
        _unregistered("lora")

    def replace(self, new_mod_or_fn: Any, target_ops: Any = None, name: str | None = None,
                concrete_args: dict[str, Any] | None = None) -> None:
        """Swap the module or a subgraph (``torchloom.primitives.replace``)."""
        _unregistered("replace")

    def replace_all(self, module_type: Any, make_mod_fn: Callable[..., Any]) -> None:
        """Replace every sub-module of a type (``torchloom.primitives.replace_all``)."""
        _unregistered("replace_all")

    def shard(self, param_name: str, axis: int, chunks: int = 1, *,
              tied: bool = False) -> None:
        """Keep this rank's slice of a tensor (``torchloom.primitives.shard``)."""
        _unregistered("shard")

    def sync(self, mode: str, sync_op_or_fn: str | Callable[..., Any], **kwargs: Any) -> None:
        """Communication at the module boundary (``torchloom.primitives.sync``)."""
        _unregistered("sync")

    def trace(self, leaf_modules: Sequence[str] | None = None, flatten: bool = False,
              tracer: str = "auto", concrete_args: dict[str, Any] | None = None,
              example_inputs: Any = None) -> None:
        """Turn the module into an fx graph (``torchloom.primitives.trace``)."""
        _unregistered("trace")

    def trace_until(self, paths: str | Sequence[str], leaf_modules: Sequence[str] | None = None,
                    tracer: str = "auto", concrete_args: dict[str, Any] | None = None,
                    example_inputs: Any = None) -> None:
        """Trace the way down to some levels (``torchloom.primitives.trace_until``)."""
        _unregistered("trace_until")
