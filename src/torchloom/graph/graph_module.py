"""The traced graph module: :class:`TracedGraphModule`, the classes that mix it with the
original class, :func:`is_traced`, and which modules the tracer keeps opaque (:func:`is_leaf`).
"""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING, Any, Sequence

import torch.fx as fx
from torch import nn

from ..core.marks import LEAF, has_mark

if TYPE_CHECKING:
    from typing_extensions import TypeIs


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
        new: TracedGraphModule = object.__new__(_instance_class(self.traced_from))
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
            namespace: dict[str, Any] = {"traced_from": original, "__module__": __name__}
            custom = getattr(original, "is_custom_code", None)
            if bases[-1] is original and callable(custom):
                # transformers tells its own models from custom code by the class's
                # module; a traced model is still the library's model (its key renames,
                # e.g. GPT-NeoX's embed_out -> lm_head, and its init rules apply)
                namespace["is_custom_code"] = classmethod(lambda _cls: custom())
            cls = type(f"Traced{original.__name__}", bases, namespace)
            _TRACED_CLASSES[original] = cls
    return cls


def _instance_class(original: type) -> type:
    """A fresh per-instance class, as fx gives every graph module its own ``forward``."""
    impl = type("GraphModuleImpl", (_traced_class(original),), {})
    impl.__qualname__ = "GraphModuleImpl"
    impl.__name__ = original.__name__
    return impl


def is_traced(module: nn.Module) -> TypeIs[TracedGraphModule]:
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


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D`` (a linear layer stored transposed)."""
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
    if is_conv1d(module):
        return True
    cls_module = type(module).__module__
    builtin = cls_module.startswith("torch.nn") or cls_module.startswith("torch.ao.nn")
    return builtin and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
