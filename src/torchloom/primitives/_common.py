"""Helpers shared by the primitives (not public)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import PathError

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["ForwardWrapper", "find_tensor", "owners_of", "tied_names"]


def find_tensor(sch: Schedule, name: str, primitive: str) -> tuple[nn.Module, str, torch.Tensor, bool]:
    """Resolve a (possibly dotted) parameter or buffer name below ``sch.mod``.

    Returns ``(owning module, attribute name, tensor, is_parameter)``; raises
    :class:`PathError` listing the nearest names when there is no such tensor.
    """
    module_path, _, attr = name.rpartition(".")
    try:
        owner = sch.mod.get_submodule(module_path)
    except AttributeError:
        owner = None
    if owner is not None:
        if (param := owner._parameters.get(attr)) is not None:
            return owner, attr, param, True
        if (buffer := owner._buffers.get(attr)) is not None:
            return owner, attr, buffer, False
    names = [n for n, _ in sch.mod.named_parameters()] + [n for n, _ in sch.mod.named_buffers()]
    nearest = difflib.get_close_matches(name, names, n=3, cutoff=0.4) or names[:5]
    raise PathError(
        f"{type(sch.mod).__name__} has no parameter or buffer {name!r}",
        path=sch.path,
        primitive=primitive,
        values={"name": name, "nearest": nearest},
        fix=f"use one of: {', '.join(repr(n) for n in nearest)}" if nearest
        else "this module has no parameters or buffers; pick a child path",
    )


def owners_of(root: nn.Module, tensor: torch.Tensor) -> list[tuple[nn.Module, str, bool]]:
    """Every ``(module, attribute, is_parameter)`` slot in ``root`` that holds ``tensor``
    (tied weights appear more than once)."""
    slots = []
    for module in root.modules():
        for attr, value in module._parameters.items():
            if value is tensor:
                slots.append((module, attr, True))
        for attr, buffer in module._buffers.items():
            if buffer is tensor:
                slots.append((module, attr, False))
    return slots


def tied_names(root: nn.Module, tensor: torch.Tensor) -> list[tuple[nn.Module, str, str]]:
    """``(module, attribute, dotted name in root)`` of every slot in ``root`` that holds
    ``tensor``; more than one means the tensor is tied (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``). A module registered at two paths counts once."""
    found = []
    for path, module in root.named_modules():
        for store in (module._parameters, module._buffers):
            for attr, value in store.items():
                if value is tensor:
                    found.append((module, attr, f"{path}.{attr}" if path else attr))
    return found


class ForwardWrapper:
    """Base of the instance ``forward`` objects that primitives install (checkpoint,
    fork_rng) instead of wrapping the module in a new one, so module paths and state-dict
    keys stay the same.

    A callable object rather than a closure, so that ``copy.deepcopy`` and pickling of the
    module carry it along pointing at the copy. ``inner`` is None (call the class forward)
    or the instance forward that was installed before, so wrappers compose.
    """

    def __init__(self, module: nn.Module, inner: Any, path: str) -> None:
        self.module = module
        self.inner = inner
        self.path = path

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)
