"""build from meta never holds the whole model: allocator accounting on a small Llama.

A rank of a tensor-parallel Llama (built-in TP schedule, rank 1 of a fake process group of
4 in this process) is built from meta while a dispatch mode counts the bytes of every
real tensor storage that build allocates and that is still alive (a weak-reference
finaliser per storage, as :class:`torchloom.tune.LiveBytes` does; meta storages, which
hold no memory, are not counted). The peak must stay within the rank's own shard plus
the full-size tensors of the largest module (what one init call may need at once), for
the default init, ``init="local"`` and ``weights=``; the whole model is larger than that
bound, so a build that materialised everything full-size (as build did before) fails.
The real-size figures (RssAnon) are in ``benchmarks/scale_bench.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchloom as tl
from torchloom import schedules
from torchloom.runtime.memory import LiveBytes

WORLD, RANK = 4, 1
SLACK = 4096  # rotary buffers and other small temporaries


class RealLiveBytes(LiveBytes):
    """Live bytes of real (non-meta) storages."""

    def track(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            super().track(tensor)


def config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    vocab_size=512, max_position_embeddings=64)


def scheduled() -> tuple[nn.Module, tl.Schedule]:
    with tl.init_empty_weights():
        model = transformers.LlamaForCausalLM(config())
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True)
    return model, sch


def full_bytes(t: torch.Tensor) -> int:
    spec = tl.shard_spec(t)
    shape = spec.full_shape if spec is not None else tuple(t.shape)
    return torch.Size(shape).numel() * t.dtype.itemsize


def bound_of(model: nn.Module) -> tuple[int, int]:
    """(largest module's own tensors at full size, the whole model at full size)."""
    largest = 0
    for module in model.modules():
        own = {id(t): t for t in [*module._parameters.values(), *module._buffers.values()]
               if t is not None}
        largest = max(largest, sum(full_bytes(t) for t in own.values()))
    whole = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return largest, sum(full_bytes(t) for t in whole.values())


def local_bytes(model: nn.Module) -> int:
    return sum(t.nbytes for t in {id(t): t for t in [*model.parameters(),
                                                     *model.buffers()]}.values())


@pytest.mark.parametrize("mode", ["full", "local", "weights"])
def test_build_peak_is_the_shard_plus_one_module(mode, tmp_path):
    kw: dict[str, Any] = {}
    if mode == "local":
        kw["init"] = "local"
    if mode == "weights":  # written before the group starts: save_pretrained saves on rank 0
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config()).save_pretrained(tmp_path, max_shard_size="64KB")
        kw["weights"] = str(tmp_path)
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    try:
        model, sch = scheduled()
        largest, whole = bound_of(model)
        live = RealLiveBytes()
        torch.manual_seed(0)
        with live:
            tl.build(sch, **kw)
    finally:
        dist.destroy_process_group()
    shard = local_bytes(model)
    bound = shard + largest + SLACK
    assert whole > bound  # holding the whole model at full size would fail this test
    assert live.peak <= bound, (live.peak, shard, largest)
    assert live.peak >= shard  # the accounting saw the shard being made
    assert not any(t.is_meta for t in model.parameters())
