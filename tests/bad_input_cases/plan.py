"""Bad-input rows: torchloom.plan (issue 17). Layouts that contradict themselves or the
model, unknown profiles, dtypes and models, degrees that do not cover the GPUs."""

from __future__ import annotations

from torchloom.apps.plan_cli import _degrees
from torchloom.plan import Layout, PlanError, check_model, get_profile, model_spec, predict


def plan_sp_without_tp():
    Layout(sp=True)


def plan_sequence_not_divisible():
    Layout(tp=4, sp=True, seq_len=30)


def plan_pipeline_without_enough_microbatches():
    Layout(pp=4, n_microbatches=2)


def plan_ckpt_ratio_out_of_range():
    Layout(ckpt_ratio=2)


def plan_unknown_dp_mode():
    Layout(dp=2, dp_mode="zero3")


def plan_fsdp_under_a_pipeline():
    Layout(pp=2, dp=2, dp_mode="fsdp", n_microbatches=2)


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
    (plan_unknown_dp_mode, PlanError, r"unknown data-parallel mode 'zero3'"),
    (plan_fsdp_under_a_pipeline, PlanError, r"FSDP2 under a pipeline is not modelled.*"
     r"fix: Layout\(dp_mode='ddp'\) with pp > 1"),
    (plan_unknown_schedule, PlanError, r"models the pipeline schedules GPipe, 1F1B, not "
     r"'ZeroBubble'"),
    (plan_unknown_mixed_precision, PlanError, r"mixed_precision is the compute dtype of "
     r"autocast, 'bf16' or 'fp16', not 'fp8'"),
    (plan_bad_stage_cuts, PlanError, r"stage_cuts lists the 2 layer\(s\) after which a stage "
     r"ends"),
    (plan_layers_do_not_split, PlanError, r"2 layers do not split evenly into 3 stages.*"
     r"pp in \[1, 2\]"),
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
