"""``fuse(subgraph, compiler="inductor", name="FusedModule")``: compile a found subgraph
into one module.

The match (from ``find``) is cut out of its graph into a standalone graph whose inputs are
the values the match reads (parameters included, so gradients reach them) and whose
outputs are every matched value used outside it. That graph is wrapped in a
:class:`FusedModule`, compiled with ``torch.compile(backend=compiler)`` on its first call
(``"eager"`` or None: not compiled), and called in place of the match, as the child
``<name>_<k>`` of the graph's schedule node. Modules called inside the match stay where
they were (they are referenced, not moved), so ``state_dict()`` keys do not change and
their hooks keep firing. TorchScript is not used (deprecated).

Preconditions:
    * the node (or a node below it) is traced and ``subgraph`` is one live ``Match`` (or a
      one-element list) from ``find`` on it;
    * ``compiler`` is ``"eager"``, None, a ``torch.compile`` backend name
      (``torch.compiler.list_backends()``) or a backend callable;
    * ``name`` is an identifier;
    * the match is self-contained: no input of it is computed from one of its results.

Before / after:

>>> import torch, torch.nn.functional as F, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2))
>>> x = torch.randn(3, 4)
>>> expected = model(x)
>>> sch = tl.create_schedule(model)
>>> sch.trace(example_inputs=(x,))
>>> match = sch.find(lambda x, w, b: F.gelu(F.linear(x, w, b)))[0]
>>> sch.fuse(match, compiler="eager")
>>> [n.target for n in sch.mod.graph.nodes if n.op == "call_module"]
['FusedModule_0', '2']
>>> torch.allclose(model(x), expected), list(model.state_dict())
(True, ['0.weight', '0.bias', '2.weight', '2.bias'])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from ..core.errors import FuseError
from ..core.registry import primitive
from ..graph.subgraph import GraphHolder, extract, recorded_matches, resolve, splice

if TYPE_CHECKING:
    from ..core.schedule import Schedule
    from ..graph.pattern import Match

NAME = "fuse"

__all__ = ["NAME", "FusedModule", "apply"]


class FusedModule(GraphHolder):
    """A compiled subgraph; see :mod:`torchloom.primitives.fuse`."""

    keeps_called_modules = True

    def __init__(self, graph_module: fx.GraphModule, n_outputs: int,
                 compiler: str | Callable[..., Any] | None) -> None:
        super().__init__(graph_module, n_outputs)
        self.compiler = compiler
        object.__setattr__(self, "_compiled", None)

    def forward(self, *args: Any) -> Any:
        if self.compiler in (None, "eager"):
            return self.run_graph(*args)
        compiled = self.__dict__.get("_compiled")
        if compiled is None:
            compiled = torch.compile(self.run_graph, backend=self.compiler)
            object.__setattr__(self, "_compiled", compiled)
        return compiled(*args)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled"] = None  # compiled code is rebuilt on the first call of a copy
        return state

    def extra_repr(self) -> str:
        return f"compiler={self.compiler!r}, {super().extra_repr()}"


def _check_compiler(sch: Schedule, compiler: Any) -> None:
    if compiler is None or callable(compiler):
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if compiler == "eager" or compiler in known:
        return
    raise FuseError(
        f"unknown compiler {compiler!r}",
        path=sch.path, primitive=NAME,
        values={"compiler": compiler, "backends": torch.compiler.list_backends()},
        fix=f"use 'inductor' (the default), 'eager' for no compilation, or a torch.compile "
        f"backend: sch[{sch.path!r}].fuse(match, compiler='inductor')",
    )


@primitive(NAME, errors=(FuseError,), record_as={"subgraph": recorded_matches})
def apply(
    sch: Schedule,
    subgraph: Match | list[Match] | dict[str, Any],
    compiler: str | Callable[..., Any] | None = "inductor",
    name: str = "FusedModule",
) -> None:
    """Compile the matched subgraph into a :class:`FusedModule` called in its place."""
    _check_compiler(sch, compiler)
    if not isinstance(name, str) or not name.isidentifier():
        raise FuseError(
            "name must be an identifier (the new child is called <name>_<k>)",
            path=sch.path, primitive=NAME, values={"name": name},
            fix=f"sch[{sch.path!r}].fuse(match, name='BiasGeLU')",
        )
    matches = resolve(sch, subgraph, NAME, FuseError)
    if len(matches) != 1:
        raise FuseError(
            f"fuse compiles one subgraph at a time, got {len(matches)} matches",
            path=sch.path, primitive=NAME, values={"matches": len(matches)},
            fix=f"fuse them one by one: for m in matches: sch[{sch.path!r}].fuse(m)",
        )
    match = matches[0]
    graph_module, _, outputs = extract(match)
    fused = FusedModule(graph_module, len(outputs), compiler)
    splice(sch, [match], fused, name, NAME, FuseError, [outputs])
