"""The table of registered primitives, by name: the one thing that the schedule tree, the
recipe and the registry all read.

:mod:`torchloom.core.registry` fills it (each primitive module registers itself there);
the layers below the registry (a recipe checks that a line names a registered
primitive, a schedule suggests the nearest name for a typo) only read it, so they need
not import the registry, which imports them.

>>> import torchloom  # registers the primitives
>>> "shard" in PRIMITIVES, "find" in list_primitives()   # find reads, it is not recorded
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .registry import Primitive

__all__ = ["PRIMITIVES", "list_primitives"]

#: Every registered primitive by name, in registration order.
PRIMITIVES: dict[str, Primitive] = {}


def list_primitives(name_only: bool = True) -> list[str] | dict[str, Callable[..., Any]]:
    """The primitives a recipe may hold (sorted), or with ``name_only=False`` a dict from
    name to the function that implements it."""
    found = {n: p.apply for n, p in sorted(PRIMITIVES.items()) if p.recorded}
    return list(found) if name_only else found
