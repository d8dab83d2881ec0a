"""What differs between the torch releases torchloom supports (2.11 and later).

torchloom is checked on torch 2.11 (the lowest supported) and 2.13 (CI). One behaviour
needs a shim:

* **Non-float tensors between pipeline stages.** transformers models hand integer and
  boolean tensors (position ids, the causal mask) from one layer to the next, so they
  cross pipeline cuts. torch 2.13's ``PipelineStage`` receives them without gradients;
  torch 2.11's marks every received buffer ``requires_grad`` (an error for integers) and
  requires a gradient for every received tensor. On those releases
  :func:`torchloom.runtime.pipeline.split_stages` sends such tensors as floating point
  (:func:`to_transport`, exact: ``bool``/small ints as float32, larger ints as float64),
  casts them back where they arrive (:func:`from_transport`), and gives them a zero
  gradient (:func:`tie_zero_grads`). :data:`PIPELINE_SENDS_NON_FLOAT` says whether the
  running torch needs none of that.

Private torch APIs torchloom uses, all present from 2.11 to 2.13 (checked by
``tests/test_versions.py``): ``torch.distributed.pipelining.schedules`` ``_Action``,
``_ComputationType``, ``_simulate_comms_compute`` and ``_validate_schedule``
(schedule checking), ``torch.serialization._get_layout`` (DCP metadata unpickling),
``torch._subclasses.fake_tensor.FakeTensorMode`` (tracing and memory planning on fake
tensors) and ``torch.testing._internal.distributed.fake_pg`` (one-process simulations).

>>> torch_version((2, 11))
True
>>> x = torch.tensor([[True, False]])
>>> sent = to_transport(x)
>>> sent.dtype, torch.equal(from_transport(sent, torch.bool), x)
(torch.float32, True)
>>> ids = torch.tensor([3, 2**40])
>>> torch.equal(from_transport(to_transport(ids), torch.int64), ids)
True
>>> out, y = torch.ones(2, requires_grad=True), torch.zeros(3, requires_grad=True)
>>> tie_zero_grads(out, y).sum().backward()
>>> out.grad.tolist(), y.grad.tolist()
([1.0, 1.0], [0.0, 0.0, 0.0])
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = [
    "PIPELINE_SENDS_NON_FLOAT",
    "from_transport",
    "is_non_float",
    "tie_zero_grads",
    "to_transport",
    "torch_version",
]


def torch_version(at_least: tuple[int, int]) -> bool:
    """Whether the running torch release is at least ``(major, minor)`` (local and
    pre-release suffixes ignored: ``2.13.0+cpu`` and ``2.13.0a0`` count as 2.13)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None:  # an unparsable version: assume a recent build
        return True
    return (int(found.group(1)), int(found.group(2))) >= at_least


#: torch's pipelining runtime receives integer / boolean tensors between stages as they
#: are (2.13 and later; see the module docstring).
PIPELINE_SENDS_NON_FLOAT: bool = torch_version((2, 13))


def is_non_float(value: Any) -> bool:
    """A tensor that cannot carry a gradient (integer or boolean)."""
    return isinstance(value, torch.Tensor) and not (value.is_floating_point()
                                                    or value.is_complex())


def to_transport(t: torch.Tensor) -> torch.Tensor:
    """A non-float tensor as an exactly equal floating-point tensor."""
    small = t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16)
    return t.to(torch.float32 if small else torch.float64)


def from_transport(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`to_transport` (no gradient flows through it)."""
    return t.detach().to(dtype)


class _ZeroGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *received: torch.Tensor) -> torch.Tensor:
        ctx.meta = [(r.shape, r.dtype, r.device) for r in received]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device)
                 for shape, dtype, device in ctx.meta]
        return (grad, *zeros)


def tie_zero_grads(out: Any, *received: torch.Tensor) -> Any:
    """``out`` unchanged; a backward through it gives each of ``received`` a zero gradient
    (torch 2.11's pipeline runtime sends a gradient back for every tensor a stage
    received). ``out`` that is not a float tensor needing a gradient is returned as is."""
    if not (isinstance(out, torch.Tensor) and out.requires_grad and received
            and torch.is_grad_enabled()):
        return out
    return _ZeroGrads.apply(out, *received)
