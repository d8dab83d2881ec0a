"""The tracer behind ``Schedule.trace``: one module (and only that one) becomes a graph.

This module builds the traced module and installs it in place (:func:`trace_module`), and
holds the public API (``__all__``). The parts live beside it in :mod:`torchloom.graph`:
``guards``, ``graph_module``, ``proxies``, ``fake`` (tensors without data), ``binding``
(arguments), ``tracer``, ``passes`` and ``examples`` (example and dummy inputs).

Preconditions and limits, in short: tracing runs the module once on example inputs
(given, or captured from dummy inputs made from the config), so control flow and
non-tensor arguments are specialised to that call and guarded (a later call that would
differ raises TraceGuardError); the KV cache is traced off; a model on meta is traced on
fake tensors. Paths, parameters and state-dict keys do not change, and the traced module
is the same object. Why torch.fx rather than torch.export, the value-carrying proxies,
the hierarchy, the leaves, every limit and the thread lock: docs/design/tracing.md.

>>> import torch
>>> from torch import nn
>>> mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
>>> keys = list(mlp.state_dict())
>>> gm = trace_module(mlp, example_inputs=(torch.randn(3, 4),))
>>> gm is mlp, isinstance(mlp, nn.Sequential), is_traced(mlp)   # changed in place
(True, True, True)
>>> [n.op for n in mlp.graph.nodes if not is_guard(n)]   # guards check the inputs
['placeholder', 'call_module', 'call_module', 'call_module', 'output']
>>> list(mlp.state_dict()) == keys
True
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch import nn

from ..core.errors import TraceError
from ..core.marks import marks_of, transfer_hooks
from ..core.schedule import join_path
from .binding import _bind
from .examples import dummy_inputs, example_inputs_for
from .fake import fake_values, meta_values, on_meta, value_mode
from .graph_module import (
    TracedGraphModule,
    _has_hooks,
    _instance_class,
    _own_forward,
    is_leaf,
    is_traced,
)
from .guards import is_guard
from .passes import _follow_training_flag, clean_graph
from .tracer import TRACE_LOCK, _modes, _patched_factories, _restore_modes, _Tracer

__all__ = [
    "TRACERS",
    "TRACE_LOCK",
    "TracedGraphModule",
    "is_traced",
    "is_guard",
    "is_leaf",
    "trace_module",
    "example_inputs_for",
    "dummy_inputs",
    "value_mode",
    "fake_values",
    "meta_values",
    "on_meta",
]

TRACERS = ("auto", "fx")


def _finish_module(original: nn.Module, graph: fx.Graph, constants: dict[str, torch.Tensor],
                   ) -> TracedGraphModule:
    """Wrap ``graph`` in a :class:`TracedGraphModule` that looks like ``original``."""
    traced_from = original.traced_from if is_traced(original) else type(original)
    gm = TracedGraphModule({}, fx.Graph(), class_name=traced_from.__name__)
    gm.__class__ = _instance_class(traced_from)
    # The module tree, parameters and buffers of the original, in its order.
    gm._modules = dict(original._modules)
    gm._parameters = dict(original._parameters)
    gm._buffers = dict(original._buffers)
    gm._non_persistent_buffers_set = set(original._non_persistent_buffers_set)
    for name, tensor in constants.items():
        gm.register_buffer(name, tensor, persistent=False)
    for key, value in original.__dict__.items():
        if key not in gm.__dict__ and key != "forward":
            gm.__dict__[key] = value
    gm.training = original.training
    gm.graph = graph
    clean_graph(gm)
    return gm


def _trace_one(module: nn.Module, path: str, example: tuple[tuple[Any, ...], dict[str, Any]] | None,
               leaf: Callable[[nn.Module, str], bool], concrete_args: dict[str, Any] | None,
               fake_mode: Any = None) -> tuple[fx.Graph, _Tracer]:
    with_values = example is not None
    tracer = _Tracer(path, leaf, with_values, fake_mode if with_values else None)
    args, kwargs = example if example is not None else ((), {})
    tracer.spec = _bind(module, path, args, kwargs, concrete_args, with_values)
    modes = _modes(module)
    for m in module.modules():
        m.training = True  # trace in training mode, dropout follows the flag afterwards
    try:
        with TRACE_LOCK, torch.random.fork_rng(devices=[]), _patched_factories(tracer):
            graph = tracer.trace(module)
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every trace failure is reported the same way
        raise TraceError(
            f"tracing {type(module).__name__} failed: {type(exc).__name__}: {exc}",
            path=path,
            primitive="trace",
            values={"module": type(module).__name__, "tracer": "auto" if with_values else "fx"},
            fix=_trace_fix(path, with_values),
        ) from exc
    finally:
        _restore_modes(modes)
    _follow_training_flag(graph)
    return graph, tracer


def _trace_fix(path: str, with_values: bool) -> str:
    if not with_values:
        return (f"trace with example values: sch[{path!r}].trace(example_inputs=(...)), or "
                f"keep the failing sub-module opaque: sch[{path!r}].trace(leaf_modules=[...])")
    return (f"keep the failing sub-module opaque: sch[{path!r}].trace(leaf_modules=[...]), or "
            "pass other example_inputs")


def trace_module(
    module: nn.Module,
    *,
    path: str = "",
    example_inputs: Any = None,
    leaf_modules: Sequence[str] = (),
    flatten: bool = False,
    tracer: str = "auto",
    concrete_args: dict[str, Any] | None = None,
    expand: Callable[[str], bool] | None = None,
    must_trace: Sequence[str] = (),
    descend: Sequence[str] = (),
    must_call: Sequence[str] = (),
) -> TracedGraphModule:
    """Trace ``module``: it becomes, in place, a :class:`TracedGraphModule` (returned).

    Its sub-modules, parameters and buffers are kept; traced children are changed in
    place too. On error nothing is changed.

    Args:
        module: the module to trace (its ``forward`` must not be replaced on the instance).
        path: its schedule path (for messages, and the absolute paths of ``leaf_modules``).
        example_inputs: a tuple of positional arguments, a dict of keyword arguments, a
            ``(args, kwargs)`` pair, or None (then the trace is symbolic, as ``tracer="fx"``).
        leaf_modules: class names or paths (absolute, or relative to ``module``) of modules
            to keep opaque.
        flatten: inline everything down to the leaves into one graph.
        tracer: ``"auto"`` (value-carrying proxies when example inputs are known) or
            ``"fx"`` (symbolic only).
        concrete_args: arguments to specialise to constants.
        expand: for hierarchical tracing, ``expand(child_path)`` says whether a non-leaf
            child is traced into its own graph (default: all) or kept opaque.
        must_trace: paths (absolute) that must end up traced; if one does not, a
            TraceError is raised and nothing is changed.
        descend: paths (absolute) of modules traced into although they are leaves by
            default: torch.nn modules that hold others, such as an ``nn.TransformerEncoder``
            on the way to its ``layers`` (:func:`is_leaf`).
        must_call: paths (absolute) that must be called as ``call_module`` nodes of a
            traced graph (leaves kept opaque, e.g. an ``nn.TransformerEncoderLayer``); as
            ``must_trace``.

    Raises:
        TraceError: naming the path of the module that failed and why.
    """
    if tracer not in TRACERS:
        raise TraceError(
            f"unknown tracer {tracer!r}",
            path=path, primitive="trace", values={"tracer": tracer, "tracers": list(TRACERS)},
            fix=f"use one of {', '.join(TRACERS)}",
        )
    if _own_forward(module):
        raise TraceError(
            f"the forward of this {type(module).__name__} was replaced on the instance "
            "(checkpoint, fork_rng or a row-parallel sync); it stays a leaf",
            path=path, primitive="trace",
            values={"module": type(module).__name__,
                    "marks": sorted(marks_of(module))},
            fix="trace before applying checkpoint/fork_rng/sync, or trace its parent or its "
            "children instead",
        )
    example = _normalise_example(example_inputs, path) if tracer == "auto" else None
    fake_mode = value_mode(module, example) if example is not None else None
    if fake_mode is not None:  # values without data: meta tensors, fake where code needs it
        example = meta_values(example)
    leaves = tuple(leaf_modules)
    installs: list[tuple[nn.Module, str, nn.Module, TracedGraphModule, str]] = []
    with TRACE_LOCK:
        gm = _trace_tree(module, path, example, leaves, flatten, concrete_args, expand,
                         installs, fake_mode, frozenset(descend))
    reached = {path} | {install[4] for install in installs}
    graphs = [(path, gm.graph)] + [(install[4], install[3].graph) for install in installs]
    called = {join_path(where, node.target) for where, graph in graphs
              for node in graph.nodes if node.op == "call_module"}
    missing = [p for p in must_trace if p not in reached]
    missing += [p for p in must_call if p not in called and p not in reached]
    if missing:
        raise TraceError(
            "these levels were not reached: the module never calls them, or they are "
            "leaves (torch.nn built-ins, checkpointed or fork_rng modules)",
            path=path, primitive="trace_until", values={"levels": missing},
            fix="pick levels that the model calls and that have children",
        )
    # Nothing in the original module tree changes until every module traced; then each
    # traced module takes the place of its original *in place*, so every reference to it
    # (the parent's slot, the user's variables, schedule nodes) stays valid.
    for _, _, old, new, _ in installs:
        _morph(old, new)
    _morph(module, gm)
    return module  # type: ignore[return-value]


def _normalise_example(example: Any, path: str) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if example is None:
        return None
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        if len(example) == 2 and isinstance(example[0], (tuple, list)) and \
                isinstance(example[1], dict):
            return tuple(example[0]), dict(example[1])
        return tuple(example), {}
    raise TraceError(
        f"example_inputs must be a tuple, a dict or an (args, kwargs) pair, not a "
        f"{type(example).__name__}",
        path=path, primitive="trace", values={"example_inputs": type(example).__name__},
        fix="e.g. example_inputs=(torch.randn(2, 16, 32),)",
    )


def _trace_tree(module: nn.Module, path: str, example: Any, leaves: tuple[str, ...],
                flatten: bool, concrete_args: dict[str, Any] | None,
                expand: Callable[[str], bool] | None,
                installs: list[tuple[nn.Module, str, nn.Module, TracedGraphModule, str]],
                fake_mode: Any = None, descend: frozenset[str] = frozenset()
                ) -> TracedGraphModule:
    def relative_leaf(m: nn.Module, qualified: str) -> bool:
        full = join_path(path, qualified)
        if is_leaf(m, full, leaves) or qualified in leaves:
            return True
        if is_traced(m) and not flatten:
            return True
        if flatten:
            return _has_hooks(m)
        return True  # hierarchical: every called child is a node of this graph

    graph, tracer = _trace_one(module, path, example, relative_leaf, concrete_args, fake_mode)
    children: list[tuple[str, nn.Module, TracedGraphModule]] = []
    if not flatten:
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            target = node.target
            child = module.get_submodule(target)
            child_path = join_path(path, target)
            if (is_leaf(child, child_path, leaves) and child_path not in descend) or \
                    target in leaves or is_traced(child):
                continue
            if expand is not None and not expand(child_path):
                continue
            if _own_forward(child):
                continue
            if any(t == target for t, _, _ in children):
                continue  # a child called twice is traced once (for its first call)
            child_example = tracer.calls.get(target) if tracer.with_values else None
            traced = _trace_tree(child, child_path, child_example, leaves, False, None, expand,
                                 installs, fake_mode, descend)
            children.append((target, child, traced))
    tracer.values.clear()
    tracer.calls.clear()
    gm = _finish_module(module, graph, tracer.constants)
    installs.extend((gm, target, child, traced, join_path(path, target))
                    for target, child, traced in children)
    return gm


def _morph(old: nn.Module, new: TracedGraphModule) -> None:
    """Turn ``old`` into ``new`` in place (class and state), carrying its hooks over."""
    transfer_hooks(old, new)
    new.training = old.training
    state = new.__dict__
    object.__setattr__(old, "__class__", type(new))
    object.__setattr__(old, "__dict__", state)
    old.graph = state["_graph"]  # the graph's owner is now `old`; recompiles
