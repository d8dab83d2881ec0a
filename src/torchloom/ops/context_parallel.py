"""Attention over a sequence split between context-parallel ranks: the kernels of the
``context_parallel`` primitive, defined in :mod:`torchloom.runtime.context_attention`
(below the primitives in the package's layers) and public here beside the other kernels.

>>> shard_index(8, cp=2, rank=1).tolist()
[2, 3, 4, 5]
"""

from __future__ import annotations

from ..runtime.context_attention import (
    ATTENTION_NAME,
    CPState,
    chunk_attention,
    context_parallel_attention,
    gather_sequence,
    mask_free_causal_chunks,
    register_attention,
    shard_index,
)

__all__ = ["ATTENTION_NAME", "CPState", "chunk_attention", "context_parallel_attention",
           "gather_sequence", "mask_free_causal_chunks", "register_attention", "shard_index"]
