"""Reading tensors out of model outputs (a tensor, tuples/lists, dicts, transformers
``ModelOutput``), shared by the verifier, the pipeline split and the test helpers; and the
keyword that turns a transformers model's KV cache off in a training call."""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["tensors_in", "main_tensor", "no_cache_kwargs"]


def no_cache_kwargs(model: Any) -> dict[str, bool]:
    """``{"use_cache": False}`` when ``model``'s forward (or the forward of the module a
    DDP wrapper holds) takes ``use_cache``, else ``{}``: a training step never needs the
    KV cache that transformers' default configs (``use_cache=True``) build.

    >>> import transformers
    >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    >>> no_cache_kwargs(transformers.GPT2LMHeadModel(cfg)), no_cache_kwargs(torch.nn.Linear(1, 1))
    ({'use_cache': False}, {})
    """
    inner = getattr(model, "module", model)
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


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
