"""LoRA adapters in a model, as the ``lora`` primitive leaves them
(:mod:`torchloom.primitives.lora`): which modules are peft LoRA layers, which parameters
are adapters, what was applied (:class:`LoraState`, the module's
:data:`~torchloom.core.marks.LORA` mark), and the checkpoint key of a tensor under a
wrapped base (``q_proj.base_layer.weight`` is ``q_proj.weight`` in a weights folder).

Everything here reads the model; nothing imports peft.

>>> checkpoint_key("model.layers.0.self_attn.q_proj.base_layer.weight", {"model.layers.0.self_attn.q_proj"})
'model.layers.0.self_attn.q_proj.weight'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.marks import LORA, get_mark

__all__ = ["ADAPTER", "TAG", "LoraState", "adapter_parameters", "base_layer_ids",
           "checkpoint_key", "is_lora_layer", "lora_layer_paths", "lora_state"]

ADAPTER = "default"
"""The adapter name peft gives the one adapter (``lora_A["default"]``)."""
TAG = "lora_adapter"
"""The tag (:func:`~torchloom.core.meta.set_tag`) on every adapter tensor."""


@dataclass(frozen=True)
class LoraState:
    """What ``lora`` did below a module (its :data:`~torchloom.core.marks.LORA` mark)."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float
    seed: int
    layers: tuple[str, ...]
    """The paths (from the marked module) of the layers that got adapters."""
    init: str = "zero_b"
    """How ``B`` started: ``"zero_b"`` (zero) or ``"random"``."""

    @property
    def scaling(self) -> float:
        """The factor of the adapters' output, ``alpha / r``."""
        return self.alpha / self.r


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (a ``base_layer`` and ``lora_A`` adapters)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and \
        isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def base_layer_ids(root: nn.Module) -> set[int]:
    """Ids of the modules below ``root`` that are a LoRA layer's ``base_layer``."""
    return {id(m.base_layer) for m in root.modules() if is_lora_layer(m)}


def lora_layer_paths(root: nn.Module) -> set[str]:
    """The paths of the LoRA layers below ``root``."""
    return {path for path, m in root.named_modules() if is_lora_layer(m)}


def adapter_parameters(root: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters below ``root`` (``lora_A`` / ``lora_B`` weights), once each."""
    seen: dict[int, nn.Parameter] = {}
    for m in root.modules():
        if is_lora_layer(m):
            layer: Any = m
            for adapters in (layer.lora_A, layer.lora_B):
                for sub in adapters.values():
                    for p in sub.parameters():
                        seen.setdefault(id(p), p)
    return list(seen.values())


def lora_state(root: nn.Module) -> tuple[str, LoraState] | None:
    """``(path, state)`` of the module below ``root`` that ``lora`` was applied to, or None."""
    for path, module in root.named_modules():
        state = get_mark(module, LORA)
        if isinstance(state, LoraState):
            return path, state
    return None


def checkpoint_key(key: str, layers: set[str]) -> str:
    """The key ``key`` has in a weights folder: ``X.base_layer.NAME`` of a LoRA layer ``X``
    (one of ``layers``, full paths) is ``X.NAME``; other keys are unchanged."""
    head, sep, tail = key.partition(".base_layer.")
    if sep and head in layers:
        return f"{head}.{tail}"
    return key
