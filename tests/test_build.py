"""build and init_empty_weights: meta construction, delayed init equal to eager init, ties,
protection of real weights, sharded materialisation, param_init_fn, and every BuildError."""

from __future__ import annotations

import resource

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

import torchloom as tl
from torchloom.core.errors import BuildError
from torchloom.core.meta import ShardSpec, get_meta, shard_spec
from torchloom.runtime.build import build
from torchloom.runtime.materialise import init_empty_weights

SEED = 7


# --------------------------------------------------------------------------- models


def gpt2_cfg(**kw) -> transformers.GPT2Config:
    args = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                bos_token_id=0, eos_token_id=0)
    args.update(kw)
    return transformers.GPT2Config(**args)


def bert_cfg() -> transformers.BertConfig:
    return transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                   intermediate_size=64, vocab_size=128,
                                   max_position_embeddings=64)


def llama_cfg() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2,
                                    vocab_size=128)


def vit_cfg() -> transformers.ViTConfig:
    # ViT's _init_weights uses trunc_normal_, which returns at once on a meta tensor
    # (torch >= 2.13), so build's dry run cannot see it
    return transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, image_size=32, patch_size=8,
                                  num_labels=3)


HF_MODELS = {
    "vit": (transformers.ViTForImageClassification, vit_cfg),
    "gpt2": (transformers.GPT2LMHeadModel, gpt2_cfg),
    "bert": (transformers.BertForMaskedLM, bert_cfg),
    "llama": (transformers.LlamaForCausalLM, llama_cfg),
}


def plain_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(16, 8, padding_idx=0), nn.Linear(8, 12), nn.LayerNorm(12),
                         nn.GELU(), nn.Sequential(nn.Linear(12, 4), nn.Linear(4, 4, bias=False)))


def eager(factory, seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def meta(factory, include_buffers: bool = False) -> nn.Module:
    with init_empty_weights(include_buffers=include_buffers):
        return factory()


def built(model: nn.Module, seed: int = SEED, **kw) -> nn.Module:
    torch.manual_seed(seed)
    out, _ = build(tl.create_schedule(model), **kw)
    return out


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


def on_meta(model: nn.Module) -> list[str]:
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]


# --------------------------------------------------------------------------- init_empty_weights


class TaggedParameter(nn.Parameter):
    pass


class WithCustomParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        p = TaggedParameter(torch.ones(3), requires_grad=False)
        p.note = "kept"
        self.p = p
        self.register_buffer("b", torch.arange(3.0))


def test_init_empty_weights_puts_params_on_meta_and_keeps_buffers_real():
    model = meta(lambda: transformers.BertForMaskedLM(bert_cfg()))
    assert all(p.is_meta for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    model = meta(lambda: transformers.BertForMaskedLM(bert_cfg()), include_buffers=True)
    assert on_meta(model) == [n for n, _ in [*model.named_parameters(), *model.named_buffers()]]


def test_init_empty_weights_keeps_subclass_requires_grad_and_attributes():
    m = meta(WithCustomParam)
    assert type(m.p) is TaggedParameter and m.p.is_meta
    assert m.p.requires_grad is False and m.p.note == "kept"
    assert not m.b.is_meta


def test_init_empty_weights_restores_the_patch_even_on_error_and_nests():
    orig_p, orig_b = nn.Module.register_parameter, nn.Module.register_buffer
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        with init_empty_weights(include_buffers=True):
            _ = 1 / 0
    assert nn.Module.register_parameter is orig_p and nn.Module.register_buffer is orig_b
    with init_empty_weights():
        with init_empty_weights(include_buffers=True):
            inner = nn.BatchNorm1d(2)
        outer = nn.BatchNorm1d(2)
    assert inner.weight.is_meta and inner.running_mean.is_meta
    assert outer.weight.is_meta and not outer.running_mean.is_meta
    assert nn.Module.register_parameter is orig_p and nn.Module.register_buffer is orig_b
    assert not nn.Linear(2, 2).weight.is_meta


def test_meta_construction_allocates_nothing():
    # 1M x 1024 embedding (+ an lm_head of the same size): ~8 GB if it were allocated.
    cfg = gpt2_cfg(n_layer=1, n_embd=1024, vocab_size=1_000_000)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    model = meta(lambda: transformers.GPT2LMHeadModel(cfg))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert sum(p.numel() for p in model.parameters()) > 1_000_000_000
    assert on_meta(model) == [n for n, _ in model.named_parameters()]
    assert grown_mib < 512


# --------------------------------------------------------------------------- build basics


def test_build_materialises_everything_and_forward_works():
    model = meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()))
    sch = tl.create_schedule(model)
    out, opt = build(sch)
    assert out is model and opt is None
    assert on_meta(model) == []
    assert all(p.device.type == "cpu" for p in model.parameters())
    ids = torch.randint(0, 128, (2, 8))
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 8, 128) and torch.isfinite(logits).all()


