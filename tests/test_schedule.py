"""The schedule tree: addressing, wildcards, containers, and path errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny


def test_tree_mirrors_named_children_of_gpt2():
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    assert [p for p, _ in sch.named_schedules()] == [p for p, _ in model.named_modules()]
    assert sch["transformer.h.0.attn"].mod is model.transformer.h[0].attn
    assert sch["transformer.h"].mod is model.transformer.h
    node = sch["transformer.h.1.mlp.c_fc"]
    assert node.path == "transformer.h.1.mlp.c_fc"
    assert node.name == "c_fc"
    assert node.parent.path == "transformer.h.1.mlp"
    assert node.root is sch
    assert sch["transformer"]["h.1"] is sch["transformer.h.1"]
    assert sch[""] is sch


def test_sequential_items_and_contains_agree_with_getitem():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    sch = tl.create_schedule(model)
    for path in ["0", "1", "1.0", "1.1"]:
        assert path in sch
        assert sch[path].mod is model.get_submodule(path)
    for path in ["2", "1.2", "0.0", "x", "1..0"]:
        assert path not in sch
        with pytest.raises(tl.PathError):
            sch[path]
    assert 3 not in sch


def test_builtin_container_children_are_addressable():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    sch = tl.create_schedule(Net())
    assert sch["attn.out_proj"].mod is sch.mod.attn.out_proj
    sch["attn.out_proj"].annotate("weight", "note", 1)
    assert sch.mod.attn.out_proj.weight.note == 1


def test_same_module_in_two_slots_gets_two_nodes():
    layer = nn.Linear(2, 2)
    sch = tl.create_schedule(nn.ModuleList([layer, layer]))
    assert sch["0"].mod is sch["1"].mod is layer


def test_wildcards_return_groups_in_tree_order():
    sch = tl.create_schedule(tiny.gpt2(n_layer=3))
    group = sch["transformer.h.*.mlp"]
    assert isinstance(group, tl.ScheduleGroup)
    assert group.paths == [f"transformer.h.{i}.mlp" for i in range(3)]
    assert sch["transformer.h.[12].attn"].paths == ["transformer.h.1.attn", "transformer.h.2.attn"]
    assert sch["transformer.h.*"]["mlp.c_fc"].paths == [
        f"transformer.h.{i}.mlp.c_fc" for i in range(3)
    ]
    assert len(sch["transformer.h.*.*"]) == 3 * 4  # ln_1, attn, ln_2, mlp per block


def test_group_applies_primitive_to_every_match_and_records_each():
    model = tiny.gpt2(n_layer=3)
    sch = tl.create_schedule(model)
    sch["transformer.h.*.mlp.c_fc"].annotate("weight", "colwise", True)
    assert all(block.mlp.c_fc.weight.colwise for block in model.transformer.h)
    assert [e.path for e in sch.recipe] == [f"transformer.h.{i}.mlp.c_fc" for i in range(3)]


def test_group_replace_needs_a_factory():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.ScheduleError, match="a group replace needs a factory"):
        sch["transformer.h.*.mlp.act"].replace(nn.ReLU())


def test_missing_path_lists_nearest_paths():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.PathError) as info:
        sch["transformer.h.0.atn"]
    message = str(info.value)
    assert message.startswith("sch['transformer.h.0.atn']: no module matches this path "
                              "(nothing at 'transformer.h.0.atn')")
    assert "'transformer.h.0.attn'" in message
    assert "fix: use one of the nearest paths; print(sch) shows the whole tree" in message
    assert info.value.path == "transformer.h.0.atn"


def test_missing_path_below_a_child_reports_full_path():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.PathError, match=re.escape("sch['transformer.h.7']: no module matches")):
        sch["transformer"]["h.7"]


def test_wildcard_matching_nothing_raises():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.PathError, match=re.escape("(nothing at 'transformer.h.*.mlpx')")):
        sch["transformer.h.*.mlpx"]


def test_non_string_path_raises():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.PathError, match="a schedule path is a dotted string, not a int"):
        sch[0]


def test_schedule_of_non_module_raises():
    with pytest.raises(tl.ScheduleError, match="a schedule is made of an nn.Module, not a dict"):
        tl.create_schedule({})


def test_get_module_and_its_error():
    sch = tl.create_schedule(tiny.gpt2())
    assert sch["transformer.h.0"].get_module("attn.c_attn") is sch.mod.transformer.h[0].attn.c_attn
    with pytest.raises(tl.PathError, match=r"module GPT2Block has no sub-module 'atn.c_attn'"):
        sch["transformer.h.0"].get_module("atn.c_attn")


def test_world_of_one_without_distributed():
    sch = tl.create_schedule(nn.Linear(2, 2))
    assert (sch.world_size, sch.rank, sch.group) == (1, 0, None)


def test_list_primitives():
    names = tl.list_primitives()
    assert {"replace", "replace_all", "shard", "sync", "checkpoint", "annotate",
            "fork_rng"} <= set(names)
    funcs = tl.list_primitives(name_only=False)
    assert all(callable(f) for f in funcs.values())
    for name in names:
        assert callable(getattr(tl.Schedule, name)), name
        assert getattr(tl.Schedule, name).__doc__, name


def test_primitive_methods_are_typed():
    import inspect

    for name in tl.list_primitives():
        sig = inspect.signature(getattr(tl.Schedule, name))
        for param in list(sig.parameters.values())[1:]:
            if param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                assert param.annotation is not inspect.Parameter.empty, (name, param.name)


def test_tensor_forward_unchanged_by_making_a_schedule():
    model = tiny.gpt2()
    ids = torch.randint(0, 128, (2, 8))
    before = model(ids).logits
    tl.create_schedule(model)
    assert torch.equal(model(ids).logits, before)
