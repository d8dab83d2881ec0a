"""``find``: locate nodes and subgraphs in traced graphs, as named :class:`Match` objects.

What ``find`` accepts:

* a **regex** (``str``): every ``call_module`` node whose module path, relative to the
  schedule node ``find`` is called on, contains a match (``re.search``); one node per match;
* a **node predicate**: a callable whose single parameter is named ``node``, called on every
  node (``lambda node: node.op == "call_module"``); one node per match;
* a **pattern function**: a function of tensors written with ordinary torch calls,
  ``lambda x, b: F.gelu(x + b)``; its parameters stand for any value;
* a **pattern module**: an ``nn.Module`` (a :class:`Pattern`, or its class) whose
  ``forward`` is the pattern; its sub-modules match modules of the same kind, and a
  :class:`ModulePattern` matches any module whose path matches its regex.

How a pattern matches (the graph node on the right, the pattern node on the left):

* the same operation, however it is spelled: ``x + b``, ``torch.add(x, b)`` and
  ``x.add(b)`` are one operation; so are ``F.gelu``, ``torch._C._nn.gelu``, ``nn.GELU``
  and transformers' GELU activations, or ``F.linear``, ``nn.Linear`` and transformers'
  ``Conv1D`` (a module call matches its functional form and the other way round);
* **data edges are checked**: every tensor argument of a pattern node must be the graph
  node matched to it, and a pattern parameter used twice must be the same graph value
  (so ``relu(x) + x`` does not match an ``add`` whose operand is not the relu's input);
  ``add`` and ``mul`` match in either operand order;
* constants (``dim=-1``, ``approximate="tanh"``, shapes) are not compared;
* matches do not overlap and come in graph order; graphs are searched in schedule order
  (this node's graph first, then the nested graphs below it).

``find`` needs a traced module (``sch.trace()``); the guards the tracer inserts are never
part of a match.

>>> import torch, torch.nn.functional as F, torchloom as tl
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc = nn.Linear(4, 4)
...     def forward(self, x):
...         y = self.fc(x)
...         return F.relu(y) + y, torch.relu(x) + y
>>> sch = tl.create_schedule(Block())
>>> sch.trace(tracer="fx")
>>> [m.nodes for m in sch.find(lambda x: F.relu(x) + x)]    # relu(x) + y does not match
[[relu, add]]
>>> [m.nodes for m in sch.find("fc")]
[[fc]]
>>> m = sch.find(lambda x, w, b: F.relu(F.linear(x, w, b)))[0]   # nn.Linear ~ F.linear
>>> m.nodes, m.anchor, m.inputs, m.path
([fc, relu], relu, [x], '')
>>> m.outputs()   # the values used outside the match
[fc, relu]
"""

from __future__ import annotations

import inspect
import operator
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..core.errors import PatternError, TraceError
from ..core.patterns import BoundedRegex
from .graph_module import is_leaf, is_traced
from .guards import is_guard
from .tracer import TRACE_LOCK

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["Match", "Pattern", "ModulePattern", "call_module", "find", "node_key"]


# --------------------------------------------------------------------------- public types


class Pattern(nn.Module):
    """Base class of pattern modules: write ``forward`` with torch calls and sub-modules.

    A sub-module matches a module call of the same kind (``nn.GELU`` also matches
    ``F.gelu``); use :class:`ModulePattern` to match modules by path.
    """


class ModulePattern(nn.Module):
    """A placeholder sub-module of a :class:`Pattern`: matches any module call whose path
    (relative to the graph) matches ``name_regex`` (``re.search``)."""

    def __init__(self, name_regex: str) -> None:
        super().__init__()
        self.name_regex = name_regex

    def forward(self, *args: Any) -> Any:  # never run: only traced as a leaf
        raise PatternError("a ModulePattern only stands for a module inside a pattern",
                           primitive="find", fix="use it inside a Pattern given to find()")