def test_build_without_meta_tensors_changes_nothing():
    model = eager(plain_model)
    before = {n: p for n, p in model.named_parameters()}
    values = state(model)
    build(tl.create_schedule(model))
    assert all(p is before[n] for n, p in model.named_parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in values.items())


def test_requires_grad_is_preserved():
    model = meta(plain_model)
    model[1].weight.requires_grad_(False)
    built(model)
    assert model[1].weight.requires_grad is False and model[1].bias.requires_grad is True


# --------------------------------------------------------------------------- delayed == eager


def test_plain_model_delayed_init_equals_eager_construction():
    assert differing(built(meta(plain_model)), eager(plain_model)) == []


class Block(nn.Module):
    """Builds a child, then calls its own reset_parameters, which re-draws the child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.proj = nn.Linear(4, 4)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale)
        nn.init.normal_(self.proj.weight, std=0.1)


def test_children_are_initialised_before_their_parent_like_in_construction():
    make = lambda: nn.Sequential(Block(), Block())  # noqa: E731
    assert differing(built(meta(make)), eager(make)) == []


def test_multihead_attention_uses_its_private_reset_and_equals_eager():
    make = lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)  # noqa: E731
    assert differing(built(meta(make)), eager(make)) == []


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_delayed_init_equals_build_with_init_weights(name):
    cls, cfg = HF_MODELS[name]
    delayed = built(meta(lambda: cls(cfg())))
    reinit = built(eager(lambda: cls(cfg()), seed=123), init_weights=True)
    assert differing(delayed, reinit) == []


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_hf_delayed_init_equals_eager_construction(name):
    cls, cfg = HF_MODELS[name]
    assert differing(built(meta(lambda: cls(cfg()))), eager(lambda: cls(cfg()))) == []


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_hf_meta_buffers_are_recomputed_by_init_weights(name):
    cls, cfg = HF_MODELS[name]
    delayed = built(meta(lambda: cls(cfg()), include_buffers=True))
    assert on_meta(delayed) == []
    assert differing(delayed, eager(lambda: cls(cfg()))) == []


def test_gpt2_differs_from_eager_because_conv1d_draws_in_its_constructor(monkeypatch):
    # Conv1D.__init__ calls nn.init.normal_ directly and has no reset_parameters: that draw
    # cannot be replayed, so every later draw starts from another generator state.
    cls, cfg = HF_MODELS["gpt2"]
    delayed = built(meta(lambda: cls(cfg())))
    diff = differing(delayed, eager(lambda: cls(cfg())))
    assert "transformer.h.0.attn.c_attn.weight" in diff and "transformer.wte.weight" in diff
    # Replaying that draw (the same call, as a reset_parameters) restores bitwise equality.
    monkeypatch.setattr(Conv1D, "reset_parameters",
                        lambda self: nn.init.normal_(self.weight, std=0.02), raising=False)
    assert differing(built(meta(lambda: cls(cfg()))), eager(lambda: cls(cfg()))) == []


# --------------------------------------------------------------------------- ties, optimizer


def test_tied_weights_stay_tied_and_the_optimizer_sees_them_once():
    model = meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()))
    assert model.lm_head.weight is model.transformer.wte.weight
    _, opt = build(tl.create_schedule(model),
                   optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and not wte.is_meta
    params = opt.param_groups[0]["params"]
    assert sum(p is wte for p in params) == 1
    assert len(params) == len({id(p) for p in model.parameters()})
    loss = model(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8))).loss
    loss.backward()
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tied_bert_decoder_and_bias_stay_tied():
    model = built(meta(lambda: transformers.BertForMaskedLM(bert_cfg())))
    head = model.cls.predictions
    assert head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert torch.equal(head.bias, torch.zeros(128))


# --------------------------------------------------------------------------- real weights


def half_meta_gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A meta GPT-2 whose first block and embeddings were loaded with real weights."""
    source = eager(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()), seed=99)
    model = meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()))
    model.transformer.h[0].load_state_dict(source.transformer.h[0].state_dict(), assign=True)
    model.transformer.wte.load_state_dict(source.transformer.wte.state_dict(), assign=True)
    model.tie_weights()
    # c_attn's bias stays meta, so c_attn and GPT2Attention are initialised, and their init
    # (normal_ on c_attn.weight, the scaled re-draw of c_proj.weight) touches real weights
    model.transformer.h[0].attn.c_attn.bias = nn.Parameter(torch.empty(96, device="meta"))
    loaded = {f"transformer.h.0.{k}": v.detach().clone()
              for k, v in source.transformer.h[0].state_dict().items() if k != "attn.c_attn.bias"}
    loaded["transformer.wte.weight"] = source.transformer.wte.weight.detach().clone()
    return model, loaded


