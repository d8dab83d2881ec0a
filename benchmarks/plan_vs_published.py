"""``torchloom plan`` against torchtitan's published H100 measurements (2024-12).

Every row of Tables 1 to 6 of torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``
(Llama 3.1 8B / 70B / 405B, sequences of 8,192 tokens unless the table says otherwise,
bf16 compute with fp32 weights, AdamW, on H100 96 GB HBM2e at 500 W; memory is the
allocator's peak reserved in GiB, throughput tokens/s per GPU at iteration 90) is
predicted **as that run was configured**: the loss on full-vocabulary fp32 logits
without tensor parallelism and vocabulary-parallel with it (``loss="full"`` /
``"parallel"``), torchtitan's per-op selective checkpointing (``ac="op"``) or full
checkpointing, FSDP2 with bf16 all-gathers and fp32 reductions, sequence parallelism
with tensor parallelism, pipelines of ``pp x stages_per_rank`` stages and as many
micro-batches (torchtitan's default), and the run's torch.compile / Float8 / async-TP
knobs (their effects are documented assumptions of :mod:`torchloom.plan.predict`).
Beside each row, the same layout with torchloom's default loss (``chunked``: the
cross-entropy over row chunks with its gradient made in the forward, vocabulary-sharded
under tensor parallelism) and what it saves.

The rows with context parallelism are predicted as configured: Table 2 (8B, 8 GPUs, FSDP
x CP = 8, the sequence growing with the CP degree, 32,768 x CP tokens, full
checkpointing) and Table 6 (405B, PP 8 x TP 8 x FSDP x CP), FSDP2 sharded over
``dp_shard x cp`` as torchtitan shards it, the FSDP 1 x CP 8 rows over the CP ranks alone
(``Layout(shard_cp=True)``).

Usage (2 CPU cores, no GPU; about a minute)::

    python benchmarks/plan_vs_published.py [--markdown] [--json PATH]

Targets: memory within 10 % and tokens/s within 20 % on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from torchloom.core.errors import PlanError
from torchloom.core.rules import even_cuts
from torchloom.parallel.layout import Layout
from torchloom.plan import predict
from torchloom.plan.layout import check_model
from torchloom.plan.spec import model_spec

GIB = 2**30
MEMORY_TARGET = 0.10
THROUGHPUT_TARGET = 0.20

#: Llama 3.1: hidden, intermediate, layers, heads, KV heads (vocabulary 128,256)
LLAMA31 = {"8B": (4096, 14336, 32, 32, 8), "70B": (8192, 28672, 80, 64, 8),
           "405B": (16384, 53248, 126, 128, 8)}


@dataclass(frozen=True)
class Row:
    """One published measurement and the run's configuration."""

    table: str
    name: str
    model: str
    gpus: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    local_batch: int
    seq_len: int
    ac: str
    compile: bool
    float8: bool
    async_tp: bool
    schedule: str
    tps: float
    gib: float

    def layout(self, loss: str | None = None) -> Layout:
        """The run's layout (``loss``: as the run computed it, unless given)."""
        per_rank = 2 if self.schedule == "Interleaved1F1B" else 1
        stages = self.pp * per_rank
        micro = stages if self.pp > 1 else 1  # torchtitan: one micro-batch per stage
        layers = LLAMA31[self.model][2]
        cuts = tuple(even_cuts(layers, stages)) if self.pp > 1 and layers % stages else None
        return Layout(
            dp_shard=self.fsdp, tp=self.tp, sp=self.tp > 1, pp=self.pp, cp=self.cp,
            shard_cp=self.cp > 1,  # torchtitan: FSDP2 over dp_shard x cp, also dp_shard 1
            pipeline_schedule=self.schedule, stages_per_rank=per_rank if self.pp > 1 else None,
            stage_cuts=cuts, n_microbatches=micro, micro_batch=self.local_batch // micro,
            seq_len=self.seq_len, ac=self.ac, compile=self.compile, float8=self.float8,
            async_tp=self.async_tp, param_dtype="fp32", mixed_precision="bf16",
            reduce_dtype="fp32",
            loss=loss or ("parallel" if self.tp > 1 else "full"))


