"""``checkpoint(ratio=None, policy=None)``: recompute a module's activations in backward.

Without ``ratio``, the module at the node runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)``:
its forward keeps no intermediate activations (only its inputs), and backward runs the
forward again to get them. Positional and keyword arguments are both supported.

With ``ratio`` (a number in [0, 1]) on a node whose module is an ``nn.ModuleList`` or
``nn.Sequential`` of ``n`` items, the first ``floor(ratio * n)`` items are checkpointed, one
by one, as above; ``ratio=0`` checkpoints nothing and ``ratio=1`` every item. The recipe
holds the one ``checkpoint(ratio=...)`` call.

How: an instance attribute ``forward`` is installed on the module, wrapping whatever
``forward`` it had (the class method, or an instance ``forward`` installed earlier, e.g.
by ``fork_rng``). The module is *not* wrapped in a new module, so the module tree, the
``state_dict()`` / ``named_parameters()`` keys and ``print(model)`` are unchanged. Module
hooks (``register_forward_hook`` and friends) run once, outside the checkpointed region,
and are not replayed by the recompute. The module is marked ``CHECKPOINTED`` (:mod:`torchloom.core.marks`).

With ``policy="op"`` (op-level selective checkpointing, the policy of torchtitan's
``--ac op``): the outputs of the expensive operators inside the module (attention kernels,
reduce-scatters, the row maximum, and every other linear-layer product: the first, third,
fifth ... ``mm`` / ``addmm`` of each forward; :data:`SAVED_OPS`) are kept from the
forward, and the rest (the other half of the linear products, element-wise operators,
normalisation) is recomputed: about half a layer's matmul outputs saved, a quarter of its
forward's matmul FLOPs recomputed
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``).

Random numbers: the recompute must draw the same dropout masks as the forward did.
``preserve_rng_state=True`` restores the global CPU and device generators; in addition the
states of :func:`torchloom.runtime.rng.get_rng_tracker` (used by ``fork_rng``) are snapshotted when
the forward runs and installed for the recompute (then put back), so ``checkpoint`` and
``fork_rng`` compose in either order and nesting.

Eval mode and ``torch.no_grad()``: there is no backward to recompute for, so the module
just runs its forward (no checkpoint).

Side effects in the forward run twice (once more in the recompute). A Hugging Face KV
cache passed to a checkpointed layer in training would be extended twice, so a
checkpointed layer in training runs without it, as transformers' own
``GradientCheckpointingLayer`` does: a cache argument (positional or keyword) is replaced
by None and ``use_cache=True`` by False, with one warning per layer class (transformers
models with a default config, ``use_cache=True``, make a cache in training). The output's
cache then lacks the checkpointed layers; pass ``use_cache=False`` to the model to avoid
both. A cache that already holds past positions for the layer would be silently ignored,
so it raises a :class:`~torchloom.core.errors.CheckpointError`. Layers that only read the cache
(``_can_checkpoint_with_cache = True``, a transformers convention) keep it.

With ``subgraph`` (a ``Match`` from ``find`` on a traced module, or a list of them): each
match is cut out of its graph into a ``CheckpointWrapper_<k>`` child that runs it under
checkpoint. Its inputs are the values the match reads; its outputs are every matched value
used outside it (intermediate values included: they are recomputed in backward like the
rest). Modules called inside the match stay registered where they were.

Preconditions:
    * ``ratio`` and ``subgraph`` are not given together; ``subgraph`` holds live matches
      at or below this node;
    * without ``ratio``: the module has a forward of its own (a ``ModuleList`` has none:
      use ``ratio`` or a wildcard path) and was not checkpointed already;
    * with ``ratio``: the module is an ``nn.ModuleList`` or ``nn.Sequential``, ``ratio``
      is a number in [0, 1], and none of the items to checkpoint is checkpointed already.

Before / after (a forward hook on the inner linear counts its calls; the recompute in
backward calls it a second time):

>>> import torch, torchloom as tl
>>> from torch import nn
>>> model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
>>> calls = []
>>> _ = model[0][0].register_forward_hook(lambda m, i, o: calls.append(1))
>>> model(torch.randn(2, 4)).sum().backward(); len(calls)
1
>>> sch = tl.create_schedule(model)
>>> sch["0"].checkpoint()
>>> calls.clear(); model(torch.randn(2, 4)).sum().backward(); len(calls)
2
>>> list(model.state_dict()) == ['0.0.weight', '0.0.bias', '1.weight', '1.bias']
True
>>> blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
>>> sch = tl.create_schedule(blocks)
>>> sch.checkpoint(ratio=0.5)
>>> from torchloom.core.marks import CHECKPOINTED, has_mark
>>> [has_mark(b, CHECKPOINTED) for b in blocks]
[True, True, False, False]
>>> mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
>>> sch = tl.create_schedule(mlp)
>>> sch.trace(tracer="fx")
>>> sch.checkpoint(subgraph=sch.find(lambda x: torch.nn.functional.gelu(x))[0])
>>> [n.target for n in mlp.graph.nodes if n.op == "call_module"]
['0', 'CheckpointWrapper_0', '2']
"""

