"""Models without weights: :func:`init_empty_weights` constructs modules whose parameters
land on the ``meta`` device, and :func:`_param_like` makes a tensor look like another
(the Parameter subclass, ``requires_grad``, attributes, torchloom metadata and gradient
hooks), which is how a meta tensor is replaced by real data.

:mod:`torchloom.runtime.materialise` (``build``) and :mod:`torchloom.runtime.weights`
(``load_weights``) both replace meta tensors this way.

>>> import torch
>>> with init_empty_weights():
...     model = torch.nn.Linear(2, 2)
>>> has_meta_tensors(model)
True
>>> real = _param_like(model.weight, torch.zeros(2, 2))
>>> type(real).__name__, real.requires_grad, real.device.type
('Parameter', True, 'cpu')
"""

from __future__ import annotations

import contextlib
from typing import Iterator, overload

import torch
from torch import nn

from ..core.meta import _ATTR as _META_ATTR
from ..core.meta import copy_meta

__all__ = ["init_empty_weights", "has_meta_tensors"]

_HF_FLAG = "_is_hf_initialized"


def _param_to_meta(module: nn.Module, name: str) -> None:
    param = module._parameters.get(name)
    if param is None or param.is_meta:
        return
    module._parameters[name] = _param_like(param, param.detach().to("meta"), keep_hf_flag=True)


def _buffer_to_meta(module: nn.Module, name: str) -> None:
    buf = module._buffers.get(name)
    if buf is None or buf.is_meta:
        return
    module._buffers[name] = buf.detach().to("meta")


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Construct modules without allocating their weights.

    While active, every parameter registered on any ``nn.Module`` (``self.w =
    nn.Parameter(...)`` or ``register_parameter``) is moved to the ``meta`` device, keeping
    its Parameter subclass, ``requires_grad`` and attributes. Buffers stay real unless
    ``include_buffers=True``. Pass the model to :func:`build` to materialise it.

    The patch of ``nn.Module.register_parameter`` (and ``register_buffer``) is global while
    the context is active (other threads see it too), is undone on exit even when the body
    raises, and nests: an inner context restores what the outer one installed.

    A constructor's ``torch.empty`` still allocates for a moment (untouched memory, freed
    when the parameter moves to ``meta``); tensor factories that draw random numbers
    (``torch.randn``) still draw.

    >>> import torch
    >>> with init_empty_weights():
    ...     bn = torch.nn.BatchNorm1d(4)
    >>> bn.weight.device.type, bn.running_mean.device.type
    ('meta', 'cpu')
    >>> with init_empty_weights(include_buffers=True):
    ...     bn = torch.nn.BatchNorm1d(4)
    >>> bn.running_mean.device.type
    'meta'
    """
    previous_param = nn.Module.register_parameter
    previous_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        previous_param(self, name, param)
        if param is not None:
            _param_to_meta(self, name)

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None:
        previous_buffer(self, name, tensor, persistent)
        if tensor is not None:
            _buffer_to_meta(self, name)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = previous_param  # type: ignore[method-assign]
        nn.Module.register_buffer = previous_buffer  # type: ignore[method-assign]


@overload
def _param_like(old: nn.Parameter, data: torch.Tensor, keep_hf_flag: bool = False
                ) -> nn.Parameter: ...


@overload
def _param_like(old: torch.Tensor, data: torch.Tensor, keep_hf_flag: bool = False
                ) -> torch.Tensor: ...


def _param_like(old: torch.Tensor, data: torch.Tensor, keep_hf_flag: bool = False) -> torch.Tensor:
    """A tensor holding ``data`` that looks like ``old``: same Parameter subclass (for a
    parameter), ``requires_grad``, attributes and torchloom metadata."""
    new: torch.Tensor
    if isinstance(old, nn.Parameter):
        cls = type(old)
        try:
            new = cls(data, requires_grad=old.requires_grad)
        except TypeError:  # a subclass whose constructor takes other arguments
            new = torch.Tensor._make_subclass(cls, data, old.requires_grad)
    else:
        new = data
    for key, value in old.__dict__.items():
        if key == _META_ATTR or (key == _HF_FLAG and not keep_hf_flag):
            continue
        new.__dict__[key] = value
    copy_meta(old, new)
    # gradient hooks registered on the old tensor (sync("param_grad") registers one on a
    # meta parameter at schedule time) act on the new one
    if getattr(old, "_backward_hooks", None):
        new._backward_hooks = old._backward_hooks
    if getattr(old, "_post_accumulate_grad_hooks", None):
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    return new


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (a model
    made under :func:`~torchloom.init_empty_weights` that ``build`` has not filled)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])
