"""``sync(mode, sync_op_or_fn, **kwargs)``: add communication at a module boundary.

Modes:

* ``"fwd_pre"``: transform the module's input before forward. The op applies to the
  first tensor among the positional arguments, or to the input ``input_name`` names
  (found whether it is passed by position or by keyword);
  every other positional and keyword argument is passed through unchanged.
* ``"fwd_post"``: transform the module's output after forward. A tensor output is
  transformed; for a tuple/list, its first element; for a dict or transformers
  ``ModelOutput``, its first field.
* ``"bwd_post"``: transform the gradient that leaves the module backwards (the gradient
  of its input), i.e. after the module's backward.
* ``"param_grad"``: all-reduce the gradients of the module's own unsharded parameters
  (a sharded parameter's gradient is already complete on its rank). For
  parameters that every tensor-parallel rank holds whole but uses on a different slice
  of the data (LayerNorm weights and row-parallel biases inside a sequence-parallel
  region), whose gradients are partial sums.

Operations (all differentiable, see :mod:`torchloom.runtime.collectives`):

=====================  =====================  =================================
op                     modes                  keyword arguments
=====================  =====================  =================================
``"all_reduce"``       all four               (none); ``input_name`` for
                                              fwd_pre / bwd_post; ``shared``
                                              for bwd_post
``"all_gather"``       fwd_pre, fwd_post      ``axis`` (required),
                                              ``tensor_parallel_output_grad=True``
``"reduce_scatter"``   fwd_pre, fwd_post      ``axis`` (required)
``"scatter"``          fwd_pre, fwd_post      ``axis`` (required)
a reshard spec         fwd_pre, fwd_post      (none)
a callable             all four               see below
=====================  =====================  =================================

A reshard spec ``"XY->ZW"`` converts the layout of the last two axes of an activation
(``[B, S, H]``: ``S`` and ``H``), each ``R`` (replicated) or ``S`` (sharded):
``"RR->RS"`` / ``"RR->SR"`` keep this rank's slice of the last / second-to-last axis,
``"RS->RR"`` / ``"SR->RR"`` all-gather it, and ``"RS->SR"`` / ``"SR->RS"`` move the
sharded axis (a gather of one axis and a slice of the other). Every reshard is
differentiable: its backward is the inverse layout change.

``axis`` is a dimension of the *activation*, not of the weight. A callable is a hook:
``fn(module, args, kwargs) -> (args, kwargs) | None`` for fwd_pre,
``fn(module, args, output) -> output | None`` for fwd_post, and a full backward hook
``fn(module, grad_input, grad_output) -> grad_input | None`` for bwd_post.

``shared=True`` (``bwd_post`` ``all_reduce`` only, on a module with a parent): the
column-parallel siblings (children of one parent) that all carry it and are handed the
same tensor object in one call of the parent reduce its gradient once, after autograd
has summed their parts: q_proj, k_proj and v_proj cost one all-reduce instead of three.
A sibling handed another tensor, or called outside its parent's forward, reduces its own;
the result is the same either way (:mod:`torchloom.primitives.sync_shared`).

A row-parallel ``nn.Linear`` or transformers ``Conv1D`` (partial output) with an
unsharded bias given ``sync("fwd_post", "all_reduce")`` (or ``"reduce_scatter"``) reduces
the partial products *before* adding the bias, so the bias is counted once (Slapo added it once per rank when the order of primitives
was unlucky; here the shard record lives on the weight, so order does not matter as long
as ``shard`` precedes ``sync``).

Illegal combinations are refused when ``sync`` is called, using the output placement
that :func:`torchloom.core.placement.output_placement` derives from the module's shards: an
all-reduce or reduce-scatter of a *sharded* output, an all-gather of a *partial* output
(or along another axis than the sharded one), a scatter of a sharded or partial output.

Every sync is recorded on the module as a :class:`SyncSpec` as the module's ``SYNCS`` mark (:mod:`torchloom.core.marks`).
With a world of one every collective is the identity.

Preconditions:
    * ``mode`` is one of the four modes and the op is allowed in that mode;
    * gather/scatter ops get an integer ``axis``;
    * unknown keyword arguments are rejected;
    * a module gets each (mode, op) once (per ``input_name``): a second
      ``sync("bwd_post", "all_reduce")`` would sum the gradient twice. User callables
      are not compared (several hooks may be meant).

Before / after (a world of one, so values do not change):

>>> import torch, torchloom as tl
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> sch = tl.create_schedule(model)
>>> sch["0"].sync("bwd_post", "all_reduce")
>>> from torchloom.core.marks import SYNCS, get_mark
>>> [s.describe() for s in get_mark(model[0], SYNCS)]
['bwd_post all_reduce']
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import SyncError
from ..core.marks import SYNCS, get_mark, set_mark
from ..core.meta import shard_spec
from ..core.placement import output_placement
from ..core.registry import primitive
from ..runtime import collectives as C
from .sync_shared import SharedReduce, scope_of

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "sync"

MODES = ("fwd_pre", "fwd_post", "bwd_post", "param_grad")
_AXIS_OPS = ("all_gather", "reduce_scatter", "scatter")
_OPS = ("all_reduce",) + _AXIS_OPS
RESHARD_SPECS = ("RR->RS", "RR->SR", "RS->RR", "SR->RR", "RS->SR", "SR->RS",
                 "RR->RR", "RS->RS", "SR->SR")


def reshard(x: torch.Tensor, spec: str, group: Any = None) -> torch.Tensor:
    """Change the layout of the last two axes of ``x`` as ``spec`` says (differentiable).

    >>> reshard(torch.ones(2, 3, 4), "RS->SR").shape   # a world of one: identity
    torch.Size([2, 3, 4])
    """
    src, dst = spec.split("->")
    if src == dst:
        return x
    if src == "RR":  # keep this rank's slice: -1 for RS, -2 for SR
        return C.scatter(x, -1 if dst == "RS" else -2, group)
    gathered_axis = -1 if src == "RS" else -2
    # Every rank consumes the gathered value the same way, so backward keeps its slice.
    full = C.all_gather(x, gathered_axis, group, tensor_parallel_output_grad=False)
    if dst == "RR":
        return full
    return C.scatter(full, -2 if dst == "SR" else -1, group)


@dataclass(frozen=True)
class SyncSpec:
    """One ``sync`` applied to a module."""

    mode: str
    op: str
    axis: int | None = None
    tensor_parallel_output_grad: bool = True
    input_name: str | None = None
    shared: bool = False

    def describe(self) -> str:
        """A short human-readable form, e.g. ``"fwd_post all_gather(axis=-1)"`` or
        ``"bwd_post all_reduce(shared)"``."""
        extra = f"(axis={self.axis})" if self.axis is not None else ""
        return f"{self.mode} {self.op}{extra}{'(shared)' if self.shared else ''}"


def _op_fn(spec: SyncSpec, group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if spec.op in RESHARD_SPECS:
        return lambda x: reshard(x, spec.op, group)
    if spec.op == "all_reduce":
        if spec.mode == "bwd_post":
            return lambda x: C.copy_to_group(x, group)
        return lambda x: C.all_reduce(x, group)
    assert spec.axis is not None
    axis = spec.axis
    if spec.op == "all_gather":
        return lambda x: C.all_gather(x, axis, group, spec.tensor_parallel_output_grad)
    if spec.op == "reduce_scatter":
        return lambda x: C.reduce_scatter(x, axis, group)
    return lambda x: C.scatter(x, axis, group)


def _at_site(op: Callable[[torch.Tensor], torch.Tensor],
             path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``op`` with its collectives named after the schedule path ``path``, so that a failed
    or timed-out one raises a CollectiveTimeoutError saying which module was in flight."""

    def run(x: torch.Tensor) -> torch.Tensor:
        with C.collective_site(path, NAME):
            return op(x)

    return run


