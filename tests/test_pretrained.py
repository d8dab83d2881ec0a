"""tl.save_pretrained in one process: the folder transformers' from_pretrained loads.

Models come from transformers' DEFAULT configs with only sizes shrunk. Each test loads
the written folder with ``from_pretrained(..., output_loading_info=True)`` into the
unmodified class and checks: no missing / unexpected / mismatched keys, every tensor
bit-equal to ``tl.full_state_dict`` of the scheduled model (or the original's keys for a
fused q/k/v), and the same logits.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open
from torch import nn

import torchloom as tl
from torchloom.ops import make_fused_qkv_bert_self_attention


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64))


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))


def bert() -> transformers.BertForMaskedLM:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=128, max_position_embeddings=64))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def _load(cls: type, path: str) -> nn.Module:
    loaded, info = cls.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return loaded


def _assert_bit_equal(loaded: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                assert f.metadata() == {"format": "pt"}
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize(("make", "shard_size"), [(gpt2, "5GB"), (gpt2, "20KB"),
                                                 (llama, "20KB")])
def test_same_folder_as_transformers(tmp_path, make, shard_size):
    """Same file names, the same index (split, weight map, sizes), byte-equal config and
    generation config, and the same tensors as transformers' own save_pretrained; tied
    GPT-2 head written once (under the embedding's key), as transformers does."""
    model = make()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    tl.save_pretrained(model, ours, max_shard_size=shard_size)
    make().save_pretrained(theirs, max_shard_size=shard_size)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for name in os.listdir(theirs):
        if name.endswith(".json"):
            with open(os.path.join(ours, name)) as a, open(os.path.join(theirs, name)) as b:
                assert a.read() == b.read(), name
    sharded = shard_size != "5GB"
    assert ("model.safetensors.index.json" in os.listdir(ours)) == sharded
    if sharded:
        with open(os.path.join(ours, "model.safetensors.index.json")) as f:
            assert len(set(json.load(f)["weight_map"].values())) > 2
    a, b = _tensors(ours), _tensors(theirs)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if isinstance(model, transformers.GPT2LMHeadModel):
        assert "lm_head.weight" not in a and "transformer.wte.weight" in a
    loaded = _load(type(model), ours)
    _assert_bit_equal(loaded, tl.full_state_dict(model))


def test_scheduled_and_trained_model(tmp_path):
    """A model under a (one-process) TP schedule with checkpointing, after a training
    step: the folder holds the trained weights; the loaded model gives the same logits."""
    from torchloom.schedules import apply_schedule

    model = gpt2()
    sch = tl.create_schedule(model)
    apply_schedule(sch, tp=True, ckpt_ratio=0.5)
    model, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    path = str(tmp_path / "out")
    tl.save_pretrained(model, path)
    loaded = _load(transformers.GPT2LMHeadModel, path)
    _assert_bit_equal(loaded, tl.full_state_dict(model))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    model.eval()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_qkv_writes_the_original_keys(tmp_path):
    """BERT with torchloom's fused q/k/v attention: the folder has query/key/value (not
    qkv) with the original values, and loads into the unmodified BertForMaskedLM."""
    original = bert().eval()
    fused = copy.deepcopy(original)
    sch = tl.create_schedule(fused)
    for node in sch["bert.encoder.layer.*.attention.self"]:
        node.replace(make_fused_qkv_bert_self_attention)
    assert any(k.endswith("qkv.weight") for k, _ in fused.named_parameters())
    path = str(tmp_path / "out")
    tl.save_pretrained(fused, path)
    written = _tensors(path)
    assert not any("qkv" in k for k in written)
    loaded = _load(transformers.BertForMaskedLM, path)
    _assert_bit_equal(loaded, original.state_dict())
    _assert_bit_equal(loaded, tl.full_state_dict(fused))
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, fused(ids).logits, rtol=1e-5, atol=1e-5)


def test_traced_model_keeps_keys_and_class(tmp_path):
    """A model traced down to its layers (fx GraphModule subclasses) keeps its keys, and
    config.json names the original class, not the traced one."""
    model = llama().eval()
    sch = tl.create_schedule(model)
    sch.trace_until("model.layers.*", example_inputs={"input_ids": _ids()})
    assert type(sch.mod) is not transformers.LlamaForCausalLM
    path = str(tmp_path / "out")
    tl.save_pretrained(sch.mod, path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    loaded = _load(transformers.LlamaForCausalLM, path)
    _assert_bit_equal(loaded, tl.full_state_dict(sch.mod))
    ids = _ids()
    torch.testing.assert_close(loaded(ids).logits, sch.mod(input_ids=ids).logits,
                               rtol=1e-5, atol=1e-5)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight


def test_plain_module_ties_and_replacement(tmp_path):
    """A module that is not a transformers model: weights only, a tied weight once (under
    its first key); saving again replaces the previous output (also a sharded one) and
    leaves no temporary folder behind."""
    model = _Tied()
    path = tmp_path / "out"
    tl.save_pretrained(model, path, max_shard_size=40)
    first = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in first and "config.json" not in first
    written = _tensors(str(path))
    assert set(written) == {"a.weight", "a.bias", "b.bias"}
    assert torch.equal(written["a.weight"], model.a.weight)
    with torch.no_grad():
        model.a.weight.add_(1.0)
    tl.save_pretrained(model, path)
    assert sorted(os.listdir(path)) == ["model.safetensors"]
    assert torch.equal(_tensors(str(path))["a.weight"], model.a.weight)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_failed_write_keeps_the_previous_folder(tmp_path, monkeypatch):
    """A write that fails (here: safetensors raising, as on a full disk) raises
    PretrainedError and leaves the previous folder as it was, with no temporary left."""
    import safetensors.torch

    model = gpt2()
    path = tmp_path / "out"
    tl.save_pretrained(model, path)
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(tl.PretrainedError, match=r"(?s)No space left on device.*fix: fix "
                                                 r"the cause"):
        tl.save_pretrained(model, path)
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]
