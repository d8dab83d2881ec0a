"""``torchloom generate`` and :mod:`torchloom.apps.generate`: what a model folder or a peft
LoRA adapter folder answers, offline.

The model is transformers' default Llama with its sizes shrunk, written by
``save_pretrained`` with a byte-level BPE tokenizer trained here (offline) that carries a
ChatML-like chat template. Checks that can fail independently of the code under test:

* greedy ids equal transformers' own ``model.generate(do_sample=False)``;
* a LoRA adapter folder loads into a model whose logits equal those of the in-memory
  ``PeftModel`` it was saved from (and differ from the base model's); the command answers
  as that in-memory model does;
* sampling is deterministic per seed; the ``share`` callback gives a rank without logits
  the ids of the rank that has them;
* every refusal names the values and the fix, and nothing is downloaded.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from torchloom.apps import generate as G
from torchloom.apps.cli import app
from torchloom.core.errors import CliOptionError

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on this file (offline), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([Path(__file__).read_text(encoding="utf-8")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama(vocab_size: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=128))


def lora(model: torch.nn.Module):
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def base_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True).eval()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """model/ (Llama + chat tokenizer), adapter/ (LoRA on it, base recorded as the absolute
    path), bytes/ (Llama with 256 tokens, no tokenizer)."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer = make_tokenizer()
    llama(len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lora(base_model(root / "model")).save_pretrained(root / "adapter")
    llama(256).save_pretrained(root / "bytes")
    return root


@pytest.fixture(scope="module")
def peft_model(work):
    """The in-memory PeftModel the adapter folder was saved from (same seeds)."""
    return lora(base_model(work / "model")).eval()


def run(*args: str, code: int = 0):
    result = CliRunner().invoke(app, ["generate", *args, "--threads", "1"])
    assert result.exit_code == code, result.output
    return result


def logits_of(model: torch.nn.Module):
    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    return logits_fn


# --------------------------------------------------------------------------- model folder


def test_recorded_base_is_the_path_given_to_from_pretrained(work):
    config = json.loads((work / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(work / "model")


def test_cli_answers_a_model_folder(work):
    result = run(str(work / "model"), "--prompt", "hi", "--prompt", "def f", "--max-new-tokens",
                 "8")
    model, tokenizer = G.load_for_generation(str(work / "model"))
    assert tokenizer is not None and tokenizer.chat_template
    expected = "".join(f"> {p}\n{G.answer(model, tokenizer, p, max_new_tokens=8)}\n\n"
                       for p in ("hi", "def f"))
    assert result.stdout == expected
    assert "tokenizer, chat template; greedy" in result.stderr


def test_greedy_ids_equal_transformers_generate(work):
    model, tokenizer = G.load_for_generation(str(work / "model"))
    assert not model.training
    for prompt, chat in (("hi", True), ("def answer(model):", False)):
        ids = G.render_prompt(tokenizer, prompt, chat=chat)
        eos = model.generation_config.eos_token_id
        ours = G.generate_ids(logits_of(model), ids, max_new_tokens=8, eos_id=eos)
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=8, eos_token_id=eos, pad_token_id=eos)
        assert ours.tolist() == theirs[:, ids.shape[1]:].tolist()
        assert ours.shape[1] >= 1


def test_render_prompt_uses_the_chat_template(work):
    _, tokenizer = G.load_for_generation(str(work / "model"))
    chat = G.render_prompt(tokenizer, "hi")
    assert chat.dtype == torch.int64 and chat.shape[0] == 1
    text = tokenizer.decode(chat[0].tolist())
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    plain = G.render_prompt(tokenizer, "hi", chat=False)
    assert plain.tolist() == [tokenizer("hi")["input_ids"]]
    result = run(str(work / "model"), "-p", "hi", "--max-new-tokens", "4",
                 "--no-chat-template")
    model, _ = G.load_for_generation(str(work / "model"))
    assert result.stdout == f"> hi\n{G.answer(model, tokenizer, 'hi', max_new_tokens=4, chat=False)}\n\n"


def test_sampling_is_seeded(work):
    args = (str(work / "model"), "-p", "hi", "--max-new-tokens", "8", "--temperature", "1.5")
    first = run(*args, "--seed", "3").stdout
    assert run(*args, "--seed", "3").stdout == first
    seeds = {run(*args, "--seed", str(s)).stdout for s in range(4)}
    assert len(seeds) > 1  # sampling does sample
    model, tokenizer = G.load_for_generation(str(work / "model"))
    ids = G.render_prompt(tokenizer, "hi")
    greedy = G.generate_ids(logits_of(model), ids, max_new_tokens=6)
    top1 = G.generate_ids(logits_of(model), ids, max_new_tokens=6, temperature=2.0, top_k=1)
    assert top1.tolist() == greedy.tolist()


# --------------------------------------------------------------------------- adapters


def test_adapter_folder_logits_equal_the_peft_model(work, peft_model):
    model, tokenizer = G.load_for_generation(str(work / "adapter"))
    assert tokenizer is not None  # the base folder's
    ids = G.render_prompt(tokenizer, "hello there")
    with torch.no_grad():
        loaded = model(input_ids=ids).logits
        expected = peft_model(input_ids=ids).logits
        base = base_model(work / "model")(input_ids=ids).logits
    torch.testing.assert_close(loaded, expected, rtol=0, atol=0)
    assert (loaded - base).abs().max() > 1e-3  # the adapter changes the outputs


def test_cli_answers_an_adapter_folder(work, peft_model):
    result = run(str(work / "adapter"), "-p", "hi", "--max-new-tokens", "8")
    _, tokenizer = G.load_for_generation(str(work / "model"))
    assert result.stdout == f"> hi\n{G.answer(peft_model, tokenizer, 'hi', max_new_tokens=8)}\n\n"
    assert re.search(r"LoRA adapter .*adapter on .*model", result.stderr)


def _copy_adapter(work: Path, name: str, base: object, tmp_path: Path) -> Path:
    folder = tmp_path / name
    shutil.copytree(work / "adapter", folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_relative_base_and_base_override(work, peft_model, tmp_path, monkeypatch):
    shutil.copytree(work / "model", tmp_path / "llama")
    near = _copy_adapter(work, "near", "../llama", tmp_path)  # relative to the adapter
    source = G.resolve_folder(str(near))
    assert Path(source.model_folder).resolve() == (tmp_path / "llama").resolve()
    assert source.tokenizer_folder == source.model_folder
    monkeypatch.chdir(tmp_path)
    cwd = _copy_adapter(work, "cwd", "llama", tmp_path)  # relative to the working directory
    assert Path(G.resolve_folder(str(cwd)).model_folder).resolve() == \
        (tmp_path / "llama").resolve()
    hub = _copy_adapter(work, "hub", "meta-llama/Llama-3-8B", tmp_path)
    ids = torch.tensor([[3, 70, 80, 90]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        for folder, base in ((near, None), (cwd, None), (hub, str(work / "model"))):
            model, _ = G.load_for_generation(str(folder), base=base)
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    result = run(str(hub), "--base", str(work / "model"), "-p", "hi", "--max-new-tokens", "4")
    assert result.stdout.startswith("> hi\n")


def test_hub_base_is_refused_without_download(work, tmp_path, monkeypatch):
    hub = _copy_adapter(work, "hub", "meta-llama/Llama-3-8B", tmp_path)

    def no_loading(*args, **kwargs):
        raise AssertionError("must not load or download anything")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_loading)
    result = run(str(hub), "-p", "hi", code=2)
    assert re.search(r"error: load_for_generation\(\.\.\.\): the adapter's base model "
                     r"'meta-llama/Llama-3-8B' is not a local folder \(torchloom generate "
                     r"never downloads", result.output)
    assert "base_model_name_or_path='meta-llama/Llama-3-8B'" in result.output
    assert re.search(r"fix: .*--base FOLDER", result.output)
    assert "Traceback" not in result.output
    with pytest.raises(CliOptionError, match=r"not a local folder"):
        G.load_for_generation(str(hub))


def test_peft_not_installed(work, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(CliOptionError, match=r"needs peft, which is not installed[\s\S]*"
                       r'fix: pip install "torchloom\[peft\]"'):
        G.load_for_generation(str(work / "adapter"))


# --------------------------------------------------------------------------- bytes


def test_bytes_mode(work):
    result = run(str(work / "bytes"), "-p", "héllo", "--max-new-tokens", "6")
    assert "bytes (no tokenizer)" in result.stderr
    model, tokenizer = G.load_for_generation(str(work / "bytes"))
    assert tokenizer is None
    ids = G.render_prompt(None, "héllo")
    assert ids.tolist() == [list("héllo".encode())]
    new = G.generate_ids(logits_of(model), ids, max_new_tokens=6)
    assert new.shape == (1, 6)  # no end-of-sequence token without a tokenizer
    assert result.stdout == f"> héllo\n{G.decode(None, new)}\n\n"
    assert G.decode(None, torch.tensor([[0xC3, 0xA9, 0xFF, 300]])) == "é\ufffd\ufffd"


def test_vocabulary_too_small_for_bytes(work, tmp_path):
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=64))
    small.save_pretrained(tmp_path / "small")
    result = run(str(tmp_path / "small"), "-p", "hi", code=2)
    assert re.search(r"the prompt has token id 105, but the model's vocabulary has 100 "
                     r"entries \(tokens: bytes\)", result.output)
    result = run(str(tmp_path / "small"), "-p", "\x01", "--max-new-tokens", "64", code=2)
    assert re.search(r"exceed the model's positions\n.*prompt_tokens=1, max_new_tokens=64, "
                     r"positions=64\n.*fix: --max-new-tokens 63", result.output)


# --------------------------------------------------------------------------- refusals


def _broken_adapter(tmp_path: Path, work: Path, text: str) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(work / "adapter", folder)
    (folder / "adapter_config.json").write_text(text)
    return folder


@pytest.mark.parametrize("case, pattern", [
    ("missing", r"load_for_generation\(\.\.\.\): the folder does not exist\n"
                r"    values: folder='.*nowhere'\n    fix: pass a folder written by "
                r"save_pretrained"),
    ("file", r"the path is not a folder"),
    ("empty", r"the folder is neither a model folder \(config.json\) nor a peft adapter "
              r"folder \(adapter_config.json\)\n    values: .*files=\['notes.txt'\]"),
    ("bad json", r"adapter_config.json is not readable JSON: JSONDecodeError: .*\n"
                 r"    values: file='.*adapter_config.json'\n    fix: write the adapter again"),
    ("array", r"adapter_config.json is not a JSON object\n.*type='list'"),
    ("not lora", r"not a LoRA adapter's config\n.*peft_type='PROMPT_TUNING'"),
    ("no base", r"names no base model .*\n.*base_model_name_or_path=None\n.*--base FOLDER"),
    ("no weights", r"the adapter folder has no adapter_model.safetensors \(only "
                   r"adapter_model.bin, a pickle, which is not loaded\)"),
    ("base is adapter", r"the adapter's base model folder holds a peft adapter"),
    ("base for model", r"--base applies to a peft adapter folder only"),
])
def test_folder_refusals(work, tmp_path, case, pattern):
    extra: list[str] = []
    folder: Path = tmp_path / "nowhere"
    config = json.loads((work / "adapter" / "adapter_config.json").read_text())
    if case == "file":
        folder = tmp_path / "a.txt"
        folder.write_text("x")
    elif case == "empty":
        folder = tmp_path / "empty"
        folder.mkdir()
        (folder / "notes.txt").write_text("x")
    elif case == "bad json":
        folder = _broken_adapter(tmp_path, work, '{"peft_type": "LORA",')
    elif case == "array":
        folder = _broken_adapter(tmp_path, work, "[1, 2]")
    elif case == "not lora":
        folder = _broken_adapter(tmp_path, work, json.dumps({**config,
                                                             "peft_type": "PROMPT_TUNING"}))
    elif case == "no base":
        folder = _broken_adapter(tmp_path, work, json.dumps(
            {**config, "base_model_name_or_path": None}))
    elif case == "no weights":
        folder = _broken_adapter(tmp_path, work, json.dumps(config))
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    elif case == "base is adapter":  # a model folder with an adapter in it, as the base
        shutil.copytree(work / "model", tmp_path / "both")
        shutil.copy(work / "adapter" / "adapter_config.json", tmp_path / "both")
        folder = _broken_adapter(tmp_path, work, json.dumps(
            {**config, "base_model_name_or_path": str(tmp_path / "both")}))
    elif case == "base for model":
        folder = work / "model"
        extra = ["--base", str(work / "model")]
    result = run(str(folder), "-p", "hi", *extra, code=2)
    assert result.output.startswith("error: "), result.output
    assert re.search(pattern, result.output), result.output
    assert "fix: " in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, pattern", [
    (["--max-new-tokens", "0"], r"--max-new-tokens must be at least 1\n"
                                r"    values: max_new_tokens=0\n    fix: --max-new-tokens 64"),
    (["--temperature", "-0.5"], r"--temperature must be a finite number >= 0 \(0: greedy\)\n"
                                r"    values: temperature=-0.5"),
    (["--temperature", "nan"], r"--temperature must be a finite number"),
    (["--top-k", "0"], r"--top-k must be at least 1\n    values: top_k=0"),
    (["--threads", "0"], r"--threads must be at least 1"),
    ([], r"no prompt given\n.*\n    fix: torchloom generate FOLDER --prompt"),
])
def test_option_refusals(work, args, pattern):
    prompt = [] if not args else ["-p", "hi"]
    result = CliRunner().invoke(app, ["generate", str(work / "model"), *prompt, *args])
    assert result.exit_code == 2, result.output
    assert re.search(r"error: torchloom generate\(\.\.\.\): " + pattern, result.output), \
        result.output


def test_bad_device(work):
    with pytest.raises(CliOptionError, match=r"not a torch device\n.*device='gpu7'"):
        G.load_for_generation(str(work / "model"), device="gpu7")


# --------------------------------------------------------------------------- generate_ids


def _counting_logits(vocab: int = 11):
    """Logits that make the next token (sum of the ids) % vocab the most likely."""
    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        target = torch.cumsum(ids, dim=1) % vocab
        return torch.nn.functional.one_hot(target, vocab).float() * 3.0
    return logits_fn


def test_share_gives_a_rank_without_logits_the_same_ids():
    """Two "ranks" in lockstep (threads): rank 0 holds the logits and samples; rank 1's
    logits_fn returns None and its share receives rank 0's token."""
    prompt = torch.tensor([[1, 2, 3]])
    channel: queue.Queue[torch.Tensor] = queue.Queue()
    seen: dict[int, list[list[int]]] = {0: [], 1: []}
    results: dict[int, torch.Tensor] = {}
    placeholders: list[torch.Tensor] = []
    holder = _counting_logits()

    def rank(r: int) -> None:
        def logits_fn(ids: torch.Tensor) -> torch.Tensor | None:
            seen[r].append(ids[0].tolist())
            return holder(ids) if r == 0 else None

        def share(token: torch.Tensor) -> torch.Tensor:
            assert token.shape == (1,) and token.dtype == torch.int64
            if r == 0:
                channel.put(token.clone())
                return token
            placeholders.append(token)
            return channel.get(timeout=30)

        results[r] = G.generate_ids(logits_fn, prompt, max_new_tokens=10, temperature=1.0,
                                    top_k=4, seed=7, eos_id=5, share=share)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[1].tolist() == results[0].tolist()
    assert seen[1] == seen[0] and len(seen[0]) == results[0].shape[1]
    alone = G.generate_ids(holder, prompt, max_new_tokens=10, temperature=1.0, top_k=4,
                           seed=7, eos_id=5)
    assert alone.tolist() == results[0].tolist()  # share changes nothing on the holder
    assert all(p.tolist() == [0] for p in placeholders)


def test_generate_ids_stops_at_eos_and_checks_arguments():
    fn = _counting_logits()
    prompt = torch.tensor([[1, 2]])
    full = G.generate_ids(fn, prompt, max_new_tokens=6)
    assert full.tolist() == [[3, 6, 1, 2, 4, 8]]  # greedy: the running sum mod 11
    assert G.generate_ids(fn, prompt, max_new_tokens=6, eos_id=[1, 9]).tolist() == [[3, 6, 1]]
    with pytest.raises(CliOptionError, match=r"logits_fn returned None, and no share "
                       r"callback[\s\S]*fix: return the \(1, n, vocab\) logits"):
        G.generate_ids(lambda ids: None, prompt, max_new_tokens=2)
    with pytest.raises(CliOptionError, match=r"logits of shape \(1, n, vocab\)\n.*"
                       r"shape=\(2, 11\)"):
        G.generate_ids(lambda ids: fn(ids)[0], prompt, max_new_tokens=2)
    for kwargs, pattern in (({"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1"),
                            ({"max_new_tokens": 2, "temperature": -1.0}, r"temperature must"),
                            ({"max_new_tokens": 2, "top_k": 0}, r"top_k must be")):
        with pytest.raises(CliOptionError, match=pattern):
            G.generate_ids(fn, prompt, **kwargs)
    with pytest.raises(CliOptionError, match=r"prompt_ids must be an integer tensor of shape "
                       r"\(1, n\), n >= 1\n.*shape=\(2,\)"):
        G.generate_ids(fn, torch.tensor([1, 2]), max_new_tokens=2)
    with pytest.raises(CliOptionError, match=r"the prompt has no tokens"):
        G.render_prompt(None, "")
