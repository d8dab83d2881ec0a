"""``trace_until(paths)``: trace from this node down to the given levels.

Every module on the way from this node (usually the root) to each path in ``paths`` is
traced into its own nested graph (torch.nn modules too, such as an ``nn.TransformerEncoder``
on the way to its ``layers``), and so is the module at each path, unless it is a torch.nn
leaf (an ``nn.TransformerEncoderLayer``: it stays one ``call_module`` node, enough to cut
a stage after it); the children of those levels, and every module off the way, stay
opaque ``call_module`` nodes. This is how the
levels where pipeline stages are cut are prepared: the graph of each level's parent shows
the level as one node. ``paths`` are relative to this node and may use wildcards
(``"transformer.h.*"``). Options are those of ``trace`` (``flatten`` is not one: the
result is hierarchical by definition). Without ``example_inputs`` a transformers model runs
on :func:`torchloom.graph.tracing.dummy_inputs`; a model built under ``init_empty_weights`` is
traced without allocating anything (a 70 B-class Llama config in seconds), so it can be cut
into pipeline stages before any weight exists.

Preconditions:
    * ``paths`` is a non-empty path or list of paths, each resolving below this node (else
      :class:`~torchloom.core.errors.PathError`);
    * every level is called when this node's module runs (else
      :class:`~torchloom.core.errors.TraceError`);
    * the modules on the way were not checkpointed / ``fork_rng``'d (they must be traced).

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), nn.Sequential(nn.ReLU()))
>>> sch = tl.create_schedule(model)
>>> sch.trace_until("0.0", example_inputs=(torch.randn(1, 2),))
>>> [type(m).__name__ for m in (sch.mod, sch["0"].mod, sch["0.0"].mod, sch["1"].mod)]
['Sequential', 'Sequential', 'Sequential', 'Sequential']
>>> from torchloom.graph.graph_module import is_traced
>>> [is_traced(m) for m in (sch.mod, sch["0"].mod, sch["0.0"].mod, sch["1"].mod)]
[True, True, True, False]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..core.errors import TraceError
from ..core.registry import primitive
from ..graph.examples import example_inputs_for
from ..graph.graph_module import _is_container, _own_forward, is_leaf, is_traced
from ..graph.tracing import trace_module
from .trace import check_options, install_traced

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "trace_until"

__all__ = ["NAME", "apply"]


def _levels(sch: Schedule, paths: str | Sequence[str]) -> list[Schedule]:
    from ..core.schedule import ScheduleGroup

    items = [paths] if isinstance(paths, str) else list(paths)
    if not items or not all(isinstance(p, str) and p for p in items):
        raise TraceError(
            "paths must be a non-empty path or list of paths below this node",
            path=sch.path, primitive=NAME, values={"paths": paths},
            fix=f"e.g. sch[{sch.path!r}].trace_until('transformer.h.*')",
        )
    nodes: list[Schedule] = []
    for item in items:
        found = sch[item]
        nodes += found.nodes if isinstance(found, ScheduleGroup) else [found]
    return nodes


@primitive(NAME, errors=(TraceError,))
def apply(
    sch: Schedule,
    paths: str | Sequence[str],
    leaf_modules: Sequence[str] | None = None,
    tracer: str = "auto",
    concrete_args: dict[str, Any] | None = None,
    example_inputs: Any = None,
) -> None:
    """Trace ``sch.mod`` hierarchically, expanding only the way to each level."""
    leaves = check_options(sch, leaf_modules, False, tracer, NAME)
    levels = _levels(sch, paths)
    level_paths = {n.path for n in levels}

    def expand(child_path: str) -> bool:
        return any(p == child_path or p.startswith(child_path + ".") for p in level_paths)

    if example_inputs is None and tracer == "auto":
        example_inputs = example_inputs_for(sch.root.mod, sch.mod, sch.path)
    # torch.nn modules on the way (an nn.TransformerEncoder holding its layers) are
    # traced into; a level that is a torch.nn leaf (an nn.TransformerEncoderLayer) stays
    # one call_module node, enough to cut a pipeline stage after it
    way = {p[:i] for p in level_paths for i in range(len(p)) if p[i] == "."}
    way = {p for p in way if p.startswith(sch.path + ".") or not sch.path}
    must: list[str] = []
    must_call: list[str] = []
    for n in levels:
        if is_traced(n.mod) or _is_container(n.mod):
            continue
        builtin_leaf = not _own_forward(n.mod) and is_leaf(n.mod, n.path, leaves)
        (must_call if builtin_leaf else must).append(n.path)
    traced = trace_module(
        sch.mod, path=sch.path, example_inputs=example_inputs, leaf_modules=leaves,
        tracer=tracer, concrete_args=concrete_args, expand=expand, must_trace=must,
        descend=sorted(way), must_call=must_call,
    )
    install_traced(sch, traced)
