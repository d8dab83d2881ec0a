"""The tracer behind ``Schedule.trace``: one module (and only that one) becomes a graph.

Design
------
torchloom traces with :mod:`torch.fx` (the IR is ordinary torch calls: ``call_module`` for
the modules that stay opaque, ``call_function`` / ``call_method`` for torch and tensor
operations, ``get_attr`` for parameters), because that IR keeps what the schedule needs:
the modules that are not traced stay the *same objects* (so their hooks, shard records and
``state_dict`` keys survive), parameters stay the same ``Parameter`` objects, and patterns
can be written as plain ``F.gelu(x + b)`` functions.

Plain ``torch.fx.symbolic_trace`` fails on transformers 5 attention modules: they take
``**kwargs``, unpack shapes (``(*x.shape[:-1], -1, d)``), branch on shapes
(``q_len > 1``), call ``torch.arange(..., device=x.device)`` and ``torch.finfo(x.dtype)``.
With ``tracer="auto"`` (the default) torchloom traces with *value-carrying proxies*:

* the module is called once on example inputs (given as ``example_inputs``, or captured by
  running the root model on :func:`dummy_inputs` made from its config, with a forward
  pre-hook on the module, stopped as soon as the module is reached); every proxy carries the
  value the operation produced, so ``len()``, iteration, ``bool()``, ``int()`` and
  ``**kwargs`` work;
* sizes stay *symbolic* in the graph (``x.size(1)`` is a node, not a constant), so the graph
  runs on other batch sizes and sequence lengths;
* Python control flow that depends on a traced value is *specialised* to the branch the
  example took, and a guard node is left in the graph: a later call that would take the other
  branch raises :class:`~torchloom.core.errors.TraceGuardError` (never a silently wrong result);
* arguments that are not tensors (``None``, flags, numbers, strings) are specialised to the
  example's value, again with a guard; the graph module's ``forward`` keeps the original
  signature so an untraced parent can call it exactly as before;
* torch factory functions (``torch.arange``, ``torch.zeros``, ..., ``torch.finfo``) called
  with traced arguments become graph nodes, so devices and dtypes are not baked in;
* the module is traced in training mode, and the dropout calls in the graph
  (``F.dropout(..., training=True)`` and ``scaled_dot_product_attention(dropout_p=p)``) are
  rewritten to follow the module's ``training`` flag at run time, so ``model.eval()`` still
  turns dropout off;
* the Hugging Face KV cache is traced off (transformers models default to
  ``use_cache=True``, also in training): a forward with a ``use_cache`` flag is traced with
  ``use_cache=False`` and its cache arguments (``cache``, ``past_key_values``, ...) as None.
  At run time ``use_cache`` may be None or False (a traced module never fills or returns a
  cache). A cache, or ``use_cache=True``, that reaches a traced module in training with
  gradients is not used, with one warning (as transformers does for a gradient-checkpointed
  layer), unless it holds past positions for the layer (refused); in eval or without
  gradients (generation) it is refused by a :class:`~torchloom.core.errors.TraceGuardError`
  whose fix is ``use_cache=False``, or an untraced copy of the model for generation;
* on a model with ``meta`` weights (built under ``init_empty_weights``) the values are
  ``meta`` tensors, computed again on fake tensors (``FakeTensorMode``) where the code reads
  a value (transformers then skips its data-dependent checks); nothing is allocated. A
  Python branch on a value computed from the weights cannot be taken (a
  :class:`~torchloom.core.errors.TraceError` says which line); guards on such values are checked
  when the built model runs.

``tracer="fx"`` is plain symbolic tracing (no example values, nothing is run): required
arguments are symbolic, optional ones take their defaults (or ``concrete_args``). It is
enough for simple modules (MLPs) and never runs the model.

Hierarchy: with ``flatten=False`` every child module is a ``call_module`` node of the
parent graph; each child that is not a leaf is traced on its own (with the inputs it
received) into its own nested graph module, recursively. With ``flatten=True`` everything
down to the leaves is inlined into one graph. The traced graph module keeps *all* the
original sub-modules, parameters and buffers (used or not) in the original order, with the
same non-persistent buffers, and the original plain attributes (``config``, ``head_dim``,
...), so paths, ``named_parameters()`` and ``state_dict()`` keys do not change.

Identity: a traced module is the *same object* as before, changed in place into a graph
module whose class derives from both :class:`TracedGraphModule` and the original class
(``forward`` comes from the graph; every other method, property and ``isinstance`` check
from the original, e.g. ``Sequential.__getitem__`` or transformers' gradient-checkpointing
``__call__``). References to it (the parent's slot, the model the user holds, schedule
nodes) stay valid. Nothing is changed if tracing fails. Copies (``copy.deepcopy``) and
pickles keep the whole module.

Leaves (never traced through): ``torch.nn`` built-ins except containers, transformers
``Conv1D``, modules whose ``forward`` was replaced on the instance (``checkpoint``,
``fork_rng``, a row-parallel ``sync``), torchloom's own wrappers, the ``leaf_modules`` given by
class name or path, and, with ``flatten=True``, any module with hooks (so the hooks keep
firing). Already traced children are kept as they are.

Why not ``torch.export`` (which also handles transformers 5): it produces ATen IR with
every module inlined and parameters lifted, so leaves (checkpointed or ``fork_rng``
modules), hooks on children and parameter identity cannot be kept, patterns would have to be
written at the ATen level, and the training mode is frozen into the graph.

Limits:

* tracing runs the module on the example values (leaves and their hooks included, in
  eval mode, with the random state restored afterwards);
* control flow is specialised (guarded) to the example, loops whose trip count depends on
  a traced value are unrolled for it, and the extra ``**kwargs`` must be the same keys as in
  the example call (the auto example is the model's plain ``input_ids`` call: pass
  ``example_inputs`` for calls with masks, labels or caches);
* dtypes reached through ``x.dtype`` stay dynamic, but other Python-level decisions of the
  code (``self.training`` checks other than dropout, layer drop) are taken at trace time;
* side effects on Python objects happen once at trace time; ``torch.rand`` and friends
  called without traced arguments become constants;
* a module called twice is traced for its first call (the guards reject a different
  second call).

Threads: a trace keeps no state between calls. torch.fx patches ``nn.Module.__call__``
(and tracing patches ``torch`` factory functions) process-wide while a trace runs, so
traces run one at a time under :data:`TRACE_LOCK`, and the patches pass calls from other
threads through untouched: two threads may schedule two models at once.

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

import copy
import inspect
import math
import operator
import os
import sys
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_aggregate

from ..core.errors import TraceError, TraceGuardError
from ..core.marks import LEAF, has_mark, marks_of, transfer_hooks

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

#: Held while torch.fx traces (here and in :mod:`torchloom.graph.pattern`): ``fx.Tracer.trace``
#: patches ``nn.Module.__call__`` / ``__getattr__`` and wrapped functions process-wide for
#: the duration of a trace, so two traces at once in two threads would route each other's
#: module calls. Traces therefore run one at a time; the tracer's hooks ignore calls made by
#: other threads, so a thread that only *runs* models is not affected by a trace.
TRACE_LOCK = threading.RLock()
_NO_VALUE = object()  # the value of a proxy is unknown (tracer="fx")


# --------------------------------------------------------------------------- guards
# Guard functions are called by the generated code of a traced graph. They are kept by dead
# code elimination and ignored by the pattern matcher.


def _recorded(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """When a traced graph is traced again (``flatten=True`` over nested graphs), its guard
    calls see proxies: record them as nodes of the new graph instead of running them."""
    for a in args:
        if issubclass(type(a), fx.Proxy):
            return a.tracer.create_proxy("call_function", fn, args, {})
    return None


def _unknowable(value: Any) -> bool:
    """A tensor without values (``meta`` or fake): a guard on it cannot be checked, e.g.
    while a model built under ``init_empty_weights`` is split into pipeline stages; the
    guard checks again once the model runs on real tensors."""
    return isinstance(value, torch.Tensor) and (value.is_meta or _is_fake(value))


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(value)


def _guard_truth(value: Any, expected: bool, where: str) -> None:
    """Raise unless ``bool(value) == expected`` (a branch taken at trace time)."""
    if _recorded(_guard_truth, (value, expected, where)) is not None:
        return
    if _unknowable(value):
        return
    if bool(value) != expected:
        raise TraceGuardError(
            f"a branch was specialised at trace time ({_guard_location(where)}) and this call "
            f"takes the other one (condition was {expected}, is now {not expected})",
            path=_guard_path(where),
            primitive="trace",
            values={"traced_condition": expected},
            fix=_retrace_fix(where),
        )


def _guard_equal(value: Any, expected: Any, where: str) -> None:
    """Raise unless ``value == expected`` (a number or length fixed at trace time)."""
    if _recorded(_guard_equal, (value, expected, where)) is not None:
        return
    if _unknowable(value):
        return
    if value != expected:
        raise TraceGuardError(
            f"a value was specialised at trace time ({_guard_location(where)}) and differs in "
            "this call",
            path=_guard_path(where),
            primitive="trace",
            values={"traced": expected, "now": value},
            fix=_retrace_fix(where),
        )


def _guard_is_none(value: Any, where: str) -> None:
    """Raise unless ``value is None`` (a result that was None at trace time)."""
    if _recorded(_guard_is_none, (value, where)) is not None:
        return
    if value is not None:
        raise TraceGuardError(
            f"a value that was None at trace time ({_guard_location(where)}) is not None in "
            "this call",
            path=_guard_path(where),
            primitive="trace",
            values={"now": type(value).__name__},
            fix=_retrace_fix(where),
        )


def _guard_argument(value: Any, expected: Any, kind: str, name: str, where: str) -> None:
    """Check one argument of a traced ``forward`` against what it was at trace time.

    ``kind`` is ``"tensor"`` (any tensor), ``"value"`` (a specialised constant equal to
    ``expected``) or ``"dynamic"`` (anything but None).
    """
    if _recorded(_guard_argument, (value, expected, kind, name, where)) is not None:
        return
    if kind == "value" and expected is None and is_cache(value):
        _refuse_cache(value, name, where, "a KV cache", None)
    if kind == "tensor":
        ok = isinstance(value, torch.Tensor)
        seen: Any = type(value).__name__
        traced: Any = "a Tensor"
    elif kind == "dynamic":
        ok = value is not None
        seen, traced = type(value).__name__, expected
    else:
        try:
            ok = type(value) is type(expected) and bool(value == expected)
        except Exception:  # noqa: BLE001 - an odd __eq__ means "not the traced value"
            ok = False
        seen, traced = value, expected
    if not ok:
        raise TraceGuardError(
            f"argument {name!r} differs from the call the graph was traced for",
            path=_guard_path(where),
            primitive="trace",
            values={"argument": name, "traced": traced, "now": seen},
            fix=f"call it as it was traced, or {_retrace_fix(where)}",
        )


def _guard_kwargs(kwargs: dict[str, Any], expected: tuple[str, ...],
                  constants: dict[str, Any], where: str) -> None:
    """Check the ``**kwargs`` of a traced ``forward``: same keys, same constants."""
    if _recorded(_guard_kwargs, (kwargs, expected, constants, where)) is not None:
        return
    if tuple(sorted(kwargs)) != expected:
        raise TraceGuardError(
            "the extra keyword arguments differ from the call the graph was traced for",
            path=_guard_path(where),
            primitive="trace",
            values={"traced": list(expected), "now": sorted(kwargs)},
            fix=f"call it as it was traced, or {_retrace_fix(where)}",
        )
    for key, want in constants.items():
        _guard_argument(kwargs[key], want, "value", key, where)


# --------------------------------------------------------------------------- the KV cache
# A traced module computes the training path, without a Hugging Face KV cache: tracing
# passes ``use_cache=False`` to a forward that has the flag, and specialises cache arguments
# to None (a cache object is not a value a graph can carry). At run time ``_guard_cache``
# checks what arrives in their place, as transformers' ``GradientCheckpointingLayer`` does
# for a checkpointed layer: in training with gradients a cache is not used (one warning),
# anywhere else a call that wants a cache is refused with the fix.

#: names of forward arguments that hold a KV cache in transformers models
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
#: the forward argument that asks a transformers model for a KV cache
CACHE_FLAG = "use_cache"
_WARNED: set[str] = set()  # keys of the one-time warnings given (see warn_once)
_WARNED_LOCK = threading.Lock()


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (``Cache`` and its subclasses)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    return cache_type is not None and isinstance(value, cache_type)


def cache_length(cache: Any, layer_idx: int | None) -> int | None:
    """How many past positions ``cache`` holds for layer ``layer_idx`` (None: unknown)."""
    if layer_idx is None:
        return None
    try:
        return int(cache.get_seq_length(layer_idx))
    except Exception:  # noqa: BLE001 - a cache type without per-layer lengths
        return None


def layer_index(module: nn.Module) -> int | None:
    """The ``layer_idx`` of ``module`` or of its first sub-module that has one (the
    transformers attention modules carry it), or None."""
    for m in module.modules():
        idx = m.__dict__.get("layer_idx")
        if isinstance(idx, int) and not isinstance(idx, bool):
            return idx
    return None


def warn_once(key: str, message: str) -> None:
    """A ``UserWarning`` the first time ``key`` is seen in this process."""
    with _WARNED_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)


_CACHE_FIX = ("call the model with use_cache=False and without a cache argument (a traced "
              "module never fills or returns a KV cache); to generate with a cache, use an "
              "untraced copy: ref = copy.deepcopy(model) before tracing, then "
              "ref.load_state_dict(model.state_dict())")


def _refuse_cache(value: Any, name: str, where: str, what: str,
                  training: bool | None) -> None:
    state = {} if training is None else {"training": training,
                                          "grad_enabled": torch.is_grad_enabled()}
    raise TraceGuardError(
        f"{what} reached a module that torchloom traced without a cache: the graph computes "
        "without past keys and does not fill the cache",
        path=_guard_path(where),
        primitive="trace",
        values={"argument": name, "now": value if isinstance(value, bool)
                else type(value).__name__, **state},
        fix=_CACHE_FIX,
    )


def _guard_cache(value: Any, name: str, layer_idx: int | None, training: bool,
                 where: str) -> None:
    """Check what a call passes for a cache argument (or ``use_cache``) of a module that was
    traced without a cache.

    None and False always pass. A cache (or ``use_cache=True``) in training with gradients
    passes with a one-time warning and is not used, as in transformers under gradient
    checkpointing, unless the cache already holds past positions for this layer (the graph
    would ignore them: refused). Anywhere else it is refused: the caller wants a cache.
    """
    if _recorded(_guard_cache, (value, name, layer_idx, training, where)) is not None:
        return
    if value is None or value is False:
        return
    cache = is_cache(value)
    if not cache and value is not True:
        _guard_argument(value, None, "value", name, where)
        return
    what = "a KV cache" if cache else "use_cache=True"
    if not (training and torch.is_grad_enabled()):
        _refuse_cache(value, name, where, what, training)
    past = cache_length(value, layer_idx) if cache else None
    if past:
        raise TraceGuardError(
            f"a KV cache holding {past} past positions for this layer reached a module traced "
            "without one: the graph would ignore them",
            path=_guard_path(where),
            primitive="trace",
            values={"argument": name, "layer_idx": layer_idx, "past_positions": past},
            fix="train without a prefilled cache (model(..., use_cache=False), no cache "
            "argument), or keep this module untraced: trace only the levels below it",
        )
    warn_once(
        f"cache|{_guard_path(where)}",
        f"{_guard_path(where) or 'the root'}: {what} is not used by a module traced without "
        "a cache in training (as transformers does under gradient checkpointing); the model's "
        "output holds no complete cache. Pass use_cache=False to the model call to silence "
        "this.",
    )


def _train_only(p: float, training: bool) -> float:
    """A dropout probability that applies in training mode only."""
    recorded = _recorded(_train_only, (p, training))
    if recorded is not None:
        return recorded
    return p if training else 0.0


def _guard_path(where: str) -> str:
    return where.rsplit("|", 1)[0]


def _guard_location(where: str) -> str:
    return where.rsplit("|", 1)[-1]


def _retrace_fix(where: str) -> str:
    return (f"re-trace with example inputs like this call's: "
            f"sch[{_guard_path(where)!r}].trace(example_inputs=...)")


_GUARDS = (_guard_truth, _guard_equal, _guard_is_none, _guard_argument, _guard_kwargs,
           _guard_cache)


def is_guard(node: fx.Node) -> bool:
    """Whether ``node`` is a guard inserted by the tracer."""
    return node.op == "call_function" and node.target in _GUARDS


# --------------------------------------------------------------------------- graph module


class TracedGraphModule(fx.GraphModule):
    """A graph module made by :func:`trace_module` from one module.

    It keeps every sub-module, parameter and buffer of the original (in the original order,
    with the same non-persistent buffers) and its plain attributes, so paths and
    ``state_dict()`` keys are those of the original. ``traced_from`` is the original class.
    """

    traced_from: type = nn.Module

    def __deepcopy__(self, memo: dict[int, Any]) -> TracedGraphModule:
        # fx rebuilds a copied GraphModule keeping only what the graph uses (and turns
        # non-persistent buffers persistent); copy the whole module instead.
        new = object.__new__(_instance_class(self.traced_from))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        # fx pickles a GraphModule as code and re-traces it; keep the module as it is.
        return (_new_traced, (self.traced_from,), self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        type(self).__name__ = self.traced_from.__name__
        self._graph.owning_module = self
        self.recompile()


def _new_traced(traced_from: type) -> TracedGraphModule:
    return object.__new__(_instance_class(traced_from))


_TRACED_CLASSES: dict[type, type] = {}  # a cache of classes (never changes a result)
_CLASSES_LOCK = threading.Lock()


def _traced_class(original: type) -> type:
    """``TracedGraphModule`` mixed with the original class: the graph gives ``forward``,
    the original class its other methods and properties (``Sequential.__getitem__``,
    transformers' ``__call__`` and helpers) and ``isinstance`` checks keep working."""
    with _CLASSES_LOCK:  # one class per original, also when two threads trace at once
        cls = _TRACED_CLASSES.get(original)
        if cls is None:
            bases = (TracedGraphModule,) if original in (nn.Module, TracedGraphModule) or \
                issubclass(original, fx.GraphModule) else (TracedGraphModule, original)
            cls = type(f"Traced{original.__name__}", bases,
                       {"traced_from": original, "__module__": __name__})
            _TRACED_CLASSES[original] = cls
    return cls


def _instance_class(original: type) -> type:
    """A fresh per-instance class, as fx gives every graph module its own ``forward``."""
    impl = type("GraphModuleImpl", (_traced_class(original),), {})
    impl.__qualname__ = "GraphModuleImpl"
    impl.__name__ = original.__name__
    return impl


def is_traced(module: nn.Module) -> bool:
    """Whether ``module`` is a graph made by torchloom's tracer."""
    return isinstance(module, TracedGraphModule)


def _own_forward(module: nn.Module) -> bool:
    return "forward" in module.__dict__


def _has_hooks(module: nn.Module) -> bool:
    return any(
        getattr(module, attr, None)
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                     "_backward_pre_hooks")
    )


