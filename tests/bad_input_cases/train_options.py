"""Bad-input rows: the options of ``torchloom train`` (issue 16 item 2).

Every bad value of a flag or of a key of a ``--config`` TOML file is refused when the
options are made (:class:`torchloom.apps.jobconfig.TrainConfig` checks itself), naming the
option as its flag, the value, and a fix for the command line and the TOML file. What
needs the model or the data (positions, vocabulary, the held-out split, the outputs) is
refused by ``check_config`` before any rank starts. Model folders are written here by
``save_pretrained`` from a default-config Llama with its sizes shrunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torchloom.apps import train as T
from torchloom.apps.data import DataError
from torchloom.apps.jobconfig import TrainConfig, TrainOptionError, load_toml, options
from torchloom.runtime.state import CheckpointIOError


def _folder(tmp_path: Path, **config) -> str:
    from tests.test_train_real import make_folder

    return str(make_folder(tmp_path / "model", tokenizer=False, **config))


def _text(tmp_path: Path, size: int = 2000) -> str:
    (tmp_path / "a.txt").write_text("to be or not to be " * (size // 19 + 1))
    return str(tmp_path / "a.txt")


def option_negative_lr():
    TrainConfig(lr=-1.0)


def option_zero_steps():
    TrainConfig(steps=0)


def option_steps_not_an_integer():
    TrainConfig(steps="10")


def option_unknown_lr_decay():
    TrainConfig(lr_decay="exponential")


def option_unknown_device():
    TrainConfig(device="tpu")


def option_unknown_dtype():
    TrainConfig(dtype="fp16")


def option_eval_fraction_one():
    TrainConfig(eval_fraction=1.0)


def option_batch_does_not_split():
    TrainConfig(batch_size=6, dp=2, grad_accum=2)


def option_pipeline_batch_does_not_split():
    TrainConfig(batch_size=8, pp=2, dp=2, n_microbatches=3)


def option_sp_without_tp():
    TrainConfig(sequence_parallel=True)


def option_hsdp_with_one_replica():
    TrainConfig(dp=2, dp_mode="hsdp")


def option_dp_replicate_without_hsdp():
    TrainConfig(dp=4, dp_mode="fsdp", dp_replicate=2)


def option_one_stage_schedule_with_virtual_stages():
    TrainConfig(pp=2, pipeline_schedule="1F1B", stages_per_rank=3, batch_size=8)


def option_pipeline_schedule_typo():
    TrainConfig(pp=2, pipeline_schedule="Interleaved", batch_size=8)


def option_zbv_with_evaluation():
    TrainConfig(pp=2, pipeline_schedule="ZBVZeroBubble", n_microbatches=4, batch_size=8,
                eval_every=2)


def option_zbv_with_too_few_micro_batches():
    TrainConfig(pp=2, pipeline_schedule="ZBVZeroBubble", n_microbatches=2, batch_size=8)


def option_ac_with_a_ratio():
    TrainConfig(ac="op", ckpt_ratio=0.5)


def option_warmup_longer_than_the_run():
    TrainConfig(steps=10, warmup_steps=20)


def option_resume_without_save_dir():
    TrainConfig(resume=True)


def option_model_typo():
    TrainConfig(model="lama")


def option_model_folder_without_config(tmp_path: Path):
    (tmp_path / "weights.bin").write_bytes(b"")
    TrainConfig(model=str(tmp_path))


def option_data_missing(tmp_path: Path):
    TrainConfig(data=[str(tmp_path / "nowhere.txt")])


def toml_unknown_key(tmp_path: Path):
    (tmp_path / "run.toml").write_text("steps = 10\nlearning-rate = 0.1\n")
    load_toml(tmp_path / "run.toml")


def toml_not_toml(tmp_path: Path):
    (tmp_path / "run.toml").write_text("steps: 10\n")
    load_toml(tmp_path / "run.toml")


def toml_bad_value(tmp_path: Path):
    (tmp_path / "run.toml").write_text("clip-grad = -1\n")
    options(tmp_path / "run.toml")


def launch_cuda_ranks_without_torchrun():
    # device="cuda" is a valid option; whether a GPU exists is checked by check_config
    T.check_launch(TrainConfig(device="cuda", tp=2), torchrun=False)


def check_metrics_inside_the_save_dir(tmp_path: Path):
    T.check_config(TrainConfig(save_dir=str(tmp_path / "run"),
                               metrics=str(tmp_path / "run" / "metrics.jsonl"),
                               steps=1, batch_size=2, seq_len=16))


def check_save_pretrained_over_other_files(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    T.check_config(TrainConfig(save_pretrained=str(tmp_path), steps=1, batch_size=2,
                               seq_len=16))


def check_folder_positions(tmp_path: Path):
    T.check_config(TrainConfig(model=_folder(tmp_path, positions=32), seq_len=64,
                               data=[_text(tmp_path)]))


def check_bytes_beyond_the_vocabulary(tmp_path: Path):
    T.check_config(TrainConfig(model=_folder(tmp_path, vocab_size=64), seq_len=16,
                               data=[_text(tmp_path)]))


def check_held_out_too_small(tmp_path: Path):
    T.check_config(TrainConfig(model=_folder(tmp_path), seq_len=32, batch_size=8,
                               eval_every=5, eval_fraction=0.05, data=[_text(tmp_path)]))


def check_data_shorter_than_a_window(tmp_path: Path):
    T.check_config(TrainConfig(model=_folder(tmp_path), seq_len=64,
                               data=[_text(tmp_path, size=40)]))


def check_empty_data_folder(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    T.check_config(TrainConfig(data=[str(tmp_path / "empty")], steps=1))


def check_heads_that_tp_does_not_divide():
    T.check_config(TrainConfig(model="llama", tp=3, batch_size=3))


def check_layers_that_virtual_stages_do_not_divide():
    T.check_config(TrainConfig(model="llama", pp=2, pipeline_schedule="Interleaved1F1B",
                               n_microbatches=2, batch_size=8))


def check_stage_cuts_leaving_a_stage_empty():
    T.check_config(TrainConfig(model="llama", pp=2, stage_cuts="1", batch_size=8))


def option_stage_cuts_not_integers():
    TrainConfig(pp=2, stage_cuts="0,x", batch_size=8)


def check_resume_from_stage_folders_of_an_older_version(tmp_path: Path):
    (tmp_path / "stage-0").mkdir()
    (tmp_path / "stage-1").mkdir()
    T.check_config(TrainConfig(pp=2, save_dir=str(tmp_path), batch_size=8, resume=True))


def option_loss_parallel_without_tp():
    TrainConfig(loss="parallel")


def option_unknown_loss():
    TrainConfig(loss="fused")


def option_float8_on_cpu():
    TrainConfig(float8=True)


def option_async_tp():
    TrainConfig(tp=2, sequence_parallel=True, async_tp=True)


_FIX = r".*fix: "

CASES: list[tuple[Callable, type, str]] = [
    (option_negative_lr, TrainOptionError,
     r"^torchloom train\(\.\.\.\): --lr -1\.0: the peak learning rate must be a positive "
     r"number\n    values: lr=-1\.0\n    fix: --lr 0\.001 \(in a TOML file: lr = 0\.001\)$"),
    (option_zero_steps, TrainOptionError,
     r"--steps 0: the number of training steps must be a positive integer" + _FIX +
     r"--steps 200 \(in a TOML file: steps = 200\)"),
    (option_steps_not_an_integer, TrainOptionError,
     r"--steps '10': the number of training steps must be a positive integer"),
    (option_unknown_lr_decay, TrainOptionError,
     r"--lr-decay 'exponential': must be one of cosine, linear, constant.*"
     r"choices=\['cosine', 'linear', 'constant'\]" + _FIX + r"--lr-decay cosine"),
    (option_unknown_device, TrainOptionError, r"--device 'tpu': must be one of cpu, cuda"),
    (option_unknown_dtype, TrainOptionError, r"--dtype 'fp16': must be one of fp32, bf16"),
    (option_eval_fraction_one, TrainOptionError,
     r"--eval-fraction 1\.0: the held-out share must be a number between 0 and 1" + _FIX +
     r"--eval-fraction 0\.1"),
    (option_batch_does_not_split, TrainOptionError,
     r"--batch-size 6 does not split into --dp 2 x --grad-accum 2 = 4 equal micro-batches"
     + _FIX + r"--batch-size 4 \(a multiple of 4"),
    (option_pipeline_batch_does_not_split, TrainOptionError,
     r"the 4 sequences of a pipeline's step \(--batch-size 8 / --dp 2 / --grad-accum 1\) do "
     r"not split into --n-microbatches 3" + _FIX + r"--batch-size 12 \(a multiple of 6\), or "
     r"--n-microbatches dividing 4$"),
    (option_sp_without_tp, TrainOptionError,
     r"--sp: sequence parallelism needs --tp 2 or more.*values: sequence_parallel=True, "
     r"tp=1" + _FIX + r"--tp 2 --sp, or leave --sp out"),
    (option_hsdp_with_one_replica, TrainOptionError,
     r"--dp-mode hsdp: --dp 2 ranks are --dp-replicate 1 replica groups of FSDP2 shards, and "
     r"HSDP needs at least 2 of each\n    values: dp=2, dp_replicate=1\n    fix: --dp 4 "
     r"--dp-mode hsdp --dp-replicate 2 \(2 replicas of 2 shards\)$"),
    (option_dp_replicate_without_hsdp, TrainOptionError,
     r"--dp-replicate 2 is for --dp-mode hsdp" + _FIX +
     r"--dp-mode hsdp --dp-replicate 2, or leave --dp-replicate out$"),
    (option_one_stage_schedule_with_virtual_stages, TrainOptionError,
     r"--pp 2 --pipeline-schedule 1F1B: 1F1B runs one stage per rank, not 3" + _FIX +
     r"--stages-per-rank 1, or --pipeline-schedule Interleaved1F1B --stages-per-rank 3$"),
    (option_pipeline_schedule_typo, TrainOptionError,
     r"--pipeline-schedule 'Interleaved': must be one of GPipe, 1F1B, Interleaved1F1B, "
     r"InterleavedZeroBubble, ZBVZeroBubble"),
    (option_zbv_with_evaluation, TrainOptionError,
     r"--pipeline-schedule ZBVZeroBubble with --eval-every 2: torch's ZBVZeroBubble cannot run "
     r"a forward-only \(evaluation\) pass" + _FIX + r"--pipeline-schedule InterleavedZeroBubble "
     r"\(zero bubble, evaluates\), or leave --eval-every out$"),
    (option_zbv_with_too_few_micro_batches, TrainOptionError,
     r"--pp 2 --pipeline-schedule ZBVZeroBubble: ZBVZeroBubble needs at least as many "
     r"micro-batches as stages \(4\), not 2" + _FIX + r"--pp 2 --n-microbatches 4$"),
    (option_ac_with_a_ratio, TrainOptionError,
     r"--ac op checkpoints every layer and --ckpt-ratio 0\.5 a share of them" + _FIX +
     r"--ac op alone, or --ckpt-ratio 0\.5 alone$"),
    (option_warmup_longer_than_the_run, TrainOptionError,
     r"--warmup-steps 20: more warm-up steps than --steps 10" + _FIX + r"--warmup-steps 1"),
    (option_resume_without_save_dir, TrainOptionError,
     r"--resume needs the checkpoint directory" + _FIX +
     r"torchloom train --save-dir runs/gpt2 --resume"),
    (option_model_typo, TrainOptionError,
     r"--model 'lama': not a zoo model, a model folder \(with config\.json\) or a config "
     r"\.json file.*zoo=\['bert', 'gpt2', 'llama'" + _FIX + r"--model llama, or --model "
     r"path/to/folder"),
    (option_model_folder_without_config, TrainOptionError,
     r"--model '.*': the folder has no config\.json.*contents=\['weights\.bin'\]"),
    (option_data_missing, TrainOptionError,
     r"--data '.*nowhere\.txt': no such file or folder" + _FIX + r"--data corpus/"),
    (toml_unknown_key, TrainOptionError,
     r"--config '.*run\.toml': unknown option 'learning-rate'.*option='learning-rate'" +
     _FIX + r"options: model, size, data"),
    (toml_not_toml, TrainOptionError,
     r"--config '.*run\.toml': not a TOML file" + _FIX + r"write options as key = value"),
    (toml_bad_value, TrainOptionError,
     r"--clip-grad -1: must be a non-negative number \(0: off\)" + _FIX +
     r"--clip-grad 1\.0 \(in a TOML file: clip_grad = 1\.0\)"),
    (launch_cuda_ranks_without_torchrun, TrainOptionError,
     r"--device cuda with 2 ranks: the local launcher starts gloo ranks for CPU" + _FIX +
     r"torchrun --nproc-per-node 2 -m torchloom train --device cuda --tp 2"),
    (check_metrics_inside_the_save_dir, TrainOptionError,
     r"--metrics '.*run/metrics\.jsonl' is inside --save-dir '.*run', which holds only "
     r"checkpoints" + _FIX + r"--metrics .*metrics\.jsonl"),
    (check_save_pretrained_over_other_files, TrainOptionError,
     r"--save-pretrained '.*': the folder holds files save_pretrained does not write.*"
     r"other_files=\['notes\.txt'\]" + _FIX + r"--save-pretrained runs/exported"),
    (check_folder_positions, TrainOptionError,
     r"--seq-len 64 is longer than the 32 positions of .*model: config field "
     r"max_position_embeddings = 32" + _FIX + r"--seq-len 32"),
    (check_bytes_beyond_the_vocabulary, DataError,
     r"the text has token id 116, but the model's vocabulary has 64 entries \(tokens: bytes\)"
     + _FIX + r"use the tokenizer the model was trained with"),
    (check_held_out_too_small, DataError,
     r"the held-out split holds 100 tokens, fewer than one evaluation batch of --batch-size 8 "
     r"x --seq-len 32 = 256" + _FIX + r"raise --eval-fraction"),
    (check_data_shorter_than_a_window, DataError,
     r"the training text holds 57 tokens, not more than one window of --seq-len 64"),
    (check_empty_data_folder, DataError,
     r"the folder holds no files.*data='.*empty'" + _FIX + r"put \.txt files in it"),
    (check_heads_that_tp_does_not_divide, TrainOptionError,
     r"^torchloom train\(\.\.\.\): --tp 3: tensor parallelism gives each of the 3 ranks whole "
     r"attention heads, and 2 heads do not divide\n    values: model='llama', heads=2, tp=3\n"
     r"    fix: --tp in \[1, 2\]$"),
    (check_layers_that_virtual_stages_do_not_divide, TrainOptionError,
     r"--pp 2: 2 layers do not split evenly into 4 stages" + _FIX +
     r"--pp x --stages-per-rank dividing 2: one of \[1, 2\]; or an uneven split with "
     r"--stage-cuts$"),
    (check_stage_cuts_leaving_a_stage_empty, TrainOptionError,
     r"--pp 2: a stage would have no layer: 2 stages, cuts \[1\], 2 layers" + _FIX +
     r"--stage-cuts naming 1 increasing layers from 0 to 0$"),
    (option_stage_cuts_not_integers, TrainOptionError,
     r"--stage-cuts '0,x': must list the layers \(0-based\) after which a stage ends, "
     r"comma-separated" + _FIX + r"--stage-cuts 7,15,23 \(in a TOML file: stage_cuts = "
     r"'7,15,23'\)$"),
    (option_loss_parallel_without_tp, TrainOptionError,
     r"--loss parallel splits the logits between the tensor-parallel ranks: it needs --tp 2 "
     r"or more" + _FIX + r"--tp 2 --loss parallel, or --loss chunked \(the default; in a "
     r"TOML file: loss = 'chunked'\)$"),
    (option_unknown_loss, TrainOptionError,
     r"--loss 'fused': must be one of full, parallel, chunked" + _FIX + r"--loss full"),
    (option_float8_on_cpu, TrainOptionError,
     r"--float8: Float8 matmuls run on a CUDA GPU \(compute capability 8\.9 or more\) with "
     r"torchao, and the device is cpu\n    values: float8=True, device='cpu'" + _FIX +
     r"--device cuda --float8 \(pip install 'torchloom\[float8\]'\), or leave --float8 out"),
    (option_async_tp, TrainOptionError,
     r"--async-tp: asynchronous tensor parallelism overlaps .* torchloom train does not build "
     r"it yet" + _FIX + r"leave --async-tp out \(in a TOML file: async_tp = false\)$"),
    (check_resume_from_stage_folders_of_an_older_version, CheckpointIOError,
     r"the save directory holds stage-0, stage-1: the per-stage checkpoints of a pipeline run "
     r"of an older torchloom, which saved each stage apart; this version saves one checkpoint "
     r"for every layout and does not read them" + _FIX + r"start anew in another directory: "
     r"--save-dir .*-2; or finish that run with the torchloom version that wrote it$"),
]