def call_module(name_regex: str, *args: Any) -> Any:
    """In a pattern function: a call of any module whose path matches ``name_regex``.

    >>> import torchloom.graph.pattern as P
    >>> pattern = lambda x: P.call_module(r"query|key", x) * 2
    """
    for a in args:
        if issubclass(type(a), fx.Proxy):
            return a.tracer.create_proxy("call_function", call_module, (name_regex, *args), {})
    raise PatternError("call_module() only stands for a module call inside a pattern",
                       primitive="find", fix="use it inside a pattern function given to find()")


@dataclass(eq=False)
class Match:
    """One occurrence of a pattern in a traced graph.

    Attributes:
        path: schedule path of the graph module that owns the nodes.
        nodes: the matched nodes, in graph order (pattern parameters are not nodes of the
            match: they are its inputs).
        anchor: the node whose value is the pattern's result (the last one for a tuple).
        inputs: the graph values the match reads from outside it, in first-use order.
        bindings: pattern parameter name -> the graph node it stands for.
        graph_module: the graph module that owns the nodes.
    """

    path: str
    nodes: list[fx.Node]
    anchor: fx.Node
    inputs: list[fx.Node]
    bindings: dict[str, fx.Node] = field(default_factory=dict)
    graph_module: fx.GraphModule | None = field(default=None, repr=False)
    source: tuple[Any, Any, bool] | None = field(default=None, repr=False)
    # (the schedule node find ran on, the pattern, whether it was a node predicate)

    def __iter__(self) -> Iterator[tuple[str, fx.Node]]:
        """``(graph path, node)`` pairs, as Slapo's subgraph lists."""
        return iter([(self.path, n) for n in self.nodes])

    def __len__(self) -> int:
        return len(self.nodes)

    def is_valid(self) -> bool:
        """Whether every node is still in its graph (a later fuse or replace may have
        removed them)."""
        gm = self.graph_module
        if gm is None:
            return False
        alive = set(gm.graph.nodes)
        return all(n in alive for n in self.nodes)

    def outputs(self) -> list[fx.Node]:
        """The matched nodes whose values are used outside the match, in graph order."""
        inside = set(self.nodes)
        return [n for n in self.nodes if any(u not in inside for u in n.users)]


# --------------------------------------------------------------------------- op keys


_OPERATORS = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul", operator.truediv: "div",
    operator.itruediv: "div", operator.floordiv: "floor_divide", operator.matmul: "matmul",
    operator.neg: "neg", operator.pow: "pow", operator.getitem: "getitem",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.and_: "and", operator.or_: "or",
}
_ALIASES = {"true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub",
            "negative": "neg", "absolute": "abs", "scaled_dot_product_attention": "sdpa"}
_COMMUTATIVE = {"add", "mul"}

# Module classes (by name, through the class hierarchy) and the operation they compute.
_MODULE_OPS = {
    "Linear": "linear", "Conv1D": "linear", "GELU": "gelu", "GELUActivation": "gelu",
    "NewGELUActivation": "gelu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu",
    "FastGELUActivation": "gelu", "QuickGELUActivation": "quick_gelu", "ReLU": "relu",
    "SiLU": "silu", "SiLUActivation": "silu", "Tanh": "tanh", "Sigmoid": "sigmoid",
    "Softmax": "softmax", "Dropout": "dropout", "LayerNorm": "layer_norm",
    "Embedding": "embedding", "Conv1d": "conv1d", "Conv2d": "conv2d", "GroupNorm": "group_norm",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "Mish": "mish",
    "LeakyReLU": "leaky_relu", "ELU": "elu", "Hardswish": "hardswish",
}


def _function_key(target: Any) -> Any:
    if target in _OPERATORS:
        return _OPERATORS[target]
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if name and (module.startswith("torch") or _is_torch_builtin(target, name)):
        return _ALIASES.get(name, name)
    return target


def _is_torch_builtin(target: Any, name: str) -> bool:
    return any(getattr(ns, name, None) is target
               for ns in (torch, F, torch.Tensor, torch._C._nn, torch.special))


