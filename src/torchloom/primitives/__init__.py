"""The primitives, one module each, and their registry.

Each module defines ``NAME`` and ``apply(sch, ...)``; :class:`torchloom.Schedule` exposes
each as a typed, documented method. :func:`list_primitives` lists them.

>>> list_primitives()  # doctest: +NORMALIZE_WHITESPACE
['annotate', 'checkpoint', 'compile', 'cut_pipeline_stage', 'decompose', 'fork_rng', 'fuse',
 'replace', 'replace_all', 'shard', 'sync', 'trace', 'trace_until']
"""

from __future__ import annotations

from typing import Any, Callable

from . import (
    annotate,
    checkpoint,
    compile,
    cut_pipeline_stage,
    decompose,
    fork_rng,
    fuse,
    replace,
    replace_all,
    shard,
    sync,
    trace,
    trace_until,
)

__all__ = ["PRIMITIVES", "list_primitives"]

PRIMITIVES: dict[str, Callable[..., Any]] = {
    m.NAME: m.apply
    for m in (annotate, checkpoint, compile, cut_pipeline_stage, decompose, fork_rng, fuse, replace,
              replace_all, shard, sync, trace, trace_until)
}


def list_primitives(name_only: bool = True) -> list[str] | dict[str, Callable[..., Any]]:
    """The registered primitive names (sorted), or with ``name_only=False`` a dict from
    name to the function that implements it."""
    if name_only:
        return sorted(PRIMITIVES)
    return dict(sorted(PRIMITIVES.items()))
