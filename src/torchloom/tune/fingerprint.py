"""What a study is about: a fingerprint of the model and of the search space.

The results database keys every row by this fingerprint, so a run resumes only rows
measured on the same model (its class, its config and every parameter's and buffer's name,
shape and dtype) over the same space (every point, in order). A row written for another
model, another size, another space, or forged by hand with another fingerprint is never
resumed and never shown.

The model is built under fake-tensor mode (nothing is allocated); the fingerprint is the
SHA-256 of a canonical JSON text, the same in every process and on every machine.

>>> import torch
>>> from torchloom.tune import Space
>>> space = Space()
>>> _ = space.create_symbol("batch_size", [1, 2])
>>> a = study_fingerprint(lambda: torch.nn.Linear(4, 4), space)
>>> a == study_fingerprint(lambda: torch.nn.Linear(4, 4), space), len(a)
(True, 64)
>>> a == study_fingerprint(lambda: torch.nn.Linear(4, 5), space)
False
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from .space import Space, point_key

__all__ = ["describe_model", "describe_space", "study_fingerprint"]

_MAX_DEPTH = 8


def _canonical(value: Any, depth: int = 0) -> Any:
    """A JSON-ready, address-free rendering of a config value."""
    if depth > _MAX_DEPTH:
        return "..."
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v, depth + 1) for k, v in value.items()}
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"  # never an address


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    to_dict = getattr(config, "to_dict", None)
    data = to_dict() if callable(to_dict) else getattr(config, "__dict__", {})
    return _canonical(dict(data))


def describe_model(model: nn.Module) -> dict[str, Any]:
    """The parts of a model its fingerprint covers: class, config, and the name, shape
    and dtype of every parameter and buffer.

    >>> describe_model(nn.Linear(2, 3))["tensors"]
    [['weight', [3, 2], 'torch.float32'], ['bias', [3], 'torch.float32']]
    """
    tensors = [[name, list(t.shape), str(t.dtype)]
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    cls = type(model)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "config": _config(model),
            "tensors": tensors}


def describe_space(space: Space) -> dict[str, Any]:
    """The parts of a space its fingerprint covers: the symbol names and every point."""
    return {"symbols": list(space.symbols), "points": [point_key(p) for p in space.enumerate()]}


def study_fingerprint(make_model: Callable[[], nn.Module], space: Space) -> str:
    """The hex SHA-256 of the model (built by ``make_model`` under fake mode) and space."""
    from ..runtime.memory import fake_mode

    with fake_mode():
        model = make_model()
    text = json.dumps({"model": describe_model(model), "space": describe_space(space)},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