def _module_class(module: nn.Module) -> type:
    return module.traced_from if is_traced(module) else type(module)


def _module_key(module: nn.Module) -> Any:
    for cls in _module_class(module).__mro__:
        op = _MODULE_OPS.get(cls.__name__)
        if op is not None:
            if cls.__name__ == "Conv1D" and not cls.__module__.startswith("transformers"):
                continue
            return op
    return ("module", _module_class(module))


def node_key(node: fx.Node, owner: nn.Module | None) -> Any:
    """The operation a node computes, the same for every spelling of it.

    >>> g = fx.symbolic_trace(lambda x: (x + 1).relu() * torch.relu(x))
    >>> [node_key(n, None) for n in g.graph.nodes if n.op.startswith("call")]
    ['add', 'relu', 'relu', 'mul']
    """
    if node.op == "call_function":
        return _function_key(node.target)
    target = cast(str, node.target)  # every other op names its target
    if node.op == "call_method":
        return _ALIASES.get(target, target)
    if node.op == "call_module" and owner is not None:
        try:
            return _module_key(owner.get_submodule(target))
        except AttributeError:
            return ("module", target)
    return (node.op, target)


def _data_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


# --------------------------------------------------------------------------- patterns


@dataclass
class _Compiled:
    """A pattern traced into a graph."""

    graph: fx.Graph
    owner: nn.Module | None
    outputs: list[fx.Node]
    params: list[fx.Node]


class _PatternTracer(fx.Tracer):
    """Traces a pattern. fx patches ``nn.Module.__call__`` process-wide while it traces, so
    module calls made meanwhile by other threads are passed through untouched (and the trace
    itself holds :data:`torchloom.graph.tracer.TRACE_LOCK`)."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, ModulePattern) or is_leaf(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def is_node_predicate(fn: Any) -> bool:
    """Whether ``fn`` is a node predicate: a callable with a single parameter ``node``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].name == "node"


def _compile(pattern: Any, path: str) -> _Compiled:
    if isinstance(pattern, type) and issubclass(pattern, nn.Module):
        try:
            pattern = pattern()
        except TypeError as exc:
            raise PatternError(
                f"pattern class {pattern.__name__} cannot be built without arguments: {exc}",
                path=path, primitive="find", values={"pattern": pattern.__name__},
                fix="pass an instance, or give the class defaults",
            ) from None
    try:
        with TRACE_LOCK:
            graph = _PatternTracer().trace(pattern)
        owner: nn.Module | None = pattern if isinstance(pattern, nn.Module) else None
    except Exception as exc:  # noqa: BLE001 - any trace failure of a pattern
        raise PatternError(
            f"the pattern cannot be traced: {type(exc).__name__}: {exc}",
            path=path, primitive="find", values={"pattern": _describe(pattern)},
            fix="write the pattern with torch calls on its arguments only, e.g. "
            "lambda x, b: F.gelu(x + b)",
        ) from None
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    if not outputs or not all(isinstance(o, fx.Node) for o in outputs) or \
            any(o.op in ("placeholder", "get_attr") for o in outputs):
        raise PatternError(
            "the pattern must compute something from its arguments and return it",
            path=path, primitive="find", values={"pattern": _describe(pattern)},
            fix="e.g. lambda x, b: F.gelu(x + b)",
        )
    params = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
    return _Compiled(graph, owner, outputs, params)


def _describe(pattern: Any) -> str:
    if isinstance(pattern, nn.Module):
        return type(pattern).__name__
    return getattr(pattern, "__qualname__", repr(pattern))


