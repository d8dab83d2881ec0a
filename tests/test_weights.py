"""build(weights=...) and torchloom.runtime.weights in one process: Hugging Face folders written by
save_pretrained (one file, sharded, .bin), transformers' key renames (base-model prefix both
ways, legacy LayerNorm.gamma/beta), dtype casts, tied weights, slices of sharded tensors
(block-wise chunks=3, fused q/k/v from the original keys), what is missing or mismatched,
untrusted folders, torchloom checkpoints, load_weights on a sub-module, init="local"."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchloom as tl
from torchloom import schedules
from torchloom.core.errors import BuildError
from torchloom.ops.qkv import make_fused_qkv_bert_self_attention
from torchloom.runtime.gather import CheckpointMismatchError
from torchloom.runtime.state import CheckpointIOError
from torchloom.runtime.weights import load_weights, model_keys

SEED = 3


# --------------------------------------------------------------------------- models


def gpt2_cfg() -> transformers.GPT2Config:
    # transformers' defaults, sizes shrunk (the special tokens inside the small vocabulary)
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                   n_positions=64, bos_token_id=0, eos_token_id=0)


def llama_cfg() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=128, max_position_embeddings=64)


def bert_cfg() -> transformers.BertConfig:
    return transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64)


def saved(tmp_path, cls, cfg, name: str = "model", **save_kw) -> str:
    torch.manual_seed(SEED)
    folder = str(tmp_path / name)
    cls(cfg).save_pretrained(folder, **save_kw)
    return folder


def meta_from(folder: str, cls=transformers.AutoModelForCausalLM, **kw) -> nn.Module:
    config = transformers.AutoConfig.from_pretrained(folder)
    with tl.init_empty_weights():
        if cls is transformers.AutoModelForCausalLM:
            return cls.from_config(config, **kw)
        return cls(config, **kw)


def loaded(model: nn.Module, folder: str, **kw) -> nn.Module:
    sch = tl.create_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing missing: no warning
        tl.build(sch, weights=folder, **kw)
    return model


def assert_same_state(model: nn.Module, ref: nn.Module) -> None:
    a, b = model.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- folders


@pytest.mark.parametrize("shard", [None, "8KB"])
def test_gpt2_folder_loads_like_from_pretrained_single_and_sharded(tmp_path, shard):
    kw = {} if shard is None else {"max_shard_size": shard}
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg(), **kw)
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json")) == bool(shard)
    model = loaded(meta_from(folder), folder)
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert_same_state(model, ref)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    model.eval()
    torch.testing.assert_close(model(ids()).logits, ref(ids()).logits, rtol=0, atol=0)


def test_llama_folder_with_untied_head_loads_like_from_pretrained(tmp_path):
    folder = saved(tmp_path, transformers.LlamaForCausalLM, llama_cfg(), max_shard_size="16KB")
    model = loaded(meta_from(folder), folder)
    assert_same_state(model, transformers.LlamaForCausalLM.from_pretrained(folder))


def test_nothing_is_initialised_when_the_files_hold_everything(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    calls: list[str] = []
    rng = torch.get_rng_state()
    loaded(meta_from(folder), folder, param_init_fn=lambda m, p: calls.append(p))
    assert calls == [] and torch.equal(torch.get_rng_state(), rng)  # no init call, no draw


def test_base_model_folder_into_head_model_and_back_like_from_pretrained(tmp_path):
    base = saved(tmp_path, transformers.GPT2Model, gpt2_cfg(), "base")
    head = loaded(meta_from(base), base)  # GPT2LMHeadModel: adds "transformer."
    ref = transformers.GPT2LMHeadModel.from_pretrained(base)
    assert_same_state(head, ref)
    assert head.lm_head.weight is head.transformer.wte.weight

    full = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg(), "head")
    body = loaded(meta_from(full, transformers.GPT2Model), full)  # strips "transformer."
    assert_same_state(body, transformers.GPT2Model.from_pretrained(full))


def test_legacy_layernorm_gamma_beta_names_are_renamed(tmp_path):
    folder = saved(tmp_path, transformers.BertForMaskedLM, bert_cfg())
    ref = transformers.BertForMaskedLM.from_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    from safetensors.torch import load_file

    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                     "LayerNorm.beta"): v
           for k, v in load_file(path).items()}
    assert any(k.endswith("LayerNorm.gamma") for k in old)
    save_file(old, path, metadata={"format": "pt"})
    model = loaded(meta_from(folder, transformers.BertForMaskedLM), folder)
    assert_same_state(model, ref)
    assert_same_state(model, transformers.BertForMaskedLM.from_pretrained(folder))


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    torch.save({k: v.clone() for k, v in ref.state_dict().items() if k != "lm_head.weight"},
               os.path.join(folder, "pytorch_model.bin"))
    assert_same_state(loaded(meta_from(folder), folder), ref)


def test_weights_are_cast_to_the_models_dtype(tmp_path):
    folder = saved(tmp_path, transformers.LlamaForCausalLM, llama_cfg())
    model = loaded(meta_from(folder, dtype=torch.bfloat16), folder)
    ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v.to(model.state_dict()[k].dtype)), k


def test_real_model_is_overwritten_in_place(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    torch.manual_seed(99)
    model = transformers.GPT2LMHeadModel(gpt2_cfg())
    w = model.transformer.h[0].mlp.c_fc.weight
    loaded(model, folder)
    assert model.transformer.h[0].mlp.c_fc.weight is w
    assert_same_state(model, transformers.GPT2LMHeadModel.from_pretrained(folder))


# --------------------------------------------------------------------------- missing, mismatched


def _drop(folder: str, key: str) -> None:
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors[key]
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensors_are_refused_by_default_or_initialised_with_strict_false(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    _drop(folder, "transformer.h.1.mlp.c_fc.weight")
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    for strict in ({}, {"strict": True}):  # the default is strict
        model = meta_from(folder)
        with pytest.raises(CheckpointMismatchError) as err:
            tl.build(tl.create_schedule(model), weights=folder, **strict)
        assert str(err.value).startswith(
            "build(...): 1 tensor(s) of the model are not in the checkpoint: "
            "['transformer.h.1.mlp.c_fc.weight'] (strict=True, the default)")
        assert "file='model.safetensors'" in str(err.value)
        assert "pass strict=False to build / load_weights (torchloom train: " \
            "--allow-missing)" in str(err.value)
        assert model.transformer.h[1].mlp.c_fc.weight.is_meta  # nothing was made
    model = meta_from(folder)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) are not in .*: "
                      r"\['transformer\.h\.1\.mlp\.c_fc\.weight'\]; those that were on meta "
                      r"were initialised"):
        tl.build(tl.create_schedule(model), weights=folder, strict=False)
    w = model.transformer.h[1].mlp.c_fc.weight
    assert not w.is_meta and not torch.isnan(w).any() and 0.01 < w.std() < 0.03  # GPT-2 init
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        if k != "transformer.h.1.mlp.c_fc.weight":
            assert torch.equal(state[k], v), k


def test_shape_mismatch_names_key_file_and_both_shapes(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    cfg = gpt2_cfg()
    cfg.n_inner = 64
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(CheckpointMismatchError,
                       match=r"(?s)'transformer\.h\.0\.mlp\.c_fc\.weight'.*"
                       r"file='model\.safetensors', checkpoint_shape=\(32, 128\), "
                       r"model_shape=\(32, 64\).*fix: "):
        tl.build(tl.create_schedule(model), weights=folder)
    assert model.transformer.wte.weight.is_meta


def test_untrusted_folders_are_refused_with_the_file_named(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg(), max_shard_size="8KB")
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    first = next(iter(data["weight_map"]))
    other = next(v for v in data["weight_map"].values() if v != data["weight_map"][first])
    bad = dict(data, weight_map={**data["weight_map"], first: other})
    with open(index, "w") as f:
        json.dump(bad, f)
    with pytest.raises(CheckpointMismatchError, match=rf"(?s)does not hold.*key='{first}'"):
        tl.build(tl.create_schedule(meta_from(folder)), weights=folder)
    with open(index, "w") as f:
        json.dump(dict(data, weight_map={**data["weight_map"], first: "../../etc/passwd"}), f)
    with pytest.raises(CheckpointIOError, match="outside the folder"):
        tl.build(tl.create_schedule(meta_from(folder)), weights=folder)
    with open(index, "w") as f:
        f.write("[1, 2]")
    with pytest.raises(CheckpointIOError, match="no weight_map"):
        tl.build(tl.create_schedule(meta_from(saved(tmp_path, transformers.GPT2LMHeadModel,
                                                      gpt2_cfg(), "ok"))), weights=folder)
    with pytest.raises(CheckpointIOError, match="holds no weights"):
        tl.build(tl.create_schedule(nn.Linear(2, 2)), weights=str(tmp_path))


# --------------------------------------------------------------------------- sharded slices


@pytest.fixture
def fake_world():
    """A fake process group of 2 in this process, as rank 1 (its collectives do nothing)."""
    def start(world: int = 2, rank: int = 1) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def _assert_slices(model: nn.Module, ref: nn.Module) -> None:
    ref_state = ref.state_dict()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in ref_state:
            continue
        spec = tl.shard_spec(t)
        want = ref_state[name] if spec is None else spec.slice(ref_state[name])
        assert torch.equal(t, want), name


def test_tp_rank_reads_only_its_slices_blockwise_for_fused_qkv(tmp_path, fake_world):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg(), max_shard_size="8KB")
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    fake_world(2, 1)
    model = meta_from(folder)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True)
    spec = tl.shard_spec(model.transformer.h[0].attn.c_attn.weight)
    assert (spec.chunks, spec.world_size, spec.rank) == (3, 2, 1)
    loaded(model, folder)
    _assert_slices(model, ref)
    assert model.transformer.h[0].attn.c_attn.weight.shape == (32, 48)


def test_fused_bert_qkv_reads_the_original_query_key_value(tmp_path, fake_world):
    folder = saved(tmp_path, transformers.BertForMaskedLM, bert_cfg())
    ref = transformers.BertForMaskedLM.from_pretrained(folder)
    fake_world(2, 1)
    model = meta_from(folder, transformers.BertForMaskedLM)
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.*.attention.self"].replace(make_fused_qkv_bert_self_attention)
    for node in sch["bert.encoder.layer.*.attention.self.qkv"]:
        node.shard("weight", 0, chunks=3)
        node.shard("bias", 0, chunks=3)
    loaded(model, folder)
    for i in range(2):
        old = ref.bert.encoder.layer[i].attention.self
        qkv = model.bert.encoder.layer[i].attention.self.qkv
        full = torch.cat([old.query.weight, old.key.weight, old.value.weight])
        assert torch.equal(qkv.weight, tl.shard_spec(qkv.weight).slice(full))
        full_b = torch.cat([old.query.bias, old.key.bias, old.value.bias])
        assert torch.equal(qkv.bias, tl.shard_spec(qkv.bias).slice(full_b))
    assert torch.equal(model.bert.embeddings.word_embeddings.weight,
                       ref.bert.embeddings.word_embeddings.weight)


def test_torchloom_checkpoint_as_weights(tmp_path):
    torch.manual_seed(SEED)
    src = transformers.GPT2LMHeadModel(gpt2_cfg())
    tl.save(src, None, str(tmp_path / "run"), step=1)
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(gpt2_cfg())
    tl.build(tl.create_schedule(model), weights=str(tmp_path / "run"))
    assert_same_state(model, src)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_load_weights_of_one_sub_module_with_its_prefix(tmp_path):
    folder = saved(tmp_path, transformers.GPT2LMHeadModel, gpt2_cfg())
    ref = transformers.GPT2LMHeadModel.from_pretrained(folder)
    model = meta_from(folder)
    report = load_weights(model.transformer.h[1], folder, prefix="transformer.h.1", root=model)
    assert "mlp.c_fc.weight" in report.loaded and report.missing == []
    assert_same_state(model.transformer.h[1], ref.transformer.h[1])
    assert model.transformer.h[0].mlp.c_fc.weight.is_meta  # only that block was read


def test_model_keys_lists_tied_tensors_once_with_every_key():
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(gpt2_cfg())
    tied = [t for t in model_keys(model) if len(t.keys) > 1]
    assert [t.keys for t in tied] == [["transformer.wte.weight", "lm_head.weight"]]


# --------------------------------------------------------------------------- init="local"


def _row_col_model() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512),
                         nn.Embedding(64, 16, padding_idx=40))


def _local_build(world: int, rank: int, seed: int = SEED, init: str = "local") -> nn.Module:
    with tl.init_empty_weights():
        model = _row_col_model()
    sch = tl.create_schedule(model)
    for _, node in sch.named_schedules():
        node.world_size, node.rank = world, rank
    sch["0"].shard("weight", 0)   # column: fan-in whole
    sch["0"].shard("bias", 0)
    sch["1"].shard("weight", 1)   # row: fan-in split, the init must use the full fan-in
    sch["2"].shard("weight", 0)   # vocabulary split; the padding row is on rank 1
    torch.manual_seed(seed)
    tl.build(sch, init=init)
    return model


def test_local_init_has_the_full_inits_distribution_and_replicas_agree():
    ranks = [_local_build(4, r) for r in range(4)]
    full = _local_build(4, 0, init="full")
    # kaiming_uniform(a=sqrt(5)) on Linear(256 -> 512): bound 1/sqrt(full fan-in 256)
    row = torch.cat([m[1].weight for m in ranks], dim=1)
    assert row.abs().max() <= 256 ** -0.5 and row.abs().max() > 0.98 * 256 ** -0.5
    assert abs(row.std().item() - 256 ** -0.5 / 3 ** 0.5) < 0.02 * 256 ** -0.5
    # the slices of different ranks are not copies of one another, nor the full init's
    assert not torch.equal(ranks[0][1].weight, ranks[1][1].weight)
    assert not torch.equal(ranks[0][0].weight, full[0].weight)
    # the replicated bias (its bound from the full fan-in) is the same on every rank
    assert all(torch.equal(m[1].bias, ranks[0][1].bias) for m in ranks)
    assert ranks[0][1].bias.abs().max() <= 256 ** -0.5
    # the padding row (global row 40, local row 8 of rank 2) is zero, no other row is
    emb = torch.cat([m[2].weight for m in ranks])
    assert torch.equal(emb[40], torch.zeros(16)) and bool((emb.abs().sum(1) > 0).sum() == 63)
    # same seed, same values
    assert torch.equal(_local_build(4, 1)[1].weight, ranks[1][1].weight)


def test_error_unknown_init_mode_and_bad_weights_arguments():
    with pytest.raises(BuildError, match=r"unknown init mode 'fast'(?s:.*)fix: build\(sch, "
                       r"init='full'\)"):
        tl.build(tl.create_schedule(nn.Linear(2, 2)), init="fast")
    with pytest.raises(BuildError, match=r"weights must be a folder path, not a dict"):
        tl.build(tl.create_schedule(nn.Linear(2, 2)), weights={})
    with pytest.raises(BuildError, match=r"strict must be True or False"):
        tl.build(tl.create_schedule(nn.Linear(2, 2)), weights="x", strict="yes")


# --------------------------------------------------------------------------- merged experts

def mixtral_cfg() -> transformers.MixtralConfig:
    return transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, max_position_embeddings=64,
                                      num_local_experts=4)


def qwen2_moe_cfg() -> transformers.Qwen2MoeConfig:
    return transformers.Qwen2MoeConfig(hidden_size=32, intermediate_size=48,
                                       moe_intermediate_size=24, shared_expert_intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64, num_experts=4,
                                       num_experts_per_tok=2)


@pytest.mark.parametrize(("cls", "cfg"), [
    (transformers.MixtralForCausalLM, mixtral_cfg),
    (transformers.Qwen2MoeForCausalLM, qwen2_moe_cfg),
])
def test_per_expert_checkpoints_are_merged_like_from_pretrained(tmp_path, cls, cfg):
    # save_pretrained writes one tensor per expert (experts.E.w1 ...); transformers 5's
    # model holds them merged (experts.gate_up_proj: E x (w1 | w3) x hidden)
    folder = saved(tmp_path, cls, cfg(), max_shard_size="40KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        keys = list(json.load(f)["weight_map"])
    assert any(".experts.3." in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    model = loaded(meta_from(folder), folder)
    assert_same_state(model, cls.from_pretrained(folder))


def test_tp_ranks_read_only_their_blocks_of_merged_experts(tmp_path, fake_world):
    folder = saved(tmp_path, transformers.MixtralForCausalLM, mixtral_cfg())
    ref = transformers.MixtralForCausalLM.from_pretrained(folder)
    fake_world(2, 1)
    # each expert split within, as the derived schedule of a plan with moe_tp_experts
    # does it: gate_up along its rows in two blocks ([gate_r | up_r]), down along its
    # columns
    model = meta_from(folder)
    sch = tl.create_schedule(model)
    for i in range(2):
        sch[f"model.layers.{i}.mlp.experts"].shard("gate_up_proj", 1, chunks=2)
        sch[f"model.layers.{i}.mlp.experts"].shard("down_proj", 2)
    spec = tl.shard_spec(model.model.layers[0].mlp.experts.gate_up_proj)
    assert (spec.axis, spec.chunks) == (1, 2)
    loaded(model, folder)
    _assert_slices(model, ref)
    # the experts split between the ranks (by hand): rank 1 holds experts 2 and 3
    model = meta_from(folder)
    sch = tl.create_schedule(model)
    for i in range(2):
        sch[f"model.layers.{i}.mlp.experts"].shard("gate_up_proj", 0)
        sch[f"model.layers.{i}.mlp.experts"].shard("down_proj", 0)
    loaded(model, folder)
    _assert_slices(model, ref)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (2, 96, 32)


def test_a_missing_expert_is_named(tmp_path):
    folder = saved(tmp_path, transformers.MixtralForCausalLM, mixtral_cfg())
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=(
            r"(?s)'model\.layers\.1\.mlp\.experts\.gate_up_proj' merges 4 experts' tensors, "
            r"and the checkpoint's '\.experts\.\*\.w3\.weight' has experts \[0, 1, 3\].*"
            r"missing_experts=\[2\].*fix: load a checkpoint of the model the schedule was "
            r"made from \(same number of experts\)")):
        tl.build(tl.create_schedule(meta_from(folder)), weights=folder)
