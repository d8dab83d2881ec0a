"""Peak memory and time of ``build`` for one rank of a large tensor-parallel model.

A Llama of 1.68 B parameters (hidden 4096, intermediate 11008 (transformers' default),
8 layers, 32 heads, 8 KV heads, vocabulary 32000, fp32) is constructed under
``tl.init_empty_weights()`` (``AutoModelForCausalLM.from_config``), scheduled with the
built-in tensor-parallel schedule (``torchloom.schedules.apply_schedule(sch, tp=True)``) for 8
ranks, and built as rank 0 of a ``fake`` process group of 8 in one process
(``torch.testing._internal.distributed.fake_pg``: the collectives do nothing). Three
modes, each in a fresh subprocess so that peaks do not mix:

* ``full``: ``build(sch)``, the default init (values equal to the unsharded init, sliced);
* ``local``: ``build(sch, init="local")``, each rank draws only its slices;
* ``weights``: ``build(sch, weights=folder)``, from a sharded safetensors folder in the
  layout ``save_pretrained`` writes (``model-0000i-of-0000n.safetensors`` + index), which
  the script writes first, tensor by tensor (one shard file of at most ``--shard-mb`` is
  held at a time, in the parent process), and deletes at the end.

Reported per mode: the peak anonymous memory above the start of ``build`` (``RssAnon``
from ``/proc/self/status``, sampled every ``--sample-ms`` ms in a thread; RSS would also
count the mapped safetensors pages, which the kernel can drop), the build time, the
rank's local shard (its parameters and buffers after build), the largest single tensor
of the model (full size), and the ratio of the peak to their sum. The target is a
peak of at most 1.3 x (local shard + largest tensor) in every mode.

Usage::

    python benchmarks/scale_bench.py                       # the 1.68 B model (~6.4 GB folder)
    python benchmarks/scale_bench.py --layers 2 --hidden 1024 --intermediate 2816
    python benchmarks/scale_bench.py --modes full,local    # no folder written

>>> args = parse_args(["--layers", "2", "--modes", "local"])
>>> args.layers, args.modes, args.world
(2, ['local'], 8)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

GIB = 2 ** 30
MODES = ("full", "local", "weights")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, default=8, help="tensor-parallel degree simulated")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each run")
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--dir", default=None, help="where to write the weights folder "
                   "(default: a new folder under /tmp, deleted at the end)")
    p.add_argument("--shard-mb", type=int, default=1024, help="max safetensors file size")
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {list(MODES)}")
    return args


def make_config(args: argparse.Namespace) -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab)


def meta_model(config: Any) -> Any:
    import transformers

    import torchloom as tl

    with tl.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config)


# --------------------------------------------------------------------------- the folder


def write_folder(args: argparse.Namespace, folder: str) -> float:
    """A safetensors folder of random weights for the model, written one tensor at a time
    (at most one shard file held); returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    config = make_config(args)
    model = meta_model(config)
    config.save_pretrained(folder)
    items = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    limit = args.shard_mb * 2 ** 20
    groups: list[list[tuple[str, tuple[int, ...], Any]]] = [[]]
    size = 0
    for key, shape, dtype in items:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append((key, shape, dtype))
        size += nbytes
    n = len(groups)
    weight_map: dict[str, str] = {}
    total = 0
    gen = torch.Generator().manual_seed(0)
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for key, shape, dtype in group:
            tensors[key] = torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=gen)
            weight_map[key] = name
            total += tensors[key].nbytes
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return float(total)


# --------------------------------------------------------------------------- one run


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (``RssAnon``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """Samples ``RssAnon`` every ``interval`` seconds in a thread; ``peak`` is the max."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torchloom as tl
    from torchloom import schedules

    torch.set_num_threads(args.threads)
    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    config = make_config(args)
    model = meta_model(config)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True)
    full_bytes: dict[str, int] = {}
    params = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        spec = tl.shard_spec(t)
        numel = torch.Size(spec.full_shape if spec is not None else tuple(t.shape)).numel()
        full_bytes[name] = numel * t.dtype.itemsize
        params += numel if isinstance(t, torch.nn.Parameter) else 0
    kw: dict[str, Any] = {}
    if args.child == "local":
        kw["init"] = "local"
    elif args.child == "weights":
        kw["weights"] = args.folder
    torch.manual_seed(0)
    start = rss_anon()
    with PeakSampler(args.sample_ms / 1000) as sampler:
        t0 = time.perf_counter()
        tl.build(sch, **kw)
        seconds = time.perf_counter() - t0
    seen: set[int] = set()
    local = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            local += t.nbytes
    dist.destroy_process_group()
    return {"mode": args.child, "build_s": seconds, "peak_bytes": sampler.peak - start,
            "local_bytes": local, "largest_bytes": max(full_bytes.values()),
            "model_bytes": sum(full_bytes.values()), "params": params}


def run_child(args: argparse.Namespace, mode: str, folder: str | None) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode,
           "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--intermediate", str(args.intermediate), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--vocab", str(args.vocab),
           "--world", str(args.world), "--threads", str(args.threads),
           "--sample-ms", str(args.sample_ms)]
    if folder is not None:
        cmd += ["--folder", folder]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mode | build (s) | peak RssAnon above start (GiB) | local shard (GiB) | "
             "largest tensor (GiB) | peak / (shard + largest) | target <= 1.3 |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["peak_bytes"] / (r["local_bytes"] + r["largest_bytes"])
        lines.append(
            f"| {r['mode']} | {r['build_s']:.1f} | {r['peak_bytes'] / GIB:.2f} | "
            f"{r['local_bytes'] / GIB:.2f} | {r['largest_bytes'] / GIB:.2f} | {ratio:.2f} | "
            f"{'yes' if ratio <= 1.3 else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return 0
    folder = None
    made_dir = None
    results = []
    try:
        if "weights" in args.modes:
            base = args.dir or tempfile.mkdtemp(prefix="scale_bench_", dir="/tmp")
            made_dir = base if args.dir is None else None
            folder = os.path.join(base, "llama")
            os.makedirs(folder, exist_ok=True)
            free = shutil.disk_usage(base).free
            print(f"writing the weights folder to {folder} ({free / GIB:.1f} GiB free)",
                  file=sys.stderr)
            t0 = time.perf_counter()
            size = write_folder(args, folder)
            print(f"wrote {size / GIB:.2f} GiB in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
        for mode in args.modes:
            print(f"building: {mode}", file=sys.stderr)
            results.append(run_child(args, mode, folder if mode == "weights" else None))
    finally:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        elif folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    first = results[0]
    print(f"Llama: {first['params'] / 1e9:.2f} B parameters ({first['model_bytes'] / GIB:.2f} "
          f"GiB fp32), hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers, {args.heads} heads, {args.kv_heads} KV heads, vocabulary "
          f"{args.vocab}; rank 0 of TP={args.world} (fake process group, one process), "
          f"{args.threads} thread(s)\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
