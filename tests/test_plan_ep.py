"""The planner's model of expert parallelism (``Layout(ep=N)``, ``torchloom plan --ep``):
measured with the ``expert_parallel`` primitive applied, as rank 0 of a fake ``ep`` group,
on fake tensors, the tokens dispatched under the routing model
(:func:`torchloom.runtime.expert_routing_model.modeled_routing`). Single process; tiny
Mixtral and Qwen3-MoE configs (transformers' defaults, sizes changed), saved as folders
as a user would pass them."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

from torchloom.apps.plan_cli import app
from torchloom.core.errors import ExpertParallelError, PlanError
from torchloom.plan import Layout, predict
from torchloom.plan.opcost import flop_counter, grouped_mm_on_fake
from torchloom.plan.search import enumerate_layouts, search
from torchloom.plan.spec import model_spec
from torchloom.plan.units import UnitKey, measure_units
from torchloom.runtime.expert_routing_model import modeled_routing

SEQ = 32
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    T.MixtralConfig(**SIZES, num_local_experts=8, num_experts_per_tok=2).save_pretrained(
        root / "mixtral")
    T.Qwen3MoeConfig(**SIZES, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=48).save_pretrained(root / "qwen3_moe")
    T.LlamaConfig(**SIZES).save_pretrained(root / "llama")
    return root


@pytest.fixture(scope="module")
def spec(folders):
    return model_spec(str(folders / "mixtral"), seq_len=SEQ)


def _meta_model(spec):
    with torch.device("meta"):
        return T.MixtralForCausalLM(spec.config)


def _expert_bytes(spec) -> int:
    """One layer's experts (fp32), from the config: gate_up (E, 2I, H) and down (E, H, I)."""
    c = spec.config
    return c.num_local_experts * 3 * c.intermediate_size * c.hidden_size * 4


def test_units_hold_and_dispatch_a_share_of_the_experts(spec):
    one = measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ))
    two = measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ, ep=2))
    experts = _expert_bytes(spec)
    # the rank keeps half of each layer's experts; nothing else changes
    assert one.params["L2"] - two.params["L2"] == experts // 2
    assert two.extra["expert_params"] == experts // 2 and one.extra["expert_params"] == 0
    # balanced routing: the same FLOPs per rank as one process
    assert two.segments["L2.f"].flops == one.segments["L2.f"].flops
    # per layer: the counts, the rows there and back; their gradients back in backward
    c = spec.config
    rows = SEQ * c.num_experts_per_tok * c.hidden_size * 4
    fwd = [(x.kind, x.group, x.size, x.bytes) for x in two.segments["L2.f"].collectives]
    assert fwd == [("all_to_all", "ep", 2, 8 * c.num_local_experts),
                   ("all_to_all", "ep", 2, rows), ("all_to_all", "ep", 2, rows)]
    bwd = [(x.kind, x.bytes) for x in two.segments["L2.b"].collectives]
    assert bwd == [("all_to_all", rows)] * 2
    assert one.segments["L2.f"].collectives == []


def test_imbalance_loads_the_measured_rank(spec):
    c = spec.config
    even = measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ, ep=2))
    heavy = measure_units(spec, UnitKey(micro_batch=1, seq_len=SEQ, ep=2, imbalance=1.5))
    routed = SEQ * c.num_experts_per_tok
    extra_rows = round(routed * 1.5) - routed
    # the busiest rank's experts compute 3 products of hidden x intermediate per extra row
    expected = 2 * 3 * c.hidden_size * c.intermediate_size * extra_rows
    assert heavy.segments["L2.f"].flops - even.segments["L2.f"].flops == expected
    back = heavy.segments["L2.f"].collectives[2]  # the results it sends back
    assert back.bytes == round(routed * 1.5) * c.hidden_size * 4
    assert heavy.segments["L2.f"].delta > even.segments["L2.f"].delta  # more kept