def _is_conv1d(module: nn.Module) -> bool:
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or (
        type(module).forward is nn.Module.forward and not _own_forward(module)
    )


def is_leaf(module: nn.Module, path: str = "", leaf_modules: Sequence[str] = ()) -> bool:
    """Whether the tracer keeps ``module`` opaque (a ``call_module`` node) by default.

    >>> is_leaf(nn.Linear(2, 2)), is_leaf(nn.Sequential())
    (True, False)
    """
    if _own_forward(module) or has_mark(type(module), LEAF):
        return True
    if isinstance(module, fx.GraphModule) and not is_traced(module):
        return True  # e.g. a fused or user-built graph
    name = type(module).__name__
    if name in leaf_modules or (path and path in leaf_modules):
        return True
    if _is_conv1d(module):
        return True
    cls_module = type(module).__module__
    builtin = cls_module.startswith("torch.nn") or cls_module.startswith("torch.ao.nn")
    return builtin and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


# --------------------------------------------------------------------------- proxies


class _ValueMixin:
    """What a proxy that may carry an example value adds to ``fx.Proxy``."""

    tracer: _Tracer

    def __getattr__(self, k: str) -> Any:
        if k.startswith("__") or k in ("_node", "root", "attr", "tracer", "node"):
            raise AttributeError(k)
        tracer = self.tracer
        value = tracer.value_of(self)
        if value is _NO_VALUE:
            if k.startswith("_"):
                raise AttributeError(k)
            return _ValueAttribute(self, k)
        if not hasattr(value, k):
            raise AttributeError(k)
        if getattr(value, k) is None:  # e.g. an output field that is None: specialise
            node = tracer.create_proxy("call_function", getattr, (self, k), {}).node
            tracer.create_node("call_function", _guard_is_none,
                               (node, f"{tracer.where}|{_user_frame()}"), {})
            return None
        return _ValueAttribute(self, k)

    def __len__(self) -> int:
        return self.tracer.specialise_len(self)

    def __index__(self) -> int:
        return self.tracer.specialise_number(self, operator.index)

    def __int__(self) -> int:
        return self.tracer.specialise_number(self, int)

    def __float__(self) -> float:
        return self.tracer.specialise_number(self, float)

    def __contains__(self, item: Any) -> bool:
        return any(item is x or item == x for x in self.tracer.iter(self))


