"""find: regexes, node predicates, pattern functions and pattern modules; data edges,
module/function equivalence, order and overlap, nested graphs, error paths."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchloom as tl
import torchloom.graph.pattern as P
from tests import tiny
from tests.trace_models import llama
from torchloom.core.errors import PatternError, TraceError

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def relu_plus_input(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x) + x


class ReluThenAdd(nn.Module):
    """``relu(x) + y`` where ``y`` is unrelated to ``x``: the false-positive trap."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = F.relu(x)
        z = y * 2
        return r + z, torch.relu(y) + y


def traced(module: nn.Module, *example: torch.Tensor, **kw: object) -> tl.Schedule:
    sch = tl.create_schedule(module)
    sch.trace(example_inputs=example, **kw)
    return sch


def test_data_edges_are_checked_no_false_positive() -> None:
    sch = traced(ReluThenAdd(), torch.randn(2, 3), torch.randn(2, 3))
    matches = sch.find(relu_plus_input)
    # `relu(x) + z` has the relu and the add in order, but z is not relu's input:
    assert [[n.name for n in m.nodes] for m in matches] == [["relu_1", "add_1"]]
    m = matches[0]
    assert m.anchor.name == "add_1" and [n.name for n in m.inputs] == ["y"]
    assert m.bindings["x"].name == "y" and m.path == ""
    assert list(m) == [("", m.nodes[0]), ("", m.nodes[1])]


def test_operand_order_spellings_and_overlap() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            a = torch.relu(torch.relu(torch.relu(x)))
            return torch.add(b, a).relu() + x.add(b)

    sch = traced(M(), torch.randn(2), torch.randn(2))
    # relu(relu(x)) twice in a chain of three: one match (no overlap), the first two
    assert [[n.name for n in m.nodes] for m in sch.find(lambda x: F.relu(F.relu(x)))] == \
        [["relu", "relu_1"]]
    # x + b matches b + a (commutative), torch.add and Tensor.add alike, in graph order
    found = sch.find(lambda x, b: x + b)
    assert [m.anchor.name for m in found] == ["add", "add_1", "add_2"]
    assert [m.anchor.name for m in sch.find(lambda x, b: F.relu(x + b))] == ["relu_3"]


def test_regex_and_node_predicate_on_nested_graphs() -> None:
    sch = tl.create_schedule(tiny.bert())
    layer = sch["bert.encoder.layer.0"]
    layer.trace()
    qkv = layer.find(r"attention\.self\.(query|key|value)$")
    assert [m.nodes[0].target for m in qkv] == ["query", "key", "value"]
    assert {m.path for m in qkv} == {"bert.encoder.layer.0.attention.self"}
    assert qkv[0].inputs == [next(iter(qkv[0].graph_module.graph.nodes))]  # hidden_states
    linears = layer.find(lambda node: node.op == "call_module" and isinstance(
        node.graph.owning_module.get_submodule(node.target), nn.Linear))
    assert len(linears) == 6  # q, k, v, attention output, intermediate, output
    assert len(layer.find_node(lambda n: n.op == "call_module" and n.target == "dense")) == 3
    group = sch["bert.encoder.layer.0.*"]  # attention, intermediate, output
    assert [m.path for m in group.find(r"^dense$")] == [
        "bert.encoder.layer.0.intermediate", "bert.encoder.layer.0.output"]


def test_module_and_functional_forms_match_each_other() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(F.linear(x, self.w))

    class Modules(Functional):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(4, 4), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    class LinearGelu(P.Pattern):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(1, 1), nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    def functional_pattern(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(x, w))

    for module in (Functional(), Modules()):
        sch = traced(module, torch.randn(2, 4))
        assert len(sch.find(functional_pattern)) == 1, type(module)
        assert len(sch.find(LinearGelu())) == 1, type(module)
        assert len(sch.find(LinearGelu)) == 1  # a class is built without arguments
    by_path = sch.find(lambda x: F.gelu(P.call_module(r"^fc$", x)))
    assert [n.target for n in by_path[0].nodes] == ["fc", "act"]

    class AnyProjection(P.Pattern):
        def __init__(self) -> None:
            super().__init__()
            self.proj = P.ModulePattern(r"f")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(self.proj(x))

    assert len(sch.find(AnyProjection())) == 1


