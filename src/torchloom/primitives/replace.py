"""``replace(new_mod_or_fn)``: swap the module at a schedule node.

``new_mod_or_fn`` is either the new ``nn.Module`` or a *factory*: any other callable,
called as ``factory(old_module)`` and returning the new module. A factory defined at
module level is stored in the recipe by import path, so the recipe stays serialisable.

What carries over from the old module to the new one:

* every hook: forward pre-hooks and forward hooks (with and without kwargs, and the
  "always called" set), backward and backward pre-hooks with the full-backward flag,
  and the state-dict / load-state-dict hooks; the old handles keep working;
* the training/eval mode;
* parameters the new module reuses keep their metadata (shard specs, tags) because
  that metadata lives on the parameter objects;
* ``fork_rng`` and ``checkpoint`` applied to the old module are applied to the new one
  (unless the new module already carries them, e.g. a factory that returns the old
  module inside a wrapper), so a replace never silently drops them.

The parent's attribute (or ``ModuleList``/``Sequential`` slot) is updated and the node's
children are rebuilt from the new module. The node keeps its path.

Subgraph form, ``replace(new, target_ops=matches)`` (``matches`` from ``find`` on a
traced module; ``new`` is an ``nn.Module``, registered in the graph's module as
``<name or class name>_<k>``, or a function, called in the graph):

* **vertical** (one match): ``new`` is called with the match's inputs (the graph values it
  reads, in first-use order) plus ``concrete_args`` as keywords, and its result takes the
  place of the match's result. A match whose other values are also used outside it is
  refused (use ``fuse`` or ``checkpoint(subgraph=...)``, which return them all);
* **horizontal** (several matches in one graph, e.g. the q/k/v projections of the same
  input): ``new`` is called once with the inputs of all matches (deduplicated, in order)
  and must return one value per match, in the order of the matches.

The modules whose calls are replaced stay registered (``state_dict()`` keys do not
change); if they have hooks the replace is refused (the hooks would stop firing).

Preconditions:
    * the new module is an ``nn.Module`` (or the factory returns one);
    * with ``target_ops``: live matches from ``find`` at or below this node; the new
      callable accepts the inputs (else the error says how many it got and suggests
      ``concrete_args``); ``concrete_args`` only with ``target_ops``.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
>>> sch = tl.create_schedule(model)
>>> _ = model[1].register_forward_hook(lambda m, i, o: o * 2)
>>> sch["1"].replace(nn.ReLU())
>>> model
Sequential(
  (0): Linear(in_features=4, out_features=4, bias=True)
  (1): ReLU()
)
>>> model[1](torch.tensor([-1.0, 3.0]))   # the old hook still doubles the output
tensor([0., 6.])

Subgraph form (a traced module; here the ``ReLU`` call becomes a ``torch.tanh`` call):

>>> mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> sch = tl.create_schedule(mlp)
>>> sch.trace(tracer="fx")
>>> sch.replace(torch.tanh, target_ops=sch.find(r"^1$"))
>>> [getattr(n.target, "__name__", n.target) for n in mlp.graph.nodes if n.op != "output"]
['input', '0', 'tanh']
>>> x = torch.randn(2, 4)
>>> torch.equal(mlp(x), torch.tanh(mlp[0](x)))
True
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable

from torch import nn

from ..core.errors import ReplaceError
from ..core.marks import CHECKPOINTED, FORK_RNG, has_mark, transfer_hooks
from ..core.registry import primitive
from ..core.schedule import building_for
from ..graph.subgraph import recorded_matches

if TYPE_CHECKING:
    from ..core.schedule import Schedule, ScheduleGroup

NAME = "replace"

def _make_new(sch: Schedule, new_mod_or_fn: Any) -> nn.Module:
    if isinstance(new_mod_or_fn, nn.Module):
        return new_mod_or_fn
    if not callable(new_mod_or_fn):
        raise ReplaceError(
            f"replace needs an nn.Module or a factory, not a {type(new_mod_or_fn).__name__}",
            path=sch.path,
            primitive=NAME,
            values={"new_mod_or_fn": repr(new_mod_or_fn)[:60]},
            fix=f"sch[{sch.path!r}].replace(MyModule(...)) or .replace(make_my_module)",
        )
    with building_for(sch.group):  # a factory builds its module for this node's group
        new = new_mod_or_fn(sch.mod)
    if not isinstance(new, nn.Module):
        raise ReplaceError(
            f"the factory returned a {type(new).__name__}, not an nn.Module",
            path=sch.path,
            primitive=NAME,
            values={"factory": getattr(new_mod_or_fn, "__qualname__", repr(new_mod_or_fn))},
            fix="make the factory return the new module: def make(old): return New(...)",
        )
    return new


def swap_module(sch: Schedule, new: nn.Module) -> None:
    """Install ``new`` at ``sch`` (hooks, mode, parent slot, children); no checks."""
    old = sch.mod
    if new is old:
        return
    transfer_hooks(old, new)
    new.train(old.training)
    if sch.parent is not None:
        setattr(sch.parent.mod, sch.name, new)
    sch.mod = new
    sch.rebuild_children()
    # fork_rng inside, checkpoint outside: the order checkpoint_forward(fork_rng_forward).
    from . import checkpoint, fork_rng

    if has_mark(old, FORK_RNG) and not has_mark(new, FORK_RNG):
        fork_rng.apply(sch)
    if has_mark(old, CHECKPOINTED) and not has_mark(new, CHECKPOINTED):
        checkpoint.apply(sch)


def _apply_subgraph(sch: Schedule, new: Any, target_ops: Any, name: str | None,
                    concrete_args: dict[str, Any] | None) -> None:
    from ..graph import subgraph

    if not (isinstance(target_ops, (dict, list, tuple)) or
            type(target_ops).__name__ == "Match") or \
            (isinstance(target_ops, (list, tuple)) and
             not all(type(m).__name__ == "Match" for m in target_ops)):
        raise ReplaceError(
            "replacing a subgraph (target_ops) needs a traced module and the Match objects that "
            "find() "
            f"returns, not {subgraph._type_name(target_ops)}",
            path=sch.path, primitive=NAME, values={"target_ops": repr(target_ops)[:80]},
            fix=f"sch[{sch.path!r}].trace(); m = sch[{sch.path!r}].find(pattern); "
            f"sch[{sch.path!r}].replace(new, target_ops=m)",
        )
    if not callable(new):
        raise ReplaceError(
            f"replace needs an nn.Module or a function, not a {type(new).__name__}",
            path=sch.path, primitive=NAME, values={"new_mod_or_fn": repr(new)[:60]},
            fix=f"sch[{sch.path!r}].replace(MyModule(...), target_ops=matches)",
        )
    if name is not None and not isinstance(new, nn.Module):
        raise ReplaceError(
            "name applies to a new module; a function is called in the graph as it is",
            path=sch.path, primitive=NAME, values={"name": name},
            fix="drop the argument, or pass a module",
        )
    matches = subgraph.resolve(sch, target_ops, NAME, ReplaceError)
    subgraph.check_one_graph(sch, matches, NAME, ReplaceError)
    kwargs = dict(concrete_args or {})
    outputs = []
    for m in matches:
        used = m.outputs() or [m.anchor]
        if len(used) > 1:
            raise ReplaceError(
                "values computed inside the subgraph are also used outside it: "
                f"{[n.name for n in used]}; one replacement value cannot stand for them all",
                path=sch.path, primitive=NAME,
                values={"outputs": [n.name for n in used], "match": [n.name for n in m.nodes]},
                fix="extend the pattern to those uses, or use fuse / checkpoint(subgraph=...), "
                "which return every such value",
            )
        outputs.append(used)
    inputs: list[Any] = []
    for m in matches:
        inputs += [n for n in m.inputs if n not in inputs]
    subgraph.check_arity(sch, new, len(inputs), kwargs, NAME, ReplaceError,
                          [n.name for n in inputs])
    subgraph.splice(sch, matches, new, name, NAME, ReplaceError, outputs, kwargs)


def _one_module_per_node(group: ScheduleGroup, bound: inspect.BoundArguments) -> None:
    """A group replace needs a factory: one module instance cannot sit in two places."""
    new = bound.arguments["new_mod_or_fn"]
    if isinstance(new, nn.Module) and len(group) > 1:
        raise ReplaceError(
            f"a group replace needs a factory, one module instance cannot sit at "
            f"{len(group)} places",
            path=group.pattern, primitive=NAME, values={"new_mod_or_fn": type(new).__name__},
            fix="pass a function old_module -> new_module, e.g. "
            "sch['h.*.mlp'].replace(make_fast_mlp)")


@primitive(NAME, errors=(ReplaceError,), record_as={"target_ops": recorded_matches},
           group_check=_one_module_per_node)
def apply(
    sch: Schedule,
    new_mod_or_fn: nn.Module | Callable[[nn.Module], nn.Module],
    target_ops: Any = None,
    name: str | None = None,
    concrete_args: dict[str, Any] | None = None,
) -> None:
    """Replace ``sch.mod`` by ``new_mod_or_fn`` (a module, or a factory of the old one), or
    with ``target_ops`` the matched nodes of a traced graph."""
    if target_ops is not None:
        _apply_subgraph(sch, new_mod_or_fn, target_ops, name, concrete_args)
        return
    if concrete_args is not None:
        raise ReplaceError(
            "concrete_args only applies to subgraph replacement (with target_ops)",
            path=sch.path, primitive=NAME, values={"concrete_args": sorted(concrete_args)},
            fix=f"drop the argument: sch[{sch.path!r}].replace(new_module)",
        )
    if name is not None and name != sch.name:
        raise ReplaceError(
            "a whole-module replace keeps the node's name; 'name' only applies to "
            "subgraph replacement",
            path=sch.path,
            primitive=NAME,
            values={"name": name, "node_name": sch.name},
            fix=f"drop the argument: sch[{sch.path!r}].replace(new_module)",
        )
    swap_module(sch, _make_new(sch, new_mod_or_fn))


__all__ = ["NAME", "apply", "swap_module"]
