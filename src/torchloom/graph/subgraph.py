"""Graph surgery shared by the subgraph primitives (``replace(target_ops=...)``, ``fuse``,
``checkpoint(subgraph=...)``); not public.

* :func:`resolve` turns what the user passed (a ``Match``, a list of them, or the recorded
  reference ``{"pattern": ..., "index": ...}``) into valid matches below a node;
* :func:`reference` is the recorded form of matches: the pattern and the indices of the
  matches among ``find(pattern)`` *at the time of the call*, so a replay finds them again;
* :func:`extract` copies a match into a standalone graph module (inputs as placeholders,
  the values used outside it as outputs), leaving parameters and modules where they are;
* :func:`splice` puts one call (a module or a function) in place of one or more matches.
"""

from __future__ import annotations

import inspect
import operator
from typing import TYPE_CHECKING, Any, Callable, cast

import torch.fx as fx
from torch import nn

from ..core.errors import PatternError, ScheduleError
from ..core.marks import LEAF, set_mark
from .passes import clean_graph
from .pattern import Match, find

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["resolve", "reference", "extract", "splice", "owner_of", "unique_name",
           "GraphHolder", "check_arity", "check_one_graph"]


# --------------------------------------------------------------------------- references


def _as_list(target: Any) -> list[Any] | None:
    if isinstance(target, Match):
        return [target]
    if isinstance(target, (list, tuple)) and target and \
            all(isinstance(m, Match) for m in target):
        return list(target)
    return None


def resolve(sch: Schedule, target: Any, primitive: str, error: type[ScheduleError]
            ) -> list[Match]:
    """The matches ``target`` stands for, checked to be alive and below ``sch``."""
    matches = _as_list(target)
    if matches is None and isinstance(target, dict) and "pattern" in target:
        matches = _from_reference(sch, target, primitive)
    if matches is None:
        raise error(
            f"expected a Match from find() (or a list of them), not {_type_name(target)}",
            path=sch.path, primitive=primitive, values={"target": repr(target)[:80]},
            fix=f"m = sch[{sch.path!r}].find(pattern); sch[{sch.path!r}].{primitive}(m[0])",
        )
    for m in matches:
        inside = sch.path == "" or m.path == sch.path or m.path.startswith(sch.path + ".")
        if not inside:
            raise error(
                f"the match is in the graph of {m.path!r}, which is not at or below this node",
                path=sch.path, primitive=primitive, values={"match_path": m.path},
                fix=f"call it on the node that owns the graph: sch[{m.path!r}].{primitive}(...)",
            )
        if not m.is_valid() or owner_of(sch, m).mod is not m.graph_module:
            raise PatternError(
                "the match is stale: its nodes are no longer in the graph (an earlier fuse, "
                "replace or trace changed it)",
                path=sch.path, primitive=primitive,
                values={"nodes": [n.name for n in m.nodes]},
                fix="run find() again after each change and use the fresh matches",
            )
        bad = [n.name for n in m.nodes if n.op in ("placeholder", "output", "get_attr")]
        if bad:
            raise error(
                "a match to replace must hold computations only, not inputs, parameters or "
                "the output",
                path=sch.path, primitive=primitive, values={"nodes": bad},
                fix="find a pattern of operations (its parameters are the inputs)",
            )
    return matches


def _type_name(value: Any) -> str:
    return "a list of " + type(value[0]).__name__ if isinstance(value, list) and value \
        else f"a {type(value).__name__}"


def _from_reference(sch: Schedule, ref: dict[str, Any], primitive: str) -> list[Match]:
    at = ref.get("at", sch.path)
    finder = cast("Schedule", sch.root[at]) if at else sch.root  # a recorded node's path
    found = find(finder, ref["pattern"], predicate=bool(ref.get("predicate", False)))
    index = ref.get("index", 0)
    indices = list(index) if isinstance(index, (list, tuple)) else [index]
    if not indices or not all(isinstance(i, int) and 0 <= i < len(found) for i in indices):
        raise PatternError(
            f"the recorded matches {indices} of the pattern are not there: find() gives "
            f"{len(found)} now",
            path=sch.path, primitive=primitive,
            values={"pattern": getattr(ref["pattern"], "__qualname__", ref["pattern"]),
                    "found": len(found)},
            fix="replay the recipe on the model it was recorded on, or edit the index",
        )
    return [found[i] for i in indices]


