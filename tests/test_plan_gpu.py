"""What the planner models for GPU runs (issue 27): the H100 96 GB profile and the caching
allocator's reserve, causal attention kernels, FSDP2's prefetch, op-level selective
checkpointing measured under torchtitan's policy, the loss modes, the compile / Float8 /
async-TP knobs, attention without a materialised mask, the ``--json`` fields a tool reads,
and the published rows ``benchmarks/plan_vs_published.py`` predicts."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
from typer.testing import CliRunner

from torchloom.apps.plan_cli import app, train_command
from torchloom.plan import Layout, get_profile, model_spec, predict
from torchloom.plan.crossing import crossing
from torchloom.plan.profiles import CUDA_RESERVE, measure_local
from torchloom.plan.units import UnitKey, measure_units

SEQ = 32
ENV = {"COLUMNS": "200"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_h100_96gb_profile_and_the_allocator_reserve():
    prof = get_profile("h100-96gb")
    assert prof.memory_bytes == 96 * 2**30 and prof.memory_bandwidth == 2.4e12
    assert prof.peak_flops("fp8") == pytest.approx(2 * prof.peak_flops("bf16"), rel=1e-3)
    assert prof.allocator_reserve == CUDA_RESERVE > 1
    assert measure_local(size=64, link=False, repeats=1).allocator_reserve == 1.0
    p = predict("llama", Layout(micro_batch=2, seq_len=SEQ), prof)
    m = p.roles[0].memory
    assert m.reserved == round(m.peak * CUDA_RESERVE) and p.peak == m.reserved
    assert p.peak_allocated == m.peak < p.peak
    assert p.tokens_per_s_per_gpu == pytest.approx(p.tokens_per_s / p.layout.world)


def test_causal_attention_is_recorded_as_causal_and_runs_without_a_mask():
    spec = model_spec("llama", seq_len=SEQ)
    units = measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ))
    kinds = {k for seg in units.segments.values() for *_, k in seg.matmuls}
    assert kinds == {"linear", "causal"}
    # the tensors crossing a pipeline cut: no (seq, seq) mask, as on a GPU
    cross = crossing(spec, UnitKey(micro_batch=1, seq_len=SEQ))
    assert all(dtype != "bool" for _, dtype, _ in cross.middle), cross.middle
    bert = measure_units(model_spec("bert", seq_len=SEQ), UnitKey(micro_batch=1, seq_len=SEQ))
    assert "causal" not in {k for s in bert.segments.values() for *_, k in s.matmuls}


def test_op_level_checkpointing_is_measured_between_plain_and_full():
    spec = model_spec("llama", size="small", seq_len=128)
    full = measure_units(spec, UnitKey(micro_batch=2, seq_len=128))
    op = measure_units(spec, UnitKey(micro_batch=2, seq_len=128, ac="op"))
    plain_saved = full.segments["L2.f"].delta     # the unchekpointed layer of both
    assert full.segments["L1.f"].delta < op.segments["L1.f"].delta < plain_saved
    assert full.segments["L1.b"].flops > op.segments["L1.b"].flops > \
        full.segments["L2.b"].flops


def test_fsdp_prefetch_is_held_on_a_gpu_only():
    lay = Layout(dp_shard=2, micro_batch=2, seq_len=SEQ, mixed_precision="bf16")
    gpu = predict("llama", lay, "h100-80gb")
    cpu = predict("llama", lay, get_profile("h100-80gb").__class__(
        **{**get_profile("h100-80gb").to_dict(), "name": "no-overlap", "overlap": False}))
    assert gpu.roles[0].memory.peak > cpu.roles[0].memory.peak


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    """A default LlamaConfig with 1B-class widths and Llama 3's vocabulary (two layers: the
    planner scales by the layer count), saved as a config folder."""
    import transformers

    path = tmp_path_factory.mktemp("llama1b")
    transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                             num_attention_heads=16, num_key_value_heads=8,
                             vocab_size=128256).save_pretrained(path)
    return model_spec(str(path), seq_len=1024)


def test_the_kernel_knobs_change_time_not_memory(llama_1b):
    base = Layout(tp=2, sp=True, dp_shard=2, micro_batch=2, seq_len=1024,
                  mixed_precision="bf16")
    plain = predict(llama_1b, base, "h100-80gb")
    comp = predict(llama_1b, base.replace(compile=True), "h100-80gb")
    fp8 = predict(llama_1b, base.replace(compile=True, float8=True), "h100-80gb")
    asy = predict(llama_1b, base.replace(compile=True, async_tp=True), "h100-80gb")
    assert plain.step_time > comp.step_time > fp8.step_time
    assert asy.roles[0].time.communication < comp.roles[0].time.communication
    assert plain.peak == comp.peak == fp8.peak == asy.peak
    # a device without an FP8 peak runs the products in bf16
    a100 = predict(llama_1b, base.replace(compile=True), "a100-80gb")
    a100_fp8 = predict(llama_1b, base.replace(compile=True, float8=True), "a100-80gb")
    assert a100_fp8.step_time == a100.step_time


def test_the_loss_modes_are_planned_as_built(llama_1b):
    base = Layout(tp=2, micro_batch=8, seq_len=1024, mixed_precision="bf16")
    full, par, chunk = (predict(llama_1b, base.replace(loss=m), "h100-80gb")
                        for m in ("full", "parallel", "chunked"))
    assert chunk.peak < par.peak < full.peak
    with pytest.raises(Exception, match="needs tp > 1"):
        Layout(loss="parallel")


def test_json_gives_peak_gib_and_tokens_per_s_per_gpu(tmp_path):
    out = tmp_path / "fixed.json"
    args = ["llama", "--gpus", "4", "--tp", "2", "--dp", "2", "--dp-mode", "fsdp",
            "--seq-len", str(SEQ), "--batch-size", "4", "--gpu", "h100-96gb", "--loss",
            "parallel", "--compile", "--float8", "--async-tp", "--ac", "op"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)], env=ENV)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["peak_gib"] == pytest.approx(data["peak"] / 2**30)
    assert data["tokens_per_s_per_gpu"] == pytest.approx(data["tokens_per_s"] / 4)
    assert data["layout"]["loss"] == "parallel" and data["layout"]["async_tp"] is True
    assert "torchloom train cannot run it" in result.output  # --async-tp: planner only
    out2 = tmp_path / "search.json"
    result = CliRunner().invoke(app, ["llama", "--gpus", "2", "--seq-len", str(SEQ),
                                      "--batch-size", "2", "--json", str(out2)], env=ENV)
    assert result.exit_code == 0, result.output
    ranked = json.loads(out2.read_text())["ranked"]
    assert ranked and all({"peak_gib", "tokens_per_s_per_gpu"} <= set(p) for p in ranked)


def test_train_command_names_the_loss_and_kernels():
    spec = model_spec("llama", seq_len=SEQ)
    lay = Layout(tp=2, sp=True, compile=True, float8=True, loss="full", seq_len=SEQ)
    cmd, _ = train_command(spec, lay)
    assert cmd is not None
    for flag in ("--loss full", "--compile", "--float8"):
        assert flag in cmd
    cmd, why = train_command(spec, lay.replace(async_tp=True))
    assert cmd is None and why is not None and "asynchronous tensor parallelism" in why


@pytest.fixture(scope="module")
def published():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        yield importlib.import_module("plan_vs_published")
    finally:
        sys.path.pop(0)


def test_every_published_row_is_listed(published):
    rows = published.ROWS
    assert len(rows) == 18  # tables 1 to 6 of torchtitan's 2024-12 H100 benchmarks
    assert sorted({r.table for r in rows}) == ["1", "2", "3", "4", "5", "6"]
    lay = next(r for r in rows if r.table == "5" and r.schedule == "Interleaved1F1B").layout()
    assert (lay.pp, lay.per_rank, lay.n_microbatches, lay.micro_batch, lay.tp, lay.dp) == \
        (8, 2, 16, 2, 8, 8)
    assert lay.loss == "parallel" and lay.async_tp and lay.float8 and lay.ac == "full"


def test_the_calibration_row_is_met(published, tmp_path):
    """Table 1's first row (Llama 3.1 8B, FSDP 8), the one the h100-96gb profile's matmul
    efficiency was fitted to, stays within the targets; a CP row without a pipeline
    (Table 2) and one inside a pipeline (Table 6) are predicted."""
    rows = [published.ROWS[0], next(r for r in published.ROWS if r.cp > 1 and r.pp == 1),
            next(r for r in published.ROWS if r.cp > 1 and r.pp > 1)]
    items = published.evaluate(rows, str(tmp_path))
    first, cp, piped = items
    assert first["met"], first
    assert cp["status"] == "predicted" and cp["layout"].split()[1] == "cp2", cp
    assert piped["status"] == "predicted" and "cp2 pp8" in piped["layout"], piped


def test_train_takes_the_flags_a_plan_prints():
    """``torchloom train`` accepts what ``train it:`` names: the loss, compile, Float8
    (refused off CUDA, before any rank starts), and refuses async TP on every device."""
    from torchloom.apps.jobconfig import TrainOptionError, options

    lay = options(None, {"model": "llama", "tp": 2, "loss": "parallel", "compile": True,
                         "batch_size": 2}).layout()
    assert (lay.loss, lay.compile, lay.tp) == ("parallel", True, 2)
    with pytest.raises(TrainOptionError, match="--float8"):
        options(None, {"model": "llama", "float8": True})
    with pytest.raises(TrainOptionError, match="async"):
        options(None, {"model": "llama", "async_tp": True})


def test_attention_is_sdpa_by_default_and_a_pipeline_cut_carries_no_mask():
    """transformers 5 builds the zoo's and a config's models with SDPA attention; a
    pipeline is traced (as parallelize and the planner trace it) with SDPA's causal
    kernel, so what crosses a cut holds no (seq, seq) mask."""
    import transformers

    from torchloom.schedules import zoo

    for name in ("llama", "gpt2"):
        assert zoo.make_model(name).config._attn_implementation == "sdpa"
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64)
    assert transformers.LlamaForCausalLM(config).config._attn_implementation == "sdpa"
    spec = model_spec("llama", seq_len=SEQ)
    cross = crossing(spec, UnitKey(micro_batch=1, seq_len=SEQ))
    assert [dtype for _, dtype, _ in cross.first].count("bool") == 0
