"""``fork_rng()``: the module draws its random numbers from the tensor-parallel stream.

A dropout inside a tensor-parallel region (for example after a column-sharded linear)
must use a different mask on each rank; see :mod:`torchloom.runtime.rng`. ``fork_rng`` makes every
call of the node's module run inside ``get_rng_tracker().fork("model-parallel", device)``,
where ``device`` is the device of the first tensor argument (else of the module's first
parameter, else the CPU). Random numbers drawn anywhere below the module come from the
``"model-parallel"`` state; the default generator is left where it was.

How: an instance attribute ``forward`` is installed on the module, wrapping whatever
``forward`` it had (the class method, or an instance ``forward`` installed earlier, e.g.
by ``checkpoint``; the two compose in either order). The module is not wrapped in a new
module, so the module tree, ``state_dict()`` keys and hooks are unchanged. The module is
marked ``FORK_RNG`` (:mod:`torchloom.core.marks`) so that tools (a tracer) can keep it a leaf.

Preconditions:
    * ``fork_rng`` was not applied to this node's module already;
    * the module has a ``forward`` (a ``ModuleList`` has none: apply it to the items);
    * when the module runs in training mode, the ``"model-parallel"`` state is seeded:
      ``torchloom.set_random_seed(seed, tp_rank=tp_rank)``; otherwise the call raises
      :class:`~torchloom.core.errors.RngError`. In eval mode (no dropout masks to draw) an
      unseeded module just runs its forward; a seeded one forks in either mode.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
>>> sch = tl.create_schedule(model)
>>> sch["1"].fork_rng()
>>> from torchloom.core.marks import FORK_RNG, has_mark
>>> has_mark(model[1], FORK_RNG), list(model.state_dict())
(True, ['0.weight', '0.bias'])
>>> _ = tl.set_random_seed(0, tp_rank=0)
>>> default_state = torch.get_rng_state()
>>> y = model(torch.ones(2, 8))                 # the dropout mask comes from the TP stream
>>> torch.equal(torch.get_rng_state(), default_state)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import RngError
from ..core.marks import FORK_RNG, has_mark, set_mark
from ..core.registry import primitive
from ..runtime.rng import MODEL_PARALLEL, get_rng_tracker
from ._common import ForwardWrapper

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "fork_rng"

__all__ = ["NAME", "apply"]


def _device_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


class _ForkRngForward(ForwardWrapper):
    """The instance ``forward`` installed by ``fork_rng``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracker = get_rng_tracker()
        if not tracker.is_seeded(MODEL_PARALLEL):
            if not self.module.training:
                # Eval mode draws no dropout masks: an unseeded model still runs inference.
                return self._run(*args, **kwargs)
            raise RngError(
                f"the module ({type(self.module).__name__}) draws from the {MODEL_PARALLEL!r} "
                "random state, which is not seeded",
                path=self.path,
                primitive=NAME,
                values={"registered_states": sorted(tracker.seeds())},
                fix="call torchloom.set_random_seed(seed, tp_rank=tp_rank) before running the "
                "model",
            )
        with tracker.fork(MODEL_PARALLEL, device=_device_of(self.module, args, kwargs)):
            return self._run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<fork_rng forward of {type(self.module).__name__} at {self.path!r}>"


@primitive(NAME, errors=(RngError,))
def apply(sch: Schedule) -> None:
    """Make ``sch.mod`` draw random numbers from the ``"model-parallel"`` state."""
    mod = sch.mod
    if has_mark(mod, FORK_RNG):
        raise RngError(
            "fork_rng was already applied to this module",
            path=sch.path,
            primitive=NAME,
            values={"module": type(mod).__name__},
            fix=f"apply it once: remove the second sch[{sch.path!r}].fork_rng()",
        )
    if type(mod).forward is nn.Module.forward and "forward" not in mod.__dict__:
        raise RngError(
            f"a {type(mod).__name__} has no forward of its own; its items are called one by one",
            path=sch.path,
            primitive=NAME,
            values={"module": type(mod).__name__},
            fix=f"apply it to the items: sch[{(sch.path + '.*').lstrip('.')!r}].fork_rng()",
        )
    inner = mod.__dict__.get("forward")
    mod.forward = _ForkRngForward(mod, inner, sch.path)
    set_mark(mod, FORK_RNG, True)
