"""The schedule tree: addressing, wildcards, containers, and path errors."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from torchloom.core.marks import SYNCS, get_mark, has_mark


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
        with pytest.raises(tl.PathError,
                           match=re.escape(f"sch[{path!r}]: no module matches this path")):
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
    with pytest.raises(tl.PathError, match=re.escape(
            "sch['transformer.h.0.atn']: no module matches this path "
            "(nothing at 'transformer.h.0.atn')")) as info:
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


# --------------------------------------------------------------------------- misuse


def _built_mlp() -> tuple[tl.Schedule, nn.Module]:
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
    sch = tl.create_schedule(model)
    sch["0"].annotate("weight", "tag", 1)
    assert not sch.built
    tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return sch, model


# Arguments that would be valid before build for each primitive (the refusal comes first).
_CALLS = {
    "annotate": ("0", ("weight", "other", 2), {}),
    "checkpoint": ("2", (), {}),
    "compile": ("2", ("eager",), {}),
    "cut_pipeline_stage": ("0", (), {}),
    "decompose": ("0", (), {}),
    "divide_attrs": ("0", ("in_features",), {}),
    "fork_rng": ("1", (), {}),
    "fuse": ("", ([],), {}),
    "lora": ("", (2, 4, ["0"]), {}),
    "replace": ("1", (nn.ReLU(),), {}),
    "replace_all": ("", (nn.GELU, lambda path, old: nn.ReLU()), {}),
    "shard": ("0", ("weight", 0), {}),
    "sync": ("0", ("bwd_post", "all_reduce"), {}),
    "trace": ("", (), {}),
    "trace_until": ("", ("1",), {}),
}


def test_every_primitive_is_refused_on_a_built_schedule():
    assert set(_CALLS) == set(tl.list_primitives())
    for name, (path, args, kwargs) in _CALLS.items():
        sch, model = _built_mlp()
        assert sch.built and sch["0"].built
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(tl.ScheduleError, match=re.escape(
                f"sch[{path!r}].{name}(...): this schedule was already built; {name} after "
                "build would not reach the model build returned")) as info:
            getattr(sch[path], name)(*args, **kwargs)
        assert "fix: apply every primitive before torchloom.build(sch)" in str(info.value)
        assert [e.primitive for e in sch.recipe] == ["annotate"], name  # nothing recorded
        assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Linear"], name
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), name
        assert not has_mark(model[0], SYNCS), name
    # reading a built schedule is fine
    assert "0" in sch and sch["0"].mod is model[0] and "annotate('weight', 'tag', 1)" in str(sch)


def test_a_built_schedule_replayed_on_a_fresh_model_takes_primitives_again():
    sch, _ = _built_mlp()
    fresh = tl.apply_recipe(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)),
                            sch.recipe)
    assert not fresh.built
    fresh["2"].checkpoint()
    assert [e.primitive for e in fresh.recipe] == ["annotate", "checkpoint"]


def test_the_same_sync_twice_is_refused_and_a_different_input_is_not():
    model = nn.Sequential(nn.Linear(4, 4))
    sch = tl.create_schedule(model)
    sch["0"].sync("bwd_post", "all_reduce")
    with pytest.raises(tl.SyncError, match=re.escape(
            "sch['0'].sync(...): Linear already has this sync (bwd_post all_reduce)")):
        sch["0"].sync("bwd_post", "all_reduce")
    assert [s.describe() for s in get_mark(model[0], SYNCS)] == ["bwd_post all_reduce"]
    assert len(model[0]._forward_pre_hooks) == 1  # the second was never installed
    # another mode, or another named input of the same module, is a different sync
    sch["0"].sync("fwd_post", "all_reduce")
    sch["0"].sync("bwd_post", "all_reduce", input_name="input")
    with pytest.raises(tl.SyncError, match=r"(?s)already has this sync \(bwd_post all_reduce\).*"
                       r"input_name='input'"):
        sch["0"].sync("bwd_post", "all_reduce", input_name="input")
    # user hooks are not compared: two may be meant
    sch["0"].sync("fwd_post", lambda m, a, o: None)
    sch["0"].sync("fwd_post", lambda m, a, o: None)
    assert len(sch.recipe) == 5


def test_replace_all_takes_a_one_argument_factory_too():
    def one(old: nn.Module) -> nn.Module:
        return nn.Tanh()

    seen: list[str] = []

    def two(path: str, old: nn.Module) -> nn.Module:
        seen.append(path)
        return nn.ReLU()

    model = nn.Sequential(nn.GELU(), nn.Sequential(nn.GELU()), nn.SiLU())
    sch = tl.create_schedule(model)
    sch.replace_all(nn.GELU, one)
    assert [type(m).__name__ for m in model.modules()] == \
        ["Sequential", "Tanh", "Sequential", "Tanh", "SiLU"]
    sch.replace_all(nn.Tanh, two)
    assert seen == ["0", "1.0"]
    assert torch.equal(model(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0 * torch.sigmoid(
        torch.tensor(2.0)).item()]))
    # a factory that fits neither form is refused before anything is replaced
    with pytest.raises(tl.ReplaceError, match=re.escape("make_mod_fn takes (a, b, c)")):
        sch.replace_all(nn.SiLU, lambda a, b, c: nn.ReLU())
    assert isinstance(model[2], nn.SiLU)


def test_annotate_refuses_to_overwrite_a_tag_with_another_value():
    model = nn.Sequential(nn.Linear(2, 2))
    sch = tl.create_schedule(model)
    sch["0"].annotate("weight", "placement", "colwise")
    sch["0"].annotate("weight", "placement", "colwise")  # the same value changes nothing
    with pytest.raises(tl.AnnotateError, match=r"'weight' already has the tag 'placement' with "
                       r"another value\n    values: .*old=\"'colwise'\", new=\"'rowwise'\""):
        sch["0"].annotate("weight", "placement", "rowwise")
    assert model[0].weight.placement == "colwise" and tl.get_meta(model[0].weight).tags == {
        "placement": "colwise"}
    with pytest.raises(tl.AnnotateError, match="another value"):  # 1 and True differ in type
        sch["0"].annotate("weight", "flag", 1) or sch["0"].annotate("weight", "flag", True)
    # an attribute set on the tensor by other code is protected too
    model[0].bias.sequence_parallel = True
    with pytest.raises(tl.AnnotateError, match="'bias' already has the tag 'sequence_parallel'"):
        sch["0"].annotate("bias", "sequence_parallel", False)
    sch["0"].annotate("weight", "placement", "rowwise", overwrite=True)
    sch["*"].annotate("bias", "sequence_parallel", False, overwrite=True)
    assert model[0].weight.placement == "rowwise" and model[0].bias.sequence_parallel is False
    assert str(sch.recipe).endswith(
        "sch['0'].annotate('weight', 'placement', 'rowwise', overwrite=True)\n"
        "sch['0'].annotate('bias', 'sequence_parallel', False, overwrite=True)")