class _ValueProxy(_ValueMixin, fx.Proxy):
    pass


class _ValueAttribute(_ValueMixin, fx.proxy.Attribute):
    pass


# --------------------------------------------------------------------------- tracer


def _user_frame() -> str:
    """file:line of the model code that is being traced (for guard messages)."""
    here = os.path.dirname(__file__)
    torch_dir = os.path.dirname(torch.__file__)
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(here) and not filename.startswith(torch_dir):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _is_simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


# torch functions that do not dispatch on a traced size / device / dtype argument: while
# tracing, a call with a traced argument becomes a graph node.
_FACTORIES = (
    "arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "eye", "linspace",
    "rand", "randn", "randint", "finfo", "iinfo", "scalar_tensor",
)


class _TraceExit(Exception):
    """Raised by the input-capturing hook to stop a model run early."""


class _Tracer(fx.Tracer):
    """fx tracer whose proxies carry example values (when it has them)."""

    def __init__(self, where: str, leaf: Callable[[nn.Module, str], bool],
                 with_values: bool, fake_mode: Any = None) -> None:
        super().__init__(autowrap_modules=(math,))
        self.proxy_buffer_attributes = True  # buffers are graph values too
        self.where = where
        self.leaf = leaf
        self.with_values = with_values
        #: a FakeTensorMode when the example values have no data (a meta model): every
        #: value is then computed on fake ``meta`` tensors (see :func:`value_mode`)
        self.fake_mode = fake_mode
        #: the thread that traces: fx patches ``nn.Module.__call__`` process-wide while it
        #: traces, and calls from other threads must run untouched
        self.thread = threading.get_ident()
        self._training_node: fx.Node | None = None
        self.values: dict[fx.Node, Any] = {}
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.executing = 0
        self.spec: list[_Arg] = []
        self.constants: dict[str, torch.Tensor] = {}

    # -- values ------------------------------------------------------------------------

    def value_of(self, a: Any) -> Any:
        kind = type(a)
        if issubclass(kind, fx.proxy.Attribute) and a._node is None:
            root = self.value_of(a.root)
            if root is _NO_VALUE:
                return _NO_VALUE
            return getattr(root, a.attr)
        if issubclass(kind, fx.Proxy):
            return self.values.get(a.node, _NO_VALUE)
        return a

    def _values_of(self, args: Any) -> tuple[Any, bool]:
        missing = False

        def get(a: Any) -> Any:
            nonlocal missing
            if issubclass(type(a), fx.Proxy):
                v = self.value_of(a)
                if v is _NO_VALUE:
                    missing = True
                return v
            return a

        return _map_nested(args, get), missing

    @contextmanager
    def executing_code(self) -> Iterator[None]:
        self.executing += 1
        try:
            yield
        finally:
            self.executing -= 1

    def _evaluate(self, kind: str, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.with_values:
            return _NO_VALUE
        (vargs, vkwargs), missing = self._values_of((args, kwargs))
        if missing:
            return _NO_VALUE

        def run(vargs: Any, vkwargs: Any) -> Any:
            if kind == "call_function":
                return target(*vargs, **vkwargs)
            if kind == "call_method":
                return getattr(vargs[0], target)(*vargs[1:], **vkwargs)
            if kind == "get_attr":
                obj: Any = self.root
                for part in target.split("."):
                    obj = getattr(obj, part)
                return obj
            if kind == "call_module":
                return self._run_module(target, vargs, vkwargs)
            return _NO_VALUE

        try:
            with self.executing_code():
                if self.fake_mode is None or kind == "get_attr":
                    return run(vargs, vkwargs)
                try:
                    return on_meta(self.fake_mode, run, vargs, vkwargs)
                except Exception as exc:  # noqa: BLE001 - see below
                    if not _data_dependent(exc):
                        raise
                    # The operation reads values the meta weights do not have: its result
                    # stays unknown, and the trace goes on symbolically from here.
                    return _NO_VALUE
        except (TraceError, _TraceExit):
            raise
        except Exception as exc:  # noqa: BLE001 - reported with the operation
            raise TraceError(
                f"running {kind} {getattr(target, '__name__', target)!s} on the example "
                f"values failed: {type(exc).__name__}: {exc}",
                path=self.where,
                primitive="trace",
                values={"operation": str(getattr(target, "__name__", target))},
                fix="check example_inputs (shapes, dtypes); they must be a valid call of "
                "the module",
            ) from exc

    def _run_module(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.root.get_submodule(target)
        captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def capture(mod: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            captured.append((a, dict(kw)))
            if self.fake_mode is not None and target not in self.calls:
                # meta values: kept even if the run fails on a value it cannot know
                self.calls[target] = meta_values(captured[0])

        handle = module.register_forward_pre_hook(capture, with_kwargs=True)
        modes = _modes(module)
        module.eval()  # values only: no dropout masks, no checkpoint, no rng stream needed
        try:
            with _tensors_on_meta(module, self.fake_mode is not None):
                out = module(*args, **kwargs)
        finally:
            handle.remove()
            _restore_modes(modes)
        if captured and target not in self.calls:
            self.calls[target] = captured[0] if self.fake_mode is None else \
                meta_values(captured[0])
        return out

    # -- fx hooks ----------------------------------------------------------------------

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def _create_arg(self, a: Any) -> Any:
        if issubclass(type(a), fx.Proxy):
            return a.node
        if _is_output_mapping(a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", type(a), (), fields)
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
            for n, b in self.root.named_buffers():
                if a is b:
                    return self.create_node("get_attr", n, (), {})
            known = self.tensor_attrs.get(a)
            if known is not None:
                return self.create_node("get_attr", known, (), {})
            for n, b in self.constants.items():
                if a is b:
                    return self.create_node("get_attr", n, (), {})
            name = f"_tensor_constant{len(self.constants)}"
            self.constants[name] = a
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def create_proxy(self, kind: str, target: Any, args: Any, kwargs: Any,
                     name: str | None = None, type_expr: Any = None,
                     proxy_factory_fn: Any = None) -> Any:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr)
        if kind in ("placeholder", "output"):
            return proxy
        value = self._evaluate(kind, target, args, kwargs)
        self.values[proxy.node] = value
        if value is None and kind != "get_attr" and target is not getattr and \
                target not in _GUARDS:
            # A None result: code tests it with `is None`, so hand back None itself.
            self.create_node("call_function", _guard_is_none,
                             (proxy.node, f"{self.where}|{_user_frame()}"), {})
            return None
        return proxy

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any,
                    name: str | None = None, type_expr: Any = None) -> fx.Node:
        if name is None and kind in ("call_module", "get_attr") and target == "self":
            name = "self_module"  # a child called "self" (BERT) must not shadow `self`
        return super().create_node(kind, target, args, kwargs, name, type_expr)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.executing or threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_arg(self, a: Any) -> Any:
        if is_cache(a):
            raise TraceError(
                f"the module's code passes a KV cache object ({type(a).__name__}) to a traced "
                f"call ({_user_frame()}); a graph cannot carry a cache",
                path=self.where, primitive="trace", values={"cache": type(a).__name__},
                fix="turn the cache off in every config the model holds (T5's decoder keeps "
                "its own): for m in model.modules(): if hasattr(m, 'config'): "
                "m.config.use_cache = False",
            )
        return self._create_arg(a)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if self.executing or threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        try:
            self.path_of_module(m)
        except NameError:  # a module made inside forward (e.g. a loss): trace through it
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.leaf(m, module_qualified_name)

    # -- control flow ------------------------------------------------------------------

    def _need_value(self, obj: Any, what: str) -> Any:
        value = self.value_of(obj)
        if value is _NO_VALUE and self.with_values and self.fake_mode is not None:
            raise TraceError(
                f"the module's code {what} a value ({_user_frame()}) computed by a module "
                "whose output depends on tensor values, and this model's tensors have no "
                "values (meta weights: the model was built under init_empty_weights)",
                path=self.where, primitive="trace", values={"tracer": "auto"},
                fix="keep the module that uses the value opaque: "
                f"sch[{self.where!r}].trace(leaf_modules=[...]), or materialise the weights "
                "first: tl.build(sch), then trace",
            )
        if value is _NO_VALUE:
            raise TraceError(
                f"the module's code {what} a traced value ({_user_frame()}), which plain "
                "symbolic tracing cannot do",
                path=self.where,
                primitive="trace",
                values={"tracer": "fx" if not self.with_values else "auto"},
                fix=f"trace with example values: sch[{self.where!r}].trace(tracer='auto', "
                "example_inputs=(...))",
            )
        return value

    def _concrete(self, convert: Callable[[Any], Any], value: Any, what: str) -> Any:
        """``convert(value)``; a tensor without data (meta / fake) has no Python value."""
        try:
            return convert(value)
        except Exception as exc:  # noqa: BLE001 - DataDependentOutputException and friends
            if not _unknowable(value):
                raise
            raise TraceError(
                f"the module's code {what} a tensor value ({_user_frame()}), and this model's "
                "tensors have no values (meta weights: the model was built under "
                "init_empty_weights)",
                path=self.where, primitive="trace",
                values={"value": f"{type(value).__name__}{tuple(value.shape)}"},
                fix="keep the module that does this opaque: "
                f"sch[{self.where!r}].trace(leaf_modules=[...]), or materialise the weights "
                "first: tl.build(sch), then trace",
            ) from exc

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self._concrete(bool, self._need_value(obj, "branches on"), "branches on")
        self.create_node("call_function", _guard_truth,
                         (obj.node, value, f"{self.where}|{_user_frame()}"), {})
        return value

    def specialise_number(self, obj: fx.Proxy, convert: Callable[[Any], Any]) -> Any:
        value = self._concrete(convert, self._need_value(obj, "needs a Python number from"),
                               "needs a Python number from")
        self.create_node("call_function", _guard_equal,
                         (obj.node, value, f"{self.where}|{_user_frame()}"), {})
        return value

    def specialise_len(self, obj: fx.Proxy) -> int:
        n = len(self._need_value(obj, "takes len() of"))
        length = self.create_proxy("call_function", len, (obj,), {})
        self.create_node("call_function", _guard_equal,
                         (length.node, n, f"{self.where}|{_user_frame()}"), {})
        return n

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = self._need_value(obj, "iterates over")
        if isinstance(value, dict):
            return iter(list(value.keys()))
        n = len(value)
        return iter([obj[i] for i in range(n)])

    def keys(self, obj: fx.Proxy) -> Any:
        value = self._need_value(obj, "unpacks (**)")
        return list(value.keys())

    # -- root arguments ----------------------------------------------------------------

    def training_flag(self) -> fx.Node:
        """A ``get_attr`` node of the traced module's ``training`` flag (made once)."""
        if self._training_node is None:
            self._training_node = self.create_node("get_attr", "training", (), {})
        return self._training_node

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> tuple[Any, list[Any]]:
        where = f"{self.where}|forward"
        proxies: dict[str, Any] = {}
        seen_default = False
        for arg in self.spec:
            if arg.kind == inspect.Parameter.VAR_POSITIONAL:
                target = f"*{arg.name}"
            elif arg.kind == inspect.Parameter.VAR_KEYWORD:
                target = f"**{arg.name}"
            else:
                target = arg.name
            if arg.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                default: tuple[Any, ...] = ()
                seen_default = arg.kind == inspect.Parameter.VAR_POSITIONAL or seen_default
            elif arg.default is not inspect.Parameter.empty:
                default, seen_default = (arg.default,), True
            else:  # a required argument after one with a default: None (the guard checks)
                default = (None,) if seen_default else ()
            if arg.kind == inspect.Parameter.VAR_POSITIONAL:
                seen_default = False  # what follows *args is keyword-only
            ph = self.create_proxy("placeholder", target, default, {})
            self.values[ph.node] = arg.value
            proxies[arg.name] = ph

        def call_value(arg: _Arg) -> Any:
            ph = proxies[arg.name]
            if arg.kind == inspect.Parameter.VAR_POSITIONAL:
                self.create_node("call_function", _guard_equal,
                                 (self.create_proxy("call_function", len, (ph,), {}).node,
                                  len(arg.value), where), {})
                return tuple(_item(self, ph, i, v) for i, v in enumerate(arg.value))
            if arg.kind == inspect.Parameter.VAR_KEYWORD:
                # the KV cache among the keywords: traced off, checked by _guard_cache
                cache = {k: (False if k == CACHE_FLAG else None) for k, v in arg.value.items()
                         if (k == CACHE_FLAG or k in CACHE_ARGUMENTS) and not v}
                constants = {k: v for k, v in arg.value.items()
                             if not _dynamic(v) and k not in cache}
                self.create_node("call_function", _guard_kwargs,
                                 (ph.node, tuple(sorted(arg.value)), constants, where), {})
                for key in cache:
                    self.create_node("call_function", _guard_cache,
                                     (_item(self, ph, key, None).node, key,
                                      layer_index(self.root), self.training_flag(), where), {})
                return {k: (cache[k] if k in cache else v if k in constants
                            else _item(self, ph, k, v)) for k, v in arg.value.items()}
            if arg.mode == "cache":
                self.create_node("call_function", _guard_cache,
                                 (ph.node, arg.name, layer_index(self.root),
                                  self.training_flag(), where), {})
                return arg.value
            if arg.value is _NO_VALUE:
                return ph
            if arg.mode == "constant":
                self.create_node("call_function", _guard_argument,
                                 (ph.node, arg.value, "value", arg.name, where), {})
                return arg.value
            kind = "tensor" if isinstance(arg.value, torch.Tensor) else "dynamic"
            self.create_node("call_function", _guard_argument,
                             (ph.node, None, kind, arg.name, where), {})
            return ph

        spec = self.spec

        def fn(module, *_):  # type: ignore[no-untyped-def]  # no annotations: fx reads them
            positional: list[Any] = []
            keywords: dict[str, Any] = {}
            # The call is made as the example made it (decorators on forward may look at
            # which arguments were passed); arguments it did not pass keep their defaults.
            for arg in spec:
                value = call_value(arg)
                if arg.passed == "no":
                    continue
                if arg.kind == inspect.Parameter.VAR_POSITIONAL:
                    positional.extend(value)
                elif arg.kind == inspect.Parameter.VAR_KEYWORD:
                    keywords.update(value)
                elif arg.passed == "positional":
                    positional.append(value)
                else:
                    keywords[arg.name] = value
            return root_fn(module, *positional, **keywords)

        return fn, [self.root]


def _item(tracer: _Tracer, container: fx.Proxy, key: Any, value: Any) -> Any:
    proxy = tracer.create_proxy("call_function", operator.getitem, (container, key), {})
    return proxy


def _dynamic(value: Any) -> bool:
    return not _is_simple(value)


def _is_output_mapping(a: Any) -> bool:
    """A dict subclass such as a transformers ``ModelOutput`` (rebuilt by a node)."""
    return isinstance(a, dict) and type(a) not in (dict,) and \
        not type(a).__module__.startswith("torch.fx") and \
        type(a).__name__ not in ("OrderedDict", "defaultdict", "immutable_dict")


def _map_nested(a: Any, fn: Callable[[Any], Any]) -> Any:
    if issubclass(type(a), fx.Proxy):
        return fn(a)
    if isinstance(a, tuple):
        items = [_map_nested(x, fn) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)
    if isinstance(a, list):
        return [_map_nested(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: _map_nested(v, fn) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map_nested(a.start, fn), _map_nested(a.stop, fn), _map_nested(a.step, fn))
    return fn(a)


def _modes(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(m, m.training) for m in module.modules()]


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


# --------------------------------------------------------------------------- tensors without data


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def value_mode(module: nn.Module | None, example: Any = None) -> Any:
    """The ``FakeTensorMode`` in which example values are computed, or None for real ones.

    A model built under ``init_empty_weights`` has ``meta`` tensors: they have shapes but no
    values, and model code that reads a value (``.item()``, ``bool(t)``) fails on them.
    Under a fake mode the same code runs on fake tensors, which transformers recognises as
    tracing (``is_tracing``) and skips its data-dependent checks for; nothing is allocated.
    The mode of fake tensors already in ``example`` is reused; a new one is made when
    ``example`` or ``module`` holds a ``meta`` tensor.

    >>> with torch.device("meta"):
    ...     lin = nn.Linear(4, 4)
    >>> mode = value_mode(lin)
    >>> x = fake_values(mode, torch.randn(2, 4))
    >>> with mode:
    ...     y = lin(x)
    >>> type(y).__name__, y.device, tuple(y.shape)
    ('FakeTensor', device(type='meta'), (2, 4))
    >>> value_mode(nn.Linear(2, 2)) is None
    True
    """
    for t in _tensors(example):
        if _is_fake(t):
            return t.fake_mode
    tensors = list(_tensors(example))
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    if any(t.is_meta for t in tensors):
        from torch._subclasses.fake_tensor import FakeTensorMode

        return FakeTensorMode(allow_non_fake_inputs=True)
    return None


def fake_values(mode: Any, value: Any) -> Any:
    """``value`` with every tensor replaced by a fake ``meta`` tensor of ``mode`` (same
    shape, dtype and ``requires_grad``; nothing allocated); tuples, lists and dicts are
    rebuilt, anything else is kept."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        if _is_fake(t):
            return t
        return mode.from_tensor(t if t.is_meta else t.detach().to("meta").requires_grad_(
            t.requires_grad))

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return fake(v)
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(walk(x) for x in v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if type(v) is dict:
            return {k: walk(x) for k, x in v.items()}
        return v

    return walk(value)


def _data_dependent(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is an operation that needed tensor values: a
    fake tensor's ``DataDependentOutputException`` or ``.item()`` on a meta tensor."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, DataDependentOutputException) or \
                "cannot be called on meta tensors" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def meta_values(value: Any) -> Any:
    """``value`` with every tensor replaced by a plain ``meta`` one (same shape, strides,
    dtype and ``requires_grad``; nothing allocated): real and fake tensors are converted,
    meta ones kept; tuples (named ones too), lists, dicts and transformers ``ModelOutput``
    mappings are rebuilt."""
    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if _is_fake(v):
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                           device="meta").requires_grad_(v.requires_grad)
            if v.is_meta:
                return v
            return v.detach().to("meta").requires_grad_(v.requires_grad)
        if isinstance(v, tuple):
            items = [walk(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if type(v) is dict:
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, dict) and _is_output_mapping(v):
            try:
                return type(v)(**{k: walk(x) for k, x in v.items()})
            except Exception:  # noqa: BLE001 - a mapping that cannot be rebuilt: as it is
                return v
        return v

    return walk(value)


def on_meta(mode: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on values without data: first on plain ``meta`` tensors (fast), and if
    that raises (code that reads a value: ``.item()``, ``bool(t)``), again on fake tensors
    of ``mode``, under which transformers skips such data-dependent checks."""
    try:
        return fn(*meta_values(args))
    except (TraceError, _TraceExit):
        raise
    except Exception:  # noqa: BLE001 - retried on fake tensors; a real error raises again
        with mode:
            result = fn(*fake_values(mode, args))
        return meta_values(result)  # back to plain meta: the next operations run fast


@contextmanager
def _tensors_on_meta(module: nn.Module, active: bool) -> Iterator[None]:
    """While values are fake (a meta model), the real tensors of ``module`` (e.g. the CPU
    buffers ``init_empty_weights`` leaves, such as rotary ``inv_freq``) are swapped for
    ``meta`` copies, so that fake values never meet a real device; put back afterwards."""
    if not active:
        yield
        return
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is None or t.is_meta or _is_fake(t):
                    continue
                meta = t.detach().to("meta")
                if isinstance(t, nn.Parameter):
                    meta = nn.Parameter(meta, requires_grad=t.requires_grad)
                swapped.append((slots, name, t))
                slots[name] = meta
    try:
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


@contextmanager
def _patched_factories(tracer: _Tracer) -> Iterator[None]:
    """While tracing, torch factory functions called with traced arguments become nodes."""
    saved = {}
    for name in _FACTORIES:
        original = getattr(torch, name, None)
        if original is None:
            continue
        saved[name] = original

        def wrapper(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            found = []
            map_aggregate((args, kwargs),
                          lambda a: found.append(a) if issubclass(type(a), fx.Proxy) else None)
            if found and not tracer.executing and threading.get_ident() == tracer.thread:
                return tracer.create_proxy("call_function", __original, args, kwargs)
            return __original(*args, **kwargs)

        setattr(torch, name, wrapper)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(torch, name, original)


# --------------------------------------------------------------------------- arguments


@dataclass
class _Arg:
    """One parameter of the traced forward and what the example gave it."""

    name: str
    kind: Any  # inspect.Parameter kind
    default: Any
    mode: str  # "dynamic", "constant" or "cache" (a KV cache argument or use_cache, traced off)
    value: Any
    passed: str = "no"  # how the example call passed it: "positional", "keyword" or "no"


def _signature(module: nn.Module) -> inspect.Signature:
    return inspect.signature(type(module).forward)


def _bind(module: nn.Module, path: str, args: tuple[Any, ...] | None,
          kwargs: dict[str, Any] | None, concrete_args: dict[str, Any] | None,
          with_values: bool) -> list[_Arg]:
    sig = _signature(module)
    params = list(sig.parameters.values())[1:]  # drop self
    concrete = dict(concrete_args or {})
    for key, value in concrete.items():
        if not _is_simple(value):
            raise TraceError(
                f"concrete_args[{key!r}] is a {type(value).__name__}; concrete arguments "
                "must be constants (None, bool, number, string)",
                path=path, primitive="trace", values={"concrete_args": sorted(concrete)},
                fix="pass tensors through example_inputs instead",
            )
    if with_values:
        try:
            bound = sig.bind(module, *(args or ()), **(kwargs or {}))
        except TypeError as exc:
            raise TraceError(
                f"the example inputs are not a valid call of {type(module).__name__}.forward: "
                f"{exc}",
                path=path, primitive="trace",
                values={"signature": str(sig), "args": len(args or ()),
                        "kwargs": sorted(kwargs or {})},
                fix="pass example_inputs as a tuple of positional arguments or a dict of "
                "keyword arguments of forward()",
            ) from None
        given = dict(bound.arguments)
        given.pop(next(iter(sig.parameters)))
        n_positional = len(args or ())
    else:
        given = {}
        n_positional = 0
    spec: list[_Arg] = []
    names = [p.name for p in params]
    unknown = sorted(set(concrete) - set(names))
    if unknown and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        raise TraceError(
            f"concrete_args names arguments that forward() does not have: {unknown}",
            path=path, primitive="trace", values={"forward": str(sig)},
            fix=f"use argument names of forward(): {names}",
        )
    for index, p in enumerate(params):
        default = p.default
        if p.kind == inspect.Parameter.VAR_POSITIONAL:
            value = tuple(given.get(p.name, ()))
            spec.append(_Arg(p.name, p.kind, inspect.Parameter.empty, "dynamic", value,
                             "positional"))
            continue
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            value = dict(given.get(p.name, {}))
            value.update({k: v for k, v in concrete.items() if k not in names})
            for key, item in value.items():
                if is_cache(item) or (key == CACHE_FLAG and item):
                    _refuse_example_cache(path, key, item)
            spec.append(_Arg(p.name, p.kind, inspect.Parameter.empty, "dynamic", value,
                             "keyword"))
            continue
        if p.name in given or not with_values:
            passed = "positional" if index < n_positional else "keyword"
        else:
            passed = "no"
        # The KV cache: traced off (see _guard_cache). The flag is passed as False so a
        # decorator that reads config.use_cache (transformers' merge_with_config_defaults)
        # does not make a cache; cache arguments are specialised to None.
        if p.name == CACHE_FLAG or p.name in CACHE_ARGUMENTS or is_cache(given.get(p.name)):
            value = concrete.get(p.name, given.get(p.name, default))
            if value is inspect.Parameter.empty:
                value = None
            if is_cache(value) or (p.name == CACHE_FLAG and value is True):
                _refuse_example_cache(path, p.name, value)
            if p.name == CACHE_FLAG and value in (None, False):
                spec.append(_Arg(p.name, p.kind, _codegen_default(default), "cache", False,
                                 passed if passed != "no" else "keyword"))
                continue
            if value is None:
                spec.append(_Arg(p.name, p.kind, _codegen_default(default), "cache", None,
                                 passed if p.name in given else "no"))
                continue
        if default is not inspect.Parameter.empty and not _is_simple(default):
            default = inspect.Parameter.empty if p.name in given else default
        if p.name in concrete:
            spec.append(_Arg(p.name, p.kind, _codegen_default(default), "constant",
                             concrete[p.name], "keyword"))
        elif p.name in given:
            value = given[p.name]
            mode = "dynamic" if _dynamic(value) else "constant"
            spec.append(_Arg(p.name, p.kind, _codegen_default(default), mode, value, passed))
        elif not with_values and default is inspect.Parameter.empty:
            spec.append(_Arg(p.name, p.kind, default, "dynamic", _NO_VALUE, passed))
        elif not with_values or default is not inspect.Parameter.empty:
            if not _is_simple(default):
                raise TraceError(
                    f"argument {p.name!r} has a default that cannot be specialised "
                    f"({type(default).__name__})",
                    path=path, primitive="trace", values={"argument": p.name},
                    fix="pass the argument in example_inputs",
                )
            spec.append(_Arg(p.name, p.kind, _codegen_default(default), "constant", default,
                             "no"))
        else:
            raise TraceError(
                f"required argument {p.name!r} is missing from the example inputs",
                path=path, primitive="trace", values={"forward": str(sig)},
                fix="pass it in example_inputs",
            )
    return spec


def _refuse_example_cache(path: str, name: str, value: Any) -> None:
    raise TraceError(
        "the example inputs ask for a KV cache; torchloom traces the training path, without "
        "a cache",
        path=path, primitive="trace",
        values={"argument": name, "value": value if isinstance(value, bool)
                else type(value).__name__},
        fix=f"leave {name!r} out of example_inputs (a traced module runs with "
        "use_cache=False)",
    )


def _codegen_default(default: Any) -> Any:
    return default if _is_simple(default) else inspect.Parameter.empty


# --------------------------------------------------------------------------- post passes


_DROPOUT_FNS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                F.feature_alpha_dropout}


def _follow_training_flag(graph: fx.Graph) -> None:
    """Make dropout nodes traced in training mode follow ``self.training`` at run time."""
    training: fx.Node | None = None

    def flag(before: fx.Node) -> fx.Node:
        nonlocal training
        if training is None:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                training = graph.get_attr("training")
        return training

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DROPOUT_FNS:
            if node.kwargs.get("training") is True:
                node.update_kwarg("training", flag(node))
            elif len(node.args) >= 3 and node.args[2] is True:
                node.update_arg(2, flag(node))
        elif node.target is torch.dropout and len(node.args) >= 3 and node.args[2] is True:
            node.update_arg(2, flag(node))
        elif node.target is _guard_cache and isinstance(node.args[3], bool):
            node.update_arg(3, flag(node))  # a nested graph inlined by flatten=True
        elif node.target is F.scaled_dot_product_attention:
            p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
            if isinstance(p, (int, float)) and p > 0:
                with graph.inserting_before(node):
                    gated = graph.call_function(_train_only, (p, flag(node)))
                if "dropout_p" in node.kwargs:
                    node.update_kwarg("dropout_p", gated)
                else:
                    node.update_arg(4, gated)


def clean_graph(gm: fx.GraphModule) -> None:
    """Dead-code elimination that keeps guards and side effects, then lint and recompile."""
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: is_guard(n) or n.is_impure())
    gm.graph.lint()
    gm.recompile()


# --------------------------------------------------------------------------- building


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


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
    installs: list[tuple[nn.Module, str, nn.Module, nn.Module, str]] = []
    with TRACE_LOCK:
        gm = _trace_tree(module, path, example, leaves, flatten, concrete_args, expand,
                         installs, fake_mode)
    reached = {path} | {install[4] for install in installs}
    missing = [p for p in must_trace if p not in reached]
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
                installs: list[tuple[nn.Module, str, nn.Module, nn.Module, str]],
                fake_mode: Any = None) -> TracedGraphModule:
    def relative_leaf(m: nn.Module, qualified: str) -> bool:
        full = _join(path, qualified)
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
            child_path = _join(path, target)
            if is_leaf(child, child_path, leaves) or target in leaves or is_traced(child):
                continue
            if expand is not None and not expand(child_path):
                continue
            if _own_forward(child):
                continue
            if any(t == target for t, _, _ in children):
                continue  # a child called twice is traced once (for its first call)
            child_example = tracer.calls.get(target) if tracer.with_values else None
            traced = _trace_tree(child, child_path, child_example, leaves, False, None, expand,
                                 installs, fake_mode)
            children.append((target, child, traced))
    tracer.values.clear()
    tracer.calls.clear()
    gm = _finish_module(module, graph, tracer.constants)
    installs.extend((gm, target, child, traced, _join(path, target))
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


# --------------------------------------------------------------------------- examples


def example_inputs_for(root: nn.Module, module: nn.Module, path: str
                       ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The inputs ``module`` receives when ``root`` runs on its example inputs.

    The root's example inputs are :func:`dummy_inputs` (made from a transformers model's
    config); other roots have none (returns None). The root runs in eval mode without
    gradients and without a KV cache (``use_cache=False`` when its forward has the flag),
    the random state is restored, and the run stops as soon as ``module`` is called. On a
    model with ``meta`` weights it runs on fake tensors (:func:`value_mode`), and the
    captured inputs are fake tensors.
    """
    root_inputs = dummy_inputs(root)
    if root_inputs is None:
        return None
    if CACHE_FLAG in _signature(root).parameters and CACHE_FLAG not in root_inputs:
        root_inputs[CACHE_FLAG] = False
    mode = value_mode(root, root_inputs)
    if mode is not None:
        root_inputs = meta_values(root_inputs)
    if module is root:
        return (), dict(root_inputs)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, dict(kwargs)))
        raise _TraceExit

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    modes = _modes(root)
    root.eval()

    def run(inputs: dict[str, Any]) -> None:
        try:
            root(**inputs)
        except _TraceExit:
            pass

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                _tensors_on_meta(root, mode is not None):
            if mode is None:
                run(root_inputs)
            else:
                on_meta(mode, run, root_inputs)
    except _TraceExit:
        pass
    except Exception as exc:  # noqa: BLE001
        raise TraceError(
            f"running the model on its dummy inputs to find this module's inputs failed: "
            f"{type(exc).__name__}: {exc}",
            path=path, primitive="trace", values={"root": type(root).__name__},
            fix=f"pass the module's inputs: sch[{path!r}].trace(example_inputs=(...))",
        ) from exc
    finally:
        handle.remove()
        _restore_modes(modes)
    if not captured:
        raise TraceError(
            "the model never called this module when run on its dummy inputs",
            path=path, primitive="trace", values={"root": type(root).__name__},
            fix=f"pass the module's inputs: sch[{path!r}].trace(example_inputs=(...))",
        )
    return captured[-1] if mode is None else meta_values(captured[-1])


#: the batch and (at most) the sequence length of :func:`dummy_inputs`
DUMMY_BATCH, DUMMY_LENGTH = 2, 16
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


def dummy_inputs(model: nn.Module, batch: int = DUMMY_BATCH,
                 length: int = DUMMY_LENGTH) -> dict[str, Any] | None:
    """Example inputs for a transformers model, made from its config (None for a model
    without a config).

    * an image model (``pixel_values`` in its forward, ``image_size`` in its config):
      ``pixel_values`` of shape ``(batch, num_channels, image_size, image_size)``;
    * a text model: ``input_ids`` of shape ``(batch, min(length, positions))`` drawn from
      the vocabulary without the padding token, plus ``decoder_input_ids`` for an
      encoder-decoder model.

    The values come from a fixed generator (the global random state is not touched). They
    are CPU tensors (or on the device of the model's first real parameter); tracing a
    model with ``meta`` weights turns them into fake tensors.

    >>> import transformers
    >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50)
    >>> {k: tuple(v.shape) for k, v in dummy_inputs(transformers.GPT2LMHeadModel(cfg)).items()}
    {'input_ids': (2, 16)}
    """
    config = getattr(model, "config", None)
    if config is None or getattr(type(model), "dummy_inputs", None) is None:
        return None
    params = _signature(model).parameters
    device = next((t.device for t in model.parameters() if not t.is_meta),
                  torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    image_size = getattr(config, "image_size", None)
    if "pixel_values" in params and image_size is not None:
        side = tuple(image_size) if isinstance(image_size, (tuple, list)) else \
            (image_size, image_size)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        pixels = torch.randn(batch, getattr(config, "num_channels", 3), *side,
                             generator=generator)
        return {"pixel_values": pixels.to(device=device, dtype=dtype)}
    vocab = getattr(config, "vocab_size", None)
    if "input_ids" in params and isinstance(vocab, int) and vocab > 1:
        limits = [getattr(config, k) for k in _POSITION_LIMITS
                  if isinstance(getattr(config, k, None), int)]
        seq = max(2, min([length, *limits]))
        pad = getattr(config, "pad_token_id", None)

        def ids() -> torch.Tensor:
            drawn = torch.randint(0, vocab, (batch, seq), generator=generator)
            if isinstance(pad, int):
                drawn[drawn == pad] = (pad + 1) % vocab
            return drawn.to(device)

        inputs = {"input_ids": ids()}
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = ids()
        return inputs
    try:
        inputs = dict(model.dummy_inputs)
    except Exception:  # noqa: BLE001 - a model without usable dummy inputs
        return None
    ids = {k: v for k, v in inputs.items() if k.endswith("input_ids")}
    inputs = ids or inputs  # token ids only: the plain call, without masks
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