def test_prediction_memory_and_collectives(spec):
    L = spec.num_layers
    experts = _expert_bytes(spec)
    base = predict(spec, Layout(dp_replicate=4, seq_len=SEQ), "h100-80gb").roles[0]
    for ep in (2, 4):
        p = predict(spec, Layout(dp_replicate=4, ep=ep, seq_len=SEQ), "h100-80gb")
        role = p.roles[0]
        assert base.memory.parameters - role.memory.parameters == L * experts * (ep - 1) // ep
        totals = {(c.kind, c.group): c for c in role.collectives}
        assert totals[("all_to_all", "ep")].count == 5 * L
        # DDP averages the rest; the experts are averaged over the ranks that share them
        # (none at ep 4 = dp 4)
        # (and DDP's int32 map of the parameter tensors the step used, experts not among
        # them: find_unused_parameters)
        used_map = totals[("all_reduce", "dp")].bytes - (role.memory.gradients
                                                         - L * experts // ep)
        assert used_map == 4 * (len(list(_meta_model(spec).parameters())) - 2 * L)
        if ep == 2:
            assert totals[("all_reduce", "ep_replicas")].bytes == L * experts // 2
        else:
            assert ("all_reduce", "ep_replicas") not in totals
        assert any("expert parallelism" in n for n in p.notes)
    fsdp = predict(spec, Layout(dp_shard=4, ep=2, seq_len=SEQ), "h100-80gb")
    # FSDP2 shards the rest over 4 ranks, and the rank's 4 experts over the 2 ranks holding
    # them (as parallelize builds it): a quarter of everything, the experts all-gathered and
    # reduce-scattered over their replicas
    role = fsdp.roles[0]
    assert role.memory.parameters == pytest.approx(base.memory.parameters / 4, rel=0.01)
    kinds = {(c.kind, c.group) for c in role.collectives}
    assert {("all_gather", "ep_replicas"), ("reduce_scatter", "ep_replicas")} <= kinds
    assert ("all_reduce", "ep_replicas") not in kinds
    assert "the experts FSDP2-sharded over the 2 ranks holding the same ones" in fsdp.notes[-1]


def test_another_family(folders):
    spec = model_spec(str(folders / "qwen3_moe"), seq_len=SEQ)
    one = predict(spec, Layout(dp_replicate=2, seq_len=SEQ), "h100-80gb").roles[0]
    two = predict(spec, Layout(dp_replicate=2, ep=2, seq_len=SEQ), "h100-80gb").roles[0]
    c = spec.config
    experts = c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size * 4
    assert one.memory.parameters - two.memory.parameters == c.num_hidden_layers * experts // 2


def test_refusals(folders, spec):
    with pytest.raises(PlanError, match=r"declares no experts") as err:
        predict(str(folders / "llama"), Layout(dp_replicate=2, ep=2, seq_len=SEQ))
    assert "fix: ep=1" in str(err.value)
    with pytest.raises(PlanError) as err:
        predict(spec, Layout(dp_replicate=3, ep=3, seq_len=SEQ))
    assert str(err.value) == (
        "plan(...): 8 experts do not split evenly between 3 expert-parallel ranks\n"
        "    values: num_experts=8, ep=3\n    fix: ep in [1, 2, 4, 8]")
    with pytest.raises(ExpertParallelError, match="imbalance"):
        with modeled_routing(0.5):
            pass
    for bad in (float("inf"), float("nan"), 0.5):
        with pytest.raises(PlanError) as err:
            predict(spec, Layout(dp_replicate=2, ep=2, seq_len=SEQ), imbalance=bad)
        assert str(err.value) == (
            "plan(...): the routing imbalance is the busiest expert-parallel rank's load over "
            f"the average: a finite number of 1 or more\n    values: imbalance={bad}\n"
            "    fix: imbalance=1.0 (balanced routing), or e.g. 1.25")
        with pytest.raises(PlanError, match="routing imbalance"):
            search(spec, 2, batch_size=2, seq_len=SEQ, ep=2, imbalance=bad)
        with pytest.raises(ExpertParallelError, match="imbalance"):
            with modeled_routing(bad):
                pass


def test_search_tries_ep_degrees(spec, folders):
    layouts, _ = enumerate_layouts(spec, 4, batch_size=4, seq_len=SEQ, ep=None, tp=1, pp=1,
                                   micro_batches=(1,), ckpt_ratios=(0.0,))
    eps = {(lay.dp_mode, lay.ep) for lay in layouts}
    assert eps == {("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp", 1), ("fsdp", 2), ("fsdp", 4)}
    dense = model_spec(str(folders / "llama"), seq_len=SEQ)
    layouts, _ = enumerate_layouts(dense, 4, batch_size=4, seq_len=SEQ, ep=None, tp=1, pp=1,
                                   micro_batches=(1,), ckpt_ratios=(0.0,))
    assert {lay.ep for lay in layouts} == {1}
    result = search(spec, 4, "h100-80gb", batch_size=4, seq_len=SEQ, ep=None, tp=1, pp=1,
                    micro_batches=(1,), ckpt_ratios=(0.0,))
    assert {p.layout.ep for p in result.ranked} == {1, 2, 4}
    # fewer experts per rank: less memory (parameters, gradients, optimizer state)
    peak = {(p.layout.dp_mode, p.layout.ep): p.peak for p in result.ranked}
    assert peak[("ddp", 4)] < peak[("ddp", 2)] < peak[("ddp", 1)]


def test_cli_ep(tmp_path, folders):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, [str(folders / "mixtral"), "--gpus", "4", "--ep", "2",
                                      "--tp", "1", "--pp", "1", "--dp-mode", "fsdp",
                                      "--ep-imbalance", "1.25", "--seq-len", str(SEQ),
                                      "--json", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "ep2" in result.output and "--ep 2" in result.output
    assert "the busiest receiving 1.25 x the average" in result.output.replace("\n", " ")
    data = json.loads(out.read_text())
    assert data["layout"]["ep"] == 2 and data["layout"]["dp_shard"] == 4
    groups = {c["group"] for c in data["roles"][0]["collectives"]}
    assert {"ep", "ep_replicas", "dp"} <= groups


def test_grouped_products_are_counted(spec):
    """The grouped product every transformers mixture of experts uses: on fake tensors of
    any dtype (PyTorch's fake kernel takes bf16 only) and in FLOPs (FlopCounterMode has no
    formula): the count on fake tensors equals a real run's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = T.MixtralForCausalLM(spec.config)
    ids = torch.randint(0, 256, (1, SEQ))
    real = flop_counter()
    with real:
        model(input_ids=ids, labels=ids).loss.backward()
    with torch.device("meta"):
        meta = T.MixtralForCausalLM(spec.config)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        meta.to_empty(device="cpu")
        fake_ids = torch.zeros(1, SEQ, dtype=torch.long)
    fake = flop_counter()
    with mode, grouped_mm_on_fake(), fake:
        meta(input_ids=fake_ids, labels=fake_ids).loss.backward()
    grouped = sum(v for k, v in real.get_flop_counts()["Global"].items()
                  if "grouped_mm" in str(k))
    c = spec.config
    # forward 3 products per routed row, backward twice that
    assert grouped == 3 * 2 * 3 * c.hidden_size * c.intermediate_size * SEQ * 2 \
        * c.num_hidden_layers
    assert fake.get_total_flops() == pytest.approx(real.get_total_flops(), rel=0.01)



def test_inside_a_pipeline(spec):
    """Each stage's experts split over the stage's data-parallel ranks: every pipeline
    rank holds half of its layers' experts and dispatches each micro-batch."""
    L, n = spec.num_layers, 4
    experts = _expert_bytes(spec)
    base = predict(spec, Layout(pp=2, dp_replicate=2, n_microbatches=n, seq_len=SEQ))
    ep = predict(spec, Layout(pp=2, dp_replicate=2, ep=2, n_microbatches=n, seq_len=SEQ))
    for plain, split in zip(base.roles, ep.roles):
        assert plain.memory.parameters - split.memory.parameters == L // 2 * experts // 2
        totals = {(c.kind, c.group): c for c in split.collectives}
        assert totals[("all_to_all", "ep")].count == 5 * (L // 2) * n
        assert ("all_reduce", "ep_replicas") not in totals  # dp 2 = ep 2
    layouts, _ = enumerate_layouts(spec, 4, batch_size=4, seq_len=SEQ, ep=None, tp=1, pp=2,
                                   micro_batches=(1,), ckpt_ratios=(0.0,))
    assert {lay.ep for lay in layouts} == {1, 2}


def test_with_context_parallelism(spec):
    """ep 2 inside each context-parallel position: half the experts per rank; the experts'
    gradients all-reduced over the dp x cp / ep = 2 ranks that hold them."""
    L = spec.num_layers
    experts = _expert_bytes(spec)
    base = predict(spec, Layout(dp_replicate=2, cp=2, seq_len=SEQ)).roles[0]
    p = predict(spec, Layout(dp_replicate=2, cp=2, ep=2, seq_len=SEQ))
    role = p.roles[0]
    assert base.memory.parameters - role.memory.parameters == L * experts // 2
    totals = {(c.kind, c.group): c for c in role.collectives}
    assert totals[("all_reduce", "ep_replicas")].bytes == L * experts // 2
    assert {("all_gather", "cp"), ("all_to_all", "ep")} <= set(totals)
    assert "over the 2 ranks holding the same ones" in p.notes[-1]


def test_search_retries_without_sequence_parallelism(spec):
    """Mixtral's schedule refuses sequence parallelism (its router mixes positions): the
    search predicts its tensor-parallel layouts without it instead of dropping them."""
    result = search(spec, 2, "h100-80gb", batch_size=2, seq_len=SEQ, tp=2, pp=1,
                    micro_batches=(1,), ckpt_ratios=(0.0,), dp_mode="ddp")
    assert [p.layout.describe() for p in result.ranked] == [
        "tp2 accum2 dp1(ddp) mb1 ckpt0 fp32/bf16"]
    [(refused, why)] = result.rejected
    assert refused.sp and refused.tp == 2
    assert why.startswith("sequence parallelism runs model.layers.0.mlp.gate "
                          "(MixtralTopKRouter) on a slice of the sequence")
