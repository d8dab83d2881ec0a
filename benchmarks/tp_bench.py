"""Tensor parallelism on 2 gloo ranks: torchloom's shard + sync against PyTorch DTensor.

The same GPT-2-like model (token and position embeddings, ``--layers`` pre-norm blocks of
causal self-attention with separate ``nn.Linear`` q/k/v/o projections and a GELU MLP, a
final norm and an ``nn.Linear`` head) is trained with SGD on 2 CPU processes in two ways:

* **torchloom**: ``tl.create_schedule`` with Megatron-style primitives. q/k/v and the first
  MLP linear are column-parallel (``shard("weight", 0)``, ``shard("bias", 0)``); the output
  projection and the second MLP linear are row-parallel (``shard("weight", 1)``,
  ``sync("fwd_post", "all_reduce")``). The input gradient of a column-parallel region is
  summed by ``sync("bwd_post", "all_reduce")``, placed on the attention module (one
  all-reduce for q, k and v together) and on the first MLP linear.
* **DTensor**: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel`` on q/k/v/fc1 and ``RowwiseParallel`` on o/fc2, on
  ``DeviceMesh("cpu", [0, 1])``.

Embeddings, norms and the head stay replicated. Both runs must give the losses of a
single-process model on the same batches (within ``1e-5``) for the first
``--check-steps`` steps. Then ``--steps`` steps are timed after ``--warmup`` steps, and
the collectives of one forward and one backward are counted: torchloom's by wrapping
``torch.distributed.all_reduce`` / ``all_gather`` (and, as a cross-check,
``CommDebugMode``), DTensor's with ``CommDebugMode``.

These are CPU / gloo figures (one thread per rank by default): they compare the
communication pattern and framework overhead, not GPU performance.

Usage::

    python benchmarks/tp_bench.py                 # default sizes, about 30-60 s
    python benchmarks/tp_bench.py --json out.json # also write the numbers as JSON

>>> args = parse_args(["--layers", "1", "--steps", "2"])
>>> (args.layers, args.steps, args.hidden)
(1, 2, 256)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
LR = 0.05


# --------------------------------------------------------------------- the model


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o ``nn.Linear`` projections.

    The number of heads is inferred from the (possibly sharded) width of q, so the same
    code runs with a full or a column-parallel projection.
    """

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                           heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with a 4x wider middle."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final norm, linear head."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------- parallelisation


def apply_torchloom_tp(model: TinyGPT) -> None:
    """Megatron-style tensor parallelism with torchloom primitives (default group)."""
    import torchloom as tl

    sch = tl.create_schedule(model)
    for i in range(len(model.blocks)):
        attn, mlp = f"blocks.{i}.attn", f"blocks.{i}.mlp"
        sch[attn].sync("bwd_post", "all_reduce")  # one reduction of dx for q, k and v
        for name in ("q", "k", "v"):
            sch[f"{attn}.{name}"].shard("weight", 0)
            sch[f"{attn}.{name}"].shard("bias", 0)
        sch[f"{attn}.o"].shard("weight", 1)
        sch[f"{attn}.o"].sync("fwd_post", "all_reduce")
        sch[f"{mlp}.fc1"].shard("weight", 0)
        sch[f"{mlp}.fc1"].shard("bias", 0)
        sch[f"{mlp}.fc1"].sync("bwd_post", "all_reduce")
        sch[f"{mlp}.fc2"].shard("weight", 1)
        sch[f"{mlp}.fc2"].sync("fwd_post", "all_reduce")


def apply_dtensor_tp(model: TinyGPT) -> None:
    """The same layout with ``parallelize_module`` (ColwiseParallel / RowwiseParallel)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh("cpu", list(range(WORLD)))
    plan: dict[str, Any] = {}
    for i in range(len(model.blocks)):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


# --------------------------------------------------------------------- measuring


@contextlib.contextmanager
def count_dist_calls() -> Iterator[Counter]:
    """Count calls of ``torch.distributed.all_reduce`` / ``all_gather`` inside the block."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int,
                args: argparse.Namespace) -> float:
    ids, labels = _batch(step, args)
    opt.zero_grad(set_to_none=True)
    loss = _loss(model, ids, labels)
    loss.backward()
    opt.step()
    return loss.item()


