"""An untrusted recipe reaches only the schedule allow-list (issue 24, item 1).

Three kinds of check:

* the catalogue of known routes from a recipe file to code (reading or writing files,
  compiling, loading code, opening connections), each pinned as must-fail: among them the
  one that ran a Python file through ``torch._inductor.codecache.PyCodeCache`` from a
  ``replace(target_ops=..., concrete_args=...)`` line;
* a walk over every public callable of every imported module of torch, transformers and
  torchloom (with the modules that hold the dangerous functions imported first): each one
  that resolves without trust is on the allow-list, checked here by rules written
  independently of the resolver;
* references only where a primitive takes a function or class: ``concrete_args``,
  ``annotate``'s value and ``sync``'s keywords are plain data.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom.core.refs import SAFE_FUNCTIONAL, SAFE_TORCH, resolve_ref


def _text(*entries: dict) -> str:
    return json.dumps({"torchloom_recipe": 1, "entries": list(entries)})


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())


# Known routes from a file to code. Each must be refused without trust, whatever module
# is imported already.
ROUTES = [
    "torch._inductor.codecache:PyCodeCache.load_by_key_path",  # ran a file (the probe)
    "torch._inductor.codecache:PyCodeCache.load",               # wrote into the cache
    "torch.serialization:save",                                 # overwrote a user's file
    "torch:save", "torch:load", "torch.serialization:load", "torch:from_file",
    "torch.hub:load", "torch.hub:load_state_dict_from_url", "torch.hub:download_url_to_file",
    "torch.utils.model_zoo:load_url",
    "torch.utils.cpp_extension:load_inline", "torch.utils.cpp_extension:load",
    "torch.jit:load", "torch.jit:script", "torch.jit:trace", "torch:compile",
    "torch.export:load", "torch.export:save", "torch.onnx:export",
    "torch.package:PackageImporter", "torch.package:PackageExporter",
    "torch.distributed.checkpoint:load", "torch.distributed.checkpoint:save",
    "torch.library:Library", "torch:UntypedStorage.from_file",
    "torch.nn:Module.load_state_dict", "torch.nn.modules.module:Module.register_forward_hook",
    "torch.nn:Linear.to_empty", "torch.nn:Module.apply",
    "transformers:AutoModel", "transformers:AutoModel.from_pretrained",
    "transformers:PreTrainedModel", "transformers:pipeline", "transformers:AutoConfig",
    "transformers.dynamic_module_utils:get_class_from_dynamic_module",
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel.from_pretrained",
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel.save_pretrained",
    "transformers.utils.hub:cached_file",
    "torchloom.runtime.state:save", "torchloom.core.refs:import_ref",
    "torchloom.core.recipe:apply_recipe", "torchloom.apps.cli:main",
    "torchloom.runtime.weights:load_weights", "torchloom:save",
    "builtins:eval", "builtins:exec", "builtins:open", "os:system", "subprocess:run",
    "importlib:import_module", "pickle:loads", "numpy:load", "runpy:run_path",
]


@pytest.mark.parametrize("ref", ROUTES)
def test_known_code_routes_are_refused(ref: str) -> None:
    module = ref.partition(":")[0]
    if module.startswith(("torch", "transformers", "torchloom")):
        try:  # the worst case: the module is imported already
            importlib.import_module(module)
        except ImportError:
            pass
    with pytest.raises(tl.RecipeError, match=r"is not trusted|goes through|private attribute|"
                       r"must be 'package\.module:Name'|cannot find") as info:
        resolve_ref(ref)
    assert f"trusted_refs={{{ref!r}: <the object>}}" in str(info.value) or \
        "cannot find" in str(info.value) or "goes through" in str(info.value)


def test_the_probed_exploit_runs_no_file(tmp_path: Path) -> None:
    """The two-line recipe that made build and the first forward run a Python file."""
    import torch._inductor.codecache  # noqa: F401 - loaded, as after any torch.compile

    marker = tmp_path / "RAN"
    payload = tmp_path / "payload.py"
    payload.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    text = _text(
        {"primitive": "trace", "path": "", "kwargs": {"tracer": "fx"}},
        {"primitive": "replace", "path": "",
         "args": [{"__ref__": "torch._inductor.codecache:PyCodeCache.load_by_key_path"}],
         "kwargs": {"target_ops": {"pattern": "^1$", "index": 0},
                    "concrete_args": {"key": "x", "path": str(payload)}}})
    with pytest.raises(tl.RecipeError, match=re.escape(
            "recipe line 2: the reference 'torch._inductor.codecache:PyCodeCache."
            "load_by_key_path' is not trusted: it names a function of "
            "'torch._inductor.codecache', which is not on the schedule allow-list")):
        tl.apply_recipe(_mlp(), text)
    assert not marker.exists()


def test_references_only_where_a_primitive_takes_code() -> None:
    # an allowed class, but in concrete_args: plain data only
    text = _text(
        {"primitive": "trace", "path": "", "kwargs": {"tracer": "fx"}},
        {"primitive": "replace", "path": "", "args": [{"__ref__": "torch.nn.functional:relu"}],
         "kwargs": {"target_ops": {"pattern": "^1$", "index": 0},
                    "concrete_args": {"inplace": {"__ref__": "torch.nn:Linear"}}}})
    with pytest.raises(tl.RecipeError, match=re.escape(
            "recipe line 2: argument 'concrete_args' of replace takes plain data, and this "
            "recipe puts a function or class there")) as info:
        tl.Recipe.from_json(text)
    assert "references are accepted only in: new_mod_or_fn, target_ops" in str(info.value)
    for entry in (
        {"primitive": "annotate", "path": "0", "args": ["weight", "k", {"__ref__": "torch:tanh"}]},
        {"primitive": "sync", "path": "0", "args": ["fwd_post", "all_reduce"],
         "kwargs": {"group": {"__ref__": "torch.nn:Linear"}}},
    ):
        with pytest.raises(tl.RecipeError, match=r"takes plain data"):
            tl.Recipe.from_json(_text(entry))
    # the same reference where the primitive takes a function is fine
    ok = tl.Recipe.from_json(_text(
        {"primitive": "replace", "path": "1", "args": [{"__ref__": "torch.nn:GELU"}]}))
    assert ok[0].args[0] is nn.GELU
    # and a caller who trusts the object by name may put it anywhere
    trusted = tl.Recipe.from_json(_text(
        {"primitive": "annotate", "path": "0", "args": ["weight", "k", {"__ref__": "torch:save"}]}),
        trusted_refs={"torch:save": torch.save})
    assert trusted[0].args[2] is torch.save


def test_a_printed_recipe_obeys_the_same_rules() -> None:
    script = ("import torch.serialization\nimport torchloom\n\n"
              "sch = torchloom.create_schedule(model)\n"
              "sch['1'].replace(torch.serialization.save)\n")
    with pytest.raises(tl.RecipeError, match=r"script line 5: the reference "
                       r"'torch\.serialization:save' is not trusted"):
        tl.Recipe.from_script(script)


# --------------------------------------------------------------------------- the walk

_DANGEROUS = re.compile(r"(?i)load|save|open|compile|import|exec|eval|download|url|file|hub\b|"
                        r"script|spawn|system|popen|pickle|library|extension|dump|write|read")

# modules that hold file, network, code-loading and compile functions: imported before
# the walk so that it sees them
_DANGEROUS_MODULES = [
    "torch.serialization", "torch.hub", "torch.utils.cpp_extension", "torch.jit",
    "torch.package", "torch.export", "torch.distributed.checkpoint", "torch._inductor.codecache",
    "torch.utils.model_zoo", "torch.library", "torch.utils.data", "torch.compiler",
    "transformers.dynamic_module_utils", "transformers.utils.hub", "transformers.modeling_utils",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    "transformers.models.auto.modeling_auto", "torchloom.apps.cli", "torchloom.apps.train",
]


def _on_the_allow_list_by_rule(obj: object) -> bool:
    """The allow-list, restated from the documentation (not from the resolver's code)."""
    if inspect.isclass(obj):
        module = obj.__module__
        return issubclass(obj, nn.Module) and (
            module.startswith(("torch.nn.", "torchloom.ops.", "transformers.models.",
                               "transformers.activations", "transformers.pytorch_utils",
                               "transformers.modeling_layers")))
    module = getattr(obj, "__module__", "") or ""
    if module.startswith(("torchloom.ops", "torchloom.schedules")):
        return True
    import torch.nn.functional as F

    return any(getattr(F, n, None) is obj for n in SAFE_FUNCTIONAL) or \
        any(getattr(torch, n, None) is obj for n in SAFE_TORCH)


def test_every_public_callable_that_resolves_is_on_the_allow_list() -> None:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _DANGEROUS_MODULES:
            importlib.import_module(name)
        for name in dir(transformers):  # every top-level name (imports its module)
            if not name.startswith("_"):
                getattr(transformers, name, None)
    modules = [(n, m) for n, m in list(sys.modules.items())
               if n.split(".")[0] in ("torch", "transformers", "torchloom") and m is not None]
    resolved, refused, classes = 0, 0, []
    for module_name, module in modules:
        for attr, obj in list(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            try:
                got = resolve_ref(f"{module_name}:{attr}")
            except tl.RecipeError:
                refused += 1
                continue
            resolved += 1
            assert got is obj
            assert _on_the_allow_list_by_rule(obj), f"{module_name}:{attr} resolves untrusted"
            if inspect.isroutine(obj):
                assert not _DANGEROUS.search(obj.__name__) or \
                    obj.__module__.startswith("torchloom."), f"{module_name}:{attr}"
            elif len(classes) < 400:
                classes.append((module_name, attr, obj))
    # the walk saw the whole surface, and the allow-list is not empty
    assert len(modules) > 1500 and refused > 20000 and resolved > 1000, \
        (len(modules), refused, resolved)
    # no method of an allowed class resolves (load_state_dict, to_empty, from_pretrained)
    for module_name, attr, cls in classes:
        for method in ("load_state_dict", "from_pretrained", "save_pretrained", "to_empty",
                       "register_forward_hook", "apply", "forward"):
            if hasattr(cls, method):
                with pytest.raises(tl.RecipeError, match="not trusted"):
                    resolve_ref(f"{module_name}:{attr}.{method}")


# --------------------------------------------------------------------------- patterns


class _LongNames(nn.Module):
    """A module whose child's name makes ``(a|aa)+$`` backtrack catastrophically."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({"a" * 60 + "b": nn.Linear(4, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return torch.relu(x)


def test_a_catastrophic_pattern_in_a_recipe_is_refused_in_under_a_second() -> None:
    import time

    text = _text(
        {"primitive": "trace", "path": "", "kwargs": {"tracer": "fx"}},
        {"primitive": "replace", "path": "", "args": [{"__ref__": "torch.nn.functional:relu"}],
         "kwargs": {"target_ops": {"pattern": "(a|aa)+$", "index": 0}}})
    start = time.monotonic()
    with pytest.raises(tl.RecipeError, match=re.escape(
            "the regular expression '(a|aa)+$' took over 0.5 s on one name (it backtracks "
            "catastrophically)")):
        tl.apply_recipe(_LongNames(), text)
    assert time.monotonic() - start < 1.5  # the budget, plus tracing
    # the same pattern typed by hand fails the same way; an ordinary one still works
    sch = tl.create_schedule(_LongNames())
    sch.trace(tracer="fx")
    with pytest.raises(tl.PatternError, match=r"(?s)took over 0\.5 s.*fix: write a pattern "
                       r"without nested repetition"):
        sch.find("(a|aa)+$")
    assert len(sch.find(r"blocks\.a+b$")) == 1


def test_a_pattern_longer_than_the_limit_is_refused() -> None:
    sch = tl.create_schedule(_mlp())
    sch.trace(tracer="fx")
    with pytest.raises(tl.PatternError, match=r"the regular expression is 5000 characters "
                       r"long, over the limit of 1000"):
        sch.find("x" * 5000)
    with pytest.raises(tl.PatternError, match=r"invalid regular expression"):
        sch.find("(unclosed")
