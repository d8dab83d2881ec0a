"""torchloom.ops kernels: SDPA attention, compiled fused element-wise blocks, fused QKV.

Every replacement is checked on tiny transformers models against the original: the loss,
the logits and every parameter gradient agree to ``TOL`` (float32 on CPU; the measured
differences are ~1e-7, the gap is the reassociation of the fused/SDPA arithmetic).
Only two modules are compiled (``torch.compile`` takes seconds on CPU); the rest use the
eager variants, which run the same functions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from torchloom.core.errors import ReplaceError
from torchloom.core.meta import set_tag
from torchloom.ops import (
    FusedBiasDropoutResidualLayerNorm,
    FusedBiasGelu,
    FusedQKVBertSelfAttention,
    OpsError,
    SDPAAttention,
    gelu_approximation,
    make_fused_bert_intermediate_eager,
    make_fused_bert_output,
    make_fused_bert_output_eager,
    make_fused_gpt2_mlp,
    make_fused_gpt2_mlp_eager,
    make_fused_qkv_bert_self_attention,
    make_sdpa_bert_self_attention,
    make_sdpa_gpt2_attention,
    sdpa_attention,
)
from torchloom.tools.testing import verify_recipe_roundtrip

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _batch(seed: int = 1, batch: int = 2, seq: int = 8, padded: bool = True) -> dict:
    b = tiny.token_batch(seed=seed, batch=batch, seq=seq)
    if padded:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, seq - 3:] = 0  # right padding on the second sequence
        b["attention_mask"] = mask
    return b


def _run(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    logits = out.logits
    if "attention_mask" in batch:  # padded positions carry no meaning
        logits = logits * batch["attention_mask"][..., None]
    (out.loss + logits.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same(ref: nn.Module, new: nn.Module, batch: dict) -> float:
    """Logits and gradients (by parameter name) agree; returns the largest difference."""
    logits_a, grads_a = _run(ref, batch)
    logits_b, grads_b = _run(new, batch)
    torch.testing.assert_close(logits_b, logits_a, **TOL)
    assert grads_a.keys() == grads_b.keys()
    worst = (logits_a - logits_b).abs().max().item()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **TOL, msg=name)
        worst = max(worst, (grads_a[name] - grads_b[name]).abs().max().item())
    return worst


def _replace_all(model: nn.Module, pattern: str, factory) -> None:
    sch = tl.create_schedule(model)
    for node in sch[pattern]:
        node.replace(factory)


# ---------------------------------------------------------------------------- attention


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_gpt2_attention_equals_original(impl: str, padded: bool) -> None:
    ref = tiny.gpt2()
    ref.config._attn_implementation = impl  # eager: float additive masks; sdpa: bool / None
    new = copy.deepcopy(ref)
    before = dict(new.state_dict())
    params = {id(p) for p in new.parameters()}
    _replace_all(new, "transformer.h.*.attn", make_sdpa_gpt2_attention)
    assert type(new.transformer.h[0].attn).__name__ == "SDPAGPT2Attention"
    assert {id(p) for p in new.parameters()} == params  # the same Parameter objects
    assert new.state_dict().keys() == before.keys()
    _assert_same(ref, new, _batch(padded=padded))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sdpa_bert_self_attention_equals_original_with_padding(impl: str) -> None:
    ref = tiny.bert()
    ref.config._attn_implementation = impl
    new = copy.deepcopy(ref)
    keys = new.state_dict().keys()
    _replace_all(new, "bert.encoder.layer.*.attention.self", make_sdpa_bert_self_attention)
    assert type(new.bert.encoder.layer[1].attention.self).__name__ == "SDPABertSelfAttention"
    assert new.state_dict().keys() == keys
    _assert_same(ref, new, _batch())


def test_attention_dropout_in_train_only_and_read_at_call_time() -> None:
    ref = tiny.bert(dropout=0.0).eval()
    new = copy.deepcopy(ref)
    _replace_all(new, "bert.encoder.layer.*.attention.self", make_sdpa_bert_self_attention)
    batch = _batch()
    for layer in new.bert.encoder.layer:  # raise p after the replace: read at call time
        layer.attention.self.dropout.p = 0.5
    with torch.no_grad():
        eval_a, eval_b = new(**batch).logits, new(**batch).logits
        torch.testing.assert_close(eval_a, ref(**batch).logits, **TOL)  # eval: no dropout
        assert torch.equal(eval_a, eval_b)
        new.train()
        torch.manual_seed(0)
        train_a = new(**batch).logits
        torch.manual_seed(1)
        train_b = new(**batch).logits
    assert not torch.allclose(train_a, eval_a) and not torch.allclose(train_a, train_b)


def _reference(q, k, v, keep):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def test_sdpa_attention_masks_and_is_causal() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    full = torch.ones(5, 5, dtype=torch.bool)
    torch.testing.assert_close(sdpa_attention(q, k, v, is_causal=True),
                               _reference(q, k, v, causal), **TOL)
    torch.testing.assert_close(sdpa_attention(q, k, v, is_causal=False),
                               _reference(q, k, v, full), **TOL)
    # a padding mask in every form gives the same result, alone and with causality
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    keep = pad.bool()[:, None, None, :]
    forms = [pad, pad.bool(), keep, keep.expand(2, 1, 5, 5)[:, 0],
             torch.zeros(2, 1, 1, 5).masked_fill(~keep, torch.finfo(torch.float32).min)]
    for is_causal, base in ((False, full), (True, causal)):
        want = _reference(q, k, v, keep & base)
        for mask in forms:
            got = sdpa_attention(q, k, v, mask, is_causal=is_causal)
            torch.testing.assert_close(got, want, **TOL, msg=f"{mask.dtype} {mask.dim()}-d")
    # fewer queries than keys (decoding): the causal mask is aligned to the end of the keys
    got = sdpa_attention(q[:, :, 3:], k, v, is_causal=True)
    torch.testing.assert_close(got, _reference(q, k, v, causal)[:, :, 3:], **TOL)
    # the module form; per-call override of is_causal
    core = SDPAAttention(is_causal=True)
    torch.testing.assert_close(core(q, k, v), _reference(q, k, v, causal), **TOL)
    torch.testing.assert_close(core(q, k, v, is_causal=False), _reference(q, k, v, full), **TOL)


# ------------------------------------------------------------------------ fused kernels


def test_fused_gpt2_mlp_compiled_equals_original() -> None:
    ref = tiny.gpt2()
    new = copy.deepcopy(ref)
    keys = new.state_dict().keys()
    _replace_all(new, "transformer.h.*.mlp", make_fused_gpt2_mlp)
    mlp = new.transformer.h[0].mlp
    assert mlp.bias_gelu.approximate == "tanh" and mlp.bias_gelu.compile  # gelu_new
    for block in new.transformer.h:  # one compiled kernel per test keeps the test fast
        block.mlp.bias_dropout.compile = False
    assert new.state_dict().keys() == keys
    print("max difference, compiled bias+gelu:", _assert_same(ref, new, _batch(padded=False)))


def test_fused_bert_output_compiled_and_intermediate_equal_original() -> None:
    ref = tiny.bert()
    new = copy.deepcopy(ref)
    keys = new.state_dict().keys()
    sch = tl.create_schedule(new)
    for layer in sch["bert.encoder.layer.*"]:
        layer["attention.output"].replace(make_fused_bert_output)
        layer["output"].replace(make_fused_bert_output_eager)
        layer["intermediate"].replace(make_fused_bert_intermediate_eager)
    assert new.bert.encoder.layer[0].intermediate.bias_gelu.approximate == "none"  # "gelu"
    assert new.state_dict().keys() == keys
    print("max difference, compiled bias+dropout+residual+LN:", _assert_same(ref, new, _batch()))


def test_fused_dropout_reads_the_training_flag_at_call_time() -> None:
    ref = tiny.gpt2(dropout=0.0)
    mlp = make_fused_gpt2_mlp_eager(ref.transformer.h[0].mlp)
    mlp.eval()  # built/evaluated in eval, then switched to training
    mlp.dropout.p = 0.5
    x = torch.randn(4, 3, 32)
    with torch.no_grad():
        ref_mlp = ref.transformer.h[0].mlp.eval()
        torch.testing.assert_close(mlp(x), ref_mlp(x), **TOL)
        mlp.train()
        out = mlp(x)
        frac = (out == 0).float().mean().item()
    assert 0.3 < frac < 0.7  # about half of the outputs dropped
    f = FusedBiasDropoutResidualLayerNorm(compile=False)
    y = torch.randn(1000)
    with torch.no_grad():
        assert (f(y, None, p=0.5) == 0).any()
        assert torch.equal(f.eval()(y, None, p=0.5), y)


def test_gelu_approximation_matches_the_activation() -> None:
    import transformers.activations as A

    x = torch.linspace(-4, 4, 101)
    for act in (A.NewGELUActivation(), A.GELUActivation(), A.FastGELUActivation(),
                A.GELUActivation(use_gelu_python=True), nn.GELU(), nn.GELU("tanh")):
        kernel = FusedBiasGelu(gelu_approximation(act), compile=False)
        torch.testing.assert_close(kernel(x), act(x), rtol=1e-6, atol=1e-6,
                                   msg=type(act).__name__)


# ---------------------------------------------------------------------------- fused QKV


def test_fused_qkv_equals_original_and_grads_split() -> None:
    ref = tiny.bert()
    new = copy.deepcopy(ref)
    _replace_all(new, "bert.encoder.layer.*.attention.self", make_fused_qkv_bert_self_attention)
    attn = new.bert.encoder.layer[0].attention.self
    assert isinstance(attn, FusedQKVBertSelfAttention)
    assert tuple(attn.qkv.weight.shape) == (96, 32)
    batch = _batch()
    logits_a, grads_a = _run(ref, batch)
    logits_b, grads_b = _run(new, batch)
    torch.testing.assert_close(logits_b, logits_a, **TOL)
    for i in range(2):
        p = f"bert.encoder.layer.{i}.attention.self."
        for name in ("weight", "bias"):
            want = torch.cat([grads_a[f"{p}{n}.{name}"] for n in ("query", "key", "value")])
            torch.testing.assert_close(grads_b[f"{p}qkv.{name}"], want, **TOL)


def test_fused_qkv_state_dict_round_trip_both_directions() -> None:
    original = tiny.bert(seed=0)
    fused = copy.deepcopy(original)
    _replace_all(fused, "bert.encoder.layer.*.attention.self",
                 make_fused_qkv_bert_self_attention)
    # the fused model saves the original keys and values
    saved = fused.state_dict()
    assert saved.keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(saved[key], value), key
    # a checkpoint of another original model loads into the fused one (strict)
    other = tiny.bert(seed=7).eval()
    fused.load_state_dict(other.state_dict())
    batch = _batch(padded=True)
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(fused.eval()(**batch).logits, other(**batch).logits, **TOL)
        # and the fused model's checkpoint loads into a plain original model (strict)
        plain = tiny.bert(seed=3).eval()
        plain.load_state_dict(fused.state_dict())
        torch.testing.assert_close(plain(**batch).logits, other(**batch).logits, **TOL)
    # a checkpoint in the fused layout loads too
    sd = {"qkv.weight": torch.ones(96, 32), "qkv.bias": torch.zeros(96)}
    attn = fused.bert.encoder.layer[0].attention.self
    attn.load_state_dict(sd)
    assert torch.equal(attn.qkv.weight, torch.ones(96, 32))


def test_fused_qkv_keeps_tags_and_refuses_partial_checkpoints() -> None:
    model = tiny.bert()
    sch = tl.create_schedule(model)
    for name in ("query", "key", "value"):
        set_tag(getattr(model.bert.encoder.layer[0].attention.self, name).weight, "mine", 1)
    sch["bert.encoder.layer.0.attention.self"].replace(make_fused_qkv_bert_self_attention)
    attn = model.bert.encoder.layer[0].attention.self
    assert attn.qkv.weight.mine == 1
    sd = attn.state_dict()
    del sd["key.weight"]
    with pytest.raises(RuntimeError, match="all three are needed"):
        attn.load_state_dict(sd)


# ------------------------------------------------------------------------------- errors


def test_errors_are_pinned() -> None:
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    with pytest.raises(ReplaceError, match="replaces a transformers GPT2Attention") as err:
        sch["transformer.h.0.mlp"].replace(make_sdpa_gpt2_attention)
    assert err.value.fix == ("apply it to the GPT2Attention modules, e.g. "
                             "sch['transformer.h.0.attn'].replace(make_sdpa_gpt2_attention)")
    with pytest.raises(ReplaceError, match="BertSelfAttention") as err:
        sch["transformer.h.0.attn"].replace(make_sdpa_bert_self_attention)
    assert err.value.fix == (
        "apply it to the BertSelfAttention modules, e.g. "
        "sch['bert.encoder.layer.0.attention.self'].replace(make_sdpa_bert_self_attention)")
    with pytest.raises(ReplaceError, match="BertSelfOutput"):
        sch["transformer.h.0.mlp"].replace(make_fused_bert_output)
    mlp = model.transformer.h[0].mlp
    mlp.act = nn.ReLU()
    with pytest.raises(ReplaceError, match="fuses a GeLU; this module's activation is ReLU"):
        sch["transformer.h.0.mlp"].replace(make_fused_gpt2_mlp)
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(OpsError, match="is_causal must be True or False"):
        sdpa_attention(q, q, q, is_causal=None)  # type: ignore[arg-type]
    with pytest.raises(OpsError, match="is_causal must be True or False"):
        SDPAAttention(is_causal=1)  # type: ignore[arg-type]
    with pytest.raises(OpsError, match="2, 3 or 4 dimensions"):
        sdpa_attention(q, q, q, torch.ones(1, 1, 1, 3, 3), is_causal=False)
    with pytest.raises(OpsError, match="dropout_p must be in"):
        sdpa_attention(q, q, q, is_causal=False, dropout_p=1.5)
    with pytest.raises(OpsError, match="unknown GeLU approximation 'fast'"):
        FusedBiasGelu("fast")
    with pytest.raises(OpsError, match="compile must be True or False"):
        FusedBiasGelu("tanh", compile="yes")  # type: ignore[arg-type]
    with pytest.raises(OpsError, match="not a GeLU"):
        gelu_approximation(nn.SiLU())
    attn = make_sdpa_gpt2_attention(model.transformer.h[1].attn)
    with pytest.raises(OpsError, match="cannot return them"):
        attn(torch.randn(1, 3, 32), output_attentions=True)
    with pytest.raises(OpsError, match="cross-attention"):
        attn(torch.randn(1, 3, 32), encoder_hidden_states=torch.randn(1, 3, 32))
    assert "fix:" in str(err.value) and "values:" in str(err.value)


def test_factories_are_recorded_and_replayed_from_a_recipe() -> None:
    model = tiny.bert()
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.0.attention.self"].replace(make_fused_qkv_bert_self_attention)
    sch["bert.encoder.layer.1.attention.self"].replace(make_sdpa_bert_self_attention)
    sch["bert.encoder.layer.*.output"].replace(make_fused_bert_output_eager)
    sch["bert.encoder.layer.*.intermediate"].replace(make_fused_bert_intermediate_eager)
    assert "torchloom.ops" in sch.recipe.to_json()
    verify_recipe_roundtrip(sch, tiny.bert, (tiny.token_batch()["input_ids"],))