def test_real_weights_are_never_overwritten_without_init_weights():
    model, loaded = half_meta_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    objects = {n: model.get_parameter(n) for n in loaded}
    assert not any(t.is_meta for t in objects.values())
    assert model.transformer.h[1].mlp.c_fc.weight.is_meta
    built(model)
    assert torch.equal(model.transformer.h[0].attn.c_attn.bias, torch.zeros(96))
    assert on_meta(model) == []
    for name, value in loaded.items():
        assert model.get_parameter(name) is objects[name]
        assert torch.equal(model.get_parameter(name), value), name
    assert model.lm_head.weight is model.transformer.wte.weight
    # the meta part was initialised: GPT-2 scaled init for c_proj, zero biases, unit norms
    assert model.transformer.h[1].mlp.c_fc.weight.std() > 0
    assert torch.equal(model.transformer.h[1].ln_1.weight, torch.ones(32))


def test_init_weights_true_reinitialises_real_weights_in_place():
    model, loaded = half_meta_gpt2()
    objects = {n: model.get_parameter(n) for n in loaded}
    built(model, init_weights=True)
    for name in loaded:
        assert model.get_parameter(name) is objects[name]
    changed = [n for n, v in loaded.items() if not torch.equal(model.get_parameter(n), v)]
    assert "transformer.wte.weight" in changed and "transformer.h.0.attn.c_attn.weight" in changed
    # same walk, same draws as re-initialising a fully eager model
    assert differing(model, built(eager(lambda: transformers.GPT2LMHeadModel(gpt2_cfg())),
                                  init_weights=True)) == []


def test_hf_is_initialized_flag_does_not_stop_init_weights():
    model = eager(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()), seed=1)
    for p in model.parameters():
        p._is_hf_initialized = True
    before = model.transformer.wpe.weight.detach().clone()
    built(model, init_weights=True)
    assert not torch.equal(model.transformer.wpe.weight, before)
    assert model.transformer.wpe.weight._is_hf_initialized is True


# --------------------------------------------------------------------------- sharding


def test_slice_for_rank_takes_the_ranks_piece():
    full = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(ShardSpec(0, (4, 6), 2, 1).slice(full), full[2:])
    piece = ShardSpec(1, (4, 6), 3, 2).slice(full)
    assert torch.equal(piece, full[:, 4:])
    assert torch.equal(ShardSpec(1, (4, 6), 1, 0).slice(full), full)


def _fake_world(node: tl.Schedule, world_size: int, rank: int) -> None:
    node.world_size, node.rank = world_size, rank