class _Matcher:
    """Backtracking subgraph isomorphism on data edges, from the pattern's outputs."""

    def __init__(self, compiled: _Compiled, owner: nn.Module) -> None:
        self.p = compiled
        self.owner = owner
        self._regexes: dict[str, BoundedRegex] = {}

    def _regex(self, pattern: str) -> BoundedRegex:
        """The bounded form of a module-name pattern, compiled once per search."""
        if pattern not in self._regexes:
            self._regexes[pattern] = BoundedRegex(pattern, primitive="find", path="")
        return self._regexes[pattern]

    def key(self, pn: fx.Node) -> Any:
        return node_key(pn, self.p.owner)

    def match_node(self, pn: fx.Node, gn: fx.Node, env: dict[fx.Node, fx.Node],
                   taken: set[fx.Node]) -> dict[fx.Node, fx.Node] | None:
        if pn.op in ("placeholder", "get_attr"):
            bound = env.get(pn)
            if bound is None:
                return {**env, pn: gn}
            return env if bound is gn else None
        if pn in env:
            return env if env[pn] is gn else None
        if gn in taken or is_guard(gn) or gn.op in ("placeholder", "output", "get_attr"):
            return None
        if any(v is gn for k, v in env.items() if k.op not in ("placeholder", "get_attr")):
            return None
        pdata, gdata, ok = self._compare(pn, gn)
        if not ok:
            return None
        env = {**env, pn: gn}
        orders = [gdata]
        if len(pdata) == 2 and len(gdata) == 2 and self.key(pn) in _COMMUTATIVE:
            orders.append([gdata[1], gdata[0]])
        result: dict[fx.Node, fx.Node] | None
        for order in orders:
            result = env
            for pa, ga in zip(pdata, order, strict=True):
                result = self.match_node(pa, ga, result, taken)
                if result is None:
                    break
            if result is not None:
                return result
        return None

    def _compare(self, pn: fx.Node, gn: fx.Node) -> tuple[list[fx.Node], list[fx.Node], bool]:
        """Whether the two nodes compute the same operation; their data arguments to pair."""
        gdata = _data_args(gn)
        if pn.op == "call_function" and pn.target is call_module:
            ok = gn.op == "call_module" and self._regex(cast(str, pn.args[0])).search(
                cast(str, gn.target))
            pdata = _data_args(pn)
            return pdata, gdata, ok and len(pdata) == len(gdata)
        if pn.op == "call_module" and isinstance(  # (only a pattern module has an owner)
                sub := cast(nn.Module, self.p.owner).get_submodule(cast(str, pn.target)),
                ModulePattern):
            pdata = _data_args(pn)
            ok = gn.op == "call_module" and self._regex(sub.name_regex).search(
                cast(str, gn.target))
            return pdata, gdata, ok and len(pdata) == len(gdata)
        pdata = _data_args(pn)
        if self.key(pn) != node_key(gn, self.owner):
            return pdata, gdata, False
        if (pn.op == "call_module") != (gn.op == "call_module"):
            # A module call and its functional form: the module's input is the first data
            # argument; the function's weights are the module's own parameters.
            n = min(len(pdata), len(gdata))
            extra = pdata[n:]
            if not all(a.op in ("placeholder", "get_attr") and len(a.users) == 1
                       for a in extra):
                return pdata, gdata, False
            return pdata[:n], gdata[:n], n >= 1
        return pdata, gdata, len(pdata) == len(gdata)

    def find(self, graph: fx.Graph, taken: set[fx.Node]) -> list[dict[fx.Node, fx.Node]]:
        found = []
        nodes = list(graph.nodes)
        first, rest = self.p.outputs[0], self.p.outputs[1:]
        for gn in nodes:
            env = self.match_node(first, gn, {}, taken)
            if env is None:
                continue
            env = self._match_rest(rest, nodes, env, taken)
            if env is None:
                continue
            found.append(env)
            taken |= {v for k, v in env.items() if k.op not in ("placeholder", "get_attr")}
        return found

    def _match_rest(self, outputs: list[fx.Node], nodes: list[fx.Node],
                    env: dict[fx.Node, fx.Node], taken: set[fx.Node]
                    ) -> dict[fx.Node, fx.Node] | None:
        if not outputs:
            return env
        for gn in nodes:
            found = self.match_node(outputs[0], gn, env, taken)
            if found is not None:
                done = self._match_rest(outputs[1:], nodes, found, taken)
                if done is not None:
                    return done
        return None


