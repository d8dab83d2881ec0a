"""Bad-input rows: a user's own model named as ``path/to/file.py:factory`` (issue 25 item 3,
issue 24's last rule).

The file is code the user runs on purpose: accepted on the command line only. A TOML
config (``load_toml``) or a recipe (``{"__ref__": ...}``) naming it is refused before
anything is imported. On the command line, what is wrong with the file, the factory or
what it returns is refused before any rank starts, naming the input, the value and the
fix: a missing file or function, a factory that raises, a result that is not a module,
logits of the wrong shape or in a tuple, no ``nn.Embedding``, ``--tp`` for a module
whose schedule takes none, ``--save-pretrained`` for a plain module, ``torchloom verify
--tp 2`` of such a module, and ``torchloom plan`` of a plain module.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Callable

from torch import nn

import torchloom as tl
from torchloom.apps import train as T
from torchloom.apps.jobconfig import TrainConfig, TrainOptionError, load_toml
from torchloom.core.errors import CliOptionError, PlanError, RecipeError

MODEL_PY = textwrap.dedent('''
    import pathlib
    import torch
    from torch import nn

    pathlib.Path(__file__).with_name("imported").write_text("the file ran")


    class LM(nn.Module):
        def __init__(self, vocab=256, width=16, layers=2, last_only=False, pair=False):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.head = nn.Linear(width, vocab)
            self.last_only, self.pair = last_only, pair

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = x + torch.tanh(block(x))
            logits = self.head(x[:, -1:] if self.last_only else x)
            return (logits, None) if self.pair else logits


    def make_model():
        return LM()


    def last_position_only():
        return LM(last_only=True)


    def logits_and_loss():
        return LM(pair=True)


    def no_embedding():
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


    def needs_a_gpu():
        raise RuntimeError("CUDA is not available")


    def not_a_module():
        return {"model": LM()}
''')


def _file(tmp_path: Path) -> str:
    path = tmp_path / "model.py"
    path.write_text(MODEL_PY)
    return str(path)


def _cfg(spec: str, **options) -> TrainConfig:
    return TrainConfig(model=spec, **{"steps": 1, "batch_size": 2, "seq_len": 16, **options})


def code_model_in_a_toml_config(tmp_path: Path):
    (tmp_path / "run.toml").write_text(f'model = "{_file(tmp_path)}:make_model"\nsteps = 2\n')
    load_toml(tmp_path / "run.toml")


def code_python_file_in_a_toml_config(tmp_path: Path):
    (tmp_path / "run.toml").write_text('model = "model.py"\n')
    load_toml(tmp_path / "run.toml")


def code_model_in_a_recipe(tmp_path: Path):
    _file(tmp_path)
    sys.path.insert(0, str(tmp_path))  # even where "model" would import
    try:
        tl.apply_recipe(nn.Sequential(nn.Linear(4, 4), nn.GELU()),
                        json.dumps({"torchloom_recipe": 1, "entries": [{
                            "primitive": "replace", "path": "1",
                            "args": [{"__ref__": "model.py:make_model"}]}]}))
    finally:
        sys.path.remove(str(tmp_path))


def code_model_path_in_a_recipe(tmp_path: Path):
    path = _file(tmp_path)
    tl.Recipe.from_json(json.dumps({"torchloom_recipe": 1, "entries": [{
        "primitive": "replace", "path": "1",
        "args": [{"__ref__": f"{path}:make_model"}]}]}))


def code_file_missing(tmp_path: Path):
    TrainConfig(model=str(tmp_path / "nowhere.py") + ":make_model")


def code_factory_name_not_an_identifier(tmp_path: Path):
    TrainConfig(model=_file(tmp_path) + ":make-model")


def code_factory_missing(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":make_modle"))


def code_factory_raises(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":needs_a_gpu"))


def code_factory_returns_no_module(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":not_a_module"))


def code_logits_of_the_last_position_only(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":last_position_only"))


def code_logits_in_a_tuple(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":logits_and_loss"))


def code_model_without_an_embedding(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":no_embedding"))


def code_tensor_parallel_without_a_schedule(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":make_model", tp=2))


def code_save_pretrained_of_a_plain_module(tmp_path: Path):
    T.check_config(_cfg(_file(tmp_path) + ":make_model",
                        save_pretrained=str(tmp_path / "out")))


def code_verify_tensor_parallel_without_a_schedule(tmp_path: Path):
    from torchloom.apps.cli import check_verify

    check_verify(_file(tmp_path) + ":make_model", tp=2, sp=False)


def code_plan_of_a_plain_module(tmp_path: Path):
    from torchloom.plan.spec import code_spec

    code_spec(_file(tmp_path) + ":make_model", seq_len=64)


def code_plan_model_spec_of_a_string(tmp_path: Path):
    from torchloom.plan.spec import model_spec

    model_spec(_file(tmp_path) + ":make_model")


_FIX = r".*fix: "

CASES: list[tuple[Callable, type, str]] = [
    (code_model_in_a_toml_config, TrainOptionError,
     r"--config '.*run\.toml': model = '.*model\.py:make_model': a TOML config cannot name "
     r"Python code to run" + _FIX + r"pass it on the command line: --model .*model\.py:"
     r"make_model"),
    (code_python_file_in_a_toml_config, TrainOptionError,
     r"model = 'model\.py': a TOML config cannot name Python code to run" + _FIX +
     r"pass it on the command line: --model model\.py:factory"),
    (code_model_in_a_recipe, RecipeError,
     r"recipe line 1: the reference 'model\.py:make_model' is not trusted: its module "
     r"'model\.py' is outside torch, torchloom and transformers"),
    (code_model_path_in_a_recipe, RecipeError,
     r"recipe line 1: a reference must be 'package\.module:Name'"),
    (code_file_missing, TrainOptionError,
     r"--model '.*nowhere\.py:make_model': '.*nowhere\.py': no such file" + _FIX +
     r"--model the path of an existing file"),
    (code_factory_name_not_an_identifier, TrainOptionError,
     r"--model '.*model\.py:make-model': 'make-model' is not the name of a Python function"
     + _FIX + r"--model .*model\.py:make_model"),
    (code_factory_missing, TrainOptionError,
     r"--model '.*model\.py:make_modle': .*model\.py defines no 'make_modle'.*defined=\["
     r"'last_position_only', 'logits_and_loss', 'make_model'" + _FIX),
    (code_factory_raises, TrainOptionError,
     r"calling needs_a_gpu\(\) raised RuntimeError: CUDA is not available \(line \d+ of "
     r"model\.py\)" + _FIX + r"the factory takes no arguments and returns the model"),
    (code_factory_returns_no_module, TrainOptionError,
     r"not_a_module\(\) returned a dict, not an nn\.Module" + _FIX +
     r"return the model from not_a_module"),
    (code_logits_of_the_last_position_only, TrainOptionError,
     r"the forward of LM returned logits of shape \(2, 1, 256\) for token ids of shape "
     r"\(2, 16\); they must be \(2, 16, V\) with V at least the 256 rows of its embedding"
     + _FIX + r".*logits for every position"),
    (code_logits_in_a_tuple, TrainOptionError,
     r"the forward of LM returned a tuple, not a tensor of logits" + _FIX + r".*wrap it, e\.g\. a module whose forward returns model\(ids\)\[0\]"),
    (code_model_without_an_embedding, TrainOptionError,
     r"Sequential has no nn\.Embedding: torchloom feeds it token ids" + _FIX +
     r".*embed the ids with nn\.Embedding\(vocab, width\)"),
    (code_tensor_parallel_without_a_schedule, TrainOptionError,
     r"--tp 2: LM has no built-in schedule and transformers declares no tensor-parallel "
     r"plan for it" + _FIX + r"train it with --dp \(or --pp\), or register a schedule.*"
     r"for class LM"),
    (code_save_pretrained_of_a_plain_module, TrainOptionError,
     r"--save-pretrained '.*out': .*model\.py:make_model made a LM, not a transformers model: "
     r"there is no transformers folder \(config\.json and its class\) to write" + _FIX +
     r"keep the trained weights with --save-dir"),
    (code_verify_tensor_parallel_without_a_schedule, CliOptionError,
     r"torchloom verify\(\.\.\.\): --tp 2: LM has only a schedule without tensor "
     r"parallelism, automatic \(checkpoint and compile of the layer stacks\)" + _FIX +
     r"verify its automatic schedule on one rank: torchloom verify .*model\.py:make_model "
     r"--ckpt-ratio 0\.5"),
    (code_plan_of_a_plain_module, PlanError,
     r"the factory returned a LM, a module without a transformers config; the planner "
     r"rebuilds a model at a few depths from its config \(num_hidden_layers" + _FIX +
     r"plan a transformers config of the same shape"),
    (code_plan_model_spec_of_a_string, PlanError,
     r"names Python code: model_spec does not import files named by a string" + _FIX +
     r"torchloom plan .*model\.py:make_model on the command line, or in Python: "
     r"model_spec\(code_spec\("),
]
