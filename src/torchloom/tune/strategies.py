"""Search strategies: which points to try, in which order.

A strategy gets the space and a ``trial(point) -> TrialRecord`` function from the tuner.
``trial`` evaluates the point (or returns the stored result of a point already tried, in
this run or a run before it, or the pruned record of a point the memory cost model ruled
out), so a strategy only decides what to ask next. Every strategy is deterministic for a
given seed and given trial results, which is what lets an interrupted run resume: the
strategy replays its decisions, reading finished trials from the database.

* :class:`Exhaustive`: every point, in enumeration order.
* :class:`BinarySearch`: Slapo's search over batch size and checkpoint ratio (below).
* :class:`ModelBased`: optuna's TPE sampler, seeded, over the points of the space.

BinarySearch follows Slapo's search over batch size and checkpoint ratio, on any space
that holds both symbols: docs/design/tuner.md describes its three steps and assumptions.

>>> from torchloom.tune import Space
>>> space = Space()
>>> _ = space.create_symbol("batch_size", [1, 2, 4, 8, 16, 32, 64])
>>> _ = space.create_symbol("ckpt_ratio", [0.0, 0.25, 0.5, 0.75, 1.0])
>>> seen = []
>>> def trial(p):   # fits while batch * (1.25 - ratio) <= 20; faster with less recompute
...     seen.append(p)
...     ok = p["batch_size"] * (1.25 - p["ckpt_ratio"]) <= 20
...     thr = p["batch_size"] * (1 - 0.3 * p["ckpt_ratio"]) if ok else 0.0
...     return TrialRecord(p, "ok" if ok else "failed", thr)
>>> BinarySearch().search(space, trial)
>>> len({point_key(p) for p in seen}), space.count()
(11, 35)
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ..core.errors import TuneError
from .database import TrialRecord
from .space import Point, Space, point_key

__all__ = ["STRATEGIES", "BinarySearch", "Exhaustive", "ModelBased", "Strategy", "make_strategy"]

TrialFn = Callable[[Point], TrialRecord]


class Strategy(ABC):
    """Decides which points of a space to try."""

    name: str = "strategy"

    @abstractmethod
    def search(self, space: Space, trial: TrialFn) -> None:
        """Call ``trial`` on the points to try; the tuner keeps the results."""


class Exhaustive(Strategy):
    """Every point of the space, in enumeration order."""

    name = "exhaustive"

    def search(self, space: Space, trial: TrialFn) -> None:
        """Try every point."""
        for point in space.enumerate():
            trial(point)


class BinarySearch(Strategy):
    """Slapo's binary search over batch size and checkpoint ratio (module docstring).

    Args:
        batch_size: the name of the batch-size symbol.
        ratio: the name of the checkpoint-ratio symbol.
        neighbours: how many smaller batch sizes to try after the throughput stopped
            improving.
    """

    name = "binary"

    def __init__(self, batch_size: str = "batch_size", ratio: str = "ckpt_ratio",
                 neighbours: int = 1) -> None:
        self.batch_size = batch_size
        self.ratio = ratio
        self.neighbours = neighbours

    def search(self, space: Space, trial: TrialFn) -> None:
        """Run the search on every combination of the other symbols."""
        missing = [s for s in (self.batch_size, self.ratio) if s not in space.symbols]
        if missing:
            raise TuneError(
                f"the binary search needs symbols {self.batch_size!r} and {self.ratio!r}; "
                f"the space lacks {missing}",
                primitive="BinarySearch",
                values={"symbols": list(space.symbols), "missing": missing},
                fix="name the symbols: BinarySearch(batch_size='bs', ratio='ckpt') or use "
                "the 'exhaustive' or 'optuna' strategy",
            )
        groups: dict[str, dict[Any, dict[Any, Point]]] = {}
        for point in space.enumerate():
            rest = {k: v for k, v in point.items() if k not in (self.batch_size, self.ratio)}
            grid = groups.setdefault(point_key(rest), {})
            grid.setdefault(point[self.batch_size], {})[point[self.ratio]] = point
        for grid in groups.values():
            self._search_grid(grid, trial)

    def _search_grid(self, grid: dict[Any, dict[Any, Point]], trial: TrialFn) -> None:
        def ok(point: Point) -> bool:
            return trial(point).status == "ok"

        sizes = sorted(grid)
        ratios = {b: sorted(grid[b]) for b in sizes}
        # 1. the largest batch size that runs with its most checkpointing
        lo, hi, top = 0, len(sizes) - 1, -1
        while lo <= hi:
            mid = (lo + hi) // 2
            b = sizes[mid]
            if ok(grid[b][ratios[b][-1]]):
                top, lo = mid, mid + 1
            else:
                hi = mid - 1
        if top < 0:
            return
        # 2. its least checkpointing that runs; 3. smaller batch sizes while they improve
        bound = ratios[sizes[top]][-1]
        best, misses = float("-inf"), 0
        for index in range(top, -1, -1):
            b = sizes[index]
            # memory falls with the batch size: a smaller batch needs no more checkpointing
            allowed = [r for r in ratios[b] if r <= bound]
            if not allowed:
                allowed = ratios[b]
            record = self._least_ratio(grid[b], allowed, trial)
            if record is None:
                continue
            bound = record.point[self.ratio]
            if record.throughput > best:
                best, misses = record.throughput, 0
            else:
                misses += 1
                if misses > self.neighbours:
                    break

    @staticmethod
    def _least_ratio(row: dict[Any, Point], ratios: list[Any],
                     trial: TrialFn) -> TrialRecord | None:
        """The trial of the least feasible ratio, searching on the premise that the last
        ratio is feasible (it is tried only when every smaller one fails)."""
        lo, hi, least = 0, len(ratios) - 2, None
        while lo <= hi:
            mid = (lo + hi) // 2
            record = trial(row[ratios[mid]])
            if record.status == "ok":
                least, hi = record, mid - 1
            else:
                lo = mid + 1
        if least is None:
            last = trial(row[ratios[-1]])
            return last if last.status == "ok" else None
        return least


class ModelBased(Strategy):
    """optuna's TPE sampler over the points of the space, seeded.

    Each symbol is a categorical parameter over all the values it takes anywhere in the
    space; a proposal that is not a point of the space (a dependent value that does not
    apply, a violated constraint) is told a throughput of 0 and costs no evaluation, as
    does a proposal tried before (its stored result is told again). Infeasible trials
    score 0.

    Args:
        n_trials: stop after this many distinct points ran (pruned ones do not count).
        seed: the sampler's seed.
        n_startup_trials: random proposals before TPE models the results.
        max_proposals: stop after this many proposals in all (default ``20 * n_trials``).
    """

    name = "optuna"

    def __init__(self, n_trials: int = 10, seed: int = 0, n_startup_trials: int = 4,
                 max_proposals: int | None = None) -> None:
        self.n_trials = n_trials
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self.max_proposals = max_proposals if max_proposals is not None else 20 * n_trials

    def search(self, space: Space, trial: TrialFn) -> None:
        """Propose, try and tell until ``n_trials`` distinct points ran."""
        import optuna

        logging.getLogger("optuna").setLevel(logging.WARNING)
        points = {point_key(p): p for p in space.enumerate()}
        choices: dict[str, list[Any]] = {name: [] for name in space.symbols}
        known: dict[str, set[str]] = {name: set() for name in space.symbols}
        for point in points.values():
            for name, value in point.items():
                if json.dumps(value) not in known[name]:  # exact: 1, 1.0 and True differ
                    known[name].add(json.dumps(value))
                    choices[name].append(value)
        sampler = optuna.samplers.TPESampler(seed=self.seed,
                                             n_startup_trials=self.n_startup_trials)
        study = optuna.create_study(direction="maximize", sampler=sampler)
        tried: set[str] = set()  # points that ran
        seen: set[str] = set()  # points that ran or were pruned
        for _ in range(self.max_proposals):
            if len(tried) >= self.n_trials or len(seen) == len(points):
                break
            ask = study.ask()
            proposal = {name: ask.suggest_categorical(name, values)
                        for name, values in choices.items()}
            key = point_key(proposal)
            if key not in points:
                study.tell(ask, 0.0)
                continue
            record = trial(points[key])
            seen.add(key)
            if record.finished:  # a pruned point costs nothing: it does not count
                tried.add(key)
            study.tell(ask, record.throughput if record.status == "ok" else 0.0)


STRATEGIES: dict[str, type[Strategy]] = {
    "exhaustive": Exhaustive,
    "binary": BinarySearch,
    "optuna": ModelBased,
}


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """The strategy called ``name`` (``"exhaustive"``, ``"binary"``, ``"optuna"``).

    >>> make_strategy("binary").name
    'binary'
    """
    if name not in STRATEGIES:
        raise TuneError(
            f"unknown strategy {name!r}",
            primitive="make_strategy",
            values={"name": name, "known": sorted(STRATEGIES)},
            fix=f"use one of: {', '.join(sorted(STRATEGIES))}",
        )
    return STRATEGIES[name](**kwargs)