@pytest.mark.parametrize("axis,rank", [(0, 0), (0, 1), (1, 1)])
def test_sharded_meta_params_materialise_to_the_slice_of_the_full_init(axis, rank):
    make = lambda: nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))  # noqa: E731
    model = meta(make)
    sch = tl.create_schedule(model)
    _fake_world(sch["0"], 2, rank)
    sch["0"].shard("weight", axis)
    if axis == 0:
        sch["0"].shard("bias", 0)
    sch["0"].annotate("weight", "tp", "column")
    torch.manual_seed(SEED)
    build(sch)
    ref = eager(make)
    w = model[0].weight
    assert torch.equal(w, ref[0].weight.detach().split(8 // 2 if axis == 0 else 3, axis)[rank])
    assert shard_spec(w) == ShardSpec(axis=axis, full_shape=(8, 6), world_size=2, rank=rank)
    assert w.tp == "column" and get_meta(w).tags == {"tp": "column"}
    if axis == 0:
        assert torch.equal(model[0].bias, ref[0].bias.detach()[4 * rank:4 * rank + 4])
    else:
        assert torch.equal(model[0].bias, ref[0].bias)  # bias init used the full fan-in
    assert torch.equal(model[1].weight, ref[1].weight)  # the draws after it line up


def test_sharded_meta_gpt2_keeps_specs_and_tags_and_equals_unsharded_build():
    model = meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg()))
    sch = tl.create_schedule(model)
    sch["transformer.h.*.mlp.c_fc"].shard("weight", 1)
    sch["transformer.h.*.mlp.c_fc"].shard("bias", 0)
    sch["transformer.h.0.mlp.c_proj"].annotate("weight", "replicated", False)
    torch.manual_seed(SEED)
    build(sch)
    w = model.transformer.h[0].mlp.c_fc.weight
    assert shard_spec(w) == ShardSpec(axis=1, full_shape=(32, 128), world_size=1, rank=0)
    assert model.transformer.h[0].mlp.c_proj.weight.replicated is False
    assert differing(model, built(meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg())))) == []


def test_real_sharded_params_are_kept_or_reinitialised_full_size():
    make = lambda: nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))  # noqa: E731
    model = eager(make, seed=3)
    sch = tl.create_schedule(model)
    _fake_world(sch["0"], 2, 1)
    sch["0"].shard("weight", 0)
    kept = model[0].weight
    values = kept.detach().clone()
    model[0].bias = nn.Parameter(torch.empty(8, device="meta"))
    model[1].weight = nn.Parameter(torch.empty(4, 8, device="meta"))
    model[1].bias = nn.Parameter(torch.empty(4, device="meta"))
    torch.manual_seed(SEED)
    build(sch)
    assert model[0].weight is kept and torch.equal(kept, values)
    # reset_parameters drew the full (8, 6) weight into a scratch tensor, so the bias and
    # the next layer got the same draws as in an eager full model
    ref = eager(make)
    assert torch.equal(model[0].bias, ref[0].bias) and torch.equal(model[1].weight, ref[1].weight)
    torch.manual_seed(SEED)
    build(sch, init_weights=True, rebuild=True)  # re-initialise a built model on purpose
    assert model[0].weight is not kept
    assert torch.equal(model[0].weight, ref[0].weight.detach()[4:])
    assert shard_spec(model[0].weight) == ShardSpec(axis=0, full_shape=(8, 6), world_size=2,
                                                    rank=1)


# --------------------------------------------------------------------------- param_init_fn


def test_param_init_fn_with_module_only():
    calls = []

    def init(module):
        calls.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    model = meta(plain_model)
    build(tl.create_schedule(model), param_init_fn=init)
    assert calls == ["Embedding", "Linear", "LayerNorm", "Linear", "Linear"]
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_param_init_fn_with_module_and_path():
    calls = []

    def init(module, path):
        calls.append(path)
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)

    model = meta(lambda: transformers.GPT2LMHeadModel(gpt2_cfg(n_layer=1)))
    build(tl.create_schedule(model), param_init_fn=init)
    assert calls[:3] == ["transformer.wte", "transformer.wpe", "transformer.h.0.ln_1"]
    # lm_head holds the tied (meta) wte weight, so it is called too; what it writes into the
    # already initialised wte is undone
    assert calls[-2:] == ["transformer.ln_f", "lm_head"]
    assert all(p.abs().sum() == 0 for p in model.parameters())


# --------------------------------------------------------------------------- buffers


class NoInitBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("count", torch.ones((), dtype=torch.long))


def test_meta_buffers_without_init_are_zero_filled():
    model = meta(NoInitBuffer, include_buffers=True)
    assert model.scale.is_meta
    built(model)
    assert torch.equal(model.scale, torch.zeros(2)) and model.count.item() == 0


# --------------------------------------------------------------------------- errors


class Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


