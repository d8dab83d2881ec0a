"""``divide_attrs(names)``: make integer attributes of a module this rank's share.

A module that reads its sizes from attributes (a head count, a width, a split size) keeps
computing with the whole model's sizes after ``shard`` has given each rank a slice of
its weights: ``GPT2Attention.split_size``, ``OPTAttention.num_heads`` or nanoGPT's
``CausalSelfAttention.n_head`` and ``n_embd`` must become the rank's own.
``divide_attrs(["n_head", "n_embd"])`` divides each named attribute of the node's module
by the size of the schedule's group. It is recorded (so a recipe replays it on any
tensor-parallel degree) and, like ``shard``, changes nothing in a world of one.

A module whose forward reads a size from its *input* (nanoGPT's ``B, T, C = x.size()``,
then ``view(B, T, n_head, C // n_head)``) cannot be fixed by attributes: the input's
width is the whole model's. Replace such a module by one that reads the rank's width
from an attribute (README, "Schedules for any model").

Preconditions:
    * each name is a public attribute of the node's module holding an ``int`` (not a
      bool) greater than zero;
    * the group's size divides every value (else a
      :class:`~torchloom.core.errors.DivideAttrsError` names the attribute, its value,
      the group's size and the fix, and nothing is changed).

Before / after (a world of one: nothing to divide, but the call is checked and recorded):

>>> import torch, torchloom as tl
>>> from torch import nn
>>> class Attention(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.qkv = nn.Linear(8, 24)
...         self.n_head = 4
>>> sch = tl.create_schedule(Attention())
>>> sch.divide_attrs(["n_head"])
>>> sch.mod.n_head, sch.recipe[0].call_text()
(4, "sch[''].divide_attrs(['n_head'])")
>>> sch.divide_attrs("qkv")
Traceback (most recent call last):
...
torchloom.core.errors.DivideAttrsError: sch[''].divide_attrs(...): 'qkv' of Attention is a Linear, not an integer size
    values: name='qkv', value='Linear(in_features=8, out_features=24, bias=True)'
    fix: name integer attributes only, e.g. sch[''].divide_attrs(['num_heads'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.errors import DivideAttrsError
from ..core.registry import primitive

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "divide_attrs"


@primitive(NAME, errors=(DivideAttrsError,))
def apply(sch: Schedule, names: str | Sequence[str]) -> None:
    """Divide each attribute of ``names`` of ``sch.mod`` by the group's size."""
    listed = [names] if isinstance(names, str) else list(names) \
        if isinstance(names, (list, tuple)) else None
    if not listed or not all(isinstance(n, str) for n in listed):
        raise DivideAttrsError(
            f"names must be an attribute name or a list of them, not {names!r}"[:200],
            path=sch.path, primitive=NAME, values={"names": repr(names)[:80]},
            fix=f"sch[{sch.path!r}].divide_attrs(['num_heads', 'hidden_size'])")
    module, world = sch.mod, sch.world_size
    kind = type(module).__name__
    values: dict[str, int] = {}
    for name in listed:
        if not name.isidentifier() or name.startswith("_") or not hasattr(module, name):
            raise DivideAttrsError(
                f"{kind} has no public attribute {name!r}", path=sch.path, primitive=NAME,
                values={"name": name, "attributes": sorted(
                    k for k, v in vars(module).items()
                    if isinstance(v, int) and not isinstance(v, bool)
                    and not k.startswith("_"))[:12]},
                fix="name one of the module's integer attributes (listed)")
        value = getattr(module, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DivideAttrsError(
                f"{name!r} of {kind} is a {type(value).__name__}, not an integer size",
                path=sch.path, primitive=NAME,
                values={"name": name, "value": repr(value)[:80]},
                fix=f"name integer attributes only, e.g. sch[{sch.path!r}].divide_attrs("
                "['num_heads'])")
        if value <= 0 or value % world:
            raise DivideAttrsError(
                f"{name}={value} of {kind} does not divide into {world} equal shares",
                path=sch.path, primitive=NAME,
                values={"name": name, "value": value, "group_size": world},
                fix=f"use a group whose size divides {value}, or a model whose {name} is a "
                f"multiple of {world}")
        values[name] = value
    for name, value in values.items():
        setattr(module, name, value // world)
