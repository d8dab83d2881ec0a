"""The tracer: an ``fx.Tracer`` whose proxies carry example values, specialising control
flow with guards, and the lock under which traces run one at a time."""

from __future__ import annotations

import inspect
import math
import operator
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from ..core.errors import TraceError
from .binding import _Arg, _dynamic
from .fake import (
    _data_dependent,
    _is_output_mapping,
    _tensors_on_meta,
    _TraceExit,
    meta_values,
    on_meta,
)
from .guards import (
    _GUARDS,
    CACHE_ARGUMENTS,
    CACHE_FLAG,
    _guard_argument,
    _guard_cache,
    _guard_is_none,
    _guard_kwargs,
    _guard_truth,
    _unknowable,
    _user_frame,
    guard_equal,
    is_cache,
    layer_index,
)
from .proxies import _NO_VALUE, _ValueProxy

#: Held while torch.fx traces (in :mod:`torchloom.graph.tracing` and
#: :mod:`torchloom.graph.pattern`): ``fx.Tracer.trace`` patches ``nn.Module.__call__`` /
#: ``__getattr__`` and wrapped functions process-wide for the duration of a trace, so two
#: traces at once in two threads would route each other's module calls. Traces therefore run
#: one at a time; the tracer's hooks ignore calls made by other threads, so a thread that
#: only *runs* models is not affected by a trace.
TRACE_LOCK = threading.RLock()


# torch functions that do not dispatch on a traced size / device / dtype argument: while
# tracing, a call with a traced argument becomes a graph node.
_FACTORIES = (
    "arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "eye", "linspace",
    "rand", "randn", "randint", "finfo", "iinfo", "scalar_tensor",
)

#: torch's own helpers that inspect their arguments' types (``isinstance(x, Tensor)``),
#: which a proxy fails: called with traced arguments they become nodes, so that torch.nn
#: modules such as ``nn.TransformerEncoder`` can be traced into (their layers stay leaves)
_OPAQUE_HELPERS = (
    ("torch.nn.functional", "_canonical_mask"),
    ("torch.nn.functional", "_none_or_dtype"),
    ("torch.nn.modules.transformer", "_get_seq_len"),
    ("torch.nn.modules.transformer", "_detect_is_causal_mask"),
)


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
        self.create_node("call_function", guard_equal,
                         (obj.node, value, f"{self.where}|{_user_frame()}"), {})
        return value

    def specialise_len(self, obj: fx.Proxy) -> int:
        n = len(self._need_value(obj, "takes len() of"))
        length = self.create_proxy("call_function", len, (obj,), {})
        self.create_node("call_function", guard_equal,
                         (length.node, n, f"{self.where}|{_user_frame()}"), {})
        return n

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = self._need_value(obj, "iterates over")
        if isinstance(value, dict):
            return iter(list(value.keys()))
        n = len(value)
        return iter([obj[i] for i in range(n)])  # type: ignore[index]  # fx adds it at run time

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
                self.create_node("call_function", guard_equal,
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


@contextmanager
def _patched_factories(tracer: _Tracer) -> Iterator[None]:
    """While tracing, torch factory functions called with traced arguments become nodes."""
    import importlib

    saved: dict[tuple[Any, str], Any] = {}
    places = [(torch, name) for name in _FACTORIES]
    for module_name, name in _OPAQUE_HELPERS:
        try:
            places.append((importlib.import_module(module_name), name))
        except ImportError:  # pragma: no cover - every supported torch has them
            continue
    for owner, name in places:
        original = getattr(owner, name, None)
        if original is None:
            continue
        saved[owner, name] = original

        def wrapper(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            found = []
            map_aggregate((args, kwargs),
                          lambda a: found.append(a) if issubclass(type(a), fx.Proxy) else None)
            if found and not tracer.executing and threading.get_ident() == tracer.thread:
                return tracer.create_proxy("call_function", __original, args, kwargs)
            return __original(*args, **kwargs)

        setattr(owner, name, wrapper)
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
