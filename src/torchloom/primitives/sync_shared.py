"""``sync("bwd_post", "all_reduce", shared=True)``: one input-gradient all-reduce for the
column-parallel siblings that read the same tensor.

A column-parallel module computes a per-rank part of its input's gradient; ``sync(
"bwd_post", "all_reduce")`` sums it over the group by passing the input through
:func:`~torchloom.runtime.collectives.copy_to_group` (the identity, whose backward
all-reduces). q_proj, k_proj and v_proj (gate_proj and up_proj) read the *same* tensor,
and autograd sums their parts of its gradient anyway, so one all-reduce of the sum
equals the three (two) all-reduces of the parts, for a third (half) of the traffic.

How, without assuming anything about the parent's forward: the parent module (the
siblings' common parent in the module tree) gets a :class:`SharedInputScope`, opened by a
forward pre-hook and closed by a forward hook (``always_call``), so it lives for one call
of the parent. Within it, the first sibling handed a tensor ``x`` runs
``y = copy_to_group(x)`` and remembers ``(x, y)``; every sibling handed the *same tensor
object* ``x`` in that call gets the same ``y``. Their gradients of ``y`` add up first, and
the backward all-reduces once. The scope holds ``x`` and ``y`` only while the parent's
forward runs (so a tensor's identity cannot be reused under it) and starts empty on
every call: a checkpointed layer's recompute opens its own.

Why it is always correct: ``y`` is ``x`` with a backward that sums over the group, and a
sum of sums is the sum of the parts, whoever shares ``y``. So every way the sharing can
miss (a sibling handed another tensor object, a view such as ``Verify``'s recording hooks
make, a sibling called outside its parent's forward, a parent replaced by a module without
the scope's hooks) only costs one more all-reduce, never a wrong gradient.

>>> import torch
>>> scope = SharedInputScope()
>>> calls = []
>>> def reduce(x):
...     calls.append(1)
...     return x.view_as(x)
>>> x = torch.ones(2)
>>> scope.open()
>>> scope.reduce(x, 0, reduce) is scope.reduce(x, 0, reduce), len(calls)
(True, 1)
>>> _ = scope.reduce(x.clone(), 0, reduce); len(calls)   # another tensor: its own
2
>>> scope.close(); scope.frames
[]
>>> _ = scope.reduce(x, 0, reduce); len(calls)           # no call of the parent open
3
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["SharedInputScope", "SharedReduce", "scope_of"]


class SharedInputScope:
    """The inputs reduced during the running calls of one parent module: a frame per
    call (a list of ``(input, group id, reduced)``), the innermost last."""

    def __init__(self) -> None:
        self.frames: list[list[tuple[torch.Tensor, int, torch.Tensor]]] = []

    def open(self) -> None:
        """A call of the parent starts: a new, empty frame."""
        self.frames.append([])

    def close(self) -> None:
        """The call ends (or raised): drop its frame and the tensors it held."""
        if self.frames:
            self.frames.pop()

    def reduce(self, x: torch.Tensor, group_id: int,
               op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``op(x)`` (a ``copy_to_group``), or the result a sibling got for this very
        tensor over the same group in the current call of the parent."""
        if not self.frames:
            return op(x)
        frame = self.frames[-1]
        for source, gid, reduced in frame:
            if source is x and gid == group_id:
                return reduced
        reduced = op(x)
        frame.append((x, group_id, reduced))
        return reduced


class _Open:
    """The parent's forward pre-hook (an object, so that ``copy.deepcopy`` of the model
    gives the copy a scope of its own, shared by its parent and its siblings)."""

    def __init__(self, scope: SharedInputScope) -> None:
        self.scope = scope

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.scope.open()


class _Close:
    """The parent's forward hook, also called when the forward raises."""

    def __init__(self, scope: SharedInputScope) -> None:
        self.scope = scope

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scope.close()


class SharedReduce:
    """A sibling's ``bwd_post`` op: ``op`` (its ``copy_to_group``) through the scope."""

    def __init__(self, scope: SharedInputScope, group_id: int,
                 op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.scope, self.group_id, self.op = scope, group_id, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.scope.reduce(x, self.group_id, self.op)


def scope_of(parent: nn.Module) -> SharedInputScope:
    """The scope of ``parent``'s calls, installed (two hooks) on first use. Found through
    the hooks themselves, so it follows them through ``replace`` (which moves a module's
    hooks to its replacement) and ``copy.copy``.

    >>> parent = nn.Sequential(nn.Linear(2, 2))
    >>> scope_of(parent) is scope_of(parent), len(parent._forward_pre_hooks)
    (True, 1)
    """
    for hook in parent._forward_pre_hooks.values():
        if isinstance(hook, _Open):
            return hook.scope
    scope = SharedInputScope()
    parent.register_forward_pre_hook(_Open(scope), prepend=True)
    parent.register_forward_hook(_Close(scope), always_call=True)
    return scope
