"""torchloom train: checkpoints every N steps, and a run killed with SIGKILL and resumed
computes the same losses, bit for bit, as a run never interrupted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["--steps", "8", "--batch-size", "4", "--seq-len", "32", "--save-every", "2",
        "--threads", "1", "--ckpt-ratio", "0.5"]
LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)")


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torchloom", "train", *ARGS, *extra]


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for line in text.splitlines() if (m := LINE.match(line))}


def _run(*extra: str) -> str:
    done = subprocess.run(_command(*extra), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_killed_and_resumed_run_matches_an_uninterrupted_one(tmp_path: Path):
    reference = _losses(_run("--save-dir", str(tmp_path / "a")))
    assert sorted(reference) == list(range(1, 9))
    assert sorted(os.listdir(tmp_path / "a")) == ["step-6", "step-8", "torchloom-checkpoints.json"]

    # Kill the second run with SIGKILL once step 5 is printed (checkpoint of step 4 on disk).
    proc = subprocess.Popen(_command("--save-dir", str(tmp_path / "b")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    before: dict[int, str] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        before.update(_losses(line))
        if 5 in before:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    after = _losses(_run("--save-dir", str(tmp_path / "b"), "--resume"))
    assert min(after) in (5, 7), after  # resumed after the last complete checkpoint
    combined = {**{s: v for s, v in before.items() if s < min(after)}, **after}
    assert combined == reference  # the same float reprs: bitwise equal
    # whatever the kill left (a partial save of step 6) is gone; the two newest stay
    assert sorted(os.listdir(tmp_path / "b")) == ["step-6", "step-8", "torchloom-checkpoints.json"]


def test_resume_needs_a_directory():
    done = subprocess.run(_command("--resume"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--resume needs the checkpoint directory" in done.stdout + done.stderr
    assert "torchloom train --save-dir runs/gpt2 --resume" in done.stdout + done.stderr


@pytest.mark.slow
def test_tensor_parallel_run_resumes_exactly(tmp_path: Path):
    reference = _losses(_run("--tp", "2", "--save-dir", str(tmp_path / "a")))
    _run("--tp", "2", "--save-dir", str(tmp_path / "b"), "--stop-after", "4")
    after = _losses(_run("--tp", "2", "--save-dir", str(tmp_path / "b"), "--resume"))
    assert sorted(after) == [5, 6, 7, 8]
    assert {s: reference[s] for s in after} == after


def test_torchrun_launches_tensor_data_and_pipeline_parallel_training():
    for flag in ("--tp", "--dp", "--pp"):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
             "torchloom", "train", flag, "2", "--steps", "2", "--batch-size", "4",
             "--seq-len", "32"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(_losses(done.stdout)) == [1, 2]
        assert done.stdout.count("trained steps 1..2") == 1  # rank 0 reports


def test_activation_checkpointing_policies_train_the_same_losses():
    """``--ac full`` and ``--ac op`` (every layer; op-level selective) and ``--ckpt-ratio``
    recompute what they drop exactly: the losses equal a run without checkpointing, and
    the run's recipe records the policy."""
    from torchloom.apps import train as T

    def losses(**knobs) -> list[float]:
        cfg = T.TrainConfig(model="llama", steps=2, batch_size=4, seq_len=16, **knobs)
        return T.train_rank(0, cfg)["losses"]

    plain = losses()
    assert losses(ac="full") == plain
    assert losses(ac="op") == plain
    assert losses(ckpt_ratio=0.5) == plain
    from torchloom.parallel import Layout, create_schedule, parallelize
    from torchloom.schedules import zoo

    sch = create_schedule(zoo.make_model("llama"), None)
    done = parallelize(sch, Layout(ac="op"))
    assert done.checkpointed == ["model.layers.0", "model.layers.1"]
    assert "sch['model.layers'].checkpoint(ratio=1.0, policy='op')" in str(sch.recipe)
