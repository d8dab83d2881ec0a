"""LoRA fine-tuning in a layout: :class:`LoraSpec` (what ``torchloom train --lora`` and
``torchloom plan --lora`` take), and the step :func:`torchloom.parallelize` runs with it:
the ``lora`` primitive at the model, after its tensor-parallel schedule (the adapters
follow the shards) and before pipeline cuts, checkpointing and compile, then the frozen
base optionally cast to bf16.

>>> spec = parse_lora("r=16,alpha=32,targets=q_proj,v_proj")
>>> spec.r, spec.alpha, spec.targets, spec.dropout
(16, 32.0, ('q_proj', 'v_proj'), 0.0)
>>> spec.text()
'r=16,alpha=32,targets=q_proj,v_proj'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import LoraError
from ..core.meta import copy_meta
from ..core.schedule import Schedule

__all__ = ["BASE_DTYPES", "LoraSpec", "apply_lora", "cast_frozen", "parse_lora"]

BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes the frozen base may be kept in (the adapters always train in fp32)."""
_PRIMITIVE = "lora"
_EXAMPLE = "--lora r=16,alpha=32,targets=q_proj,v_proj"


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters of rank ``r`` scaled by ``alpha / r`` on the linear layers named
    ``targets`` (peft's matching: a module path equal to a target or ending in
    ``"." + target``), with ``dropout`` on their input, initialised from ``seed``; the
    frozen base kept in ``base_dtype``."""

    r: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    seed: int = 0
    base_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.base_dtype not in BASE_DTYPES:
            raise LoraError(f"the base dtype must be one of {sorted(BASE_DTYPES)}, not "
                            f"{self.base_dtype!r}", primitive=_PRIMITIVE,
                            values={"base_dtype": self.base_dtype},
                            fix="--lora-base-dtype bf16 (or fp32, the default)")

    def text(self) -> str:
        """The ``--lora`` form of the spec (``dropout`` / ``seed`` when not the default)."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        out = f"r={self.r},alpha={alpha},targets={','.join(self.targets)}"
        if self.dropout:
            out += f",dropout={self.dropout:g}"
        return out

    def primitive_args(self) -> dict[str, Any]:
        """The ``lora`` primitive's arguments."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return {"r": self.r, "alpha": alpha, "targets": list(self.targets),
                "dropout": self.dropout, "seed": self.seed}


def _bad(text: str, problem: str) -> LoraError:
    return LoraError(f"--lora {text!r}: {problem}", primitive=_PRIMITIVE,
                     values={"lora": text}, fix=_EXAMPLE + " (and optionally ,dropout=0.05)")


def parse_lora(text: str, *, seed: int = 0, base_dtype: str = "fp32") -> LoraSpec:
    """The spec of ``"r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]"`` (keys in any
    order; every name after ``targets=`` up to the next ``key=`` is a target).

    >>> parse_lora("targets=q_proj,k_proj,v_proj,o_proj,r=8,alpha=16,dropout=0.05").targets
    ('q_proj', 'k_proj', 'v_proj', 'o_proj')
    >>> try:
    ...     parse_lora("r=8,alpha=16")
    ... except LoraError as err:
    ...     print(err.problem)
    --lora 'r=8,alpha=16': no targets= (the linear layers to adapt, e.g. targets=q_proj,v_proj)
    """
    if not isinstance(text, str) or len(text) > 4096:
        raise _bad(str(text)[:80], "not a short text")
    values: dict[str, Any] = {}
    key = None
    for item in (part.strip() for part in text.split(",")):
        name, sep, value = item.partition("=")
        if sep:
            key = name.strip()
            if key in values:
                raise _bad(text, f"{key}= given twice")
            if key not in ("r", "alpha", "targets", "dropout"):
                raise _bad(text, f"unknown key {key!r} (keys: r, alpha, targets, dropout)")
            values[key] = [value.strip()] if key == "targets" else value.strip()
        elif key == "targets" and item:
            values["targets"].append(item)
        else:
            raise _bad(text, f"{item!r} is not key=value")
    if "targets" not in values or not all(values["targets"]):
        raise _bad(text, "no targets= (the linear layers to adapt, e.g. targets=q_proj,v_proj)")
    try:
        r = int(values.get("r", 16))
        alpha = float(values.get("alpha", 2 * r))
        dropout = float(values.get("dropout", 0.0))
    except ValueError as exc:
        raise _bad(text, f"a value is not a number ({exc})") from None
    if r < 1 or not math.isfinite(alpha) or alpha <= 0 or not 0 <= dropout < 1:
        raise _bad(text, f"r must be >= 1, alpha > 0 and dropout in [0, 1) (r={r}, "
                         f"alpha={alpha:g}, dropout={dropout:g})")
    return LoraSpec(r=r, alpha=alpha, targets=tuple(values["targets"]), dropout=dropout,
                    seed=seed, base_dtype=base_dtype)


def cast_frozen(root: nn.Module, dtype: torch.dtype) -> int:
    """Cast the frozen floating-point parameters below ``root`` to ``dtype`` (meta ones
    stay on meta: ``build`` then makes them in ``dtype``); tied slots keep one tensor, and
    each keeps its shard spec. Returns how many tensors changed."""
    done: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
                continue
            new = done.get(id(p))
            if new is None:
                new = nn.Parameter(p.detach().to(dtype), requires_grad=False)
                copy_meta(p, new)
                done[id(p)] = new
            module._parameters[name] = new
    return len(done)


def apply_lora(root: Schedule, spec: LoraSpec) -> None:
    """The ``lora`` primitive at ``root`` with ``spec``, then the frozen base cast to
    ``spec.base_dtype``."""
    root.lora(**spec.primitive_args())
    if spec.base_dtype != "fp32":
        cast_frozen(root.mod, BASE_DTYPES[spec.base_dtype])
