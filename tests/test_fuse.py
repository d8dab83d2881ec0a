"""decompose, fuse, replace(target_ops=...) vertical and horizontal, checkpoint(subgraph=...):
numerics, structure, recipe replay and error paths."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchloom as tl
from tests import tiny
from torchloom.core.errors import (
    CheckpointError,
    FuseError,
    PatternError,
    RecipeError,
    ReplaceError,
)
from torchloom.primitives.fuse import FusedModule
from torchloom.tools.testing import verify_recipe_roundtrip

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 128


# --------------------------------------------------------------------------- patterns


def bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def bias_add(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x + b


def gelu_of_sum(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A replacement for a matched ``F.gelu(x + b)`` (tanh approximation)."""
    return F.gelu(x + b, approximate="tanh")


def inputs(seq: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(model: nn.Module, reference: nn.Module, batch: dict,
                     tol: float = 1e-6) -> None:
    loss, grads = loss_and_grads(model, batch)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=10 * tol, atol=tol)


def bert_with_fusable_intermediate() -> tuple[nn.Module, tl.Schedule]:
    model = tiny.bert()
    sch = tl.create_schedule(model)
    inter = sch["bert.encoder.layer.0.intermediate"]
    sch["bert.encoder.layer.0.intermediate.dense"].decompose()
    inter.trace(flatten=True)
    return model, sch


# --------------------------------------------------------------------------- fuse


def test_bias_gelu_fused_with_inductor_matches_the_original() -> None:
    reference = tiny.bert()
    model, sch = bert_with_fusable_intermediate()
    inter = sch["bert.encoder.layer.0.intermediate"]
    matches = inter.find(bias_gelu)
    assert len(matches) == 1
    assert [n.target.__name__ for n in matches[0].nodes] == ["add", "gelu"]
    inter.fuse(matches, compiler="inductor", name="BiasGeLU")
    assert isinstance(inter["BiasGeLU_0"].mod, FusedModule)
    calls = [n.target for n in inter.mod.graph.nodes if n.op == "call_module"]
    assert calls == ["BiasGeLU_0"]
    assert list(model.state_dict()) == list(reference.state_dict())
    assert_same_step(model, reference, inputs(), tol=1e-5)
    assert inter["BiasGeLU_0"].mod._compiled is not None  # it was compiled, and ran
    assert str(sch.recipe).splitlines()[-1] == (
        "sch['bert.encoder.layer.0.intermediate'].fuse({'pattern': "
        "tests.test_fuse.bias_gelu, 'index': 0}, name='BiasGeLU')")


def test_fuse_returns_values_used_outside_and_replays() -> None:
    reference = tiny.gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.0.mlp.c_fc"].decompose()
    block = sch["transformer.h.0"]
    block.trace(flatten=True)
    # ln_2(h) + mlp: the residual sum `h` is also used by the second residual add
    found = block.find(lambda x, y: F.layer_norm(x + y, (32,)))
    assert len(found) == 1 and [n.name for n in found[0].outputs()] == ["add", "ln_2"]
    block.fuse(found[0], compiler="eager")
    fused = block["FusedModule_0"].mod
    assert fused.n_outputs == 2
    assert not list(fused.parameters())  # ln_2 stays where it was; nothing is listed twice
    block.fuse(block.find(bias_add)[0], compiler="eager")  # c_fc's bias add
    assert_same_step(model, reference, inputs())
    with pytest.raises(RecipeError, match=r"recipe line 3 \(fuse at 'transformer.h.0'\) has an "
                                          r"argument that is not data: a function"):
        sch.recipe.to_json()  # the first pattern is a lambda
    again = tl.create_schedule(tiny.gpt2())
    again["transformer.h.0.mlp.c_fc"].decompose()
    again["transformer.h.0"].trace(flatten=True)
    again["transformer.h.0"].fuse(again["transformer.h.0"].find(bias_add)[0], compiler="eager")
    verify_recipe_roundtrip(again, tiny.gpt2, (inputs()["input_ids"],))
    entry = again.recipe[-1]
    assert entry.args == ({"pattern": bias_add, "index": 0},) and \
        entry.kwargs == {"compiler": "eager"}


