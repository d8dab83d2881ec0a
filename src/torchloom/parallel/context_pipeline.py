"""Context parallelism inside a pipeline: what :func:`torchloom.parallelize` adds to a
pipeline whose layout has ``cp > 1``.

Outside a pipeline the ``context_parallel`` primitive's input hook takes this rank's
positions of every sequence and its output hook sums the loss over the group. A pipeline
runs the model's traced stages instead, so the same two steps move to its two ends:

* **inputs** (:class:`ContextParallelPipeline`): ``step(ids, target=ids)`` and
  ``pipe(ids)`` take the whole sequences, as without context parallelism; the first stage
  is given this rank's positions of them (chunks ``r`` and ``2 cp - 1 - r``,
  :func:`~torchloom.ops.context_parallel.shard_index`) and, by keyword, their true
  ``position_ids`` (the model was traced with both, so its rotary embeddings see each
  token's place; a pipeline's positional inputs must be tensors, and the models put
  ``attention_mask`` between the two);
* **loss** (:class:`ContextParallelLoss`, the last stage's): the targets are shifted over
  the whole sequence first (a chunk's last next-token lives on another rank), then this
  rank's positions are taken; the sum of this rank's token losses over the number of
  targets of the whole sequence, summed over the group (forward and backward, as the
  primitive's loss: each rank's gradient is ``cp`` times its own share, and the
  data-parallel x context-parallel average makes it the single-process gradient).

>>> import torch
>>> from torchloom.runtime.context_attention import CPState
>>> ids, pos = local_inputs(torch.arange(8).view(1, 8), CPState(group=None, size=2, rank=1))
>>> ids.tolist(), pos.tolist()
([[2, 3, 4, 5]], [[2, 3, 4, 5]])
>>> loss = ContextParallelLoss("full", None, CPState(group=None, size=1, rank=0))
>>> logits, target = torch.randn(2, 6, 5), torch.randint(0, 5, (2, 6))
>>> reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 5),
...                                               target[:, 1:].reshape(-1))
>>> torch.allclose(loss(logits, target), reference)
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.loss import IGNORE_INDEX, _loss
from ..runtime import collectives as C
from ..runtime.context_attention import CPState, shard_index

__all__ = ["ContextParallelLoss", "ContextParallelPipeline", "local_inputs"]


def local_inputs(ids: torch.Tensor, state: CPState) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions of ``ids`` (batch x sequence) and their position ids."""
    batch, seq = ids.shape[0], ids.shape[1]
    index = shard_index(seq, state.size, state.rank, ids.device)
    positions = torch.arange(seq, device=ids.device).expand(batch, seq)
    return ids.index_select(1, index), positions.index_select(1, index).contiguous()


class ContextParallelLoss:
    """The next-token loss of a context-parallel pipeline's last stage (see the module
    docstring); ``mode`` and ``group`` as :func:`torchloom.ops.loss.next_token_loss`'s
    (``group``: the logits' vocabulary split)."""

    def __init__(self, mode: str, group: Any, state: CPState) -> None:
        self.mode, self.group, self.state = mode, group, state

    def __repr__(self) -> str:
        return (f"ContextParallelLoss(mode={self.mode!r}, cp={self.state.size}, "
                f"rank={self.state.rank})")

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        state = self.state
        shifted = F.pad(target[:, 1:], (0, 1), value=IGNORE_INDEX)
        local = shifted.index_select(1, shard_index(shifted.shape[1], state.size, state.rank,
                                                    shifted.device))
        count = (shifted != IGNORE_INDEX).sum().clamp_min(1)
        if self.mode == "full":
            total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    local.reshape(-1), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
        else:
            total = _loss(self.mode, logits, local, self.group, IGNORE_INDEX, "sum", None)
        loss = total / count
        if state.size == 1:
            return loss
        return C.copy_to_group(C.all_reduce(loss, state.group), state.group)


class ContextParallelPipeline(nn.Module):
    """A pipeline (:class:`~torchloom.runtime.pipeline.PipelineModel`) that takes whole
    sequences: ``step(ids, target=...)`` and ``pipe(ids)`` hand its first stage this
    rank's positions and their position ids (see the module docstring). Its parameters,
    state dict (under ``pipe.``) and modes are the pipeline's; save the pipeline itself
    (:attr:`pipe`)."""

    def __init__(self, pipe: nn.Module, state: CPState) -> None:
        super().__init__()
        self.pipe = pipe
        self.state = state

    def step(self, ids: torch.Tensor, target: torch.Tensor | None = None) -> Any:
        local, positions = local_inputs(ids, self.state)
        return self.pipe.step(local, target=target,  # type: ignore[operator]
                              position_ids=positions)

    def forward(self, ids: torch.Tensor) -> Any:
        local, positions = local_inputs(ids, self.state)
        return self.pipe(local, position_ids=positions)
