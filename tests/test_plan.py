"""torchloom.plan in one process: layouts, profiles, the measured pieces of a step, the
composition, the search and the command line.

Independent checks (not the planner's own formulas): tensor-parallel bytes against
Megatron's count of two all-reduces of the activations per layer and direction, DDP's
against the model's parameter bytes, FLOPs against FlopCounterMode on the real
(unfaked) model, parameter bytes against the model, an extrapolated micro-batch against
a measured one, and the predicted peak against a real step measured on a gloo group of
one rank (the multi-rank comparisons are in tests/test_plan_dist.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import torchloom as tl
from torchloom import schedules
from torchloom.apps.plan_cli import app, train_command
from torchloom.plan import Layout, PlanError, Profile, get_profile, model_spec, predict, search
from torchloom.plan.predict import units_for
from torchloom.plan.units import UnitKey, extrapolate, flop_counter, measure_units
from torchloom.plan.validate import check_prediction, measure_rank
from torchloom.schedules import zoo

SEQ = 32


# ---- layouts and profiles ----------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"sp": True}, "needs tp > 1"),
    ({"tp": 3, "sp": True, "seq_len": 32}, "do not divide"),
    ({"pp": 2, "n_microbatches": 1}, "at least 2 micro-batches"),
    ({"ckpt_ratio": 1.5}, "between 0 and 1"),
    ({"pipeline_schedule": "ZeroBubble"}, "unknown pipeline schedule 'ZeroBubble'"),
    ({"pp": 2, "n_microbatches": 2, "pipeline_schedule": "1F1B", "stages_per_rank": 2},
     "1F1B runs one stage per rank, not 2"),
    ({"ac": "selective"}, "unknown activation checkpointing 'selective'"),
    ({"optimizer": "lion"}, "unknown optimizer"),
    ({"pp": 2, "n_microbatches": 2, "stage_cuts": (3, 1)}, "stage_cuts lists"),
    ({"pp": 2, "dp_shard": 2, "n_microbatches": 4, "pipeline_schedule": "InterleavedZeroBubble"},
     r"InterleavedZeroBubble with FSDP2 loses weight gradients(.|\n)*values: pipeline_schedule="
     r"'InterleavedZeroBubble', pp=2, dp_shard=2(.|\n)*fix: Layout\(pipeline_schedule="
     r"'Interleaved1F1B'\) with FSDP2, or InterleavedZeroBubble with DDP"),
    ({"pp": 2, "cp": 2, "shard_cp": True, "n_microbatches": 4,
      "pipeline_schedule": "ZBVZeroBubble"}, "ZBVZeroBubble with FSDP2 loses weight gradients"),
])
def test_layout_refuses_contradictions(kwargs, pattern):
    # torchloom.plan.Layout is torchloom.Layout; its errors are LayoutErrors (PlanErrors)
    with pytest.raises(tl.LayoutError, match=pattern):
        Layout(**kwargs)
    assert issubclass(tl.LayoutError, PlanError) and Layout is tl.Layout


def test_bf16_stages_under_fsdp2_send_bf16():
    """Pipeline stages that compute in bf16 under FSDP2's mixed precision send bf16 (as
    ``parallelize`` builds them): the stage-to-stage bytes and the receive buffers are
    half those of fp32 stages; under autocast (no FSDP2) the residual stream is fp32 and
    so is what crosses."""
    base = {"pp": 2, "n_microbatches": 2, "micro_batch": 2, "seq_len": SEQ}

    def pipe(p):
        return {(c.kind, c.group): c.bytes for r in p.roles for c in r.collectives
                if c.group == "pp"}

    fp32 = predict("llama", Layout(dp_shard=2, **base))
    bf16 = predict("llama", Layout(dp_shard=2, mixed_precision="bf16", **base))
    autocast = predict("llama", Layout(mixed_precision="bf16", **base))
    # the floats halve; the position ids (int64, a few hundred bytes) cross unchanged
    assert pipe(fp32) and pipe(bf16).keys() == pipe(fp32).keys()
    for key, sent in pipe(fp32).items():
        assert 0 <= 2 * pipe(bf16)[key] - sent <= 0.05 * sent
    assert pipe(autocast) == pipe(fp32)
    assert [2 * r.memory.buffers for r in bf16.roles] == \
        pytest.approx([r.memory.buffers for r in fp32.roles], rel=0.05)


def test_fsdp_under_a_pipeline_hsdp_and_virtual_stages_are_predicted():
    base = {"micro_batch": 1, "seq_len": SEQ}
    spec = model_spec("llama", size="small", seq_len=SEQ)  # 4 layers
    ddp = predict(spec, Layout(pp=2, dp_replicate=2, n_microbatches=4, **base))
    fsdp = predict(spec, Layout(pp=2, dp_shard=2, n_microbatches=4, **base))
    assert len(fsdp.roles) == 2 and fsdp.roles[0].memory.parameters < \
        ddp.roles[0].memory.parameters
    got = fsdp.roles[1].collective_bytes()
    assert got[("reduce_scatter", "dp")] > 0 and ("all_reduce", "dp") not in got
    hsdp = predict(spec, Layout(dp_replicate=2, dp_shard=2, **base))
    assert hsdp.roles[0].collective_bytes()[("all_reduce", "dp_replicate")] > 0
    one = predict(spec, Layout(pp=2, n_microbatches=4, **base))
    inter = predict(spec, Layout(pp=2, n_microbatches=4,
                                 pipeline_schedule="Interleaved1F1B", **base))
    zbv = predict(spec, Layout(pp=2, n_microbatches=4, pipeline_schedule="ZBVZeroBubble",
                               **base))
    bubble = [max(r.time.bubble for r in p.roles) for p in (one, inter, zbv)]
    assert bubble[0] > bubble[1] > bubble[2] >= 0
    assert [r.layers for r in inter.roles] == [2, 2] and inter.layout.stages == 4
    big = model_spec("llama", size="small", seq_len=128)
    full, op, plain = (predict(big, Layout(**kw, micro_batch=8, seq_len=128))
                       for kw in ({"ac": "full"}, {"ac": "op"}, {}))
    assert full.peak <= op.peak <= plain.peak and full.peak < plain.peak
    # op-level selective (torchtitan's policy, measured) recomputes some of the linear
    # products (every other one whose output a backward needs), full all of them
    assert plain.flops_per_step < op.flops_per_step < full.flops_per_step
    assert op.model_flops_per_step == plain.model_flops_per_step == full.model_flops_per_step


def test_planner_and_parallelize_count_the_same_checkpointed_layers():
    from torchloom.core.rules import checkpointed_count

    assert Layout(ckpt_ratio=0.29).checkpointed(100) == checkpointed_count(0.29, 100) == 29
    assert Layout(ac="full").checkpointed(7) == 7


def test_layout_derived_values():
    lay = Layout(tp=2, pp=2, dp_replicate=3, n_microbatches=4, micro_batch=2, seq_len=64,
                 ckpt_ratio=0.5)
    assert (lay.world, lay.batch_size, lay.tokens) == (12, 24, 24 * 64)
    assert lay.stage_layers(6) == [3, 3] and lay.checkpointed(6) == 3
    assert Layout(pp=3, n_microbatches=3, stage_cuts=(0, 4)).stage_layers(8) == [1, 4, 3]


def test_model_checks_name_the_config():
    spec = model_spec("llama")  # 2 layers, 2 heads, 2 KV heads
    with pytest.raises(PlanError, match="2 layers do not split evenly into 3 stages"):
        tl.plan.check_model(Layout(pp=3, n_microbatches=3), spec)
    with pytest.raises(PlanError, match="whole attention heads, and 2 heads"):
        tl.plan.check_model(Layout(tp=4), spec)


def test_profiles_hold_the_datasheet_figures():
    h100, a100 = get_profile("H100-80GB"), get_profile("a100-80gb")
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12)
    assert a100.peak_flops("fp32") == pytest.approx(19.5e12)
    assert get_profile("h200").memory_bandwidth == pytest.approx(4.8e12)
    assert h100.link(8, 1) == h100.intra_node_bandwidth      # a TP group inside a node
    assert h100.link(8, 8) == h100.inter_node_bandwidth      # one rank per node
    assert h100.link(2, 4) == h100.intra_node_bandwidth
    with pytest.raises(PlanError, match="unknown device profile 'tpu'"):
        get_profile("tpu")
    with pytest.raises(PlanError, match="no bf16 matmul peak"):
        predict("gpt2", Layout(seq_len=SEQ, mixed_precision="bf16"), "v100-32gb")


# ---- the measured pieces -----------------------------------------------------------------

def _real_flops(name: str, key: UnitKey) -> int:
    """FlopCounterMode on a real 3-layer model with the same checkpointing."""
    torch.manual_seed(0)
    model = zoo.make_model(name)
    model.config.num_hidden_layers = 3
    model = type(model)(model.config).train()
    if name == "gpt2":
        model.loss_type = "ForCausalLM"
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, ckpt_ratio=2 / 3)
    ids = torch.randint(0, 256, (key.micro_batch, key.seq_len))
    with flop_counter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_flops_equal_flop_counter_mode_on_the_real_model(name):
    key = UnitKey(micro_batch=2, seq_len=SEQ)
    units = measure_units(model_spec(name, seq_len=SEQ), key)
    assert units.flops_total == _real_flops(name, key) > 0
    # a checkpointed layer's backward recomputes its forward (up to the last tensor the
    # backward needs: non-reentrant checkpointing stops the recompute early)
    seg = units.segments
    assert seg["L2.b"].flops + 0.5 * seg["L1.f"].flops < seg["L1.b"].flops <= \
        seg["L2.b"].flops + seg["L1.f"].flops


def test_an_extrapolated_micro_batch_equals_a_measured_one():
    spec = model_spec("llama", seq_len=SEQ)
    one, two = (units_for(spec, UnitKey(tp=1, micro_batch=m, seq_len=SEQ)) for m in (1, 2))
    guess = extrapolate(one, two, 3)
    real = measure_units(spec, UnitKey(micro_batch=3, seq_len=SEQ))
    assert guess is not None
    for name, seg in real.segments.items():
        got = guess.segments[name]
        assert got.flops == seg.flops, name
        assert got.delta == pytest.approx(seg.delta, abs=64), name  # scalars aside
        assert got.rise == pytest.approx(seg.rise, rel=0.02), name


# ---- composed predictions against independent counts -------------------------------------

def test_tensor_parallel_bytes_are_megatrons():
    lay = Layout(tp=2, micro_batch=2, n_microbatches=2, seq_len=SEQ, loss="full")
    pred = predict("llama", lay, "h100-80gb")
    cfg = model_spec("llama").config
    activation = lay.micro_batch * SEQ * cfg.hidden_size * 4
    # two all-reduces per layer forward (attention and MLP outputs), two backward (their
    # input gradients), per micro-batch
    expected = 4 * cfg.num_hidden_layers * activation * lay.n_microbatches
    assert pred.roles[0].collective_bytes() == {("all_reduce", "tp"): expected}
    # the default loss splits the head along the vocabulary: its input gradient is one
    # more all-reduce per micro-batch, the loss's row maxima and sums (fp32) two more
    sharded = predict("llama", lay.replace(loss="chunked"), "h100-80gb")
    rows = lay.micro_batch * SEQ
    loss_rows = rows * 4 + rows * 2 * 4
    assert sharded.roles[0].collective_bytes() == {
        ("all_reduce", "tp"): expected + (activation + loss_rows) * lay.n_microbatches}


def test_data_parallel_bytes_are_the_gradients():
    model = zoo.make_model("gpt2")
    grads = sum(p.numel() * 4 for p in model.parameters())
    ddp = predict("gpt2", Layout(dp_replicate=2, micro_batch=2, seq_len=SEQ))
    # and DDP's map of the parameters the step used (find_unused_parameters): an int32
    # per parameter tensor
    used_map = 4 * len(list(model.parameters()))
    assert ddp.roles[0].collective_bytes() == {("all_reduce", "dp"): grads + used_map}
    fsdp = predict("gpt2", Layout(dp_shard=2, micro_batch=2, seq_len=SEQ))
    got = fsdp.roles[0].collective_bytes()
    # FSDP2 gathers every layer twice (forward, backward) and the root once, and
    # reduce-scatters every gradient once (shapes padded to the degree: at least the
    # model's bytes)
    assert got[("reduce_scatter", "dp")] >= grads
    assert grads < got[("all_gather", "dp")] < 2 * grads


def test_memory_kinds_add_up_and_count_the_model():
    model = zoo.make_model("gpt2")  # the plan keeps its 128 positions (SEQ is shorter)
    params = sum(p.numel() * 4 for p in model.parameters())
    pred = predict("gpt2", Layout(micro_batch=2, seq_len=SEQ))
    m = pred.roles[0].memory
    assert m.parameters == m.gradients == params
    tensors = len(list(model.parameters()))
    assert m.optimizer == 2 * params + 4 * tensors  # AdamW: two states and a step each
    assert m.peak == m.parameters + m.gradients + m.optimizer + m.buffers + m.inputs + \
        m.activations
    # a pipeline: each stage holds its layers; both ends hold the tied embedding
    pipe = predict("gpt2", Layout(pp=2, n_microbatches=2, micro_batch=1, seq_len=SEQ))
    wte = model.transformer.wte.weight.numel() * 4
    assert sum(r.memory.parameters for r in pipe.roles) == params + wte
    assert pipe.roles[1].time.bubble > 0 or pipe.roles[0].time.bubble > 0


def test_checkpointing_and_sequence_parallelism_lower_the_peak():
    base = dict(tp=2, micro_batch=4, seq_len=SEQ)
    peaks = [predict("llama", Layout(**base, ckpt_ratio=r)).peak for r in (0.0, 0.5, 1.0)]
    assert peaks[0] > peaks[1] > peaks[2]
    sp = predict("llama", Layout(**base, sp=True)).peak
    assert sp < peaks[0]


def test_a_step_measured_on_one_rank_is_within_ten_percent():
    lay = Layout(micro_batch=2, n_microbatches=2, seq_len=SEQ, ckpt_ratio=0.5)
    preds = {name: predict(name, lay, "h100-80gb") for name in ("gpt2", "llama")}
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        with pytest.raises(PlanError, match="runs on its own fake process group"):
            predict("gpt2", Layout(micro_batch=3, seq_len=SEQ), "h100-80gb")
        for name, pred in preds.items():
            measured = measure_rank(0, {"model": name, "layout": lay.to_dict()})
            check = check_prediction(measured, pred)
            assert check["within"], (name, check)
            assert check["collectives_equal"], (name, check)
    finally:
        dist.destroy_process_group()


# ---- search and command line -------------------------------------------------------------

def test_search_ranks_fitting_layouts_by_throughput():
    result = search("llama", 4, "h100-80gb", batch_size=8, seq_len=SEQ, ckpt_ratios=(0.0,),
                    micro_batches=(2,))
    fitting = [p for p in result.ranked if p.fits]
    assert fitting and result.best is fitting[0]
    speeds = [p.tokens_per_s for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert {p.layout.world for p in result.ranked} == {4}
    # tp=4 does not divide llama's 2 heads: refused with the reason
    assert any("heads" in why for _, why in result.rejected)


def test_search_prunes_what_cannot_fit_before_measuring():
    small = Profile("toy", 300_000, {"fp32": 1e12}, 1e11, 1e10, 1e9)
    result = search("gpt2", 2, small, batch_size=2, seq_len=SEQ, ckpt_ratios=(0.0,),
                    micro_batches=(1,))
    assert result.best is None
    assert any("optimizer state alone need" in why for _, why in result.rejected)
    assert all(not p.fits for p in result.ranked)


def test_train_command_or_the_reason():
    spec = model_spec("llama")
    cmd, why = train_command(spec, Layout(tp=2, dp_shard=2, micro_batch=2,
                                          mixed_precision="bf16", ckpt_ratio=1.0))
    assert why is None and cmd.startswith("torchrun --nnodes 1 --nproc-per-node 4 -m "
                                          "torchloom train --model llama")
    assert "--dp-mode fsdp" in cmd and "--ckpt-ratio 1" in cmd and "--dtype bf16" in cmd
    cmd, why = train_command(spec, Layout(pp=2, dp_replicate=2, dp_shard=2, n_microbatches=2,
                                          pipeline_schedule="Interleaved1F1B", ac="op",
                                          mixed_precision="bf16"))
    assert why is None, why
    assert "--dp-mode hsdp --dp-replicate 2 --pipeline-schedule Interleaved1F1B" in cmd
    assert "--ac op" in cmd and "--dtype bf16" in cmd
    cmd, why = train_command(spec, Layout(pp=2, n_microbatches=2, stage_cuts=(0,)))
    assert why is None and "--pp 2 --stage-cuts 0 --n-microbatches 2" in cmd


def test_cli_with_degrees_prints_every_stage(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["gpt2", "--gpus", "4", "--tp", "2", "--pp", "2",
                                      "--seq-len", str(SEQ), "--batch-size", "4",
                                      "--dtype", "fp32", "--json", str(out)],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "memory per GPU" in result.output and "time per step" in result.output
    data = json.loads(out.read_text())
    assert [r["stage"] for r in data["roles"]] == [0, 1]
    assert data["layout"]["tp"] == 2 and data["fits"]


def test_cli_search_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    result = CliRunner().invoke(app, ["llama", "--gpus", "2", "--seq-len", str(SEQ),
                                      "--batch-size", "4", "--ckpt-ratio", "0",
                                      "--micro-batch", "2", "--top", "2", "--json", str(out),
                                      "--plot", str(png)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "the fastest layouts that fit" in result.output and "train it:" in result.output
    data = json.loads(out.read_text())
    assert data["predicted"] >= 2 and png.stat().st_size > 0


def test_cli_errors_exit_2():
    result = CliRunner().invoke(app, ["gpt2", "--gpus", "4", "--tp", "3", "--pp", "1",
                                      "--dp", "1"])
    assert result.exit_code == 2
    assert "is not --gpus 4" in result.output


@pytest.mark.slow
def test_llama2_70b_on_64_h100s_is_planned_from_its_config(tmp_path):
    # The question the planner exists for, on a Llama-2-70B config.json (no weights): the
    # search over every layout of 64 H100-80GB for a 2 M-token batch, ranked. (Its time,
    # 51 s on the 2-core CI machine, is in the README, not asserted.)
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672,
                                   num_hidden_layers=80, num_attention_heads=64,
                                   num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=4096)
    cfg.save_pretrained(tmp_path / "llama-2-70b")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [str(tmp_path / "llama-2-70b"), "--gpus", "64",
                                      "--gpu", "h100-80gb", "--seq-len", "4096",
                                      "--batch-size", "512", "--json", str(out)],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "the fastest layouts that fit" in result.output and "train it:" in result.output
    data = json.loads(out.read_text())
    fitting = [r for r in data["ranked"] if r["fits"]]
    assert fitting and fitting[0] is data["ranked"][0]
    # ranked: those with the headroom asked for by throughput, then the tight ones
    roomy = [r for r in fitting if r["headroom"] >= data["min_headroom"]]
    assert roomy and fitting[:len(roomy)] == roomy
    speeds = [r["tokens_per_s"] for r in roomy]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["peak"] <= 80e9 for r in fitting)
    # an independent count, FlopCounterMode's conventions: 6 N FLOPs per token for the
    # matmuls of a step (N without the embedding table, which is a lookup), attention's
    # forward A = 4 x layers x seq x hidden per token and its backward 2.5 A; a checkpointed
    # layer recomputes at most its forward (2 N / layers and A / layers per token), less
    # where non-reentrant checkpointing stops the recompute early
    with tl.init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg)
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    tokens = 512 * 4096
    attention = 4 * 80 * 4096 * 8192 * tokens
    for r in fitting:
        ratio = r["layout"]["ckpt_ratio"]
        # (pipelines with tensor parallelism count 1.8e-5 less than this bound: within 1e-4)
        lowest = (6 * n * tokens + 3.5 * attention) * (1 - 1e-4)
        highest = (6 + 2 * ratio) * n * tokens + (3.5 + ratio) * attention
        assert lowest <= r["flops_per_step"] <= highest, (r["layout"], lowest, highest)


def test_tune_layouts_chooses_by_measurement_not_by_prediction():
    from torchloom.tune import TuneError, tune_layouts

    calls = []

    def measure(layout, knobs):  # a stand-in run: compiled, the plan's second is fastest
        calls.append((layout, knobs))
        return {"tokens_per_s": 100.0 if len(calls) == 4 else 50.0, "peak": 1}

    result = tune_layouts("llama", 2, "h100-80gb", batch_size=4, seq_len=SEQ,
                          ckpt_ratios=(0.0,), micro_batches=(2,), measure_top=2,
                          kernels=({}, {"compile": "aot_eager"}), measure=measure)
    assert [(t.layout, t.kernels) for t in result.measured] == calls
    assert [k for _, k in calls] == [{}, {"compile": "aot_eager"}] * 2
    assert calls[0][0] == calls[1][0] != calls[2][0] == calls[3][0]
    assert result.best is result.measured[3]
    assert result.measured[0].predicted_tokens_per_s >= result.measured[2].predicted_tokens_per_s
    with pytest.raises(TuneError, match=r"(?s)no layout of 2 devices fits 0\.0 MiB per device "
                                        r"by prediction.*fix: a larger budget_bytes"):
        tune_layouts("llama", 2, batch_size=4, seq_len=SEQ, budget_bytes=1000,
                     ckpt_ratios=(0.0,), micro_batches=(2,), measure=measure)
    with pytest.raises(TuneError, match=r"measure_top=0: at least one layout must be measured"):
        tune_layouts("llama", 2, batch_size=4, seq_len=SEQ, measure_top=0, measure=measure)


def test_latencies_cost_per_operator_and_per_collective_call():
    # a profile's fixed costs: every collective call (on the critical path at tp, no dp)
    # adds collective_latency; every dispatched operator adds op_overhead
    import dataclasses

    base = get_profile("a100-80gb")
    lay = Layout(tp=2, micro_batch=2, seq_len=SEQ)
    plain = predict("gpt2", lay, base)
    calls = sum(c.count for c in plain.roles[0].collectives)
    assert calls > 0
    slow_links = predict("gpt2", lay, dataclasses.replace(base, collective_latency=1e-3))
    assert slow_links.step_time - plain.step_time == pytest.approx(calls * 1e-3, rel=1e-6)
    slow_host = predict("gpt2", lay, dataclasses.replace(base, op_overhead=1e-5))
    # hundreds of operators in a step of even a 2-layer model
    assert slow_host.step_time - plain.step_time > 100 * 1e-5
