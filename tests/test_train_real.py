"""``torchloom train`` for real work: a transformers model folder, local text files, a
held-out evaluation, resuming, and a ``--save-pretrained`` folder that transformers loads.

The folder is written by ``save_pretrained`` from a default-config Llama with only its
sizes shrunk, plus a byte-level BPE tokenizer trained (offline, with ``tokenizers``) on
this file's own text and saved as a ``PreTrainedTokenizerFast``; the data files are that
text split in three. Checks that can fail independently of the training code:

* a run stopped after step 2 and resumed gives the same losses and held-out losses, bit
  for bit, as one run;
* the ``--save-pretrained`` folder loads with ``from_pretrained`` (no missing or
  unexpected keys) and its tensors equal the run's last checkpoint; its tokenizer loads;
* the held-out loss the run reports equals the loss of the loaded model on the last
  ``eval_fraction`` of the text, tokenised here with ``AutoTokenizer``;
* the gradient norm reported with ``--clip-grad`` equals ``clip_grad_norm_``'s on the
  unscheduled model; ``--grad-accum 2`` gives the losses of one full batch;
* flags override a ``--config`` TOML file; ``torchloom show`` states the size it shows.
Multi-rank runs (tensor parallelism, FSDP2 in bf16) are marked slow; the compositions
with pipelines are in tests/test_layouts_train.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

import torchloom as tl
from torchloom.apps import data
from torchloom.apps import train as T
from torchloom.apps.cli import app
from torchloom.schedules import zoo

LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)")
EVAL = re.compile(r"^eval\s+step\s+(\d+)\s+loss (\S+)")
COMMON = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
          "--threads", "1", "--no-progress"]


def text() -> str:
    return Path(__file__).read_text(encoding="utf-8")


def make_tokenizer(corpus: str, vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus`` (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def llama_config(vocab_size: int = 384, positions: int = 128,
                 tie_word_embeddings: bool = False) -> transformers.LlamaConfig:
    """transformers' default Llama config, sizes shrunk."""
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=vocab_size, max_position_embeddings=positions,
                                    tie_word_embeddings=tie_word_embeddings)


def make_folder(path: Path, tokenizer: bool = True, **config) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(**config)).save_pretrained(path)
    if tokenizer:
        make_tokenizer(text()).save_pretrained(path)
    return path


