"""The head's cross-entropy, three ways (:data:`LOSSES`, ``Layout.loss``).

A language model's logits ``(batch, seq, vocab)`` are its largest activation, and the
loss transformers computes from them (``ForCausalLMLoss``) upcasts all of them to fp32,
takes a log-softmax (another fp32 copy, saved for backward) and, in backward, makes two
more fp32 copies before casting the gradient back. Here:

* ``"full"``: that loss, unchanged (the model's own ``loss_function``);
* ``"parallel"``: the logits stay split along the vocabulary over the tensor-parallel
  ranks (each rank ``V / tp`` columns) and
  :func:`~torchloom.ops.vocab_parallel.vocab_parallel_cross_entropy` computes the loss
  from them in fp32 (torchtitan's loss parallel): no rank holds full logits;
* ``"chunked"`` (the default): :func:`cross_entropy` walks the rows of the logits
  ``chunk_rows`` at a time, upcasting one chunk to fp32, and writes the gradient
  ``softmax - onehot`` of each chunk, in the logits' dtype, into one preallocated buffer
  in the forward. Only that buffer is saved; the backward scales it in place. Peak memory
  above the logits: one logits-sized buffer plus one fp32 chunk (:data:`CHUNK_BYTES`).
  With a vocabulary-sharded head (a ``group`` of more than one rank) each chunk costs two
  all-reduces of a few numbers per row, as the parallel loss does.

:class:`CausalLMLoss` is a drop-in for transformers' ``model.loss_function`` (same label
shift, ``shift_labels``, ``num_items_in_batch`` and ``ignore_index``), :func:`set_loss`
installs it, and :func:`next_token_loss` is the loss of a pipeline's last stage.

>>> import torch, torch.nn.functional as F
>>> logits = torch.randn(2, 5, 11, requires_grad=True)
>>> target = torch.tensor([[1, 2, 3, -100, 10], [0, 4, 4, 7, -100]])
>>> loss = cross_entropy(logits, target, chunk_rows=3)
>>> ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
>>> torch.allclose(loss, ref)
True
>>> loss.backward()
>>> mine = logits.grad.clone(); logits.grad = None; ref.backward()
>>> torch.allclose(mine, logits.grad)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.errors import LossError
from ..runtime import collectives as C
from .vocab_parallel import (
    _all_reduce_in_place,
    _target_logits,
    vocab_parallel_cross_entropy,
)

__all__ = ["CHUNK_BYTES", "CausalLMLoss", "LOSSES", "NextTokenLoss", "cross_entropy",
           "default_chunk_rows", "is_causal_lm", "next_token_loss", "set_loss"]

LOSSES = ("full", "parallel", "chunked")
"""How the head's cross-entropy is computed (this module): ``full``,
the model's own loss on full-vocabulary logits (transformers upcasts them to fp32);
``parallel``, vocabulary-sharded logits under tensor parallelism and an fp32
cross-entropy over the shards (no rank holds full logits; torchtitan's loss parallel);
``chunked`` (the default), the cross-entropy over rows of the logits a chunk at a time
with its gradient made in the forward (vocabulary-sharded under tensor parallelism when
the head is not tied to the embedding): no fp32 copy of the whole logits exists."""

CHUNK_BYTES = 64 * 2**20
"""The fp32 bytes one chunk of :func:`cross_entropy` may hold when ``chunk_rows`` is not
given: ``chunk_rows = max(1, CHUNK_BYTES // (4 * V_local))`` rows (524 rows of a
32000-column vocabulary)."""
IGNORE_INDEX = -100
_REDUCTIONS = ("mean", "sum")
_PRIMITIVE = "cross_entropy"


def default_chunk_rows(local_vocab: int, element_bytes: int = 4) -> int:
    """Rows per chunk whose ``element_bytes``-wide copy stays under :data:`CHUNK_BYTES`.

    >>> default_chunk_rows(32000), default_chunk_rows(10**9)
    (524, 1)
    """
    return max(1, CHUNK_BYTES // max(1, local_vocab * element_bytes))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any,
                ignore_index: int, reduction: str, chunk_rows: int) -> torch.Tensor:
        # None: the vocabulary is whole (not the world, as for torchloom's collectives)
        world_size, rank = (C.group_size(group), C.group_rank(group)) if group is not None \
            else (1, 0)
        local_vocab = logits.shape[-1]
        start = rank * local_vocab
        flat = logits.detach().reshape(-1, local_vocab)
        flat_target = target.reshape(-1).long()
        rows = flat.shape[0]
        compute = torch.promote_types(logits.dtype, torch.float32)
        # no gradient wanted (evaluation, no_grad): no buffer, each chunk a copy
        need_grad = bool(ctx.needs_input_grad[0])
        grad = torch.empty(logits.shape if need_grad else (0,), dtype=logits.dtype,
                           device=logits.device)
        flat_grad = grad.view(-1, local_vocab) if need_grad else None
        n_valid = (flat_target != ignore_index).sum()
        # The mean's 1/n goes into the gradient now (one rounding to the logits' dtype).
        scale = 1.0 / n_valid.to(compute) if reduction == "mean" else None
        total = torch.zeros((), dtype=compute, device=logits.device)
        for lo in range(0, rows, chunk_rows):
            hi = min(lo + chunk_rows, rows)
            out = flat_grad[lo:hi] if flat_grad is not None else None
            # fp32 logits are worked on in the gradient buffer itself; others in one copy.
            work = out.copy_(flat[lo:hi]) if out is not None and out.dtype == compute else \
                flat[lo:hi].to(compute, copy=True)
            chunk_target = flat_target[lo:hi]
            row_max = work.amax(dim=-1)
            _all_reduce_in_place(row_max, dist.ReduceOp.MAX, group, world_size, _PRIMITIVE)
            work.sub_(row_max.unsqueeze(-1))
            local_target, foreign, picked = _target_logits(work, chunk_target, start)
            work.exp_()
            # One all-reduce for both sums: [sum of exp, target logit (owner only)].
            sums = torch.stack([work.sum(dim=-1), picked], dim=-1)
            _all_reduce_in_place(sums, dist.ReduceOp.SUM, group, world_size, _PRIMITIVE)
            sum_exp, target_logit = sums.unbind(-1)
            ignored = chunk_target == ignore_index
            total = total + (sum_exp.log() - target_logit).masked_fill(ignored, 0.0).sum()
            if out is None:
                del work
                continue
            work.div_(sum_exp.unsqueeze(-1))  # softmax
            owned = (~foreign).to(compute).unsqueeze(-1)
            work.scatter_add_(-1, local_target.unsqueeze(-1), -owned)  # - onehot
            if scale is not None:
                work.mul_(scale)
            work.masked_fill_(ignored.unsqueeze(-1), 0.0)
            if work is not out:
                out.copy_(work)
            del work  # before the next chunk's copy is made: one chunk alive at a time
        ctx.save_for_backward(grad)
        ctx.used = False
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.used:
            raise LossError(
                "the chunked cross-entropy's backward ran twice: it scales its saved "
                "gradient in place, so its graph cannot be retained",
                primitive=_PRIMITIVE, values={"retain_graph": True},
                fix="call backward once per forward, or use loss='full' "
                "(torchloom.ops.loss.set_loss(model, 'full'))")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_out)  # in place: the gradient is the one saved buffer
        return grad, None, None, None, None, None


def _check_args(logits: torch.Tensor, target: torch.Tensor, reduction: str,
                chunk_rows: int | None) -> None:
    if reduction not in _REDUCTIONS:
        raise LossError(f"unknown reduction {reduction!r}", primitive=_PRIMITIVE,
                        values={"reduction": reduction, "reductions": list(_REDUCTIONS)},
                        fix="cross_entropy(logits, target, reduction='mean') or 'sum'")
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise LossError(
            "target must have the shape of the logits without their last (vocabulary) axis",
            primitive=_PRIMITIVE,
            values={"logits": tuple(logits.shape), "target": tuple(target.shape)},
            fix="cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise LossError("target must hold integer class ids", primitive=_PRIMITIVE,
                        values={"dtype": target.dtype}, fix="pass target.long()")
    if not logits.dtype.is_floating_point:
        raise LossError("logits must be floating point", primitive=_PRIMITIVE,
                        values={"dtype": logits.dtype}, fix="pass logits.float()")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 1):
        raise LossError("chunk_rows must be a positive integer (or None for the default)",
                        primitive=_PRIMITIVE, values={"chunk_rows": chunk_rows},
                        fix="cross_entropy(logits, target, chunk_rows=None)")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group: Any = None,
                  ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                  chunk_rows: int | None = None) -> torch.Tensor:
    """The chunked softmax cross-entropy (see the module docstring).

    Args:
        logits: ``(..., V_local)``: the whole vocabulary, or, when ``group`` has more than
            one rank, rank ``r``'s columns ``[r * V_local, (r + 1) * V_local)`` of it. The
            class axis is the last one. Any floating dtype; chunks are computed in fp32
            (or in the logits' dtype when wider).
        target: global class ids, shape ``logits.shape[:-1]``.
        group: the process group the vocabulary is split over (None: not split, whatever
            the world; unlike torchloom's collectives, None is not the world). Every
            rank of it must call with the same shapes and ``chunk_rows``.
        ignore_index: targets equal to it contribute neither loss nor gradient.
        reduction: ``"mean"`` over the targets not ignored (NaN when there are none, as
            for ``F.cross_entropy``) or ``"sum"``.
        chunk_rows: rows of the flattened logits per chunk; None: :func:`default_chunk_rows`.

    Returns:
        the loss, a scalar of the chunk's compute dtype (fp32 for fp32, bf16 or fp16
        logits), the same on every rank of ``group``. Its backward must run once (the
        saved gradient is scaled in place).

    >>> logits = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    >>> loss = cross_entropy(logits, torch.tensor([0, 5, -100, 2]))
    >>> loss.dtype
    torch.float32
    >>> loss.backward()
    >>> logits.grad.dtype, logits.grad[2].abs().sum().item()
    (torch.bfloat16, 0.0)
    """
    _check_args(logits, target, reduction, chunk_rows)
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(logits.shape[-1])
    out: torch.Tensor = _ChunkedCrossEntropy.apply(logits, target, group, ignore_index,
                                                   reduction, rows)
    return out


def _sharded(group: Any) -> bool:
    return group is not None and C.group_size(group) > 1


def _check_mode(mode: str, group: Any, primitive: str) -> None:
    if mode not in LOSSES:
        raise LossError(f"unknown loss mode {mode!r}", primitive=primitive,
                        values={"mode": mode, "losses": list(LOSSES)},
                        fix=f"{primitive}('chunked', ...), 'parallel' or 'full'")
    if mode == "full" and _sharded(group):
        raise LossError("loss 'full' computes from whole-vocabulary logits; it cannot take a "
                        "group the vocabulary is split over", primitive=primitive,
                        values={"mode": mode, "group_size": C.group_size(group)},
                        fix=f"{primitive}('chunked', group) or {primitive}('parallel', group); "
                        "or loss 'full' without a group")


def _loss(mode: str, logits: torch.Tensor, target: torch.Tensor, group: Any,
          ignore_index: int, reduction: str, chunk_rows: int | None) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V_local) against ``target`` (...) by ``mode``
    (chunked or parallel)."""
    if mode == "parallel":
        # torchtitan's loss parallel: fp32 logits, one softmax of them saved for backward.
        if not _sharded(group):  # whole logits (vocab_parallel's None is the world)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   target.reshape(-1), ignore_index=ignore_index,
                                   reduction=reduction)
        out: torch.Tensor = vocab_parallel_cross_entropy(
            logits.float(), target, group, ignore_index=ignore_index, reduction=reduction)
        return out
    return cross_entropy(logits, target, group=group, ignore_index=ignore_index,
                         reduction=reduction, chunk_rows=chunk_rows)


@dataclass
class CausalLMLoss:
    """A drop-in for a transformers model's ``loss_function`` (``ForCausalLMLoss``): the
    labels shifted left by one (or ``shift_labels`` as given), ``ignore_index`` targets
    left out, the mean over the targets kept, or the sum divided by
    ``num_items_in_batch`` when it is given; computed by ``mode``.

    Attributes:
        mode: ``"chunked"`` (:func:`cross_entropy`), ``"parallel"``
            (:func:`~torchloom.ops.vocab_parallel.vocab_parallel_cross_entropy`, fp32) or
            ``"full"`` (transformers' ``ForCausalLMLoss`` itself).
        group: the tensor-parallel group the logits' vocabulary is split over, or None
            (whole logits). A copy (``copy.deepcopy``) shares the group; a process group
            does not pickle, so only an instance without one does.
        chunk_rows: rows per chunk of the chunked loss (None: the default).

    >>> import torch
    >>> logits, labels = torch.randn(2, 4, 7), torch.tensor([[1, 2, 3, 4], [5, 6, 0, -100]])
    >>> from transformers.loss.loss_utils import ForCausalLMLoss
    >>> ref = ForCausalLMLoss(logits, labels, vocab_size=7)
    >>> torch.allclose(CausalLMLoss("chunked")(logits, labels, vocab_size=7), ref)
    True
    """

    mode: str
    group: Any = None
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        _check_mode(self.mode, self.group, "CausalLMLoss")

    def __deepcopy__(self, memo: dict[int, Any]) -> CausalLMLoss:
        return CausalLMLoss(self.mode, self.group, self.chunk_rows)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: torch.Tensor | int | None = None,
                 ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        """The loss, as ``ForCausalLMLoss(logits, labels, vocab_size, ...)`` computes it."""
        if self.mode == "full":
            from transformers.loss.loss_utils import ForCausalLMLoss

            full: torch.Tensor = ForCausalLMLoss(
                logits, labels, vocab_size if vocab_size is not None else logits.shape[-1],
                num_items_in_batch=num_items_in_batch,  # type: ignore[arg-type]
                ignore_index=ignore_index,
                shift_labels=shift_labels, **kwargs)
            return full
        world = C.group_size(self.group) if self.group is not None else 1
        if vocab_size is not None and logits.shape[-1] * world != vocab_size:
            raise LossError(
                "the logits' last axis times the group's size is not the vocabulary",
                primitive="CausalLMLoss", values={"logits": tuple(logits.shape),
                                                  "group_size": world, "vocab_size": vocab_size},
                fix="pass the tensor-parallel group the head's output is split over "
                "(set_loss(model, mode, group)), or None for whole logits")
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = _loss(self.mode, logits, shift_labels.reshape(logits.shape[:-1]), self.group,
                     ignore_index, reduction, self.chunk_rows)
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


@dataclass
class NextTokenLoss:
    """The loss a pipeline's last stage computes from its ``(logits, input_ids)``: each
    position predicts the next token, the mean over ``batch x (seq - 1)`` positions (for
    mode ``"full"`` exactly ``torchloom.apps.train``'s historical formula). Made by
    :func:`next_token_loss`; picklable without a group.

    >>> import torch
    >>> logits, ids = torch.randn(2, 5, 9), torch.randint(0, 9, (2, 5))
    >>> torch.allclose(NextTokenLoss("chunked")(logits, ids), NextTokenLoss("full")(logits, ids))
    True
    """

    mode: str
    group: Any = None
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        _check_mode(self.mode, self.group, "next_token_loss")

    def __deepcopy__(self, memo: dict[int, Any]) -> NextTokenLoss:
        return NextTokenLoss(self.mode, self.group, self.chunk_rows)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.mode == "full":
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(),
                                   target[:, 1:].reshape(-1))
        # Shift the targets, not the logits: a slice of the logits would be copied.
        shifted = F.pad(target[:, 1:], (0, 1), value=IGNORE_INDEX)
        return _loss(self.mode, logits, shifted, self.group, IGNORE_INDEX, "mean",
                     self.chunk_rows)