def test_error_not_a_schedule():
    with pytest.raises(BuildError, match=r"(?s)^build\(\.\.\.\): build takes the root schedule, "
                       r"not a Sequential.*fix: make a schedule first"):
        build(nn.Sequential())


def test_error_child_schedule():
    sch = tl.create_schedule(plain_model())
    with pytest.raises(BuildError, match=r"(?s)^sch\['4'\]\.build\(\.\.\.\): build takes the root "
                       r"schedule, not a child node.*fix: pass the root schedule: "
                       r"torchloom\.build\(sch\.root\)"):
        build(sch["4"])


@pytest.mark.parametrize("target", ["deepspeed"])
def test_error_planned_target(target):
    sch = tl.create_schedule(plain_model())
    with pytest.raises(BuildError, match=rf"(?s)target '{target}' is not available in this "
                       r"version.*supported=\[None, 'ddp', 'fsdp', 'pipeline'\], planned="
                       r"\['deepspeed'\].*fix: build the scheduled module itself with target=None"):
        build(sch, target=target)


@pytest.mark.parametrize("target", ["ddp", "fsdp"])
def test_error_data_parallel_without_a_process_group(target):
    sch = tl.create_schedule(plain_model())
    with pytest.raises(BuildError, match=rf"(?s)target '{target}' needs an initialised process "
                       r"group.*fix: start with torchrun"):
        build(sch, target=target)


def test_error_unknown_target():
    with pytest.raises(BuildError, match=r"unknown build target 'megatron'"):
        build(tl.create_schedule(plain_model()), target="megatron")


def test_error_module_without_init_code_names_it_and_leaves_the_model_alone():
    model = meta(lambda: nn.Sequential(nn.Linear(3, 3), Bare()))
    with pytest.raises(BuildError, match=r"(?s)^sch\['1'\]\.build\(\.\.\.\): 1 module\(s\) hold "
                       r"meta parameters but have no "
                       r"init code.*modules=\['1 \(Bare: w\)'\].*fix: pass an init function: "
                       r"build\(sch, param_init_fn=.*define reset_parameters\(\) on Bare"):
        build(tl.create_schedule(model))
    assert on_meta(model) == ["0.weight", "0.bias", "1.w"]
    build(tl.create_schedule(model), param_init_fn=lambda m: [nn.init.ones_(p) for p in
                                                              m.parameters(recurse=False)])
    assert torch.equal(model[1].w, torch.ones(3))


