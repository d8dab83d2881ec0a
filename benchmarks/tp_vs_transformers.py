"""Tensor parallelism at TP=2 on gloo: torchloom against transformers' own ``tp_plan``.

For each family (default: Llama, Qwen2 and the mixture-of-experts Mixtral) one model is
built from transformers' default config with only sizes changed (``zoo_sweep``'s
shrinker, at the sizes of ``--hidden`` ... ``--experts``), initialised from a seed and
written with ``save_pretrained`` to a temporary folder. Then, on 2 CPU processes (gloo,
``--threads`` torch threads each), both load that folder:

* **transformers**: ``AutoModelFor....from_pretrained(folder,
  distributed_config=DistributedConfig(tp_plan="auto", tp_size=2))``: the model's own
  plan applied with DTensor. Transformers builds its device mesh on the process group
  that is already initialised (it would initialise one from torchrun's ``RANK`` /
  ``LOCAL_RANK`` / ``WORLD_SIZE`` otherwise; the ranks set those variables too);
* **torchloom**: the model class built under ``tl.init_empty_weights()``,
  ``schedules.apply_schedule(sch, tp=True)`` (the hand-written schedule where one exists,
  Llama, otherwise the one derived from the same plan), ``tl.build(sch, weights=folder)``:
  each rank reads its slices.

Both train with SGD on the same batches. The first ``--check-steps`` losses of each must
equal those of the unsharded model trained in one process (within ``--tol``, 1e-5).
Then ``--steps`` timed steps of each, interleaved (one of each per round, alternating
which goes first, after ``--warmup`` untimed steps; a step's time is the slower rank's),
report the median; and the collectives of one step are counted with PyTorch's
``CommDebugMode`` (which sees torchloom's ``torch.distributed`` calls and DTensor's
functional collectives alike), per forward, backward and optimizer step.

These are CPU / gloo figures: they compare the communication pattern and framework
overhead, not GPU performance. Needs ``accelerate`` installed, as transformers' TP does
(a benchmark extra, not a torchloom dependency).

Usage::

    python benchmarks/tp_vs_transformers.py
    python benchmarks/tp_vs_transformers.py --families llama,qwen2,qwen2_moe --json out.json

>>> args = parse_args(["--families", "llama", "--steps", "4"])
>>> args.families, args.steps, args.hidden
(['llama'], 4, 256)
>>> canonical("c10d_functional.all_gather_into_tensor"), canonical("c10d.allreduce_")
('all_gather', 'all_reduce')
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo_sweep  # noqa: E402  (the family list and the size shrinker)

WORLD = 2
FRAMEWORKS = ("transformers", "torchloom")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", default="llama,qwen2,mixtral",
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check-steps", type=int, default=3,
                   help="steps whose losses are compared with one process")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the check")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each, interleaved")
    p.add_argument("--tol", type=float, default=1e-5, help="largest loss difference allowed")
    p.add_argument("--sp", action="store_true",
                   help="torchloom with sequence parallelism (transformers has none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % WORLD or args.kv_heads % WORLD:
        p.error(f"--hidden must be a multiple of --heads; --heads and --kv-heads of {WORLD}")
    return args


def _sizes(args: argparse.Namespace) -> dict[str, int]:
    return {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.hidden // args.heads,
            "intermediate": args.intermediate, "moe_intermediate": args.moe_intermediate,
            "vocab": args.vocab, "experts": args.experts, "top_k": args.top_k}


def canonical(op: Any) -> str:
    """One name per collective, whichever API issued it (``c10d.allreduce_``,
    ``c10d_functional.all_reduce`` -> ``all_reduce``)."""
    name = str(op).split(".")[-1].strip("_").replace("_", "")
    for prefix, canon in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                          ("reducescatter", "reduce_scatter"), ("alltoall", "all_to_all"),
                          ("broadcast", "broadcast"), ("scatter", "scatter")):
        if name.startswith(prefix):
            return canon
    return name


def _batch(step: int, args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
          ) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    return float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss)


class _NoModules:
    """Stands in for ``CommDebugMode``'s per-module tracker: only the totals are used
    here, and on torch 2.13 that tracker loses its place in transformers' tensor-parallel
    model (an ``IndexError`` in its post-forward hook)."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False

    def __init__(self) -> None:
        self.parent_dict: dict[str, Any] = {}
        self.module_helper_dict: dict[str, Any] = {}
        self.module_parameters_dict: dict[str, Any] = {}
        self.module_parents_dict: dict[str, Any] = {"Global": []}
        self.sharding_dict: dict[str, Any] = {}

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _comm_mode() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    mode.advanced_module_tracker = _NoModules()
    return mode