def reference(sch: Schedule, matches: list[Match]) -> Any:
    """The recordable form of ``matches``: ``{"pattern", "index"[, "at"]}`` when they came
    from ``find`` and can be found again; otherwise the matches themselves (which a recipe
    cannot serialise)."""
    sources = {id(m.source[0]) for m in matches if m.source is not None}
    if len(sources) != 1 or any(m.source is None for m in matches):
        return matches if len(matches) > 1 else matches[0]
    finder, pattern, predicate = matches[0].source  # type: ignore[misc]
    if any(m.source[1] is not pattern for m in matches):  # type: ignore[index]
        return matches if len(matches) > 1 else matches[0]
    current = find(finder, pattern, predicate=predicate)
    indices = []
    for m in matches:
        same = [i for i, c in enumerate(current) if c.nodes == m.nodes]
        if not same:
            return matches if len(matches) > 1 else matches[0]
        indices.append(same[0])
    ref: dict[str, Any] = {"pattern": pattern,
                           "index": indices[0] if len(indices) == 1 else indices}
    if finder.path != sch.path:
        ref["at"] = finder.path
    if predicate and not isinstance(pattern, str):
        ref["predicate"] = True
    return ref


def recorded_matches(sch: Schedule, target: Any) -> Any:
    """How a primitive's match argument is recorded: a ``Match`` or a list of them as
    their :func:`reference`; anything else (a recorded reference, None) as it is."""
    if isinstance(target, Match):
        target = [target]
    if isinstance(target, (list, tuple)) and target and all(isinstance(m, Match) for m in target):
        return reference(sch, list(target))
    return target


# --------------------------------------------------------------------------- helpers


def owner_of(sch: Schedule, match: Match) -> Schedule:
    """The schedule node whose module owns the match's graph."""
    root = sch.root
    return root[match.path] if match.path else root  # type: ignore[return-value]


def unique_name(module: nn.Module, base: str) -> str:
    """``base_k`` with the first free ``k``."""
    k = 0
    while hasattr(module, f"{base}_{k}"):
        k += 1
    return f"{base}_{k}"


class GraphHolder(nn.Module):
    """Base of modules that run an extracted graph they do not own.

    The graph module is kept as a plain attribute (not a registered sub-module): the
    modules and parameters it uses stay registered where they were, so ``state_dict()`` and
    ``named_parameters()`` do not change and nothing is listed twice. The tracer keeps it
    opaque (a ``LEAF`` mark on the class).
    """

    def __init__(self, graph_module: fx.GraphModule, n_outputs: int) -> None:
        super().__init__()
        object.__setattr__(self, "graph_module", graph_module)
        self.n_outputs = n_outputs

    def run_graph(self, *args: Any) -> Any:
        gm = self.__dict__["graph_module"]
        gm.training = self.training
        return gm(*args)

    def extra_repr(self) -> str:
        nodes = [n for n in self.__dict__["graph_module"].graph.nodes
                 if n.op not in ("placeholder", "output")]
        return f"{len(nodes)} ops: " + ", ".join(str(n.target).split(".")[-1] if n.op ==
                                                   "call_module" else getattr(
                                                       n.target, "__name__", str(n.target))
                                                   for n in nodes[:8]) + \
            (", ..." if len(nodes) > 8 else "")


set_mark(GraphHolder, LEAF, True)


# --------------------------------------------------------------------------- extract


def extract(match: Match) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """A standalone graph module computing ``match``: its inputs are ``match.inputs`` (in
    order), its outputs the matched values used outside the match (one value, or a tuple).
    Modules called inside are referenced, not copied; parameters arrive as inputs."""
    owner = match.graph_module
    assert owner is not None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(match.inputs):
        env[node] = graph.placeholder(node.name if node.name.isidentifier() else f"in_{i}")
    modules: dict[str, nn.Module] = {}
    for node in match.nodes:
        if node.op == "call_module":
            assert isinstance(node.target, str)
            flat = node.target.replace(".", "_")
            modules[flat] = owner.get_submodule(node.target)
            env[node] = graph.call_module(flat, fx.node.map_arg(node.args, env.__getitem__),
                                          fx.node.map_arg(node.kwargs, env.__getitem__))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    outputs = match.outputs() or [match.anchor]
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    gm = fx.GraphModule(modules, graph, class_name="Subgraph")
    for name in list(gm._modules):  # keep the modules referenced, not registered
        module = gm._modules.pop(name)
        object.__setattr__(gm, name, module)
    uses_training = any(n.op == "get_attr" and n.target == "training" for n in graph.nodes)
    if uses_training:
        gm.training = owner.training
    gm.recompile()
    return gm, list(match.inputs), outputs


