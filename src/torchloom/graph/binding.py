"""Argument binding: what the example call gives each parameter of the traced ``forward``
(a dynamic value, a constant, or the KV cache traced off)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import TraceError
from .guards import CACHE_ARGUMENTS, CACHE_FLAG, is_cache
from .proxies import _NO_VALUE

_SIMPLE = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _is_simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def _dynamic(value: Any) -> bool:
    return not _is_simple(value)


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
