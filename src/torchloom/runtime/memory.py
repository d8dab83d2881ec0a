"""A memory cost model: the peak training memory of a candidate, without allocating it.

The candidate (a fresh model with the recipe replayed) runs one training forward and
backward under :class:`torch._subclasses.fake_tensor.FakeTensorMode`: tensors have shapes,
dtypes and storages of a size, but no data and no memory. A dispatch mode,
:class:`LiveBytes`, follows every storage the step creates and frees (a weak-reference
finaliser per storage), so it sees the step as an allocator would: activations saved for
backward, the recomputation of checkpointed layers in backward, gradients, temporaries.
Its peak, plus the optimizer state that lives through a steady step, is the prediction,
for the model as this rank holds it (after ``shard`` each rank keeps a slice: the estimate
is per rank). The optimizer step itself is not simulated; its temporaries (a few tensors
of a parameter's size, when activations are already freed) are ignored.

The steady parts are reported too: parameters and gradients count each storage once
(tied weights once), gradients only for parameters that require them; AdamW keeps two
states of a parameter's size plus a 4-byte ``step`` per parameter tensor; activations are
the distinct storages autograd saves in the forward (a
:func:`torch.autograd.graph.saved_tensors_hooks` pack hook, parameters excluded), where a
checkpointed region, which installs its own hooks, keeps only its inputs.

The measured counterpart (:class:`~torchloom.tune.TrainEvaluator`) runs the same
:class:`LiveBytes` over a real training step.

>>> import torch
>>> from torch import nn
>>> make = lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
>>> model = CostModel(make, lambda m, p: {"input": torch.randn(p["batch_size"], 64)},
...                   loss_fn=lambda out: out.sum())
>>> import torchloom as tl
>>> est = model.predict(tl.Recipe(), {"batch_size": 32})
>>> est.parameters, est.gradients, est.optimizer
(132352, 132352, 264720)
>>> est.activations    # input, ReLU output saved by ReLU and by the 2nd Linear (once)
40960
>>> est.peak == est.total > est.parameters + est.gradients + est.optimizer
True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.errors import TuneError
from ..core.recipe import Recipe, apply_recipe

__all__ = [
    "CostModel",
    "LiveBytes",
    "MemoryEstimate",
    "SavedBytes",
    "count_saved",
    "default_loss",
    "fake_mode",
    "state_bytes",
]

ADAMW_STATES = 2
STEP_BYTES = 4  # AdamW's "step" is a float32 scalar tensor per parameter


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of a training step, and its steady parts (bytes).

    Attributes:
        parameters, gradients, optimizer: the model's state, as this rank holds it.
        activations: the storages saved for backward by the forward.
        peak: live bytes at the worst moment of the step (see the module docstring).
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int

    @property
    def total(self) -> int:
        """The predicted peak (what a budget is compared against)."""
        return self.peak


class LiveBytes(TorchDispatchMode):
    """A dispatch mode that adds up the distinct storages alive, and their peak.

    Every tensor an operator returns while the mode is active is followed (and any tensor
    passed to :meth:`track`): its storage counts from then until it is freed. Works on real
    and on fake tensors.

    >>> live = LiveBytes()
    >>> with live:
    ...     a = torch.ones(1000)          # 4000 bytes
    ...     b = (a * 2).view(10, 100)     # 4000 more; a view shares its storage
    ...     del a
    >>> live.current, live.peak
    (4000, 8000)
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def track(self, tensor: Any) -> None:
        """Count ``tensor``'s storage from now until it is freed (once per storage)."""
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        size = storage.nbytes()
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            self.track(item)
        return out


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output: ``output.loss`` (transformers), else the sum of the
    first tensor found.

    >>> default_loss(torch.ones(2, 3)).item()
    6.0
    """
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.sum()
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item.sum()
    raise TuneError(
        f"cannot find a loss in a model output of type {type(output).__name__}",
        primitive="CostModel",
        values={"output": type(output).__name__},
        fix="pass loss_fn=lambda out: ... that returns a scalar tensor",
    )


class SavedBytes:
    """The running total of distinct storages saved for backward (see :func:`count_saved`)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.sizes: dict[int, int] = {}

    @property
    def total(self) -> int:
        """Bytes saved so far."""
        return sum(self.sizes.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: count ``t``'s storage once, keep ``t`` as autograd would."""
        key = _key(t)
        if key not in self.exclude:
            self.sizes[key] = t.untyped_storage().nbytes()
        return t


@contextlib.contextmanager
def count_saved(model: nn.Module) -> Iterator[SavedBytes]:
    """Count the bytes of the distinct storages autograd saves while the block runs,
    excluding the storages of ``model``'s parameters.

    >>> lin = nn.Linear(4, 4)
    >>> with count_saved(lin) as saved:
    ...     _ = lin(torch.randn(3, 4)).relu().sum()
    >>> saved.total   # the input (3x4 floats, saved by the linear) and the relu output
    96
    """
    exclude = {_key(p) for p in model.parameters()}
    saved = SavedBytes(exclude)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        yield saved


def _unique(tensors: Iterable[torch.Tensor]) -> int:
    sizes = {_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def state_bytes(model: nn.Module, optimizer_states: int = ADAMW_STATES) -> tuple[int, int, int]:
    """Predicted ``(parameters, gradients, optimizer)`` bytes of ``model`` as this rank holds
    it, for an Adam-like optimizer with ``optimizer_states`` states per parameter.

    >>> state_bytes(nn.Linear(4, 4))   # 20 floats; 2 tensors -> 2 step scalars
    (80, 80, 168)
    """
    params = list(model.parameters())
    trainable = list({_key(p): p for p in params if p.requires_grad}.values())
    param_bytes = _unique(params)
    grad_bytes = _unique(trainable)
    opt_bytes = optimizer_states * grad_bytes + (STEP_BYTES * len(trainable) if optimizer_states else 0)
    return param_bytes, grad_bytes, opt_bytes


def fake_mode() -> FakeTensorMode:
    """A fake-tensor mode for building and running candidates without allocating."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class CostModel:
    """Predict the peak training memory of a candidate recipe at a point.

    Args:
        make_model: builds a fresh (unscheduled) model; called under fake-tensor mode, so
            nothing is allocated.
        make_inputs: ``(model, point) -> dict`` of keyword arguments for one training
            forward at the point (e.g. of its batch size); also called under fake mode.
        loss_fn: output -> scalar loss (default :func:`default_loss`).
        optimizer_states: states kept per parameter (AdamW: 2; SGD without momentum: 0).
    """

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        make_inputs: Callable[[nn.Module, Mapping[str, Any]], dict[str, Any]],
        loss_fn: Callable[[Any], torch.Tensor] = default_loss,
        optimizer_states: int = ADAMW_STATES,
    ) -> None:
        self.make_model = make_model
        self.make_inputs = make_inputs
        self.loss_fn = loss_fn
        self.optimizer_states = optimizer_states

    def predict(self, recipe: Recipe, point: Mapping[str, Any]) -> MemoryEstimate:
        """The estimate for ``recipe`` replayed on a fresh fake model, at ``point``."""
        with fake_mode():
            model = self.make_model()
            apply_recipe(model, recipe)
            model.train()
            params, grads, opt = state_bytes(model, self.optimizer_states)
            inputs = self.make_inputs(model, point)
            live = LiveBytes()
            for tensor in [*model.parameters(), *tree_flatten(inputs)[0]]:
                live.track(tensor)
            with live:
                with count_saved(model) as saved:
                    loss = self.loss_fn(model(**inputs))
                loss.backward()
        return MemoryEstimate(params, grads, opt, saved.total, live.peak + opt)
