"""The automatic schedule of any model with a list of layers: checkpointing and compile.

A model that has neither a built-in schedule nor a transformers tensor-parallel plan (a
user's own ``nn.Module``, karpathy's nanoGPT, a ``nn.TransformerEncoder`` language model)
still has what activation checkpointing and per-layer compilation need: its stacks of
layers, the ``nn.ModuleList`` / ``nn.Sequential`` containers not nested in another one
whose children are all of one class. :func:`schedule_layers` checkpoints the first
``ckpt_ratio`` of each stack and compiles each layer (``compile``), as every built-in
schedule does last (:func:`~torchloom.schedules._common.finish_layers`). It takes no
tensor-parallel knob: sharding a model torchloom knows nothing about is written by hand
(README, "Schedules for any model"). Data parallelism (DDP, FSDP2) needs no schedule:
FSDP2 wraps each layer of these same stacks.

Preconditions: the model has at least one stack of layers (else
:class:`~torchloom.core.errors.NoScheduleError` names the model and the fix).

>>> import torch, torchloom as tl
>>> from torch import nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
...     def forward(self, x):
...         for block in self.blocks:
...             x = torch.relu(block(x))
...         return x
>>> sch = tl.create_schedule(Net())
>>> layer_stack_paths(sch.mod)
['blocks']
>>> schedule_layers(sch, ScheduleConfig(ckpt_ratio=0.5))
>>> print(sch.recipe.entries[0].call_text())
sch['blocks'].checkpoint(ratio=0.5)
"""

from __future__ import annotations

from ..core.errors import NoScheduleError
from ..core.rules import layer_stacks
from ..core.schedule import Schedule
from ._common import finish_layers, takes
from .config import ScheduleConfig

__all__ = ["layer_stack_paths", "schedule_layers"]


layer_stack_paths = layer_stacks
"""The stacks of layers (:func:`torchloom.core.rules.layer_stacks`, under the name this
package has always exported)."""


@takes("ckpt_ratio", "compile")
def schedule_layers(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Checkpoint the first ``config.ckpt_ratio`` of each stack of layers and compile each
    layer (``config.compile``); see the module docstring."""
    stacks = layer_stack_paths(sch.mod)
    if not stacks:
        raise NoScheduleError(
            f"{type(sch.mod).__name__} has no built-in schedule, no transformers "
            "tensor-parallel plan and no stack of layers (a ModuleList or Sequential of two "
            "or more modules of one class) to checkpoint or compile",
            path=sch.path, primitive="schedules.schedule_layers",
            values={"model": type(sch.mod).__name__},
            fix="write the schedule with primitives: sch['path'].checkpoint(), "
            "sch['path'].compile() (README, 'Schedules for any model')")
    for path in stacks:
        finish_layers(sch[path] if path else sch, config)
