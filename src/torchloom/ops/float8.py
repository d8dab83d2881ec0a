"""Float8 matmuls in the layers' linear layers (``Layout.float8``), with torchao.

torchao's float8 training (``torchao.float8.convert_to_float8_training``) replaces an
``nn.Linear`` by a ``Float8Linear`` that casts its input, weight and output gradient to
float8 (dynamic tensor-wise scales) for the three matrix products of its forward and
backward; the weight stays in its dtype. It needs a CUDA GPU with float8 matrix
products (compute capability 8.9 or more: Ada, Hopper and later) and torchao (the
``float8`` extra: ``pip install 'torchloom[float8]'``); :func:`float8_problem` says what
is missing, and :func:`torchloom.parallelize` and ``torchloom train --float8`` refuse a
machine without it before anything is built.

:func:`apply_float8` converts, through the ``replace`` primitive (so the schedule's
``sync`` hooks and the parameters' shard specs carry over, and the recipe records it),
every ``nn.Linear`` inside the layers of the stacks whose (local, after tensor
parallelism) sizes are multiples of 16; the embeddings and the head stay as they are (as
in torchtitan).

>>> float8_problem("cpu")[0]
'Float8 matmuls run on a CUDA GPU, and the device is cpu'
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from ..core.refs import schedule_safe
from ..core.schedule import Schedule

__all__ = ["apply_float8", "float8_linear", "float8_problem"]

MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability with float8 matrix products (Ada; Hopper is 9.0)."""
FIX = ("run on a CUDA GPU of compute capability 8.9 or more (H100, L40S, RTX 4090) with "
       "torchao installed (pip install 'torchloom[float8]'), or leave float8 out")


def float8_problem(device: str | torch.device) -> tuple[str, dict[str, Any]] | None:
    """Why float8 training cannot run on ``device`` (a problem and its values), or None.

    >>> float8_problem(torch.device("cpu"))[1]
    {'device': 'cpu'}
    """
    kind = torch.device(device).type
    if kind != "cuda":
        return f"Float8 matmuls run on a CUDA GPU, and the device is {kind}", {"device": kind}
    if not torch.cuda.is_available():
        return "Float8 matmuls run on a CUDA GPU, and none is available", {
            "device": kind, "torch": torch.__version__}
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (f"Float8 matmuls need a GPU of compute capability {MIN_CAPABILITY[0]}."
                f"{MIN_CAPABILITY[1]} or more, and this one has {capability[0]}.{capability[1]}",
                {"device": torch.cuda.get_device_name(), "capability": capability})
    if importlib.util.find_spec("torchao") is None:
        return "Float8 training is torchao's, and torchao is not installed", {
            "torchao": None}
    return None


@schedule_safe
def float8_linear(old: nn.Module) -> nn.Module:
    """``replace`` factory: ``old`` (an ``nn.Linear``) as torchao's ``Float8Linear``
    (``convert_to_float8_training`` with its default, tensor-wise dynamic scaling). The
    weight (and its shard spec and tags) is kept."""
    from torchao.float8 import convert_to_float8_training

    new: nn.Module = convert_to_float8_training(old)
    return new


def _fits(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(module) is nn.Linear and isinstance(weight, torch.Tensor) and \
        weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def apply_float8(sch: Schedule, stacks: list[str]) -> list[str]:
    """Replace every plain ``nn.Linear`` inside the layers of ``stacks`` (full paths)
    whose weight's sizes are multiples of 16 by :func:`float8_linear`; returns their
    paths. The caller checks :func:`float8_problem` first."""
    done: list[str] = []
    for stack in stacks:
        for name, module in list(sch[stack].mod.named_modules()):
            if name and "." in name and _fits(module):  # inside a layer, not the stack
                path = f"{stack}.{name}"
                sch[path].replace(float8_linear)
                done.append(path)
    return done
