"""Parallel building blocks that a schedule can ``replace`` modules with.

* :class:`VocabParallelEmbedding` (and the factory :func:`make_vocab_parallel_embedding`
  for ``sch[path].replace(...)``): an embedding whose table is split by rows (vocabulary)
  over the tensor-parallel group.
* :func:`vocab_parallel_cross_entropy`: cross-entropy over logits split along the
  vocabulary axis, without gathering them.
* :func:`vocab_parallel_logits`: the logits shard of a language-model head tied to a
  vocab-parallel embedding.

In a world of one every operation equals its ``torch.nn`` counterpart.

>>> import torch
>>> emb = VocabParallelEmbedding.from_embedding(torch.nn.Embedding(8, 3))
>>> emb(torch.tensor([[0, 7]])).shape
torch.Size([1, 2, 3])
"""

from __future__ import annotations

from .vocab_parallel import (
    VocabParallelEmbedding,
    make_vocab_parallel_embedding,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)

__all__ = [
    "VocabParallelEmbedding",
    "make_vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]