def test_transformers_modules_match_their_functional_forms() -> None:
    # hierarchical BERT: the activation is a nested graph of a GELUActivation, the dense an
    # nn.Linear; both match the functional pattern
    sch = tl.create_schedule(tiny.bert())
    sch["bert.encoder.layer.0.intermediate"].trace()
    found = sch["bert.encoder.layer.0"].find(lambda x, w, b: F.gelu(F.linear(x, w, b)))
    assert [n.target for n in found[0].nodes] == ["dense", "intermediate_act_fn"]
    # GPT-2's Conv1D is a linear; its MLP flattened has conv1d -> (tanh gelu ops) -> conv1d
    gpt = tl.create_schedule(tiny.gpt2())
    gpt["transformer.h.0.mlp"].trace(flatten=True)
    assert [m.nodes[0].target for m in gpt.find(lambda x, w: F.linear(x, w))] == \
        ["c_fc", "c_proj"]


def test_rms_norm_found_in_flattened_llama_layers() -> None:
    sch = tl.create_schedule(llama())
    sch["model.layers.0"].trace(flatten=True)

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    found = sch["model.layers.0"].find(rms_norm)
    assert len(found) == 2  # input_layernorm and post_attention_layernorm
    assert all(len(m.nodes) == 5 for m in found)
    assert found[0].nodes[0].graph is sch["model.layers.0"].mod.graph


def test_find_error_paths() -> None:
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(TraceError, match=re.escape(
            "sch['transformer.h.0'].find(...): find needs a traced module, and nothing at or "
            "below this node is traced\n    values: module='GPT2Block'\n"
            "    fix: trace it first: sch['transformer.h.0'].trace()")):
        sch["transformer.h.0"].find("c_attn")
    sch["transformer.h.0.mlp"].trace()
    mlp = sch["transformer.h.0.mlp"]
    with pytest.raises(PatternError, match=re.escape(
            "sch['transformer.h.0.mlp'].find(...): invalid regular expression: missing ), "
            "unterminated subpattern at position 0")):
        mlp.find("(c_fc")
    with pytest.raises(PatternError, match=re.escape(
            "sch['transformer.h.0.mlp'].find(...): find takes a regex, a node predicate, a "
            "pattern function or a pattern module, not a int")):
        mlp.find(3)
    with pytest.raises(PatternError, match=re.escape(
            "sch['transformer.h.0.mlp'].find(...): the pattern cannot be traced: TraceError: "
            "symbolically traced variables cannot be used as inputs to control flow")):
        mlp.find(lambda x: x if x.sum() > 0 else -x)
    with pytest.raises(PatternError, match=re.escape(
            "sch['transformer.h.0.mlp'].find(...): the pattern must compute something from "
            "its arguments and return it")):
        mlp.find(lambda x: x)

    class NeedsArgs(P.Pattern):
        def __init__(self, n: int) -> None:
            super().__init__()

    with pytest.raises(PatternError, match=re.escape(
            "sch['transformer.h.0.mlp'].find(...): pattern class NeedsArgs cannot be built "
            "without arguments")):
        mlp.find(NeedsArgs)
    with pytest.raises(PatternError, match="only stands for a module call inside a pattern"):
        P.call_module("x", torch.zeros(1))


def test_a_pattern_with_several_results() -> None:
    class Gates(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(y) * torch.relu(x) + torch.sigmoid(x)

    sch = traced(Gates(), torch.randn(2), torch.randn(2))
    found = sch.find(lambda x: (torch.relu(x), torch.sigmoid(x)))
    assert len(found) == 1
    m = found[0]
    assert [n.name for n in m.nodes] == ["relu", "sigmoid_1"] and m.anchor.name == "sigmoid_1"
    assert m.bindings["x"].name == "x"
