"""Helpers shared by the ``torchloom`` commands: plurals, counts and the default number
of torch threads.

>>> plural(1, "layer"), plural(3, "rank")
('1 layer', '3 ranks')
>>> count_text(37824), count_text(12)
('37,824 (37.8 K)', '12')
"""

from __future__ import annotations

import os

__all__ = ["available_cores", "count_text", "default_threads", "plural"]


def plural(count: int, word: str) -> str:
    """``1 layer``, ``2 layers``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def default_threads() -> tuple[int, str]:
    """One thread per idle core: torch's OpenMP threads spin while they wait for each other,
    so a thread that has to share its core with another busy process slows every step down
    many times over (measured: 5x-10x on a 2-core machine running other jobs)."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return cores, f"{cores} cores"
    threads = max(1, min(cores, cores - round(load)))
    if threads == cores:
        return cores, f"{cores} cores"
    return threads, f"{cores} cores, load {load:.1f}; --threads {cores} to use all"


def count_text(n: int) -> str:
    """``37,824 (37.8 K)``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n:,} ({n / scale:.3g} {unit})"
    return f"{n:,}"
