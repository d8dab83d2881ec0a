"""Test isolation: global state a test may leave behind is reset after each test.

The tensor-parallel RNG tracker is process-global (like torch's own generators); a test
that seeds it would change later tests' numbers (activation checkpointing snapshots its
states, which the memory accounting of the tuner then counts).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchloom.runtime.rng import get_rng_tracker


@pytest.fixture(autouse=True)
def _reset_global_state() -> Iterator[None]:
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    yield
    get_rng_tracker().reset()
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
