"""``trace(...)``: turn this node's module (only this one) into a graph.

The module is replaced by a :class:`~torchloom.graph.tracing.TracedGraphModule` built by
:func:`torchloom.graph.tracing.trace_module` (the module docstring there describes the tracer,
its choices and its limits). What stays the same:

* the module object: it is changed in place into the traced graph module, so references
  to it stay valid (the model you hold, when the root is traced);
* the module tree below the node: with ``flatten=False`` every child is a nested graph or
  an untouched leaf, so every schedule path still resolves and the schedule nodes you hold
  stay valid (their ``mod`` is updated in place); with ``flatten=True`` the children are
  inlined into one graph but stay registered, so paths, parameters and ``state_dict()``
  keys still resolve;
* the ``Parameter`` objects (and so the shard records and tags on them);
* hooks: those of the traced module and of traced children move to their graph modules,
  modules with hooks stay leaves of a flattened graph, leaves keep theirs;
* checkpointed / ``fork_rng`` / row-parallel modules, which stay leaves.

Example inputs: ``example_inputs`` (a tuple of positional arguments, a dict of keyword
arguments, or an ``(args, kwargs)`` pair) if given; otherwise, for a transformers model,
the inputs this module receives when the model runs (without a KV cache) on
:func:`torchloom.graph.tracing.dummy_inputs` made from its config (token ids, or pixel values for
an image model); otherwise none, and the trace is symbolic (enough for modules without
data-dependent Python code). A model built under ``init_empty_weights`` is traced the
same way on tensors without data (nothing is allocated).

The KV cache of a transformers model (``use_cache`` defaults to True) is traced off: the
graph computes the training path, accepts ``use_cache`` None or False, and refuses a cache
where one would be used (see :mod:`torchloom.graph.tracing`).

Tracing an already traced module traces its graph again (e.g. ``flatten=True`` after a
hierarchical trace inlines the nested graphs).

Preconditions:
    * the module's ``forward`` was not replaced on the instance (``checkpoint``,
      ``fork_rng``, a row-parallel ``sync``): trace first, or trace its parent;
    * ``tracer`` is ``"auto"`` or ``"fx"``; ``leaf_modules`` is a list of class names or
      paths; ``flatten`` is a bool;
    * a failure raises :class:`~torchloom.core.errors.TraceError` naming the path that failed.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.GELU()), nn.Linear(8, 2))
>>> sch = tl.create_schedule(model)
>>> inner = sch["0.0"]
>>> sch.trace(example_inputs=(torch.randn(3, 4),))
>>> type(sch.mod).__name__, type(sch["0"].mod).__name__, sch["0.0"] is inner
('Sequential', 'Sequential', True)
>>> print(sch["0"].mod.code.strip().splitlines()[-1].strip())
return _1
>>> list(sch.mod.state_dict()) == ['0.0.weight', '0.0.bias', '1.weight', '1.bias']
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..core.errors import TraceError
from ..core.registry import primitive
from ..graph.examples import example_inputs_for
from ..graph.tracing import TRACERS, trace_module

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "trace"

__all__ = ["NAME", "apply", "install_traced", "check_options"]


def check_options(sch: Schedule, leaf_modules: Any, flatten: Any, tracer: Any,
                  primitive: str = NAME) -> tuple[str, ...]:
    """Validate the common trace options; returns ``leaf_modules`` as a tuple."""
    if leaf_modules is None:
        leaves: tuple[str, ...] = ()
    elif isinstance(leaf_modules, str) or not all(isinstance(x, str) for x in leaf_modules):
        raise TraceError(
            "leaf_modules must be a list of class names or module paths",
            path=sch.path, primitive=primitive, values={"leaf_modules": leaf_modules},
            fix=f"e.g. sch[{sch.path!r}].{primitive}(leaf_modules=['GPT2Attention'])",
        )
    else:
        leaves = tuple(leaf_modules)
    if not isinstance(flatten, bool):
        raise TraceError(
            "flatten must be True or False",
            path=sch.path, primitive=primitive, values={"flatten": flatten},
            fix=f"sch[{sch.path!r}].{primitive}(flatten=True)",
        )
    if tracer not in TRACERS:
        raise TraceError(
            f"unknown tracer {tracer!r}",
            path=sch.path, primitive=primitive, values={"tracer": tracer,
                                                       "tracers": list(TRACERS)},
            fix=f"use one of {', '.join(TRACERS)}; 'auto' handles transformers modules",
        )
    return leaves


def install_traced(sch: Schedule, new: Any) -> None:
    """Point ``sch`` at the traced module (the same object: tracing works in place) and
    bring the schedule nodes below in line, keeping the existing ones."""
    sch.mod = new
    sch.sync_children()


@primitive(NAME, errors=(TraceError,))
def apply(
    sch: Schedule,
    leaf_modules: Sequence[str] | None = None,
    flatten: bool = False,
    tracer: str = "auto",
    concrete_args: dict[str, Any] | None = None,
    example_inputs: Any = None,
) -> None:
    """Trace ``sch.mod`` into a graph module and install it at ``sch``."""
    leaves = check_options(sch, leaf_modules, flatten, tracer)
    if example_inputs is None and tracer == "auto":
        example_inputs = example_inputs_for(sch.root.mod, sch.mod, sch.path)
    traced = trace_module(
        sch.mod, path=sch.path, example_inputs=example_inputs, leaf_modules=leaves,
        flatten=flatten, tracer=tracer, concrete_args=concrete_args,
    )
    install_traced(sch, traced)
