"""Tensors without data: example values of a model with ``meta`` weights are ``meta``
tensors, computed again on fake tensors (``FakeTensorMode``) where code reads a value."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.errors import TraceError
from ..core.meta import copy_meta, has_meta
from .guards import _is_fake

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensor


class _TraceExit(Exception):
    """Raised by the input-capturing hook to stop a model run early."""


def _is_output_mapping(a: Any) -> bool:
    """A dict subclass such as a transformers ``ModelOutput`` (rebuilt by a node)."""
    return isinstance(a, dict) and type(a) not in (dict,) and \
        not type(a).__module__.startswith("torch.fx") and \
        type(a).__name__ not in ("OrderedDict", "defaultdict", "immutable_dict")


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
            return cast("FakeTensor", t).fake_mode
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
        with grouped_mm_on_fake():
            return fn(*meta_values(args))
    except (TraceError, _TraceExit):
        raise
    except Exception:  # noqa: BLE001 - retried on fake tensors; a real error raises again
        with mode, grouped_mm_on_fake():
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
        for slots in cast("tuple[dict[str, Any], ...]", (m._parameters, m._buffers)):
            for name, t in slots.items():
                if t is None or t.is_meta or _is_fake(t):
                    continue
                meta = t.detach().to("meta")
                if isinstance(t, nn.Parameter):
                    meta = nn.Parameter(meta, requires_grad=t.requires_grad)
                if has_meta(t):  # a hook may read the shard spec (vocab_ids_local does)
                    copy_meta(t, meta)
                swapped.append((slots, name, t))
                slots[name] = meta
    try:
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


def _no_data(t: torch.Tensor) -> bool:
    return t.is_meta or _is_fake(t)


class _GroupedMMOnFake(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._overloadpacket is not getattr(torch.ops.aten, "_grouped_mm", None):
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        if not (_no_data(a) and _no_data(b)) or a.dtype == b.dtype == torch.bfloat16:
            return func(*args, **kwargs)
        dtype = a.dtype
        out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
        return out.to(dtype)


def grouped_mm_on_fake() -> TorchDispatchMode:
    """A dispatch mode under which ``torch._grouped_mm`` of fake or meta tensors of any
    dtype gives its output's shape (PyTorch's meta kernel takes bfloat16 only, and every
    mixture-of-experts family of transformers computes its experts with it): the product
    runs on bfloat16 copies, its result is cast back. Enter it *outside* a mode that
    counts operators (it then sees one ``_grouped_mm``, not the casts); real tensors pass
    through.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode(), grouped_mm_on_fake():
    ...     x, w = torch.empty(6, 8), torch.empty(2, 8, 16)
    ...     offs = torch.tensor([3, 6], dtype=torch.int32)
    ...     y = torch._grouped_mm(x, w, offs=offs)
    >>> tuple(y.shape), y.dtype
    ((6, 16), torch.float32)
    """
    return _GroupedMMOnFake()
