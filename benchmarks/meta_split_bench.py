"""Trace and cut a 70 B-class Llama into pipeline stages before any weight exists.

The model (Llama-2-70B's shape by default: hidden 8192, intermediate 28672, 80 layers, 64
heads, 8 KV heads, vocabulary 32000) is constructed under ``tl.init_empty_weights()``,
traced down to its layers with dummy inputs made from the config (``trace_until``), cut
into ``--stages`` equal pipeline stages and split (``torchloom.runtime.pipeline.split_stages``,
the liveness analysis ``build(target="pipeline")`` runs), all on fake tensors. Reported:
the parameter count, the time of each phase and the peak anonymous memory above the
start (``RssAnon`` from ``/proc/self/status``, sampled in a thread).

Usage::

    python benchmarks/meta_split_bench.py                 # 69 B parameters, 4 stages
    python benchmarks/meta_split_bench.py --layers 8 --stages 2

>>> parse_args(["--layers", "4"]).layers
4
"""

from __future__ import annotations

import argparse
import threading
import time

MIB = 2 ** 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=28672)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--stages", type=int, default=4)
    return p.parse_args(argv)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import transformers

    import torchloom as tl
    from torchloom.runtime.pipeline_split import split_stages

    start = rss_anon()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    cfg = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab)
    t0 = time.perf_counter()
    with tl.init_empty_weights():
        model = transformers.LlamaForCausalLM(cfg)
    t1 = time.perf_counter()
    sch = tl.create_schedule(model)
    sch.trace_until("model.layers.*")
    t2 = time.perf_counter()
    per = args.layers // args.stages
    for k in range(1, args.stages):
        sch[f"model.layers.{k * per - 1}"].cut_pipeline_stage()
    stages = split_stages(sch)
    t3 = time.perf_counter()
    done.set()
    params = sum(p.numel() for p in model.parameters())
    print(f"Llama on meta: {params / 1e9:.1f} B parameters, {args.layers} layers, hidden "
          f"{args.hidden}; {len(stages.modules)} stages")
    print("| phase | seconds |\n|---|---|")
    print(f"| construct under init_empty_weights | {t1 - t0:.1f} |")
    print(f"| trace_until('model.layers.*'), dummy inputs | {t2 - t1:.1f} |")
    print(f"| cut and split into {args.stages} stages | {t3 - t2:.1f} |")
    print(f"peak RssAnon above start: {(peak[0] - start) / MIB:.0f} MiB (after imports)")


if __name__ == "__main__":
    main()