def _counted_step(model: nn.Module, opt: torch.optim.Optimizer,
                  batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One step with its collectives counted per phase (``CommDebugMode``), and
    torchloom's own count of what it issued (a cross-check)."""
    from torchloom.runtime.collectives import count_collectives

    counts: dict[str, Any] = {}
    opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # CommDebugMode's module tracker hooks modules whose inputs need no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with _comm_mode() as mode, count_collectives() as own:
            loss = model(**batch).loss
        counts["forward"] = mode.get_comm_counts()
        counts["tl_forward"] = dict(own)
        with _comm_mode() as mode, count_collectives() as own:
            loss.backward()
        counts["backward"] = mode.get_comm_counts()
        counts["tl_backward"] = dict(own)
        with _comm_mode() as mode:
            opt.step()
        counts["optimizer"] = mode.get_comm_counts()
    out: dict[str, Any] = {}
    for phase in ("forward", "backward", "optimizer"):
        by_op: Counter[str] = Counter()
        for op, n in counts[phase].items():
            by_op[canonical(op)] += n
        out[phase] = dict(sorted(by_op.items()))
        out[f"{phase}_total"] = sum(by_op.values())
    out["torchloom_counter"] = {"forward": counts["tl_forward"],
                                "backward": counts["tl_backward"]}
    return out


def _load_transformers(folder: str, model_class: str) -> nn.Module:
    from transformers.distributed import DistributedConfig

    cls = zoo_sweep.model_class_of(model_class)
    model = cls.from_pretrained(folder, distributed_config=DistributedConfig(
        tp_plan="auto", tp_size=WORLD))
    return model.train()


def _load_torchloom(folder: str, model_class: str, config: Any, sp: bool
                    ) -> tuple[nn.Module, str, str]:
    """The scheduled model, its schedule's name and how the weights were loaded: on a
    meta model with ``build(weights=folder)``; where that refuses the checkpoint (a
    mixture-of-experts checkpoint whose expert tensors transformers converts when it
    loads them), ``from_pretrained`` on every rank, then schedule and build."""
    import torchloom as tl
    from torchloom import schedules
    from torchloom.runtime.gather import CheckpointMismatchError

    cls = zoo_sweep.model_class_of(model_class)
    knobs = {"tp": True, "sequence_parallel": True} if sp else {"tp": True}

    def scheduled(model: nn.Module) -> tuple[Any, str]:
        model.train()
        sch = tl.create_schedule(model)
        schedules.apply_schedule(sch, **knobs)
        return sch, schedules.schedule_for(model).__name__

    with tl.init_empty_weights():
        meta = cls(config)
    sch, schedule = scheduled(meta)
    try:
        built, _ = tl.build(sch, weights=folder)
        return built, schedule, "meta + build(weights=folder)"
    except CheckpointMismatchError as err:
        if "WeightConverter" not in str(err):
            raise
    sch, schedule = scheduled(cls.from_pretrained(folder))
    built, _ = tl.build(sch)
    return built, schedule, ("from_pretrained on each rank + build (build(weights=) refuses "
                             "the converted expert tensors)")


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _run_family(job: dict[str, Any], args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import transformers

    config = transformers.AutoConfig.from_pretrained(job["folder"])
    vocab = job["vocab"]
    start = time.perf_counter()
    hf = _load_transformers(job["folder"], job["model_class"])
    load_hf = _max_over_ranks(time.perf_counter() - start)
    accelerate_used = "accelerate" in sys.modules  # imported by transformers' TP loading
    start = time.perf_counter()
    tl_model, schedule, loaded = _load_torchloom(job["folder"], job["model_class"], config,
                                                 args.sp)
    load_tl = _max_over_ranks(time.perf_counter() - start)
    models = {"transformers": hf, "torchloom": tl_model}
    opts = {k: torch.optim.SGD(m.parameters(), lr=args.lr) for k, m in models.items()}
    runs: dict[str, dict[str, Any]] = {
        k: {"losses": [], "times_ms": [], "load_s": t}
        for k, t in (("transformers", load_hf), ("torchloom", load_tl))}
    runs["torchloom"]["schedule"] = schedule + (" + sequence parallel" if args.sp else "")
    runs["torchloom"]["loaded"] = loaded
    runs["transformers"]["loaded"] = "from_pretrained(folder, distributed_config=...)"
    runs["transformers"]["schedule"] = "tp_plan='auto' (DTensor)"
    for step in range(args.check_steps):
        for name in FRAMEWORKS:
            runs[name]["losses"].append(_step(models[name], opts[name],
                                              _batch(step, args, vocab)))
    step = args.check_steps
    for _ in range(args.warmup):
        for name in FRAMEWORKS:
            _step(models[name], opts[name], _batch(step, args, vocab))
        step += 1
    for round_ in range(args.steps):
        order = FRAMEWORKS if round_ % 2 == 0 else FRAMEWORKS[::-1]
        for name in order:
            batch = _batch(step, args, vocab)
            dist.barrier()
            t0 = time.perf_counter()
            _step(models[name], opts[name], batch)
            runs[name]["times_ms"].append(1000 * _max_over_ranks(time.perf_counter() - t0))
        step += 1
    for name in FRAMEWORKS:
        runs[name]["collectives"] = _counted_step(models[name], opts[name],
                                                  _batch(step, args, vocab))
        times = runs[name]["times_ms"]
        runs[name]["step_ms"] = statistics.median(times) if times else float("nan")
        ref = job["reference_losses"]
        diffs = [abs(a - b) for a, b in zip(runs[name]["losses"], ref)]
        runs[name]["max_loss_diff"] = max(diffs) if diffs else 0.0
    runs["transformers"]["accelerate_imported"] = accelerate_used
    return {"family": job["family"], "model_class": job["model_class"],
            "parameters": job["parameters"], "reference_losses": job["reference_losses"],
            "runs": runs}


def _worker(rank: int, port: int, jobs: list[dict[str, Any]], args: argparse.Namespace,
            out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        results = [_run_family(job, args, rank) for job in jobs]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _prepare(family: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The family's model at the benchmark's sizes, saved to ``root/family``, and the
    losses of ``--check-steps`` SGD steps of it in this one process."""
    families = {f.name: f for f in zoo_sweep.discover()[0]}
    if family not in families:
        raise SystemExit(f"error: {family!r} is not a family with a tensor-parallel plan")
    fam = families[family]
    with zoo_sweep.sizes(**_sizes(args)):
        model = zoo_sweep.build_model(fam, seed=0)
    folder = os.path.join(root, family)
    model.save_pretrained(folder)
    vocab = model.config.vocab_size
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = [_step(model, opt, _batch(step, args, vocab)) for step in range(args.check_steps)]
    return {"family": family, "model_class": fam.model_class, "folder": folder,
            "vocab": vocab, "reference_losses": losses,
            "parameters": sum(p.numel() for p in model.parameters())}


def format_table(result: dict[str, Any]) -> str:
    """The report: machine, versions and command, then one row per family and framework."""
    m, c = result["machine"], result["config"]
    lines = [
        f"TP={WORLD} on gloo (CPU), {m['threads_per_rank']} thread(s) per rank on "
        f"{m['cpu_count']} CPUs ({m['processor']}); torch {m['torch']}, transformers "
        f"{m['transformers']}, accelerate {m['accelerate']}, Python {m['python']}",
        f"sizes: hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads / "
        f"{c['kv_heads']} KV heads, intermediate {c['intermediate']} (experts "
        f"{c['experts']} x {c['moe_intermediate']}, top-{c['top_k']}), vocab {c['vocab']}; "
        f"batch {c['batch']} x seq {c['seq']}; {c['steps']} timed steps each, interleaved",
        f"command: {result['command']}",
        "",
        "| family | framework | schedule | max loss diff vs 1 process | step (ms, median) "
        "| collectives fwd / bwd / opt | by op (fwd; bwd) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fam in result["families"]:
        for name in FRAMEWORKS:
            run = fam["runs"][name]
            col = run["collectives"]
            ops = "; ".join(", ".join(f"{k} {v}" for k, v in col[p].items()) or "-"
                            for p in ("forward", "backward"))
            lines.append(
                f"| {fam['family']} | {name} | {run['schedule']} | {run['max_loss_diff']:.1e} "
                f"| {run['step_ms']:.1f} | {col['forward_total']} / {col['backward_total']} / "
                f"{col['optimizer_total']} | {ops} |")
    lines.append("")
    for fam in result["families"]:
        hf, tlr = fam["runs"]["transformers"], fam["runs"]["torchloom"]
        lines.append(
            f"{fam['family']}: transformers / torchloom step time "
            f"{hf['step_ms'] / tlr['step_ms']:.2f}x; collectives per step "
            f"{hf['collectives']['forward_total'] + hf['collectives']['backward_total']} vs "
            f"{tlr['collectives']['forward_total'] + tlr['collectives']['backward_total']}")
    lines.append(f"losses equal to one process within {c['tol']:g} over {c['check_steps']} "
                 f"steps: {'yes' if result['losses_match'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison, print the table, return the figures (and write ``--json``)."""
    import transformers

    args = parse_args(argv)
    try:
        import accelerate
    except ImportError:
        raise SystemExit("error: transformers' tensor parallelism needs accelerate: "
                         "pip install accelerate") from None
    from torchloom.runtime.launch import free_port

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        jobs = [_prepare(f, args, root) for f in args.families]
        out_path = os.path.join(root, "result.json")
        mp.spawn(_worker, args=(free_port(), jobs, args, out_path), nprocs=WORLD, join=True)
        with open(out_path) as f:
            families = json.load(f)
    command = "python benchmarks/tp_vs_transformers.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    result = {
        "machine": {"cpu_count": os.cpu_count(), "threads_per_rank": args.threads,
                    "processor": _processor(), "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "accelerate": accelerate.__version__,
                    "python": platform.python_version(), "backend": "gloo (CPU)",
                    "world_size": WORLD},
        "config": {k: getattr(args, k) for k in (
            "hidden", "layers", "heads", "kv_heads", "intermediate", "moe_intermediate",
            "experts", "top_k", "vocab", "batch", "seq", "steps", "warmup", "check_steps",
            "tol", "sp", "lr")},
        "command": command.strip(),
        "families": families,
        "losses_match": all(f["runs"][n]["max_loss_diff"] <= args.tol
                            for f in families for n in FRAMEWORKS),
    }
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not result["losses_match"]:
        print("error: a tensor-parallel run does not match the single-process model",
              file=sys.stderr)
    return result


def _processor() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(0 if main()["losses_match"] else 1)