def _count_one_step(model: nn.Module, opt: torch.optim.Optimizer, step: int,
                    args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    ids, labels = _batch(step, args)
    opt.zero_grad(set_to_none=True)
    with count_dist_calls() as fwd_calls, CommDebugMode() as fwd_mode:
        loss = _loss(model, ids, labels)
    with count_dist_calls() as bwd_calls, CommDebugMode() as bwd_mode, \
            warnings.catch_warnings():
        # CommDebugMode's module tracker installs full backward hooks on modules whose
        # inputs need no gradient (the embeddings); torch warns about that, harmlessly.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    opt.step()

    def by_op(mode: Any) -> dict[str, int]:
        return {str(op).split(".")[-1]: n for op, n in sorted(
            mode.get_comm_counts().items(), key=lambda kv: str(kv[0]))}

    return {
        "fwd_collectives": fwd_mode.get_total_counts(),
        "bwd_collectives": bwd_mode.get_total_counts(),
        "fwd_by_op": by_op(fwd_mode),
        "bwd_by_op": by_op(bwd_mode),
        "fwd_dist_calls": dict(fwd_calls),
        "bwd_dist_calls": dict(bwd_calls),
    }


def _run(name: str, model: nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = [_train_step(model, opt, step, args) for step in range(args.warmup)]
    dist.barrier()
    start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        losses.append(_train_step(model, opt, step, args))
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
    result = {"name": name, "step_ms": 1000 * elapsed.item() / max(args.steps, 1),
              "losses": losses}
    result.update(_count_one_step(model, opt, args.warmup + args.steps, args))
    return result


def _worker(rank: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        torch.manual_seed(0)
        reference = TinyGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq)
        tl_model, dt_model = copy.deepcopy(reference), copy.deepcopy(reference)

        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        ref_losses = [_train_step(reference, ref_opt, s, args) for s in range(args.check_steps)]

        apply_torchloom_tp(tl_model)
        apply_dtensor_tp(dt_model)
        runs = [_run("torchloom", tl_model, args), _run("dtensor", dt_model, args)]

        n = min(args.check_steps, args.warmup + args.steps)
        for run in runs:
            diffs = [abs(a - b) for a, b in zip(run["losses"][:n], ref_losses[:n])]
            run["max_loss_diff"] = max(diffs) if diffs else 0.0
        if rank == 0:
            result = {
                "machine": {
                    "cpu_count": os.cpu_count(),
                    "threads_per_rank": args.threads,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "backend": "gloo (CPU)",
                    "world_size": WORLD,
                },
                "config": {k: getattr(args, k) for k in (
                    "layers", "hidden", "heads", "seq", "batch", "vocab", "steps", "warmup",
                    "check_steps")},
                "reference_losses": ref_losses,
                "runs": {run["name"]: run for run in runs},
                "loss_tolerance": 1e-5,
                "losses_match": all(run["max_loss_diff"] <= 1e-5 for run in runs),
                "ratio_dtensor_over_torchloom": runs[1]["step_ms"] / runs[0]["step_ms"],
            }
            with open(out_path, "w") as f:
                json.dump(result, f)
        # no rank leaves while a peer still holds a connection to it (a gloo process whose
        # peers left first can abort at exit: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--check-steps", type=int, default=3,
                   help="steps whose losses are compared with a single-process run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % WORLD:
        p.error(f"--hidden must be a multiple of --heads, and --heads of {WORLD}")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report of a result dict."""
    m, c = result["machine"], result["config"]
    lines = [
        f"tensor parallelism, {m['world_size']} ranks, {m['backend']}: CPU figures, "
        f"{m['threads_per_rank']} thread(s) per rank on {m['cpu_count']} CPUs; "
        f"torch {m['torch']}, Python {m['python']}",
        f"model: {c['layers']} blocks, hidden {c['hidden']}, {c['heads']} heads, "
        f"batch {c['batch']} x seq {c['seq']}, vocab {c['vocab']}; "
        f"{c['steps']} timed steps after {c['warmup']} warm-up",
        "",
        f"{'':<11}{'step (ms)':>10}{'fwd coll.':>11}{'bwd coll.':>11}"
        f"{'max |dloss|':>13}  collectives by op (fwd / bwd)",
    ]
    for name, run in result["runs"].items():
        lines.append(
            f"{name:<11}{run['step_ms']:>10.1f}{run['fwd_collectives']:>11}"
            f"{run['bwd_collectives']:>11}{run['max_loss_diff']:>13.2e}  "
            f"{run['fwd_by_op']} / {run['bwd_by_op']}")
    lines += [
        "",
        f"DTensor / torchloom step time: {result['ratio_dtensor_over_torchloom']:.2f}x",
        f"losses equal to the single-process model within {result['loss_tolerance']:g} over "
        f"{c['check_steps']} steps: {'yes' if result['losses_match'] else 'NO'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, return the figures (and write ``--json``)."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(_free_port(), args, out_path), nprocs=WORLD, join=True)
        with open(out_path) as f:
            result = json.load(f)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not result["losses_match"]:
        print("error: a tensor-parallel run does not match the single-process model",
              file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["losses_match"] else 1)
