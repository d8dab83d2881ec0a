"""Auto-tuning: search the knobs a schedule exposes for the fastest candidate that fits.

The pieces, each usable alone:

* :class:`Space` / :class:`Symbol`: named knobs whose candidates may depend on knobs fixed
  before them, and constraints as plain functions (:mod:`~torchloom.tune.space`);
* strategies: :class:`Exhaustive`, :class:`BinarySearch` (Slapo's search over batch size
  and checkpoint ratio) and :class:`ModelBased` (optuna TPE) (:mod:`~torchloom.tune.strategies`);
* :class:`CostModel`: the peak training memory of a candidate, predicted by running a
  step on fake tensors while :class:`LiveBytes` follows every storage, used to prune
  candidates over a budget before any runs (:mod:`~torchloom.runtime.memory`);
* :class:`TrainEvaluator`: the default measurement, a few real training steps
  (:mod:`~torchloom.tune.evaluate`); :class:`~torchloom.tune.worker.TorchrunEvaluator`
  runs each candidate as a ``torchrun`` job instead (:mod:`~torchloom.tune.worker`);
* :class:`Database`: SQLite results that survive an interruption, keyed by the study's
  fingerprint of the model and space (:mod:`~torchloom.tune.database`,
  :mod:`~torchloom.tune.fingerprint`); a file it did not write raises
  :class:`TuneDatabaseError`;
* :class:`Tuner` / :func:`tune`: ties them together; a candidate is the recipe a schedule
  function records at a point (:mod:`~torchloom.tune.tuner`);
* :func:`plot_space` and :func:`torchloom.apps.tune_cli.tune_command` for output;
* :func:`tune_layouts`: tensor, sequence, pipeline and data parallelism, checkpoint ratio
  and micro-batch on N devices, pruned and ordered by :mod:`torchloom.plan`, the best few
  measured (:mod:`~torchloom.tune.layouts`).

>>> from torchloom.tune import Space
>>> space = Space()
>>> bs = space.create_symbol("batch_size", [8, 16, 32])
>>> ckpt = space.create_symbol("ckpt_ratio", lambda p: [0.5, 1.0] if p["batch_size"] > 8 else [0.0])
>>> space.count(), next(space.enumerate())
(5, {'batch_size': 8, 'ckpt_ratio': 0.0})
"""

from __future__ import annotations

from ..core.errors import TuneDatabaseError, TuneError
from ..runtime.memory import CostModel, LiveBytes, MemoryEstimate, count_saved, state_bytes
from .database import Database, TrialRecord
from .evaluate import Evaluator, Result, TrainEvaluator
from .fingerprint import study_fingerprint
from .layouts import LayoutTrial, LayoutTuneResult, measure_on_local_ranks, tune_layouts
from .plot import plot_space
from .space import Space, Symbol, point_key
from .strategies import BinarySearch, Exhaustive, ModelBased, Strategy, make_strategy
from .tuner import Tuner, TuneResult, tune

__all__ = [
    "BinarySearch",
    "CostModel",
    "Database",
    "Evaluator",
    "Exhaustive",
    "LayoutTrial",
    "LayoutTuneResult",
    "LiveBytes",
    "MemoryEstimate",
    "ModelBased",
    "Result",
    "Space",
    "Strategy",
    "Symbol",
    "TrainEvaluator",
    "TrialRecord",
    "TuneDatabaseError",
    "TuneError",
    "TuneResult",
    "Tuner",
    "count_saved",
    "make_strategy",
    "measure_on_local_ranks",
    "plot_space",
    "point_key",
    "state_bytes",
    "study_fingerprint",
    "tune",
    "tune_layouts",
]
