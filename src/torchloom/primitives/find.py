"""``find``, ``find_node``, ``find_subgraph``: the matches of a pattern in the traced graphs
at and below a node (see :mod:`torchloom.graph.pattern` for what a pattern is). They read
the schedule and change nothing, so they are not recorded; a primitive given their matches
records them as references (``{"pattern": ..., "index": ...}``).

Precondition: the node or a node below it is traced.

>>> import torch, torchloom as tl
>>> sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
>>> sch.trace(tracer="fx")
>>> [m.nodes for m in sch.find("0")], [m.nodes for m in sch.find_node(lambda n: n.op == "output")]
([[_0]], [[output]])
>>> len(sch.recipe)  # trace only
1
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ..core.errors import PatternError, TraceError
from ..core.registry import primitive
from ..graph import pattern as _pattern

if TYPE_CHECKING:
    from ..core.schedule import Schedule
    from ..graph.pattern import Match

__all__ = ["find", "find_node", "find_subgraph"]


@primitive("find", errors=(TraceError, PatternError), recorded=False)
def find(sch: Schedule, pattern: str | Callable[..., Any] | nn.Module | type[nn.Module]
         ) -> list[Match]:
    """Matches of a regex, node predicate, pattern function or pattern module in the
    traced graphs at and below this node."""
    return _pattern.find(sch, pattern)


@primitive("find_node", errors=(TraceError, PatternError), recorded=False)
def find_node(sch: Schedule, regex_or_fn: str | Callable[[Any], bool]) -> list[Match]:
    """``find`` with a regex or a node predicate (any callable taking a node)."""
    return _pattern.find(sch, regex_or_fn, predicate=callable(regex_or_fn))


@primitive("find_subgraph", errors=(TraceError, PatternError), recorded=False)
def find_subgraph(sch: Schedule, pattern: Callable[..., Any] | nn.Module | type[nn.Module]
                  ) -> list[Match]:
    """``find`` with a pattern function or pattern module."""
    return _pattern.find(sch, pattern)