from __future__ import annotations

import inspect
import numbers
import sys
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ..core.errors import CheckpointError
from ..core.marks import CHECKPOINTED, has_mark, set_mark
from ..core.registry import primitive
from ..core.rules import checkpointed_count
from ..graph.guards import CACHE_FLAG, cache_length, is_cache, layer_index, warn_once
from ..graph.subgraph import GraphHolder, extract, recorded_matches, resolve, splice
from ..runtime.rng import get_rng_tracker
from ._common import ForwardWrapper

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "checkpoint"

__all__ = ["NAME", "apply", "tracker_context_fn", "CheckpointWrapper"]


# --------------------------------------------------------------------------- rng tracker


class _Snapshot:
    """The tracker states taken when a checkpointed forward ran."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, torch.Tensor]] | None = None


class _TakeSnapshot:
    """Forward context: remember the tracker states the forward starts from."""

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot

    def __enter__(self) -> None:
        self.snapshot.states = get_rng_tracker().get_states()

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


class _ReplaySnapshot:
    """Recompute context: run from the snapshot, then put the current states back.

    Re-enterable (a recompute can run more than once with ``retain_graph=True``).
    """

    def __init__(self, snapshot: _Snapshot) -> None:
        self.snapshot = snapshot
        self._saved: list[dict[str, dict[str, torch.Tensor]]] = []

    def __enter__(self) -> None:
        tracker = get_rng_tracker()
        self._saved.append(tracker.get_states())
        if self.snapshot.states is not None:
            tracker.set_states(self.snapshot.states)

    def __exit__(self, *exc: object) -> Literal[False]:
        get_rng_tracker().set_states(self._saved.pop())
        return False


def tracker_context_fn() -> tuple[_TakeSnapshot, _ReplaySnapshot]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` that makes the recompute
    draw from the rng tracker's states as they were when the forward ran."""
    snapshot = _Snapshot()
    return _TakeSnapshot(snapshot), _ReplaySnapshot(snapshot)


POLICIES = ("op",)
"""The ``policy`` values: ``"op"`` (keep :data:`SAVED_OPS`' outputs, recompute the rest)."""


