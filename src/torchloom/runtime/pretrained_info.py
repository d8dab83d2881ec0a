"""What a Hugging Face folder needs from the original model besides its tensors: its
config, generation config, class name and declared tied keys (:class:`PretrainedInfo`),
read from a model however it was scheduled, traced or wrapped (:func:`describe_model`).

A pipeline build records the whole model's info before splitting it (a stage alone no
longer knows it); :func:`torchloom.save_pretrained` writes it next to the weights.

>>> info = describe_model(nn.Sequential(nn.Linear(2, 2)))
>>> info.class_name, info.config, info.tied
('Sequential', None, {})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.marks import PRETRAINED_INFO, get_mark

__all__ = ["PretrainedInfo", "describe_model", "unwrap"]


@dataclass(frozen=True)
class PretrainedInfo:
    """What a Hugging Face folder needs from the original model besides its tensors.

    Attributes:
        config: the model's config object (anything with ``save_pretrained``), or None.
        generation_config: its generation config when the model can generate, else None.
        class_name: the original model class's name (``architectures`` in config.json).
        tied: transformers' declared tied keys, ``{tied key: key it is tied to}``.
    """

    config: Any = None
    generation_config: Any = None
    class_name: str | None = None
    tied: dict[str, str] = field(default_factory=dict)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a ``DistributedDataParallel`` or ``torch.compile`` wrapper."""
    while True:
        inner = getattr(model, "module", None)
        if type(model).__name__ == "DistributedDataParallel" and isinstance(inner, nn.Module):
            model = inner
            continue
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model = orig
            continue
        return model


def _original_class(model: nn.Module) -> type:
    """The user's class of ``model``, under torchloom's traced classes and FSDP2's."""
    import torch.fx as fx

    from ..graph.graph_module import TracedGraphModule

    skipped: tuple[type, ...] = (TracedGraphModule,)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - FSDP2 ships with torch >= 2.6
        pass
    else:
        skipped += (FSDPModule,)
    for cls in type(model).__mro__:
        if issubclass(cls, skipped) or cls is fx.GraphModule:
            continue
        return cls
    return type(model)


def describe_model(model: nn.Module) -> PretrainedInfo:
    """The :class:`PretrainedInfo` of a (scheduled, traced, wrapped) model.

    >>> describe_model(nn.Linear(2, 2)).class_name
    'Linear'
    """
    model = unwrap(model)
    info = get_mark(model, PRETRAINED_INFO)
    if isinstance(info, PretrainedInfo):
        return info
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        config = None
    generation = None
    can_generate = getattr(model, "can_generate", None)
    if config is not None and callable(can_generate):
        try:
            if can_generate():
                generation = getattr(model, "generation_config", None)
        except Exception:  # noqa: BLE001 - a model that cannot tell cannot generate
            generation = None
    tied = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        tied = getattr(model, "_tied_weights_keys", None)
    tied = {str(k): str(v) for k, v in tied.items()} if isinstance(tied, dict) else {}
    return PretrainedInfo(config=config, generation_config=generation,
                          class_name=_original_class(model).__name__, tied=tied)
