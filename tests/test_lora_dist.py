"""LoRA fine-tuning under tensor parallelism, FSDP2 and a pipeline equals one process
(issue 29), on two gloo ranks in one launch. ``torchloom train --lora`` at ``--tp 2``,
``--dp 2 --dp-mode fsdp``, ``--dp 2`` (DDP) and ``--pp 2`` of:

* a tiny Llama and a tiny Qwen2 (transformers' default configs, sizes shrunk, read from
  ``save_pretrained`` folders), adapters on q/k/v/o/gate/down (column- and row-parallel);
* chat examples (``.jsonl``, only the responses in the loss; packed under TP and FSDP2),
  with the held-out rows' loss (``--eval-every``) compared too;
* the Llama with its frozen base in bf16 (``--lora-base-dtype bf16``), against one process
  with the same bf16 base.

Each run is compared with the same run in one process (made by the test before the
launch): the loss and the global gradient norm of every step (the norm of the adapters'
gradients: a gradient summed or averaged over the wrong ranks changes it, where Adam's
update would hide a scale) within 1e-5 relative (5e-3 with the bf16 base: tensor
parallelism sums the row-parallel partial outputs in bf16, in another order than one
process's product), and the adapter folder each writes (peft's form) within 1e-3 of its
largest value: Adam divides each gradient by its own magnitude, so the rounding of a
gradient near zero (``B``'s first ones) shows in the values; the losses and norms, which
depend on every adapter, are the tight check (with the bf16 base the only one: its
rounding flips the sign of such gradients, a step of 2 x lr). The adapters' dropout is 0.

In the same launch, ``Verify`` of the Llama schedule at TP 2 (and with sequence
parallelism) followed by ``lora`` passes with every adapter gradient compared, and names
the adapter whose gradient all-reduce was removed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from tests.dist import spawn

ROOT_ENV = "TORCHLOOM_TEST_LORA_ROOT"
SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=256, max_position_embeddings=128)
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
LAYOUTS = {"tp2": dict(tp=2), "fsdp2": dict(dp=2, dp_mode="fsdp"),
           "ddp2": dict(dp=2), "pp2": dict(pp=2, n_microbatches=2)}
TARGETS = "r=4,alpha=8,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,down_proj"


def _runs(root: str) -> dict[str, dict]:
    """name -> TrainConfig options of every compared run (without the layout)."""
    runs = {}
    for family in FAMILIES:
        for layout in LAYOUTS:
            runs[f"{family}-{layout}"] = dict(
                model=os.path.join(root, family), steps=3, batch_size=4, seq_len=32,
                lora=TARGETS, clip_grad=1e9, lr=1e-2, seed=1)
    for layout in LAYOUTS:  # the frozen base in bf16, the adapters in fp32
        runs[f"bf16-{layout}"] = dict(
            model=os.path.join(root, "llama"), steps=3, batch_size=4, seq_len=32,
            lora=TARGETS, lora_base_dtype="bf16", clip_grad=1e9, lr=1e-2, seed=1)
    chat = os.path.join(root, "chat.jsonl")
    for layout in LAYOUTS:
        runs[f"chat-{layout}"] = dict(
            model=os.path.join(root, "llama"), steps=3, batch_size=4, seq_len=48, data=(chat,),
            lora="r=4,alpha=8,targets=q_proj,v_proj", clip_grad=1e9, lr=1e-2,
            pack=layout != "pp2", eval_every=3, eval_fraction=0.25)
    return runs


def _train(name: str, options: dict, out: str, **layout) -> dict:
    from torchloom.apps.train import TrainConfig, train_rank

    records: list[dict] = []
    cfg = TrainConfig(**options, **layout, save_pretrained=out, progress=False)
    result = train_rank(0 if not torch.distributed.is_initialized()
                        else torch.distributed.get_rank(), cfg, report=records.append)
    norms = [r["grad_norm"] for r in records if r["kind"] == "step"]
    evals = [result["eval_losses"][k] for k in sorted(result["eval_losses"])]
    return {"losses": result["losses"], "norms": norms, "evals": evals}


def _compare(rank: int) -> None:
    from safetensors.torch import load_file

    root = os.environ[ROOT_ENV]
    for name, options in _runs(root).items():
        layout = LAYOUTS[name.rsplit("-", 1)[1]]
        got = _train(name, options, os.path.join(root, "out", name), **layout)
        with open(os.path.join(root, "one", name + ".json"), encoding="utf-8") as f:
            want = json.load(f)
        # a bf16 base: tensor parallelism all-reduces the row-parallel partial outputs in
        # bf16, another order of addition than one process's product
        rel = 5e-3 if name.startswith("bf16-") else 1e-5
        for key in ("losses", "norms", "evals"):
            assert got[key] == pytest.approx(want[key], rel=rel), (name, key, got, want)
        if rank == 0 and not name.startswith("bf16-"):
            ours = load_file(os.path.join(root, "out", name, "adapter_model.safetensors"))
            one = load_file(os.path.join(root, "one", name, "adapter_model.safetensors"))
            assert sorted(ours) == sorted(one), name
            for key, value in one.items():
                diff = (ours[key] - value).abs().max().item()
                # Adam divides each gradient by its own magnitude: an element whose gradient
                # is ~0 turns rounding into a visible step (B starts at zero), so the
                # values get 1e-3 of their largest (a wrong shard is off by its size)
                assert diff <= 1e-3 * value.abs().max().item() + 1e-7, \
                    (name, key, diff, value.abs().max().item())


def _verify(rank: int) -> None:
    """Verify compares the adapted layers with one process's (the reference gets the same
    adapters): with B drawn (init="random") every adapter's gradient is non-trivial; a
    column-parallel adapter whose A gradient is left partial is named."""
    import torchloom as tl
    from torchloom.core.errors import VerificationError

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    config = transformers.LlamaConfig(**{**SIZES, "vocab_size": 64})
    for sp, broken in ((False, False), (True, False), (False, True)):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        sch = tl.create_schedule(model)
        check = tl.Verify(sch, {"input_ids": ids, "labels": ids})
        try:
            with check:
                tl.schedules.apply_schedule(sch, tl.schedules.ScheduleConfig(
                    tp=2, sequence_parallel=sp))
                sch.lora(4, 8, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                         init="random")
                if broken:  # the all-reduce of q_proj's A gradient, dropped
                    layer = model.model.layers[1].self_attn.q_proj
                    layer.lora_A["default"].weight._backward_hooks.clear()
        except VerificationError as err:
            assert broken, err
            assert "the gradient of parameter 'model.layers.1.self_attn.q_proj.lora_A." \
                "default.weight' differs" in str(err), err
            continue
        assert not broken, "Verify missed a partial adapter gradient"
        # 2 layers x 5 adapted layers x (A, B)
        assert check.stats["parameter gradient"] == 20, check.stats


def _chat_rows() -> list[str]:
    rows = []
    for i in range(16):
        if i % 2:
            rows.append(json.dumps({"prompt": f"add {i} and {i + 1}:",
                                    "response": f" {2 * i + 1}."}))
        else:
            rows.append(json.dumps({"messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"name {i}"},
                {"role": "assistant", "content": "n" * (i % 5 + 1)}]}))
    return rows


@pytest.mark.slow
def test_lora_at_every_layout_equals_one_process(tmp_path) -> None:
    root = str(tmp_path)
    for family, (config_cls, model_cls) in FAMILIES.items():
        torch.manual_seed(0)
        model_cls(config_cls(**SIZES)).save_pretrained(os.path.join(root, family))
    with open(os.path.join(root, "chat.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(_chat_rows()) + "\n")
    os.makedirs(os.path.join(root, "one"))
    for name, options in _runs(root).items():
        result = _train(name, options, os.path.join(root, "one", name))
        with open(os.path.join(root, "one", name + ".json"), "w", encoding="utf-8") as f:
            json.dump(result, f)
    os.environ[ROOT_ENV] = root
    try:
        spawn(_verify, _compare, world=2, timeout_s=600)
    finally:
        del os.environ[ROOT_ENV]
