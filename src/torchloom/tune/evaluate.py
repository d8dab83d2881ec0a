"""Evaluating a candidate: run it, measure throughput and peak memory.

An evaluator is any callable ``evaluate(recipe, point) -> Result``. The tuner calls it
in-process, one candidate at a time. :class:`TrainEvaluator` is the default: it replays
the recipe on a fresh model, builds it with an AdamW optimizer, trains a few steps
(:func:`~torchloom.runtime.loop.train_step`) on its device and reports

* throughput: tokens per second (``input_ids.numel()`` per step; samples per second when
  the inputs have no ``input_ids``) of the median step after the warm-up (the median
  shrugs off a step that other processes on a shared machine slowed down);
* peak memory: the peak of the distinct storages alive during one steady training step
  (the second: the first creates the optimizer state), followed by
  :class:`~torchloom.runtime.memory.LiveBytes`: parameters, optimizer state, inputs,
  activations, recomputation, gradients and temporaries, as the allocator would hold
  them. That step is untimed (following storages slows every operator down); then come
  ``warmup`` untimed and ``steps`` timed steps.

A memory limit makes a candidate whose measured peak exceeds it fail as out of memory,
so a CPU run behaves like a device with that much memory.

>>> import torch, torchloom as tl
>>> from torch import nn
>>> ev = TrainEvaluator(lambda: nn.Linear(8, 8),
...                     lambda m, p: {"input": torch.randn(p["batch_size"], 8)},
...                     loss_fn=lambda out: out.sum(), steps=2, warmup=1)
>>> result = ev(tl.Recipe(), {"batch_size": 4})
>>> result.ok, result.throughput > 0
(True, True)
>>> # at least parameters, AdamW state and input: 288 + (2 * 288 + 8) + 128 bytes
>>> 1000 < result.peak_memory_bytes < 4000
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..core.recipe import Recipe, apply_recipe
from ..runtime.build import build
from ..runtime.loop import train_step
from ..runtime.memory import LiveBytes, default_loss

__all__ = ["Evaluator", "Result", "TrainEvaluator", "describe_exception"]


@dataclass(frozen=True)
class Result:
    """The outcome of evaluating one candidate.

    Attributes:
        throughput: higher is better (tokens/s for the default evaluator); 0 if not ok.
        peak_memory_bytes: measured peak, or None if unknown.
        ok: whether it ran.
        error: why not (e.g. ``"out of memory: ..."``).
    """

    throughput: float
    peak_memory_bytes: int | None = None
    ok: bool = True
    error: str | None = None


Evaluator = Callable[[Recipe, Mapping[str, Any]], Result]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class TrainEvaluator:
    """Train a candidate for a few steps and measure it (see the module docstring).

    Args:
        make_model: builds a fresh, unscheduled model.
        make_inputs: ``(model, point) -> dict`` of keyword arguments of one training
            forward at the point.
        loss_fn: model output -> scalar loss.
        optimizer: a factory ``params -> Optimizer`` (default AdamW).
        steps: measured steps; warmup: steps run first and not timed.
        memory_limit_bytes: a candidate whose measured peak is above it fails as out of
            memory; None: no limit.
        seed: the global torch seed set before the model is made.
    """

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        make_inputs: Callable[[nn.Module, Mapping[str, Any]], dict[str, Any]],
        loss_fn: Callable[[Any], torch.Tensor] = default_loss,
        optimizer: Callable[[Any], torch.optim.Optimizer] = _adamw,
        steps: int = 3,
        warmup: int = 1,
        memory_limit_bytes: int | None = None,
        seed: int = 0,
    ) -> None:
        self.make_model = make_model
        self.make_inputs = make_inputs
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.steps = steps
        self.warmup = warmup
        self.memory_limit_bytes = memory_limit_bytes
        self.seed = seed

    def __call__(self, recipe: Recipe, point: Mapping[str, Any]) -> Result:
        """Evaluate ``recipe`` at ``point``; a ``torch.OutOfMemoryError`` (or a measured
        peak over the limit) gives a failed :class:`Result`, other errors propagate."""
        try:
            return self._run(recipe, point)
        except torch.OutOfMemoryError as exc:
            return Result(0.0, None, ok=False, error=f"out of memory: {exc}".splitlines()[0])

    def _run(self, recipe: Recipe, point: Mapping[str, Any]) -> Result:
        torch.manual_seed(self.seed)
        sch = apply_recipe(self.make_model(), recipe)
        model, optimizer = build(sch, optimizer=self.optimizer)
        assert optimizer is not None
        model.train()
        inputs = self.make_inputs(model, point)
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            work = ids.numel()
        else:
            first = next(v for v in inputs.values() if isinstance(v, torch.Tensor))
            work = first.shape[0]

        def step() -> None:
            train_step(lambda: self.loss_fn(model(**inputs)), optimizer, read_loss=False)

        step()  # creates the optimizer state: from here on every step is alike
        live = LiveBytes()
        states = [v for state in optimizer.state.values() for v in state.values()]
        for tensor in [*model.parameters(), *states, *tree_flatten(inputs)[0]]:
            live.track(tensor)
        with live:
            step()
        peak = live.peak
        for _ in range(self.warmup):
            step()
        durations: list[float] = []
        for _ in range(self.steps):
            start = time.perf_counter()
            step()
            durations.append(time.perf_counter() - start)
        if self.memory_limit_bytes is not None and peak > self.memory_limit_bytes:
            return Result(0.0, peak, ok=False,
                          error=f"out of memory: peak {peak} B > limit {self.memory_limit_bytes} B")
        median = statistics.median(durations) if durations else 0.0
        throughput = work / median if median > 0 else float("inf")
        return Result(throughput, peak, ok=True)


def describe_exception(exc: BaseException) -> str:
    """One line naming an exception, for the database: its type and first line.

    >>> describe_exception(ValueError("bad value" + chr(10) + "    more"))
    'ValueError: bad value'
    """
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
