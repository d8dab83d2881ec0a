"""Memory per rank of context parallelism at a fixed sequence: cp 1, 2, 4 (issue 28).

One process plays rank 0 of a ``cp``-rank world (PyTorch's fake process-group backend:
collectives return tensors of the right size without moving data), so the sizes of
everything rank 0 allocates are those of a real run. A Llama-shaped model (default
config, sizes changed; 8 query and 2 key/value heads) runs one forward and backward on
one sequence with ``context_parallel`` applied; a dispatch mode adds up the storages
alive (:class:`torchloom.runtime.memory.LiveBytes`, allocator-independent). Printed per
degree: the activations kept for backward at the end of the forward, the step's peak
above the weights, and their ratio to cp 1. What context parallelism divides by ``cp``
is every activation of the local tokens; what it adds is each layer's gathered keys and
values (the whole sequence's, kept by SDPA for its backward) and, on these CPU kernels,
the causal mask of each query chunk: PyTorch's CPU SDPA kernel turns a mask into an
additive float ``(c, keys)`` tensor and keeps it for backward (``c = S / 2cp``; the two
chunks of a rank together ``(2cp + 1) S^2 / (4 cp^2)`` elements per layer), where CUDA's
memory-efficient kernel takes the lower-right causal mask (``causal_lower_right``) without
materialising it. The third column counts that mask separately.

    python benchmarks/cp_memory.py [--seq 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.distributed as dist
import transformers as T
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchloom as tl
from torchloom.runtime.memory import LiveBytes

SIZES = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=1024, max_position_embeddings=65536)


def measure(cp: int, seq: int) -> dict[str, float]:
    dist.init_process_group("fake", rank=0, world_size=cp, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(**SIZES)).train()
        if cp > 1:
            tl.create_schedule(model).context_parallel()
        ids = torch.randint(0, SIZES["vocab_size"], (1, seq))
        live = LiveBytes()
        with live:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            kept = live.current
            out.loss.backward()
        c = seq // (2 * cp)
        mask = 0 if cp == 1 else SIZES["num_hidden_layers"] * c * (2 * cp + 1) * c * 4
        return {"cp": cp, "kept_mib": kept / 2**20, "peak_mib": live.peak / 2**20,
                "mask_mib": mask / 2**20}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    rows = [measure(cp, args.seq) for cp in (1, 2, 4)]
    base = rows[0]
    print(f"context parallelism, one sequence of {args.seq} tokens, Llama-shaped "
          f"({SIZES['num_hidden_layers']} layers, hidden {SIZES['hidden_size']}, 8 q / 2 kv heads,"
          f" vocab {SIZES['vocab_size']}), fp32, rank 0; torch {torch.__version__}, "
          f"transformers {T.__version__}, {platform.processor() or platform.machine()}")
    print("| cp | activations kept for backward | of which CPU-kernel masks | without them, "
          "vs cp 1 | ideal 1/cp | step peak above the weights | vs cp 1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rest = (r["kept_mib"] - r["mask_mib"]) / base["kept_mib"]
        print(f"| {r['cp']} | {r['kept_mib']:.1f} MiB | {r['mask_mib']:.1f} MiB | {rest:.3f} | "
              f"{1 / r['cp']:.3f} | {r['peak_mib']:.1f} MiB | "
              f"{r['peak_mib'] / base['peak_mib']:.3f} |")
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq": args.seq, "sizes": SIZES, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
