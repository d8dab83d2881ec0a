"""Evaluate candidates as ``torchrun`` jobs, one process per rank.

:class:`TorchrunEvaluator` is an evaluator (``evaluate(recipe, point) -> Result``) that
writes the candidate to a JSON spec and runs::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m torchloom.tune.worker SPEC.json RESULT.json

A worker that raises writes the exception as the trial's error before failing. Every rank
joins the default process group (gloo on CPU, NCCL when CUDA is there), makes
the model from an importable factory, replays the recipe (so ``shard`` / ``sync`` use the
world group), and trains it like :class:`~torchloom.tune.TrainEvaluator`. Rank 0 writes
the throughput it measured and the largest peak over the ranks. A job that exits with an
error or runs past ``timeout_s`` is a failed trial; the tuner goes on. Use it when a
candidate needs several processes (tensor parallelism) or should not share the tuner's
process (a crash, a leak).

The model and input factories cross the process boundary by import path, so they must be
module-level functions (``"package.module:function"``, or the function itself).

>>> ev = TorchrunEvaluator("torchloom.schedules.zoo:make_model", "mypackage.data:make_inputs",
...                        nproc=2, make_model_kwargs={"name": "gpt2", "seed": 0})
>>> ev.command("spec.json", "out.json")[1:6]
['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2']
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.errors import TuneError
from ..core.recipe import Recipe, import_ref, ref_of
from ..runtime.collectives import guard_collective
from .evaluate import Result, TrainEvaluator, describe_exception

__all__ = ["TorchrunEvaluator", "main"]


def _ref(fn: str | Callable[..., Any], what: str) -> str:
    if isinstance(fn, str):
        return fn
    ref = ref_of(fn)
    if ref is None:
        raise TuneError(
            f"the {what} factory must be importable to reach a torchrun worker",
            primitive="TorchrunEvaluator",
            values={what: repr(fn)},
            fix="define it at module level and pass it (or 'package.module:function')",
        )
    return ref


class TorchrunEvaluator:
    """Run each candidate as a ``torchrun`` job (see the module docstring).

    Args:
        make_model: ``"module:function"`` (or the function) that builds a fresh model;
            called with ``make_model_kwargs``.
        make_inputs: ``"module:function"`` (or the function), called as
            ``make_inputs(model, point, **make_inputs_kwargs)`` -> dict of forward keyword
            arguments.
        nproc: processes (ranks) per job.
        steps, warmup, memory_limit_bytes, seed: as for
            :class:`~torchloom.tune.TrainEvaluator`.
        timeout_s: a job running longer fails.
        env: extra environment variables of the job (e.g. ``PYTHONPATH``).
    """

    def __init__(
        self,
        make_model: str | Callable[..., Any],
        make_inputs: str | Callable[..., Any],
        nproc: int = 1,
        *,
        make_model_kwargs: Mapping[str, Any] | None = None,
        make_inputs_kwargs: Mapping[str, Any] | None = None,
        steps: int = 3,
        warmup: int = 1,
        memory_limit_bytes: int | None = None,
        seed: int = 0,
        timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.make_model = _ref(make_model, "make_model")
        self.make_inputs = _ref(make_inputs, "make_inputs")
        self.nproc = nproc
        self.make_model_kwargs = dict(make_model_kwargs or {})
        self.make_inputs_kwargs = dict(make_inputs_kwargs or {})
        self.steps = steps
        self.warmup = warmup
        self.memory_limit_bytes = memory_limit_bytes
        self.seed = seed
        self.timeout_s = timeout_s
        self.env = dict(env or {})

    def command(self, spec: str, out: str) -> list[str]:
        """The command line of one job."""
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.nproc), "-m", "torchloom.tune.worker", spec, out]

    def __call__(self, recipe: Recipe, point: Mapping[str, Any]) -> Result:
        """Run the job for ``recipe`` at ``point`` and read its result."""
        with tempfile.TemporaryDirectory(prefix="torchloom-tune-") as tmp:
            spec, out = Path(tmp, "spec.json"), Path(tmp, "result.json")
            spec.write_text(json.dumps({
                "make_model": self.make_model, "make_model_kwargs": self.make_model_kwargs,
                "make_inputs": self.make_inputs, "make_inputs_kwargs": self.make_inputs_kwargs,
                "recipe": recipe.to_json(), "trusted_refs": sorted(recipe.references()),
                "point": dict(point), "steps": self.steps,
                "warmup": self.warmup, "memory_limit_bytes": self.memory_limit_bytes,
                "seed": self.seed,
            }))
            try:
                proc = subprocess.run(self.command(str(spec), str(out)), check=False,
                                      capture_output=True,
                                      text=True, timeout=self.timeout_s,
                                      env={**os.environ, **self.env})
            except subprocess.TimeoutExpired:
                return Result(0.0, None, ok=False, error=f"timed out after {self.timeout_s} s")
            if not out.exists():
                lines = [line for line in (proc.stderr or "").splitlines() if line.strip()]
                detail = next((line for line in reversed(lines) if "Error" in line),
                              lines[-1] if lines else "")
                return Result(0.0, None, ok=False,
                              error=f"torchrun exited with {proc.returncode}: {detail}"[:500])
            data = json.loads(out.read_text())
        return Result(data["throughput"], data["peak_memory_bytes"], data["ok"], data["error"])


def _worker(spec_path: str, out_path: str) -> None:
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "LOCAL_RANK" in os.environ
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank0 = not distributed or dist.get_rank() == 0
    try:
        make_model = import_ref(spec["make_model"])
        make_inputs = import_ref(spec["make_inputs"])

        def model_factory() -> Any:
            return make_model(**spec["make_model_kwargs"])

        def inputs_factory(model: Any, point: Mapping[str, Any]) -> Any:
            return make_inputs(model, point, **spec["make_inputs_kwargs"])

        evaluator = TrainEvaluator(model_factory, inputs_factory, steps=spec["steps"],
                                   warmup=spec["warmup"], seed=spec["seed"])
        # The spec is written by TorchrunEvaluator into its own private temporary folder,
        # and its factories are imported anyway: the references the parent's recipe holds
        # are imported as the factories are; any other reference follows the usual rules.
        trusted = {ref: import_ref(ref) for ref in spec.get("trusted_refs", [])}
        recipe = Recipe.from_json(spec["recipe"], trusted_refs=trusted)
        result = evaluator(recipe, spec["point"])
        peak = result.peak_memory_bytes or 0
        if distributed:
            t = torch.tensor([peak], dtype=torch.int64)
            with guard_collective("all_reduce", "tune"):
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        limit = spec["memory_limit_bytes"]
        ok, error = result.ok, result.error
        if ok and limit is not None and peak > limit:
            ok, error = False, f"out of memory: peak {peak} B > limit {limit} B"
        if rank0:
            Path(out_path).write_text(json.dumps({
                "throughput": result.throughput if ok else 0.0, "peak_memory_bytes": peak,
                "ok": ok, "error": error}))
    except Exception as exc:
        if rank0:  # say why, then fail the job
            Path(out_path).write_text(json.dumps({
                "throughput": 0.0, "peak_memory_bytes": None, "ok": False,
                "error": describe_exception(exc)}))
        raise
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker: ``python -m torchloom.tune.worker SPEC.json RESULT.json``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m torchloom.tune.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    _worker(*args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
