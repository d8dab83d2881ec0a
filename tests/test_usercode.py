"""A user's own model as ``path/to/file.py:factory`` (issue 25 item 3; issue 24's rule that
it is accepted on the command line only).

The README's "Your own model" example is written to ``tmp_path/model.py`` from the README
itself and its commands are run (fewer steps): ``verify`` on one rank, ``train`` with
``--dp 2`` (one launch) equal to one rank, which equals the unscheduled module trained by
hand. On one rank: ``--ckpt-ratio``, a run stopped and resumed equal to one never
stopped, the banner; a factory returning a transformers model (its built-in schedule,
``--save-pretrained``); ``show`` and ``plan``; a schedule registered for the user's class
enables ``--tp``. Refusals are pinned in ``tests/bad_input_cases/usercode.py``; here: a
TOML config or recipe naming the file never imports it, and ``verify`` refuses bad input
before any rank starts (in well under the ~28 s the ranks' start-up takes). A pipeline
(``--pp 2``) and FSDP2 equal to one rank are marked slow.
"""

from __future__ import annotations

import json
import re
import runpy
import shlex
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import torchloom as tl
from tests.bad_input_cases.usercode import MODEL_PY
from torchloom.apps import train as T
from torchloom.apps.cli import app
from torchloom.apps.jobconfig import TrainConfig, TrainOptionError, load_toml
from torchloom.core.errors import RecipeError

README = Path(__file__).resolve().parents[1] / "README.md"
LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)")
SMALL = ["--steps", "2", "--batch-size", "4", "--seq-len", "32", "--threads", "1",
         "--no-progress"]

GPT2_FACTORY = textwrap.dedent('''
    import transformers


    def make_gpt2():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64))
''')