def _rows() -> list[Row]:
    out = []

    def add(table: str, name: str, model: str, gpus: int, fsdp: int, tp: int, pp: int,
            cp: int, batch: int, seq: int, ac: str, knobs: str, schedule: str, tps: float,
            gib: float) -> None:
        out.append(Row(table, name, model, gpus, fsdp, tp, pp, cp, batch, seq, ac,
                       "compile" in knobs, "float8" in knobs, "async" in knobs, schedule,
                       tps, gib))

    for table, gpus, rows in (("1", 8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                              ("3", 128, ((5605, 67.0), (6514, 62.0), (8380, 61.8)))):
        for knobs, (tps, gib) in zip(("", "compile", "compile float8"), rows, strict=True):
            label = "FSDP" + "".join(f" + {k}" for k in knobs.split())
            add(table, label, "8B", gpus, gpus, 1, 1, 1, 2, 8192, "op", knobs, "1F1B", tps, gib)
    for cp, seq, tps, gib in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2),
                              (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5)):
        add("2", f"FSDP {8 // cp}, CP {cp}", "8B", 8, 8 // cp, 1, 1, cp, 1, seq, "full",
            "compile float8", "1F1B", tps, gib)
    add("4", "2D", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", "compile float8", "1F1B",
        829, 71.9)
    add("4", "2D + AsyncTP", "70B", 256, 32, 8, 1, 1, 16, 8192, "full",
        "compile float8 async", "1F1B", 876, 67.6)
    for schedule, tps, gib in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7)):
        add("5", schedule, "405B", 512, 8, 8, 8, 1, 32, 8192, "full", "compile float8 async",
            schedule, tps, gib)
    for cp, seq, tps, gib in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9),
                              (4, 131072, 31, 77.1), (8, 262144, 16, 84.9)):
        add("6", f"FSDP {8 // cp}, CP {cp}", "405B", 512, 8 // cp, 8, 8, cp, 8, seq, "full",
            "compile float8 async", "1F1B", tps, gib)
    return out


ROWS = _rows()


def config_dir(model: str, root: str) -> str:
    """A Llama 3.1 config folder (``save_pretrained``; nothing downloaded). Positions:
    262,144, the longest sequence of the tables (Llama 3.1's config says 131,072; torchtitan
    sizes its rotary table from the run's sequence length, and transformers' rotary
    embedding holds nothing per position, so the field changes no prediction)."""
    hidden, inter, layers, heads, kv = LLAMA31[model]
    path = os.path.join(root, f"llama-3.1-{model}")
    if not os.path.exists(os.path.join(path, "config.json")):
        transformers.LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128256,
            max_position_embeddings=262144, rope_theta=500000.0,
            tie_word_embeddings=False).save_pretrained(path)
    return path


def torchtitan_tp(sch: Any, knobs: dict[str, Any]) -> None:
    """torchtitan's tensor-parallel layout of Llama: transformers' own plan, which is the
    same Megatron split with the embedding and the head split along the vocabulary
    (torchloom's built-in Llama schedule keeps the embedding whole)."""
    from torchloom.schedules.hf_plan import from_hf_plan

    from_hf_plan(sch, tp=bool(knobs.get("tp")),
                 sequence_parallel=bool(knobs.get("sequence_parallel")),
                 ckpt_ratio=float(knobs.get("ckpt_ratio", 0.0)),
                 loss_parallel=bool(knobs.get("loss_parallel")))


def _error(predicted: float, published: float) -> float:
    return (predicted - published) / published


