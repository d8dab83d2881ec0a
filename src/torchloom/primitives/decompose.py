"""``decompose()``: split a linear layer into its matmul and a separate bias add.

An ``nn.Linear`` becomes a :class:`DecomposedLinear` (``F.linear(x, weight) + bias``) and a
transformers ``Conv1D`` a :class:`DecomposedConv1D` (``x @ weight + bias``). Both are
subclasses of the original class holding the *same* ``weight`` and ``bias`` Parameter
objects under the same names, so ``state_dict()`` keys, shard records, tags and
``isinstance`` checks are unchanged; hooks and the training mode carry over as with
``replace``. Unlike the original, the tracer traces through them, so once the parent is
traced with ``flatten=True`` the bias add is a node of its graph and a following
activation can be fused with it (``find(lambda x, b: F.gelu(x + b))`` then ``fuse``).

Preconditions:
    * the module is an ``nn.Linear`` or a transformers ``Conv1D`` with a bias, not already
      decomposed;
    * its ``forward`` was not replaced on the instance (``checkpoint``, ``fork_rng``, a
      row-parallel ``sync``): decompose first.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU())
>>> weight = model[0].weight
>>> x = torch.randn(2, 4)
>>> expected = model(x)
>>> sch = tl.create_schedule(model)
>>> sch["0"].decompose()
>>> type(model[0]).__name__, model[0].weight is weight, isinstance(model[0], nn.Linear)
('DecomposedLinear', True, True)
>>> torch.allclose(model(x), expected)
True
>>> sch.trace(flatten=True, example_inputs=(x,))
>>> from torchloom.graph.guards import is_guard
>>> [n.target.__name__ for n in sch.mod.graph.nodes
...  if n.op == "call_function" and not is_guard(n)]
['linear', 'add']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import FuseError
from ..core.marks import marks_of, set_mark
from ..core.registry import primitive
from ..graph.graph_module import is_conv1d
from .replace import swap_module

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "decompose"

__all__ = ["NAME", "DecomposedLinear", "DecomposedConv1D", "apply"]


class DecomposedLinear(nn.Linear):
    """``nn.Linear`` computed as ``F.linear(x, weight) + bias`` (same parameters)."""

    def __init__(self, old: nn.Linear) -> None:  # noqa: D107 - takes over old's parameters
        nn.Module.__init__(self)
        self.in_features, self.out_features = old.in_features, old.out_features
        self.weight, self.bias = old.weight, old.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.bias


_CONV1D_CLASSES: dict[type, type[nn.Module]] = {}


def DecomposedConv1D(old: nn.Module) -> nn.Module:  # noqa: N802 - a class factory
    """The decomposed form of a transformers ``Conv1D`` (``x @ weight + bias``)."""
    base = type(old)
    cls = _CONV1D_CLASSES.get(base)
    if cls is None:
        def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(x, self.weight) + self.bias

        cls = type("DecomposedConv1D", (base,), {"forward": forward, "__module__": __name__,
                                                "__doc__": DecomposedConv1D.__doc__})
        _CONV1D_CLASSES[base] = cls
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(old).items():
        if not key.startswith("_") and key != "training":
            setattr(new, key, value)  # nf, nx
    new.weight, new.bias = old.weight, old.bias
    return new


@primitive(NAME, errors=(FuseError,))
def apply(sch: Schedule) -> None:
    """Replace the linear layer at ``sch`` by its decomposed form."""
    mod = sch.mod
    kind = type(mod).__name__
    if isinstance(mod, DecomposedLinear) or kind == "DecomposedConv1D":
        raise FuseError(
            "this layer is already decomposed",
            path=sch.path, primitive=NAME, values={"module": kind},
            fix=f"decompose once: remove the second sch[{sch.path!r}].decompose()",
        )
    if not (isinstance(mod, nn.Linear) or is_conv1d(mod)):
        raise FuseError(
            f"decompose splits an nn.Linear or a transformers Conv1D, not a {kind}",
            path=sch.path, primitive=NAME, values={"module": kind},
            fix="point it at the linear layer whose bias to separate, e.g. "
            "sch['bert.encoder.layer.0.intermediate.dense'].decompose()",
        )
    if getattr(mod, "bias", None) is None:
        raise FuseError(
            "this layer has no bias, so there is nothing to separate",
            path=sch.path, primitive=NAME, values={"module": kind},
            fix="decompose a layer with a bias, or fuse without decomposing",
        )
    if "forward" in mod.__dict__:
        raise FuseError(
            "the layer's forward was replaced on the instance (checkpoint, fork_rng or a "
            "row-parallel sync)",
            path=sch.path, primitive=NAME,
            values={"marks": sorted(marks_of(mod))},
            fix=f"decompose first: sch[{sch.path!r}].decompose() before those primitives",
        )
    new = DecomposedLinear(mod) if isinstance(mod, nn.Linear) else DecomposedConv1D(mod)
    own = marks_of(new)
    for name, value in marks_of(mod).items():
        if name not in own:
            set_mark(new, name, value)  # e.g. recorded syncs
    swap_module(sch, new)
