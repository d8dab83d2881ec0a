"""Auto-tuning a tiny GPT-2 on the CPU: exhaustive search, Slapo's binary search and
optuna's model-based search (TPE) on the same grid and budget (the paper's experiment).

The space is batch size x checkpoint ratio (``sch["transformer.h"].checkpoint(ratio=r)``)
of a 4-layer GPT-2 (hidden size 64, 4 heads, byte vocabulary). Both strategies get the
same memory budget: the cost model prunes every candidate it predicts over the budget
before any runs, and a candidate whose measured peak exceeds the budget fails as out of
memory (a CPU has no device memory limit, so the budget stands in for one). Each
remaining candidate is trained in-process for ``--warmup`` + ``--steps`` steps and its
throughput (tokens/s) measured.

Printed: a table per strategy (points evaluated, pruned, evaluations until the grid's
optimum, the exhaustive run's best point, was first measured, trials that ran over the
budget, which must be 0 because the cost model prunes them, best point, best throughput,
time), and the memory cost model's error against the measured peak for every
configuration that ran. Predicted: one training step on fake tensors, every storage
followed from creation to release (``torchloom.runtime.memory``). Measured: the same
following on real tensors over a real step (``TrainEvaluator``). For contrast the table
also shows the naive steady sum (parameters + gradients + AdamW state + saved
activations), which misses the recomputation of checkpointed layers in backward.

Throughputs on a shared CPU are noisy; the binary search's best point is therefore also
compared with the exhaustive run's measurement of that same point.

Usage::

    python benchmarks/tune_bench.py                # about 1-2 minutes on 2 cores
    python benchmarks/tune_bench.py --budget-mib 24 --seq-len 32

>>> args = parse_args(["--budget-mib", "10"])
>>> (args.budget_mib, args.seq_len, args.steps)
(10.0, 64, 3)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import transformers
from rich.console import Console
from rich.table import Table

import torchloom as tl
from torchloom.tune import (
    CostModel,
    MemoryEstimate,
    Space,
    TrainEvaluator,
    Tuner,
    TuneResult,
    point_key,
)

STRATEGIES = ("exhaustive", "binary", "optuna")
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]
RATIOS = [0.0, 0.25, 0.5, 0.75, 1.0]
MIB = 2**20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=40.0, help="memory budget (MiB)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps per candidate (the median counts)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate")
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of the head-to-head re-measurement of the two best points")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steady timings on a busy machine)")
    return parser.parse_args(argv)


def make_model() -> transformers.GPT2LMHeadModel:
    """The tiny GPT-2 (random init, seed 0)."""
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                  n_positions=128, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def schedule(sch: tl.Schedule, point: dict) -> None:
    """Checkpoint the first ``ckpt_ratio`` of the layers."""
    sch["transformer.h"].checkpoint(ratio=point["ckpt_ratio"])


def run(strategy: str, args: argparse.Namespace,
        estimates: dict[str, MemoryEstimate] | None = None) -> TuneResult:
    """Tune with ``strategy``, from an empty database; the cost model's estimates are
    kept in ``estimates`` by point key."""
    def make_inputs(model: torch.nn.Module, point: dict) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (point["batch_size"], args.seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}

    space = Space()
    space.create_symbol("batch_size", BATCH_SIZES)
    space.create_symbol("ckpt_ratio", RATIOS)
    budget = int(args.budget_mib * MIB)
    evaluate = TrainEvaluator(make_model, make_inputs, steps=args.steps, warmup=args.warmup,
                              memory_limit_bytes=budget)
    cost = CostModel(make_model, make_inputs)
    kept = estimates if estimates is not None else {}

    def predict(recipe: tl.Recipe, point: dict) -> MemoryEstimate:
        kept[point_key(point)] = cost.predict(recipe, point)
        return kept[point_key(point)]

    tuner = Tuner(space, make_model, schedule, evaluate, cost_model=predict,
                  budget_bytes=budget)
    return tuner.run(strategy)


def head_to_head(points: list[dict], args: argparse.Namespace) -> list[float]:
    """Median throughput of each point over ``args.repeats`` rounds that alternate between
    the points, so that a slow spell of a shared machine hits all of them alike."""
    def make_inputs(model: torch.nn.Module, point: dict) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (point["batch_size"], args.seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}

    evaluate = TrainEvaluator(make_model, make_inputs, steps=args.steps, warmup=args.warmup)
    recipes = []
    for point in points:
        sch = tl.create_schedule(make_model())
        schedule(sch, point)
        recipes.append(sch.recipe)
    samples: list[list[float]] = [[] for _ in points]
    for _ in range(args.repeats):
        for i, (recipe, point) in enumerate(zip(recipes, points)):
            samples[i].append(evaluate(recipe, point).throughput)
    return [statistics.median(s) for s in samples]


def evaluations_to(result: TuneResult, key: str) -> int | None:
    """How many evaluations ``result``'s strategy ran until it first measured the point
    ``key`` (1-based), or None if it never did.

    >>> from torchloom.tune import TrialRecord
    >>> recs = [TrialRecord(point={"b": b}, status=s) for b, s in [(1, "pruned"), (2, "ok"), (4, "ok")]]
    >>> evaluations_to(TuneResult(best=None, records=recs), recs[2].key)
    2
    """
    ran = [r for r in result.records if r.status != "pruned"]
    return next((i + 1 for i, r in enumerate(ran) if r.key == key), None)


def over_budget(result: TuneResult) -> int:
    """Trials that ran and measured a peak over the budget (the cost model should have
    pruned them)."""
    return sum(1 for r in result.records
               if r.status == "failed" and (r.error or "").startswith("out of memory"))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three strategies and print the tables."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    console.print(f"tiny GPT-2, {len(BATCH_SIZES)} batch sizes x {len(RATIOS)} ratios = "
                  f"{len(BATCH_SIZES) * len(RATIOS)} points, budget {args.budget_mib} MiB, "
                  f"seq {args.seq_len}, torch threads {torch.get_num_threads()}")
    results = {}
    estimates: dict[str, MemoryEstimate] = {}
    for name in STRATEGIES:
        start = time.perf_counter()
        results[name] = run(name, args, estimates if name == "exhaustive" else None)
        results[name].seconds = time.perf_counter() - start
    summary = Table(title="strategies")
    for column in ("strategy", "evaluated", "pruned", "evaluations to the optimum",
                   "over budget", "best point", "best tokens/s", "time s"):
        summary.add_column(column, justify="left" if column in ("strategy", "best point") else "right")
    optimum = results["exhaustive"].best
    for name, result in results.items():
        best = result.best
        reached = evaluations_to(result, optimum.key) if optimum else None
        summary.add_row(name, str(result.evaluations), str(len(result.pruned)),
                        str(reached) if reached else "not reached", str(over_budget(result)),
                        str(best.point) if best else "-",
                        f"{best.throughput:.0f}" if best else "-", f"{result.seconds:.1f}")
    console.print(summary)
    full, binary = results["exhaustive"], results["binary"]
    if full.best and binary.best:
        same = next(r for r in full.records if r.key == binary.best.key)
        console.print(
            f"binary's best point as measured by the exhaustive run: {same.throughput:.0f} "
            f"tokens/s = {same.throughput / full.best.throughput:.1%} of the exhaustive best")
        fair = head_to_head([full.best.point, binary.best.point], args)
        console.print(
            f"re-measured head to head ({args.repeats} alternating rounds, median): exhaustive "
            f"best {full.best.point} {fair[0]:.0f} tokens/s, binary best {binary.best.point} "
            f"{fair[1]:.0f} tokens/s = {fair[1] / fair[0]:.1%}")
    for name in ("binary", "optuna"):
        console.print(f"{name} trials in order: " + ", ".join(
            f"{r.point['batch_size']}/{r.point['ckpt_ratio']}:{r.status}"
            + (f" {r.throughput:.0f}" if r.status == "ok" else "")
            for r in results[name].records if r.status != "pruned"))

    errors = Table(title="memory cost model vs measured peak (exhaustive run)")
    for column in ("batch", "ratio", "predicted MiB", "measured MiB", "error",
                   "steady sum MiB", "its error"):
        errors.add_column(column, justify="right")
    worst, worst_sum = 0.0, 0.0
    for r in sorted(full.records, key=lambda r: (r.point["batch_size"], r.point["ckpt_ratio"])):
        if r.peak_memory_bytes and r.predicted_memory_bytes is not None:
            err = (r.predicted_memory_bytes - r.peak_memory_bytes) / r.peak_memory_bytes
            e = estimates[r.key]
            steady = e.parameters + e.gradients + e.optimizer + e.activations
            steady_err = (steady - r.peak_memory_bytes) / r.peak_memory_bytes
            worst, worst_sum = max(worst, abs(err)), max(worst_sum, abs(steady_err))
            errors.add_row(str(r.point["batch_size"]), str(r.point["ckpt_ratio"]),
                           f"{r.predicted_memory_bytes / MIB:.2f}",
                           f"{r.peak_memory_bytes / MIB:.2f}", f"{err:+.2%}",
                           f"{steady / MIB:.2f}", f"{steady_err:+.1%}")
    console.print(errors)
    console.print(f"largest cost-model error: {worst:.2%} (steady sum: {worst_sum:.1%})")


if __name__ == "__main__":
    main()
