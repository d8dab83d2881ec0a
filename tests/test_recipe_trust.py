"""A recipe read from text is data: it never imports, evaluates or runs code unless trusted.

The payloads here are the ones that ran code before recipes were validated: a dunder
primitive that rebinds a method to ``os.system``, a ``__ref__`` that imports a module
written next to the recipe, a printed recipe that ``verify_recipe_roundtrip`` executed.
Each test would create its marker file on that code.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.helpers import make_explicit_mlp
from torchloom.core.meta import has_meta
from torchloom.core.recipe import MAX_DEPTH, RecipeEntry, resolve_ref
from torchloom.tools.testing import verify_recipe_roundtrip


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))


def _text(*entries: dict) -> str:
    return json.dumps({"torchloom_recipe": 1, "entries": list(entries)})


def _payload(marker: Path) -> str:
    """Rebind the root's ``shard`` to os.system, then call it with a shell command."""
    return _text(
        {"primitive": "__setattr__", "path": "", "args": ["shard", {"__ref__": "os:system"}]},
        {"primitive": "shard", "path": "", "args": [f"touch {marker}"]},
    )


def test_a_crafted_recipe_runs_no_shell_command(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    text = _payload(marker)
    with pytest.raises(tl.RecipeError, match=re.escape(
            "Recipe.from_json(...): recipe line 1: unknown primitive '__setattr__'")):
        tl.Recipe.from_json(text)
    with pytest.raises(tl.RecipeError, match="recipe line 1: unknown primitive '__setattr__'"):
        tl.apply_recipe(_mlp(), text, trust_code=True)  # not even trusted code may do it
    # the reference alone, on a real primitive's line, is refused too
    ref_only = _text({"primitive": "annotate", "path": "0",
                      "args": ["weight", "cmd", {"__ref__": "os:system"}]})
    with pytest.raises(tl.RecipeError, match=(
            r"recipe line 1: the reference 'os:system' is not trusted: its module 'os' is "
            r"outside torch, torchloom and transformers")) as info:
        tl.apply_recipe(_mlp(), ref_only)
    assert str(info.value).splitlines()[0] == (
        "Recipe.from_json(...): recipe line 1: the reference 'os:system' is not trusted: its "
        "module 'os' is outside torch, torchloom and transformers, and a recipe imports "
        "nothing else")
    assert "fix: if you trust it, pass the object: Recipe.from_json(text, trusted_refs=" \
        "{'os:system': <the object>})" in str(info.value)
    assert not marker.exists()


def test_an_in_memory_recipe_cannot_hold_a_dunder_call(tmp_path: Path) -> None:
    import os

    with pytest.raises(tl.RecipeError, match=r"(?s)RecipeEntry\(\.\.\.\): unknown primitive "
                       r"'__setattr__'.*fix: use one of the primitives: annotate, checkpoint"):
        RecipeEntry("__setattr__", "", ("shard", os.system))
    recipe = tl.Recipe([RecipeEntry("annotate", "0", ("weight", "k", 1))])
    recipe.entries.append(("__setattr__", "", ("shard", os.system)))  # type: ignore[arg-type]
    model = _mlp()
    with pytest.raises(tl.RecipeError, match=r"recipe line 2: a recipe holds RecipeEntry "
                       r"objects, not a tuple"):
        tl.apply_recipe(model, recipe)
    assert not has_meta(model[0].weight)  # checked before line 1 was applied


def test_a_reference_to_an_untrusted_module_never_imports_it(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "IMPORTED"
    for name in ("evil_kernels_xyz", "torchloom_evil_xyz"):  # the second only looks allowed
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r})\n"
            "def make(old):\n    return old\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("evil_kernels_xyz", "torchloom_evil_xyz"):
        text = _text({"primitive": "replace", "path": "1", "args": [{"__ref__": f"{name}:make"}]})
        with pytest.raises(tl.RecipeError, match=re.escape(
                f"recipe line 1: the reference '{name}:make' is not trusted")):
            tl.Recipe.from_json(text)
        with pytest.raises(tl.RecipeError, match="is not trusted"):
            tl.apply_recipe(_mlp(), text)
        assert not marker.exists() and name not in sys.modules
    # trusting the file is explicit, and then its module is imported
    try:
        recipe = tl.Recipe.from_json(text, trust_code=True)
        assert marker.read_text() == "torchloom_evil_xyz"
        assert recipe[0].args[0] is sys.modules["torchloom_evil_xyz"].make
    finally:
        sys.modules.pop("torchloom_evil_xyz", None)


