"""Tests of the ``torchloom`` command line, run in-process with typer's CliRunner."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import torchloom as tl
from torchloom.apps.cli import app


@pytest.fixture
def run():
    runner = CliRunner()
    threads = torch.get_num_threads()

    def invoke(*args: str):
        return runner.invoke(app, list(args))

    yield invoke
    torch.set_num_threads(threads)  # the demo sets it


def test_show_prints_the_collapsed_tree(run):
    result = run("show", "gpt2")
    assert result.exit_code == 0, result.output
    assert "GPT2LMHeadModel" in result.output
    assert "h.0 .. h.1: GPT2Block x2" in result.output
    assert "◆" not in result.output  # no schedule asked for


def test_show_with_the_demo_schedule(run):
    result = run("show", "llama", "--ckpt-ratio", "0.5")
    assert result.exit_code == 0, result.output
    assert "◆ .checkpoint(ratio=0.5)" in result.output
    assert "sch['model.layers'].checkpoint(ratio=0.5)" in result.output  # the recipe


def test_list_primitives(run):
    result = run("list-primitives")
    assert result.exit_code == 0, result.output
    for name in tl.list_primitives():
        assert name in result.output


def test_unknown_model_is_a_clean_error_with_exit_code_2(run):
    result = run("show", "gpt3")
    assert result.exit_code == 2
    assert "unknown model 'gpt3'" in result.output
    assert "gpt2" in result.output  # the known names are listed
    assert "Traceback" not in result.output


def test_a_schedule_error_from_a_primitive_exits_with_code_2(run):
    result = run("show", "gpt2", "--size", "huge")
    assert result.exit_code == 2
    assert "unknown size 'huge'" in result.output


def test_demo_trains_and_reports_throughput(run):
    result = run("demo", "--steps", "3", "--layers", "2", "--batch-size", "2",
                 "--seq-len", "32", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "sch['transformer.h'].checkpoint(ratio=0.5)" in result.output
    assert "tokens/s" in result.output
    assert "loss, step 1" in result.output
    assert "1 of 2" in result.output  # checkpointed layers


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "torchloom", "--version"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"torchloom {tl.__version__}"


def test_verify_on_two_ranks(run):
    result = run("verify", "bert", "--tp", "2", "--sp")
    assert result.exit_code == 0, result.output
    assert "ok: 38 primitive calls, the scheduled model computes what the original does" \
        in result.output
    assert "equal" in result.output and "differs" not in result.output


def test_verify_in_one_process_and_its_errors(run):
    result = run("verify", "llama", "--ckpt-ratio", "0.5")
    assert result.exit_code == 0, result.output
    assert "ok: 23 primitive calls" in result.output
    result = run("verify", "gpt2", "--sp")
    assert result.exit_code == 2
    assert "sequence parallelism needs at least two tensor-parallel ranks" in result.output
    assert "torchloom verify gpt2 --tp 2 --sp" in result.output
    result = run("verify", "gpt2", "--tp", "3", "--sp")  # refused before any rank starts
    assert result.exit_code == 2
    assert "splits the 16 positions verified between the 3 tensor-parallel ranks" \
        in result.output
    result = run("verify", "resnet")
    assert result.exit_code == 2
    assert "resnet" in result.output and "gpt2" in result.output  # the known names


def test_tune_prunes_over_budget_and_prints_the_best_recipe(run, tmp_path):
    result = run("tune", "gpt2", "--budget-gb", "0.0035", "--batch-sizes", "2,4,8",
                 "--db", str(tmp_path / "t.db"), "--plot", str(tmp_path / "t.png"),
                 "--threads", "1", "--steps", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps lines at the terminal width
    assert re.search(r"\d+ evaluated, 0 resumed from .* [1-9]\d* pruned by the cost model", text)
    assert "sch['transformer.h'].checkpoint(ratio=" in text
    assert (tmp_path / "t.png").stat().st_size > 1000
    again = run("tune", "gpt2", "--budget-gb", "0.0035", "--batch-sizes", "2,4,8",
                "--db", str(tmp_path / "t.db"), "--plot", "", "--threads", "1", "--steps", "1")
    assert again.exit_code == 0, again.output
    # every finished trial (and every pruned point) comes back from the database
    assert re.search(r"\b0 evaluated, [1-9]\d* resumed", " ".join(again.output.split()))
