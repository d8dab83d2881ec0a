"""LoRA fine-tuning in one process (issue 29): the ``lora`` primitive's refusals, an
adapter built over a ``save_pretrained`` folder read under ``init_empty_weights``, what it
writes (peft's adapter folder: ``PeftModel.from_pretrained`` gives the same logits; the
merged model: the same logits as the adapted one), only the adapters train, a bf16 base,
and ``torchloom train --lora`` end to end on chat examples (a ChatML tokenizer made
offline, the model's default config with sizes shrunk): the first loss is the mean over
the response tokens computed here by hand, the adapter loads, ``--merge`` and
``--sample-every`` work, and ``torchloom generate`` answers from the adapter folder,
the same text twice. The layouts are in tests/test_lora_dist.py.
"""

from __future__ import annotations

import json
import re

import peft
import pytest
import torch
import transformers
from typer.testing import CliRunner

import torchloom as tl
from tests.test_chat_data import CHATML, CONVERSATION, make_tokenizer
from torchloom.apps.cli import app
from torchloom.apps.jobconfig import TrainConfig, TrainOptionError
from torchloom.core.errors import CheckpointMismatchError, LoraError, PretrainedError

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=256)
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML
    for name, (config_cls, model_cls) in FAMILIES.items():
        torch.manual_seed(0)
        model_cls(config_cls(**SIZES, vocab_size=len(tokenizer))).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    rows = [{"messages": CONVERSATION},
            {"prompt": "What is two plus two?", "response": "Two plus two is four."},
            {"messages": CONVERSATION[:3]}, {"prompt": "hello there", "response": "Thanks!"}]
    (out / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out


def _meta(folder) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(folder)
    with tl.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_and_merged_model_load_where_users_load_them(root, family, tmp_path) -> None:
    model = _meta(root / family)
    sch = tl.create_schedule(model)
    sch.lora(4, 8, ["q_proj", "v_proj", "down_proj"])
    built, _ = tl.build(sch, weights=str(root / family))
    trainable = [n for n, p in built.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    with torch.no_grad():  # trained adapters: B no longer zero
        for p in built.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    tl.save_adapter(built, tmp_path / "adapter", base_model=str(root / family))
    tl.save_pretrained(built, tmp_path / "merged", merge_adapters=True)
    ids = torch.randint(0, 300, (2, 12))
    ours = built(input_ids=ids).logits
    base = transformers.AutoModelForCausalLM.from_pretrained(root / family)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(loaded(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(PretrainedError, match=r"the model has LoRA adapters \(6 layers\)"):
        tl.save_pretrained(built, tmp_path / "plain")


def test_lora_refuses_what_it_cannot_adapt() -> None:
    def fresh():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        return tl.create_schedule(model)

    with pytest.raises(LoraError, match=r"no module below matches the targets \['q_proj'\]"):
        fresh().lora(4, 8, ["q_proj"])
    with pytest.raises(LoraError, match=r"the target '1' is a LayerNorm, not an nn.Linear"):
        fresh().lora(4, 8, ["1"])
    with pytest.raises(LoraError, match=r"r \(the adapters' rank\) must be a positive integer"):
        fresh().lora(0, 8, ["0"])
    with pytest.raises(LoraError, match=r"dropout must be in \[0, 1\), not 1.5"):
        fresh().lora(4, 8, ["0"], dropout=1.5)
    sch = fresh()
    sch.lora(2, 4, ["0"])
    with pytest.raises(LoraError, match=r"the target '0' already has LoRA adapters"):
        sch.lora(2, 4, ["0"])
    sch = fresh()
    sch["0"].checkpoint()
    with pytest.raises(LoraError, match=r"has its forward wrapped \(checkpoint"):
        sch.lora(2, 4, ["0"])


def test_without_peft_the_fix_is_the_extra(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft":
            raise ImportError("no peft")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(LoraError, match=re.escape('fix: pip install "torchloom[peft]"')):
        sch.lora(2, 4, ["0"])


def test_train_options_are_checked_before_anything_runs(root) -> None:
    with pytest.raises(TrainOptionError, match=r"--lora 'r=8': .*no targets="):
        TrainConfig(lora="r=8")
    with pytest.raises(TrainOptionError, match=r"--merge=True: writes the merged model of a "
                       r"LoRA run: it needs --lora and --save-pretrained"):
        TrainConfig(merge=True)
    with pytest.raises(TrainOptionError, match=r"--lora-base-dtype 'bf16': keeps a frozen "
                       r"base in bf16: it needs --lora"):
        TrainConfig(lora_base_dtype="bf16")
    assert TrainConfig(lora={"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}).lora == \
        "r=8,alpha=16,targets=q_proj,v_proj"


def test_only_the_adapters_train_and_a_bf16_base_stays_frozen(root) -> None:
    from torchloom.apps.train import train_rank

    common = dict(model=str(root / "llama"), steps=2, batch_size=2, seq_len=32,
                  lora="r=4,alpha=8,targets=q_proj,v_proj", progress=False)
    fp32 = train_rank(0, TrainConfig(**common))["losses"]
    bf16 = train_rank(0, TrainConfig(**common, lora_base_dtype="bf16"))["losses"]
    # the same run, its frozen base rounded to bf16
    assert bf16 == pytest.approx(fp32, rel=2e-2) and bf16 != fp32
    from torchloom.apps.train import _Run

    run = _Run(TrainConfig(**common, lora_base_dtype="bf16"), 0, 1, None)
    model, _, params, _, _ = run.build()
    assert {p.dtype for p in params} == {torch.float32}
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}


def test_train_lora_on_chat_examples_end_to_end(root, tmp_path) -> None:
    from torchloom.apps import chat_data

    out = tmp_path / "adapter"
    runner = CliRunner()
    result = runner.invoke(app, [
        "train", "--model", str(root / "llama"), "--data", str(root / "chat.jsonl"),
        "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--steps", "2", "--batch-size", "2",
        "--seq-len", "64", "--lr", "1e-2", "--save-pretrained", str(out), "--merge",
        "--sample-every", "2", "--sample-prompt", "hello", "--sample-tokens", "4",
        "--metrics", str(tmp_path / "m.jsonl"), "--threads", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "wrote the adapter to" in result.output and "sample step     2  > hello" in result.output
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "step")
    # step 1 by hand: the responses' tokens only, the model as loaded
    corpus = chat_data.load_examples([str(root / "chat.jsonl")], str(root / "llama"), 64)
    batch = chat_data.example_batch(corpus, 1, 2, 64, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             target.reshape(-1), ignore_index=-100)
    assert first["loss"] == pytest.approx(float(want), rel=1e-5)
    assert int((target != -100).sum()) < target.numel() // 2  # prompts and padding masked
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    adapted = peft.PeftModel.from_pretrained(base, out)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged")
    ids = batch["input_ids"]
    torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)
    answers = [runner.invoke(app, ["generate", str(out), "--prompt", "hello",
                                   "--max-new-tokens", "6", "--temperature", "0.7",
                                   "--seed", "3"]) for _ in range(2)]
    assert answers[0].exit_code == 0, answers[0].output
    assert answers[0].stdout == answers[1].stdout and "> hello" in answers[0].stdout


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(root, tmp_path) -> None:
    from torchloom.apps.train import train_rank
    from torchloom.runtime.state import list_checkpoints

    common = dict(model=str(root / "qwen2"), steps=4, batch_size=2, seq_len=32,
                  lora="r=4,alpha=8,targets=q_proj,v_proj", progress=False)
    whole = train_rank(0, TrainConfig(**common))["losses"]
    run = str(tmp_path / "run")
    first = train_rank(0, TrainConfig(**common, save_dir=run, stop_after=2))["losses"]
    rest = train_rank(0, TrainConfig(**common, save_dir=run, resume=True))["losses"]
    assert first + rest == whole  # bit for bit
    ckpt = max(list_checkpoints(run), key=lambda c: c.step)
    assert ckpt.step == 4 and ckpt.marker["trainable_only"] is True
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(ckpt.path).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith("optim")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    # build(weights=) of it would leave the base uninitialised: refused, naming the fix
    sch = tl.create_schedule(_meta(root / "qwen2"))
    sch.lora(4, 8, ["q_proj", "v_proj"])
    with pytest.raises(CheckpointMismatchError,
                       match=r"(?s)holds only the tensors that trained.*trainable_only=True.*"
                             r"tl.build\(sch, weights='base-folder'\); tl.load"):
        tl.build(sch, weights=run)
    # the way it is meant: the base from its folder, then the adapters
    sch = tl.create_schedule(_meta(root / "qwen2"))
    sch.lora(4, 8, ["q_proj", "v_proj"])
    built, _ = tl.build(sch, weights=str(root / "qwen2"))
    assert tl.load(built, None, run) == 4


def test_held_out_examples_loss_is_the_responses_loss_of_the_trained_adapter(root, tmp_path):
    from torchloom.apps import chat_data
    from torchloom.apps.train import train_rank

    out = tmp_path / "adapter"
    cfg = TrainConfig(model=str(root / "llama"), data=(str(root / "chat.jsonl"),), steps=2,
                      batch_size=2, seq_len=64, lr=1e-2, eval_every=2, eval_fraction=0.25,
                      lora="r=4,alpha=8,targets=q_proj,v_proj", save_pretrained=str(out),
                      progress=False)
    reported = train_rank(0, cfg)["eval_losses"][2]
    corpus = chat_data.load_examples([str(root / "chat.jsonl")], str(root / "llama"), 64)
    _, held = chat_data.split_rows(corpus, 0.25)
    assert len(held.rows) == 1
    batch = chat_data.eval_batch(held, 0, 2, 64)
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "llama")
    model = peft.PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             batch["labels"][:, 1:].reshape(-1))
    assert reported == pytest.approx(float(want), rel=1e-5)