def _input_position(sch: Schedule, input_name: str) -> int | None:
    """Where ``input_name`` sits among the positional parameters of ``sch.mod.forward``."""
    params = list(inspect.signature(sch.mod.forward).parameters.values())
    names = [p.name for p in params]
    if input_name not in names and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise SyncError(
            f"{type(sch.mod).__name__}.forward has no input named {input_name!r}",
            path=sch.path, primitive=NAME, values={"input_name": input_name, "inputs": names},
            fix=f"use one of {', '.join(repr(n) for n in names)}",
        )
    if input_name in names and params[names.index(input_name)].kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return names.index(input_name)
    return None


def _map_input(args: tuple, kwargs: dict, input_name: str | None, position: int | None,
               path: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    if input_name is not None:
        if isinstance(kwargs.get(input_name), torch.Tensor):
            kwargs = dict(kwargs)
            kwargs[input_name] = fn(kwargs[input_name])
            return args, kwargs
        if position is not None and position < len(args) and isinstance(args[position], torch.Tensor):
            return args[:position] + (fn(args[position]),) + args[position + 1:], kwargs
        raise SyncError(
            f"the forward call passed no tensor as {input_name!r}",
            path=path, primitive=NAME,
            values={"input_name": input_name, "num_args": len(args), "kwargs": sorted(kwargs)},
            fix="name the input the module is actually called with",
        )
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return args[:i] + (fn(arg),) + args[i + 1:], kwargs
    for key, value in kwargs.items():  # everything passed by keyword
        if isinstance(value, torch.Tensor):
            kwargs = dict(kwargs)
            kwargs[key] = fn(value)
            return args, kwargs
    return args, kwargs


class _InputHook:
    """The forward pre-hook of a ``fwd_pre`` or ``bwd_post`` sync: ``op`` on the input
    (an object rather than a closure, so that ``copy.deepcopy`` of the model carries a
    shared reduction's scope along consistently with its parent's hooks)."""

    def __init__(self, name: str | None, position: int | None, path: str,
                 op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.name, self.position, self.path, self.op = name, position, path, op

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _map_input(args, kwargs, self.name, self.position, self.path, self.op)


def _map_output(output: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, (tuple, list)) and not hasattr(output, "keys"):
        if not output or not isinstance(output[0], torch.Tensor):
            return output
        items = [fn(output[0]), *output[1:]]
        if hasattr(output, "_fields"):  # a namedtuple
            return type(output)(*items)
        return type(output)(items)
    if hasattr(output, "keys"):  # dict or transformers ModelOutput
        keys = list(output.keys())
        if keys and isinstance(output[keys[0]], torch.Tensor):
            output[keys[0]] = fn(output[keys[0]])
        return output
    return output


class _ReduceThenAddBias:
    """Forward of a row-parallel ``nn.Linear`` / ``Conv1D``: partial product, reduce, then
    the (unsharded) bias once."""

    def __init__(self, module: nn.Module, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module, self.op = module, op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = cast(torch.Tensor, self.module.weight)
        if isinstance(self.module, nn.Linear):
            partial = F.linear(x, weight)
        else:  # Conv1D keeps its weight as (in, out)
            partial = (x.reshape(-1, x.shape[-1]) @ weight).reshape(*x.shape[:-1], weight.shape[-1])
        return self.op(partial) + cast(torch.Tensor, self.module.bias)


def _needs_bias_after_reduction(module: nn.Module) -> bool:
    placement = output_placement(module)
    bias = module._parameters.get("bias")
    return (placement is not None and placement.kind == "partial" and bias is not None
            and shard_spec(bias) is None
            and any(c.__name__ in ("Linear", "Conv1D") for c in type(module).__mro__))


def _install_param_grad_sync(sch: Schedule, op: str) -> None:
    params = [p for p in sch.mod._parameters.values()
              if p is not None and p.requires_grad and shard_spec(p) is None]
    if not params:
        raise SyncError(
            f"{type(sch.mod).__name__} has no replicated parameters of its own whose "
            "gradients could be synchronised",
            path=sch.path, primitive=NAME, values={"mode": "param_grad", "op": op},
            fix="apply it to the modules that hold the parameters, e.g. "
            f"sch[{(sch.path + '.*').lstrip('.')!r}].sync('param_grad', 'all_reduce')",
        )
    group = sch.group
    for param in params:
        # A tensor hook sees this backward's contribution before it is accumulated into
        # .grad, so gradient accumulation over micro-batches stays correct.
        param.register_hook(_at_site(lambda grad: C.all_reduce_raw(grad, group), sch.path))


def _check(sch: Schedule, mode: str, op: Any, kwargs: dict[str, Any]) -> SyncSpec | None:
    if mode not in MODES:
        raise SyncError(
            f"unknown sync mode {mode!r}",
            path=sch.path, primitive=NAME, values={"mode": mode, "modes": list(MODES)},
            fix=f"use one of {', '.join(MODES)}, e.g. sch[{sch.path!r}].sync('fwd_post', "
            "'all_reduce')",
        )
    allowed = {"axis", "tensor_parallel_output_grad", "input_name", "shared"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise SyncError(
            f"unknown keyword argument(s) {', '.join(unknown)}",
            path=sch.path, primitive=NAME, values={"kwargs": sorted(kwargs)},
            fix=f"use only {', '.join(sorted(allowed))}",
        )
    if callable(op):
        if kwargs:
            raise SyncError(
                "a callable sync takes no keyword arguments",
                path=sch.path, primitive=NAME, values={"kwargs": sorted(kwargs)},
                fix="bind them into the callable (functools.partial)",
            )
        return None
    if op not in _OPS and op not in RESHARD_SPECS:
        raise SyncError(
            f"unknown sync operation {op!r}",
            path=sch.path, primitive=NAME, values={"op": op, "ops": list(_OPS)},
            fix=f"use one of {', '.join(_OPS)}, a reshard spec such as 'RS->SR' (last two "
            "axes, R replicated, S sharded), or a callable hook",
        )
    if op in RESHARD_SPECS and kwargs:
        raise SyncError(
            "a reshard spec names its axes itself and takes no keyword arguments",
            path=sch.path, primitive=NAME, values={"op": op, "kwargs": sorted(kwargs)},
            fix=f"sch[{sch.path!r}].sync({mode!r}, {op!r})",
        )
    if mode in ("bwd_post", "param_grad") and op != "all_reduce":
        raise SyncError(
            f"{op!r} is not a backward operation; bwd_post supports 'all_reduce' (gathers and "
            "scatters already carry their matching backward)",
            path=sch.path, primitive=NAME, values={"mode": mode, "op": op},
            fix=f"use sch[{sch.path!r}].sync('fwd_pre', {op!r}, axis=...) whose backward is "
            "the inverse collective, or sync('bwd_post', 'all_reduce')",
        )
    axis = kwargs.get("axis")
    if op in _AXIS_OPS and not isinstance(axis, int):
        raise SyncError(
            f"{op!r} needs the activation axis",
            path=sch.path, primitive=NAME, values={"op": op, "axis": axis},
            fix=f"sch[{sch.path!r}].sync({mode!r}, {op!r}, axis=-1) for the feature axis, "
            "axis=1 for the sequence axis of a (batch, seq, hidden) activation",
        )
    if op == "all_reduce" and axis is not None:
        raise SyncError(
            "'all_reduce' takes no axis",
            path=sch.path, primitive=NAME, values={"op": op, "axis": axis},
            fix=f"sch[{sch.path!r}].sync({mode!r}, 'all_reduce')",
        )
    if "tensor_parallel_output_grad" in kwargs and op != "all_gather":
        raise SyncError(
            "tensor_parallel_output_grad only applies to 'all_gather'",
            path=sch.path, primitive=NAME, values={"op": op},
            fix="drop the argument",
        )
    if mode == "fwd_post":
        _check_output_placement(sch, op, axis)
    shared = kwargs.get("shared", False)
    if "shared" in kwargs:
        _check_shared(sch, mode, op, shared)
    return SyncSpec(mode=mode, op=op, axis=axis,
                    tensor_parallel_output_grad=kwargs.get("tensor_parallel_output_grad", True),
                    input_name=kwargs.get("input_name"), shared=shared)


def _check_shared(sch: Schedule, mode: str, op: str, shared: Any) -> None:
    if not isinstance(shared, bool):
        raise SyncError(
            "shared must be True or False",
            path=sch.path, primitive=NAME, values={"shared": repr(shared)},
            fix=f"sch[{sch.path!r}].sync('bwd_post', 'all_reduce', shared=True)",
        )
    if shared and (mode, op) != ("bwd_post", "all_reduce"):
        raise SyncError(
            "shared=True shares one input-gradient all-reduce between sibling modules; "
            f"it applies to sync('bwd_post', 'all_reduce') only, not {mode} {op}",
            path=sch.path, primitive=NAME, values={"mode": mode, "op": op, "shared": shared},
            fix=f"drop shared=True, or sch[{sch.path!r}].sync('bwd_post', 'all_reduce', "
            "shared=True)",
        )
    if shared and sch.parent is None:
        raise SyncError(
            "shared=True shares the reduction between the children of one parent module, "
            "and this module is the root of the schedule",
            path=sch.path, primitive=NAME, values={"shared": shared},
            fix=f"sch[{sch.path!r}].sync('bwd_post', 'all_reduce') without shared",
        )


def _check_output_placement(sch: Schedule, op: str, axis: int | None) -> None:
    placement = output_placement(sch.mod)
    if placement is None:
        return
    shards = {name: spec.axis for name, p in sch.mod._parameters.items()
              if p is not None and (spec := shard_spec(p)) is not None}
    values = {"op": op, "output": str(placement), "sharded": shards}
    if placement.kind == "shard" and op in ("all_reduce", "reduce_scatter"):
        raise SyncError(
            f"cannot {op} a sharded output: each rank holds a different slice "
            f"(along axis {placement.axis}), summing them mixes features",
            path=sch.path, primitive=NAME, values=values,
            fix=f"gather it instead: sch[{sch.path!r}].sync('fwd_post', 'all_gather', "
            f"axis={placement.axis}), or shard the weight along the other axis",
        )
    if placement.kind == "partial" and op == "all_gather":
        raise SyncError(
            "cannot all_gather a partial output: each rank holds a summand of the whole "
            "value, not a slice",
            path=sch.path, primitive=NAME, values=values,
            fix=f"reduce it: sch[{sch.path!r}].sync('fwd_post', 'all_reduce') (or "
            "'reduce_scatter' with an axis for sequence parallelism)",
        )
    if placement.kind == "shard" and op == "all_gather" and axis is not None and \
            placement.axis is not None and (axis < 0) == (placement.axis < 0) and \
            axis != placement.axis:
        raise SyncError(
            f"the output is sharded along axis {placement.axis}, not {axis}",
            path=sch.path, primitive=NAME, values={**values, "axis": axis},
            fix=f"sch[{sch.path!r}].sync('fwd_post', 'all_gather', axis={placement.axis})",
        )
    if placement.kind != "replicate" and (op == "scatter" or op.startswith("RR->")):
        raise SyncError(
            f"cannot {op} an output that is already {placement}",
            path=sch.path, primitive=NAME, values=values,
            fix="scatter only replicated values; remove this sync or the shard",
        )


def _check_not_twice(sch: Schedule, spec: SyncSpec) -> None:
    """Refuse a second sync of the same mode and operation (and the same input) on one
    module: it would run the collective twice (a gradient summed twice)."""
    for previous in get_mark(sch.mod, SYNCS, []):
        if (previous.mode, previous.op, previous.input_name) != \
                (spec.mode, spec.op, spec.input_name):
            continue
        input_kw = f", input_name={spec.input_name!r}" if spec.input_name is not None else ""
        raise SyncError(
            f"{type(sch.mod).__name__} already has this sync ({previous.describe()}); a "
            "second one would run the collective twice (a sum taken twice is multiplied "
            "by the world size)",
            path=sch.path, primitive=NAME,
            values={"mode": spec.mode, "op": spec.op, "input_name": spec.input_name,
                    "syncs": [s.describe() for s in get_mark(sch.mod, SYNCS)]},
            fix=f"apply sch[{sch.path!r}].sync({spec.mode!r}, {spec.op!r}{input_kw}) once "
            "per module (a built-in schedule may already have added it: print(sch[path]) "
            "lists the syncs); a different input of the same module takes input_name=...",
        )


@primitive(NAME, errors=(SyncError,))
def apply(sch: Schedule, mode: str, sync_op_or_fn: str | Callable[..., Any], **kwargs: Any) -> None:
    """Install the communication described by ``mode`` and ``sync_op_or_fn`` on ``sch.mod``."""
    spec = _check(sch, mode, sync_op_or_fn, kwargs)
    if spec is not None:
        _check_not_twice(sch, spec)
    module = sch.mod
    if spec is None:  # a user hook
        fn = sync_op_or_fn
        assert callable(fn)  # _check returns None for a callable only
        spec = SyncSpec(mode=mode, op=getattr(fn, "__qualname__", "callable"))
        if mode == "fwd_pre":
            module.register_forward_pre_hook(fn, with_kwargs=True)
        elif mode == "fwd_post":
            module.register_forward_hook(fn)
        else:
            module.register_full_backward_hook(fn)
    else:
        op = _at_site(_op_fn(spec, sch.group), sch.path)
        if mode == "param_grad":
            _install_param_grad_sync(sch, spec.op)
        elif mode == "fwd_post" and spec.op in ("all_reduce", "reduce_scatter") and \
                _needs_bias_after_reduction(module):
            if "forward" in module.__dict__:
                raise SyncError(
                    "this row-parallel module must reduce before adding its bias, which "
                    "needs its own forward, but another primitive (checkpoint or fork_rng) "
                    "already wrapped it",
                    path=sch.path, primitive=NAME,
                    values={"op": spec.op, "forward": repr(module.__dict__["forward"])},
                    fix="apply shard and sync first, then checkpoint / fork_rng",
                )
            module.forward = _ReduceThenAddBias(module, op)
        elif mode == "fwd_post":
            module.register_forward_hook(lambda m, args, out: _map_output(out, op))
        else:  # fwd_pre, and bwd_post (an identity whose backward runs the op)
            if spec.shared:
                assert sch.parent is not None  # _check_shared refuses the root
                op = SharedReduce(scope_of(sch.parent.mod), id(sch.group), op)
            name = spec.input_name
            position = _input_position(sch, name) if name is not None else None
            module.register_forward_pre_hook(_InputHook(name, position, sch.path, op),
                                             with_kwargs=True)
    set_mark(module, SYNCS, [*get_mark(module, SYNCS, []), spec])


__all__ = ["NAME", "MODES", "SyncSpec", "apply"]
