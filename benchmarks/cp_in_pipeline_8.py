"""Context parallelism inside a pipeline at eight ranks, by hand (the test suite's one
8-rank launch is FSDP2 x TP x PP's): ``torchloom train`` of the zoo Llama, 2 steps with
the gradient norm clipped, in two pairs of layouts that see the same batch:

* pp 2 x tp 2 x cp 2 against pp 2 x tp 2 x dp 2;
* pp 2 x FSDP2 2 x cp 2 (sharded over dp_shard x cp) against pp 2 x FSDP2 4.

Each pair's losses must agree within 1e-5 relative. Prints both and exits 1 if not.

    python benchmarks/cp_in_pipeline_8.py     # about a minute on 2 cores

>>> sorted(PAIRS)
['fsdp', 'tp']
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import torch

COMMON: dict[str, Any] = dict(model="llama", steps=2, batch_size=8, seq_len=32,
                              progress=False, pp=2, n_microbatches=2, clip_grad=0.05)
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tp": (dict(tp=2, cp=2), dict(tp=2, dp=2)),
    "fsdp": (dict(cp=2, dp=2, dp_mode="fsdp"), dict(dp=4, dp_mode="fsdp")),
}


def _rank(rank: int, root: str) -> dict[str, list[list[float]]]:
    from torchloom.apps.train import TrainConfig, train_rank

    out: dict[str, list[list[float]]] = {}
    for name, layouts in PAIRS.items():
        out[name] = [train_rank(rank, TrainConfig(**COMMON, **layout,
                                                  save_dir=os.path.join(root, f"{name}{i}")))
                     ["losses"] for i, layout in enumerate(layouts)]
    return out


def main() -> int:
    from torchloom.runtime.launch import raise_first_failure, run_ranks

    root = tempfile.mkdtemp(prefix="cp8-")
    try:
        results = run_ranks(_rank, 8, root, timeout_s=900)
        raise_first_failure(results, command="cp_in_pipeline_8")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = True
    for name, (cp, other) in results[0].items():
        same = torch.allclose(torch.tensor(cp), torch.tensor(other), rtol=1e-5, atol=0)
        ok &= same
        print(f"{name}: with cp {cp}, without {other}: {'equal' if same else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
