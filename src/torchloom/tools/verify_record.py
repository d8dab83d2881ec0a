"""The hooks :class:`~torchloom.tools.verify.Verify` records a model through: every
module's first floating output in forward order and the gradient of its first input in
backward order, each tagged with the module's path and call number.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
>>> rec = Recorder(model, record_grads=True)
>>> model(torch.ones(1, 2, requires_grad=True)).sum().backward()
>>> [(r.path, r.call) for r in rec.outputs]
[('0', 0), ('1', 0), ('', 0)]
>>> [r.path for r in rec.input_grads]
['1', '0', '']
>>> rec.remove()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..core.outputs import tensors_in

__all__ = ["Record", "Recorder"]


@dataclass
class Record:
    """One recorded tensor: the module's path, which call of it, the value."""

    path: str
    call: int
    value: torch.Tensor
    module: nn.Module | None = None


class Recorder:
    """Hooks on every module of one model: outputs in forward order, input gradients in
    backward order."""

    def __init__(self, model: nn.Module, record_grads: bool) -> None:
        self.outputs: list[Record] = []
        self.input_grads: list[Record] = []
        self.calls: dict[str, int] = {}
        self.stack: list[str] = []
        self.handles: list[Any] = []
        seen: set[int] = set()
        for path, module in model.named_modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            self.handles.append(module.register_forward_pre_hook(
                self._pre(path, module, record_grads), with_kwargs=True, prepend=True))
            # Not always_call: when a forward raises, the stack keeps the module that raised.
            self.handles.append(module.register_forward_hook(self._post(path, module)))

    def _pre(self, path: str, module: nn.Module, record_grads: bool) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            call = self.calls.get(path, 0)
            self.calls[path] = call + 1
            self.stack.append(path)
            if not record_grads or not torch.is_grad_enabled():
                return None
            for i, arg in enumerate(args):  # the first floating tensor input
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    marked = arg.view_as(arg)
                    marked.register_hook(self._grad(path, call, module))
                    return args[:i] + (marked,) + args[i + 1:], kwargs
            for key, arg in kwargs.items():
                if isinstance(arg, torch.Tensor) and arg.requires_grad:
                    marked = arg.view_as(arg)
                    marked.register_hook(self._grad(path, call, module))
                    return args, {**kwargs, key: marked}
            return None
        return hook

    def _grad(self, path: str, call: int, module: nn.Module) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.input_grads.append(Record(path, call, grad.detach().clone(), module))
        return hook

    def _post(self, path: str, module: nn.Module) -> Callable:
        def hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            tensors = [t for t in tensors_in(output) if t.is_floating_point()]
            if tensors:
                call = self.calls.get(path, 1) - 1
                self.outputs.append(Record(path, call, tensors[0].detach().clone(), module))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
