"""Seeding, and a tracker of named random-number-generator states per device type.

Tensor parallelism splits one layer over several ranks. A dropout *inside* a sharded
region sees a different slice of the activations on each rank, so its mask must differ
per tensor-parallel rank (otherwise the ranks drop correlated units). A dropout *outside*
a sharded region sees the same replicated activations on every rank of the group, so its
mask must be the same everywhere (otherwise the replicas drift apart).

:func:`set_random_seed` arranges both:

* the default generators (python ``random``, numpy, torch on every device) get
  ``seed + 100 * pp_rank + 10 * dp_rank``: equal on the ranks of one tensor-parallel group
  (they share the pipeline stage and the data-parallel replica), distinct across pipeline
  stages (which hold different layers) and across data-parallel replicas (which see
  different data). The factors 100 and 10 keep the offsets apart for up to 10 replicas
  per stage; they are conventions, not magic;
* the tracker gets a state named ``"model-parallel"`` seeded with
  ``<that seed> + 2718 + tp_rank``: distinct per tensor-parallel rank. The offset 2718 only
  has to keep this stream away from the default seeds of the neighbouring ranks
  (``seed + 100 * k + 10 * j`` for small ``k, j``), so the two streams never coincide.

The ``fork_rng`` primitive then runs a module inside ``get_rng_tracker().fork()``, which
swaps the device's global generator state for the tracked one while the module runs.

>>> import torch
>>> set_random_seed(1234, tp_rank=1)
1234
>>> tracker = get_rng_tracker()
>>> tracker.is_seeded(), tracker.seeds()
(True, {'model-parallel': 3953})
>>> default_before = torch.get_rng_state()
>>> with tracker.fork():                       # draws from the "model-parallel" stream
...     inside = torch.rand(2)
>>> torch.equal(torch.get_rng_state(), default_before)   # the default stream is untouched
True
>>> with tracker.fork():                       # the stream continues where it stopped
...     again = torch.rand(2)
>>> torch.equal(inside, again)
False
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

from ..core.errors import RngError

__all__ = [
    "MODEL_PARALLEL",
    "RngStatesTracker",
    "get_rng_tracker",
    "set_random_seed",
    "PIPELINE_OFFSET",
    "DATA_PARALLEL_OFFSET",
    "TENSOR_PARALLEL_OFFSET",
]

#: Name of the tensor-parallel state that ``fork_rng`` draws from.
MODEL_PARALLEL = "model-parallel"
#: ``set_random_seed`` adds ``PIPELINE_OFFSET * pp_rank`` to the default seed.
PIPELINE_OFFSET = 100
#: ``set_random_seed`` adds ``DATA_PARALLEL_OFFSET * dp_rank`` to the default seed.
DATA_PARALLEL_OFFSET = 10
#: The tensor-parallel seed is ``default seed + TENSOR_PARALLEL_OFFSET + tp_rank``.
TENSOR_PARALLEL_OFFSET = 2718


def _device_type(device: torch.device | str | None) -> tuple[str, int | None]:
    """``(type, index)`` of a device given as a ``torch.device``, a string or None (cpu)."""
    if device is None:
        return "cpu", None
    if isinstance(device, int) and not isinstance(device, bool):
        # A bare index means the current accelerator, as in torch.
        acc = torch.accelerator.current_accelerator()
        return (acc.type if acc is not None else "cpu"), device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RngError(
            f"{device!r} is not a device",
            primitive="rng_tracker.fork",
            values={"device": device},
            fix="pass a torch.device or a device string, e.g. device='cuda:0' or device='cpu'",
        ) from exc
    return dev.type, dev.index


def _get_state(dtype: str, index: int | None) -> torch.Tensor:
    if dtype == "cpu":
        return torch.get_rng_state()
    module = torch.get_device_module(dtype)
    return module.get_rng_state() if index is None else module.get_rng_state(index)


def _set_state(dtype: str, index: int | None, state: torch.Tensor) -> None:
    if dtype == "cpu":
        torch.set_rng_state(state)
        return
    module = torch.get_device_module(dtype)
    if index is None:
        module.set_rng_state(state)
    else:
        module.set_rng_state(state, index)


def _seeded_state(dtype: str, index: int | None, seed: int) -> torch.Tensor:
    """The state of a fresh generator of this device type seeded with ``seed``; the global
    generators are not touched."""
    device = torch.device(dtype) if index is None else torch.device(dtype, index)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


def _check_int(value: object, name: str, primitive: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise RngError(
            f"{name} must be a non-negative integer",
            primitive=primitive,
            values={name: value},
            fix=fix,
        )
    return int(value)


class RngStatesTracker:
    """Named generator states, kept per device type (``"cpu"``, ``"cuda"``, ...).

    A state is registered with :meth:`add` (a name and a seed). The state for a device type
    is created lazily, the first time :meth:`fork` runs on that device type, by seeding a
    temporary generator of that type with the registered seed; so a model on CPU and one
    on GPU draw from the same logical stream, each from its own generator.
    """

    def __init__(self) -> None:
        self._seeds: dict[str, int | None] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._active: dict[tuple[str, str], int] = {}

    # ----------------------------------------------------------------- registry

    def reset(self) -> None:
        """Forget every state."""
        self._seeds.clear()
        self._states.clear()

    def is_seeded(self, name: str = MODEL_PARALLEL) -> bool:
        """Whether a state called ``name`` is registered."""
        return name in self._states

    def seeds(self) -> dict[str, int | None]:
        """The registered seeds by name (None for a state installed by :meth:`set_states`
        without a known seed)."""
        return {name: self._seeds.get(name) for name in self._states}

    def add(self, name: str, seed: int) -> None:
        """Register a state called ``name`` seeded with ``seed``.

        >>> t = RngStatesTracker()
        >>> t.add("a", 1)
        >>> t.add("b", 1)
        Traceback (most recent call last):
        ...
        torchloom.core.errors.RngError: rng_tracker.add(...): seed 1 is already used by state 'a'
            values: name='b', seed=1
            fix: give each state its own seed, e.g. rng_tracker.add('b', 2)
        """
        if not isinstance(name, str) or not name:
            raise RngError(
                "a state name is a non-empty string",
                primitive="rng_tracker.add",
                values={"name": name},
                fix=f"rng_tracker.add({MODEL_PARALLEL!r}, seed)",
            )
        seed = _check_int(seed, "seed", "rng_tracker.add", f"rng_tracker.add({name!r}, 1234)")
        if name in self._states:
            raise RngError(
                f"a state called {name!r} is already registered",
                primitive="rng_tracker.add",
                values={"name": name, "seed": seed, "registered_seed": self._seeds.get(name)},
                fix="call rng_tracker.reset() first, or pick another name",
            )
        for other, other_seed in self.seeds().items():
            if other_seed == seed:
                raise RngError(
                    f"seed {seed} is already used by state {other!r}",
                    primitive="rng_tracker.add",
                    values={"name": name, "seed": seed},
                    fix=f"give each state its own seed, e.g. rng_tracker.add({name!r}, "
                    f"{max(s for s in self.seeds().values() if s is not None) + 1})",
                )
        self._seeds[name] = seed
        self._states[name] = {}

    # ----------------------------------------------------------------- states

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every state: ``{name: {device_type: state tensor}}``."""
        return {
            name: {dtype: state.clone() for dtype, state in per_type.items()}
            for name, per_type in self._states.items()
        }

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace every state by a copy of ``states`` (as returned by :meth:`get_states`).

        The seeds registered with :meth:`add` are kept, so a state for a device type that
        is not in ``states`` is still created lazily from its seed.
        """
        if not isinstance(states, dict) or not all(
            isinstance(v, dict) and all(isinstance(s, torch.Tensor) for s in v.values())
            for v in states.values()
        ):
            raise RngError(
                "set_states takes the dict that get_states returned",
                primitive="rng_tracker.set_states",
                values={"states": type(states).__name__},
                fix="states = rng_tracker.get_states(); ...; rng_tracker.set_states(states)",
            )
        self._states = {
            name: {dtype: state.clone() for dtype, state in per_type.items()}
            for name, per_type in states.items()
        }
        for name in self._states:
            self._seeds.setdefault(name, None)

    # ----------------------------------------------------------------- fork

    @contextlib.contextmanager
    def fork(
        self, name: str = MODEL_PARALLEL, device: torch.device | str | None = None
    ) -> Iterator[None]:
        """Draw from the state ``name`` on ``device`` (default cpu) inside the block.

        On entry the device type's global generator state is put aside and replaced by the
        tracked state; on exit (also on an exception) the advanced state is saved back into
        the tracker and the global state restored. A fork of the same name and device type
        inside another is a no-op: the stream is already the current one. On the ``meta``
        device nothing is random, and the fork does nothing.
        """
        if name not in self._states:
            raise RngError(
                f"no random state called {name!r} is registered",
                primitive="rng_tracker.fork",
                values={"name": name, "registered": sorted(self._states)},
                fix="seed it first: torchloom.set_random_seed(seed, tp_rank=tp_rank)"
                if name == MODEL_PARALLEL
                else f"register it first: get_rng_tracker().add({name!r}, seed)",
            )
        dtype, index = _device_type(device)
        key = (name, dtype)
        if dtype == "meta" or self._active.get(key, 0) > 0:
            yield
            return
        per_type = self._states[name]
        if dtype not in per_type:
            seed = self._seeds.get(name)
            if seed is None:
                raise RngError(
                    f"state {name!r} has no {dtype} state and no seed to create one",
                    primitive="rng_tracker.fork",
                    values={"name": name, "device_type": dtype, "known": sorted(per_type)},
                    fix=f"register it with a seed: get_rng_tracker().add({name!r}, seed)",
                )
            per_type[dtype] = _seeded_state(dtype, index, seed)
        saved = _get_state(dtype, index)
        _set_state(dtype, index, per_type[dtype])
        self._active[key] = 1
        try:
            yield
        finally:
            self._active[key] = 0
            # The state may have been replaced (set_states) while forked: write into the
            # current dict of this name if it still exists.
            advanced = _get_state(dtype, index)
            if name in self._states:
                self._states[name][dtype] = advanced
            _set_state(dtype, index, saved)


_TRACKER = RngStatesTracker()


def get_rng_tracker() -> RngStatesTracker:
    """The process-wide tracker that ``fork_rng`` and ``checkpoint`` use."""
    return _TRACKER


def set_random_seed(seed: int, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
    """Seed every generator for this rank and register the tensor-parallel state.

    Python ``random``, numpy and torch (every device) get
    ``seed + 100 * pp_rank + 10 * dp_rank``, which is returned. The tracker is reset and
    gets ``"model-parallel"`` seeded with ``<returned seed> + 2718 + tp_rank``. See the
    module docstring for why.

    >>> set_random_seed(7, tp_rank=3, dp_rank=1, pp_rank=2)
    217
    >>> get_rng_tracker().seeds()
    {'model-parallel': 2938}
    """
    fix = "torchloom.set_random_seed(1234, tp_rank=0, dp_rank=0, pp_rank=0)"
    seed = _check_int(seed, "seed", "set_random_seed", fix)
    tp_rank = _check_int(tp_rank, "tp_rank", "set_random_seed", fix)
    dp_rank = _check_int(dp_rank, "dp_rank", "set_random_seed", fix)
    pp_rank = _check_int(pp_rank, "pp_rank", "set_random_seed", fix)
    rank_seed = seed + PIPELINE_OFFSET * pp_rank + DATA_PARALLEL_OFFSET * dp_rank
    if rank_seed >= 2**32 - TENSOR_PARALLEL_OFFSET - tp_rank:
        raise RngError(
            "the seed is too large for numpy (seeds must stay below 2**32)",
            primitive="set_random_seed",
            values={"seed": seed, "rank_seed": rank_seed},
            fix="use a smaller seed, e.g. torchloom.set_random_seed(1234)",
        )
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)  # seeds every device type torch knows
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL, rank_seed + TENSOR_PARALLEL_OFFSET + tp_rank)
    return rank_seed