# --------------------------------------------------------------------------- splice


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def splice(
    sch: Schedule,
    matches: list[Match],
    new: nn.Module | Callable[..., Any],
    name: str | None,
    primitive: str,
    error: type[ScheduleError],
    outputs: list[list[fx.Node]],
    kwargs: dict[str, Any] | None = None,
) -> str | None:
    """Replace ``matches`` (in one graph) by one call of ``new``.

    ``outputs[i]`` are the values of match ``i`` that the call provides, in order; the call
    returns one value when there is one match with one output, else a flat tuple. Returns
    the name of the new sub-module (None for a function).
    """
    check_one_graph(sch, matches, primitive, error)
    owner_sch = owner_of(sch, matches[0])
    gm = cast(fx.GraphModule, owner_sch.mod)  # the owner of a match is a traced graph
    graph = gm.graph
    order = _position(graph)
    inside: set[fx.Node] = set()
    for m in matches:
        inside |= set(m.nodes)
    inputs: list[fx.Node] = []
    for m in matches:
        for node in m.inputs:
            if node in inside:
                raise error(
                    "the matches depend on each other; a horizontal replacement needs "
                    "parallel branches",
                    path=sch.path, primitive=primitive, values={"node": node.name},
                    fix="replace them one at a time",
                )
            if node not in inputs:
                inputs.append(node)
    flat_outputs = [o for outs in outputs for o in outs]
    users = [u for o in flat_outputs for u in o.users if u not in inside]
    last_input = max((order[n] for n in inputs), default=-1)
    first_user = min((order[u] for u in users), default=len(order))
    if last_input > first_user:
        raise error(
            "an input of the matched nodes is computed after one of their results is used; "
            "the nodes cannot be replaced by one call",
            path=sch.path, primitive=primitive,
            values={"input": next(n.name for n in inputs if order[n] == last_input)},
            fix="match a smaller (or larger) pattern so that the subgraph is self-contained",
        )
    _check_hooks(sch, matches, primitive, error, new)
    anchor = next(n for n in graph.nodes if order[n] == first_user) if users else \
        next(n for n in graph.nodes if n.op == "output")
    child_name = None
    with graph.inserting_before(anchor):
        if isinstance(new, nn.Module):
            child_name = unique_name(gm, name or type(new).__name__)
            gm.add_module(child_name, new)
            call = graph.call_module(child_name, tuple(inputs), dict(kwargs or {}))
        else:
            call = graph.call_function(new, tuple(inputs), dict(kwargs or {}))
        single = len(flat_outputs) == 1 and len(matches) == 1
        for i, out in enumerate(flat_outputs):
            value = call if single else graph.call_function(operator.getitem, (call, i))
            out.replace_all_uses_with(value, delete_user_cb=lambda u: u not in inside)
    for node in sorted(inside, key=order.__getitem__, reverse=True):
        if node.users:
            raise error(
                f"node {node.name} is still used outside the replaced nodes",
                path=sch.path, primitive=primitive, values={"users": [u.name for u in node.users]},
                fix="include its users in the pattern",
            )
        graph.erase_node(node)
    clean_graph(gm)
    owner_sch.sync_children()
    return child_name


def check_one_graph(sch: Schedule, matches: list[Match], primitive: str,
                    error: type[ScheduleError]) -> None:
    """One call can only stand for matches of one graph."""
    if any(m.graph_module is not matches[0].graph_module for m in matches):
        raise error(
            "the matches are in different graphs; one call can only replace matches of one "
            "graph",
            path=sch.path, primitive=primitive,
            values={"graphs": sorted({m.path for m in matches})},
            fix="trace the common parent with flatten=True, or replace each graph's matches "
            "separately",
        )


def _check_hooks(sch: Schedule, matches: list[Match], primitive: str,
                 error: type[ScheduleError], new: Any) -> None:
    if getattr(new, "keeps_called_modules", False):
        return  # fuse and checkpoint still call the modules (their hooks still fire)
    hooked = []
    for m in matches:
        for node in m.nodes:
            if node.op == "call_module":
                assert m.graph_module is not None and isinstance(node.target, str)
                module = m.graph_module.get_submodule(node.target)
                if any(getattr(module, a, None) for a in ("_forward_pre_hooks", "_forward_hooks",
                                                          "_backward_hooks",
                                                          "_backward_pre_hooks")):
                    hooked.append(node.target)
    if hooked:
        raise error(
            "modules in the match have hooks (e.g. a sync), which would stop firing once "
            "their calls are replaced",
            path=sch.path, primitive=primitive, values={"modules": hooked},
            fix="replace first, then apply sync/hooks to the new module",
        )


def check_arity(sch: Schedule, fn: Any, n_inputs: int, kwargs: dict[str, Any],
                primitive: str, error: type[ScheduleError], input_names: list[str]) -> None:
    """The replacement must accept the match's inputs (positionally) and ``kwargs``."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(n_inputs), **kwargs)
    except TypeError as exc:
        raise error(
            f"the replacement cannot take the match's {n_inputs} input(s) "
            f"{input_names}: {exc}",
            path=sch.path, primitive=primitive,
            values={"signature": str(sig), "inputs": input_names, "concrete_args": sorted(kwargs)},
            fix="make it accept one positional argument per input (in that order); fixed "
            "extra arguments go in concrete_args={...}",
        ) from None
