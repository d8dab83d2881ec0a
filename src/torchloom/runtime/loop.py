"""The training step every command runs (demo, train, bench, the tuner's measurement), and
the learning-rate schedule of demo and train.

A step, in this order: the learning rate set, the loss and its gradients, the loss checked,
the gradients clipped, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``.
The optimizer holds the parameters the loss gives gradients to; they start with none.

>>> import torch
>>> model, x = torch.nn.Linear(4, 1), torch.ones(8, 4)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> losses = [train_step(lambda: model(x).pow(2).mean(), opt, lr=lr_at(s, 3, 0.1), clip=1.0)[0]
...           for s in range(3)]
>>> losses[0] > losses[-1], model.weight.grad, round(opt.param_groups[0]["lr"], 3)
(True, None, 0.055)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["lr_at", "train_step"]


def lr_at(step: int, steps: int, peak: float, *, warmup: int | None = None,
          decay: str = "cosine", min_ratio: float = 0.1) -> float:
    """The learning rate of (0-based) ``step``: linear warm-up over ``warmup`` steps (None:
    10% of ``steps``, at least 1), then ``cosine`` or ``linear`` decay to ``min_ratio *
    peak`` at the last step, or ``constant``.

    >>> round(lr_at(0, 100, 1.0), 3), round(lr_at(99, 100, 1.0), 3)
    (0.1, 0.1)
    """
    warmup = max(1, steps // 10) if warmup is None else warmup
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay == "constant":
        return peak
    progress = (step - warmup) / max(1, steps - warmup)
    if decay == "linear":
        return peak * (min_ratio + (1 - min_ratio) * (1 - progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_step(loss_fn: Callable[[], torch.Tensor | float], optimizer: torch.optim.Optimizer,
               *, lr: float | None = None, clip: float | Callable[[], Any] | None = None,
               check: Callable[[float], None] | None = None,
               read_loss: bool = True) -> tuple[Any, Any]:
    """One training step (module docstring); ``(loss, gradient norm before clipping)``.

    Args:
        loss_fn: the loss: a tensor, whose backward runs here, or a float when it ran
            backward itself (gradient accumulation, a pipeline).
        lr: set on every parameter group first (None: left as it is).
        clip: a maximum norm (``clip_grad_norm_`` over the optimizer's parameters), or a
            callable that clips and returns the norm (gradients sharded over ranks).
        check: called with the loss before the optimizer step; raises to stop the run.
        read_loss: False: a loss tensor is not read (no device synchronisation inside a
            timed step) and None is returned for it.
    """
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    loss = loss_fn()
    value: Any = loss
    if isinstance(loss, torch.Tensor):
        loss.backward()
        value = loss.item() if read_loss else None
    del loss  # a tensor is freed before the optimizer step
    if check is not None:
        check(value)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = None if clip is None else clip() if callable(clip) else \
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value, norm
