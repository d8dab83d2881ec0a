"""Validate torchloom.plan against real steps on gloo ranks: the table of the README.

For GPT-2 and Llama (zoo sizes) at world sizes 1, 2 and 4, a grid of layouts (tensor
parallelism with and without sequence parallelism, pipelines of two stages with GPipe
and 1F1B, data parallelism with DDP and FSDP2, their compositions, checkpoint ratios 0,
0.5 and 1, gradient accumulation) is predicted in this process on fake tensors
(:func:`torchloom.plan.predict`) and measured on real ranks, one launch per world size
(:func:`torchloom.plan.validate.measure_many`): every rank's peak of live storages over a
steady training step (TrainEvaluator's storage view, from before ``build``) against the
prediction for its pipeline stage, and the bytes of every collective by kind and mesh
dimension.

With ``--timed N`` every layout also runs N timed steps; predicted step times on a
profile of this machine (:func:`torchloom.plan.measure_local`) are compared with the
measured ones for every pair of layouts of the same world size whose measured times differ
by more than their spread (the range of their timed steps): does the plan order them the
same way?

Usage::

    python benchmarks/plan_validate.py                        # the full grid, memory only
    python benchmarks/plan_validate.py --worlds 1,2 --models llama --timed 5
    python benchmarks/plan_validate.py --json plan_validate.json

>>> [lay.describe() for _, lay in grid(1, ["gpt2"])][:2]
['tp1 dp1(ddp) mb4 ckpt0 fp32', 'tp1 dp1(ddp) mb4 ckpt0.5 fp32']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from torchloom.plan import Layout, measure_local, predict
from torchloom.plan.validate import check_prediction, measure_many
from torchloom.runtime.launch import raise_first_failure, run_ranks

SEQ = 32
RATIOS = (0.0, 0.5, 1.0)


def grid(world: int, models: list[str]) -> list[tuple[str, Layout]]:
    """The layouts of ``world`` ranks validated for ``models``."""
    out: list[tuple[str, Layout]] = []
    for name in models:
        lays: list[Layout] = []
        if world == 1:
            lays += [Layout(micro_batch=4, seq_len=SEQ, ckpt_ratio=r) for r in RATIOS]
            lays += [Layout(micro_batch=2, n_microbatches=2, seq_len=SEQ, ckpt_ratio=r)
                     for r in (0.0, 1.0)]
        if world == 2:
            for r in RATIOS:
                lays += [Layout(tp=2, micro_batch=4, seq_len=SEQ, ckpt_ratio=r),
                         Layout(tp=2, sp=True, micro_batch=4, seq_len=SEQ, ckpt_ratio=r),
                         Layout(dp_replicate=2, micro_batch=4, seq_len=SEQ, ckpt_ratio=r),
                         Layout(dp_shard=2, micro_batch=4, seq_len=SEQ,
                                ckpt_ratio=r),
                         Layout(pp=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                                ckpt_ratio=r),
                         Layout(pp=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                                ckpt_ratio=r, pipeline_schedule="GPipe")]
            lays.append(Layout(dp_replicate=2, micro_batch=2, n_microbatches=2, seq_len=SEQ))
            lays.append(Layout(dp_shard=2, micro_batch=2, n_microbatches=2,
                               seq_len=SEQ))
        if world == 4:
            for r in (0.0, 1.0):
                lays += [Layout(tp=2, dp_replicate=2, micro_batch=4, seq_len=SEQ, ckpt_ratio=r),
                         Layout(tp=2, sp=True, dp_shard=2, micro_batch=4,
                                seq_len=SEQ, ckpt_ratio=r)]
                lays += [Layout(tp=2, pp=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                                ckpt_ratio=r),
                         Layout(pp=2, dp_replicate=2, n_microbatches=4, micro_batch=2, seq_len=SEQ,
                                ckpt_ratio=r)]
            lays.append(Layout(dp_shard=4, micro_batch=4, seq_len=SEQ))
        out += [(name, lay) for lay in lays]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--size", default="tiny")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--timed", type=int, default=0, help="timed steps per layout")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _order_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pairs of layouts (same world size) whose measured times differ by more than their
    spread: how many the plan orders the same way."""
    agree, pairs, details = 0, 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["world"] != b["world"] or a["model"] != b["model"]:
                continue
            ta, tb = a["measured_s"], b["measured_s"]
            spread = max(a["spread_s"], b["spread_s"])
            if abs(ta - tb) <= spread:
                continue
            pairs += 1
            same = (ta < tb) == (a["predicted_s"] < b["predicted_s"])
            agree += same
            details.append((a["layout"], b["layout"], ta, tb, a["predicted_s"],
                            b["predicted_s"], same))
    return {"pairs": pairs, "agree": agree, "details": details}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    started = time.perf_counter()
    profile = measure_local(link=True) if args.timed else None
    rows: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    print("| model | layout | ranks | stage | predicted peak | measured peak | error | "
          "collective bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for world in worlds:
        cases = grid(world, models)
        preds = [predict(name, lay, "h100-80gb", size=args.size) for name, lay in cases]
        configs = [{"model": name, "size": args.size, "layout": lay.to_dict(),
                    "timed": args.timed} for name, lay in cases]
        results = run_ranks(measure_many, world, configs, timeout_s=300)
        raise_first_failure(results, command="plan_validate")
        for i, ((name, lay), pred) in enumerate(zip(cases, preds)):
            by_stage: dict[int, list[dict[str, Any]]] = {}
            for rank in range(world):
                m = results[rank][i]
                by_stage.setdefault(m["stage"], []).append(check_prediction(
                    m, pred, args.tolerance))
            for stage, checks in sorted(by_stage.items()):
                worst = max(checks, key=lambda c: abs(c["error"]))
                equal = all(c["collectives_equal"] for c in checks)
                row = {"model": name, "layout": lay.describe(), "world": world,
                       "stage": stage, "ranks": len(checks),
                       "predicted": worst["predicted"], "measured": worst["measured"],
                       "error": worst["error"], "collectives_equal": equal,
                       "collectives": worst["collectives_measured"]}
                rows.append(row)
                print(f"| {name} | {lay.describe()} | {len(checks)} | {stage} | "
                      f"{worst['predicted'] / 2**20:.3f} MiB | "
                      f"{worst['measured'] / 2**20:.3f} MiB | {worst['error']:+.1%} | "
                      f"{'equal' if equal else 'DIFFER'} |", flush=True)
            if args.timed:
                steps = [s for r in range(world) for s in results[r][i]["step_s"]]
                med = statistics.median(results[0][i]["step_s"])
                p = predict(name, lay, profile, size=args.size)
                cores = os.cpu_count() or 1
                timing.append({"model": name, "layout": lay.describe(), "world": world,
                               "measured_s": med, "spread_s": max(steps) - min(steps),
                               "predicted_s": p.step_time * max(1.0, world / cores)})
    errors = [abs(r["error"]) for r in rows]
    summary = {"rows": rows, "max_abs_error": max(errors), "mean_abs_error":
               statistics.mean(errors), "within": sum(e <= args.tolerance for e in errors),
               "total": len(errors), "collectives_equal": sum(r["collectives_equal"]
                                                               for r in rows),
               "seconds": time.perf_counter() - started}
    print(f"\n{summary['within']}/{summary['total']} stage peaks within "
          f"{args.tolerance:.0%} (largest error {summary['max_abs_error']:.1%}, mean "
          f"{summary['mean_abs_error']:.1%}); collective bytes equal for "
          f"{summary['collectives_equal']}/{summary['total']}; {summary['seconds']:.0f} s")
    if timing:
        order = _order_check(timing)
        summary["timing"] = timing
        summary["order"] = order
        print(f"step-time order: {order['agree']}/{order['pairs']} pairs whose measured "
              "times differ by more than their spread are ordered the same way by the plan")
        for a, b, ta, tb, pa, pb, same in order["details"]:
            print(f"  {'ok ' if same else 'NO '} {a} {ta * 1e3:.0f} ms vs {b} {tb * 1e3:.0f} ms"
                  f" (predicted {pa * 1e3:.1f} vs {pb * 1e3:.1f} ms)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
    return summary


if __name__ == "__main__":
    main()
