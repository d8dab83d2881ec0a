"""Full fine-tuning against LoRA: trainable parameters, optimizer bytes and peak memory
per rank at TP 2 and FSDP 2 (issue 29).

Two parts, both side by side in one run:

* **At scale** (no memory used): transformers' default ``LlamaConfig`` (the Llama-2-7B
  shape, nothing changed) on ``meta``, one process playing rank 0 of a 2-rank world
  (PyTorch's fake process-group backend): the model's own schedule at ``tp=2`` (the rank's
  shards), then ``lora(16, 32, ["q_proj", "v_proj"])``; the trainable parameters and
  AdamW's two fp32 states are read off the tensors the rank holds. FSDP 2 holds half of
  every tensor, so its numbers are the whole model's halved.
* **Measured** (2 gloo ranks, CPU): ``torchloom train`` of a small Llama (hidden 256, 4
  layers, default config otherwise) for 3 steps at ``--tp 2`` and ``--dp 2 --dp-mode
  fsdp``, with and without ``--lora r=16,alpha=32,targets=q_proj,v_proj``: each rank's
  peak anonymous memory (``RssAnon`` of /proc/self/status, sampled every 2 ms; mapped
  files do not count), its trainable parameters and its optimizer state bytes.

    python benchmarks/lora_memory.py [--json benchmarks/results/lora_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import transformers as T
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchloom as tl
from torchloom.schedules import ScheduleConfig, apply_schedule

LORA = "r=16,alpha=32,targets=q_proj,v_proj"


def at_scale() -> dict[str, Any]:
    """Rank 0 of tp 2: the whole model's and LoRA's trainable numbers (Llama-2-7B shape)."""
    out: dict[str, Any] = {}
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        for lora in (False, True):
            with torch.device("meta"):
                model = T.LlamaForCausalLM(T.LlamaConfig())
            total = sum(p.numel() for p in model.parameters())
            sch = tl.create_schedule(model)
            apply_schedule(sch, ScheduleConfig(tp=2))
            if lora:
                sch.lora(16, 32, ["q_proj", "v_proj"])
            held = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            full_trainable = total if not lora else sum(
                p.numel() for n, p in model.named_parameters() if ".lora_" in n)
            name = "lora" if lora else "full"
            out[name] = {"tp2_params_held": held, "tp2_trainable": trainable,
                         "tp2_optimizer_bytes": 2 * 4 * trainable,
                         "fsdp2_trainable": full_trainable / 2,
                         "fsdp2_optimizer_bytes": 2 * 4 * full_trainable / 2}
    finally:
        dist.destroy_process_group()
    return out


class _Peak:
    def __init__(self) -> None:
        self.peak = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def read(self) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.read())
            time.sleep(0.002)


def _rank(rank: int, folder: str, layout: dict[str, Any], lora: str | None) -> dict[str, Any]:
    from torchloom.apps.train import TrainConfig, _Run

    torch.set_num_threads(1)
    peak = _Peak()
    peak.thread.start()
    cfg = TrainConfig(model=folder, steps=3, batch_size=4, seq_len=64, lora=lora,
                      progress=False, **layout)
    run = _Run(cfg, rank, 2, None)
    model, module, params, tied, sch = run.build()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for step in range(1, 4):
        optimizer.zero_grad()
        run.step(model, step)
        optimizer.step()
    peak.stop = True
    peak.thread.join()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    state = sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values()
                for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"trainable": sum(local(p).numel() for p in params), "optimizer_bytes": state,
            "peak_rss_anon_mib": peak.peak / 2**20}


def measured() -> dict[str, Any]:
    from torchloom.runtime.launch import raise_first_failure, run_ranks

    folder = os.path.join(tempfile.mkdtemp(), "llama")
    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(hidden_size=256, intermediate_size=688,
                                     num_attention_heads=8, num_key_value_heads=8,
                                     num_hidden_layers=4, vocab_size=32000)).save_pretrained(folder)
    out: dict[str, Any] = {}
    for name, layout in (("tp2", {"tp": 2}), ("fsdp2", {"dp": 2, "dp_mode": "fsdp"})):
        for lora in (None, LORA):
            results = run_ranks(_rank, 2, folder, layout, lora, timeout_s=600)
            raise_first_failure(results, command="lora_memory")
            out[f"{name} {'lora' if lora else 'full'}"] = results
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    scale = at_scale()
    print("Llama-2-7B shape (transformers' default LlamaConfig), rank 0 of 2:")
    print(f"{'':8} {'tp2 trainable':>15} {'tp2 AdamW bytes':>16} {'fsdp2 trainable':>16} "
          f"{'fsdp2 AdamW bytes':>18}")
    for name, row in scale.items():
        print(f"{name:8} {row['tp2_trainable']:>15,} {row['tp2_optimizer_bytes']:>16,} "
              f"{row['fsdp2_trainable']:>16,.0f} {row['fsdp2_optimizer_bytes']:>18,.0f}")
    ratio = scale["lora"]["tp2_optimizer_bytes"] / scale["full"]["tp2_optimizer_bytes"]
    print(f"LoRA's optimizer state / full fine-tuning's (tp2): {100 * ratio:.3f}%")
    runs = measured()
    print("\nMeasured, small Llama (hidden 256, 4 layers, vocab 32000), per rank (rank 0):")
    print(f"{'':12} {'trainable':>10} {'AdamW bytes':>12} {'peak RssAnon MiB':>17}")
    for name, ranks in runs.items():
        row = ranks[0]
        print(f"{name:12} {row['trainable']:>10,} {row['optimizer_bytes']:>12,} "
              f"{row['peak_rss_anon_mib']:>17.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"scale": scale, "measured": runs, "torch": torch.__version__,
                       "transformers": T.__version__, "machine": platform.platform(),
                       "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}, f, indent=2)


if __name__ == "__main__":
    main()
