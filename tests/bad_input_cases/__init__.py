"""More rows of the bad-input catalogue, one module per area (``recipes``, ``checkpoints``,
``launch``, ``misuse``, ...).

Each module defines ``CASES``: a list of ``(case, error class, pattern)`` rows of the same
shape as ``tests/test_bad_input.py``'s own table; that file collects them all with
:func:`collect` and runs every row the same way (the message must match the pattern and
carry a ``fix:`` line).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

Row = tuple[Callable, type, str]


def collect() -> list[Row]:
    """The ``CASES`` of every module of this package, by module name."""
    rows: list[Row] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        rows += list(getattr(module, "CASES", []))
    return rows