# --------------------------------------------------------------------------- find


def traced_graphs(sch: Schedule) -> list[Schedule]:
    """The schedule nodes at or below ``sch`` whose module is a traced graph, pre-order."""
    return [node for _, node in sch.named_schedules() if is_traced(node.mod)]


def _gm(owner: Schedule) -> fx.GraphModule:
    return cast(fx.GraphModule, owner.mod)  # a node of traced_graphs()


def _relative(sch: Schedule, path: str) -> str:
    if not sch.path:
        return path
    return path[len(sch.path) + 1:] if path.startswith(sch.path + ".") else ""


def _make_match(owner: Schedule, env: dict[fx.Node, fx.Node], compiled: _Compiled,
                order: dict[fx.Node, int], source: tuple[Any, Any, bool]) -> Match:
    nodes = sorted((v for k, v in env.items() if k.op not in ("placeholder", "get_attr")),
                   key=order.__getitem__)
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in _data_args(n):
            if a not in inside and a not in inputs:
                inputs.append(a)
    anchor = env[compiled.outputs[-1]]
    bindings = {k.name: v for k, v in env.items() if k.op in ("placeholder", "get_attr")}
    return Match(owner.path, nodes, anchor, inputs, bindings, _gm(owner), source)


def find(sch: Schedule, pattern: Any, predicate: bool = False) -> list[Match]:
    """All non-overlapping matches of ``pattern`` in the traced graphs at or below ``sch``
    (``predicate=True``: a callable ``pattern`` is a node predicate whatever its signature).
    """
    owners = traced_graphs(sch)
    if not owners:
        raise TraceError(
            "find needs a traced module, and nothing at or below this node is traced",
            path=sch.path, primitive="find", values={"module": type(sch.mod).__name__},
            fix=f"trace it first: sch[{sch.path!r}].trace() (flatten=True to match "
            "across sub-modules)",
        )
    is_predicate = predicate or (not isinstance(pattern, (nn.Module, type, str))
                                 and callable(pattern) and is_node_predicate(pattern))
    source = (sch, pattern, is_predicate)
    matches: list[Match] = []
    if isinstance(pattern, str):
        regex = BoundedRegex(pattern, primitive="find", path=sch.path)
        for owner in owners:
            prefix = _relative(sch, owner.path)
            for node in _gm(owner).graph.nodes:
                if node.op == "call_module" and \
                        regex.search(f"{prefix}.{node.target}" if prefix else node.target):
                    matches.append(_single(owner, node, source))
        return matches
    if is_predicate:
        for owner in owners:
            for node in _gm(owner).graph.nodes:
                if not is_guard(node) and pattern(node):
                    matches.append(_single(owner, node, source))
        return matches
    if not (callable(pattern) or isinstance(pattern, nn.Module)):
        raise PatternError(
            f"find takes a regex, a node predicate, a pattern function or a pattern module, "
            f"not a {type(pattern).__name__}",
            path=sch.path, primitive="find", values={"pattern": repr(pattern)[:60]},
            fix="e.g. sch.find(lambda x, b: F.gelu(x + b)) or sch.find(r'attn\\.c_attn')",
        )
    compiled = _compile(pattern, sch.path)
    taken: set[fx.Node] = set()
    for owner in owners:
        order = {n: i for i, n in enumerate(_gm(owner).graph.nodes)}
        matcher = _Matcher(compiled, owner.mod)
        found = [_make_match(owner, env, compiled, order, source)
                 for env in matcher.find(_gm(owner).graph, taken)]
        matches += sorted(found, key=lambda m: order[m.nodes[0]])
    return matches


def _single(owner: Schedule, node: fx.Node, source: tuple[Any, Any, bool]) -> Match:
    inputs: list[fx.Node] = []
    for a in _data_args(node):
        if a not in inputs:
            inputs.append(a)
    return Match(owner.path, [node], node, inputs, {}, _gm(owner), source)
