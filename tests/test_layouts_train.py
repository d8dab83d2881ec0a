"""``torchloom train`` in every composition of FSDP2 / HSDP x TP x PP: each equals one
process, saves, resumes into another layout and exports (the README's "Layouts" table).

The model is a transformers Llama of the default config with its sizes shrunk (4 layers,
so that two pipeline ranks hold two virtual stages each; its embedding tied to the output
layer, which the pipelines hold on another stage), written with ``save_pretrained``; the
data are text files read as bytes. One process trains it 4 steps (batch 8 of 32 tokens, 2
accumulated micro-steps), evaluates the held-out loss at steps 2 and 4, and exports it:
the reference. Then:

* dp_shard 2 x tp 2 x pp 2 (8 ranks, the one 8-rank launch) trains the same 4 steps with
  gradient accumulation and op-level selective checkpointing, saving at steps 2 and 4; its step-2 checkpoint resumes at
  dp 2 x tp 2 (4 ranks) and at one rank, the losses continuing equal;
* HSDP 2 x 2 (2 replicas of 2 FSDP2 shards), launched by torchloom on one "node" of four
  and by ``torchrun --nnodes 2 --rdzv-backend c10d`` as two "nodes" of two ranks on
  localhost: the losses of the two equal each other and one process;
* Interleaved1F1B with two virtual stages per rank (2 ranks, 4 stages), half of the layers
  checkpointed, saving at step 2, resumed by 1F1B pipelines under DDP (pp 2 x dp 2);
* bf16 under a pipeline (autocast), and under FSDP 2 x PP 2 (FSDP2's mixed-precision
  policy in each stage), against one process under bf16 autocast.

Every run exports with ``--save-pretrained``: transformers loads each folder, and its
tensors equal the reference's export. Tolerances: fp32 runs within 1e-5 relative on the
loss (reduction order differs across ranks) and 3e-5 absolute on the exported weights
(:data:`FP32_WEIGHTS`);
bf16 runs within 2e-2 relative on the loss (bf16 has 8 bits of mantissa, and the
collectives add in another order), and 99% of the exported weights within 1e-3 (the rest
within :data:`BF16_WEIGHTS`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow

STEPS = ["--steps", "4", "--batch-size", "8", "--seq-len", "32", "--grad-accum", "2",
         "--threads", "1", "--no-progress", "--clip-grad", "1e9", "--lr", "3e-3",
         "--eval-every", "2", "--eval-batches", "2"]
FP32 = 1e-5
FP32_WEIGHTS = 3e-5
"""AdamW divides by the root of the squared gradients' average: where a gradient is near
zero, its last-bit differences (another reduction order) move the weight by up to about
1e-2 of the learning rate (3e-3) over the 4 steps."""
BF16 = 2e-2
BF16_WEIGHTS = 2 * (3e-3 + 3e-3 + 2.325e-3 + 0.975e-3)
"""AdamW moves a weight by about the learning rate a step whatever the gradient's size, so
where bf16 rounding flips the sign of a tiny gradient the two runs' weights part by up to
twice the learning rates summed over the 4 steps."""


def _llama(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32,
                                      intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _corpus(words: int = 8000) -> str:
    """Fixed text, drawn from a seeded generator (not read from a file whose edits would
    change every run's numbers): words of 1 to 9 lowercase letters, a line every 12."""
    import random

    rng = random.Random(0)
    out = []
    for i in range(words):
        out.append("".join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(1, 9))))
        out.append("\n" if i % 12 == 11 else " ")
    return "".join(out)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    _llama(root / "model")
    (root / "corpus").mkdir()
    body = _corpus()
    (root / "corpus" / "a.txt").write_text(body, encoding="utf-8")
    return root


def _args(work: Path) -> list[str]:
    return ["--model", str(work / "model"), "--data", str(work / "corpus"), *STEPS]


