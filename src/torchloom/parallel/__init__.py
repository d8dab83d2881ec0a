"""Layouts and where they become models: :class:`Layout`, :func:`init_mesh`,
:func:`parallelize`.

This package sits above :mod:`torchloom.runtime` and :mod:`torchloom.schedules` (it applies
schedules and builds) and below :mod:`torchloom.plan`, :mod:`torchloom.tune`,
:mod:`torchloom.tools` and :mod:`torchloom.apps` (which describe runs as layouts).

>>> from torchloom.parallel import Layout
>>> Layout(dp_shard=4, tp=2).world
8
"""

# what torchloom.parallel offered before it was a package of its own
from ..runtime.parallel import DP_TARGETS, MESH_DIMS, fully_shard_model, wrap_data_parallel
from .layout import (
    AC_MODES,
    DP_MODES,
    DTYPES,
    NOTATION,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    Layout,
    data_parallel,
)
from .mesh import PIECES, checkpoint_group, group_of, init_mesh
from .parallelize import Parallelized, create_schedule, parallelize

__all__ = ["AC_MODES", "DP_MODES", "DP_TARGETS", "MESH_DIMS", "fully_shard_model",
           "wrap_data_parallel", "DTYPES", "Layout", "NOTATION", "OPTIMIZERS", "PIECES",
           "PIPELINE_SCHEDULES", "Parallelized", "checkpoint_group", "create_schedule", "data_parallel",
           "group_of", "init_mesh", "parallelize"]
