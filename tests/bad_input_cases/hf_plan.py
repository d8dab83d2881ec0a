"""Bad-input rows: schedules derived from transformers' parallel plans (issue 15).

Every refusal of :func:`torchloom.schedules.hf_plan.from_hf_plan` happens before any
primitive is applied and names the style, the path and the family: a model with no plan,
an unknown or unsupported style, a style on a module it does not fit, sizes the ranks
cannot split (heads and KV heads by config field, the MLP's features, the vocabulary), a
norm over all the features of a projection whose heads (or input) the plan splits, a
row-parallel module with no column-parallel one before it, an expert parameter the plan
leaves whole, a weight tied to a module the plan leaves whole, sequence parallelism where
the layers do not allow it, pipeline stages the layers cannot fill, and bad knobs.

The models come from transformers' default configs with only sizes changed, built on
``meta`` (nothing allocated); a tensor-parallel degree is faked on the root schedule,
which is all these checks read.
"""

from __future__ import annotations

from typing import Any, Callable

import transformers

import torchloom as tl
from torchloom import schedules
from torchloom.core.errors import ScheduleConfigError
from torchloom.schedules.hf_plan import PlanError, from_hf_plan, tp_plan_of

_DENSE = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64)


def _schedule(model_class: str, config_class: str, world: int = 2, **sizes: Any) -> tl.Schedule:
    with tl.init_empty_weights():
        config = getattr(transformers, config_class)(**{**_DENSE, **sizes})
        model = getattr(transformers, model_class)(config)
    sch = tl.create_schedule(model)
    sch.world_size = world
    return sch


def _refused(sch: tl.Schedule, **knobs: Any) -> None:
    try:
        from_hf_plan(sch, **knobs)
    finally:
        assert not sch.recipe, "a refusal must leave the schedule unchanged"


def plan_absent():
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    _refused(tl.create_schedule(model))


def unknown_style():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    _refused(sch, plan={**tp_plan_of(sch.mod), "model.layers.*.mlp.up_proj": "colwize"})


def refused_style():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    _refused(sch, plan={**tp_plan_of(sch.mod),
                        "model.layers.*.mlp.up_proj": "moe_identity_expert"})


def style_on_the_wrong_module():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    _refused(sch, plan={**tp_plan_of(sch.mod), "model.layers.*.input_layernorm": "colwise"})


def plan_matches_nothing():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    _refused(sch, plan={"decoder.layers.*.fc1": "colwise"})


def heads_do_not_divide():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config", world=4, num_attention_heads=6,
                       hidden_size=48, num_key_value_heads=6))


def kv_heads_neither_divide_nor_a_divisor():
    _refused(_schedule("MistralForCausalLM", "MistralConfig", num_attention_heads=6,
                       hidden_size=48, num_key_value_heads=3))


def intermediate_size_does_not_divide():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config", world=4, intermediate_size=66,
                       num_key_value_heads=4))


def vocabulary_does_not_divide():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config", vocab_size=63))


def norm_over_split_heads():
    _refused(_schedule("EsmcForMaskedLM", "EsmcConfig", num_key_value_heads=4, head_dim=8))


def norm_over_split_input():
    sch = _schedule("BitNetForCausalLM", "BitNetConfig")  # no plan of its own: one by hand
    plan = {f"model.layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
    _refused(sch, plan={**plan, "model.layers.*.self_attn.o_proj": "rowwise"})


def row_without_columns():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    _refused(sch, plan={"model.layers.*.self_attn.o_proj": "rowwise"})


# Mixtral's experts as transformers 5.24 planned them (5.25 plans its attention only)
_MOE_PLAN = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
             "model.layers.*.mlp.experts.down_proj": "rowwise",
             "model.layers.*.mlp.experts": "moe_tp_experts"}


def expert_parameter_left_whole():
    sch = _schedule("MixtralForCausalLM", "MixtralConfig", num_local_experts=4)
    plan = {**tp_plan_of(sch.mod), **_MOE_PLAN}
    del plan["model.layers.*.mlp.experts.down_proj"]
    _refused(sch, plan=plan)


def tied_weight_of_an_unplanned_module():
    sch = _schedule("GemmaForCausalLM", "GemmaConfig", head_dim=8)
    plan = tp_plan_of(sch.mod)
    del plan["model.embed_tokens"]
    _refused(sch, plan=plan)


def sequence_parallel_over_two_stacks():
    sizes = dict(_DENSE, head_dim=8)
    with tl.init_empty_weights():
        model = transformers.T5GemmaForConditionalGeneration(transformers.T5GemmaConfig(
            encoder=transformers.T5GemmaModuleConfig(**sizes),
            decoder=transformers.T5GemmaModuleConfig(**sizes), vocab_size=64))
    sch = tl.create_schedule(model)
    sch.world_size = 2
    _refused(sch, sequence_parallel=True)


def sequence_parallel_with_experts():
    sch = _schedule("MixtralForCausalLM", "MixtralConfig", num_local_experts=4)
    _refused(sch, plan={**tp_plan_of(sch.mod), **_MOE_PLAN}, sequence_parallel=True)


def plan_sequence_parallel_without_tp():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config"), tp=False, sequence_parallel=True)


def pipeline_stages_exceed_layers():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config"), pipeline_stages=2)


def ckpt_ratio_out_of_range():
    _refused(_schedule("Qwen2ForCausalLM", "Qwen2Config"), ckpt_ratio=1.5)


def derived_schedule_unknown_knob():
    sch = _schedule("Qwen2ForCausalLM", "Qwen2Config")
    schedules.apply_schedule(sch, tp=True, fused=True)


_WHERE = r"sch\['{path}'\]\.schedules\.from_hf_plan\(\.\.\.\): "

