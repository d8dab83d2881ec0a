"""Schedules derived from transformers' parallel plans, in one process (issue 15).

What the derived schedule records for each style (the recipe), that it is an ordinary
recipe (prints, JSON round trip, replays with ``apply_recipe``), the knobs, that in a
world of one it leaves every output and gradient of several families bit for bit
unchanged (``Verify`` with zero tolerance), that ``schedules.apply_schedule`` falls back to
it, and Verify's static check on a column-parallel output resharded to the sequence
layout. The two-rank checks are in test_hf_plan_dist.py; the refusals in
bad_input_cases/hf_plan.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import torchloom as tl
from tests.hf_plan_models import (
    DENSE,
    gemma,
    gemma4_vision,
    llama,
    minicpm3,
    mistral,
    mixtral,
    patches,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    starcoder2,
    t5gemma,
    text,
    ultrabert,
)
from torchloom import schedules
from torchloom.runtime.pipeline_split import cut_paths
from torchloom.schedules import zoo
from torchloom.schedules.gpt2 import schedule_gpt2
from torchloom.schedules.hf_plan import (
    MlaKvAProjection,
    PlanError,
    expand_plan,
    from_hf_plan,
    layer_stacks,
    tp_plan_of,
)
from torchloom.schedules.llama import schedule_llama
from torchloom.tools.check import check


def _lines(sch: tl.Schedule) -> list[str]:
    return [entry.call_text() for entry in sch.recipe]


def _scheduled(make, **knobs) -> tl.Schedule:
    torch.manual_seed(0)
    sch = tl.create_schedule(make())
    from_hf_plan(sch, **knobs)
    return sch


def test_llama_recipe_lists_the_plan_as_primitives():
    lines = _lines(_scheduled(llama))
    layer = "model.layers.0"
    for line in [
        "sch['model.embed_tokens'].shard('weight', 0)",
        "sch['model.embed_tokens'].sync('fwd_post', 'all_reduce')",
        f"sch['{layer}.self_attn.q_proj'].shard('weight', 0)",
        # q, k and v (gate and up) read one tensor: its gradient is all-reduced once
        f"sch['{layer}.self_attn.q_proj'].sync('bwd_post', 'all_reduce', shared=True)",
        f"sch['{layer}.self_attn.v_proj'].sync('bwd_post', 'all_reduce', shared=True)",
        f"sch['{layer}.mlp.up_proj'].sync('bwd_post', 'all_reduce', shared=True)",
        f"sch['{layer}.self_attn.o_proj'].shard('weight', 1)",
        f"sch['{layer}.self_attn.o_proj'].sync('fwd_post', 'all_reduce')",
        f"sch['{layer}.mlp.down_proj'].shard('weight', 1)",
        "sch['lm_head'].shard('weight', 0)",
        "sch['lm_head'].sync('fwd_post', 'all_gather', axis=-1, "
        "tensor_parallel_output_grad=False)",
        "sch['lm_head'].sync('bwd_post', 'all_reduce')",
    ]:
        assert line in lines, line
    assert not any("checkpoint" in line for line in lines)
    # every key of the plan matched a module of the model
    sch = tl.create_schedule(llama())
    assert {e.key for e in expand_plan(sch, tp_plan_of(sch.mod))} == set(tp_plan_of(sch.mod))


def test_the_recipe_prints_round_trips_and_replays():
    sch = _scheduled(llama, sequence_parallel=True, ckpt_ratio=0.5)
    script = str(sch.recipe)
    assert "torchloom.schedules.hf_plan.vocab_ids_local" in script
    again = tl.Recipe.from_json(sch.recipe.to_json())
    assert again == sch.recipe
    torch.manual_seed(0)
    replayed = tl.apply_recipe(llama(), again)
    assert replayed.recipe == sch.recipe
    batch = text()
    torch.manual_seed(0)
    assert torch.equal(replayed.mod(**batch).logits, sch.mod(**batch).logits)


@pytest.mark.parametrize("make", [llama, qwen2, mistral, gemma, phi3, qwen3, starcoder2, mixtral,
                                  qwen2_moe, minicpm3, ultrabert, t5gemma, gemma4_vision],
                         ids=lambda f: f.__name__)
def test_a_world_of_one_leaves_outputs_and_gradients_unchanged(make):
    torch.manual_seed(0)
    model = make().train()
    before = copy.deepcopy(model)
    batch = patches() if make is gemma4_vision else text(seq2seq=make is t5gemma)
    sch = tl.create_schedule(model)
    with tl.Verify(sch, batch, rtol=0.0, atol=0.0):  # bit for bit
        from_hf_plan(sch, ckpt_ratio=0.5)
    assert any(e.primitive == "shard" for e in sch.recipe)
    out, ref = model(**batch), before(**batch)
    first = "last_hidden_state" if make is gemma4_vision else "logits"
    assert torch.equal(getattr(out, first), getattr(ref, first))


def test_sequence_parallel_records_the_megatron_layout():
    lines = _lines(_scheduled(qwen2, sequence_parallel=True))
    layer = "model.layers.0"
    for line in [
        "sch['model.layers.0'].sync('fwd_pre', 'scatter', axis=1, input_name='hidden_states')",
        "sch['model.layers.1'].sync('fwd_post', 'all_gather', axis=1, "
        "tensor_parallel_output_grad=False)",
        f"sch['{layer}.self_attn'].sync('fwd_pre', 'all_gather', axis=1, "
        "tensor_parallel_output_grad=False, input_name='hidden_states')",
        f"sch['{layer}.self_attn.o_proj'].sync('fwd_post', 'reduce_scatter', axis=1)",
        f"sch['{layer}.mlp'].sync('fwd_pre', 'all_gather', axis=1, "
        "tensor_parallel_output_grad=False, input_name='x')",
        f"sch['{layer}.input_layernorm'].sync('param_grad', 'all_reduce')",
        f"sch['{layer}.post_attention_layernorm'].sync('param_grad', 'all_reduce')",
        # the column modules still sum their input gradients: the gather keeps a slice
        f"sch['{layer}.self_attn.q_proj'].sync('bwd_post', 'all_reduce', shared=True)",
    ]:
        assert line in lines, line
    assert f"sch['{layer}.self_attn.o_proj'].sync('fwd_post', 'all_reduce')" not in lines


def test_styles_become_the_expected_primitives():
    phi = _lines(_scheduled(phi3))  # gathered packed projections, outputs split again
    assert "sch['model.layers.0.self_attn.qkv_proj'].sync('fwd_post', 'all_gather', " \
        "axis=-1, tensor_parallel_output_grad=False)" in phi
    assert "sch['model.layers.0.mlp.down_proj'].sync('fwd_pre', 'scatter', axis=-1)" in phi
    qwen = _lines(_scheduled(qwen3))  # per-head norms
    assert "sch['model.layers.0.self_attn.q_norm'].sync('param_grad', 'all_reduce')" in qwen
    # experts split within, [gate_r | up_r] per rank (the plan transformers 5.24 declared
    # for Mixtral; 5.25 plans its attention only)
    moe_plan = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                "model.layers.*.mlp.experts.down_proj": "rowwise",
                "model.layers.*.mlp.experts": "moe_tp_experts"}
    model = mixtral()
    moe_sch = tl.create_schedule(model)
    from_hf_plan(moe_sch, plan={**tp_plan_of(model), **moe_plan})
    moe = _lines(moe_sch)
    experts = "model.layers.0.mlp.experts"
    for line in [f"sch['{experts}'].shard('gate_up_proj', 1, chunks=2)",
                 f"sch['{experts}'].shard('down_proj', 2)",
                 f"sch['{experts}'].sync('bwd_post', 'all_reduce', input_name='hidden_states')",
                 f"sch['{experts}'].sync('bwd_post', 'all_reduce', input_name='top_k_weights')",
                 f"sch['{experts}'].sync('fwd_post', 'all_reduce')"]:
        assert line in moe, line
    assert not any("mlp.gate'" in line for line in moe)  # the router stays replicated
    tied = _lines(_scheduled(gemma))  # one vocabulary-parallel table for both
    assert "sch['model.embed_tokens'].shard('weight', 0, tied=True)" in tied
    assert not any(line.startswith("sch['lm_head'].shard") for line in tied)
    bert = _lines(_scheduled(ultrabert))  # the padding row moves to its owner's slice
    assert "sch['model.embed_tokens'].replace(torchloom.schedules.hf_plan.localise_padding_idx)" \
        in bert
    sch = _scheduled(minicpm3)  # latent attention: the rotary part's gradient summed
    attn = "model.layers.0.self_attn"
    assert isinstance(sch[f"{attn}.kv_a_proj_with_mqa"].mod, MlaKvAProjection)
    assert f"sch['{attn}.kv_a_proj_with_mqa.grad_sum'].sync('bwd_post', 'all_reduce')" in \
        _lines(sch)


def test_knobs():
    whole = _lines(_scheduled(llama, vocab_parallel=False))
    assert not any("embed_tokens" in line or "lm_head" in line for line in whole)
    assert any("q_proj" in line for line in whole)
    plain = _lines(_scheduled(llama, tp=False, ckpt_ratio=1.0, compile="eager"))
    assert plain[0] == "sch['model.layers'].checkpoint(ratio=1.0)"
    assert plain[1:] == [f"sch['model.layers.{i}'].compile(backend='eager')" for i in range(2)]
    both = _lines(_scheduled(t5gemma, ckpt_ratio=0.5))  # every stack of layers
    assert "sch['model.encoder.layers'].checkpoint(ratio=0.5)" in both
    assert "sch['model.decoder.layers'].checkpoint(ratio=0.5)" in both
    assert layer_stacks(tl.create_schedule(t5gemma())) == ["model.encoder.layers",
                                                           "model.decoder.layers"]
    only = _lines(_scheduled(llama, plan={"model.layers.*.mlp.up_proj": "colwise",
                                          "model.layers.*.mlp.down_proj": "rowwise"}))
    assert not any("self_attn" in line for line in only) and len(only) == 8


def test_apply_schedule_falls_back_to_the_plan():
    assert schedules.schedule_for(qwen2()).__name__ == "schedule_hf_plan"
    assert schedules.schedule_for(llama()) is schedule_llama  # hand-written ones stay
    assert schedules.schedule_for(zoo.make_model("gpt2")) is schedule_gpt2
    sch = tl.create_schedule(qwen2())
    schedules.apply_schedule(sch)  # tp off by default, as in every built-in schedule
    assert not sch.recipe
    schedules.apply_schedule(sch, tp=True, ckpt_ratio=0.5)
    assert any(e.primitive == "shard" for e in sch.recipe)
    with pytest.raises(tl.ScheduleError, match="there is no built-in schedule for Sequential"):
        schedules.schedule_for(nn.Sequential(nn.Linear(2, 2)))


def test_a_refused_plan_changes_nothing():
    torch.manual_seed(0)
    model = mixtral()
    before = copy.deepcopy(model.state_dict())
    sch = tl.create_schedule(model)
    plan = tp_plan_of(model)
    plan["model.layers.*.mlp.experts"] = "moe_identity_expert"
    with pytest.raises(PlanError, match="moe_identity_expert") as info:
        from_hf_plan(sch, plan=plan)
    assert info.value.values["style"] == "moe_identity_expert"
    assert info.value.values["family"] == "mixtral"
    assert not sch.recipe
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _column_mlp(reshard: str) -> tl.Schedule:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    sch = tl.create_schedule(mlp)
    sch["0"].shard("weight", 0)
    sch["0"].shard("bias", 0)
    sch["0"].sync("bwd_post", "all_reduce")
    sch["0"].sync("fwd_post", reshard)
    return sch


def test_static_check_accepts_a_column_output_resharded_to_the_sequence():
    # whole features on a slice of the sequence: consumed by the whole Linear, whose
    # parameter gradients then cover this rank's tokens only (rule 6) until synced
    resharded = _column_mlp("RS->SR")
    assert [(f.path, f.rule) for f in check(resharded).findings] == \
        [("2", "parameter gradient left partial")]
    resharded["2"].sync("param_grad", "all_reduce")
    assert check(resharded).ok
    report = check(_column_mlp("RS->RS"))  # still split along the features: refused
    assert [f.rule for f in report.findings] == ["sharded output never consumed"]


def test_pipeline_stages_cut_the_pipeline_plans_layers():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**DENSE, "num_hidden_layers": 4}))
    sch = tl.create_schedule(model)
    batch = text()
    with tl.Verify(sch, batch):  # also runs each stage on the batch
        from_hf_plan(sch, ckpt_ratio=0.5, pipeline_stages=2, example_inputs=batch)
    assert cut_paths(sch) == ["model.layers.1"]
    primitives = [e.primitive for e in sch.recipe]
    assert primitives.index("trace_until") < primitives.index("cut_pipeline_stage") < \
        primitives.index("checkpoint")
    with pytest.raises(PlanError, match="3 pipeline stages over 2 layers"):
        from_hf_plan(tl.create_schedule(llama()), pipeline_stages=3)
    with pytest.raises(PlanError, match="the pipeline plan .* names 0"):
        from_hf_plan(tl.create_schedule(gemma4_vision()), pipeline_stages=2)
