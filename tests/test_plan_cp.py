"""The planner's model of context parallelism (``Layout(cp=N)``): measured with the
``context_parallel`` primitive applied, as rank 0 of a fake ``cp`` group, on fake tensors
(single process, a tiny Llama)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from torchloom.apps.plan_cli import app
from torchloom.plan import Layout, predict
from torchloom.plan.predict import causal_share
from torchloom.plan.spec import model_spec
from torchloom.plan.units import UnitKey, measure_units

SEQ = 64


@pytest.fixture(scope="module")
def spec():
    return model_spec("llama")


@pytest.fixture(scope="module")
def units(spec):
    return {cp: measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ, cp=cp))
            for cp in (1, 2)}


def _kv_bytes(spec, seq: int) -> int:
    """One of K or V of the whole sequence (fp32, one sequence)."""
    c = spec.config
    head_dim = c.hidden_size // c.num_attention_heads
    return seq * c.num_key_value_heads * head_dim * 4


def test_cp2_halves_layer_activations(spec, units):
    # a checkpointed layer keeps its input only: exactly the local tokens, half
    one, two = units[1].segments, units[2].segments
    assert two["L1.f"].delta * 2 == one["L1.f"].delta
    # a plain layer: half of everything per token, plus what attention keeps of the
    # gathered keys and values of the whole sequence (SDPA saves its inputs): at most
    # K + V of the whole sequence above half (tiny model: K/V are 1/4 of the hidden size)
    half = one["L2.f"].delta / 2
    extra = two["L2.f"].delta - half
    assert 0 < extra <= 2 * _kv_bytes(spec, SEQ)
    # and the forward's FLOPs: linear products halve, attention falls to (2cp+1)/(4cp^2)
    assert two["L2.f"].flops < 0.5 * one["L2.f"].flops


def test_collectives_per_layer(spec, units):
    seg = units[2].segments
    kv = _kv_bytes(spec, SEQ)
    fwd = [(c.kind, c.group, c.size, c.bytes) for c in seg["L2.f"].collectives]
    bwd = [(c.kind, c.group, c.size, c.bytes) for c in seg["L2.b"].collectives]
    assert fwd == [("all_gather", "cp", 2, kv)] * 2  # K and V, gathered bytes
    assert bwd == [("reduce_scatter", "cp", 2, kv)] * 2  # their gradients
    # a checkpointed layer gathers again in its recomputation
    kinds = sorted(c.kind for c in seg["L1.b"].collectives)
    assert kinds == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert units[1].segments["L2.f"].collectives == []


def test_prediction_counts_and_times_cp(spec):
    p = predict(spec, Layout(cp=2, seq_len=SEQ), "h100-80gb")
    role = p.roles[0]
    totals = {(c.kind, c.group): c for c in role.collectives}
    layers = spec.num_layers
    assert totals[("all_gather", "cp")].count == 2 * layers
    assert totals[("reduce_scatter", "cp")].count == 2 * layers
    assert totals[("all_gather", "cp")].bytes == 2 * layers * _kv_bytes(spec, SEQ)
    assert ("all_reduce", "cp") in totals  # the loss
    # DDP averages the gradients over dp x cp = 2 ranks (and all-reduces its map of the
    # parameters the step used: find_unused_parameters)
    assert totals[("all_reduce", "dp")].count == 2
    assert role.ranks == 2 and p.layout.world == 2
    # each sequence is counted once: tokens per step are the layout's
    assert p.tokens_per_s == pytest.approx(SEQ / p.step_time)
    assert causal_share(1) == 0.5 and causal_share(2) == pytest.approx(4 / 5)


def test_fsdp_shards_over_dp_shard_times_cp(spec):
    base = predict(spec, Layout(seq_len=SEQ), "h100-80gb").roles[0].memory
    cp = predict(spec, Layout(dp_shard=2, cp=2, seq_len=SEQ), "h100-80gb").roles[0].memory
    four = predict(spec, Layout(dp_shard=4, seq_len=SEQ), "h100-80gb").roles[0].memory
    assert cp.optimizer == four.optimizer
    assert cp.parameters == four.parameters
    # FSDP2 pads each shard to a multiple of the group: within 1% of a quarter
    assert cp.optimizer == pytest.approx(base.optimizer / 4, rel=0.01)


def test_fsdp_over_the_cp_ranks_alone(spec):
    """shard_cp (torchtitan's FSDP2 over dp_shard x cp with dp_shard 1): the weights and
    the optimizer state halve against DDP over the cp ranks; FSDP2's all-gathers and
    reduce-scatters replace DDP's all-reduce, beside the K / V exchange over cp."""
    ddp = predict(spec, Layout(cp=2, seq_len=SEQ), "h100-80gb").roles[0]
    fsdp = predict(spec, Layout(cp=2, shard_cp=True, seq_len=SEQ), "h100-80gb").roles[0]
    two = predict(spec, Layout(dp_shard=2, seq_len=SEQ), "h100-80gb").roles[0]
    assert fsdp.memory.optimizer == two.memory.optimizer
    assert fsdp.memory.optimizer == pytest.approx(ddp.memory.optimizer / 2, rel=0.01)
    kinds = {(c.kind, c.group) for c in fsdp.collectives}
    assert {("all_gather", "cp"), ("reduce_scatter", "cp"), ("all_gather", "dp"),
            ("reduce_scatter", "dp")} <= kinds
    assert ("all_reduce", "dp") not in kinds
    assert ("all_reduce", "dp") in {(c.kind, c.group) for c in ddp.collectives}


def _plan_cp2_fsdp(tmp_path, gpus: int) -> tuple[str, dict]:
    """``torchloom plan llama --cp 2 --dp-mode fsdp`` on ``gpus`` (tp 1, pp 1): its output
    and its ``--json``."""
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["llama", "--gpus", str(gpus), "--cp", "2", "--tp", "1",
                                      "--pp", "1", "--dp-mode", "fsdp", "--seq-len", str(SEQ),
                                      "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output, json.loads(out.read_text())


def test_cli_fsdp_over_cp(tmp_path):
    output, data = _plan_cp2_fsdp(tmp_path, 2)
    assert "dp1(fsdp over cp)" in output
    assert "--cp 2 --dp-mode fsdp" in output  # the torchloom train command
    assert data["layout"]["shard_cp"] is True and data["layout"]["dp_shard"] == 1


def test_pipeline_with_cp(spec):
    """Each stage's sequences split over its cp ranks: every stage gathers K / V over cp,
    the stages exchange seq_len / cp positions, the last sums the loss over cp."""
    base = predict(spec, Layout(pp=2, n_microbatches=2, seq_len=SEQ), "h100-80gb")
    p = predict(spec, Layout(pp=2, cp=2, n_microbatches=2, seq_len=SEQ), "h100-80gb")
    for plain, role in zip(base.roles, p.roles):
        kinds = {(c.kind, c.group): c for c in role.collectives}
        assert kinds[("all_gather", "cp")].count == 2 * 2 * role.layers  # K, V, 2 micro
        plain_send = {(c.kind, c.group): c for c in plain.collectives}[("send", "pp")]
        assert kinds[("send", "pp")].bytes * 2 == plain_send.bytes  # half the positions
        assert role.memory.activations < plain.memory.activations
    assert ("all_reduce", "cp") in {(c.kind, c.group) for c in p.roles[-1].collectives}


def test_cli_cp(tmp_path):
    output, data = _plan_cp2_fsdp(tmp_path, 4)
    assert "cp2" in output and "--cp 2" in output
    assert data["layout"]["cp"] == 2 and data["layout"]["dp_shard"] == 2
    assert data["peak_gib"] > 0 and data["tokens_per_s_per_gpu"] > 0
    groups = {c["group"] for c in data["roles"][0]["collectives"]}
    assert {"cp", "dp"} <= groups


def test_search_tries_valid_cp_degrees(spec):
    from torchloom.plan.search import enumerate_layouts

    layouts, _ = enumerate_layouts(spec, 8, batch_size=8, seq_len=20, cp=None, pp=1,
                                   micro_batches=(1,), ckpt_ratios=(0.0,))
    cps = {lay.cp for lay in layouts}
    assert cps == {1, 2}  # 20 tokens split into 2 x cp chunks for cp 1, 2 only (not 4, 8)
    assert all(lay.world == 8 for lay in layouts)
    # one data-parallel rank beside cp: DDP over the cp ranks, and FSDP2 over them
    layouts, _ = enumerate_layouts(spec, 4, batch_size=4, seq_len=32, cp=2, tp=2, pp=1,
                                   micro_batches=(1,), ckpt_ratios=(0.0,))
    assert {(lay.dp, lay.dp_mode, lay.shard_cp) for lay in layouts} == {
        (1, "ddp", False), (1, "fsdp", True)}
