"""The recipe: recording, printing, JSON, replay, and its errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.helpers import make_explicit_mlp, make_tanh_gelu, make_tanh_gelu_at
from torchloom.core.recipe import RecipeEntry, import_ref, ref_of
from torchloom.tools.testing import verify_recipe_roundtrip


def test_every_primitive_round_trips():
    """One schedule that uses every primitive, through the shared round-trip check."""
    torch.manual_seed(0)
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    sch["transformer.h.1.mlp"].replace_all(nn.Dropout, lambda_free_dropout)
    sch["transformer.h.*.attn.c_attn"].shard("weight", 1)
    sch["transformer.h.*.attn.c_attn"].sync("bwd_post", "all_reduce")
    sch["transformer.h.0.attn.c_attn"].annotate("weight", "colwise", True)
    sch["transformer.h.0.attn"].lora(2, 4, ["c_proj"], init="random")  # peft on a Conv1D
    sch["transformer.h"].checkpoint(ratio=0.5)
    sch["transformer.h.1.attn"].fork_rng()
    sch["transformer.h.1.attn"].divide_attrs(["num_heads", "split_size"])
    sch["transformer.h.0.ln_1"].compile(backend="eager")
    # the static-graph primitives: decompose, trace_until, trace, fuse (a recorded pattern)
    sch["transformer.h.1.mlp.c_fc"].decompose()
    sch["transformer.h.1"].trace_until("mlp")
    sch["transformer.h.1.mlp"].trace(flatten=True)
    sch["transformer.h.1.mlp"].fuse(sch["transformer.h.1.mlp"].find(bias_add)[0],
                                    compiler="eager")
    sch["transformer.h.1.ln_2"].cut_pipeline_stage()  # its parent h.1 is traced
    assert {e.primitive for e in sch.recipe} == set(tl.list_primitives())
    verify_recipe_roundtrip(sch, tiny.gpt2, (torch.randint(0, 128, (2, 8)),))


def lambda_free_dropout(path: str, old: nn.Module) -> nn.Module:
    return nn.Dropout(old.p)


def bias_add(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x + b


def test_printed_recipe_is_the_script_a_user_would_write():
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    sch["transformer.h.1.mlp.c_fc"].annotate("weight", "meta", {"k": (1, 2), "d": torch.float16})
    assert str(sch.recipe) == (
        "import tests.helpers\n"
        "import torch\n"
        "import torchloom\n"
        "\n"
        "sch = torchloom.create_schedule(model)\n"
        "sch['transformer.h.0.mlp'].replace(tests.helpers.make_explicit_mlp)\n"
        "sch['transformer.h.1.mlp.c_fc'].annotate('weight', 'meta', "
        "{'k': (1, 2), 'd': torch.float16})"
    )


def test_json_encodes_data_and_references():
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "info", {"t": (1,), "l": [None, 2.5]})
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    data = json.loads(sch.recipe.to_json())
    assert data["torchloom_recipe"] == 1
    assert data["entries"][0]["args"][2] == {"t": {"__tuple__": [1]}, "l": [None, 2.5]}
    assert data["entries"][1]["args"] == [{"__ref__": "tests.helpers:make_explicit_mlp"}]
    # a reference outside torch / torchloom / transformers resolves only when trusted
    trusted = sch.recipe.references()
    assert trusted == {"tests.helpers:make_explicit_mlp": make_explicit_mlp}
    assert tl.Recipe.from_json(sch.recipe.to_json(), trusted_refs=trusted) == sch.recipe
    with pytest.raises(tl.RecipeError, match="'tests.helpers:make_explicit_mlp' is not trusted"):
        tl.Recipe.from_json(sch.recipe.to_json())


def test_to_json_names_the_line_that_is_not_data():
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "note", 1)
    sch["transformer.h.0.mlp.act"].replace(nn.ReLU())
    with pytest.raises(tl.RecipeError, match=(
            r"recipe line 2 \(replace at 'transformer\.h\.0\.mlp\.act'\) has an argument "
            r"that is not data: a ReLU")) as info:
        sch.recipe.to_json()
    assert str(info.value) == (
        "sch['transformer.h.0.mlp.act'].recipe.to_json(...): recipe line 2 (replace at "
        "'transformer.h.0.mlp.act') has an argument that is not data: a ReLU\n"
        "    values: line=2, argument='ReLU()'\n"
        "    fix: pass a module-level factory function (stored by import path) instead of an "
        "object, e.g. sch[path].replace(mypackage.kernels.make_fused_mlp)"
    )
    # Printing still works and says what to bind.
    text = str(sch.recipe)
    assert "bind UNSERIALISABLE_0 first" in text
    assert "sch['transformer.h.0.mlp.act'].replace(UNSERIALISABLE_0)" in text


def test_lambdas_and_local_functions_are_not_data():
    def local(old):
        return old

    assert ref_of(local) is None
    assert ref_of(lambda old: old) is None
    assert ref_of(make_tanh_gelu) == "tests.helpers:make_tanh_gelu"
    assert ref_of(nn.Linear(1, 1)) is None
    sch = tl.create_schedule(nn.Sequential(nn.Linear(1, 1)))
    sch["0"].replace(local)
    with pytest.raises(tl.RecipeError, match="recipe line 1 .* not data: a function"):
        sch.recipe.to_json()


def test_from_json_rejects_other_text():
    with pytest.raises(tl.RecipeError, match=re.escape("Recipe.from_json(...): not a torchloom recipe")):
        tl.Recipe.from_json("{}")
    with pytest.raises(tl.RecipeError, match="not a torchloom recipe"):
        tl.Recipe.from_json("not json")


def test_import_ref_error():
    with pytest.raises(tl.RecipeError, match=re.escape("cannot import 'tests.helpers:nope'")):
        import_ref("tests.helpers:nope")


def test_recipe_for_another_model_lists_each_failing_line():
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "ok", 1)
    sch["transformer.h.1.attn.c_attn"].shard("weight", 1)
    recipe = tl.Recipe.from_json(sch.recipe.to_json())
    with pytest.raises(tl.RecipeError, match=(
            r"^apply_recipe\(\.\.\.\): 2 of 2 recipe lines failed on this model:")) as info:
        tl.apply_recipe(tiny.bert(), recipe)
    message = str(info.value)
    assert message.startswith("apply_recipe(...): 2 of 2 recipe lines failed on this model:")
    assert "line 1: sch['transformer.h.0.mlp.c_fc'].annotate('weight', 'ok', 1)" in message
    assert "line 2: sch['transformer.h.1.attn.c_attn'].shard('weight', 1)" in message
    assert "no module matches this path (nothing at 'transformer')" in message
    assert "values: model='BertForMaskedLM', failed_lines=2" in message


def test_nested_primitive_calls_record_only_the_outer_call():
    sch = tl.create_schedule(tiny.gpt2())
    sch.replace_all(type(sch.mod.transformer.h[0].mlp.act), make_tanh_gelu_at)
    assert [e.primitive for e in sch.recipe] == ["replace_all"]
    assert sch["transformer.h.0"].recipe is sch.recipe


def test_entry_repr_and_equality():
    a = RecipeEntry("shard", "x", ("weight", 0), {})
    assert a == RecipeEntry("shard", "x", ("weight", 0), {})
    assert a.call_text() == "sch['x'].shard('weight', 0)"
    assert repr(tl.Recipe([a])) == "Recipe(1 entries)"
