"""``torchloom train`` knows what it resumes (in-process, one rank, a few tiny steps).

* a checkpoint holds the run's configuration; ``--resume`` with another one exits 2
  listing the differing fields (``--allow-config-change`` accepts it);
* ``--resume`` with nothing loadable exits 2 naming the directory and what it holds;
  a complete run says so and trains nothing; a new run will not write over another's;
* a NaN loss stops the run naming the step, before any checkpoint of it is written;
* models that take images and sequences longer than a model's positions are refused up
  front; ``--timeout`` reaches the launcher and torchrun's process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from typer.testing import CliRunner

from torchloom.apps import train as T
from torchloom.apps.cli import app
from torchloom.apps.train_checkpoints import compare
from torchloom.runtime import launch
from torchloom.runtime import state as S

BASE = ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--save-every", "1",
        "--threads", "1"]


@pytest.fixture
def cli():
    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(app, [*BASE, *args])
        # rich wraps long lines at the terminal width: compare words
        return result.exit_code, " ".join(result.output.split())

    return invoke


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> str:
    """A complete 3-step run (checkpoints of steps 2 and 3)."""
    save_dir = str(tmp_path_factory.mktemp("run") / "run")
    result = CliRunner().invoke(app, [*BASE, "--save-dir", save_dir])
    assert result.exit_code == 0, result.output
    return save_dir


def test_the_checkpoint_records_the_run_configuration(finished_run):
    ckpt = S.list_checkpoints(finished_run)[0]
    assert ckpt.step == 3
    assert ckpt.config == {
        "model": "gpt2", "size": "tiny", "data": [], "eval_fraction": 0.1, "eval_every": 0,
        "eval_batches": 4, "steps": 3, "batch_size": 2, "grad_accum": 1, "seq_len": 16,
        "lr": 0.001, "warmup_steps": None, "lr_decay": "cosine", "min_lr_ratio": 0.1,
        "weight_decay": 0.01, "clip_grad": 0.0, "seed": 0, "dtype": "fp32", "tp": 1, "cp": 1, "ep": 1,
        "dp": 1, "dp_mode": "ddp", "dp_replicate": 1, "pp": 1, "pipeline_schedule": "1F1B",
        "stages_per_rank": None, "stage_cuts": None, "n_microbatches": 4, "sequence_parallel": False,
        "ckpt_ratio": 0.0, "ac": None, "deterministic": True, "loss": "chunked", "float8": False,
        "lora": None, "lora_base_dtype": "fp32", "pack": False,
        "recipe": "import torchloom\n\nsch = torchloom.create_schedule(model)"}


def test_a_checkpoint_of_an_older_version_resumes_with_the_new_fields_at_defaults():
    old = {k: v for k, v in T.run_config(T.TrainConfig(), "").items()
           if k not in ("data", "grad_accum", "clip_grad", "dtype")}
    compare(old, T.run_config(T.TrainConfig(), ""), "step-1", "runs/x")  # no error
    with pytest.raises(S.CheckpointMismatchError, match="configuration: dtype"):
        compare(old, T.run_config(T.TrainConfig(dtype="bf16"), ""), "step-1", "runs/x")


def test_resume_with_another_configuration_lists_the_fields(cli, finished_run):
    code, output = cli("--save-dir", finished_run, "--resume", "--lr", "0.002", "--seed", "1")
    assert code == 2
    assert ("error: torchloom train(...): checkpoint 'step-3' was saved by a run with another "
            "configuration: lr, seed values: save_dir=") in output, output
    assert ("differences=['lr: 0.001 in the checkpoint, 0.002 now', 'seed: 0 in the "
            "checkpoint, 1 now'] fix: resume with the checkpoint's values: torchloom train "
            f"--save-dir {finished_run} --resume --lr 0.001 --seed 0; or continue with the "
            "new values: add --allow-config-change") in output, output
    assert "step " not in output.replace("step-3", "")  # nothing trained


def test_allow_config_change_resumes(cli, finished_run, tmp_path):
    import shutil

    save_dir = str(tmp_path / "copy")
    shutil.copytree(finished_run, save_dir)
    code, output = cli("--save-dir", save_dir, "--resume", "--steps", "4",
                       "--allow-config-change")
    assert code == 0, output
    assert re.search(r"step 4 loss \S+ .* trained steps 4\.\.4", output), output
    assert S.list_checkpoints(save_dir)[0].config["steps"] == 4  # the new one is recorded


def test_resume_into_another_layout_is_accepted_and_said(cli, tmp_path):
    """A layout field (here the accumulation micro-steps) may change on --resume without
    --allow-config-change: the run says what changed, and computes the same step (of a
    model without dropout: another split of the batch draws other dropout masks)."""
    save_dir = str(tmp_path / "run")
    code, whole = cli("--model", "llama", "--save-dir", save_dir)  # llama: no dropout
    assert code == 0, whole
    shutil.rmtree(os.path.join(save_dir, "step-3"))  # keep step 2 only
    code, output = cli("--model", "llama", "--save-dir", save_dir, "--resume",
                       "--grad-accum", "2")
    assert code == 0, output
    assert re.search(r"resumed step 2 from \S+step-2; the layout changed \(grad_accum: 1 -> "
                     r"2\): the checkpoint was resharded on load", output), output
    before = float(re.search(r"step 3 loss (\S+)", whole).group(1))
    after = float(re.search(r"step 3 loss (\S+)", output).group(1))
    assert abs(before - after) <= 1e-6 * abs(before)


def test_a_different_recipe_is_a_difference():
    saved = {**{k: 1 for k in T.RUN_FIELDS}, "recipe": "sch['h'].checkpoint()"}
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            "torchloom train(...): checkpoint 'step-4' was saved by a run with another "
            "configuration: recipe")) as info:
        compare(saved, {**saved, "recipe": ""}, "step-4", "runs/x")
    assert str(info.value) == (
        "torchloom train(...): checkpoint 'step-4' was saved by a run with another "
        "configuration: recipe\n"
        "    values: save_dir='runs/x', differences=['recipe: the schedule differs']\n"
        "    fix: continue with the new values: add --allow-config-change")


def test_an_already_complete_run_says_so(cli, finished_run):
    before = json.loads(open(os.path.join(finished_run, S.DIR_MARKER)).read())
    code, output = cli("--save-dir", finished_run, "--resume")
    assert code == 0, output
    assert output == (f"the run in {finished_run} is already complete: its newest checkpoint "
                      "is of step 3 of --steps 3; nothing to train (to train further, raise "
                      "--steps and add --allow-config-change)")
    assert json.loads(open(os.path.join(finished_run, S.DIR_MARKER)).read()) == before


def test_resume_without_a_checkpoint_exits_2_naming_the_directory(cli, tmp_path, monkeypatch):
    missing = str(tmp_path / "typo")
    code, output = cli("--save-dir", missing, "--resume")
    assert code == 2
    assert output == (
        "error: torchloom train(...): --resume: the save directory holds no complete "
        f"checkpoint to resume from values: save_dir='{missing}', contents=['(missing)'] "
        "fix: check the directory name, or start the run without --resume: torchloom train "
        f"--model gpt2 --save-dir {missing}")
    # a directory where only an interrupted first save was left
    crashed = str(tmp_path / "crashed")
    original = S._checksums

    class Crash(BaseException):
        pass

    def crash(*args):
        original(*args)
        raise Crash("crash after _checksums")

    monkeypatch.setattr(S, "_checksums", crash)
    with pytest.raises(Crash, match=r"^crash after _checksums$"):
        T.train_rank(0, T.TrainConfig(steps=1, batch_size=2, seq_len=16, save_dir=crashed))
    monkeypatch.undo()
    code, output = cli("--save-dir", crashed, "--resume")
    assert code == 2
    assert re.search(r"holds no complete checkpoint to resume from values: save_dir='.*', "
                     r"contents=\['\.tmp-step-1-[0-9a-f]{12} \(interrupted save\)', "
                     r"'torchloom-checkpoints\.json \(the torchloom marker\)'\]", output), output


def test_a_new_run_does_not_write_over_another_run(cli, finished_run):
    code, output = cli("--save-dir", finished_run)
    assert code == 2
    assert ("the save directory already holds checkpoints of a run (newest: step 3); a new run "
            "would replace them") in output, output
    assert f"fix: continue that run: torchloom train --save-dir {finished_run} --resume" in output


def test_a_nan_loss_stops_before_its_checkpoint(tmp_path, monkeypatch):
    save_dir = str(tmp_path / "run")
    original = T._step_loss
    calls = []

    def nan_at_step_3(model, ids):
        calls.append(1)
        loss = original(model, ids)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(T, "_step_loss", nan_at_step_3)
    cfg = T.TrainConfig(steps=4, batch_size=2, seq_len=16, save_dir=save_dir, save_every=1)
    with pytest.raises(T.NonFiniteLossError, match=re.escape(
            "torchloom train(...): the loss of step 3 is nan: training stopped before the "
            "optimizer step")) as info:
        T.train_rank(0, cfg)
    last = os.path.join(save_dir, "step-2")
    assert str(info.value) == (
        "torchloom train(...): the loss of step 3 is nan: training stopped before the "
        "optimizer step of step 3, and no checkpoint of step 3 was written\n"
        f"    values: step=3, loss=nan, lr={T.lr_at(2, 4, 1e-3)!r}, last_checkpoint={last!r}\n"
        f"    fix: resume from the last good checkpoint with a lower learning rate: torchloom "
        f"train --save-dir {save_dir} --resume --lr 0.0005 --allow-config-change")
    assert sorted(os.listdir(save_dir)) == ["step-1", "step-2", S.DIR_MARKER]
    assert S.find_checkpoint(save_dir).step == 2


def test_models_and_lengths_that_cannot_train_are_refused_up_front(cli):
    code, output = cli("--model", "vit")
    assert code == 2
    assert output == (
        "error: torchloom train(...): torchloom train feeds token windows of text, and vit "
        "takes images values: model='vit', supported=['bert', 'gpt2', 'llama', 'opt', 't5'] "
        "fix: train one of bert, gpt2, llama, opt, t5: torchloom train --model gpt2; train vit "
        "in Python with image batches (zoo.example_inputs('vit', model))")
    code, output = cli("--model", "opt", "--seq-len", "300")
    assert code == 2
    assert output == (
        "error: torchloom train(...): --seq-len 300 is longer than the 128 positions of opt "
        "(tiny): config field max_position_embeddings = 128 values: model='opt', size='tiny', "
        "seq_len=300, max_position_embeddings=128 fix: torchloom train --model opt --size "
        "tiny --seq-len 128")
    # gpt2's position table grows to the sequence (and the checkpoint records seq_len)
    grown = T.meta_model(T.TrainConfig(model="gpt2", size="tiny", seq_len=300))
    assert grown.config.n_positions == 300 and grown.transformer.wpe.weight.shape[0] == 300


def test_timeout_reaches_the_launcher_and_torchrun(cli, monkeypatch):
    seen = {}
    done = {"losses": [5.0], "first_step": 1, "tokens_per_s": 1.0}

    def fake_run_ranks(fn, world, *args, timeout_s):
        seen["run_ranks"] = (world, timeout_s)
        return [done] * world

    monkeypatch.setattr(launch, "run_ranks", fake_run_ranks)
    code, output = cli("--tp", "2", "--timeout", "7")
    assert code == 0, output
    assert seen["run_ranks"] == (2, 7.0)

    monkeypatch.setattr(launch, "under_torchrun", lambda: True)
    monkeypatch.setattr("torchloom.apps.cli._start_group",
                        lambda device, timeout: seen.update(group=(device, timeout)))
    monkeypatch.setattr("torchloom.apps.cli.train_rank_cli", lambda rank, config: done)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    code, output = cli("--timeout", "9")
    assert code == 0, output
    assert seen["group"] == ("cpu", 9.0)  # gloo for --device cpu, even where CUDA exists


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_saves_again(cli, finished_run,
                                                                           tmp_path):
    import shutil

    save_dir = tmp_path / "copy"
    shutil.copytree(finished_run, save_dir)
    shard = save_dir / "step-3" / "__0_0.distcp"  # a symbolic link inside step-3
    (tmp_path / "elsewhere.distcp").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere.distcp")
    with pytest.warns(UserWarning, match=r"set aside the damaged 'step-3' as "
                      r"'\.damaged-step-3-[0-9a-f]{12}'"):
        code, output = cli("--save-dir", str(save_dir), "--resume")
    assert code == 0, output  # it died at the save of step 3 before
    assert re.search(r"trained steps 3\.\.3", output), output
    names = sorted(os.listdir(save_dir))
    assert names[1:] == ["step-2", "step-3", S.DIR_MARKER], names
    assert re.fullmatch(r"\.damaged-step-3-[0-9a-f]{12}", names[0])
    assert S.find_checkpoint(save_dir).step == 3