def _ops(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


LINEAR_OPS = _ops("mm", "addmm")
"""The linear layers' products: ``policy="op"`` keeps every other one (the odd ones, counted
from 1 in each forward and, separately, in each recompute)."""


def _saved_ops() -> frozenset[Any]:
    ops = set(LINEAR_OPS) | _ops(
        "bmm", "baddbmm", "max", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm")
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()
"""The operators whose outputs ``policy="op"`` keeps from the forward (of
:data:`LINEAR_OPS`, every other one)."""


def _op_policy() -> Any:
    """A fresh policy for one checkpointed region: it counts the region's linear products
    in the forward and in the recompute separately, so both make the same decisions."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in LINEAR_OPS:
            count[ctx.is_recompute] += 1
            if count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Both:
    """Two context managers entered as one (the rng tracker's and the selective policy's)."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Literal[False]:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
        return False


def op_context_fn() -> tuple[_Both, _Both]:
    """``tracker_context_fn`` with the op-level selective policy (``policy="op"``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    take, replay = tracker_context_fn()
    forward, recompute = create_selective_checkpoint_contexts(_op_policy())
    return _Both(take, forward), _Both(replay, recompute)


def _context_fn(policy: str | None) -> Any:
    return op_context_fn if policy == "op" else tracker_context_fn


# --------------------------------------------------------------------------- the forward


class _CheckpointForward(ForwardWrapper):
    """The instance ``forward`` installed by ``checkpoint``."""

    policy: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):
            return self._run(*args, **kwargs)
        args, kwargs = _without_kv_cache(self, args, kwargs)
        # Keyword arguments travel as extra positional inputs of the checkpoint, so that
        # tensors among them are saved (and seen by device inference) like the others,
        # and names such as "debug" or "context_fn" cannot clash with checkpoint's own.
        n_args, keys = len(args), tuple(kwargs)

        def run(*flat: Any) -> Any:
            return self._run(*flat[:n_args], **dict(zip(keys, flat[n_args:])))

        return _torch_checkpoint(
            run,
            *args,
            *kwargs.values(),
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_context_fn(getattr(self, "policy", None)),
        )

    def __repr__(self) -> str:
        return f"<checkpointed forward of {type(self.module).__name__} at {self.path!r}>"


def _parameter_names(module: nn.Module) -> list[str]:
    """The names of ``forward``'s parameters after ``self``, in order."""
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def _without_kv_cache(fwd: _CheckpointForward, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with a Hugging Face KV cache turned off (training only).

    The recompute in backward would append the layer's keys and values to the cache a
    second time, so the layer runs without it, as under transformers' gradient
    checkpointing (``GradientCheckpointingLayer``): every ``Cache`` argument becomes None
    and ``use_cache=True`` becomes False, with a one-time warning. A cache holding past
    positions for this layer is refused (the layer would ignore them). Layers that only
    read the cache declare ``_can_checkpoint_with_cache = True`` and keep it.
    """
    if sys.modules.get("transformers.cache_utils") is None:
        return args, kwargs
    keep_cache = bool(getattr(fwd.module, "_can_checkpoint_with_cache", False))
    names = _parameter_names(fwd.module)
    changed: list[str] = []

    def drop(position: Any, value: Any) -> Any:
        if keep_cache or not is_cache(value):
            return value
        past = cache_length(value, layer_index(fwd.module))
        if past:
            raise CheckpointError(
                "a checkpointed layer got a KV cache holding past positions in training; "
                "running without the cache would ignore them, and with it the recompute in "
                "backward would write the layer's keys and values a second time",
                path=fwd.path,
                primitive=NAME,
                values={"argument": position, "cache": type(value).__name__,
                        "past_positions": past},
                fix="train without a prefilled cache: model(..., use_cache=False) and no "
                "cache argument, or do not checkpoint this layer",
            )
        if isinstance(position, int):
            position = names[position] if position < len(names) and not \
                names[position].startswith("*") else f"argument {position}"
        changed.append(f"{position}=None")
        return None

    new_args = tuple(drop(i, a) for i, a in enumerate(args))
    new_kwargs = {k: drop(k, v) for k, v in kwargs.items()}
    if new_kwargs.get(CACHE_FLAG) is True:
        new_kwargs[CACHE_FLAG] = False
        changed.append(f"{CACHE_FLAG}=False")
    index = names.index(CACHE_FLAG) if CACHE_FLAG in names else None
    if index is not None and index < len(new_args) and new_args[index] is True:
        new_args = new_args[:index] + (False,) + new_args[index + 1:]
        changed.append(f"{CACHE_FLAG}=False")
    if changed:
        name = type(fwd.module).__name__
        warn_once(
            f"checkpoint|{name}",
            f"caching is incompatible with activation checkpointing in {name} (at "
            f"{fwd.path!r} and the other checkpointed {name} layers): running them in "
            f"training with {', '.join(dict.fromkeys(changed))}, as transformers does under "
            "gradient checkpointing. Pass use_cache=False to the model call to silence this.",
        )
    return new_args, new_kwargs


def _has_forward(mod: nn.Module) -> bool:
    return type(mod).forward is not nn.Module.forward or "forward" in mod.__dict__


def _check_not_checkpointed(node: Schedule, called_at: str, fix: str) -> None:
    if has_mark(node.mod, CHECKPOINTED):
        raise CheckpointError(
            "this module is already checkpointed",
            path=called_at,
            primitive=NAME,
            values={"module": type(node.mod).__name__, "checkpointed_path": node.path},
            fix=fix,
        )


def _install(node: Schedule, policy: str | None = None) -> None:
    mod = node.mod
    wrapper = _CheckpointForward(mod, mod.__dict__.get("forward"), node.path)
    wrapper.policy = policy
    mod.forward = wrapper
    set_mark(mod, CHECKPOINTED, True)


# --------------------------------------------------------------------------- apply


def _item_path(sch: Schedule) -> str:
    return f"{sch.path}.*" if sch.path else "*"


def _apply_whole(sch: Schedule, policy: str | None) -> None:
    if not _has_forward(sch.mod):
        raise CheckpointError(
            f"a {type(sch.mod).__name__} has no forward of its own to checkpoint",
            path=sch.path,
            primitive=NAME,
            values={"module": type(sch.mod).__name__, "items": len(sch.child)},
            fix=f"checkpoint its items: sch[{sch.path!r}].checkpoint(ratio=1.0) or "
            f"sch[{_item_path(sch)!r}].checkpoint()",
        )
    _check_not_checkpointed(
        sch, sch.path, fix=f"checkpoint each module once: remove the second "
        f"sch[{sch.path!r}].checkpoint()"
    )
    _install(sch, policy)


def _apply_ratio(sch: Schedule, ratio: Any, policy: str | None) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or \
            not 0 <= ratio <= 1:  # type: ignore[operator]  # typeshed: int <= Real
        raise CheckpointError(
            "ratio must be a number between 0 and 1 (the share of items to checkpoint)",
            path=sch.path,
            primitive=NAME,
            values={"ratio": ratio},
            fix=f"e.g. sch[{sch.path!r}].checkpoint(ratio=0.5) checkpoints the first half",
        )
    if not isinstance(sch.mod, (nn.ModuleList, nn.Sequential)):
        raise CheckpointError(
            "ratio needs an nn.ModuleList or nn.Sequential of layers to choose from",
            path=sch.path,
            primitive=NAME,
            values={"module": type(sch.mod).__name__, "ratio": ratio},
            fix=f"checkpoint the whole module: sch[{sch.path!r}].checkpoint(), or point "
            "ratio at the layer list, e.g. sch['transformer.h'].checkpoint(ratio=0.5)",
        )
    items = list(sch.child.values())
    count = checkpointed_count(float(ratio), len(items))
    chosen: list[Schedule] = []
    seen: set[int] = set()
    for node in items[:count]:
        if id(node.mod) in seen:  # the same layer in two slots: checkpoint it once
            continue
        seen.add(id(node.mod))
        if not _has_forward(node.mod):
            raise CheckpointError(
                f"item {node.name} is a {type(node.mod).__name__}, which has no forward of "
                "its own to checkpoint",
                path=sch.path,
                primitive=NAME,
                values={"item": node.path, "ratio": ratio},
                fix=f"checkpoint the layers inside it, e.g. sch[{node.path + '.*'!r}].checkpoint()",
            )
        _check_not_checkpointed(
            node, sch.path, fix=f"item {node.name} is checkpointed already: lower the ratio or "
            f"remove the earlier sch[{node.path!r}].checkpoint()"
        )
        chosen.append(node)
    for node in chosen:  # all checks passed: nothing is half-applied on error
        _install(node, policy)


class CheckpointWrapper(GraphHolder):
    """Runs an extracted subgraph under activation checkpointing."""

    keeps_called_modules = True

    def forward(self, *args: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.run_graph(*args)
        return _torch_checkpoint(self.run_graph, *args, use_reentrant=False,
                                 preserve_rng_state=True, context_fn=tracker_context_fn)


def _apply_subgraph(sch: Schedule, subgraph: Any) -> None:
    matches = resolve(sch, subgraph, NAME, CheckpointError)
    for match in matches:  # non-overlapping: each stays valid while the others are cut
        graph_module, _, outputs = extract(match)
        wrapper = CheckpointWrapper(graph_module, len(outputs))
        splice(sch, [match], wrapper, "CheckpointWrapper", NAME, CheckpointError, [outputs])


@primitive(NAME, errors=(CheckpointError,), record_as={"subgraph": recorded_matches})
def apply(sch: Schedule, ratio: float | None = None, subgraph: Any = None,
          policy: str | None = None) -> None:
    """Checkpoint ``sch.mod``, or with ``ratio`` the first ``floor(ratio * n)`` items of
    the ``ModuleList`` / ``Sequential`` at ``sch``, or with ``subgraph`` the matched
    subgraph(s) of its traced graph; ``policy="op"``: op-level selective (see the module
    docstring)."""
    if policy is not None and policy not in POLICIES:
        raise CheckpointError(
            f"unknown checkpoint policy {policy!r}", path=sch.path, primitive=NAME,
            values={"policy": policy, "policies": list(POLICIES)},
            fix=f"sch[{sch.path!r}].checkpoint(policy='op'), or no policy (recompute all)")
    if policy is not None and subgraph is not None:
        raise CheckpointError(
            "policy and subgraph cannot be combined", path=sch.path, primitive=NAME,
            values={"policy": policy}, fix=f"sch[{sch.path!r}].checkpoint(subgraph=matches)")
    if subgraph is not None:
        if ratio is not None:
            raise CheckpointError(
                "ratio and subgraph cannot be combined",
                path=sch.path, primitive=NAME, values={"ratio": ratio},
                fix=f"sch[{sch.path!r}].checkpoint(subgraph=matches) or "
                f"sch[{sch.path!r}].checkpoint(ratio={ratio!r})",
            )
        _apply_subgraph(sch, subgraph)
    elif ratio is None:
        _apply_whole(sch, policy)
    else:
        _apply_ratio(sch, ratio, policy)
