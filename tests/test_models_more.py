"""The built-in OPT, T5 and ViT schedules in one process.

With a world of one, tensor parallelism records its shards and syncs and changes nothing,
and checkpointing recomputes the same values: the scheduled model's outputs and every
gradient equal the unscheduled model's exactly. The recipes survive JSON, printing and
replay. Sequence parallelism, which OPT and T5 cannot run, is refused with a reason.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom import schedules
from torchloom.core.errors import ScheduleError
from torchloom.core.marks import COMPILED, has_mark
from torchloom.schedules import zoo
from torchloom.tools.testing import verify_recipe_roundtrip

# Config overrides that turn off the dropout the modules hold as float attributes.
NO_DROPOUT = {"opt": {"dropout": 0.0, "attention_dropout": 0.0}, "t5": {"dropout_rate": 0.0},
              "vit": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "gpt2": {}, "bert": {}, "llama": {}}

# (zoo name, extra config fields, transformers class to build instead of the zoo's)
CASES = [
    ("gpt2", {}, None),
    ("bert", {}, None),
    ("llama", {}, None),
    ("opt", {}, None),
    ("opt", {}, "OPTModel"),
    ("t5", {}, None),
    ("t5", {"feed_forward_proj": "gated-gelu"}, None),  # DenseGatedActDense: wi_0, wi_1
    ("t5", {}, "T5Model"),
    ("vit", {}, None),
    ("vit", {}, "ViTModel"),
]


def _make(name: str, extra: dict, cls: str | None) -> nn.Module:
    model = zoo.make_model(name, "tiny", seed=0, **NO_DROPOUT[name], **extra)
    if cls is not None:
        import transformers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(transformers, cls)(model.config).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def _inputs(name: str, model: nn.Module, cls: str | None) -> dict:
    inputs = zoo.example_inputs(name, model, batch_size=2, seq_len=8)
    if cls == "T5Model":
        return {"input_ids": inputs["input_ids"], "decoder_input_ids": inputs["labels"]}
    if cls is not None:
        inputs.pop("labels")
    return inputs


def _loss(out) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out[0].pow(2).mean()


@pytest.mark.parametrize("name,extra,cls", CASES, ids=lambda v: str(v) if v else "")
def test_schedule_changes_nothing_in_one_process(name, extra, cls):
    reference = _make(name, extra, cls)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, cls)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True, ckpt_ratio=0.5)
    assert any(tl.shard_spec(p) is not None for p in model.parameters())
    assert "checkpoint(ratio=0.5)" in str(sch.recipe)

    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=0, atol=0)
    _loss(out).backward()
    _loss(ref_out).backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=0, atol=0,
                                   msg=f"grad of {pname}")

    verify_recipe_roundtrip(sch, partial(_make, name, extra, cls), inputs)


def test_heads_per_rank_factories_are_in_the_recipe():
    sch = tl.create_schedule(_make("t5", {}, None))
    schedules.apply_schedule(sch, tp=True)
    text = str(sch.recipe)
    assert "relative_attention_bias'].shard('weight', 1)" in text
    assert "EncDecAttention'].sync('bwd_post', 'all_reduce', input_name='key_value_states')" \
        in text
    assert "heads_per_rank" in text
    sch = tl.create_schedule(_make("opt", {}, None))
    schedules.apply_schedule(sch, tp=True)
    assert "heads_per_rank" in str(sch.recipe)


@pytest.mark.parametrize("name", ["opt", "t5"])
def test_sequence_parallel_is_refused_where_it_cannot_work(name):
    sch = tl.create_schedule(_make(name, {}, None))
    problem = {"opt": r"the MLP's input cannot be all-gathered along the sequence axis",
               "t5": r"the blocks cannot run on sequence slices"}[name]
    with pytest.raises(ScheduleError, match=rf"\.schedule_{name}\(\.\.\.\): .*{problem}"
                       ) as info:
        schedules.apply_schedule(sch, tp=True, sequence_parallel=True)
    err = info.value
    assert err.primitive == f"schedules.schedule_{name}"
    assert err.values["sequence_parallel"] is True
    assert "without sequence_parallel" in err.fix
    assert len(sch.recipe) == 0  # nothing was applied


def test_vit_sequence_parallel_in_one_process():
    reference = _make("vit", {"image_size": 24}, None)
    model = copy.deepcopy(reference)
    inputs = _inputs("vit", reference, None)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True, sequence_parallel=True)
    torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits,
                               rtol=0, atol=0)


@pytest.mark.parametrize("name,extra,cls", CASES, ids=lambda v: str(v) if v else "")
def test_compile_knob_keeps_outputs_and_gradients(name, extra, cls):
    """``compile=`` compiles every transformer layer in place (here with aot_eager, which
    captures and differentiates the graph like inductor but runs eager kernels) on top of
    TP and checkpointing; outputs and gradients stay equal."""
    reference = _make(name, extra, cls)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, cls)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True, ckpt_ratio=0.5, compile="aot_eager")
    compiled = [path for path, node in sch.named_schedules()
                if has_mark(node.mod, COMPILED)]
    layer_paths = [f"{stack}.{i}" for stack in zoo.layer_paths(name)
                   for i in range(len(model.get_submodule(stack)))] if cls is None else None
    if layer_paths is not None:
        assert compiled == layer_paths
    assert compiled and all("compile(backend='aot_eager')" in line
                            for line in str(sch.recipe).splitlines() if "compile(" in line)
    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-5, atol=1e-6)
    _loss(out).backward()
    _loss(ref_out).backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-6,
                                   msg=f"grad of {pname}")


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_kernel_knobs_with_inductor(name):
    """GPT-2 and BERT with torchloom's kernels (SDPA attention, fused blocks) and every
    layer compiled by inductor: outputs and gradients within 1e-5 of the original."""
    reference = _make(name, {}, None)
    model = copy.deepcopy(reference)
    inputs = _inputs(name, reference, None)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, attention="sdpa", fused=True, ckpt_ratio=0.5, compile=True)
    text = str(sch.recipe)
    assert "make_sdpa_" in text and "make_fused_" in text and ".compile()" in text
    assert list(model.state_dict()) == list(reference.state_dict())
    out, ref_out = model(**inputs), reference(**inputs)
    torch.testing.assert_close(out[0], ref_out[0], rtol=1e-5, atol=1e-5)
    out.loss.backward()
    ref_out.loss.backward()
    ref_params = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[pname].grad, rtol=1e-5, atol=1e-5,
                                   msg=f"grad of {pname}")


def test_kernel_knob_errors():
    sch = tl.create_schedule(_make("gpt2", {}, None))
    with pytest.raises(ScheduleError, match=(
            r"the fused blocks compute their projections without calling the projection "
            r"modules")) as info:
        schedules.apply_schedule(sch, tp=True, fused=True)
    assert str(info.value).splitlines()[0] == (
        "schedules.apply_schedule(...): the fused blocks compute their projections "
        "without calling the projection modules, so tensor parallelism's sync hooks on those "
        "modules would not run")
    assert info.value.fix.startswith("apply_schedule(sch, tp=True, compile=True)")
    with pytest.raises(ScheduleError, match=r"unknown attention kernel 'flash'") as info:
        schedules.apply_schedule(sch, attention="flash")
    assert info.value.values == {"attention": "flash", "choices": ["model", "sdpa"]}
    with pytest.raises(ScheduleError, match=(
            r"compile must be True, False or a torch\.compile backend name")) as info:
        schedules.apply_schedule(sch, tp=True, ckpt_ratio=0.5, compile=1)
    assert info.value.values == {"compile": 1}
    assert info.value.path is None  # a knob is checked when the config is made, before any path
    assert len(sch.recipe) == 0


# --------------------------------------------------------------------------- sizes, knobs, GQA


def _default(cls_name: str, **sizes) -> nn.Module:
    """A transformers model from its default config with only sizes changed."""
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, cls_name)
    return cls(cls.config_class(**sizes))


@pytest.mark.parametrize("cls_name,sizes,knobs", [
    ("LlamaForCausalLM", dict(num_hidden_layers=1, hidden_size=48, intermediate_size=96,
                              num_attention_heads=6, num_key_value_heads=3, vocab_size=64),
     {"tp": True, "ckpt_ratio": 1.0}),
    ("OPTForCausalLM", dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                            ffn_dim=66, vocab_size=64, word_embed_proj_dim=32), {"tp": True}),
    ("T5ForConditionalGeneration", dict(num_layers=1, d_model=32, d_kv=8, num_heads=6,
                                        d_ff=64, vocab_size=64), {"tp": True}),
])
def test_tp_size_refusals_leave_the_model_unchanged(cls_name, sizes, knobs):
    model = _default(cls_name, **sizes)
    before = {k: (v.shape, v.clone()) for k, v in model.state_dict().items()}
    modules = [type(m).__name__ for m in model.modules()]
    sch = tl.create_schedule(model)
    sch.world_size = 4 if "Llama" not in cls_name else 2  # what the checks read
    with pytest.raises(ScheduleError, match="does not divide|neither a multiple"):
        schedules.apply_schedule(sch, **knobs)
    assert len(sch.recipe) == 0
    assert [type(m).__name__ for m in model.modules()] == modules
    for key, value in model.state_dict().items():
        assert value.shape == before[key][0] and torch.equal(value, before[key][1]), key
    assert not any(tl.shard_spec(p) for p in model.parameters())


def test_gpt2_kernel_replacements_wait_for_the_size_checks():
    model = _default("GPT2LMHeadModel", n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                     bos_token_id=0, eos_token_id=0)
    sch = tl.create_schedule(model)
    sch.world_size = 3
    with pytest.raises(ScheduleError, match="n_head=4 does not divide by 3"):
        schedules.apply_schedule(sch, tp=True, attention="sdpa")
    assert len(sch.recipe) == 0
    assert type(model.transformer.h[0].attn).__name__ == "GPT2Attention"


def test_unknown_knob_lists_the_valid_ones():
    sch = tl.create_schedule(_make("t5", {}, None))
    with pytest.raises(ScheduleError,
                       match=r"unknown knob 'ckpt' for the built-in schedule of T5") as info:
        schedules.apply_schedule(sch, tp=True, ckpt=0.5)
    assert info.value.values == {"unknown": ["ckpt"],
                                 "knobs": ["tp", "sequence_parallel", "ckpt_ratio", "compile"]}
    assert info.value.fix == "apply_schedule(sch, ckpt_ratio=0.5)"
    assert len(sch.recipe) == 0


def _rank_attention(full: nn.Module, rank: int, world: int) -> nn.Module:
    """Layer 0's attention as rank ``rank`` of ``world`` holds it under the built-in
    schedule's GQA layout (the rank is faked on the nodes, so no process group)."""
    from torchloom.schedules.llama import replicate_kv_heads

    model = copy.deepcopy(full)
    sch = tl.create_schedule(model)
    attn = sch["model.layers.0.self_attn"]
    for name, axis in (("q_proj", 0), ("o_proj", 1)):
        node = attn[name]
        node.world_size, node.rank = world, rank
        node.shard("weight", axis)
    attn.replace(replicate_kv_heads)
    return model.model.layers[0].self_attn


