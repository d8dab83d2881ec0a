"""trace / trace_until on transformers 5 models: equal outputs and gradients, hierarchy,
parameters, hooks and primitive state that survive, guards, recipe replay, error paths."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.trace_models import VOCAB, llama
from torchloom.core.errors import PathError, TraceError, TraceGuardError
from torchloom.core.marks import CHECKPOINTED, FORK_RNG, SYNCS, get_mark, has_mark
from torchloom.graph.graph_module import is_traced
from torchloom.graph.guards import is_guard
from torchloom.tools.testing import verify_recipe_roundtrip

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


# --------------------------------------------------------------------------- models


def t5() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                vocab_size=VOCAB, use_cache=False, dropout_rate=0.1)
    return transformers.T5ForConditionalGeneration(cfg)


def opt() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False,
    )
    return transformers.OPTForCausalLM(cfg)


def gpt2_dropout() -> nn.Module:
    return tiny.gpt2(dropout=0.1)


def bert_dropout() -> nn.Module:
    return tiny.bert(dropout=0.1)


FAMILIES = {
    "gpt2": (gpt2_dropout, ["transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1"]),
    "bert": (bert_dropout, ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.0.attention",
                            "bert.encoder.layer.0.intermediate", "bert.encoder.layer.1"]),
    "llama": (llama, ["model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1"]),
    "t5": (t5, ["encoder.block.0.layer.0.SelfAttention", "encoder.block.0.layer.1.DenseReluDense",
                "decoder.block.1", "decoder.block.0.layer.1.EncDecAttention"]),
    "opt": (opt, ["model.decoder.layers.0.self_attn", "model.decoder.layers.0.fc1",
                  "model.decoder.layers.1"]),
}


def batch(family: str, seq: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    if family == "t5":
        dec = ids[:, :6].clone()
        return {"input_ids": ids, "decoder_input_ids": dec, "labels": dec.clone()}
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model: nn.Module, inputs: dict, seed: int = 7
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks, if the graph draws them in the same order
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(model: nn.Module, reference: nn.Module, inputs: dict) -> None:
    loss, grads = loss_and_grads(model, inputs)
    ref_loss, ref_grads = loss_and_grads(reference, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attention_mlp_and_layer_trace_exactly(family: str) -> None:
    make, paths = FAMILIES[family]
    reference = make().train()
    inputs = batch(family)
    for flatten in (False, True):
        model = copy.deepcopy(reference)
        sch = tl.create_schedule(model)
        keys = list(model.state_dict())
        for path in paths:
            sch[path].trace(flatten=flatten)
            assert is_traced(sch[path].mod), path
            assert type(sch[path].mod).__name__ == type(reference.get_submodule(path)).__name__
        assert list(model.state_dict()) == keys  # names (and order) unchanged
        assert_same_training_step(model, reference, inputs)
        # dropout follows the mode at run time although the graph was traced in training
        model.eval(), reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits)
        reference.train()


def test_hierarchy_paths_parameters_and_schedule_nodes_survive() -> None:
    model = tiny.bert()
    sch = tl.create_schedule(model)
    query = sch["bert.encoder.layer.0.attention.self.query"]
    params = dict(model.named_parameters())
    sch["bert.encoder.layer.0"].trace()
    layer = model.bert.encoder.layer[0]
    assert is_traced(layer) and is_traced(layer.attention) and is_traced(layer.attention.self)
    assert isinstance(layer, transformers.models.bert.modeling_bert.BertLayer)  # still one
    assert sch["bert.encoder.layer.0.attention.self.query"] is query  # same node, still valid
    assert query.mod is layer.attention.self.query
    assert query.parent.mod is layer.attention.self
    for name, p in model.named_parameters():
        assert params[name] is p, name  # the same Parameter objects
    targets = [n.target for n in layer.attention.self.graph.nodes if n.op == "call_module"]
    assert targets == ["query", "key", "value"]


def test_flatten_inlines_to_leaves_but_keeps_the_module_tree() -> None:
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.0"].trace(flatten=True)
    block = model.transformer.h[0]
    targets = [n.target for n in block.graph.nodes if n.op == "call_module"]
    assert targets == ["ln_1", "attn.c_attn", "attn.c_proj", "attn.resid_dropout", "ln_2",
                       "mlp.c_fc", "mlp.c_proj", "mlp.dropout"]
    assert not is_traced(block.attn)  # inlined, kept only so paths still resolve
    assert sch["transformer.h.0.attn.c_attn"].mod is block.attn.c_attn


def test_traced_graph_runs_other_shapes_and_guards_other_branches() -> None:
    model = tiny.gpt2()
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    sch["transformer.h.0"].trace()  # traced on dummy inputs of shape (3, 5)
    ids = torch.randint(0, VOCAB, (4, 21))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    # A single token takes another branch of the attention (no causal mask needed):
    with pytest.raises(TraceGuardError, match=re.escape(
            "sch['transformer.h.0.attn'].trace(...): a branch was specialised at trace time "
            "(sdpa_attention.py:")):
        model(ids[:, :1])


def test_shard_sync_and_hooks_applied_before_tracing_still_hold() -> None:
    model = tiny.gpt2()
    sch = tl.create_schedule(model)
    sch["transformer.h.0.attn.c_attn"].shard("weight", 1)
    calls: list[str] = []
    sch["transformer.h.0.attn.c_attn"].sync("fwd_post", lambda m, i, o: calls.append("c_attn"))
    sch["transformer.h.0.attn"].sync("fwd_pre", lambda m, a, k: calls.append("attn"))
    model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: calls.append("mlp"))
    sch["transformer.h.0"].trace()  # runs the hooks on the example values, too
    calls.clear()
    spec = tl.shard_spec(model.transformer.h[0].attn.c_attn.weight)
    assert spec is not None and spec.axis == 1 and spec.full_shape == (32, 96)
    assert [s.mode for s in get_mark(model.transformer.h[0].attn, SYNCS)] == ["fwd_pre"]
    model(torch.randint(0, VOCAB, (2, 8)))
    assert calls == ["attn", "c_attn", "mlp"]


def test_checkpointed_and_fork_rng_modules_stay_leaves() -> None:
    reference = tiny.gpt2(dropout=0.1).train()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.0.mlp"].checkpoint()
    sch["transformer.h.0.attn"].fork_rng()
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0.mlp'].trace(...): the forward of this GPT2MLP was replaced on "
            "the instance (checkpoint, fork_rng or a row-parallel sync); it stays a leaf")):
        sch["transformer.h.0.mlp"].trace()
    sch["transformer.h.0"].trace()
    block = model.transformer.h[0]
    assert not is_traced(block.mlp) and has_mark(block.mlp, CHECKPOINTED)
    assert not is_traced(block.attn) and has_mark(block.attn, FORK_RNG)
    targets = [n.target for n in block.graph.nodes if n.op == "call_module"]
    assert targets == ["ln_1", "attn", "ln_2", "mlp"]


def test_trace_until_traces_the_way_down_and_keeps_level_children_opaque() -> None:
    model = tiny.gpt2()
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, 8)), "labels": None}
    inputs["labels"] = inputs["input_ids"]
    sch.trace_until("transformer.h.*", example_inputs=inputs)
    assert is_traced(model) and is_traced(model.transformer)
    assert all(is_traced(block) for block in model.transformer.h)
    assert not is_traced(model.transformer.h[0].attn)  # a child of a level: opaque
    assert not is_traced(model.lm_head)
    calls = [n.target for n in model.transformer.graph.nodes if n.op == "call_module"]
    assert calls[-3:] == ["h.0", "h.1", "ln_f"]
    assert_same_training_step(model, reference, inputs)
    assert model.config.to_dict() == reference.config.to_dict()  # attributes and methods
    assert isinstance(model, transformers.GPT2LMHeadModel)  # of the original class
    assert model.get_input_embeddings() is model.transformer.wte


def test_traced_models_copy_and_pickle_whole() -> None:
    model = tiny.bert()
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.0"].trace()
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, 8))}
    expected = model(**inputs).logits
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert list(clone.state_dict()) == list(model.state_dict())
        assert is_traced(clone.bert.encoder.layer[0].attention.self)
        torch.testing.assert_close(clone(**inputs).logits, expected)


def test_symbolic_trace_without_example_inputs_and_group_trace() -> None:
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)))
    sch = tl.create_schedule(blocks)
    sch["*"].trace(tracer="fx")
    assert all(is_traced(b) for b in blocks)
    assert len(sch.recipe) == 3
    graph = blocks[0].graph
    assert [n.op for n in graph.nodes if not is_guard(n)] == \
        ["placeholder", "call_module", "call_module", "output"]
    assert blocks[1][0] is sch["1.0"].mod


def test_trace_recipe_replays() -> None:
    sch = tl.create_schedule(tiny.gpt2())
    sch["transformer.h.0"].trace(leaf_modules=["GPT2MLP"])
    sch["transformer.h.1"].trace(flatten=True)
    assert not is_traced(sch["transformer.h.0.mlp"].mod)
    assert str(sch.recipe).endswith(
        "sch['transformer.h.0'].trace(leaf_modules=['GPT2MLP'])\n"
        "sch['transformer.h.1'].trace(flatten=True)")
    verify_recipe_roundtrip(sch, tiny.gpt2, (torch.randint(0, VOCAB, (2, 8)),))


# --------------------------------------------------------------------------- errors


def test_trace_error_paths() -> None:
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0'].trace(...): unknown tracer 'export'\n"
            "    values: tracer='export', tracers=['auto', 'fx']\n"
            "    fix: use one of auto, fx; 'auto' handles transformers modules")):
        sch["transformer.h.0"].trace(tracer="export")
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0'].trace(...): leaf_modules must be a list of class names or "
            "module paths")):
        sch["transformer.h.0"].trace(leaf_modules="GPT2MLP")
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0.attn'].trace(...): the example inputs are not a valid call of "
            "GPT2Attention.forward")):
        sch["transformer.h.0.attn"].trace(example_inputs={"hidden": torch.zeros(1, 2, 32)})
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0.attn'].trace(...): tracing GPT2Attention failed: TraceError: "
            "sch['transformer.h.0.attn'].trace(...): the module's code unpacks a traced value")
            + "|" + re.escape("the module's code iterates over a traced value")):
        sch["transformer.h.0.attn"].trace(tracer="fx")
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0.attn'].trace(...): running call_module c_attn on the example "
            "values failed: RuntimeError")):
        sch["transformer.h.0.attn"].trace(example_inputs=(torch.zeros(1, 2, 7),))
    assert not is_traced(sch["transformer.h.0.attn"].mod)  # nothing half-done
    assert len(sch.recipe) == 0


def test_trace_until_error_paths() -> None:
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(PathError, match=re.escape(
            "sch['transformer.layers.*']: no module matches this path "
            "(nothing at 'transformer.layers')")):
        sch.trace_until("transformer.layers.*")
    with pytest.raises(TraceError, match=re.escape(
            "sch[''].trace_until(...): paths must be a non-empty path or list of paths below "
            "this node\n    values: paths=[]")):
        sch.trace_until([])
    with pytest.raises(TraceError, match=re.escape(
            "sch[''].trace_until(...): these levels were not reached: the module never calls "
            "them, or they are leaves (torch.nn built-ins, checkpointed or fork_rng modules)\n"
            "    values: levels=['transformer.h.0.attn']")):
        sch["transformer.h.0.attn"].checkpoint()
        sch.trace_until("transformer.h.0.attn")
    assert not is_traced(sch.mod) and not is_traced(sch["transformer.h.0"].mod)