@pytest.mark.parametrize("ref, needle", [
    ("torch.serialization:os.system", "goes through 'os', a module"),
    ("torch.nn.modules.linear:Linear.__init__", "must be 'package.module:Name'"),
    ("torchloom.core.recipe:_loaded", "names a private attribute '_loaded'"),
    ("torchloom.core.recipe:MAX_DEPTH", "it resolves to a int, not a class or function"),
    ("torch.serialization:closing", "it names a class of 'contextlib', which is not on the "
     "schedule allow-list"),
    ("transformers:is_torch_available", "it names a function of 'transformers.utils.import_utils'"
     ", which is not on the schedule allow-list"),
    ("os:system; rm -rf /", "must be 'package.module:Name'"),
    ("torch.utils.model_dump.__main__:main", "(no dunder names)"),  # its import runs main()
    ("torch.no_such_module_xyz:f", "cannot import module 'torch.no_such_module_xyz'"),
])
def test_allowed_packages_are_matched_by_module_and_by_object(ref: str, needle: str) -> None:
    with pytest.raises(tl.RecipeError, match=re.escape(needle)):
        resolve_ref(ref)


def test_what_is_trusted_by_default() -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.pytorch_utils import Conv1D

    from torchloom.schedules.opt import heads_per_rank

    assert resolve_ref("torch.nn.modules.linear:Linear") is nn.Linear
    assert resolve_ref("torch.nn:GELU") is nn.GELU
    assert resolve_ref("torch._C._nn:gelu") is torch.nn.functional.gelu
    assert resolve_ref("torchloom.schedules.opt:heads_per_rank") is heads_per_rank
    assert resolve_ref("transformers.pytorch_utils:Conv1D") is Conv1D
    assert resolve_ref("transformers.models.gpt2.modeling_gpt2:GPT2Attention") is GPT2Attention


def test_trusted_refs_let_a_recipe_name_the_callers_functions() -> None:
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0.mlp"].replace(make_explicit_mlp)
    text = sch.recipe.to_json()
    with pytest.raises(tl.RecipeError, match="'tests.helpers:make_explicit_mlp' is not "
                       "trusted"):
        tl.apply_recipe(tiny.gpt2(), text)
    trusted = {"tests.helpers:make_explicit_mlp": make_explicit_mlp}
    replayed = tl.apply_recipe(tiny.gpt2(), text, trusted_refs=trusted)
    assert replayed.recipe == sch.recipe
    assert type(replayed.mod.transformer.h[0].mlp) is type(sch.mod.transformer.h[0].mlp)
    # a trusted name maps to the object the caller gives, whatever the text claims
    fake = {"tests.helpers:make_explicit_mlp": make_explicit_mlp}
    assert tl.Recipe.from_json(text, trusted_refs=fake)[0].args[0] is make_explicit_mlp


@pytest.mark.parametrize("entry, needle", [
    ({"primitive": "shard", "path": "0", "args": "weight"},
     "recipe line 1: args of shard must be a list, not a str"),
    ({"primitive": "shard", "path": "0", "args": ["weight", 0], "kwargs": [["chunks", 2]]},
     "recipe line 1: kwargs of shard must be an object (a dict), not a list"),
    ({"primitive": "shard", "path": "0", "args": ["weight", 0], "kwargs": {"__class__": 1}},
     "recipe line 1: '__class__' is not a keyword shard can take"),
    ({"primitive": "shard", "path": 0, "args": ["weight", 0]},
     "recipe line 1: the path must be a string, not a int"),
    ({"primitive": "shardd", "path": "0"}, "recipe line 1: unknown primitive 'shardd'"),
    ({"primitive": "shard", "path": "0", "code": "x"}, "unknown field 'code' in an entry"),
    ({"primitive": "annotate", "path": "0", "args": ["weight", "d", {"__dtype__": "load"}]},
     "recipe line 1: unknown dtype 'load'"),
    ({"primitive": "annotate", "path": "0", "args": ["weight", "d", {"__ref__": 1, "x": 2}]},
     "the special key '__ref__' must be alone in its object"),
])
def test_every_field_and_value_is_validated(entry: dict, needle: str) -> None:
    with pytest.raises(tl.RecipeError, match=re.escape(needle)):
        tl.Recipe.from_json(_text(entry))


def test_a_string_args_is_no_longer_split_into_characters() -> None:
    control = tl.create_schedule(_mlp())
    control["0"].annotate("weight", "k", 1)
    assert has_meta(control.mod[0].weight)  # what an applied line leaves behind
    model = _mlp()
    with pytest.raises(tl.RecipeError, match="args of annotate must be a list, not a str"):
        tl.apply_recipe(model, _text({"primitive": "annotate", "path": "0", "args": "wkv"}))
    assert not has_meta(model[0].weight)


