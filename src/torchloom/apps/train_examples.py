"""What ``torchloom train`` adds for instruction and chat examples and for watching a
fine-tune: :class:`CountedLoss` (a pipeline's loss over the step's response tokens) and
:func:`sample_answer` (the model's answer to a prompt, in the middle of training, on any
layout but a pipeline).

>>> import torch
>>> loss = CountedLoss(lambda logits, target: torch.tensor(2.0))
>>> loss.per_micro = torch.tensor(4.0)
>>> float(loss(torch.zeros(1, 3, 5), torch.tensor([[-100, 1, 2]])))   # 2.0 x 2 tokens / 4
1.0
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..core.outputs import no_cache_kwargs
from ..runtime.collectives import guard_collective
from . import data
from .jobconfig import TrainConfig

__all__ = ["CountedLoss", "pipeline_loss_sum", "sample_answer"]

_PRIMITIVE = "torchloom train"


class CountedLoss:
    """A pipeline's last-stage loss for examples: ``loss_fn``'s mean over a micro-batch's
    response tokens, times their number, over ``per_micro`` (set each step)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.per_micro: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        counted = (target[:, 1:] != -100).sum()
        mean = self.loss_fn(logits, target)
        assert self.per_micro is not None
        if int(counted) == 0:
            return mean.nan_to_num() * 0  # no response token here: nothing to learn
        return mean * counted / self.per_micro




@torch.no_grad()
def sample_answer(model: Any, built: Any, cfg: TrainConfig, tokenizer_folder: str | None,
                  device: torch.device) -> str:
    """The greedy answer of ``model`` (what a step calls, built by
    :func:`~torchloom.parallelize`) to ``cfg.sample_prompt``, rendered with the tokenizer's
    chat template (bytes without a tokenizer). Every rank runs the forwards
    (tensor-parallel and FSDP2 ranks need each other); logits split along the vocabulary
    are gathered over ``built.loss_group``."""
    from .generate import decode, generate_ids, render_prompt

    tokenizer = data.load_tokenizer(tokenizer_folder) if tokenizer_folder else None
    ids = render_prompt(tokenizer, cfg.sample_prompt).to(device)

    def logits_fn(x: torch.Tensor) -> torch.Tensor:
        with built.autocast(device.type):
            logits = model(input_ids=x, **no_cache_kwargs(model)).logits
        group = built.loss_group
        if group is not None:  # this rank's columns of the vocabulary
            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
            with guard_collective("all_gather", _PRIMITIVE, group):
                dist.all_gather(parts, logits.contiguous(), group=group)
            logits = torch.cat(parts, dim=-1)
        return logits.float()

    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    model.eval()
    try:
        new = generate_ids(logits_fn, ids, max_new_tokens=cfg.sample_tokens, eos_id=eos)
    finally:
        model.train()
    return decode(tokenizer, new)


@torch.no_grad()
def pipeline_loss_sum(pipe: Any, built: Any, batch: dict[str, torch.Tensor]
                      ) -> torch.Tensor | None:
    """A pipeline's evaluation loss of examples, summed over this rank's response tokens
    of ``batch``: on the rank of the last stage (None on the others)."""
    logits = pipe(batch["input_ids"])
    if logits is None:
        return None
    labels = batch["labels"]
    mean = built.next_token_loss(logits, labels).detach().nan_to_num()
    return mean * (labels[:, 1:] != -100).sum()