def readme_example() -> tuple[str, list[list[str]]]:
    """The README's ``model.py`` and its ``torchloom`` commands (as argument lists)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("### Your own model: `file.py:factory`", 1)[1].split("\n### ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    bash = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert python and bash, "the README's example moved"
    commands = [shlex.split(line)[1:] for line in bash.group(1).splitlines()
                if line.startswith("torchloom ")]
    return python.group(1), commands


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """``model.py`` from the README in ``tmp_path``, the working directory."""
    source, commands = readme_example()
    (tmp_path / "model.py").write_text(source)
    (tmp_path / "gpt2_model.py").write_text(GPT2_FACTORY)
    monkeypatch.chdir(tmp_path)
    return commands


def invoke(*args: str):
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        torch.set_num_threads(threads)


def losses(output: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for line in output.splitlines()
            if (m := LINE.match(line))}


def by_hand(steps: int = 2) -> list[float]:
    """The README's module trained as ``torchloom train`` does it, in plain PyTorch: made
    after ``manual_seed(0)``, AdamW, the batches and learning rates of ``train``."""
    make_model = runpy.run_path("model.py")["make_model"]
    cfg = TrainConfig(model="model.py:make_model", steps=steps, batch_size=4, seq_len=32)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    out = []
    for step in range(1, steps + 1):
        ids = T.batch_at(step, 4, 32, 0)
        for group in opt.param_groups:
            group["lr"] = T._lr(cfg, step)
        torch.manual_seed(step)
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


# --------------------------------------------------------------------------- the README


def test_readme_example_verifies_and_trains_on_two_ranks(example, capfd):
    verify, train, resume = example
    assert verify[:2] == ["verify", "model.py:make_model"] and "--resume" in resume
    result = invoke(*verify)
    assert result.exit_code == 0, result.output
    assert "schedule: automatic" in result.output
    assert re.search(r"ok: \d+ primitive calls", result.output)

    reference = by_hand()
    started = time.perf_counter()
    capfd.readouterr()
    result = invoke(*train, *SMALL)  # --dp 2: one launch of two local ranks
    assert result.exit_code == 0, result.output
    assert "trained steps 1..2" in result.output
    ranks = capfd.readouterr().out  # rank 0 prints from its own process
    found = losses(ranks)
    assert sorted(found) == [1, 2], ranks
    assert [found[1], found[2]] == pytest.approx(reference, rel=1e-5, abs=1e-5)
    assert "TinyLM" in ranks and "made by model.py:make_model, seed 0" in ranks
    assert "dp2 (ddp)" in ranks
    assert (Path("runs/mine") / "step-2").is_dir()
    print(f"dp 2 launch: {time.perf_counter() - started:.1f} s")


def test_one_rank_checkpointing_and_resume_equal_an_uninterrupted_run(example):
    base = ["train", "--model", "model.py:make_model", "--ckpt-ratio", "0.5", *SMALL]
    whole = invoke(*base, "--save-dir", "a")
    assert whole.exit_code == 0, whole.output
    assert "schedule: automatic (checkpoint and compile of the layer stacks)" in whole.output
    reference = losses(whole.output)
    assert [reference[1], reference[2]] == pytest.approx(by_hand(), rel=1e-6, abs=1e-6)

    first = invoke(*base, "--save-dir", "b", "--stop-after", "1")
    assert first.exit_code == 0, first.output
    rest = invoke(*base, "--save-dir", "b", "--resume")
    assert rest.exit_code == 0, rest.output
    assert {**losses(first.output), **losses(rest.output)} == reference  # bit for bit
    # the schedule is the wrapped module's: paths under "model."
    saved = json.loads((Path("b") / "torchloom-checkpoints.json").read_text())
    assert saved
    assert T.layer_lists(T.meta_model(TrainConfig(model="model.py:make_model"))) == [
        "model.blocks.layers"]


def test_a_factory_returning_a_transformers_model(example, tmp_path):
    result = invoke("train", "--model", "gpt2_model.py:make_gpt2", *SMALL[:2],
                    "--batch-size", "2", "--seq-len", "16", "--threads", "1", "--no-progress",
                    "--save-pretrained", "out")
    assert result.exit_code == 0, result.output
    assert "GPT2LMHeadModel" in result.output and "built-in schedule_gpt2" in result.output
    import transformers

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert loaded.config.n_layer == 2
    # with a schedule taking tp, --tp passes the checks made before any rank starts
    T.check_config(TrainConfig(model="gpt2_model.py:make_gpt2", tp=2, steps=1, batch_size=2,
                               seq_len=16))


def test_a_schedule_registered_for_the_users_class_takes_tp(tmp_path, monkeypatch):
    (tmp_path / "tp_model.py").write_text(textwrap.dedent('''
        from torch import nn
        import torchloom as tl


        class RegisteredLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(256, 16)
                self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
                self.head = nn.Linear(16, 256)

            def forward(self, ids):
                x = self.embed(ids)
                for layer in self.layers:
                    x = layer(x)
                return self.head(x)


        def schedule_registered(sch, config):
            if config.tp > 1:
                sch["layers.*"].shard("weight", 0)
            sch["layers"].checkpoint(ratio=config.ckpt_ratio)


        tl.schedules.register_schedule("RegisteredLM", schedule_registered)


        def make():
            return RegisteredLM()
    '''))
    monkeypatch.chdir(tmp_path)
    from torchloom.schedules import _REGISTRY

    # the file registers a schedule globally: undone after the test
    monkeypatch.setattr("torchloom.schedules._REGISTRY", dict(_REGISTRY))
    cfg = TrainConfig(model="tp_model.py:make", tp=2, steps=1, batch_size=2, seq_len=16)
    T.check_config(cfg)  # not refused: the class has a schedule taking tp
    assert T.schedule_source(T.meta_model(cfg)) == "built-in schedule_registered"
    sch = tl.create_schedule(T.meta_model(cfg))
    from torchloom.parallel import Layout, parallelize

    parallelize(sch, Layout(ckpt_ratio=0.5), schedule_at="model")
    assert "sch['model.layers'].checkpoint(ratio=0.5)" in str(sch.recipe)  # the inner module


# --------------------------------------------------------------------------- command line only


def test_a_toml_config_or_recipe_naming_the_file_never_imports_it(tmp_path, monkeypatch):
    (tmp_path / "model.py").write_text(MODEL_PY)  # writes "imported" when it runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text('model = "model.py:make_model"\nsteps = 1\n')
    with pytest.raises(TrainOptionError, match="a TOML config cannot name Python code"):
        load_toml(tmp_path / "run.toml")
    result = invoke("train", "--config", "run.toml", "--model", "gpt2")
    assert result.exit_code == 2
    assert "a TOML config cannot name Python code to run" in result.output
    assert "--model model.py:make_model" in result.output
    monkeypatch.syspath_prepend(str(tmp_path))  # "model" would import
    for ref in ("model.py:make_model", "model:make_model", f"{tmp_path}/model.py:make_model"):
        text = json.dumps({"torchloom_recipe": 1, "entries": [
            {"primitive": "replace", "path": "1", "args": [{"__ref__": ref}]}]})
        with pytest.raises(RecipeError):
            tl.apply_recipe(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), text)
    assert not (tmp_path / "imported").exists()
    # on the command line it is imported (and checked) on purpose
    result = invoke("train", "--model", "model.py:make_model", "--steps", "1", "--batch-size",
                    "2", "--seq-len", "16", "--threads", "1", "--no-progress")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "imported").exists()


def test_verify_refuses_bad_input_before_any_rank_starts(example, tmp_path):
    (tmp_path / "weights_only").mkdir()
    cases = [
        (["verify", "model.py:make_model", "--tp", "2"],
         "TinyLM has only a schedule without tensor parallelism"),
        (["verify", "lama", "--tp", "2"], "torchloom verify llama"),
        (["verify", "weights_only", "--tp", "2"], "the folder has no config.json"),
        (["verify", "nowhere.py:make_model", "--tp", "2"], "'nowhere.py': no such file"),
        (["verify", "model.py:make", "--tp", "2"], "model.py defines no 'make'"),
    ]
    for args, needle in cases:
        started = time.perf_counter()
        result = invoke(*args)
        seconds = time.perf_counter() - started
        assert result.exit_code == 2, result.output
        assert needle in result.output, result.output
        assert seconds < 8, (args, seconds)  # the ranks' start-up alone takes ~28 s


def test_verify_a_folder_and_show_and_plan(example, tmp_path):
    import transformers

    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                             max_position_embeddings=64).save_pretrained(tmp_path / "tiny-llama")
    result = invoke("verify", "tiny-llama", "--ckpt-ratio", "0.5")  # config only: random init
    assert result.exit_code == 0, result.output
    assert "derived from transformers' tensor-parallel plan" in result.output or \
        "built-in" in result.output
    assert re.search(r"ok: \d+ primitive calls", result.output)

    result = invoke("show", "model.py:make_model", "--ckpt-ratio", "0.5")
    assert result.exit_code == 0, result.output
    assert "model.py:make_model: TinyLM" in result.output and "TokenLM" in result.output
    assert "checkpoint" in result.output

    result = invoke("plan", "gpt2_model.py:make_gpt2", "--gpus", "2", "--tp", "2", "--pp", "1",
                    "--seq-len", "32")
    assert result.exit_code == 0, result.output
    assert "--model gpt2_model.py:make_gpt2" in result.output.replace("\n", "")
    result = invoke("plan", "model.py:make_model", "--gpus", "2")
    assert result.exit_code == 2
    assert "the planner rebuilds a model at a few depths from its config" in result.output


# --------------------------------------------------------------------------- more ranks


@pytest.mark.slow
def test_pipeline_and_fsdp_equal_one_rank(example, capfd):
    reference = by_hand()
    for extra in (["--pp", "2", "--n-microbatches", "2"], ["--dp", "2", "--dp-mode", "fsdp"]):
        capfd.readouterr()
        result = invoke("train", "--model", "model.py:make_model", *SMALL, *extra)
        assert result.exit_code == 0, result.output
        found = losses(capfd.readouterr().out)
        assert [found[1], found[2]] == pytest.approx(reference, rel=1e-5, abs=1e-5), extra