def _records(metrics: Path) -> dict[int, dict]:
    """The step records by step, each with its step's held-out loss if evaluated."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["kind"] == "step"}
    for r in records:
        if r["kind"] == "eval":
            steps[r["step"]]["eval_loss"] = r["eval_loss"]
    return steps


def _train(work: Path, name: str, *args: str, launcher: list[str] | None = None
           ) -> dict[int, dict]:
    """Run ``torchloom train`` in new processes; its step records by step."""
    metrics = work / f"{name}.jsonl"
    command = [*(launcher or [sys.executable, "-m"]), "torchloom", "train", *_args(work),
               *args, "--metrics", str(metrics)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return _records(metrics)


def _close(got: dict[int, dict], expected: dict[int, dict], tol: float) -> None:
    """The losses, the gradient norms (over every shard, stage and replica counted once)
    and the held-out losses, within ``tol`` relative."""
    assert got and set(got) <= set(expected), (sorted(got), sorted(expected))
    for step, record in got.items():
        assert ("eval_loss" in record) == ("eval_loss" in expected[step]), step
        for key in ("loss", "grad_norm", "eval_loss"):
            if key not in record:
                continue
            want = expected[step][key]
            assert abs(record[key] - want) <= tol * abs(want), (step, key, record[key], want)


def _exported_equal(folder: Path, reference: Path, atol: float, share: float = 0.0) -> None:
    """transformers loads ``folder`` into the unmodified class, and its tensors equal the
    reference export's within ``atol``; with ``share``, all but that share of the entries
    (the rest within the bf16 bound, see :data:`BF16_WEIGHTS`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    expected = transformers.AutoModelForCausalLM.from_pretrained(reference).state_dict()
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    outside = total = 0
    for key, tensor in state.items():
        if not share:
            torch.testing.assert_close(tensor, expected[key], atol=atol, rtol=0, msg=key)
            continue
        diff = (tensor - expected[key]).abs()
        assert float(diff.max()) <= BF16_WEIGHTS, (key, float(diff.max()))
        outside, total = outside + int((diff > atol).sum()), total + diff.numel()
    assert outside <= share * total, (outside, total)


@pytest.fixture(scope="module")
def single(work: Path) -> dict[int, dict]:
    return _train(work, "single", "--save-pretrained", str(work / "single-hf"))


def _step2(work: Path, source: Path, name: str) -> Path:
    """A save directory holding only ``source``'s step-2 checkpoint."""
    target = work / name
    shutil.copytree(source / "step-2", target / "step-2")
    return target


def test_dp_shard_tp_pp_trains_equal_saves_and_resumes_at_dp_tp_and_one_rank(work, single):
    save = work / "3d"
    three = _train(work, "3d", "--dp", "2", "--dp-mode", "fsdp", "--tp", "2", "--pp", "2",
                   "--n-microbatches", "2", "--ac", "op", "--save-every", "2",
                   "--save-dir", str(save),
                   "--save-pretrained", str(work / "3d-hf"))
    assert sorted(three) == [1, 2, 3, 4]
    _close(three, single, FP32)
    _exported_equal(work / "3d-hf", work / "single-hf", FP32_WEIGHTS)
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-4"]  # one checkpoint of the whole model per saved step

    # resumed at dp 2 x tp 2 (DDP): the FSDP2 x TP x PP checkpoint resharded on load
    dp_tp = _train(work, "dp-tp", "--dp", "2", "--tp", "2", "--save-dir",
                   str(_step2(work, save, "dp-tp")), "--resume",
                   "--save-pretrained", str(work / "dp-tp-hf"))
    assert sorted(dp_tp) == [3, 4]
    _close(dp_tp, single, FP32)
    _exported_equal(work / "dp-tp-hf", work / "single-hf", FP32_WEIGHTS)

    # resumed at one rank
    one = _train(work, "one", "--save-dir", str(_step2(work, save, "one")), "--resume",
                 "--save-pretrained", str(work / "one-hf"))
    assert sorted(one) == [3, 4]
    _close(one, single, FP32)
    _exported_equal(work / "one-hf", work / "single-hf", FP32_WEIGHTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_hsdp_on_one_node_of_four_and_on_two_nodes_of_two_equal_one_process(work, single):
    hsdp = ["--dp", "4", "--dp-mode", "hsdp", "--dp-replicate", "2"]
    node = _train(work, "hsdp", *hsdp, "--save-pretrained", str(work / "hsdp-hf"))
    assert sorted(node) == [1, 2, 3, 4]
    _close(node, single, FP32)
    _exported_equal(work / "hsdp-hf", work / "single-hf", FP32_WEIGHTS)

    # two "nodes" of two ranks on localhost, started as on two machines (README: Multi-node)
    port = _free_port()
    metrics = work / "two-nodes.jsonl"
    command = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes",
               "-m", "torchloom", "train", *_args(work), *hsdp,
               "--save-pretrained", str(work / "two-nodes-hf"), "--metrics", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outputs)
    two = _records(metrics)
    assert sorted(two) == [1, 2, 3, 4]
    assert [two[s]["loss"] for s in two] == [node[s]["loss"] for s in two]  # bit for bit
    _exported_equal(work / "two-nodes-hf", work / "hsdp-hf", 0.0)


def test_interleaved_1f1b_with_two_virtual_stages_per_rank(work, single):
    save = work / "interleaved"
    pipe = _train(work, "interleaved", "--pp", "2", "--pipeline-schedule", "Interleaved1F1B",
                  "--stages-per-rank", "2", "--n-microbatches", "2", "--ckpt-ratio", "0.5",
                  "--save-every", "2", "--save-dir", str(save),
                  "--save-pretrained", str(work / "interleaved-hf"))
    assert sorted(pipe) == [1, 2, 3, 4]
    _close(pipe, single, FP32)
    _exported_equal(work / "interleaved-hf", work / "single-hf", FP32_WEIGHTS)
    # resumed into 1F1B with one stage a rank and data parallelism: the checkpoint of four
    # virtual stages loads into two
    ddp = _train(work, "pp-ddp", "--pp", "2", "--n-microbatches", "2", "--grad-accum", "1",
                 "--dp", "2", "--save-dir", str(_step2(work, save, "pp-ddp")), "--resume")
    assert sorted(ddp) == [3, 4]
    _close(ddp, single, FP32)


def test_bf16_under_a_pipeline_equals_one_process_under_the_same_policy(work):
    one = _train(work, "bf16", "--dtype", "bf16", "--save-pretrained", str(work / "bf16-hf"))
    pipe = _train(work, "bf16-pp", "--dtype", "bf16", "--pp", "2", "--n-microbatches", "2",
                  "--save-pretrained", str(work / "bf16-pp-hf"))
    assert sorted(pipe) == sorted(one) == [1, 2, 3, 4]
    _close(pipe, one, BF16)
    # all but 1% of the entries within 1e-3, the rest within BF16_WEIGHTS
    _exported_equal(work / "bf16-pp-hf", work / "bf16-hf", 1e-3, share=0.01)
    # FSDP2 stages: its MixedPrecisionPolicy (bf16 compute, fp32 reduction); the stages
    # send bf16 (split_stages(send_dtype=bf16)), the last hands bf16 logits to the loss
    fsdp = _train(work, "bf16-fsdp-pp", "--dtype", "bf16", "--pp", "2", "--n-microbatches",
                  "2", "--dp", "2", "--dp-mode", "fsdp",
                  "--save-pretrained", str(work / "bf16-fsdp-pp-hf"))
    assert sorted(fsdp) == [1, 2, 3, 4]
    _close(fsdp, one, BF16)
    _exported_equal(work / "bf16-fsdp-pp-hf", work / "bf16-hf", 1e-3, share=0.01)
