"""Attention over a sequence split between context-parallel ranks (the kernels of
:mod:`torchloom.primitives.context_parallel`; public as :mod:`torchloom.ops.context_parallel`).

A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; context-parallel rank
``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (:func:`shard_index`). Under a causal
mask chunk ``j`` attends to ``j + 1`` chunks of keys, so each rank attends to
``(r + 1) + (2 * cp - r) = 2 * cp + 1`` chunks' worth of keys: every rank does the same
work (load balance), which cutting the sequence into ``cp`` plain pieces would not (the
last rank would do ``2 * cp - 1`` times the first's).

:func:`context_parallel_attention` is a transformers attention function (the signature
of ``transformers.integrations.sdpa_attention.sdpa_attention_forward``): the module's
local queries, keys and values come in; the keys and values of the whole sequence are
all-gathered over the context-parallel group (differentiable: their gradients are
reduce-scattered back in backward), put back in token order, and each local query chunk
runs ``F.scaled_dot_product_attention`` against the keys it may see, with the causal
mask aligned to its true positions, the model's sliding window and the batch's key
padding. Attention probabilities never cross ranks, so the result and its gradients are
the single-process attention's, up to floating-point summation order.

Why all-gather and not a ring: a ring exchange (PyTorch's
``torch.distributed.tensor.experimental.context_parallel``) overlaps ``cp - 1`` point-to-point
steps with attention and never holds more than two chunks of keys, but merges partial
results by their log-sum-exp, which needs the attention kernel's LSE output (only the
CUDA flash / efficient / cuDNN kernels give it; PyTorch's ring runs on none of the CPU
kernels). The all-gather moves the same bytes per rank (``(cp - 1) / cp`` of the
sequence's keys and values) in one collective per layer, runs on every SDPA kernel and
device, and with grouped-query attention (Llama 3: 8 key/value heads for 32 query heads)
the gathered keys and values of a layer are a quarter of its queries' size: at 8B and
32,768 tokens, 128 MiB in bf16 per layer, transient, against activations of GiBs. It is
the layout of Llama 3's own long-context training.

>>> import torch
>>> shard_index(8, cp=2, rank=0).tolist(), shard_index(8, cp=2, rank=1).tolist()
([0, 1, 6, 7], [2, 3, 4, 5])
>>> q = k = v = torch.randn(1, 2, 8, 4)
>>> full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> outs = [chunk_attention(q[:, :, shard_index(8, 2, r)], k, v, cp=2, rank=r)
...         for r in range(2)]
>>> torch.allclose(outs[0], full[:, :, shard_index(8, 2, 0)], atol=1e-6)
True
>>> torch.allclose(outs[1], full[:, :, shard_index(8, 2, 1)], atol=1e-6)
True
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import ContextParallelError
from ..core.marks import CONTEXT_PARALLEL, get_mark
from . import collectives as C

__all__ = [
    "CPState",
    "chunk_attention",
    "context_parallel_attention",
    "gather_sequence",
    "shard_index",
]

PRIMITIVE = "context_parallel"
ATTENTION_NAME = "torchloom_context_parallel"
"""The name :func:`context_parallel_attention` is registered under in transformers'
``AttentionInterface`` (what ``config._attn_implementation`` is set to)."""


@dataclass
class CPState:
    """What every attention module of one context-parallel model shares.

    Attributes:
        group: the context-parallel process group (None: one rank, nothing gathered).
        size, rank: its size and this rank's place in it.
        path: the schedule path the primitive was applied at (for messages).
        key_padding: the batch's ``(batch, seq)`` padding mask over the whole sequence in
            token order (True: a real token), set by the model's input hook for one
            forward; None: no padding.
    """

    group: Any
    size: int
    rank: int
    path: str = ""
    key_padding: torch.Tensor | None = field(default=None, repr=False)


def shard_index(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """The positions (in token order) context-parallel rank ``rank`` of ``cp`` keeps: chunks
    ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp`` equal ones. ``seq_len`` must be a
    multiple of ``2 * cp``."""
    if seq_len % (2 * cp):
        raise ContextParallelError(
            f"a sequence of {seq_len} tokens does not split into 2 x {cp} equal chunks",
            primitive=PRIMITIVE, values={"seq_len": seq_len, "cp": cp},
            fix=f"use a sequence length that is a multiple of {2 * cp} (pad or pack the "
            "batch to it)")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, last])


def _token_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """The permutation that puts the ranks' shards, concatenated in rank order, back in
    token order."""
    gathered = torch.cat([shard_index(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(gathered)


_MASK_FREE = contextvars.ContextVar("torchloom_cp_mask_free", default=False)


@contextlib.contextmanager
def mask_free_causal_chunks() -> Iterator[None]:
    """For cost measurement only (the planner, on fake tensors): where a query chunk would
    take the lower-right ``CausalBias`` (a GPU kernel's mask that never exists in memory),
    pass no mask at all, so that what is measured holds no mask either. The positions
    each query sees are then wrong: never use it to compute."""
    token = _MASK_FREE.set(True)
    try:
        yield
    finally:
        _MASK_FREE.reset(token)


def _bias_ok() -> bool:
    """Whether a ``CausalBias`` can be made: not under a Python dispatch mode (a memory or
    FLOP counter, fake tensors), where the tensor subclass cannot be created; the same
    mask is then built explicitly."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is None


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    cp: int, rank: int, is_causal: bool = True, scale: float | None = None,
                    dropout_p: float = 0.0, sliding_window: int | None = None,
                    key_padding: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of rank ``rank``'s two query chunks (``(batch, heads, 2c, dim)``, in
    :func:`shard_index` order) against the whole sequence's keys and values
    (``(batch, kv_heads, S, dim)``, token order; ``heads`` a multiple of ``kv_heads``).
    Returns ``(batch, heads, 2c, dim)``.

    A query at position ``p`` sees the keys ``t <= p`` (``is_causal``), with
    ``p - t < sliding_window`` (when given) and ``key_padding[b, t]`` (when given).
    """
    seq = key.shape[2]
    c = query.shape[2] // 2
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for half, j in ((0, rank), (1, 2 * cp - 1 - rank)):
        q = query[:, :, half * c:(half + 1) * c]
        start, end = 0, seq
        if is_causal:
            end = (j + 1) * c
            if sliding_window is not None:
                start = max(0, j * c - sliding_window + 1)
        k, v = key[:, :, start:end], value[:, :, start:end]
        plain = is_causal and sliding_window is None and key_padding is None
        mask: Any = None
        if plain and _MASK_FREE.get():
            mask = None
        elif plain and _bias_ok():
            from torch.nn.attention.bias import causal_lower_right

            # the kernel aligns the causal mask to the end of the keys: no mask in memory,
            # and the flash kernel stays eligible on CUDA
            mask = causal_lower_right(c, end)
        elif is_causal or key_padding is not None:
            positions = torch.arange(j * c, (j + 1) * c, device=q.device)[:, None]
            keys = torch.arange(start, end, device=q.device)[None, :]
            keep = torch.ones(c, end - start, dtype=torch.bool, device=q.device)
            if is_causal:
                keep = keys <= positions
                if sliding_window is not None:
                    keep = keep & (positions - keys < sliding_window)
            mask = keep[None, None]
            if key_padding is not None:
                mask = mask & key_padding[:, None, None, start:end].to(torch.bool)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                   scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def gather_sequence(local: torch.Tensor, state: CPState | Any, dim: int = 1) -> torch.Tensor:
    """The whole sequence of ``local`` (this rank's :func:`shard_index` positions along
    ``dim``) in token order: all-gathered over ``state.group`` (differentiable). For
    comparing a context-parallel model's outputs with one process's."""
    group = state.group if isinstance(state, CPState) else state
    size = C.group_size(group)
    if size == 1:
        return local
    moved = local.movedim(dim, 0)
    parts = C.all_gather(moved, 0, group)
    order = _token_order(moved.shape[0] * size, size, moved.device)
    return parts.index_select(0, order).movedim(0, dim)


def _gather_kv(tensor: torch.Tensor, state: CPState) -> torch.Tensor:
    """``(batch, heads, local, dim)`` -> the whole sequence in token order."""
    return gather_sequence(tensor, state, dim=2)


def _refuse(module: nn.Module, state: CPState, what: str, values: dict[str, Any],
            fix: str) -> ContextParallelError:
    return ContextParallelError(f"{type(module).__name__}: {what}", path=state.path, primitive=PRIMITIVE,
                    values=values, fix=fix)


def context_parallel_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None,
                               sliding_window: int | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function over a context-parallel sequence (see the module
    docstring): ``query`` ``(batch, heads, local, dim)``, ``key`` / ``value``
    ``(batch, kv_heads, local, dim)`` for this rank's positions; returns the attention
    output as ``(batch, local, heads, dim)`` and no weights, as transformers' SDPA
    function does. The module must carry the model's :class:`CPState` (installed by the
    ``context_parallel`` primitive)."""
    state: CPState | None = get_mark(module, CONTEXT_PARALLEL)
    if state is None:
        raise ContextParallelError(
            f"{type(module).__name__} runs the context-parallel attention function but was "
            "not prepared by the context_parallel primitive", primitive=PRIMITIVE,
            values={"module": type(module).__name__},
            fix="apply sch[path].context_parallel(group) to the model that holds it")
    if attention_mask is not None:
        raise _refuse(module, state, "the model built a full attention mask, which a "
                      "context-parallel sequence cannot use",
                      {"mask_shape": tuple(attention_mask.shape)},
                      "pass a 2-D padding mask (or none) to the model: the primitive keeps "
                      "it and masks the gathered keys; a model that builds its own 4-D mask "
                      "is not supported")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise _refuse(module, state, f"its attention takes {name}, which the "
                          "context-parallel kernel (SDPA) does not compute",
                          {name: True}, "train this model without context parallelism")
    if query.shape[2] % 2:
        raise _refuse(module, state, "an odd number of local positions",
                      {"local": query.shape[2], "cp": state.size},
                      f"the sequence length must be a multiple of {2 * state.size}")
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    full_key = _gather_kv(key, state)
    full_value = _gather_kv(value, state)
    out = chunk_attention(query, full_key, full_value, cp=state.size, rank=state.rank,
                          is_causal=causal, scale=scaling,
                          dropout_p=dropout if module.training else 0.0,
                          sliding_window=sliding_window, key_padding=state.key_padding)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register :func:`context_parallel_attention` in transformers' attention (and
    attention-mask) interfaces under :data:`ATTENTION_NAME`; idempotent. Returns the name.
    It is registered as an attention function without a mask function: transformers then
    builds no mask for models that use it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    return ATTENTION_NAME