def make_data(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    body = text()
    third = len(body) // 3
    for i in range(3):
        (path / f"part-{i}.txt").write_text(body[i * third:(i + 1) * third], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real")
    make_folder(root / "model")
    make_data(root / "corpus")
    return root


@pytest.fixture
def cli():
    runner = CliRunner()
    threads = torch.get_num_threads()

    def invoke(*args: str) -> str:
        result = runner.invoke(app, ["train", *args])
        assert result.exit_code == 0, result.output
        return result.output

    yield invoke
    torch.set_num_threads(threads)


def _lines(pattern: re.Pattern, output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for line in output.splitlines()
            if (m := pattern.match(line))}


def test_a_model_folder_trains_on_text_files_evaluates_resumes_and_exports(workspace, cli):
    model, corpus = str(workspace / "model"), str(workspace / "corpus")
    args = ["--model", model, "--data", corpus, *COMMON]
    whole = cli(*args, "--save-dir", str(workspace / "a"))
    assert "LlamaForCausalLM" in whole and "the model folder's tokenizer" in whole, whole
    steps, evals = _lines(LINE, whole), _lines(EVAL, whole)
    assert sorted(steps) == [1, 2, 3, 4] and sorted(evals) == [2, 4], whole

    first = cli(*args, "--save-dir", str(workspace / "b"), "--stop-after", "2")
    assert sorted(_lines(LINE, first)) == [1, 2]
    out = workspace / "exported"
    metrics = workspace / "metrics.jsonl"
    second = cli(*args, "--save-dir", str(workspace / "b"), "--resume",
                 "--save-pretrained", str(out), "--metrics", str(metrics))
    assert sorted(_lines(LINE, second)) == [3, 4]
    # resumed exactly: the same float reprs as the uninterrupted run
    assert {**_lines(LINE, first), **_lines(LINE, second)} == steps
    assert {**_lines(EVAL, first), **_lines(EVAL, second)} == evals
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("step", 3), ("step", 4), ("eval", 4)]
    assert repr(records[-1]["eval_loss"]) == evals[4]

    # transformers loads the output, and it holds the trained weights (the last checkpoint)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    trained = transformers.LlamaForCausalLM(llama_config())
    tl.load(trained, None, str(workspace / "b"))
    expected = trained.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    start = transformers.LlamaForCausalLM.from_pretrained(model).state_dict()
    assert not torch.equal(start["model.layers.0.mlp.up_proj.weight"],
                           expected["model.layers.0.mlp.up_proj.weight"])  # it trained

    # the reported held-out loss, recomputed here from the files and the exported model
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids: list[int] = []
    for path in sorted((workspace / "corpus").iterdir()):
        ids += tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        ids.append(tokenizer.eos_token_id)
    held_out = ids[len(ids) - int(len(ids) * 0.1):]
    windows = torch.tensor(held_out[:len(held_out) // 32 * 32]).reshape(-1, 32)
    count = min(4, len(windows) // 4)
    loaded.eval()
    with torch.no_grad():
        losses = [loaded(input_ids=windows[b * 4:(b + 1) * 4],
                         labels=windows[b * 4:(b + 1) * 4]).loss for b in range(count)]
    assert count >= 1
    assert abs(float(torch.stack(losses).mean()) - float(evals[4])) < 1e-5


def test_a_config_file_trains_from_random_init_and_flags_override_a_toml_file(
        workspace, cli, tmp_path):
    config = tmp_path / "llama.json"
    llama_config(vocab_size=256).to_json_file(config)
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{config}"\ndata = ["{workspace / "corpus"}"]\nsteps = 9\n'
                    'batch-size = 2\nseq_len = 16\nlr_decay = "linear"\n')
    output = cli("--config", str(toml), "--steps", "2", "--threads", "1", "--no-progress")
    steps = _lines(LINE, output)
    assert sorted(steps) == [1, 2], output  # --steps 2 beat the file's 9
    assert "parameters (random init);" in output and "(bytes)" in output
    # the banner names the layout, the batch rule and where the schedule came from
    assert "1 rank: one rank, 2 sequences a step; schedule: built-in schedule_llama" in output
    # a random init predicts about uniformly: ln(256)
    assert abs(float(steps[1]) - math.log(256)) < 0.3, steps


def test_grad_accum_clipping_bf16_and_the_learning_rate_schedule():
    base = dict(model="llama", steps=5, batch_size=4, seq_len=16, warmup_steps=2,
                lr_decay="linear", clip_grad=1e9)
    records: list[dict] = []
    plain = T.train_rank(0, T.TrainConfig(**base), report=records.append)
    steps = [r for r in records if r["kind"] == "step"]
    # warm-up over 2 steps, then linear decay to 0.1 x peak at step 5 (progress 0, 1/3, 2/3)
    assert [round(r["lr"], 10) for r in steps] == [5e-4, 1e-3, 1e-3, 7e-4, 4e-4]

    # the norm clip_grad reports is clip_grad_norm_'s on the unscheduled model's first step
    model = zoo.make_model("llama", "tiny", seed=0)
    ids = data.window_batch(data.load_corpus(), 1, 4, 16, 0)
    torch.manual_seed(1_000_003 * 0 + 1)
    model(input_ids=ids, labels=ids).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert abs(steps[0]["grad_norm"] - float(norm)) < 1e-5 * float(norm)

    accumulated = T.train_rank(0, T.TrainConfig(**base, grad_accum=2))
    torch.testing.assert_close(accumulated["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    bf16 = T.train_rank(0, T.TrainConfig(**base, dtype="bf16"))
    assert bf16["losses"] != plain["losses"]  # autocast ran in bf16 ...
    torch.testing.assert_close(bf16["losses"], plain["losses"], rtol=0, atol=0.05)  # ... close


def test_show_states_the_size_of_what_it_shows(workspace):
    runner = CliRunner()
    result = runner.invoke(app, ["show", "gpt2"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    count = sum(p.numel() for p in zoo.make_model("gpt2", "tiny").parameters())
    assert f"gpt2, zoo size 'tiny' (2 layers, hidden 32, vocabulary 256): {count:,}" in text
    assert "other sizes: small (--size)" in text
    result = runner.invoke(app, ["show", "gpt2", "--size", "small"])
    small = sum(p.numel() for p in zoo.make_model("gpt2", "small").parameters())
    assert f"zoo size 'small' (4 layers, hidden 128, vocabulary 256): {small:,}" in \
        " ".join(result.output.split())
    result = runner.invoke(app, ["show", str(workspace / "model"), "--ckpt-ratio", "0.5"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    folder = transformers.LlamaForCausalLM(llama_config())
    assert f"LlamaForCausalLM from its config.json (2 layers, hidden 32, vocabulary 384), " \
        f"{sum(p.numel() for p in folder.parameters()):,}" in text
    assert "sch['model.layers'].checkpoint(ratio=0.5)" in text


def _subprocess(tmp: Path, name: str, *args: str) -> dict[int, dict]:
    """Run ``torchloom train`` in a new process (its ranks print to the real stdout);
    the step records of its metrics file by step, evaluations under ``-step``."""
    import subprocess
    import sys

    metrics = tmp / f"{name}.jsonl"
    done = subprocess.run([sys.executable, "-m", "torchloom", "train", *args, "--metrics",
                           str(metrics)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"] if r["kind"] == "step" else -r["step"]: r for r in records}


@pytest.mark.slow
def test_tensor_parallel_and_fsdp_bf16_runs_match_one_process(workspace, tmp_path):
    args = ["--model", str(workspace / "model"), "--data", str(workspace / "corpus"),
            "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--clip-grad", "1e9",
            "--no-progress"]
    one = _subprocess(tmp_path, "one", *args, "--threads", "1")
    tp = _subprocess(tmp_path, "tp", *args, "--tp", "2")
    fsdp = _subprocess(tmp_path, "fsdp", *args, "--dp", "2", "--dp-mode", "fsdp", "--dtype",
                       "bf16", "--grad-accum", "2")
    assert sorted(one) == sorted(tp) == sorted(fsdp) == [1, 2]
    for step in (1, 2):
        assert abs(one[step]["loss"] - tp[step]["loss"]) < 1e-5
        # the norm over both ranks' shards equals one process's
        assert abs(one[step]["grad_norm"] - tp[step]["grad_norm"]) < 1e-5 * one[step]["grad_norm"]
        assert abs(one[step]["loss"] - fsdp[step]["loss"]) < 0.05  # bf16 compute
        assert abs(one[step]["grad_norm"] - fsdp[step]["grad_norm"]) < 0.05 * one[step]["grad_norm"]


def test_a_folder_missing_a_tensor_is_refused_unless_allow_missing_and_the_banner_says_so(
        workspace, cli, tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=256, max_position_embeddings=64))
    whole, headless, bare = tmp_path / "neox", tmp_path / "headless", tmp_path / "bare"
    for folder in (whole, headless):
        neox.save_pretrained(folder)
    neox.config.save_pretrained(bare)  # a config.json only: random init
    tensors = load_file(headless / "model.safetensors")
    del tensors["embed_out.weight"]  # the head, under the name save_pretrained gives it
    save_file(tensors, headless / "model.safetensors", metadata={"format": "pt"})
    args = ["--data", str(workspace / "corpus"), "--steps", "1", "--batch-size", "2",
            "--seq-len", "16", "--threads", "1", "--no-progress"]

    output = cli("--model", str(whole), *args)
    assert f"parameters (weights: {whole} (" in output and " tensors));" in output, output
    assert ("schedule: derived from transformers' tensor-parallel plan of "
            "GPTNeoXForCausalLM") in output, output
    assert "parameters (random init);" in cli("--model", str(bare), *args)

    result = CliRunner().invoke(app, ["train", "--model", str(headless), *args])
    assert result.exit_code == 2, result.output
    assert ("1 tensor(s) of the model are not in the checkpoint: ['lm_head.weight'] "
            "(strict=True, the default)") in result.output, result.output
    assert "file='model.safetensors'" in result.output
    assert "--allow-missing" in result.output
    assert "step " not in result.output  # nothing trained
    with pytest.warns(UserWarning, match=r"\['lm_head\.weight'\]"):
        output = cli("--model", str(headless), *args, "--allow-missing")
    assert sorted(_lines(LINE, output)) == [1], output