class LlamaWithExtra(transformers.LlamaForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.extra = nn.Parameter(torch.ones(4))  # not covered by _init_weights


def test_error_parameter_left_uninitialised_by_hf_init_and_rollback():
    model = meta(lambda: LlamaWithExtra(llama_cfg()))
    with pytest.raises(BuildError, match=r"(?s)^sch\[''\]\.build\(\.\.\.\): 1 parameter\(s\) were "
                       r"not initialised by any init "
                       r"code.*parameters=\['extra'\].*fix: pass an init function that covers "
                       r"them"):
        build(tl.create_schedule(model))
    assert on_meta(model) == [n for n, _ in model.named_parameters()]


def test_error_init_code_raising_is_wrapped():
    class Broken(nn.Linear):
        armed = False

        def reset_parameters(self) -> None:
            if self.armed:
                raise RuntimeError("boom")
            super().reset_parameters()

    model = nn.Sequential(nn.Linear(2, 2))
    with init_empty_weights():
        model.append(Broken(2, 2))
    model[1].armed = True
    first = model[0].weight
    with pytest.raises(BuildError, match=r"(?s)^sch\['1'\]\.build\(\.\.\.\): reset_parameters\(\) "
                       r"of Broken raised RuntimeError: boom.*fix: fix the init code"):
        build(tl.create_schedule(model))
    assert model[1].weight.is_meta and model[0].weight is first


def test_error_bad_param_init_fn_and_optimizer():
    sch = tl.create_schedule(meta(plain_model))
    with pytest.raises(BuildError, match=r"param_init_fn must be callable, not a int"):
        build(sch, param_init_fn=3)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(BuildError, match=r"(?s)optimizer must be a factory params -> Optimizer, "
                       r"not an optimizer instance.*values: optimizer='SGD'.*fix: build\(sch, "
                       r"optimizer=lambda params"):
        build(sch, optimizer=opt)
    with pytest.raises(BuildError, match=r"the optimizer factory raised TypeError"):
        build(sch, optimizer=lambda: None)


def test_error_bad_device():
    sch = tl.create_schedule(meta(plain_model))
    with pytest.raises(BuildError, match=r"cannot materialise onto the meta device"):
        build(sch, device="meta")
    with pytest.raises(BuildError, match=r"'nowhere' is not a device"):
        build(sch, device="nowhere")


def test_error_shard_spec_does_not_match_shape():
    model = meta(lambda: nn.Sequential(nn.Linear(4, 8)))
    sch = tl.create_schedule(model)
    sch["0"].shard("weight", 0)
    model[0].weight = nn.Parameter(torch.empty(2, 4, device="meta"))
    get_meta(model[0].weight).shard = ShardSpec(axis=0, full_shape=(8, 4), world_size=1, rank=0)
    with pytest.raises(BuildError, match=r"(?s)the shape of '0\.weight' does not match its shard "
                       r"spec.*shape=\(2, 4\), local_shape=\(8, 4\), full_shape=\(8, 4\).*fix: "
                       r"shard tensors only through"):
        build(sch)


# --------------------------------------------------------------------------- misuse


def test_build_twice_is_refused_and_rebuild_builds_a_new_optimizer():
    model = meta(plain_model)
    sch = tl.create_schedule(model)
    sch["1"].shard("weight", 0)
    torch.manual_seed(SEED)
    first, opt1 = build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    values = state(first)
    with pytest.raises(BuildError, match=r"(?s)^sch\[''\]\.build\(\.\.\.\): this schedule was already "
                       r"built; a second build.*fix: .*torchloom\.build\(sch, rebuild=True"):
        build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    # rebuild: a new optimizer over the same parameters, nothing re-initialised or undone
    second, opt2 = build(sch, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1), rebuild=True)
    assert second is first and isinstance(opt2, torch.optim.AdamW) and opt2 is not opt1
    assert [p for g in opt2.param_groups for p in g["params"]] == list(model.parameters())
    assert not [k for k, v in state(second).items() if not torch.equal(v, values[k])]
    assert shard_spec(model[1].weight) is not None and sch.built
    # rebuild with init_weights=True re-initialises every tensor (new values, new objects)
    torch.manual_seed(SEED + 1)
    build(sch, init_weights=True, rebuild=True)
    assert not torch.equal(model[1].bias, values["1.bias"])


def test_optimizer_factory_must_return_an_optimizer():
    sch = tl.create_schedule(meta(plain_model))
    with pytest.raises(BuildError, match=r"(?s)the optimizer factory returned a int, not a "
                       r"torch\.optim\.Optimizer.*returned='int'"):
        build(sch, optimizer=lambda ps: 42)
    assert not sch.built  # a failed build can be retried
    _, opt = build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert isinstance(opt, torch.optim.SGD) and sch.built


def _eval_mode_warnings(model: nn.Module, *primitives: str) -> list[str]:
    import warnings

    sch = tl.create_schedule(model)
    for name in primitives:
        getattr(sch["transformer.h"] if name == "checkpoint" else sch["transformer.drop"],
                name)(*((0.5,) if name == "checkpoint" else ()))
    sch["transformer.h.0.mlp.c_fc"].annotate("weight", "note", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(sch)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and "eval mode" in str(w.message)]


def test_build_warns_once_about_an_eval_mode_model_with_training_only_primitives(tmp_path):
    tl.set_random_seed(0)
    transformers.GPT2LMHeadModel(gpt2_cfg()).save_pretrained(tmp_path)
    pretrained = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert not pretrained.training  # what from_pretrained returns
    found = _eval_mode_warnings(pretrained, "checkpoint", "fork_rng")
    assert len(found) == 1, found  # one warning per build call, not one per module
    assert found[0].startswith(
        "build: the model is in eval mode, so checkpoint / fork_rng at 'transformer.h', "
        "'transformer.drop' do nothing")
    assert "call model.train()" in found[0]
    # a model in training mode, or an eval model with no training-only primitive: silent
    train = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).train()
    assert _eval_mode_warnings(train, "checkpoint", "fork_rng") == []
    assert _eval_mode_warnings(transformers.GPT2LMHeadModel.from_pretrained(tmp_path)) == []


