"""shard and sync in one process: slicing, metadata, module attributes, hooks, errors.

The multi-process side (real collectives on gloo) is tested separately; here a world of
one is used, and a larger world is faked on a node to exercise the slicing arithmetic.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from torchloom.core.marks import SYNCS, get_mark
from torchloom.tools.testing import verify_recipe_roundtrip


def _fake_world(node: tl.Schedule, world_size: int, rank: int) -> None:
    node.world_size, node.rank = world_size, rank


def test_shard_slices_for_this_rank_and_records_full_shape():
    model = nn.Sequential(nn.Linear(4, 6))
    full = model[0].weight.detach().clone()
    sch = tl.create_schedule(model)
    _fake_world(sch["0"], 2, 1)
    sch["0"].shard("weight", 0)
    assert torch.equal(model[0].weight, full[3:])
    assert model[0].out_features == 3 and model[0].in_features == 4
    assert tl.shard_spec(model[0].weight) == tl.ShardSpec(0, (6, 4), 2, 1)
    assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
    sch["0"].shard("bias", 0)
    assert model[0].bias.shape == (3,)


def test_row_shard_updates_in_features():
    model = nn.Sequential(nn.Linear(4, 6))
    sch = tl.create_schedule(model)
    _fake_world(sch["0"], 2, 0)
    sch["0"].shard("weight", 1)
    assert (model[0].in_features, model[0].out_features) == (2, 6)


def test_embedding_and_conv1d_attributes():
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    for path in ["transformer.wpe", "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]:
        _fake_world(sch[path], 2, 0)
    sch["transformer.wpe"].shard("weight", 1)
    assert model.transformer.wpe.embedding_dim == 16
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)  # Conv1D weight is (in, out)
    assert model.transformer.h[0].mlp.c_fc.nf == 64
    sch["transformer.h.0.mlp.c_proj"].shard("weight", 0)
    assert model.transformer.h[0].mlp.c_proj.nx == 64


def test_shard_of_a_tied_tensor_is_refused_naming_the_tie():
    model = tiny.gpt2()
    full = model.lm_head.weight.detach().clone()
    sch = tl.create_schedule(model)
    _fake_world(sch["lm_head"], 2, 1)
    with pytest.raises(tl.ShardError, match=re.escape(
            "sch['lm_head'].shard(...): 'weight' is tied to 'transformer.wte.weight'")) as info:
        sch["lm_head"].shard("weight", 0)
    assert str(info.value) == (
        "sch['lm_head'].shard(...): 'weight' is tied to 'transformer.wte.weight' (one tensor "
        "used in both places): sharding it here would shard it there too\n"
        "    values: param_name='weight', axis=0, tied_to=['transformer.wte.weight']\n"
        "    fix: shard every use of the tied tensor alike (Megatron's tied embedding and head: "
        "one vocab-parallel table): sch['lm_head'].shard('weight', 0, tied=True); or build "
        "the model untied (transformers: config.tie_word_embeddings = False)")
    # nothing changed: both modules still hold the one full tensor
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, full) and tl.shard_spec(full) is None
    assert len(sch.recipe) == 0


def test_shard_tied_true_shards_every_use_alike_and_says_so_in_the_recipe():
    model = tiny.gpt2()
    full = model.lm_head.weight.detach().clone()
    sch = tl.create_schedule(model)
    _fake_world(sch["lm_head"], 2, 1)
    sch["lm_head"].shard("weight", 0, tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor
    assert torch.equal(model.lm_head.weight, full[64:])  # rank 1's vocabulary rows
    assert tl.shard_spec(model.transformer.wte.weight) == tl.ShardSpec(0, (128, 32), 2, 1)
    assert model.lm_head.out_features == 64 and model.transformer.wte.num_embeddings == 64
    assert "sch['lm_head'].shard('weight', 0, tied=True)" in str(sch.recipe)
    # an untied tensor accepts tied=True (one recipe for tied and untied configs)
    sch["transformer.wpe"].shard("weight", 1, tied=True)
    assert tl.shard_spec(model.transformer.wpe.weight).axis == 1


def test_tied_shard_recipe_round_trips_and_replays():
    sch = tl.create_schedule(tiny.gpt2())
    sch["lm_head"].shard("weight", 0, tied=True)
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "note", 1)
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "note", 2, overwrite=True)
    verify_recipe_roundtrip(sch, tiny.gpt2, (tiny.token_batch()["input_ids"],))


def test_shard_buffer_and_meta_tensor():
    module = nn.BatchNorm1d(4)
    sch = tl.create_schedule(nn.Sequential(module))
    _fake_world(sch["0"], 2, 1)
    sch["0"].shard("running_mean", 0)
    assert module.running_mean.shape == (2,)
    assert tl.shard_spec(module.running_mean).rank == 1
    with torch.device("meta"):
        lin = nn.Linear(8, 8)
    sch = tl.create_schedule(nn.Sequential(lin))
    _fake_world(sch["0"], 4, 3)
    sch["0"].shard("weight", 0)
    assert lin.weight.is_meta and lin.weight.shape == (2, 8)


def test_shard_metadata_survives_replace_and_annotate_order():
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.0.attn.c_attn"].annotate("weight", "colwise", True)
    sch["transformer.h.0.attn.c_attn"].shard("weight", 1)
    weight = model.transformer.h[0].attn.c_attn.weight
    assert weight.colwise is True  # the tag moved to the sliced parameter
    sch["transformer.h.0"].replace(lambda old: old)  # no-op swap keeps everything
    assert tl.shard_spec(model.transformer.h[0].attn.c_attn.weight).full_shape == (32, 96)


def test_shard_errors():
    model = nn.Sequential(nn.Linear(4, 6))
    sch = tl.create_schedule(model)
    with pytest.raises(tl.ShardError, match=re.escape(
            "sch['0'].shard(...): axis 2 is out of range for 'weight' of shape (6, 4)")):
        sch["0"].shard("weight", 2)
    with pytest.raises(tl.PathError, match=re.escape(
            "sch['0'].shard(...): Linear has no parameter or buffer 'wieght'")) as info:
        sch["0"].shard("wieght", 0)
    assert "fix: use one of: 'weight'" in str(info.value)
    _fake_world(sch["0"], 4, 0)
    with pytest.raises(tl.ShardError, match=re.escape(
            "sch['0'].shard(...): size 6 of axis 0 of 'weight' is not divisible by the world "
            "size 4")) as info:
        sch["0"].shard("weight", 0)
    assert str(info.value) == (
        "sch['0'].shard(...): size 6 of axis 0 of 'weight' is not divisible by the world size 4\n"
        "    values: param_name='weight', axis=0, shape=(6, 4), world_size=4\n"
        "    fix: pick an axis whose size divides evenly, pad the tensor (e.g. the vocabulary to "
        "a multiple of 4), or use a world size that divides 6"
    )
    sch["0"].shard("weight", 1)
    with pytest.raises(tl.ShardError, match=r"'weight' is already sharded \(along axis 1\)"):
        sch["0"].shard("weight", 0)
    assert [e.primitive for e in sch.recipe] == ["shard"]


def test_shard_and_sync_recipe_roundtrip():
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.*.mlp.c_fc"].shard("weight", 1)
    sch["transformer.h.*.mlp.c_fc"].shard("bias", 0)
    sch["transformer.h.*.mlp.c_fc"].sync("bwd_post", "all_reduce")
    sch["transformer.h.*.mlp.c_proj"].shard("weight", 0)
    sch["transformer.h.*.mlp.c_proj"].sync("fwd_post", "all_reduce")
    sch["transformer.ln_f"].sync("fwd_pre", "all_gather", axis=1, tensor_parallel_output_grad=False)
    sch["transformer.h.0.ln_1"].sync("fwd_post", record_output_shape)
    verify_recipe_roundtrip(sch, tiny.gpt2, (torch.randint(0, 128, (2, 8)),))


SEEN_SHAPES: list[tuple[int, ...]] = []


def record_output_shape(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    SEEN_SHAPES.append(tuple(output.shape))


def test_sync_world_of_one_keeps_numerics_and_gradients():
    reference = tiny.gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.*.attn.c_attn"].sync("bwd_post", "all_reduce")
    sch["transformer.h.*.attn.c_proj"].sync("fwd_post", "all_reduce")
    sch["transformer.h.*.mlp"].sync("fwd_pre", "scatter", axis=-1)
    sch["transformer.h.*.mlp"].sync("fwd_post", "all_gather", axis=-1)
    batch = tiny.token_batch()
    loss = model(**batch).loss
    loss.backward()
    ref = reference(**batch).loss
    ref.backward()
    assert torch.equal(loss, ref)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_fwd_pre_keeps_every_input_and_fwd_post_handles_containers():
    seen = {}

    class Two(nn.Module):
        def forward(self, x, y, *, scale=1.0, mask=None):
            seen.update(x=x, y=y, scale=scale, mask=mask)
            return (x * scale, y)

    module = Two()
    sch = tl.create_schedule(nn.Sequential(module))
    sch["0"].sync("fwd_pre", "all_reduce")
    sch["0"].sync("fwd_post", "all_reduce")
    x, y, mask = torch.ones(2), torch.zeros(2), torch.ones(1)
    out = module(x, y, scale=3.0, mask=mask)
    assert seen["y"] is y and seen["scale"] == 3.0 and seen["mask"] is mask
    assert isinstance(out, tuple) and torch.equal(out[0], 3 * x) and out[1] is y
    specs = [s.describe() for s in get_mark(module, SYNCS)]
    assert specs == ["fwd_pre all_reduce", "fwd_post all_reduce"]

    gpt = tiny.gpt2()
    sch = tl.create_schedule(gpt)
    SEEN_SHAPES.clear()
    sch["transformer"].sync("fwd_post", "all_reduce")  # a ModelOutput
    sch["transformer.h.0.ln_1"].sync("fwd_post", record_output_shape)
    gpt(torch.randint(0, 128, (2, 5)))
    assert SEEN_SHAPES == [(2, 5, 32)]


def test_sync_errors():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    node = sch["0"]
    with pytest.raises(tl.SyncError, match=re.escape("sch['0'].sync(...): unknown sync mode 'fwd'")):
        node.sync("fwd", "all_reduce")
    with pytest.raises(tl.SyncError, match="unknown sync operation 'allreduce'"):
        node.sync("fwd_post", "allreduce")
    with pytest.raises(tl.SyncError, match=re.escape("unknown sync operation 'RS->XS'")) as info:
        node.sync("fwd_post", "RS->XS")
    assert "a reshard spec such as 'RS->SR'" in str(info.value)
    with pytest.raises(tl.SyncError, match="a reshard spec names its axes itself"):
        node.sync("fwd_post", "RS->SR", axis=1)
    with pytest.raises(tl.SyncError, match="'RS->RR' is not a backward operation"):
        node.sync("bwd_post", "RS->RR")
    with pytest.raises(tl.SyncError, match="'all_gather' needs the activation axis"):
        node.sync("fwd_post", "all_gather")
    with pytest.raises(tl.SyncError, match="'all_reduce' takes no axis"):
        node.sync("fwd_post", "all_reduce", axis=1)
    with pytest.raises(tl.SyncError, match="'scatter' is not a backward operation"):
        node.sync("bwd_post", "scatter", axis=1)
    with pytest.raises(tl.SyncError, match=r"unknown keyword argument\(s\) dim"):
        node.sync("fwd_post", "all_gather", dim=1)
    with pytest.raises(tl.SyncError, match="tensor_parallel_output_grad only applies to 'all_gather'"):
        node.sync("fwd_post", "scatter", axis=1, tensor_parallel_output_grad=False)
    with pytest.raises(tl.SyncError, match="a callable sync takes no keyword arguments"):
        node.sync("fwd_post", record_output_shape, axis=1)
    assert len(sch.recipe) == 0


def _column_row() -> tuple[nn.Module, tl.Schedule]:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    sch = tl.create_schedule(model)
    sch["0"].shard("weight", 0)
    sch["0"].shard("bias", 0)
    sch["1"].shard("weight", 1)
    return model, sch


def test_illegal_syncs_are_refused_at_schedule_time():
    model, sch = _column_row()
    with pytest.raises(tl.SyncError, match=re.escape(
            "sch['0'].sync(...): cannot all_reduce a sharded output")) as info:
        sch["0"].sync("fwd_post", "all_reduce")
    assert str(info.value) == (
        "sch['0'].sync(...): cannot all_reduce a sharded output: each rank holds a different "
        "slice (along axis -1), summing them mixes features\n"
        "    values: op='all_reduce', output='shard(axis=-1)', sharded={'weight': 0, 'bias': 0}\n"
        "    fix: gather it instead: sch['0'].sync('fwd_post', 'all_gather', axis=-1), or shard "
        "the weight along the other axis"
    )
    with pytest.raises(tl.SyncError, match="cannot reduce_scatter a sharded output"):
        sch["0"].sync("fwd_post", "reduce_scatter", axis=1)
    with pytest.raises(tl.SyncError, match=re.escape("the output is sharded along axis -1, not -2")):
        sch["0"].sync("fwd_post", "all_gather", axis=-2)
    with pytest.raises(tl.SyncError, match="cannot scatter an output that is already shard"):
        sch["0"].sync("fwd_post", "scatter", axis=1)
    with pytest.raises(tl.SyncError, match="cannot all_gather a partial output"):
        sch["1"].sync("fwd_post", "all_gather", axis=-1)
    with pytest.raises(tl.SyncError, match="cannot RR->RS an output that is already partial"):
        sch["1"].sync("fwd_post", "RR->RS")
    # The legal ones pass, and the placement survives a replace of the parent.
    sch["0"].sync("fwd_post", "all_gather", axis=-1)
    sch["1"].sync("fwd_post", "all_reduce")
    sch.replace(lambda old: old)
    with pytest.raises(tl.SyncError, match="cannot all_gather a partial output"):
        sch["1"].sync("fwd_post", "all_gather", axis=-1)
    assert [e.primitive for e in sch.recipe] == ["shard"] * 3 + ["sync"] * 2 + ["replace"]


def test_reshard_specs_are_identity_in_a_world_of_one():
    model = nn.Sequential(nn.Identity())
    sch = tl.create_schedule(model)
    for spec in ["RR->RS", "RS->RR", "RS->SR", "SR->RS", "RR->SR", "SR->RR"]:
        sch["0"].sync("fwd_post", spec)
    x = torch.randn(2, 4, 6, requires_grad=True)
    model(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_input_name_finds_the_input_by_position_or_keyword():
    seen = []

    class Attn(nn.Module):
        def forward(self, hidden_states, mask=None):
            return hidden_states

    module = Attn()
    sch = tl.create_schedule(nn.Sequential(module))
    sch["0"].sync("fwd_pre", lambda m, a, k: seen.append((len(a), sorted(k))))
    sch["0"].sync("bwd_post", "all_reduce", input_name="hidden_states")
    x = torch.ones(2)
    assert module(x) is not None and module(hidden_states=x, mask=None) is not None
    with pytest.raises(tl.SyncError, match=re.escape(
            "sch['0'].sync(...): the forward call passed no tensor as 'hidden_states'")):
        module(None)
    with pytest.raises(tl.SyncError, match="Attn.forward has no input named 'x'"):
        sch["0"].sync("fwd_pre", "all_reduce", input_name="x")


def test_param_grad_needs_replicated_parameters():
    model, sch = _column_row()
    sch["1"].sync("param_grad", "all_reduce")  # the unsharded bias of the row-parallel linear
    with pytest.raises(tl.SyncError, match="Linear has no replicated parameters of its own"):
        sch["0"].sync("param_grad", "all_reduce")
    with pytest.raises(tl.SyncError, match="'all_gather' is not a backward operation"):
        sch["1"].sync("param_grad", "all_gather", axis=1)


def test_conv2d_batchnorm_layernorm_attributes():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.LayerNorm((5, 8)), nn.Conv2d(8, 4, 1))
    sch = tl.create_schedule(model)
    for path in ["0", "1", "2", "3"]:
        _fake_world(sch[path], 2, 0)
    sch["0"].shard("weight", 0)
    sch["1"].shard("weight", 0)
    sch["2"].shard("weight", 1)
    sch["3"].shard("weight", 1)
    assert (model[0].out_channels, model[0].in_channels) == (4, 4)
    assert model[1].num_features == 4
    assert model[2].normalized_shape == (5, 4)
    assert (model[3].in_channels, model[3].out_channels) == (4, 4)
    from torchloom.core.placement import Placement, output_placement
    assert output_placement(model[0]) == Placement.shard(1)
    assert output_placement(model[3]) == Placement.partial()
