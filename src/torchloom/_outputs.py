"""Reading tensors out of model outputs (a tensor, tuples/lists, dicts, transformers
``ModelOutput``), shared by the verifier, the pipeline split and the test helpers."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_in", "main_tensor"]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, depth first, in order.

    >>> tensors_in((torch.zeros(1), {"a": None, "b": [torch.ones(2)]}))
    [tensor([0.]), tensor([1., 1.])]
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if hasattr(value, "values") and callable(value.values):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def main_tensor(value: Any) -> Any:
    """The ``logits`` of a mapping output that has them, else the first tensor in
    ``value``; ``value`` itself if it holds no tensor."""
    if hasattr(value, "keys") and "logits" in value.keys() and \
            isinstance(value["logits"], torch.Tensor):
        return value["logits"]
    found = tensors_in(value)
    return found[0] if found else value
