"""The planner against a real device: train a 1B-class Llama for a few steps on one GPU at
two layouts (micro-batch and checkpointing) and print predicted vs measured peak reserved
memory and tokens/s (``benchmarks/gpu_check.sh`` runs it when a GPU is lent).

The model is a default ``transformers.LlamaConfig`` with 1B-class widths (hidden 2048,
MLP 8192, 16 layers, 32 heads, 8 KV heads, vocabulary 128,256), random weights, bf16
autocast over fp32 weights, AdamW, built by :func:`torchloom.parallelize` exactly as
``torchloom train`` builds it. Measured: ``torch.cuda.max_memory_reserved()`` and
``max_memory_allocated()`` over the timed steps (after one warm-up step) and the median
step time. Predicted: ``torchloom.plan.predict`` with the device's profile (``h100-80gb``,
``h100-96gb`` or ``h200`` by the device's name and memory; else one measured on the device).

Usage::

    python benchmarks/plan_vs_gpu.py [--steps 4] [--seq-len 2048]
    python benchmarks/plan_vs_gpu.py --dry-run     # the plumbing on a CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import transformers

from torchloom.parallel.layout import Layout
from torchloom.parallel.parallelize import create_schedule, parallelize
from torchloom.plan import predict
from torchloom.plan.profiles import PROFILES, Profile, measure_local
from torchloom.plan.spec import model_spec

GIB = 2**30


def device_profile(dry_run: bool) -> Profile:
    """The built-in profile of this GPU, or one measured here."""
    if dry_run or not torch.cuda.is_available():
        return measure_local("cpu", size=256, link=False, repeats=1)
    name = torch.cuda.get_device_name(0).lower()
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    if "h200" in name:
        return PROFILES["h200"]
    if "h100" in name:
        return PROFILES["h100-96gb" if total > 85 else "h100-80gb"]
    return measure_local("cuda")


def config(dry_run: bool) -> transformers.LlamaConfig:
    if dry_run:
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=512)
    return transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, tie_word_embeddings=False)


def measure(cfg: transformers.LlamaConfig, layout: Layout, device: str,
            steps: int) -> dict[str, float]:
    """Train ``steps`` + 1 steps; the first is a warm-up."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    done = parallelize(create_schedule(model, None), layout, device=device)
    opt = torch.optim.AdamW(done.model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (layout.micro_batch, layout.seq_len),
                        device=device)
    times = []
    for i in range(steps + 1):
        if i == 1 and device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with done.autocast(device):
            loss = done.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    out = {"tokens_per_s": layout.tokens / step, "step_s": step}
    if device == "cuda":
        out["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    del done, model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    cfg = config(dry)
    seq = 32 if dry else args.seq_len
    mixed = None if dry else "bf16"
    layouts = [Layout(micro_batch=2, seq_len=seq, ac="full", mixed_precision=mixed),
               Layout(micro_batch=4, seq_len=seq, ac="op", mixed_precision=mixed)]
    profile = device_profile(dry)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        cfg.save_pretrained(root)
        spec = model_spec(root, seq_len=seq)
        for lay in layouts:
            p = predict(spec, lay, profile)
            m = measure(cfg, lay, device, 1 if dry else args.steps)
            rows.append({"layout": lay.describe(), "pred_gib": p.peak / GIB,
                         "pred_alloc_gib": p.peak_allocated / GIB,
                         "pred_tps": p.tokens_per_s, **m})
    name = torch.cuda.get_device_name(0) if not dry else "CPU (dry run)"
    print(f"{time.strftime('%Y-%m-%d')}, {name}, profile {profile.name}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}; "
          f"`python benchmarks/plan_vs_gpu.py --steps {1 if dry else args.steps} --seq-len {seq}`"
          + (" --dry-run" if dry else ""))
    print("| layout | predicted reserved GiB | measured reserved GiB | predicted allocated "
          "| measured allocated | predicted tok/s | measured tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        res = f"{r['reserved_gib']:.1f}" if "reserved_gib" in r else "-"
        alloc = f"{r['allocated_gib']:.1f}" if "allocated_gib" in r else "-"
        print(f"| {r['layout']} | {r['pred_gib']:.1f} | {res} | {r['pred_alloc_gib']:.1f} | "
              f"{alloc} | {r['pred_tps']:,.0f} | {r['tokens_per_s']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
