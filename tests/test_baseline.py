"""A user can rebuild ``torchloom train``'s run in plain PyTorch (issue 25, item 4).

The README states the batch rule and the learning-rate schedule; this test follows them
with nothing of torchloom but the public :func:`torchloom.apps.data.rank_batches` and
:func:`torchloom.runtime.loop.lr_at`, and gets the same losses as ``torchloom train``.
"""

from __future__ import annotations

import re

import torch
from typer.testing import CliRunner

from torchloom.apps import data
from torchloom.apps.cli import app
from torchloom.runtime.loop import lr_at
from torchloom.schedules import zoo

LINE = re.compile(r"^step\s+(\d+)\s+loss (\S+)", re.M)


def test_a_plain_pytorch_loop_reproduces_torchloom_train() -> None:
    steps, batch, accum, seq, seed, lr = 3, 4, 2, 16, 5, 3e-3
    threads = torch.get_num_threads()
    result = CliRunner().invoke(app, [
        "train", "--model", "gpt2", "--steps", str(steps), "--batch-size", str(batch),
        "--grad-accum", str(accum), "--seq-len", str(seq), "--seed", str(seed), "--lr", str(lr),
        "--threads", "1", "--no-progress"])
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    losses = {int(s): float(v) for s, v in LINE.findall(result.output)}

    # the baseline: the README's rules, in plain PyTorch
    model = zoo.make_model("gpt2", "tiny", seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tokens = data.load_corpus()                     # no --data: Python's source, as bytes
    for step in range(1, steps + 1):
        torch.manual_seed(seed * 1_000_003 + step)  # the step's dropout draws
        for group in optimizer.param_groups:        # warm-up 10% of steps, cosine to 0.1 lr
            group["lr"] = lr_at(step - 1, steps, lr, warmup=max(1, steps // 10))
        total = 0.0
        for ids in data.rank_batches(tokens, step, batch_size=batch, seq_len=seq, seed=seed,
                                     grad_accum=accum):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            (loss / accum).backward()
            total += float(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert abs(total / accum - losses[step]) < 1e-6, (step, total / accum, losses[step])
