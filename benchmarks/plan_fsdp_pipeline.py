"""``torchloom plan`` against real FSDP2-under-a-pipeline steps on gloo ranks (4: pp 2 x
FSDP2 2, or pp 2 x cp 2 with FSDP2 over the cp ranks; 8: HSDP 2 x 2 under pp 2, and pp 2 x
TP 2 x FSDP2 2): the predicted peak of each stage against
the measured one (:func:`torchloom.plan.validate.measure_many`, the storage view), and
whether every collective's bytes are equal. (The zero-bubble schedules are refused with
FSDP2: ``Layout`` says why.)

Each peak is predicted twice: with the ``h100-80gb`` profile, as ``tests/test_plan_dist.py``
checks it, and with the same profile stripped of what only a GPU does (FSDP2's next
all-gather issued ahead on its own stream, the foreach optimizer's transient copy, the
caching allocator's reserve), which is what the CPU ranks run.

Usage (2 CPU cores; about a minute and a half)::

    python benchmarks/plan_fsdp_pipeline.py
"""

from __future__ import annotations

import dataclasses
import time

from torchloom.plan import Layout, predict
from torchloom.plan.profiles import get_profile
from torchloom.plan.validate import check_prediction, measure_many
from torchloom.runtime.launch import raise_first_failure, run_ranks

GPU = "h100-80gb"
CPU_LIKE = dataclasses.replace(get_profile(GPU), overlap=False, optimizer_impl="single",
                               allocator_reserve=1.0)


def cases() -> list[tuple[str, Layout]]:
    """Tiny (2 layers, hidden 32) and small (4 layers, hidden 128) zoo Llamas."""
    tiny = dict(pp=2, dp_shard=2, micro_batch=2, seq_len=32)
    small = dict(pp=2, dp_shard=2, micro_batch=2, seq_len=64)
    out: list[tuple[str, Layout]] = []
    for size, base in (("tiny", tiny), ("small", small)):
        out += [(size, Layout(**base, n_microbatches=2, mixed_precision="bf16")),
                (size, Layout(**base, n_microbatches=2)),
                (size, Layout(**base, n_microbatches=4)),
                (size, Layout(**base, n_microbatches=4, mixed_precision="bf16",
                              ckpt_ratio=1.0)),
                (size, Layout(**base, n_microbatches=2, pipeline_schedule="GPipe"))]
    out += [("small", Layout(**small, n_microbatches=4, pipeline_schedule="Interleaved1F1B",
                             mixed_precision="bf16")),
            ("tiny", Layout(pp=2, cp=2, shard_cp=True, n_microbatches=2, micro_batch=1,
                            seq_len=32)),
            ("small", Layout(pp=2, cp=2, shard_cp=True, n_microbatches=4, micro_batch=1,
                             seq_len=64, mixed_precision="bf16"))]
    return out


def cases_8() -> list[tuple[str, Layout]]:
    """On 8 ranks: HSDP under a pipeline, and FSDP2 x TP x PP."""
    return [("tiny", Layout(pp=2, dp_replicate=2, dp_shard=2, n_microbatches=2, micro_batch=2,
                            seq_len=32)),
            ("small", Layout(pp=2, dp_replicate=2, dp_shard=2, n_microbatches=4, micro_batch=1,
                             seq_len=64, mixed_precision="bf16")),
            ("small", Layout(pp=2, tp=2, sp=True, dp_shard=2, n_microbatches=4, micro_batch=1,
                             seq_len=64, mixed_precision="bf16"))]


def main() -> None:
    start = time.perf_counter()
    print("| model | layout | stage | measured KiB | error (h100-80gb) | error (CPU-like) "
          "| collectives equal |")
    print("|---|---|---:|---:|---:|---:|---|")
    worst = 0.0
    for world, todo in ((4, cases()), (8, cases_8())):
        worst = max(worst, _report(world, todo))
    print(f"\nlargest CPU-like error {worst:.1%}; {time.perf_counter() - start:.0f} s")


def _report(world: int, todo: list[tuple[str, Layout]]) -> float:
    results = run_ranks(measure_many, world, [{"model": "llama", "size": size,
                                               "layout": lay.to_dict()}
                                              for size, lay in todo], timeout_s=900)
    raise_first_failure(results, command="plan_fsdp_pipeline")
    worst = 0.0
    for i, (size, lay) in enumerate(todo):
        gpu, cpu = predict("llama", lay, GPU, size=size), predict("llama", lay, CPU_LIKE,
                                                                  size=size)
        for rank in (0, world - 1):  # one rank of each stage
            measured = results[rank][i]
            a, b = check_prediction(measured, gpu), check_prediction(measured, cpu)
            worst = max(worst, abs(b["error"]))
            print(f"| {size} | {lay.describe()} | {measured['stage']} | "
                  f"{measured['peak'] / 1024:,.0f} | {a['error']:+.1%} | {b['error']:+.1%} | "
                  f"{'yes' if a['collectives_equal'] else 'no'} |")
    return worst


if __name__ == "__main__":
    main()
