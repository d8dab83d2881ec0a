"""Parameter bytes per rank of expert parallelism: ep 1, 2, 4, 8 (issue 28).

Each model is transformers' **default config** of its family (no size changed: Mixtral
8x7B, Qwen3-MoE, gpt-oss-120b, DeepSeek-V3), built on the meta device (under
``torch.device("meta")``: shapes only, nothing allocated; ``tl.init_empty_weights``
allocates each tensor for a moment, and one of DeepSeek-V3's stacked expert tensors is
28 GiB). One process plays rank 0 of
an ``ep``-rank world (PyTorch's fake process-group backend) and applies the
``expert_parallel`` primitive to the whole model, as ``torchloom.parallelize`` does from
``Layout(ep=...)``; the bytes are then read off the parameters the rank actually holds
(their local shapes after the primitive), in bf16, split into the experts' and the rest
(attention, router, shared experts, dense layers, embeddings). The ideal is
``rest + experts / ep``; the table says how far the built model is from it (it is exact
when the primitive keeps exactly ``E / ep`` experts per rank and nothing else changes).

    python benchmarks/ep_memory.py [--json out.json] [--families mixtral,qwen3_moe]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch
import torch.distributed as dist
import transformers as T
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchloom as tl
from torchloom.primitives.expert_parallel import experts_modules

#: family -> (config class, model class, label); every config at transformers' defaults
MODELS: dict[str, tuple[Any, Any, str]] = {
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, "Mixtral 8x7B"),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, "Qwen3-MoE (default config)"),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, "gpt-oss-120b"),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, "DeepSeek-V3"),
}
DEGREES = (1, 2, 4, 8)
BYTES = 2  # bf16


def measure(family: str, ep: int) -> dict[str, Any]:
    """Rank 0's parameter bytes (bf16) of ``family``'s default model at ``ep``."""
    config_cls, model_cls, _ = MODELS[family]
    dist.init_process_group("fake", rank=0, world_size=ep, store=FakeStore())
    try:
        with torch.device("meta"):  # init_empty_weights would allocate each tensor briefly
            model = model_cls(config_cls())
        paths = [name for name, _ in experts_modules(model)]
        if not paths:
            raise LookupError(f"expert parallelism finds no experts module in {model_cls.__name__}")
        if ep > 1:
            tl.create_schedule(model).expert_parallel()
        experts = {id(p) for path in paths
                   for p in model.get_submodule(path).parameters()}
        expert_bytes = rest_bytes = 0
        for p in model.parameters():
            if id(p) in experts:
                expert_bytes += p.numel() * BYTES
            else:
                rest_bytes += p.numel() * BYTES
        local = model.get_submodule(paths[0]).num_experts
        return {"family": family, "ep": ep, "experts_modules": len(paths),
                "local_experts": int(local), "expert_gib": expert_bytes / 2**30,
                "rest_gib": rest_bytes / 2**30}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(MODELS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows, missing = [], []
    for family in args.families.split(","):
        try:
            rows.extend(measure(family, ep) for ep in DEGREES)
        except LookupError as err:
            missing.append(f"{family}: {err}")
    print(f"expert parallelism, parameter bytes on rank 0 (bf16), transformers' default "
          f"configs on meta weights, fake process group; torch {torch.__version__}, "
          f"transformers {T.__version__}, {platform.processor() or platform.machine()}")
    print("| model | ep | experts per module on the rank | experts' weights | the rest | "
          "total per rank | vs ep 1 | ideal (rest + experts / ep) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next(r for r in rows if r["family"] == row["family"] and r["ep"] == 1)
        total = row["expert_gib"] + row["rest_gib"]
        ideal = base["rest_gib"] + base["expert_gib"] / row["ep"]
        row["total_gib"], row["ideal_gib"] = total, ideal
        row["vs_ep1"] = total / (base["expert_gib"] + base["rest_gib"])
        print(f"| {MODELS[row['family']][2]} | {row['ep']} | {row['local_experts']} | "
              f"{row['expert_gib']:.2f} GiB | {row['rest_gib']:.2f} GiB | {total:.2f} GiB | "
              f"{row['vs_ep1']:.3f} | {ideal:.2f} GiB |")
    for line in missing:
        print(f"not measured: {line}")
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "not_measured": missing, "torch": torch.__version__,
                       "transformers": T.__version__}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
