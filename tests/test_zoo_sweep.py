"""The model-zoo sweep (benchmarks/zoo_sweep.py): discovery of the families with a
tensor-parallel plan, the tiny-config shrinker, and one 2-rank launch on a few families
in which one rank of one family dies (the launcher records it, starts two new ranks and
goes on with the next family)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def zoo_sweep():
    # The spawned ranks import zoo_sweep by name: they inherit sys.path at spawn time.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import zoo_sweep

        yield zoo_sweep
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_discover_lists_families_with_a_plan(zoo_sweep):
    families, skipped = zoo_sweep.discover()
    by_name = {f.name: f for f in families}
    assert len(by_name) == len(families) > 100
    assert by_name["llama"].model_class == "LlamaForCausalLM"
    assert by_name["mixtral"].plan_in == "config"
    # a multimodal / encoder-decoder family whose sub-config carries the plan
    assert by_name["qwen2_vl"].plan_in == "text_config"
    assert by_name["t5gemma"].model_class == "T5GemmaForConditionalGeneration"
    # families without a plan are not listed (GPT-2 has none in transformers 5)
    assert "gpt2" not in by_name and "bert" not in by_name
    names = {s["family"] for s in skipped}
    assert not names & set(by_name)


def test_tiny_config_shrinks_only_sizes(zoo_sweep):
    families = {f.name: f for f in zoo_sweep.discover()[0]}
    default = transformers.Qwen2MoeConfig()
    tiny = zoo_sweep.tiny_config(families["qwen2_moe"])
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads) == (64, 2, 4)
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.vocab_size) == (4, 2, 256)
    assert tiny.num_key_value_heads == tiny.num_attention_heads  # as the default (16 / 16)
    mixtral = zoo_sweep.tiny_config(families["mixtral"])
    assert (mixtral.num_attention_heads, mixtral.num_key_value_heads) == (4, 2)  # GQA stays
    for field in ("hidden_act", "rms_norm_eps", "use_cache", "tie_word_embeddings",
                  "norm_topk_prob", "attention_dropout"):
        assert getattr(tiny, field) == getattr(default, field), field
    # a multimodal config: the text sub-config shrunk, the image token moved into the
    # shrunk vocabulary
    vl = zoo_sweep.tiny_config(families["qwen2_vl"])
    assert vl.text_config.hidden_size == vl.vision_config.hidden_size == 64
    assert vl.image_token_id < vl.text_config.vocab_size == 256
    # a hybrid keeps one layer of each kind
    nxt = zoo_sweep.tiny_config(families["qwen3_next"])
    assert set(nxt.layer_types) == set(transformers.Qwen3NextConfig().layer_types)


def test_pick_layers_keeps_every_kind(zoo_sweep):
    kinds = ["linear"] * 3 + ["full"] + ["linear"] * 3 + ["full"]
    assert zoo_sweep._pick_layers([kinds], 8) == [0, 3]
    assert zoo_sweep._pick_layers([["a"] * 8], 8) == [0, 1]
    assert zoo_sweep._scaled_sections([16, 24, 24], 8) == [2, 3, 3]


@pytest.mark.slow
def test_ci_subset_two_ranks_survives_a_dead_rank(zoo_sweep, tmp_path, monkeypatch, capsys):
    # The CI subset (dense with GQA, biases, tied embeddings, mixtures of experts, an
    # encoder, an encoder-decoder, multimodal) must pass Verify at TP=2 and train. In the
    # same run rank 1 dies at the start of olmo: it is recorded as failed and two new
    # ranks run the rest; gemma4_vision's tiny model needs inputs the sweep does not
    # make, so it is counted as not building.
    ci = list(zoo_sweep.CI_FAMILIES)
    families = ci[:6] + ["olmo"] + ci[6:] + ["gemma4_vision"]
    monkeypatch.setenv(zoo_sweep.FAULT_ENV, "olmo:1:die")
    out = tmp_path / "sweep.json"
    result = zoo_sweep.main(["--families", ",".join(families), "--timeout", "60",
                             "--json", str(out)])
    assert json.loads(out.read_text())["counts"] == result["counts"]
    rows = {r["family"]: r for r in result["rows"]}
    assert [r["family"] for r in result["rows"]] == families
    for name in ci:
        row = rows[name]
        assert row["status"] == "passed", row
        assert row["verified"]["parameter gradient"] > 0
        assert row["local_share"] < 0.9  # each rank keeps part of the weights
        assert len(row["losses"]) == 3
    assert rows["llama"]["sp"] is True
    assert rows["mixtral"]["sp"] is False and "sequence" in rows["mixtral"]["sp_refused"]
    assert rows["olmo"]["status"] == "failed" and "died" in rows["olmo"]["error"]
    assert rows["gemma4_vision"]["stage"] == "reference"
    assert result["launches"] == 2
    c = result["counts"]
    assert (c["families"], c["not_building"], c["passed"], c["failed"]) == (
        len(families), 1, len(ci), 1)
    printed = capsys.readouterr().out
    assert "| llama | LlamaForCausalLM | config | passed | yes | 0." in printed
    assert f"{len(ci)} of {len(ci) + 1} families that build from a tiny config pass" in printed


@pytest.mark.slow
def test_tp_vs_transformers_tiny(zoo_sweep, capsys):
    # benchmarks/tp_vs_transformers.py at tiny sizes on Llama: transformers' own
    # tp_plan="auto" and torchloom load the same save_pretrained folder; both losses
    # equal one process; torchloom's hand-written Llama schedule issues Megatron's
    # collectives (2 all-reduces per layer forward, 2 backward), transformers' plan more
    # (it also splits the vocabulary and reduces q, k and v's input gradients apart).
    pytest.importorskip("accelerate")
    import tp_vs_transformers as bench

    layers = 2
    result = bench.main(["--families", "llama", "--hidden", "64", "--layers", str(layers),
                         "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
                         "--vocab", "256", "--seq", "16", "--batch", "2", "--steps", "2",
                         "--warmup", "0"])
    assert result["losses_match"]
    (family,) = result["families"]
    hf, tl_run = family["runs"]["transformers"], family["runs"]["torchloom"]
    for run in (hf, tl_run):
        assert len(run["losses"]) == 3 and run["max_loss_diff"] <= 1e-5
        assert run["step_ms"] > 0 and len(run["times_ms"]) == 2
    assert tl_run["loaded"] == "meta + build(weights=folder)"
    col = tl_run["collectives"]
    assert col["forward"] == {"all_reduce": 2 * layers}
    assert col["backward"] == {"all_reduce": 2 * layers}
    assert col["optimizer_total"] == 0
    # torchloom's own counter sees the same calls as CommDebugMode
    assert col["torchloom_counter"] == {"forward": {"all_reduce": 2 * layers},
                                           "backward": {"all_reduce": 2 * layers}}
    assert hf["collectives"]["forward_total"] >= 2 * layers
    assert hf["collectives"]["backward_total"] >= 2 * layers
    printed = capsys.readouterr().out
    assert "| llama | torchloom | schedule_llama |" in printed
    assert "transformers " + result["machine"]["transformers"] in printed
