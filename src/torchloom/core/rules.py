"""Rules of a layout that several parts of torchloom apply, written once.

* :func:`checkpointed_count`: how many layers (the first ones) ``checkpoint(ratio=r)``
  wraps, and so what the planner counts as recomputed;
* :func:`even_cuts`: where the default pipeline stage cuts fall;
* :func:`layer_stacks`: which module lists are the model's stacks of layers (what a
  ratio checkpoints, where stages are cut, what FSDP2 shards as units).

>>> checkpointed_count(0.29, 100), checkpointed_count(0.5, 5), checkpointed_count(1, 7)
(29, 2, 7)
>>> even_cuts(8, 2), even_cuts(8, 3), even_cuts(7, 2)
([3], [2, 4], [3])
>>> from torch import nn
>>> model = nn.Module()
>>> model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
>>> model.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
>>> layer_stacks(model)
['layers']
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["checkpointed_count", "even_cuts", "layer_stacks"]


def checkpointed_count(ratio: float, layers: int) -> int:
    """``floor(ratio * layers)``, guarded against float error (``0.29 * 100`` is
    ``28.999999999999996`` in binary floating point, and 29 layers are meant)."""
    return min(layers, math.floor(float(ratio) * layers + 1e-9))


def even_cuts(layers: int, stages: int) -> list[int]:
    """The layers (0-based) after which each of the first ``stages - 1`` stages ends,
    splitting ``layers`` as evenly as possible (stage ``k`` ends after layer
    ``round((k + 1) * layers / stages) - 1``; an even split when ``stages`` divides
    ``layers``)."""
    return [round(k * layers / stages) - 1 for k in range(1, stages)]


def layer_stacks(model: nn.Module) -> list[str]:
    """Paths of the model's stacks of layers: ``nn.ModuleList`` / ``nn.Sequential``
    containers of two or more children, all of one class, not inside another such stack
    (the model itself counts when it is one), in module order."""
    found: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(path == f or path.startswith(f + ".") or f == "" for f in found):
            continue
        if len({type(child) for child in module}) == 1:
            found.append(path)
    return found
