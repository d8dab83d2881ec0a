"""``cut_pipeline_stage()``: end a pipeline stage after this module.

``build(sch, target="pipeline", ...)`` splits the model after every marked module (see
:mod:`torchloom.runtime.pipeline`). The stages are cut out of the traced graphs, so the module
must be called from a traced parent: prepare the levels with ``trace_until``. Cuts may sit
at several levels (e.g. after a layer and after an embedding block); each marks one
boundary.

Preconditions:
    * not the root;
    * the nearest enclosing module with a forward of its own (a ``ModuleList`` has none)
      is traced, and its graph calls this module (else the error says to call
      ``trace_until``);
    * the module is not marked already.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
>>> sch = tl.create_schedule(model)
>>> sch.trace(example_inputs=(torch.randn(1, 2),))
>>> sch["1"].cut_pipeline_stage()
>>> from torchloom.runtime.pipeline_split import cut_paths
>>> cut_paths(sch)
['1']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..core.errors import PipelineCutError, ScheduleError
from ..core.marks import PIPELINE_CUT, has_mark, set_mark
from ..core.registry import primitive
from ..graph.graph_module import is_traced

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "cut_pipeline_stage"

__all__ = ["NAME", "apply"]


def _graph_parent(sch: Schedule) -> tuple[Schedule, str]:
    """The nearest ancestor whose graph would call ``sch``, and ``sch``'s path below it."""
    node, rel = sch.parent, sch.name
    while node is not None and node.parent is not None and \
            isinstance(node.mod, (nn.ModuleList, nn.ModuleDict)):
        rel = f"{node.name}.{rel}"
        node = node.parent
    assert node is not None
    return node, rel


@primitive(NAME, errors=(ScheduleError,))
def apply(sch: Schedule) -> None:
    """Mark ``sch.mod`` as the last module of a pipeline stage."""
    if sch.parent is None:
        raise PipelineCutError(
            "the root cannot end a pipeline stage; cut after one of its modules",
            path=sch.path, primitive=NAME, values={"module": type(sch.mod).__name__},
            fix="e.g. sch['transformer.h.5'].cut_pipeline_stage()",
        )
    parent, rel = _graph_parent(sch)
    levels = f"{sch.parent.path}.*" if sch.parent.path else "*"
    if not is_traced(parent.mod):
        raise PipelineCutError(
            f"the module that calls this one ({parent.path or 'the root'}) is not traced, so "
            "there is no graph to cut",
            path=sch.path, primitive=NAME,
            values={"parent": parent.path, "parent_module": type(parent.mod).__name__},
            fix=f"trace down to this level first: sch.trace_until({levels!r})",
        )
    calls = [n for n in parent.mod.graph.nodes if n.op == "call_module" and n.target == rel]
    if not calls:
        raise PipelineCutError(
            f"the traced graph of {parent.path or 'the root'} does not call this module",
            path=sch.path, primitive=NAME, values={"parent": parent.path, "target": rel},
            fix="cut after a module the model calls (look at sch[parent].mod.graph)",
        )
    if has_mark(sch.mod, PIPELINE_CUT):
        raise PipelineCutError(
            "a stage already ends after this module",
            path=sch.path, primitive=NAME, values={"module": type(sch.mod).__name__},
            fix=f"cut once: remove the second sch[{sch.path!r}].cut_pipeline_stage()",
        )
    set_mark(sch.mod, PIPELINE_CUT, True)
