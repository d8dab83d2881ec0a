"""Bad-input rows: torchloom.plan (issue 17). Layouts that contradict themselves or the
model, unknown profiles, dtypes and models, degrees that do not cover the GPUs."""

from __future__ import annotations

from torchloom.apps.plan_cli import _degrees, plan_layout
from torchloom.plan import (
    Layout,
    LayoutError,
    PlanError,
    check_model,
    get_profile,
    model_spec,
    predict,
)
from torchloom.plan.layout import data_parallel


def plan_sp_without_tp():
    Layout(sp=True)


def plan_sequence_not_divisible():
    Layout(tp=4, sp=True, seq_len=30)


def plan_pipeline_without_enough_microbatches():
    Layout(pp=4, n_microbatches=2)


def plan_ckpt_ratio_out_of_range():
    Layout(ckpt_ratio=2)


def plan_unknown_dp_mode():
    data_parallel(2, "zero3")


def plan_hsdp_replicas_do_not_divide():
    plan_layout(model_spec("gpt2"), tp=1, pp=1, dp=4, dp_mode="hsdp", dp_replicate=3,
                micro_steps=1)


def plan_unknown_schedule():
    Layout(pp=2, n_microbatches=2, pipeline_schedule="ZeroBubble")


def plan_unknown_mixed_precision():
    Layout(mixed_precision="fp8")


def plan_bad_stage_cuts():
    Layout(pp=3, n_microbatches=3, stage_cuts=(2,))


def plan_layers_do_not_split():
    check_model(Layout(pp=3, n_microbatches=3), model_spec("gpt2"))


def plan_heads_do_not_divide():
    check_model(Layout(tp=4), model_spec("gpt2"))


def plan_unknown_profile():
    get_profile("b200")


def plan_dtype_the_device_lacks():
    predict("gpt2", Layout(seq_len=16, param_dtype="bf16"), "v100-32gb")


def plan_unknown_model():
    model_spec("gpt5")


def plan_image_model():
    model_spec("vit")


def plan_sequence_longer_than_positions():
    model_spec("opt", seq_len=4096)


def plan_degrees_do_not_cover_the_gpus():
    _degrees(8, 2, 2, 3)


CASES = [
    (plan_sp_without_tp, PlanError, r"sequence parallelism splits activations between "
     r"tensor-parallel ranks; it needs tp > 1.*fix: Layout\(tp=2, sp=True\)"),
    (plan_sequence_not_divisible, PlanError, r"splits the 30 positions between 4 ranks.*"
     r"fix: a seq_len divisible by 4, e.g. 32"),
    (plan_pipeline_without_enough_microbatches, PlanError, r"a pipeline of 4 stages needs at "
     r"least 4 micro-batches.*Layout\(pp=4, n_microbatches=4\)"),
    (plan_ckpt_ratio_out_of_range, PlanError, r"ckpt_ratio must be a number between 0 and 1"),
    (plan_unknown_dp_mode, LayoutError, r"unknown data-parallel mode 'zero3'.*"
     r"fix: --dp-mode ddp or --dp-mode fsdp"),
    (plan_hsdp_replicas_do_not_divide, PlanError, r"HSDP splits the 4 data-parallel ranks "
     r"into --dp-replicate replica groups of two or more FSDP2 shards, and --dp-replicate 3 "
     r"does not.*fix: --dp-replicate R with R dividing 4"),
    (plan_unknown_schedule, LayoutError, r"unknown pipeline schedule 'ZeroBubble'.*"
     r"fix: Layout\(pipeline_schedule='1F1B'\)"),
    (plan_unknown_mixed_precision, LayoutError, r"mixed_precision is a dtype of fp32, bf16, "
     r"fp16 \(or None\), not 'fp8'"),
    (plan_bad_stage_cuts, PlanError, r"stage_cuts lists the 2 layer\(s\) after which a stage "
     r"ends"),
    (plan_layers_do_not_split, LayoutError, r"2 layers do not split evenly into 3 stages.*"
     r"pp x stages_per_rank in \[1, 2\]"),
    (plan_heads_do_not_divide, PlanError, r"whole attention heads, and 2 heads do not divide"
     r".*tp in \[1, 2\]"),
    (plan_unknown_profile, PlanError, r"unknown device profile 'b200'.*--gpu h100-80gb"),
    (plan_dtype_the_device_lacks, PlanError, r"the v100-32gb has no bf16 matmul peak.*"
     r"--dtype fp16"),
    (plan_unknown_model, PlanError, r"unknown model 'gpt5': not a zoo name, a config\.json"),
    (plan_image_model, PlanError, r"vit is not a model the planner takes \(image\)"),
    (plan_sequence_longer_than_positions, PlanError, r"a sequence of 4096 tokens is longer "
     r"than the 128 positions of opt.*--seq-len 128"),
    (plan_degrees_do_not_cover_the_gpus, PlanError, r"tp x pp x dp = 2 x 2 x 3 = 12 is not "
     r"--gpus 8"),
]