CASES: list[tuple[Callable, type, str]] = [
    (plan_absent, PlanError,
     r"GPT2LMHeadModel has no tensor-parallel plan.*family='gpt2'.*fix: pass one: "
     r"from_hf_plan\(sch, plan="),
    (unknown_style, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.mlp\.up_proj") + r"unknown tensor-parallel "
     r"style 'colwize'.*style='colwize', family='qwen2', "
     r"plan_key='model\.layers\.\*\.mlp\.up_proj'.*fix: use one of colwise, "),
    (refused_style, PlanError,
     r"the plan's style 'moe_identity_expert' is not supported: an identity expert.*"
     r"style='moe_identity_expert', family='qwen2'"),
    (style_on_the_wrong_module, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.input_layernorm") + r"the style 'colwise' "
     r"splits a Linear layer, and model\.layers\.0\.input_layernorm is a Qwen2RMSNorm"),
    (plan_matches_nothing, PlanError,
     r"no key of the tensor-parallel plan matches a module or parameter of "
     r"Qwen2ForCausalLM.*keys=\['decoder\.layers\.\*\.fc1'\]"),
    (heads_do_not_divide, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.self_attn\.q_proj") + r"tensor parallelism "
     r"gives each of the 4 ranks whole heads of q_proj, and num_attention_heads=6 does not "
     r"divide by 4.*style='colwise', family='qwen2'.*fix: use a tensor-parallel degree "
     r"that divides num_attention_heads=6 \(one of \[1, 2, 3, 6\]\)"),
    (kv_heads_neither_divide_nor_a_divisor, PlanError,
     r"whole heads of k_proj, and num_key_value_heads=3 does not divide by 2.*"
     r"family='mistral'.*fix: use a tensor-parallel degree that divides "
     r"num_key_value_heads=3 \(one of \[1, 3\]\)"),
    (intermediate_size_does_not_divide, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.mlp\.gate_proj") + r"the plan splits axis 0 "
     r"of model\.layers\.0\.mlp\.gate_proj\.weight \(size 66\) over 4 ranks.*"
     r"config_fields=\['intermediate_size'\].*fix: .*intermediate_size is a multiple of 4"),
    (vocabulary_does_not_divide, PlanError,
     _WHERE.format(path=r"model\.embed_tokens") + r"the plan splits the vocabulary of "
     r"model\.embed_tokens \(63 rows\) over 2 ranks.*style='embedding_rowwise'.*fix: keep "
     r"the embeddings and the head whole: from_hf_plan\(sch, vocab_parallel=False\); or "
     r"pad the vocabulary: model\.resize_token_embeddings\(64\)"),
    (norm_over_split_heads, PlanError,
     r"the plan splits the features of esmc\.layers\.0\.self_attn\.q_proj \(32\) over the "
     r"ranks, but q_norm normalises all 32 of them together.*family='esmc'.*fix: gather "
     r"the projection's output instead: the style colwise_gather_output"),
    (norm_over_split_input, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.self_attn\.o_proj") + r"the plan splits the "
     r"input features of model\.layers\.0\.self_attn\.o_proj \(32\) over the ranks, but "
     r"attn_sub_norm normalises all 32 of them together.*style='rowwise', family='bitnet'.*"
     r"fix: gather instead: colwise_gather_output"),
    (row_without_columns, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.self_attn\.o_proj") + r"the plan splits the "
     r"input features of model\.layers\.0\.self_attn\.o_proj, and nothing in "
     r"model\.layers\.0\.self_attn is column parallel.*style='rowwise', family='qwen2'.*"
     r"fix: rowwise_split_input splits a whole input itself"),
    (expert_parameter_left_whole, PlanError,
     _WHERE.format(path=r"model\.layers\.0\.mlp\.experts") + r"the experts' parameter "
     r"'down_proj' is not split by the plan.*style='moe_tp_experts', family='mixtral'"),
    (tied_weight_of_an_unplanned_module, PlanError,
     r"lm_head's weight is tied to model\.embed_tokens, which the plan does not split.*"
     r"style='colwise_gather_output', family='gemma'.*vocab_parallel=False"),
    (sequence_parallel_over_two_stacks, PlanError,
     r"sequence parallelism splits the activations of one stack of layers; this plan "
     r"covers 2 \(\['model\.encoder\.layers', 'model\.decoder\.layers'\]\).*"
     r"family='t5gemma'"),
    (sequence_parallel_with_experts, PlanError,
     r"sequence parallelism is supported for plans of attention and MLP regions; "
     r"model\.layers\.0\.mlp\.experts has the style 'moe_tp_experts'.*"
     r"family='mixtral'.*fix: from_hf_plan\(sch, tp=True\) without sequence_parallel"),
    (plan_sequence_parallel_without_tp, ScheduleConfigError,
     r"sequence parallelism splits the activations between tensor-parallel regions; it "
     r"needs tp=True"),
    (pipeline_stages_exceed_layers, PlanError,
     _WHERE.format(path=r"model\.layers") + r"2 pipeline stages over 1 layers: each stage "
     r"needs a layer.*fix: pipeline_stages=1: one layer makes one stage"),
    (ckpt_ratio_out_of_range, ScheduleConfigError,
     r"ckpt_ratio must be a number from 0 to 1, not 1\.5.*ckpt_ratio=1\.5"),
    (derived_schedule_unknown_knob, tl.ScheduleError,
     r"unknown knob 'fused' for the built-in schedule of Qwen2ForCausalLM.*knobs=\['tp', "
     r"'sequence_parallel', 'ckpt_ratio', 'compile', 'vocab_parallel', 'loss_parallel'\]"),
]