@pytest.mark.parametrize("kv,world", [(2, 4), (1, 2), (1, 4)])
def test_replicated_kv_heads_add_up_to_the_full_attention(kv, world):
    """The layout and the gradient rule of fewer KV heads than ranks, all ranks in one
    process: rank r's k_proj / v_proj hold KV head ``r * kv // world``; the ranks' o_proj
    partial outputs sum to the full attention's output; and a replicated KV weight's full
    gradient is the sum of its sharing ranks' gradients (what the schedule's grad_sum
    all-reduce computes), while the sum over all ranks would be wrong."""
    full = _default("LlamaForCausalLM", num_hidden_layers=1, hidden_size=64,
                    intermediate_size=128, num_attention_heads=8, num_key_value_heads=kv,
                    vocab_size=64)
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(5)[None].expand(2, -1)
    cos_sin = full.model.rotary_emb(hidden, position_ids)
    weight = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    ref_attn = full.model.layers[0].self_attn
    ref_out = ref_attn(hidden, position_embeddings=cos_sin, attention_mask=None)[0]
    (ref_out * weight).sum().backward()

    ranks = [_rank_attention(full, r, world) for r in range(world)]
    out = sum(attn(hidden, position_embeddings=cos_sin, attention_mask=None)[0]
              for attn in ranks)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    (out * weight).sum().backward()
    replicas, head_dim = world // kv, 8
    for name in ("k_proj", "v_proj"):
        ref_grad = getattr(ref_attn, name).weight.grad
        for g in range(kv):
            sharing = ranks[g * replicas:(g + 1) * replicas]
            for attn in sharing:
                spec = tl.shard_spec(getattr(attn, name).weight)
                assert (spec.replicas, spec.piece, spec.full_shape) == (replicas, g, (kv * 8, 64))
                torch.testing.assert_close(getattr(attn, name).weight.detach(),
                                           getattr(ref_attn, name).weight[spec.slice(
                                               torch.arange(kv * head_dim))].detach())
            summed = sum(getattr(attn, name).weight.grad for attn in sharing)
            rows = ref_grad[g * head_dim:(g + 1) * head_dim]
            torch.testing.assert_close(summed, rows, rtol=1e-5, atol=1e-5)
            if kv > 1:  # all ranks' sum mixes the heads
                wrong = sum(getattr(attn, name).weight.grad for attn in ranks)
                assert not torch.allclose(wrong, rows, rtol=1e-3, atol=1e-3)
    for attn in ranks:
        spec = tl.shard_spec(attn.q_proj.weight)
        torch.testing.assert_close(attn.q_proj.weight.grad,
                                   spec.slice(ref_attn.q_proj.weight.grad), rtol=1e-5, atol=1e-5)
        assert attn.num_key_value_groups == 8 // world
