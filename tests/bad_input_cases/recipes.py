"""Bad-input rows: recipes read from text are data (issue 13 items 1 and 7).

A recipe line that names no registered primitive, has arguments of the wrong type or
keywords its primitive does not take, nests too deeply, or references an object outside
the trusted packages raises a RecipeError naming the line, the offending name and the fix.
"""

from __future__ import annotations

import json
from typing import Callable

from torch import nn

import torchloom as tl
from torchloom.core.errors import RecipeError


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))


def _text(*entries: dict) -> str:
    return json.dumps({"torchloom_recipe": 1, "entries": list(entries)})


def recipe_dunder_primitive():
    tl.Recipe.from_json(_text(
        {"primitive": "__setattr__", "path": "", "args": ["shard", {"__ref__": "os:system"}]}))


def recipe_unknown_primitive_name():
    tl.apply_recipe(_mlp(), _text({"primitive": "shardd", "path": "0", "args": ["weight", 0]}))


def recipe_args_given_as_a_string():
    tl.apply_recipe(_mlp(), _text({"primitive": "annotate", "path": "0", "args": "wkv"}))


def recipe_kwargs_given_as_a_list():
    tl.Recipe.from_json(_text({"primitive": "checkpoint", "path": "0", "kwargs": [["ratio", 1]]}))


def recipe_dunder_keyword():
    tl.Recipe.from_json(_text({"primitive": "checkpoint", "path": "0", "kwargs": {"__class__": 1}}))


def recipe_unknown_keyword():
    tl.apply_recipe(_mlp(), _text(
        {"primitive": "annotate", "path": "0", "args": ["weight", "ok", 1]},
        {"primitive": "shard", "path": "0", "args": ["weight", 0], "kwargs": {"chunk": 2}}))


def recipe_too_many_arguments():
    tl.apply_recipe(_mlp(), _text({"primitive": "shard", "path": "0", "args": ["weight", 0, 1, 2]}))


def recipe_path_not_a_string():
    tl.Recipe.from_json(_text({"primitive": "checkpoint", "path": ["0"]}))


def recipe_entry_with_an_unknown_field():
    tl.Recipe.from_json(_text({"primitive": "checkpoint", "path": "0", "code": "import os"}))


def recipe_json_nested_too_deeply():
    deep = "[" * 100_000 + "]" * 100_000
    tl.Recipe.from_json('{"torchloom_recipe": 1, "entries": [{"primitive": "annotate", '
                        f'"path": "0", "args": ["weight", "k", {deep}]}}]}}')


def recipe_value_nested_beyond_the_limit():
    value = json.loads("[" * 30 + "]" * 30)
    tl.Recipe.from_json(_text({"primitive": "annotate", "path": "0", "args": ["weight", "k", value]}))


def recipe_reference_to_os_system():
    tl.apply_recipe(_mlp(), _text(
        {"primitive": "annotate", "path": "0", "args": ["weight", "k", {"__ref__": "os:system"}]}))


def recipe_reference_through_a_module():
    tl.Recipe.from_json(_text(
        {"primitive": "replace", "path": "1", "args": [{"__ref__": "torch.serialization:os.system"}]}))


def recipe_reference_to_a_transformers_function():
    tl.Recipe.from_json(_text(
        {"primitive": "replace", "path": "1",
         "args": [{"__ref__": "transformers:is_torch_available"}]}))


def recipe_unknown_dtype():
    tl.Recipe.from_json(_text(
        {"primitive": "annotate", "path": "0", "args": ["weight", "d", {"__dtype__": "load"}]}))


def recipe_script_that_runs_code():
    tl.Recipe.from_script("import torchloom\n\nsch = torchloom.create_schedule(model)\n"
                          "__import__('os').system('id')")


def recipe_wildcard_path_in_a_file():
    tl.apply_recipe(nn.Sequential(_mlp(), _mlp()),
                    _text({"primitive": "annotate", "path": "*.0", "args": ["weight", "k", 1]}))


def recipe_trusted_refs_given_as_a_list():
    tl.Recipe.from_json(_text({"primitive": "checkpoint", "path": "0"}), trusted_refs=[print])


def apply_recipe_of_a_number():
    tl.apply_recipe(_mlp(), 42)  # type: ignore[arg-type]


CASES: list[tuple[Callable, type, str]] = [
    (recipe_dunder_primitive, RecipeError, r"Recipe\.from_json\(\.\.\.\): recipe line 1: unknown "
     r"primitive '__setattr__'.*values: line=1, primitive='__setattr__'.*fix: use one of the "
     r"primitives: annotate, checkpoint, compile"),
    (recipe_unknown_primitive_name, RecipeError, r"recipe line 1: unknown primitive 'shardd'"),
    (recipe_args_given_as_a_string, RecipeError, r"recipe line 1: args of annotate must be a "
     r"list, not a str.*fix: wrap the arguments in a list, e\.g\. \"args\": \['wkv'\]"),
    (recipe_kwargs_given_as_a_list, RecipeError, r"recipe line 1: kwargs of checkpoint must be "
     r"an object \(a dict\), not a list"),
    (recipe_dunder_keyword, RecipeError, r"recipe line 1: '__class__' is not a keyword "
     r"checkpoint can take"),
    (recipe_unknown_keyword, RecipeError, r"apply_recipe\(\.\.\.\): recipe line 2: shard\(\) has "
     r"no keyword 'chunk'.*valid=\['param_name', 'axis', 'chunks'.*fix: use one of param_name, "
     r"axis, chunks"),
    (recipe_too_many_arguments, RecipeError, r"recipe line 1: the arguments do not fit "
     r"shard\(param_name, axis, chunks=1.*too many positional arguments"),
    (recipe_path_not_a_string, RecipeError, r"recipe line 1: the path must be a string, not a "
     r"list"),
    (recipe_entry_with_an_unknown_field, RecipeError, r"recipe line 1: unknown field 'code' in "
     r"an entry.*fix: an entry has the fields primitive, path, args, kwargs"),
    (recipe_json_nested_too_deeply, RecipeError, r"not a torchloom recipe: the JSON is nested "
     r"too deeply to read"),
    (recipe_value_nested_beyond_the_limit, RecipeError, r"recipe line 1: an argument is nested "
     r"deeper than 20 levels"),
    (recipe_reference_to_os_system, RecipeError, r"recipe line 1: the reference 'os:system' is "
     r"not trusted: its module 'os' is outside torch, torchloom and transformers.*fix: if you "
     r"trust it, pass the object: Recipe\.from_json\(text, trusted_refs="),
    (recipe_reference_through_a_module, RecipeError, r"the reference "
     r"'torch\.serialization:os\.system' goes through 'os', a module"),
    (recipe_reference_to_a_transformers_function, RecipeError, r"'transformers:is_torch_available'"
     r" is not trusted: it names a function of 'transformers\..*not on the schedule allow-list"),
    (recipe_unknown_dtype, RecipeError, r"recipe line 1: unknown dtype 'load'"),
    (recipe_script_that_runs_code, RecipeError, r"Recipe\.from_script\(\.\.\.\): script line 4: "
     r"not a recipe statement"),
    (recipe_wildcard_path_in_a_file, RecipeError, r"1 of 1 recipe lines failed.*a recipe line "
     r"names one module; this path matches 2"),
    (recipe_trusted_refs_given_as_a_list, RecipeError, r"trusted_refs must map reference texts "
     r"to objects, not a list.*fix: trusted_refs=\{'mypackage\.kernels:make_fused_mlp'"),
    (apply_recipe_of_a_number, RecipeError, r"apply_recipe takes a Recipe or its JSON text, not "
     r"a int"),
]
