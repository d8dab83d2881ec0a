"""The primitives, one module each, and their registry.

Each module defines ``NAME`` and ``apply(sch, ...)``; :class:`torchloom.Schedule` exposes
each as a typed, documented method. :func:`list_primitives` lists them.

>>> list_primitives()
['annotate', 'checkpoint', 'fork_rng', 'replace', 'replace_all', 'shard', 'sync']
"""

from __future__ import annotations

from typing import Any, Callable

from . import annotate, checkpoint, fork_rng, replace, replace_all, shard, sync

__all__ = ["PRIMITIVES", "list_primitives"]

PRIMITIVES: dict[str, Callable[..., Any]] = {
    m.NAME: m.apply for m in (annotate, checkpoint, fork_rng, replace, replace_all, shard, sync)
}


def list_primitives(name_only: bool = True) -> list[str] | dict[str, Callable[..., Any]]:
    """The registered primitive names (sorted), or with ``name_only=False`` a dict from
    name to the function that implements it."""
    if name_only:
        return sorted(PRIMITIVES)
    return dict(sorted(PRIMITIVES.items()))
