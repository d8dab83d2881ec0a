"""Vocabulary-parallel embedding and cross-entropy (Megatron-style tensor parallelism).

A language model's largest tensors are its token embedding table and the logits
``(batch, seq, vocab)``. Both are split along the vocabulary here: rank ``r`` of a group of
``p`` holds rows ``[r * V / p, (r + 1) * V / p)`` of the table and the matching columns of
the logits, and no rank ever materialises the full logits.

* :class:`VocabParallelEmbedding` looks up the ids this rank owns, writes zeros for the
  others and sums over the group (one all-reduce forward, none backward). Ownership is
  decided from the *global* id, so a token whose local id is 0 keeps its row (Slapo
  zeroed the rows of local id 0 after remapping, which lost the first token of every
  rank's range).
* :func:`vocab_parallel_logits` is the head of a model whose output projection is tied to
  the embedding: ``hidden @ local_table.T`` gives this rank's logits columns; the
  gradient of ``hidden`` is summed over the group (one all-reduce backward).
* :func:`vocab_parallel_cross_entropy` computes the softmax cross-entropy from those
  columns with two all-reduces forward (the max, then the sum of exponentials together
  with the target logit) and none backward: the gradient of a shard is
  ``softmax - onehot`` restricted to it.

With a world of one (no process group, or a group of one) the results equal
``nn.Embedding`` and ``F.cross_entropy``.

>>> import torch, torch.nn.functional as F
>>> emb = torch.nn.Embedding(10, 4, padding_idx=0)
>>> vp = VocabParallelEmbedding.from_embedding(emb)
>>> ids = torch.tensor([[0, 3, 9]])
>>> torch.equal(vp(ids), emb(ids))
True
>>> logits, target = torch.randn(5, 10), torch.tensor([1, 2, -100, 9, 0])
>>> torch.allclose(vocab_parallel_cross_entropy(logits, target), F.cross_entropy(logits, target))
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.errors import ShardError
from ..core.meta import ShardSpec, copy_meta, get_meta, shard_spec
from ..core.refs import schedule_safe
from ..core.schedule import factory_group
from ..runtime import collectives as C

__all__ = [
    "VocabParallelEmbedding",
    "make_vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]

_REDUCTIONS = ("mean", "sum", "none")


def _vocab_range(num_embeddings: int, world_size: int, rank: int, primitive: str) -> tuple[int, int]:
    if num_embeddings % world_size != 0:
        raise ShardError(
            f"a vocabulary of {num_embeddings} does not split into {world_size} equal parts",
            primitive=primitive,
            values={"num_embeddings": num_embeddings, "world_size": world_size},
            fix=f"pad the vocabulary to a multiple of {world_size}, e.g. "
            f"model.resize_token_embeddings({-(-num_embeddings // world_size) * world_size})",
        )
    per_rank = num_embeddings // world_size
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows are split over the ranks of ``group``.

    Attributes:
        num_embeddings: the full vocabulary size ``V``.
        embedding_dim: the width of a row.
        padding_idx: the global padding id (its row gets no gradient), or None.
        vocab_start, vocab_end: the global ids ``[vocab_start, vocab_end)`` this rank owns.
        weight: the local rows, shape ``(V / world_size, embedding_dim)``, carrying a
            :class:`~torchloom.core.meta.ShardSpec` with ``axis=0``.

    Built from scratch, the local rows are drawn from ``N(0, 1)`` on each rank (as
    ``nn.Embedding`` does), which does not equal slicing one full table: use
    :meth:`from_embedding` to shard an existing (e.g. pretrained) embedding.

    Ids outside ``[0, V)`` raise :class:`~torchloom.core.errors.ShardError` for CPU inputs
    (checking a CUDA input would synchronise the device, so it is not checked there).

    >>> vp = VocabParallelEmbedding(8, 2, padding_idx=1)
    >>> vp
    VocabParallelEmbedding(8, 2, padding_idx=1, rows=[0, 8), world_size=1)
    >>> vp(torch.tensor([1]))
    tensor([[0., 0.]], grad_fn=<EmbeddingBackward0>)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        group: Any = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        _weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        primitive = "VocabParallelEmbedding"
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ShardError(
                    "padding_idx must be within the vocabulary",
                    primitive=primitive,
                    values={"padding_idx": padding_idx, "num_embeddings": num_embeddings},
                    fix="pass padding_idx=None or an id in [0, num_embeddings)",
                )
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.group = group
        self.world_size = C.group_size(group)
        self.rank = C.group_rank(group)
        self.vocab_start, self.vocab_end = _vocab_range(
            num_embeddings, self.world_size, self.rank, primitive)
        local_rows = self.vocab_end - self.vocab_start
        if _weight is None:
            weight = torch.empty(local_rows, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(weight)
            if self.local_padding_idx is not None:
                with torch.no_grad():
                    weight[self.local_padding_idx].zero_()
            self.weight = nn.Parameter(weight)
        else:
            if tuple(_weight.shape) != (local_rows, embedding_dim):
                raise ShardError(
                    "the local weight has the wrong shape",
                    primitive=primitive,
                    values={"shape": tuple(_weight.shape),
                            "expected": (local_rows, embedding_dim)},
                    fix="pass this rank's rows of the table, or use "
                    "VocabParallelEmbedding.from_embedding(embedding)",
                )
            self.weight = _weight if isinstance(_weight, nn.Parameter) else nn.Parameter(_weight)
        get_meta(self.weight).shard = ShardSpec(
            axis=0, full_shape=(num_embeddings, embedding_dim),
            world_size=self.world_size, rank=self.rank)

    @property
    def local_padding_idx(self) -> int | None:
        """The padding row in the local table, or None when another rank owns it."""
        if self.padding_idx is None or not self.vocab_start <= self.padding_idx < self.vocab_end:
            return None
        return self.padding_idx - self.vocab_start

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Any = None) -> VocabParallelEmbedding:
        """Keep this rank's rows of an existing full ``nn.Embedding``.

        The new weight is a new ``Parameter`` (a head tied to ``emb.weight`` is no longer
        tied to it: compute its logits with :func:`vocab_parallel_logits`). Tags set with
        ``annotate`` are kept; ``padding_idx`` keeps its meaning. ``max_norm``,
        ``scale_grad_by_freq`` and ``sparse`` are not supported.

        >>> full = nn.Embedding(6, 2)
        >>> vp = VocabParallelEmbedding.from_embedding(full)
        >>> import torchloom as tl
        >>> spec = tl.shard_spec(vp.weight)
        >>> spec.axis, spec.full_shape, spec.world_size, spec.rank
        (0, (6, 2), 1, 0)
        """
        primitive = "VocabParallelEmbedding.from_embedding"
        if not isinstance(emb, nn.Embedding):
            raise ShardError(
                f"expected an nn.Embedding, got {type(emb).__name__}",
                primitive=primitive,
                values={"module": type(emb).__name__},
                fix="apply it to the token embedding, e.g. "
                "sch['transformer.wte'].replace(make_vocab_parallel_embedding)",
            )
        unsupported = {name: getattr(emb, name) for name in ("max_norm", "scale_grad_by_freq",
                                                             "sparse")
                       if getattr(emb, name) not in (None, False)}
        if unsupported:
            raise ShardError(
                "this embedding option cannot be split over the vocabulary",
                primitive=primitive,
                values=unsupported,
                fix="create the embedding without "
                + ", ".join(f"{k}={v!r}" for k, v in unsupported.items()),
            )
        previous = shard_spec(emb.weight)
        if previous is not None:
            raise ShardError(
                "the embedding weight is already sharded",
                primitive=primitive,
                values={"axis": previous.axis, "full_shape": previous.full_shape},
                fix="give VocabParallelEmbedding the full (unsharded) embedding; do not "
                "shard('weight', ...) it first",
            )
        world_size, rank = C.group_size(group), C.group_rank(group)
        start, end = _vocab_range(emb.num_embeddings, world_size, rank, primitive)
        with torch.no_grad():
            rows = emb.weight.detach()[start:end].clone()
        weight = nn.Parameter(rows, requires_grad=emb.weight.requires_grad)
        copy_meta(emb.weight, weight)
        module = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, group,
                     _weight=weight)
        module.train(emb.training)
        return module

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        """Embed ``input`` (integer ids of any shape); returns ``input.shape + (dim,)``."""
        if input.device.type == "cpu" and input.numel() > 0:
            low, high = int(input.min()), int(input.max())
            if low < 0 or high >= self.num_embeddings:
                raise ShardError(
                    "token ids are outside the vocabulary",
                    primitive="VocabParallelEmbedding.forward",
                    values={"min": low, "max": high, "num_embeddings": self.num_embeddings},
                    fix="check the tokenizer and the model's vocab_size",
                )
        if self.world_size == 1:
            return F.embedding(input, self.weight, self.padding_idx)
        # Ownership from the global id, before remapping (the Slapo bug zeroed local id 0).
        foreign = (input < self.vocab_start) | (input >= self.vocab_end)
        local_ids = (input - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local_ids, self.weight, self.local_padding_idx)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return C.all_reduce(out, self.group)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}{pad}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), world_size={self.world_size}")


@schedule_safe
def make_vocab_parallel_embedding(old: nn.Module) -> VocabParallelEmbedding:
    """Factory for ``sch[path].replace(make_vocab_parallel_embedding)``: the vocabulary is
    split over the schedule's group (the tensor-parallel group of ``create_schedule(model,
    group=...)``; the default group when the schedule has none).

    >>> import torchloom as tl
    >>> model = nn.Sequential(nn.Embedding(4, 2))
    >>> tl.create_schedule(model)["0"].replace(make_vocab_parallel_embedding)
    >>> type(model[0]).__name__
    'VocabParallelEmbedding'
    """
    return VocabParallelEmbedding.from_embedding(old, factory_group())  # type: ignore[arg-type]


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor,
                          group: Any = None) -> torch.Tensor:
    """This rank's logits columns, ``hidden @ weight.T`` with the local rows ``weight``.

    The head of a model tied to a :class:`VocabParallelEmbedding`: pass its ``weight``.
    The gradient of ``hidden`` is summed over ``group`` (every rank's columns depend on it).

    >>> vocab_parallel_logits(torch.ones(2, 3), torch.ones(5, 3))
    tensor([[3., 3., 3., 3., 3.],
            [3., 3., 3., 3., 3.]])
    """
    return F.linear(C.copy_to_group(hidden, group), weight)


def _all_reduce_in_place(x: torch.Tensor, op: Any, group: Any, world_size: int,
                         primitive: str = "vocab_parallel_cross_entropy") -> None:
    """Reduce ``x`` over ``group`` in place (nothing for a world of one), counted by
    :func:`~torchloom.runtime.collectives.count_collectives` as an ``all_reduce``."""
    if world_size > 1:
        C._record("all_reduce")
        with C.guard_collective("all_reduce", primitive, group):
            dist.all_reduce(x, op=op, group=group)


def _target_logits(shifted: torch.Tensor, target: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local_target, foreign, picked)`` for logits columns ``[start, start + V_local)``:
    the target's local column (0 where another rank owns it), whether another rank owns
    it, and the target's entry of ``shifted`` (0 where foreign)."""
    local_vocab = shifted.shape[-1]
    foreign = (target < start) | (target >= start + local_vocab)
    local_target = (target - start).masked_fill(foreign, 0)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    return local_target, foreign, picked.masked_fill(foreign, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits_local: torch.Tensor, target: torch.Tensor, group: Any,
                ignore_index: int, reduction: str) -> torch.Tensor:
        world_size, rank = C.group_size(group), C.group_rank(group)
        local_vocab = logits_local.shape[-1]
        start = rank * local_vocab
        logits = logits_local.detach().float()

        row_max = logits.amax(dim=-1)
        _all_reduce_in_place(row_max, dist.ReduceOp.MAX, group, world_size)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()

        local_target, foreign, picked = _target_logits(shifted, target, start)
        # One all-reduce for both sums: [sum of exp, target logit (owner only)].
        sums = torch.stack([exp.sum(dim=-1), picked], dim=-1)
        _all_reduce_in_place(sums, dist.ReduceOp.SUM, group, world_size)
        sum_exp, target_logit = sums.unbind(-1)

        valid = target != ignore_index
        per_token = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        n_valid = valid.sum()
        if reduction == "mean":
            loss = per_token.sum() / n_valid
        elif reduction == "sum":
            loss = per_token.sum()
        else:
            loss = per_token

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, foreign, valid, n_valid)
        ctx.reduction = reduction
        ctx.in_dtype = logits_local.dtype
        return loss.to(logits_local.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_target, foreign, valid, n_valid = ctx.saved_tensors
        grad = softmax.clone()
        onehot = (~foreign).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        grad_out = grad_out.float()
        if ctx.reduction == "mean":
            grad_out = grad_out / n_valid
        scale = grad_out * valid.to(grad.dtype)  # a scalar, or per token for "none"
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    group: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Softmax cross-entropy of logits split along their last (vocabulary) axis.

    Args:
        logits_local: this rank's columns ``[rank * V / p, (rank + 1) * V / p)`` of the
            logits, shape ``(..., V / p)``; the class axis is the *last* one (unlike
            ``F.cross_entropy``'s axis 1), as for ``(batch, seq, vocab)`` logits.
        target: global class ids, shape ``logits_local.shape[:-1]``.
        group: the tensor-parallel group (default: the world).
        ignore_index: targets equal to it contribute neither loss nor gradient.
        reduction: ``"mean"`` (over non-ignored targets; NaN if there are none, like
            ``F.cross_entropy``), ``"sum"`` or ``"none"``.

    The result is the same on every rank. Computed in fp32 (returned in the logits'
    dtype): max over the group, then the sum of exponentials and the target logit (two
    all-reduces forward); the backward is local.

    >>> import torch.nn.functional as F
    >>> logits = torch.randn(2, 3, 7, requires_grad=True)
    >>> target = torch.tensor([[1, 6, -100], [0, 2, 5]])
    >>> loss = vocab_parallel_cross_entropy(logits, target)
    >>> torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1)))
    True
    """
    primitive = "vocab_parallel_cross_entropy"
    if reduction not in _REDUCTIONS:
        raise ShardError(
            f"unknown reduction {reduction!r}",
            primitive=primitive, values={"reduction": reduction},
            fix="use reduction='mean', 'sum' or 'none'",
        )
    if logits_local.dim() < 1 or tuple(target.shape) != tuple(logits_local.shape[:-1]):
        raise ShardError(
            "target must have the shape of the logits without their last (vocabulary) axis",
            primitive=primitive,
            values={"logits_local": tuple(logits_local.shape), "target": tuple(target.shape)},
            fix="flatten both, e.g. vocab_parallel_cross_entropy(logits.reshape(-1, "
            "logits.shape[-1]), target.reshape(-1))",
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ShardError(
            "target must hold integer class ids",
            primitive=primitive, values={"dtype": target.dtype},
            fix="pass target.long()",
        )
    return _VocabParallelCrossEntropy.apply(logits_local, target, group, ignore_index, reduction)
