"""Planning at scale: per-rank memory and step time of a model, a schedule and a layout
on N devices, computed in one process on fake tensors; and a search over the layouts.

* :class:`Layout`: :class:`torchloom.Layout` (the one layout class,
  :mod:`torchloom.parallel.layout`): tensor, sequence, pipeline (every schedule, virtual
  stages) and data parallelism (DDP, FSDP2, HSDP), checkpointing, micro-batches, dtypes,
  optimizer; :func:`check_model` (:mod:`~torchloom.plan.layout`) checks it against a model;
* :class:`Profile` (:mod:`~torchloom.plan.profiles`): H100-80GB, H200, A100-80GB and
  V100-32GB from their published figures, or :func:`measure_local`;
* :func:`predict` (:mod:`~torchloom.plan.predict`): for every pipeline stage, parameter,
  gradient, optimizer-state, buffer and peak activation bytes, FLOPs, the bytes of every
  collective, and compute, exposed communication, bubble and step time;
* :func:`search` (:mod:`~torchloom.plan.search`): every valid layout of N devices ranked
  by predicted throughput;
* ``torchloom plan MODEL --gpus N --gpu h100-80gb`` (:mod:`~torchloom.apps.plan_cli`).

How: :mod:`~torchloom.plan.units` runs one step of the model shortened to three layers,
scheduled at the real tensor-parallel degree, as rank 0 of a fake process group on fake
tensors, cut into pieces at the layer boundaries; :mod:`~torchloom.plan.predict` composes
any depth, stage split and micro-batch count from the pieces. Measured against real runs
on gloo ranks by :mod:`~torchloom.plan.validate`, which builds each layout with
:func:`torchloom.parallelize` as ``torchloom train`` does (``tests/test_plan_dist.py``,
``benchmarks/plan_validate.py``).

>>> import torchloom as tl
>>> import torchloom.plan as plan
>>> p = plan.predict("gpt2", plan.Layout(tp=2, micro_batch=2, seq_len=32), "a100-80gb")
>>> len(p.roles), p.roles[0].ranks, p.fits
(1, 2, True)
>>> plan.Layout is tl.Layout
True
"""

from __future__ import annotations

from ..core.errors import LayoutError, PlanError
from .layout import Layout, check_model
from .predict import (
    CollectiveTotal,
    Memory,
    Prediction,
    RolePrediction,
    Time,
    clear_cache,
    predict,
)
from .profiles import PROFILES, Profile, get_profile, measure_local
from .search import SearchResult, enumerate_layouts, search
from .spec import ModelSpec, model_spec

__all__ = [
    "CollectiveTotal", "Layout", "LayoutError", "Memory", "ModelSpec", "PROFILES", "PlanError",
    "Prediction", "Profile", "RolePrediction", "SearchResult", "Time", "check_model",
    "clear_cache", "enumerate_layouts", "get_profile", "measure_local", "model_spec",
    "predict", "search",
]