# --------------------------------------------------------------------------- one module at a time
# (issue 14: build from meta holds this rank's shard plus the full-size tensors of the
# module being initialised; the values are still those of the unsharded init, sliced)


@pytest.fixture
def fake_rank1():
    """Rank 1 of a fake process group of 2 in this process (collectives do nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_tp_rank_from_meta_equals_the_slices_of_the_unsharded_init(name, fake_rank1):
    from torchloom import schedules

    cls, cfg = HF_MODELS[name]
    whole = built(meta(lambda: cls(cfg())))  # same seed, no schedule
    model = meta(lambda: cls(cfg()))
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True)  # GPT-2: c_attn chunks=3, tied wte / lm_head
    torch.manual_seed(SEED)
    build(sch)
    ref = state(whole)
    specs = 0
    for key, value in model.state_dict(keep_vars=True).items():
        spec = shard_spec(value)
        specs += spec is not None
        want = spec.slice(ref[key]) if spec is not None else ref[key]
        assert torch.equal(value.detach(), want), key
    assert specs >= 8
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight


class RedrawsChild(nn.Module):
    """A parent whose init writes a child's tensor (as GPT-2's attention re-draws
    c_proj.weight), and one that reads its child's whole tensor (a norm of it)."""

    def __init__(self, normalise: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.normalise = normalise
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.normalise:
            self.fc.weight.div_(self.fc.weight.norm())
        else:
            nn.init.normal_(self.fc.weight, std=0.5)


def test_a_parent_writing_a_childs_sharded_tensor_equals_the_unsharded_init():
    model = meta(lambda: nn.Sequential(RedrawsChild(), nn.Linear(8, 2)))
    sch = tl.create_schedule(model)
    _fake_world(sch["0.fc"], 2, 1)
    sch["0.fc"].shard("weight", 0)
    torch.manual_seed(SEED)
    build(sch)
    ref = eager(lambda: nn.Sequential(RedrawsChild(), nn.Linear(8, 2)))
    assert torch.equal(model[0].fc.weight, ref[0].fc.weight.detach()[4:])
    assert torch.equal(model[1].weight, ref[1].weight)


def test_an_init_reading_the_parts_other_ranks_keep_is_refused():
    model = meta(lambda: nn.Sequential(RedrawsChild(normalise=True)))
    sch = tl.create_schedule(model)
    _fake_world(sch["0.fc"], 2, 1)
    sch["0.fc"].shard("weight", 0)
    with pytest.raises(BuildError, match=r"(?s)init code of 0 read the parts of '0\.fc\.weight' "
                       r"that other ranks keep.*fix: pass build\(sch, param_init_fn=fn\)"):
        build(sch)
    assert model[0].fc.weight.is_meta  # rolled back
    # unsharded, the same init is fine
    whole = meta(lambda: nn.Sequential(RedrawsChild(normalise=True)))
    built(whole)
    assert torch.allclose(whole[0].fc.weight.norm(), torch.tensor(1.0))


class ItemInInit(nn.Linear):
    """An init that reads a value (``.item()``), which the dry run on meta cannot do."""

    armed = False  # set after construction (under init_empty_weights it would fail)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.armed and self.weight.sum().item() > 1e9:  # never true; a real read
            self.weight.zero_()


def test_init_code_the_dry_run_cannot_run_falls_back_to_the_whole_module():
    model = meta(lambda: nn.Sequential(ItemInInit(4, 6), nn.Linear(6, 2)))
    model[0].armed = True
    sch = tl.create_schedule(model)
    _fake_world(sch["0"], 2, 0)
    sch["0"].shard("weight", 0)
    torch.manual_seed(SEED)
    build(sch)
    ref = eager(lambda: nn.Sequential(ItemInInit(4, 6), nn.Linear(6, 2)))
    assert torch.equal(model[0].weight, ref[0].weight.detach()[:3])
    assert torch.equal(model[1].weight, ref[1].weight)


def test_gradient_hooks_on_meta_parameters_survive_build():
    model = meta(lambda: nn.Linear(3, 2))
    model.weight.register_hook(lambda grad: grad * 10)
    built(model)
    model(torch.ones(1, 3)).sum().backward()
    assert torch.equal(model.weight.grad, torch.full((2, 3), 10.0))
