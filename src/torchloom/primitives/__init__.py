"""The primitives, one module each. Importing this package registers every primitive
(:mod:`torchloom.core.registry`), which installs it as a method of ``Schedule`` and
``ScheduleGroup``; :func:`list_primitives` lists the ones a recipe may hold.

>>> list_primitives()  # doctest: +NORMALIZE_WHITESPACE
['annotate', 'checkpoint', 'compile', 'cut_pipeline_stage', 'decompose', 'divide_attrs',
 'fork_rng', 'fuse', 'lora', 'replace', 'replace_all', 'shard', 'sync', 'trace', 'trace_until']
"""

from __future__ import annotations

from ..core.registry import PRIMITIVES, list_primitives
from . import (  # noqa: F401 - imported to register them
    annotate,
    checkpoint,
    compile,
    context_parallel,
    cut_pipeline_stage,
    decompose,
    divide_attrs,
    expert_parallel,
    find,
    fork_rng,
    fuse,
    lora,
    replace,
    replace_all,
    shard,
    sync,
    trace,
    trace_until,
)

__all__ = ["PRIMITIVES", "list_primitives"]