def test_unknown_keywords_and_arguments_are_named_before_anything_runs() -> None:
    model = _mlp()
    text = _text({"primitive": "annotate", "path": "0", "args": ["weight", "ok", 1]},
                 {"primitive": "shard", "path": "0", "args": ["weight", 0],
                  "kwargs": {"chunk": 2}})
    with pytest.raises(tl.RecipeError,
                       match=r"recipe line 2: shard\(\) has no keyword 'chunk'") as info:
        tl.apply_recipe(model, text)
    valid = list(inspect.signature(tl.Schedule.shard).parameters)[1:]
    assert valid[:3] == ["param_name", "axis", "chunks"]
    assert str(info.value) == (
        "apply_recipe(...): recipe line 2: shard() has no keyword 'chunk'\n"
        f"    values: line=2, primitive='shard', keyword='chunk', valid={valid!r}\n"
        f"    fix: use one of {', '.join(valid)}")
    assert not has_meta(model[0].weight)  # line 1 was not applied
    many = _text({"primitive": "shard", "path": "0", "args": ["weight", 0, 1, 2]})
    with pytest.raises(tl.RecipeError, match=re.escape(
            "recipe line 1: the arguments do not fit shard(param_name, axis, chunks=1")) as info:
        tl.apply_recipe(_mlp(), many)
    assert "too many positional arguments" in str(info.value)


def test_deep_nesting_is_a_recipe_error_not_a_recursion_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    text = ('{"torchloom_recipe": 1, "entries": [{"primitive": "annotate", "path": "0", '
            f'"args": ["weight", "k", {deep}]}}]}}')
    with pytest.raises(tl.RecipeError, match="not a torchloom recipe: the JSON is nested too "
                       "deeply to read"):
        tl.Recipe.from_json(text)
    level = MAX_DEPTH + 5  # readable JSON, deeper than a recipe value may be
    text = _text({"primitive": "annotate", "path": "0",
                  "args": ["weight", "k", json.loads("[" * level + "]" * level)]})
    with pytest.raises(tl.RecipeError, match=rf"recipe line 1: an argument is nested deeper "
                       rf"than {MAX_DEPTH} levels"):
        tl.Recipe.from_json(text)
    # in memory: a list that contains itself
    loop: list = []
    loop.append(loop)
    sch = tl.create_schedule(_mlp())
    sch["0"].annotate("weight", "loop", loop)
    with pytest.raises(tl.RecipeError, match="recipe line 1 .* not data: a list"):
        sch.recipe.to_json()
    assert "bind UNSERIALISABLE_0 first" in str(sch.recipe)
    with pytest.raises(tl.RecipeError, match=f"recipe line 1: an argument is nested deeper "
                       f"than {MAX_DEPTH} levels"):
        tl.apply_recipe(_mlp(), sch.recipe)


def test_the_printed_recipe_cannot_inject_code() -> None:
    with pytest.raises(tl.RecipeError, match="unknown primitive"):
        RecipeEntry("annotate('weight', 'k', 1); import os; os.system", "0")
    with pytest.raises(tl.RecipeError, match="is not a keyword annotate can take"):
        RecipeEntry("annotate", "0", (), {"x=1); __import__('os').system('id'); (": 1})
    nasty = "0'); __import__('os').system('touch PWNED'); ('"
    entry = RecipeEntry("annotate", nasty, ("weight", "k", nasty))
    text = str(tl.Recipe([entry]))
    calls = ast.parse(text).body[2:]
    assert len(calls) == 1  # one statement: the path and the value stayed strings
    assert tl.Recipe.from_script(text) == tl.Recipe([entry])


def test_from_script_reads_only_recipe_calls() -> None:
    head = "import torchloom\n\nsch = torchloom.create_schedule(model)\n"
    with pytest.raises(tl.RecipeError, match=re.escape(
            "Recipe.from_script(...): script line 4: not a recipe statement: "
            "\"__import__('os').system('id')\"")):
        tl.Recipe.from_script(head + "__import__('os').system('id')")
    with pytest.raises(tl.RecipeError, match=re.escape(
            "script line 4: \"__import__('os')\" is not a recipe value")):
        tl.Recipe.from_script(head + "sch['0'].replace(__import__('os'))")
    with pytest.raises(tl.RecipeError, match="script line 5: 'os.system' is not in a module "
                       "the script imports"):
        tl.Recipe.from_script(head + "sch['0'].checkpoint()\nsch['0'].replace(os.system)")
    with pytest.raises(tl.RecipeError, match="script line 5: the reference 'os:system' is not "
                       "trusted"):
        tl.Recipe.from_script("import os\nimport torchloom\n\n"
                              "sch = torchloom.create_schedule(model)\nsch['0'].replace(os.system)")
    values = tl.Recipe.from_script(head + "sch['0'].annotate('w', 'k', (float('inf'), -2, None))")
    assert values[0].args[2] == (float("inf"), -2, None)


def test_verify_recipe_roundtrip_executes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("exec was called")

    sch = tl.create_schedule(_mlp())
    sch["0"].annotate("weight", "d", {"t": (1, 2), "f": float("inf"), "dtype": torch.float16})
    sch["1"].checkpoint()
    sch["2"].shard("weight", 0)
    monkeypatch.setattr(builtins, "exec", refuse)
    verify_recipe_roundtrip(sch, _mlp, (torch.ones(2, 4),))
