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

The planner's prediction of the optimizer state (``torchloom.plan.predict(...,
lora=...)``, AdamW: two fp32 states plus a 4-byte step per tensor) is printed beside the
counted one; its peak memory against measured steps is tests/test_plan_lora.py.

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


def _trainable(tp: int, lora: bool) -> tuple[int, int]:
    """(parameters held, trainable parameters) of rank 0 of ``tp`` tensor-parallel ranks."""
    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig())
    sch = tl.create_schedule(model)
    if tp > 1:
        # as torchloom.parallelize builds it: the head split along the vocabulary (its
        # default loss, "chunked", over split logits)
        apply_schedule(sch, ScheduleConfig(tp=tp, loss_parallel=True))
    if lora:
        sch.lora(16, 32, ["q_proj", "v_proj"])
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for p in model.parameters() if p.requires_grad))


def at_scale() -> dict[str, Any]:
    """Rank 0 of 2: the trainable numbers of full fine-tuning and LoRA at tp 2 (the rank's
    shards) and FSDP 2 (half of every tensor), Llama-2-7B shape; with the planner's
    prediction of the optimizer state (AdamW: two fp32 states and a step per tensor)."""
    from torchloom.parallel.lora import parse_lora
    from torchloom.plan import Layout, predict

    out: dict[str, Any] = {}
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        for lora in (False, True):
            held, trainable = _trainable(2, lora)
            _, whole = _trainable(1, lora)
            out["lora" if lora else "full"] = {
                "tp2_params_held": held, "tp2_trainable": trainable,
                "tp2_optimizer_bytes": 2 * 4 * trainable,
                "fsdp2_trainable": whole / 2, "fsdp2_optimizer_bytes": 2 * 4 * whole / 2}
    finally:
        dist.destroy_process_group()
    config = os.path.join(tempfile.mkdtemp(), "config.json")
    T.LlamaConfig().to_json_file(config)
    spec = parse_lora(LORA)
    for name, layout in (("tp2", Layout(tp=2, micro_batch=1, seq_len=512)),
                         ("fsdp2", Layout(dp_shard=2, micro_batch=1, seq_len=512))):
        for kind, lora in (("full", None), ("lora", spec)):
            pred = predict(config, layout, "h100-80gb", lora=lora)
            out[kind][f"{name}_planned_optimizer_bytes"] = pred.roles[0].memory.optimizer
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
    print(f"{'':8} {'tp2 trainable':>15} {'tp2 AdamW bytes':>16} {'planned':>16} "
          f"{'fsdp2 trainable':>16} {'fsdp2 AdamW bytes':>18} {'planned':>16}")
    for name, row in scale.items():
        print(f"{name:8} {row['tp2_trainable']:>15,} {row['tp2_optimizer_bytes']:>16,} "
              f"{row['tp2_planned_optimizer_bytes']:>16,} "
              f"{row['fsdp2_trainable']:>16,.0f} {row['fsdp2_optimizer_bytes']:>18,.0f} "
              f"{row['fsdp2_planned_optimizer_bytes']:>16,}")
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
