"""Pipeline stages in one process: the split computes what the model computes, the cut's
preconditions and the schedule check."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import torchloom as tl
from tests import pipeline_models, tiny
from tests.tiny import llama
from torchloom.runtime.pipeline import check_schedule
from torchloom.runtime.pipeline_split import cut_paths, split_stages


def _ids(rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (rows, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("make", "layers"), [(lambda: tiny.gpt2(n_layer=4), "transformer.h"),
                                              (llama, "model.layers")])
def test_stages_chained_compute_the_model(make, layers):
    model = make()
    reference = copy.deepcopy(model)
    sch = tl.create_schedule(model)
    sch.trace_until(f"{layers}.*", example_inputs={"input_ids": _ids()})
    sch[f"{layers}.0"].cut_pipeline_stage()
    sch[f"{layers}.2"].cut_pipeline_stage()
    assert cut_paths(sch) == [f"{layers}.0", f"{layers}.2"]
    stages = split_stages(sch, (_ids(),))
    assert len(stages.modules) == 3
    value = stages.modules[0](_ids())
    for module in stages.modules[1:]:
        value = module(*value) if isinstance(value, tuple) else module(value)
    assert torch.equal(value, reference(_ids()).logits)
    # every parameter lives in exactly one stage, except the tied embedding / head
    names = [n for m in stages.modules for n, _ in m.named_parameters()]
    assert sorted(set(names)) == sorted(n for n, _ in reference.named_parameters(
        remove_duplicate=False))
    if layers == "transformer.h":
        assert stages.ties == [[(0, "transformer.wte.weight"), (2, "lm_head.weight")]]
    # the recipe records the cuts and replays them
    assert [e.primitive for e in sch.recipe] == ["trace_until", "cut_pipeline_stage",
                                                 "cut_pipeline_stage"]


def test_send_dtype_sends_the_floats_that_cross_in_the_compute_dtype():
    """``split_stages(send_dtype=bf16)`` (what ``parallelize`` asks for stages that compute
    in bf16 under FSDP2): every floating tensor that crosses a cut leaves its stage in bf16
    and the stage metadata (the runtime's receive buffers) says bf16, half the bytes of
    the trace's fp32; integers cross unchanged. Run in bf16, the chained stages compute
    the bf16 model exactly."""
    model = llama()
    sch = tl.create_schedule(model)
    sch.trace_until("model.layers.*", example_inputs={"input_ids": _ids()})
    sch["model.layers.0"].cut_pipeline_stage()
    plain = split_stages(sch, (_ids(),))
    sent = split_stages(sch, (_ids(),), torch.bfloat16)

    def floats(metas):
        return [(tuple(t.shape), t.dtype) for t in metas if t.is_floating_point()]

    crossing = floats(sent.metas[1][0])
    assert crossing and all(dtype == torch.bfloat16 for _, dtype in crossing)
    assert [shape for shape, _ in crossing] == [s for s, _ in floats(plain.metas[1][0])]
    assert all(dtype == torch.float32 for _, dtype in floats(plain.metas[1][0]))
    assert [t.dtype for t in sent.metas[1][0] if not t.is_floating_point()] == \
        [t.dtype for t in plain.metas[1][0] if not t.is_floating_point()]
    assert sent.metas[0][1] == sent.metas[1][0]  # what stage 0 sends, stage 1 receives
    # fp32 stages: what leaves stage 0 is its fp32 output rounded to bf16
    out32, out16 = plain.modules[0](_ids()), sent.modules[0](_ids())
    for a, b in zip(out32, out16):
        assert b.dtype == (torch.bfloat16 if a.is_floating_point() else a.dtype)
        assert torch.equal(b, a.to(b.dtype))
    # bf16 stages (FSDP2's compute): the chain is the bf16 model, bit for bit
    model.to(torch.bfloat16)
    assert torch.equal(_chain(sent, (_ids(),)), model(_ids()).logits)


def test_cut_needs_a_traced_parent():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.ScheduleError, match=(
            r"cut_pipeline_stage\(\.\.\.\): the module that calls this one \(transformer\) "
            r"is not traced, so there is no graph to cut")) as info:
        sch["transformer.h.1"].cut_pipeline_stage()
    assert str(info.value) == (
        "sch['transformer.h.1'].cut_pipeline_stage(...): the module that calls this one "
        "(transformer) is not traced, so there is no graph to cut\n"
        "    values: parent='transformer', parent_module='GPT2Model'\n"
        "    fix: trace down to this level first: sch.trace_until('transformer.h.*')"
    )


def test_cut_errors():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.ScheduleError, match="the root cannot end a pipeline stage"):
        sch.cut_pipeline_stage()
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": _ids()})
    sch["transformer.h.1"].cut_pipeline_stage()
    with pytest.raises(tl.ScheduleError, match=re.escape("a stage already ends after this module")):
        sch["transformer.h.1"].cut_pipeline_stage()
    with pytest.raises(tl.ScheduleError, match=r"the module that calls this one "
                                                 r"\(transformer\.h\.1\.attn\) is not traced"):
        sch["transformer.h.1.attn.c_attn"].cut_pipeline_stage()  # below the traced levels


class _WithSpare(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


def test_cut_after_a_module_the_graph_never_calls():
    sch = tl.create_schedule(_WithSpare())
    sch.trace(example_inputs=(torch.randn(1, 2),))
    with pytest.raises(tl.ScheduleError, match=r"the traced graph of the root does not call "
                                                 r"this module"):
        sch["spare"].cut_pipeline_stage()


def test_build_pipeline_needs_a_group_and_a_cut():
    sch = tl.create_schedule(tiny.gpt2())
    with pytest.raises(tl.BuildError, match="a pipeline runs its stages on several ranks"):
        tl.build(sch, target="pipeline", example_inputs=(_ids(),), loss_fn=lambda o, t: o.sum())
    with pytest.raises(tl.BuildError, match=r"(?s)no pipeline stage is cut.*fix: mark where stages "
                                            r"end: sch\.trace_until"):
        split_stages(sch, (_ids(),))


class _FakeSchedule:
    """A schedule object carrying a hand-written action order."""

    def __init__(self, order):
        self.pipeline_order = order


def test_schedule_check_finds_a_deadlock():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    good = {0: [_Action(0, F, 0), _Action(0, B, 0)], 1: [_Action(1, F, 0), _Action(1, B, 0)]}
    assert check_schedule(_FakeSchedule(good), 2, 2, 1) > 0
    # rank 1 runs the backward of a micro-batch it never ran forward
    bad = {0: [_Action(0, F, 0), _Action(0, B, 0)], 1: [_Action(1, B, 0), _Action(1, F, 0)]}
    with pytest.raises(tl.BuildError, match="the pipeline schedule does not validate"):
        check_schedule(_FakeSchedule(bad), 2, 2, 1)


def _chain(stages, inputs: tuple) -> torch.Tensor:
    value = inputs
    for module in stages.modules:
        value = module(*value) if isinstance(value, tuple) else module(value)
    return value


@pytest.mark.parametrize(("name", "make", "levels", "cut", "nano"), [
    ("nanogpt", pipeline_models.nano_gpt, "transformer.h.*", "transformer.h.1", True),
    ("nanogpt-transposed", lambda: pipeline_models.nano_gpt(transposed=True),
     "transformer.h.*", "transformer.h.1", True),
    ("encoder-layers", pipeline_models.encoder_lm, "encoder.layers.*", "encoder.layers.1",
     False),
    ("encoder-attention", pipeline_models.encoder_lm, "encoder.layers.1.self_attn",
     "encoder.layers.1.self_attn", False),
    ("gpt-neo", pipeline_models.gpt_neo, "transformer.h.*", "transformer.h.1", False),
])
def test_cuts_after_any_module_whatever_it_returns(name, make, levels, cut, nano):
    model = make()
    reference = copy.deepcopy(model)
    ids = _ids()
    inputs = (ids, ids) if nano else (ids,)
    sch = tl.create_schedule(model)
    sch.trace_until(levels, example_inputs=inputs)
    sch[cut].cut_pipeline_stage()
    stages = split_stages(sch, inputs)
    assert len(stages.modules) == 2
    out = reference(*inputs)
    want = out[0] if nano else getattr(out, "logits", out)
    # (GPT-Neo's traced graph itself differs from its eager forward by rounding, ~1e-7)
    torch.testing.assert_close(_chain(stages, inputs), want, rtol=0, atol=1e-6, msg=name)
    # what crosses is contiguous, and its metadata (dtype included) is the stage's
    sent = stages.modules[0](*inputs)
    assert all(t.is_contiguous() for t in sent), name
    assert stages.metas is not None
    assert [(tuple(t.shape), t.dtype) for t in stages.metas[0][1]] == \
        [(tuple(t.shape), t.dtype) for t in sent]
    assert stages.metas[0][1] == stages.metas[1][0]
    if nano:  # the integer targets cross as they are (int64), without a gradient
        assert sent[-1].dtype == torch.int64 and torch.equal(sent[-1], ids)
        assert not stages.metas[1][0][-1].requires_grad
    if name == "gpt-neo":  # the block's (hidden, attn_weights): only what stage 1 uses
        assert len(stages.inputs[1]) == 2  # the hidden states and the causal mask
    if name == "encoder-layers":  # a gradient comes back for the activation, not the mask
        assert stages.inputs[1] == ["encoder_layers_1", "_canonical_mask_1"]
        assert [t.requires_grad for t in stages.metas[1][0]] == [True, False]


def test_a_tuple_of_a_tensor_and_none_is_carried_as_its_tensor_and_a_constant():
    class Pair(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), None, [x * 2, 3]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Pair(), Pair()

        def forward(self, x):
            h, nothing, (twice, three) = self.a(x)
            out = self.b(h + twice * three)
            assert out[1] is nothing
            return out[0] + out[2][0]

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 4)
    want = model(x)
    sch = tl.create_schedule(model)
    sch.trace(example_inputs=(x,))
    sch["a"].cut_pipeline_stage()
    stages = split_stages(sch, (x,))
    assert len(stages.inputs[1]) == 2  # the two tensors; None and 3 are constants
    assert torch.equal(_chain(stages, (x,)), want)


def test_a_container_that_is_not_a_tuple_list_or_dict_is_refused():
    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def values(self):
            return [self.t]

    class Boxing(torch.nn.Module):
        def forward(self, x):
            return Box(x + 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.lin = Boxing(), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(self.a(x).t)

    sch = tl.create_schedule(Model())
    sch.trace(example_inputs=(torch.randn(2, 4),), leaf_modules=["Boxing"])
    sch["a"].cut_pipeline_stage()
    with pytest.raises(tl.BuildError) as err:
        split_stages(sch, (torch.randn(2, 4),))
    assert str(err.value) == (
        "sch['a'].build(...): a Box with tensors (a) crosses into stage 1; tensors, and "
        "tuples, lists and dicts of them, can be sent between stages, other containers "
        "cannot\n    values: value='a', type='Box'\n    fix: cut after a module that "
        "returns tensors or a tuple of them (e.g. a whole layer), or make the module "
        "return a tuple")
