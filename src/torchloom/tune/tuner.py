"""The tuner: candidates, the memory cost model, evaluation and the results database.

A candidate is the recipe that a user *schedule function* ``fn(sch, point) -> None``
records on a fresh model at a point of the space. The tuner

1. builds it under fake-tensor mode (nothing allocated) and requires it to be data
   (``recipe.to_json()`` works), so that it can be stored, printed and replayed;
2. asks the memory cost model for its peak (if a cost model is given) and, when that is
   over the budget, records the point as ``pruned`` without ever evaluating it; by default
   every point of the space is predicted before any is run (``prefilter=True``);
3. otherwise calls ``evaluate(recipe, point)`` in this process, and records the outcome;
   an exception other than ``KeyboardInterrupt`` / ``SystemExit`` is a failed trial;
4. commits every record to the database at once; on a restart with the same database and
   study, finished trials are loaded and their points are never evaluated again.

What it resumes, it checks: a study is keyed by the fingerprint of the model and the space
(:mod:`~torchloom.tune.fingerprint`), so rows of another model or space are never read;
and a stored row is used only if its recipe is, text for text, the recipe the schedule
function records at its point now. A row that differs (the schedule function changed, or
the row was edited by hand) is not resumed and not shown: its point runs again and the
row is replaced (``TuneResult.discarded`` counts them). A row whose recipe is the
candidate's but whose figures do not match the digest the tuner stored with it (edited by
hand, e.g. a raised throughput) is refused: :class:`~torchloom.core.errors.TuneDatabaseError`
names it. Nothing read from the file is run: the recipes evaluated are the ones the
schedule function records in this process.

The digest has no secret key, so whoever can edit the file can recompute it. The
guarantee is the re-measurement: when the best record comes from the file rather than
from this run, ``evaluate`` runs it once more before it is reported; a figure that
differs by more than ``remeasure_tolerance`` is reported as measured now (with a warning
and in :attr:`TuneResult.notes`), its row is replaced, and the best is chosen again.

>>> import torch, torchloom as tl
>>> from torch import nn
>>> space = Space()
>>> _ = space.create_symbol("batch_size", [1, 2, 4])
>>> _ = space.create_symbol("ckpt_ratio", [0.0, 1.0])
>>> def schedule(sch, point):
...     sch.checkpoint(ratio=point["ckpt_ratio"])
>>> def evaluate(recipe, point):    # a stand-in measurement
...     return Result(throughput=point["batch_size"] * (2 - point["ckpt_ratio"]))
>>> tuner = Tuner(space, lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), schedule, evaluate)
>>> result = tuner.run("exhaustive")
>>> result.best.point, result.evaluations
({'batch_size': 4, 'ckpt_ratio': 0.0}, 6)
>>> print(result.best_recipe)
import torchloom
<BLANKLINE>
sch = torchloom.create_schedule(model)
sch[''].checkpoint(ratio=0.0)
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..core.errors import RecipeError, TuneError
from ..core.recipe import Recipe
from ..core.schedule import Schedule, create_schedule
from ..runtime.memory import CostModel, MemoryEstimate, fake_mode
from .database import Database, TrialRecord
from .evaluate import Evaluator, Result, describe_exception
from .fingerprint import study_fingerprint
from .space import Point, Space, point_key
from .strategies import Strategy, make_strategy

__all__ = ["TuneResult", "Tuner", "tune"]

ScheduleFn = Callable[[Schedule, Point], None]
Predictor = Callable[[Recipe, Point], "MemoryEstimate | int"]


@dataclass
class TuneResult:
    """What a tuning run found.

    Attributes:
        best: the record with the highest throughput among ``ok`` trials, or None.
        records: every record the run used, in the order first written (resumed ones too).
        evaluations: how many times ``evaluate`` was called in this run.
        resumed: how many finished trials were read from the database instead of run.
        seconds: wall time of the run.
        discarded: stored rows of this study whose recipe was not the schedule function's
            (run again and replaced, not resumed).
        trusted_refs: the functions and classes the candidates of this run hold, by
            reference text (what :attr:`best_recipe` may resolve besides torch, torchloom
            and transformers module classes).
        remeasured: how many best records read from the database were evaluated again
            before being reported (not counted in ``evaluations``).
        notes: what the re-measurements found when a stored figure did not hold.
    """

    best: TrialRecord | None
    records: list[TrialRecord] = field(default_factory=list)
    evaluations: int = 0
    resumed: int = 0
    seconds: float = 0.0
    discarded: int = 0
    trusted_refs: dict[str, Any] = field(default_factory=dict)
    remeasured: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def best_recipe(self) -> Recipe | None:
        """The best candidate's recipe, parsed as untrusted data
        (:meth:`~torchloom.Recipe.from_json` with :attr:`trusted_refs`)."""
        if self.best is None or self.best.recipe is None:
            return None
        return Recipe.from_json(self.best.recipe, trusted_refs=self.trusted_refs)

    @property
    def pruned(self) -> list[TrialRecord]:
        """Records of the points the cost model ruled out."""
        return [r for r in self.records if r.status == "pruned"]


class Tuner:
    """Search a space of schedules for the fastest one that fits.

    Args:
        space: the knobs.
        make_model: builds a fresh, unscheduled model (called under fake mode to record
            candidates, and by the evaluator for real).
        schedule_fn: ``fn(sch, point)`` applies the primitives of a point.
        evaluate: ``evaluate(recipe, point) -> Result``, e.g. a
            :class:`~torchloom.tune.TrainEvaluator`.
        cost_model: a :class:`~torchloom.tune.CostModel`, or any
            ``(recipe, point) -> MemoryEstimate | bytes``; None: no pruning.
        budget_bytes: the memory per rank a candidate may use; None: no pruning.
        db: a :class:`Database`, a file path, or None (an in-memory database). A
            :class:`Database` made without a fingerprint is bound to this tuner's.
        study: the study name in the database (runs of different models may share a file;
            rows are also keyed by :attr:`fingerprint`).
        prefilter: predict every point before running any, so all pruned points are known
            (and recorded) up front.
        on_trial: called as ``on_trial(record, resumed)`` after each trial is known.
        remeasure_best: evaluate the best record once more before reporting it when it
            was read from the database (not measured in this run).
        remeasure_tolerance: the relative difference between the stored and the new
            throughput above which the stored figure is not believed.

    Attributes:
        fingerprint: the study's fingerprint (the model built by ``make_model`` and the
            space; :func:`~torchloom.tune.fingerprint.study_fingerprint`).

    Raises:
        TuneError: ``db`` is a :class:`Database` bound to another fingerprint.
        TuneDatabaseError: ``db`` is a file that is not a torchloom tuner database (and,
            from :meth:`run` / :meth:`trial`, a stored row of this schedule whose figures do
            not match its digest).
    """

    def __init__(
        self,
        space: Space,
        make_model: Callable[[], nn.Module],
        schedule_fn: ScheduleFn,
        evaluate: Evaluator,
        *,
        cost_model: CostModel | Predictor | None = None,
        budget_bytes: int | None = None,
        db: Database | str | Path | None = None,
        study: str = "default",
        prefilter: bool = True,
        on_trial: Callable[[TrialRecord, bool], None] | None = None,
        remeasure_best: bool = True,
        remeasure_tolerance: float = 0.2,
    ) -> None:
        self.space = space
        self.make_model = make_model
        self.schedule_fn = schedule_fn
        self.evaluate = evaluate
        self.cost_model = cost_model
        self.budget_bytes = budget_bytes
        self.fingerprint = study_fingerprint(make_model, space)
        if isinstance(db, Database):
            if db.fingerprint is None:
                db.fingerprint = self.fingerprint
            elif db.fingerprint != self.fingerprint:
                raise TuneError(
                    "the database is bound to another study fingerprint than this tuner's "
                    "model and space", primitive="Tuner",
                    values={"database": db.fingerprint[:16], "tuner": self.fingerprint[:16]},
                    fix="pass Database(path, study) without a fingerprint, or the path itself")
            self.db = db
        else:
            self.db = Database(db or ":memory:", study, fingerprint=self.fingerprint)
        self.prefilter = prefilter
        self.on_trial = on_trial
        if not 0 <= remeasure_tolerance:
            raise TuneError(
                f"remeasure_tolerance must be a non-negative fraction, not "
                f"{remeasure_tolerance!r}", primitive="Tuner",
                values={"remeasure_tolerance": remeasure_tolerance},
                fix="Tuner(..., remeasure_tolerance=0.2)")
        self.remeasure_best = remeasure_best
        self.remeasure_tolerance = float(remeasure_tolerance)
        self.remeasured = 0
        self.notes: list[str] = []
        self._measured: set[str] = set()  # keys evaluated in this process
        self._records: dict[str, TrialRecord] = {r.key: r for r in self.db.load()}
        self._stored = set(self._records)  # keys read from the database, not yet checked
        self._candidates: dict[str, Recipe] = {}
        self._trusted_refs: dict[str, Any] = {}
        self._predicted: dict[str, int | None] = {}
        self._used: dict[str, TrialRecord] = {}
        self._points: set[str] | None = None
        self.evaluations = 0
        self.resumed = 0
        self.discarded = 0
        self._resumable: set[str] = set()  # stored rows whose recipe was checked

    def close(self) -> None:
        """Close the database (every trial in it is committed already)."""
        self.db.close()

    # ----------------------------------------------------------------- candidates

    def candidate(self, point: Mapping[str, Any]) -> Recipe:
        """The recipe of ``point``: ``schedule_fn`` applied to a fresh fake model.

        Raises:
            TuneError: the recipe holds a value that is not data (it could not be stored
                or replayed by a worker).
        """
        with fake_mode():
            sch = create_schedule(self.make_model())
            self.schedule_fn(sch, dict(point))
        try:
            text = sch.recipe.to_json()
            trusted = sch.recipe.references()  # what this process's schedule function used
            self._trusted_refs.update(trusted)
            return Recipe.from_json(text, trusted_refs=trusted)
        except RecipeError as exc:
            raise TuneError(
                "a candidate recipe must be data, to be stored and replayed: "
                + exc.problem,
                primitive="Tuner.candidate",
                values={"point": dict(point), **exc.values},
                fix=exc.fix,
            ) from exc

    def _candidate(self, point: Mapping[str, Any]) -> Recipe:
        """:meth:`candidate`, computed once per point."""
        key = point_key(point)
        if key not in self._candidates:
            self._candidates[key] = self.candidate(point)
        return self._candidates[key]

    def _known(self, point: Mapping[str, Any]) -> TrialRecord | None:
        """The record of ``point``: one written in this run, or a stored row whose recipe
        is the candidate's (checked once); a stored row that differs is dropped."""
        key = point_key(point)
        record = self._records.get(key)
        if record is None or key not in self._stored:
            return record
        if record.recipe == self._candidate(point).to_json(indent=None):
            if not record.intact:  # this schedule's row, its figures edited
                raise self.db.edited_row_error(record)
            self._stored.discard(key)
            self._resumable.add(key)
            return record
        del self._records[key]  # not this schedule's row: run the point again
        self._stored.discard(key)
        self.discarded += 1
        return None

    def predict(self, recipe: Recipe, point: Mapping[str, Any]) -> int | None:
        """The cost model's predicted peak in bytes, or None without a cost model."""
        if self.cost_model is None:
            return None
        predictor = self.cost_model.predict if isinstance(self.cost_model, CostModel) \
            else self.cost_model
        estimate = predictor(recipe, dict(point))
        return estimate.total if isinstance(estimate, MemoryEstimate) else int(estimate)

    # ----------------------------------------------------------------- trials

    def _check_point(self, point: Mapping[str, Any]) -> None:
        if self._points is None:
            self._points = {point_key(p) for p in self.space.enumerate()}
        if point_key(point) not in self._points:
            raise TuneError(
                "a strategy asked for a point that is not in the space",
                primitive="Tuner.trial",
                values={"point": dict(point)},
                fix="propose only points from space.enumerate()",
            )

    def _over_budget(self, predicted: int | None) -> bool:
        return (predicted is not None and self.budget_bytes is not None
                and predicted > self.budget_bytes)

    def _publish(self, record: TrialRecord, resumed: bool) -> TrialRecord:
        if record.key not in self._used:
            self._used[record.key] = record
            if resumed:
                self.resumed += 1
            if self.on_trial is not None:
                self.on_trial(record, resumed)
        return record

    def _prune_record(self, point: Point, predicted: int, recipe: Recipe) -> TrialRecord:
        record = TrialRecord(
            point=point, status="pruned", predicted_memory_bytes=predicted,
            error=f"predicted {predicted} B > budget {self.budget_bytes} B",
            recipe=recipe.to_json(indent=None))
        self.db.save(record)
        self._records[record.key] = record
        return record

    def _prediction(self, point: Point, recipe: Recipe | None) -> int | None:
        """The predicted peak of ``point``, computed once per point (and kept in the DB)."""
        key = point_key(point)
        if key not in self._predicted:
            known = self._known(point)
            if known is not None and known.predicted_memory_bytes is not None:
                self._predicted[key] = known.predicted_memory_bytes
            else:
                self._predicted[key] = self.predict(recipe or self._candidate(point), point)
        return self._predicted[key]

    def trial(self, point: Mapping[str, Any]) -> TrialRecord:
        """Evaluate ``point`` once: a stored finished result is returned as is, a point the
        cost model puts over the budget is recorded as pruned and not evaluated."""
        point = dict(point)
        self._check_point(point)
        key = point_key(point)
        known = self._known(point)
        if known is not None and known.finished:
            return self._publish(known, resumed=key in self._resumable)
        stored = key in self._predicted or (known is not None
                                            and known.predicted_memory_bytes is not None)
        recipe = None if stored or self.cost_model is None else self._candidate(point)
        predicted = self._prediction(point, recipe)
        if self._over_budget(predicted):
            assert predicted is not None
            if known is None or known.status != "pruned":
                known = self._prune_record(point, predicted, recipe or self._candidate(point))
            return self._publish(known, resumed=key in self._resumable)
        record = self._measure(point, recipe or self._candidate(point), predicted)
        self.evaluations += 1
        return self._publish(record, resumed=False)

    def _measure(self, point: Point, recipe: Recipe, predicted: int | None) -> TrialRecord:
        """Evaluate ``point`` and record the outcome (in the database, at once)."""
        start = time.perf_counter()
        try:
            result = self.evaluate(recipe, point)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the candidate failed; the search goes on
            result = Result(0.0, None, ok=False, error=describe_exception(exc))
        record = TrialRecord(
            point=point, status="ok" if result.ok else "failed",
            throughput=float(result.throughput) if result.ok else 0.0,
            peak_memory_bytes=result.peak_memory_bytes, predicted_memory_bytes=predicted,
            error=result.error, recipe=recipe.to_json(indent=None),
            seconds=time.perf_counter() - start)
        self.db.save(record)
        self._records[record.key] = record
        self._measured.add(record.key)
        return record

    def _best(self) -> TrialRecord | None:
        """The ``ok`` record of the highest throughput; one read from the database is
        measured again first (and, if its figure does not hold, the next is taken)."""
        while True:
            ok = [r for r in self._used.values() if r.status == "ok"]
            best = max(ok, key=lambda r: r.throughput) if ok else None
            if best is None or not self.remeasure_best or best.key in self._measured:
                return best
            fresh = self._measure(best.point, self._candidate(best.point),
                                  best.predicted_memory_bytes)
            self.remeasured += 1
            self._used[best.key] = fresh
            scale = max(best.throughput, fresh.throughput)
            if fresh.status == "ok" and abs(fresh.throughput - best.throughput) \
                    <= self.remeasure_tolerance * scale:
                continue  # confirmed: reported with this run's figure
            now = (f"{fresh.throughput:.6g}" if fresh.status == "ok"
                   else f"a failure ({fresh.error})")
            note = (f"the stored best {best.point} (throughput {best.throughput:.6g} in "
                    f"{self.db.path}) measured {now} when run again; the row now holds "
                    "the new measurement and the best was chosen again")
            self.notes.append(note)
            warnings.warn(f"torchloom.tune: {note}", stacklevel=3)

    def prune_all(self) -> list[TrialRecord]:
        """Predict every point of the space that has no finished trial, and record those
        over the budget as pruned. Returns the pruned records."""
        if self.cost_model is None or self.budget_bytes is None:
            return []
        return [record for point in self.space.enumerate()
                if not self._finished(point)
                and self._over_budget(self._prediction(point, None))
                for record in [self.trial(point)]]

    def _finished(self, point: Point) -> bool:
        known = self._known(point)
        return known is not None and known.finished

    # ----------------------------------------------------------------- run

    def run(self, strategy: Strategy | str = "binary", **strategy_kwargs: Any) -> TuneResult:
        """Search with ``strategy`` (a :class:`Strategy` or its name) and return the result."""
        if isinstance(strategy, str):
            strategy = make_strategy(strategy, **strategy_kwargs)
        start = time.perf_counter()
        if self.prefilter:
            self.prune_all()
        strategy.search(self.space, self.trial)
        best = self._best()
        records = sorted(self._used.values(), key=lambda r: r.seq)
        return TuneResult(best=best, records=records, evaluations=self.evaluations,
                          resumed=self.resumed, seconds=time.perf_counter() - start,
                          discarded=self.discarded, trusted_refs=dict(self._trusted_refs),
                          remeasured=self.remeasured, notes=list(self.notes))


def tune(
    space: Space,
    make_model: Callable[[], nn.Module],
    schedule_fn: ScheduleFn,
    evaluate: Evaluator,
    strategy: Strategy | str = "binary",
    **kwargs: Any,
) -> TuneResult:
    """One call: ``Tuner(space, make_model, schedule_fn, evaluate, **kwargs).run(strategy)``."""
    return Tuner(space, make_model, schedule_fn, evaluate, **kwargs).run(strategy)