# --------------------------------------------------------------------------- replace


class FusedQKV(nn.Module):
    """q, k and v projections as one matmul (a copy of their weights)."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach().clone())
        self.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]).detach().clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).chunk(3, dim=-1)


def test_horizontal_replace_of_qkv_by_one_fused_module() -> None:
    reference = tiny.bert()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    layer = sch["bert.encoder.layer.0"]
    layer.trace()
    qkv = layer.find(r"\.(query|key|value)$")
    attn = model.bert.encoder.layer[0].attention.self
    layer.replace(FusedQKV(attn.query, attn.key, attn.value), target_ops=qkv)
    graph = attn.graph
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["FusedQKV_0"]
    assert sch["bert.encoder.layer.0.attention.self.FusedQKV_0"].mod is attn.FusedQKV_0
    assert sch["bert.encoder.layer.0.attention.self.query"].mod is attn.query  # still there
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(RecipeError, match="has an argument that is not data: a FusedQKV"):
        sch.recipe.to_json()


def test_vertical_replace_by_a_function_replays() -> None:
    reference = tiny.bert()
    model, sch = bert_with_fusable_intermediate()
    inter = sch["bert.encoder.layer.0.intermediate"]
    inter.replace(gelu_of_sum, target_ops=inter.find(bias_gelu)[0])
    assert [n.target for n in inter.mod.graph.nodes if n.op == "call_function"
            and n.target is gelu_of_sum] == [gelu_of_sum]
    expected = F.gelu(torch.ones(1), approximate="tanh")  # sanity: the new function runs
    assert expected.shape == (1,)
    batch = inputs()
    with torch.no_grad():
        out, ref = model(**batch).logits, reference(**batch).logits
    assert (out - ref).abs().max() < 1e-2 and not torch.equal(out, ref)
    verify_recipe_roundtrip(sch, tiny.bert, (batch["input_ids"],))
    assert str(sch.recipe).endswith(
        "sch['bert.encoder.layer.0.intermediate'].replace(tests.test_fuse.gelu_of_sum, "
        "target_ops={'pattern': tests.test_fuse.bias_gelu, 'index': 0})")


def test_replace_errors() -> None:
    model, sch = bert_with_fusable_intermediate()
    inter = sch["bert.encoder.layer.0.intermediate"]
    match = inter.find(bias_add)[0]  # the add, whose value the gelu also uses
    # Slapo crashed on any replacement with default arguments; here they are fine:
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].replace(...): the replacement cannot "
            "take the match's 2 input(s) ['linear', 'dense_bias']: missing a required argument")):
        inter.replace(lambda x, b, scale, shift=0.0: x, target_ops=match)
    inter.replace(lambda x, b, scale, shift=0.0: x * scale + b + shift, target_ops=match,
                  concrete_args={"scale": 1.0})
    gelu = inter.find(lambda x: F.gelu(x))
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].replace(...): name applies to a new module")):
        inter.replace(torch.tanh, target_ops=gelu, name="x")
    inter.replace(torch.tanh, target_ops=gelu)
    with pytest.raises(PatternError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].replace(...): the match is stale")):
        inter.replace(torch.tanh, target_ops=gelu)
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['bert.encoder.layer.0.output'].replace(...): the match is in the graph of "
            "'bert.encoder.layer.0.intermediate', which is not at or below this node")):
        sch["bert.encoder.layer.0.output"].replace(torch.tanh, target_ops=inter.find(
            lambda x: torch.tanh(x)))
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].replace(...): concrete_args only applies "
            "to subgraph replacement")):
        inter.replace(nn.ReLU(), concrete_args={"a": 1})

    gpt = tl.create_schedule(tiny.gpt2())
    block = gpt["transformer.h.0"]
    block.trace(flatten=True)
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['transformer.h.0'].replace(...): values computed inside the subgraph are also "
            "used outside it: ['add', 'ln_2']")):
        block.replace(nn.Identity(), target_ops=block.find(
            lambda x, y: F.layer_norm(x + y, (32,))))
    gpt["transformer.h.0.attn.c_proj"].sync("fwd_post", lambda m, i, o: None)
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['transformer.h.0'].replace(...): modules in the match have hooks (e.g. a "
            "sync), which would stop firing once their calls are replaced\n"
            "    values: modules=['attn.c_proj']")):
        block.replace(nn.Identity(), target_ops=block.find(r"attn\.c_proj"))


# --------------------------------------------------------------------------- checkpoint


def test_checkpoint_of_a_subgraph_whose_values_are_used_outside() -> None:
    reference = tiny.gpt2(dropout=0.1).train()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    block = sch["transformer.h.0"]
    block.trace(flatten=True)
    calls = []
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, i: calls.append(1))
    # the attention output + residual (used again by the second residual add), then ln_2,
    # c_fc and the activation
    found = block.find(lambda x, y, w: F.linear(F.layer_norm(x + y, (32,)), w))
    assert len(found) == 1
    assert [n.name for n in found[0].outputs()] == ["add", "mlp_c_fc"]
    block.checkpoint(subgraph=found)
    wrapper = block["CheckpointWrapper_0"].mod
    assert wrapper.n_outputs == 2 and not list(wrapper.parameters())
    assert list(model.state_dict()) == list(reference.state_dict())
    calls.clear()
    assert_same_step(model, reference, inputs())
    assert len(calls) == 2  # c_fc ran in forward and again in the recompute
    verify = block.find(r"CheckpointWrapper")
    assert len(verify) == 1


def test_checkpoint_subgraph_errors() -> None:
    gpt = tl.create_schedule(tiny.gpt2())
    block = gpt["transformer.h.0"]
    block.trace(flatten=True)
    found = block.find(bias_add)
    with pytest.raises(CheckpointError, match=re.escape(
            "sch['transformer.h.0'].checkpoint(...): ratio and subgraph cannot be combined")):
        block.checkpoint(ratio=0.5, subgraph=found)
    with pytest.raises(CheckpointError, match=re.escape(
            "sch['transformer.h.0'].checkpoint(...): expected a Match from find() (or a list of "
            "them), not a str")):
        block.checkpoint(subgraph="add")


# --------------------------------------------------------------------------- decompose


def test_decompose_conv1d_keeps_parameters_and_numerics() -> None:
    reference = tiny.gpt2()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    weight = model.transformer.h[0].mlp.c_fc.weight
    sch["transformer.h.*.mlp.c_fc"].decompose()
    c_fc = model.transformer.h[0].mlp.c_fc
    assert type(c_fc).__name__ == "DecomposedConv1D" and c_fc.weight is weight
    assert isinstance(c_fc, transformers.pytorch_utils.Conv1D) and c_fc.nf == 128
    assert list(model.state_dict()) == list(reference.state_dict())
    assert_same_step(model, reference, inputs(), tol=1e-5)
    verify_recipe_roundtrip(sch, tiny.gpt2, (inputs()["input_ids"],))


def test_decompose_errors() -> None:
    sch = tl.create_schedule(tiny.bert())
    dense = sch["bert.encoder.layer.0.intermediate.dense"]
    dense.decompose()
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate.dense'].decompose(...): this layer is "
            "already decomposed")):
        dense.decompose()
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].decompose(...): decompose splits an "
            "nn.Linear or a transformers Conv1D, not a BertIntermediate")):
        sch["bert.encoder.layer.0.intermediate"].decompose()
    out = sch["bert.encoder.layer.0.output.dense"]
    out.checkpoint()
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.output.dense'].decompose(...): the layer's forward was "
            "replaced on the instance")):
        out.decompose()
    lm = tl.create_schedule(tiny.gpt2())
    with pytest.raises(FuseError, match=re.escape(
            "sch['lm_head'].decompose(...): this layer has no bias, so there is nothing to "
            "separate")):
        lm["lm_head"].decompose()


def test_fuse_errors() -> None:
    model, sch = bert_with_fusable_intermediate()
    inter = sch["bert.encoder.layer.0.intermediate"]
    found = inter.find(lambda x: F.gelu(x)) + inter.find(bias_add)
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].fuse(...): unknown compiler 'TorchScript'")):
        inter.fuse(found[0], compiler="TorchScript")
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].fuse(...): fuse compiles one subgraph at "
            "a time, got 2 matches")):
        inter.fuse(found, compiler="eager")
    with pytest.raises(FuseError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].fuse(...): name must be an identifier")):
        inter.fuse(found[0], name="my fused")
    with pytest.raises(PatternError, match=re.escape(
            "sch['bert.encoder.layer.0.intermediate'].fuse(...): the recorded matches [3] of "
            "the pattern are not there: find() gives 1 now")):
        inter.fuse({"pattern": bias_gelu, "index": 3})
    assert len(sch.recipe) == 2  # decompose and trace: failed calls are not recorded


# --------------------------------------------------------------------------- recipes


def is_key_or_value(node: torch.fx.Node) -> bool:
    return node.op == "call_module" and node.target in ("key", "value")


def test_recipes_record_matches_by_pattern_and_index_at_the_time_of_the_call() -> None:
    sch = tl.create_schedule(tiny.bert())
    sch["bert.encoder.layer.*.intermediate.dense"].decompose()
    sch["bert.encoder.layer.*.intermediate"].trace(flatten=True)
    both = sch.find(bias_gelu)  # one per layer, found once, fused one after the other
    assert [m.path for m in both] == ["bert.encoder.layer.0.intermediate",
                                      "bert.encoder.layer.1.intermediate"]
    sch.fuse(both[0], compiler="eager")
    sch.fuse(both[1], compiler="eager")
    layer = sch["bert.encoder.layer.0"]
    layer.trace()
    layer.checkpoint(subgraph=layer.find(is_key_or_value))
    lines = str(sch.recipe).splitlines()
    assert lines[-5:] == [
        "sch['bert.encoder.layer.1.intermediate'].trace(flatten=True)",
        "sch[''].fuse({'pattern': tests.test_fuse.bias_gelu, 'index': 0}, compiler='eager')",
        "sch[''].fuse({'pattern': tests.test_fuse.bias_gelu, 'index': 0}, compiler='eager')",
        "sch['bert.encoder.layer.0'].trace()",
        "sch['bert.encoder.layer.0'].checkpoint(subgraph={'pattern': "
        "tests.test_fuse.is_key_or_value, 'index': [0, 1], 'predicate': True})",
    ]
    attn = sch["bert.encoder.layer.0.attention.self"]
    assert [n.target for n in attn.mod.graph.nodes if n.op == "call_module"] == \
        ["query", "CheckpointWrapper_0", "CheckpointWrapper_1"]
    verify_recipe_roundtrip(sch, tiny.bert, (inputs()["input_ids"],))

    # a recipe whose pattern finds less on another model says which line fails and why
    recipe = tl.Recipe.from_json(sch.recipe.to_json(), trusted_refs=sch.recipe.references())
    entries = list(recipe)
    entries[-1] = tl.RecipeEntry("checkpoint", entries[-1].path, (), {
        "subgraph": {"pattern": is_key_or_value, "index": [0, 7], "predicate": True}})
    with pytest.raises(RecipeError, match=re.escape(
            "line 8: sch['bert.encoder.layer.0'].checkpoint(subgraph={'pattern': "
            "tests.test_fuse.is_key_or_value, 'index': [0, 7], 'predicate': True})\n"
            "        the recorded matches [0, 7] of the pattern are not there: find() gives 2 "
            "now")):
        tl.apply_recipe(tiny.bert(), tl.Recipe(entries))


def test_matches_in_different_graphs_cannot_be_replaced_by_one_call() -> None:
    sch = tl.create_schedule(tiny.bert())
    sch["bert.encoder.layer.0"].trace()
    dense = sch["bert.encoder.layer.0"].find(r"dense$")  # in intermediate and in output
    with pytest.raises(ReplaceError, match=re.escape(
            "sch['bert.encoder.layer.0'].replace(...): the matches are in different graphs")):
        sch["bert.encoder.layer.0"].replace(lambda a, b: (a, b), target_ops=dense)