def next_token_loss(mode: str, group: Any = None) -> Callable[[torch.Tensor, torch.Tensor],
                                                              torch.Tensor]:
    """The pipeline's last-stage loss of ``mode`` over logits split along the vocabulary
    over ``group`` (None: whole logits): a :class:`NextTokenLoss`.

    >>> next_token_loss("chunked")
    NextTokenLoss(mode='chunked', group=None, chunk_rows=None)
    """
    return NextTokenLoss(mode, group)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` computes transformers' causal-LM loss through a replaceable
    ``loss_function``: its ``loss_type`` is ``"ForCausalLM"``, or its class (or a base
    class) is one of transformers' causal-LM classes (``GPT2LMHeadModel`` has no
    ``loss_type`` and falls back to the causal-LM loss). Not a masked LM, a classifier
    or a sequence-to-sequence model, whose losses shift nothing or are computed elsewhere.

    >>> import transformers
    >>> is_causal_lm(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1,
    ...     n_embd=8, n_head=2, vocab_size=16))), is_causal_lm(nn.Linear(2, 2))
    (True, False)
    """
    if not isinstance(getattr(type(model), "loss_function", None), property):
        return False
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None:
        return bool(loss_type == "ForCausalLM")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in causal for cls in type(model).__mro__)


def set_loss(model: nn.Module, mode: str, group: Any = None) -> None:
    """Make a transformers model compute its loss by ``mode``: ``model.loss_function =
    CausalLMLoss(mode, group)``, with ``group`` the tensor-parallel group its head's
    output (the logits) is split over along the vocabulary, None when the logits are
    whole. Mode ``"full"`` without such a group leaves the model's own loss (and removes
    a :class:`CausalLMLoss` an earlier call installed).

    >>> from torch import nn
    >>> set_loss(nn.Linear(2, 2), "chunked")
    Traceback (most recent call last):
    ...
    torchloom.core.errors.LossError: set_loss(...): the model has no causal-LM loss_function to replace: Linear computes no transformers next-token loss
        values: model='Linear', mode='chunked', loss_type=None
        fix: set_loss(model, 'full') (keep the model's loss), or compute the loss from the logits: torchloom.ops.loss.cross_entropy(logits, target)
    """
    _check_mode(mode, group, "set_loss")
    if mode == "full" and not _sharded(group):
        if isinstance(model.__dict__.get("_loss_function"), CausalLMLoss):
            del model.__dict__["_loss_function"]
        return
    if not is_causal_lm(model):
        name = type(model).__name__
        raise LossError(
            f"the model has no causal-LM loss_function to replace: {name} computes no "
            "transformers next-token loss",
            primitive="set_loss", values={"model": name, "mode": mode,
                                          "loss_type": getattr(model, "loss_type", None)},
            fix="set_loss(model, 'full') (keep the model's loss), or compute the loss from "
            "the logits: torchloom.ops.loss.cross_entropy(logits, target)")
    model.loss_function = CausalLMLoss(mode, group)  # type: ignore[assignment]
