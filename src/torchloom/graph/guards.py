"""Guards: the functions the generated code of a traced graph calls.

Guard functions check at run time what the tracer specialised to the example (a branch, a
number, an argument, the KV cache traced off). They are kept by dead code elimination and
ignored by the pattern matcher.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from ..core.errors import TraceGuardError


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


def guard_equal(value: Any, expected: Any, where: str) -> None:
    """Raise unless ``value == expected`` (a number or length fixed at trace time)."""
    if _recorded(guard_equal, (value, expected, where)) is not None:
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


_GUARDS = (_guard_truth, guard_equal, _guard_is_none, _guard_argument, _guard_kwargs,
           _guard_cache)


def is_guard(node: fx.Node) -> bool:
    """Whether ``node`` is a guard inserted by the tracer."""
    return node.op == "call_function" and node.target in _GUARDS


def _user_frame() -> str:
    """file:line of the model code that is being traced (for guard messages)."""
    here = os.path.dirname(__file__)
    torch_dir = os.path.dirname(torch.__file__)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(here) and not filename.startswith(torch_dir):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