def evaluate(rows: list[Row], root: str, profile: str = "h100-96gb") -> list[dict[str, Any]]:
    """Predict every row (and torchloom's default loss beside it)."""
    out = []
    for row in rows:
        item: dict[str, Any] = {"table": row.table, "run": row.name, "model": row.model,
                                "gpus": row.gpus, "published_tps": row.tps,
                                "published_gib": row.gib}
        spec = model_spec(config_dir(row.model, root), seq_len=row.seq_len)
        try:
            check_model(row.layout(), spec)
        except PlanError as exc:  # a layout torchloom or its planner does not take
            item["status"] = f"not predicted: {str(exc).splitlines()[0]}"
            out.append(item)
            continue
        start = time.perf_counter()
        schedule = torchtitan_tp if row.tp > 1 else None
        p = predict(spec, row.layout(), profile, schedule=schedule)
        item["seconds"] = time.perf_counter() - start
        ours = predict(spec, row.layout("chunked"), profile, schedule=schedule)
        item.update({
            "layout": p.layout.describe(), "predicted_gib": p.peak / GIB,
            "predicted_tps": p.tokens_per_s_per_gpu,
            "memory_error": _error(p.peak / GIB, row.gib),
            "tps_error": _error(p.tokens_per_s_per_gpu, row.tps),
            "chunked_gib": ours.peak / GIB, "chunked_tps": ours.tokens_per_s_per_gpu,
            "status": "predicted"})
        item["met"] = abs(item["memory_error"]) <= MEMORY_TARGET and \
            abs(item["tps_error"]) <= THROUGHPUT_TARGET
        out.append(item)
    return out


def _order_checks(items: list[dict[str, Any]]) -> list[str]:
    """Where two rows of a table differ, the order the published numbers have."""
    by = {(i["table"], i["run"]): i for i in items if i["status"] == "predicted"}
    lines = []
    a, b = by.get(("5", "1F1B")), by.get(("5", "Interleaved1F1B"))
    if a and b:
        faster = b["predicted_tps"] > a["predicted_tps"]
        leaner = b["predicted_gib"] < a["predicted_gib"]
        lines.append(f"Table 5: interleaved 1F1B faster than 1F1B: "
                     f"{'yes' if faster else 'NO'}; leaner: {'yes' if leaner else 'NO'}")
    cps = [i for i in (by.get(("2", f"FSDP {8 // cp}, CP {cp}")) for cp in (1, 2, 4, 8)) if i]
    if len(cps) > 1:
        down = all(cps[i + 1]["predicted_tps"] < cps[i]["predicted_tps"]
                   for i in range(len(cps) - 1))
        lines.append(f"Table 2: throughput falls with the CP degree: {'yes' if down else 'NO'}")
    for t in ("1", "3"):
        rows = [by.get((t, n)) for n in ("FSDP", "FSDP + compile", "FSDP + compile + float8")]
        if all(rows):
            up = all(rows[i + 1]["predicted_tps"] > rows[i]["predicted_tps"] for i in range(2))
            lines.append(f"Table {t}: throughput rises with compile, then Float8: "
                         f"{'yes' if up else 'NO'}")
    return lines


def markdown(items: list[dict[str, Any]]) -> str:
    """The README's validation table."""
    head = ("| table | run | GPUs | published GiB | predicted GiB | error | published "
            "tok/s/GPU | predicted tok/s/GPU | error | chunked loss: GiB (saves) |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for i in items:
        if i["status"] != "predicted":
            lines.append(f"| {i['table']} | {i['run']} | {i['gpus']} | {i['published_gib']} "
                         f"| - | - | {i['published_tps']:,.0f} | - | - | {i['status']} |")
            continue
        saved = i["predicted_gib"] - i["chunked_gib"]
        lines.append(
            f"| {i['table']} | {i['model']} {i['run']} | {i['gpus']} | {i['published_gib']} | "
            f"{i['predicted_gib']:.1f} | {i['memory_error']:+.1%} | {i['published_tps']:,.0f} | "
            f"{i['predicted_tps']:,.0f} | {i['tps_error']:+.1%} | "
            f"{i['chunked_gib']:.1f} ({saved:.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--profile", default="h100-96gb")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        items = evaluate(ROWS, root, args.profile)
    elapsed = time.perf_counter() - start
    print(markdown(items))
    print()
    for line in _order_checks(items):
        print(line)
    predicted = [i for i in items if i["status"] == "predicted"]
    met = sum(i["met"] for i in predicted)
    print(f"\n{met} of {len(predicted)} predicted rows within the targets (memory "
          f"{MEMORY_TARGET:.0%}, tokens/s {THROUGHPUT_TARGET:.0%}); "
          f"{len(items) - len(predicted)} rows not predicted (their status says why)")
    print(f"slowest fixed-layout plan: {max(i['seconds'] for i in predicted):.1f} s; "
          f"all rows: {elapsed:.0f} s on {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(items, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
