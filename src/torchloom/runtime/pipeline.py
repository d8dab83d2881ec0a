"""Pipeline parallelism: split a traced model at its ``cut_pipeline_stage`` marks and run
the stages with ``torch.distributed.pipelining`` (``PipelineStage`` and its schedules).

How a model becomes stages:

1. **Flatten.** The root and every traced module on the way to a cut (``trace_until``
   made them graphs) are inlined into one flat graph; the cut modules, and everything off
   the way, stay ``call_module`` nodes, so their hooks, shards and syncs run unchanged.
2. **Assign.** Walking the flat graph in order, every node belongs to the current stage;
   after the ``call_module`` of a cut module the next stage begins.
3. **Liveness.** For each stage, the values it needs that an earlier stage (or the model
   input) produced are its inputs, and the values later stages need are its outputs, so
   a value made in stage 0 and used in stage 3 is passed through stages 1 and 2.
   Values that cross a boundary must be tensors for ``torch.distributed.pipelining`` to
   send them: sizes, flags and other Python values computed on the way (the sequence
   length, a ``None`` mask) are replaced, in the later stages, by the value they had on
   the example micro-batch. Micro-batches therefore all have the example's shape, which
   the pipelining runtime requires anyway. (On torch < 2.13 integer and boolean tensors
   cross as floating point and are cast back, see :mod:`torchloom.runtime.compat`.)
4. **Stages.** Each stage is a ``GraphModule`` over the original modules (same
   parameter objects and names). The last stage returns the model's output; a
   transformers ``ModelOutput`` / dict is reduced to its ``logits`` (or its first tensor)
   for the loss function.

Parameters shared by several stages (GPT-2's ``lm_head`` and ``wte``) stay tied: after
backward their gradients are summed across the stages that hold them, so every copy
takes the same optimizer step. :func:`tied_weights` lists them (which stages share which
parameter, under which names).

A model built under ``init_empty_weights`` (``meta`` weights, nothing allocated) is split
the same way: the example values are then computed on fake tensors (see
:func:`torchloom.graph.tracing.value_mode`), and without ``example_inputs`` the split uses
:func:`torchloom.graph.tracing.dummy_inputs` made from the model's config. Stages are then cut
before any weight exists; ``build`` materialises them.

>>> import torch
>>> from torch import nn
>>> import torchloom as tl
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
>>> sch = tl.create_schedule(model)
>>> sch.trace(example_inputs=(torch.randn(2, 4),))
>>> sch["1"].cut_pipeline_stage()
>>> stages = split_stages(sch, (torch.randn(2, 4),))
>>> [sorted(dict(s.named_parameters())) for s in stages.modules]
[['0.bias', '0.weight'], ['2.bias', '2.weight']]
>>> x = torch.randn(2, 4)
>>> torch.equal(stages.modules[1](*stages.modules[0](x)), model(x))
True
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ..core.marks import (
    KEY_ORDER,
    PIPELINE_CUT,
    PRETRAINED_INFO,
    TIED_KEYS,
    get_mark,
    has_mark,
    set_mark,
)
from .compat import (
    PIPELINE_SENDS_NON_FLOAT,
    from_transport,
    is_non_float,
    tie_zero_grads,
    to_transport,
)
from ..core.outputs import main_tensor
from .collectives import guard_collective
from ..core.errors import BuildError
from ..graph.tracing import (
    _guard_equal,
    _tensors_on_meta,
    dummy_inputs,
    is_guard,
    is_traced,
    on_meta,
    value_mode,
)

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["cut_paths", "split_stages", "Stages", "TiedWeight", "tied_weights",
           "PipelineModel", "build_pipeline", "check_schedule", "local_stage_tensors"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def cut_paths(sch: Schedule) -> list[str]:
    """The paths of the modules after which a stage ends, in tree order."""
    return [path for path, node in sch.root.named_schedules() if has_mark(node.mod, PIPELINE_CUT)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --------------------------------------------------------------------------- flatten


def _bind(sub: fx.GraphModule, args: tuple, kwargs: dict, path: str) -> dict[str, Any]:
    """Map the placeholders of ``sub``'s graph to the values a call passes."""
    values: dict[str, Any] = {}
    positional, kwargs = list(args), dict(kwargs)
    for node in sub.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.target
        if name.startswith("**"):
            values[name] = dict(kwargs)
            kwargs = {}
        elif name.startswith("*"):
            values[name] = tuple(positional)
            positional = []
        elif positional:
            values[name] = positional.pop(0)
        elif name in kwargs:
            values[name] = kwargs.pop(name)
        elif node.args:
            values[name] = node.args[0]  # the default
        else:
            raise BuildError(
                f"cannot inline {path!r}: its input {name!r} is not given",
                path=path, primitive="build", values={"input": name},
                fix="trace the module with the inputs its parent passes (trace_until)",
            )
    return values


def _inline(graph: fx.Graph, gm: fx.GraphModule, prefix: str, inputs: dict[str, Any],
            way: set[str]) -> Any:
    env: dict[fx.Node, Any] = {}

    def arg(a: Any) -> Any:
        return fx.map_arg(a, lambda n: env[n])

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = inputs[node.target]
        elif node.op == "output":
            return arg(node.args[0])
        elif node.op == "call_module":
            path = _join(prefix, node.target)
            sub = gm.get_submodule(node.target)
            if path in way and is_traced(sub):
                bound = _bind(sub, arg(node.args), arg(node.kwargs), path)
                env[node] = _inline(graph, sub, path, bound, way)
            else:
                env[node] = graph.call_module(path, arg(node.args), arg(node.kwargs))
        elif node.op == "get_attr":
            env[node] = graph.get_attr(_join(prefix, node.target))
        else:
            env[node] = graph.create_node(node.op, node.target, arg(node.args), arg(node.kwargs))
    raise AssertionError("graph without output")


def flatten(root: nn.Module, cuts: list[str]) -> fx.GraphModule:
    """One graph of ``root`` with the traced modules on the way to ``cuts`` inlined."""
    way = {".".join(c.split(".")[:i]) for c in cuts for i in range(1, len(c.split(".")))}
    graph = fx.Graph()
    inputs: dict[str, Any] = {}
    for node in root.graph.nodes:
        if node.op == "placeholder":
            default = node.args[0] if node.args else inspect.Parameter.empty
            inputs[node.target] = graph.placeholder(node.target, default_value=default)
    out = _inline(graph, root, "", inputs, way)
    graph.output(out)
    return fx.GraphModule(root, graph)


# --------------------------------------------------------------------------- split


@dataclass
class Stages:
    """The stage modules of a split model and what crosses between them."""

    modules: list[fx.GraphModule]
    inputs: list[list[str]] = field(default_factory=list)
    """Per stage, the names of the values it receives (stage 0: the model inputs)."""
    ties: list[list[tuple[int, str]]] = field(default_factory=list)
    """Parameters held by several stages: ``[(stage, name), ...]`` per shared parameter."""
    folded: list[list[str]] = field(default_factory=list)
    """Per stage, the non-tensor values from earlier stages it uses as example constants."""
    cuts: list[str] = field(default_factory=list)
    flat: fx.GraphModule | None = None


class _Recorder(fx.Interpreter):
    """Runs a graph on named inputs and keeps every node's value."""

    def __init__(self, gm: fx.GraphModule, inputs: dict[str, Any]) -> None:
        super().__init__(gm)
        self.inputs = inputs
        self.values: dict[fx.Node, Any] = {}

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.inputs[target]

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n] = value
        return value


def _pack(*items: Any) -> tuple:
    return tuple(items)


def _unpack_crossing_tuples(flat: fx.GraphModule, values: dict[fx.Node, Any],
                            stage_of: dict[fx.Node, int]) -> bool:
    """A tuple of tensors used by a later stage (Llama's rotary ``(cos, sin)``) cannot be
    sent whole: take its items apart in its own stage and rebuild it where it is used."""
    import operator

    changed = False
    for node in list(flat.graph.nodes):
        value = values.get(node)
        if not (isinstance(value, tuple) and value and
                all(isinstance(v, torch.Tensor) for v in value)):
            continue
        later = [u for u in node.users if stage_of.get(u, -1) > stage_of[node]]
        if not later:
            continue
        with flat.graph.inserting_after(node):
            items = []
            for i in reversed(range(len(value))):
                item = flat.graph.call_function(operator.getitem, (node, i))
                values[item] = value[i]
                items.insert(0, item)
        for user in later:
            with flat.graph.inserting_before(user):
                packed = flat.graph.call_function(_pack, tuple(items))
            values[packed] = value
            user.replace_input_with(node, packed)
        changed = True
    if changed:
        flat.recompile()
    return changed


def _example(sch: Schedule, example_inputs: tuple | dict | None) -> tuple | dict:
    if example_inputs is not None:
        return example_inputs
    made = dummy_inputs(sch.root.mod)
    if made is None:
        raise BuildError(
            "no example micro-batch: the model has no config to make dummy inputs from",
            path="", primitive="build", values={"model": type(sch.root.mod).__name__},
            fix="pass one micro-batch: example_inputs=(micro_batch_input_ids,)",
        )
    return made


def split_stages(sch: Schedule, example_inputs: tuple | dict | None = None) -> Stages:
    """Split the model of ``sch`` at its cut marks (see the module docstring).

    ``example_inputs`` is one micro-batch (a tuple of positional inputs or a dict of
    keyword inputs); None: :func:`torchloom.graph.tracing.dummy_inputs` of a transformers model.
    On a model with ``meta`` weights the example values are fake tensors.
    """
    example_inputs = _example(sch, example_inputs)
    root = sch.root
    cuts = cut_paths(root)
    if not cuts:
        raise BuildError(
            "no pipeline stage is cut", path="", primitive="build", values={"cuts": []},
            fix="mark where stages end: sch.trace_until('transformer.h.*'); "
            "sch['transformer.h.1'].cut_pipeline_stage()",
        )
    if not is_traced(root.mod):
        raise BuildError(
            "the root is not traced, so the stages cannot be cut out of its graph",
            path="", primitive="build", values={"cuts": cuts},
            fix=f"sch.trace_until({cuts!r}) before cutting",
        )
    flat = flatten(root.mod, cuts)
    args, kwargs = (((), dict(example_inputs)) if isinstance(example_inputs, dict)
                    else (tuple(example_inputs), {}))
    placeholders = [n for n in flat.graph.nodes if n.op == "placeholder"]
    mode = value_mode(root.mod, (args, kwargs))

    def record(args: tuple, kwargs: dict) -> _Recorder:
        recorder = _Recorder(flat, _bind(flat, args, kwargs, ""))
        recorder.run()
        return recorder

    # meta weights: every value is a meta (or fake) tensor, nothing is allocated
    with torch.no_grad(), _tensors_on_meta(root.mod, mode is not None):
        recorder = record(args, kwargs) if mode is None else \
            on_meta(mode, record, args, kwargs)
    values = recorder.values

    def assign() -> tuple[dict[fx.Node, int], list[str]]:
        stage_of: dict[fx.Node, int] = {}
        stage, found = 0, []
        for node in flat.graph.nodes:
            stage_of[node] = stage
            if node.op == "call_module" and node.target in cuts:
                found.append(node.target)
                stage += 1
        return stage_of, found

    stage_of, found = assign()
    if _unpack_crossing_tuples(flat, values, stage_of):
        stage_of, found = assign()
    stage = max(stage_of.values())
    missing = [c for c in cuts if c not in found]
    if missing:
        raise BuildError(
            "these cut modules are not called by the traced model, so no stage ends there",
            path=missing[0], primitive="build", values={"cuts": missing},
            fix="cut at modules the model calls (e.g. its layers), after trace_until",
        )
    num_stages = stage + 1
    output_node = next(n for n in flat.graph.nodes if n.op == "output")
    stage_of[output_node] = num_stages - 1
    if any(stage_of[n] == num_stages - 1 for n in flat.graph.nodes if n.op != "output") is False:
        raise BuildError(
            "the last cut is after the model's last module: the last stage would be empty",
            path=cuts[-1], primitive="build", values={"cuts": cuts},
            fix="remove the last cut_pipeline_stage()",
        )

    # Which values each stage needs from before it (placeholders count as stage -1).
    def origin(n: fx.Node) -> int:
        return -1 if n.op == "placeholder" else stage_of[n]

    needs: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for node in flat.graph.nodes:
        for used in node.all_input_nodes:
            if origin(used) < stage_of[node] and used not in needs[stage_of[node]]:
                needs[stage_of[node]].append(used)

    def crosses(n: fx.Node) -> bool:
        return isinstance(values.get(n), torch.Tensor)

    # live[k]: tensors stage k receives; non-tensors are folded to their example values.
    live: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for k in range(num_stages - 1, 0, -1):
        later = live[k + 1] if k + 1 < num_stages else []
        wanted = [n for n in needs[k] if crosses(n)] + [
            n for n in later if origin(n) < k and n not in needs[k]]
        live[k] = list(dict.fromkeys(wanted))
    for k in range(1, num_stages):
        for n in needs[k]:
            if not crosses(n) and isinstance(values.get(n), (tuple, list)) and \
                    any(isinstance(v, torch.Tensor) for v in values[n]):
                raise BuildError(
                    f"a tuple with tensors ({n.name}) crosses into stage {k}; only tensors can "
                    "be sent between stages",
                    path=cuts[k - 1], primitive="build", values={"value": n.name},
                    fix="cut after a module that returns a tensor (a whole layer)",
                )

    modules, inputs, folded = [], [], []
    for k in range(num_stages):
        folded.append([n.name for n in needs[k] if not crosses(n)])
        graph = fx.Graph()
        env: dict[fx.Node, Any] = {}
        if k == 0:
            for p in placeholders:
                default = p.args[0] if p.args else inspect.Parameter.empty
                env[p] = graph.placeholder(p.target, default_value=default)
            inputs.append([p.target for p in placeholders])
        sent: list[fx.Node] = []  # non-float inputs received as float (torch < 2.13)
        if k > 0:
            for n in live[k]:
                env[n] = graph.placeholder(n.name)
                if not PIPELINE_SENDS_NON_FLOAT and is_non_float(values.get(n)):
                    sent.append(env[n])
                    env[n] = graph.call_function(from_transport, (env[n], values[n].dtype))
            inputs.append([n.name for n in live[k]])

        def arg(a: Any, env: dict = env) -> Any:
            return fx.map_arg(a, lambda n: env[n] if n in env else values[n])

        later_folded = {n for j in range(k + 1, num_stages) for n in needs[j] if not crosses(n)}
        for node in flat.graph.nodes:
            if stage_of[node] != k or node.op == "placeholder":
                continue
            if node.op == "output":
                continue
            env[node] = graph.create_node(node.op, node.target, arg(node.args), arg(node.kwargs),
                                          name=node.name)
            if node in later_folded:
                # A later stage uses this value as a constant: check here, at run time,
                # that it still has its example value (else a guard error, never a
                # silently wrong result).
                graph.call_function(_guard_equal, (env[node], values[node],
                                                   f"{node.name}|crosses a pipeline cut"))
        if k == num_stages - 1:
            result = graph.call_function(main_tensor, (arg(output_node.args[0]),))
            if sent:
                result = graph.call_function(tie_zero_grads, (result, *sent))
            graph.output(result)
        else:
            outs = [env[n] if n in env else arg(n) for n in live[k + 1]]
            if not PIPELINE_SENDS_NON_FLOAT:
                outs = [graph.call_function(to_transport, (o,)) if is_non_float(values.get(n))
                        else o for n, o in zip(live[k + 1], outs)]
                first_float = next((i for i, n in enumerate(live[k + 1])
                                    if isinstance(values.get(n), torch.Tensor)
                                    and values[n].is_floating_point()), None)
                if sent and first_float is not None:
                    outs[first_float] = graph.call_function(
                        tie_zero_grads, (outs[first_float], *sent))
            graph.output(tuple(outs))
        module = fx.GraphModule(flat, graph)
        # keep the tracer's guards: they check, at run time, that the inputs take the
        # path the graph was traced for
        module.graph.eliminate_dead_code(is_impure_node=lambda n: is_guard(n) or n.is_impure())
        module.delete_all_unused_submodules()
        module.recompile()
        modules.append(module)

    owners: dict[int, list[tuple[int, str]]] = {}
    for k, module in enumerate(modules):
        for name, param in module.named_parameters(remove_duplicate=False):
            owners.setdefault(id(param), [])
            if all(s != k for s, _ in owners[id(param)]):
                owners[id(param)].append((k, name))
    ties = [places for places in owners.values() if len(places) > 1]
    return Stages(modules=modules, inputs=inputs, ties=ties, folded=folded, cuts=cuts, flat=flat)


@dataclass(frozen=True)
class TiedWeight:
    """One parameter that several pipeline stages use (and so hold a copy of).

    Attributes:
        names: every name of the parameter in the model (tied aliases included), in
            ``named_parameters(remove_duplicate=False)`` order, e.g.
            ``('transformer.wte.weight', 'lm_head.weight')``.
        stages: the stages that use it, ascending.
        stage_names: for each stage in ``stages``, the parameter's name in that stage's
            module (the path of the module that uses it there).
        shape: its shape (local, as sharded).
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    stage_names: tuple[str, ...]
    shape: tuple[int, ...]


def tied_weights(sch: Schedule, example_inputs: tuple | dict | None = None
                 ) -> list[TiedWeight]:
    """The parameters shared by several pipeline stages of ``sch`` (cut with
    ``cut_pipeline_stage``), in the order the stages first use them.

    A pipelined model keeps one copy of such a parameter in every stage that uses it
    (GPT-2's token embedding, used by the first stage, is the head's weight in the last);
    ``build(target="pipeline")`` sums their gradients across the ranks that hold them after
    each step, so the copies stay equal. A loader or saver uses this to read or write such
    a tensor once. Works on a model with ``meta`` weights (nothing is allocated);
    ``example_inputs`` as for :func:`split_stages`.

    >>> import torch, transformers, torchloom as tl
    >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64)
    >>> with tl.init_empty_weights():
    ...     model = transformers.GPT2LMHeadModel(cfg)
    >>> sch = tl.create_schedule(model)
    >>> sch.trace_until("transformer.h.*")
    >>> sch["transformer.h.0"].cut_pipeline_stage()
    >>> [(t.names, t.stages) for t in tl.pipeline.tied_weights(sch)]
    [(('transformer.wte.weight', 'lm_head.weight'), (0, 1))]
    """
    split = split_stages(sch, example_inputs)
    model = sch.root.mod
    named = list(model.named_parameters(remove_duplicate=False))
    result = []
    for places in split.ties:
        param = split.modules[places[0][0]].get_parameter(places[0][1])
        result.append(TiedWeight(
            names=tuple(n for n, p in named if p is param),
            stages=tuple(k for k, _ in places),
            stage_names=tuple(name for _, name in places),
            shape=tuple(param.shape),
        ))
    return result


def replay_stages(stages: Stages, inputs: tuple | dict) -> list[tuple[Any, Any]]:
    """Run every stage on the exact values the whole (flat) model computes for ``inputs``
    and return, per stage after the first, ``(what the stage computed, what the model
    computed)``: they differ where a stage uses an example constant that does not hold for
    these inputs (what the stage computed is then an exception or other values). Everything
    runs in eval mode (restored afterwards), so dropout draws no masks and the two runs are
    comparable bit for bit."""
    assert stages.flat is not None
    modes = [(m, m.training) for root in (stages.flat, *stages.modules) for m in root.modules()]
    for m, _ in modes:
        m.training = False
    try:
        return _replay(stages, inputs)
    finally:
        for m, training in modes:
            m.training = training


def _replay(stages: Stages, inputs: tuple | dict) -> list[tuple[Any, Any]]:
    assert stages.flat is not None
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    recorder = _Recorder(stages.flat, _bind(stages.flat, args, kwargs, ""))
    with torch.no_grad():
        final = recorder.run()
    by_name = {node.name: value for node, value in recorder.values.items()}
    pairs = []
    for k, module in enumerate(stages.modules):
        if k == 0:
            continue
        try:
            with torch.no_grad():
                got: Any = module(*[by_name[name] for name in stages.inputs[k]])
        except Exception as exc:  # noqa: BLE001 - a stage that cannot run these inputs
            got = exc
        if k + 1 < len(stages.modules):
            expected: Any = tuple(by_name[name] for name in stages.inputs[k + 1])
        else:
            expected = main_tensor(final)
        pairs.append((got, expected))
    return pairs


# --------------------------------------------------------------------------- runtime


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B,
               "Interleaved1F1B": ScheduleInterleaved1F1B}
    if name not in classes:
        raise BuildError(
            f"unknown pipeline schedule {name!r}", primitive="build",
            values={"schedule": name, "schedules": list(classes)},
            fix="build(sch, target='pipeline', schedule='1F1B', ...)",
        )
    return classes[name]


def _single_stage_order(one_f_one_b: bool, num_ranks: int,
                        n_microbatches: int) -> dict[int, list[Any]]:
    """The forward/backward order of GPipe (all forwards, then all backwards) or 1F1B
    (``num_ranks - 1 - rank`` warm-up forwards, alternate, then the remaining backwards)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    order: dict[int, list[Any]] = {}
    for rank in range(num_ranks):
        if not one_f_one_b:
            actions = [_Action(rank, forward, m) for m in range(n_microbatches)]
            actions += [_Action(rank, backward, m) for m in range(n_microbatches)]
        else:
            warmup = min(n_microbatches, num_ranks - 1 - rank)
            actions = [_Action(rank, forward, m) for m in range(warmup)]
            next_f, next_b = warmup, 0
            while next_f < n_microbatches:
                actions += [_Action(rank, forward, next_f), _Action(rank, backward, next_b)]
                next_f, next_b = next_f + 1, next_b + 1
            actions += [_Action(rank, backward, m) for m in range(next_b, n_microbatches)]
        order[rank] = [None] * rank + actions
    return order


def check_schedule(schedule: Any, num_ranks: int, num_stages: int, n_microbatches: int) -> int:
    """Dry-run the schedule's action order with PyTorch's own validator and simulator
    (every rank's forwards and backwards, and the sends and receives between them) and
    return the number of simulated steps; raises :class:`BuildError` on a schedule that
    would deadlock or miss a micro-batch."""
    from torch.distributed.pipelining.schedules import (
        _add_send_recv,
        _ComputationType,
        _simulate_comms_compute,
        _validate_schedule,
    )

    compute = {_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD,
               _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT}
    name = type(schedule).__name__
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        # One stage per rank: these run their own loop, and torch 2.13's
        # Schedule1F1B.pipeline_order starts the last rank at micro-batch 1; check the order
        # the runtime follows instead.
        order = _single_stage_order(name == "Schedule1F1B", num_ranks, n_microbatches)
    else:
        order = getattr(schedule, "pipeline_order", None)
    if order is None:
        raise BuildError("this schedule exposes no action order to check", primitive="build",
                         values={"schedule": type(schedule).__name__},
                         fix="use GPipe, 1F1B or Interleaved1F1B")
    stages_per_rank = num_stages // num_ranks

    def stage_to_rank(stage: int) -> int:
        return stage % num_ranks

    # Only the compute actions (gradient reductions are data-parallel bookkeeping); the
    # validator steps all ranks in lockstep, so idle steps (None) keep their place.
    timed = {rank: [a if a is None or a.computation_type in compute else None for a in actions]
             for rank, actions in order.items()}
    compact = {rank: [a for a in actions if a is not None] for rank, actions in timed.items()}
    try:
        _validate_schedule(timed, num_ranks, num_stages, n_microbatches)
        with_comms = _add_send_recv(compact, stage_to_rank=stage_to_rank, num_stages=num_stages)
        simulated = _simulate_comms_compute(with_comms, stage_to_rank, num_stages)
    except Exception as exc:  # noqa: BLE001 - the validators raise plain errors
        raise BuildError(
            f"the pipeline schedule does not validate: {exc}", primitive="build",
            values={"schedule": type(schedule).__name__, "stages_per_rank": stages_per_rank,
                    "n_microbatches": n_microbatches},
            fix="check the number of micro-batches (at least the number of stages) and cuts",
        ) from exc
    return max(len(actions) for actions in simulated.values())


def _mirror_into(dst: nn.Module, src: nn.Module, path: str, source: nn.Module | None) -> None:
    """Put the modules and tensors of a stage module ``src`` into ``dst`` at their original
    paths. fx gives a stage module an empty ``nn.Module`` for each path component on the
    way to a module or tensor the graph uses; here those become containers of ``dst``
    (shared by the stages of this rank), the original modules are inserted as they are."""
    for name, param in src._parameters.items():
        if param is not None:
            _put(dst, name, param, path, persistent=True)
    for name, buf in src._buffers.items():
        if buf is not None:
            persistent = name not in src._non_persistent_buffers_set and \
                _persistent_in(source, path, name)
            _put(dst, name, buf, path, persistent=persistent)
    for name, child in src._modules.items():
        if child is None:
            continue
        here = dst._modules.get(name)
        sub = _join(path, name)
        if type(child) is nn.Module:  # a container fx made
            if here is None:
                here = nn.Module()
                _add(dst, name, here, sub)
            if type(here) is nn.Module:
                _mirror_into(here, child, sub, source)
            else:
                _check_inside(here, child, sub)
        elif here is None:
            _add(dst, name, child, sub)
        elif here is not child:
            if type(here) is not nn.Module:
                raise BuildError(
                    f"two stages hold different modules at {sub!r}", path=sub,
                    primitive="build", values={"modules": [type(here).__name__,
                                                           type(child).__name__]},
                    fix="cut the model at module boundaries of the original tree")
            _check_inside(child, here, sub)  # the module replaces the container made earlier
            dst._modules[name] = child


def _persistent_in(source: nn.Module | None, path: str, name: str) -> bool:
    """Whether ``path.name`` is a persistent buffer of the original model (a tensor fx put
    on a container may be a non-persistent buffer or a traced constant)."""
    if source is None:
        return True
    try:
        owner = source.get_submodule(path) if path else source
    except AttributeError:
        return False
    return name in owner._buffers and name not in owner._non_persistent_buffers_set


def _add(dst: nn.Module, name: str, module: nn.Module, path: str) -> None:
    try:
        dst.add_module(name, module)
    except KeyError as exc:
        raise BuildError(
            f"the model's {path!r} clashes with an attribute of the pipeline model",
            path=path, primitive="build", values={"name": name},
            fix="rename that sub-module of the model") from exc


def _put(dst: nn.Module, name: str, tensor: torch.Tensor, path: str, persistent: bool) -> None:
    here = dst._parameters.get(name, dst._buffers.get(name))
    if here is tensor:
        return
    where = _join(path, name)
    if here is not None:
        raise BuildError(f"two stages hold different tensors under {where!r}", path=path,
                         primitive="build", values={"key": where},
                         fix="cut the model at module boundaries of the original tree")
    try:
        if isinstance(tensor, nn.Parameter):
            dst.register_parameter(name, tensor)
        else:
            dst.register_buffer(name, tensor, persistent=persistent)
    except KeyError as exc:
        raise BuildError(
            f"the model's tensor {where!r} clashes with an attribute of the pipeline model",
            path=path, primitive="build", values={"key": where},
            fix="rename that tensor of the model") from exc


def _check_inside(real: nn.Module, container: nn.Module, path: str) -> None:
    """Every tensor of ``container`` is the same tensor at the same name in ``real``."""
    mine = dict(real.named_parameters(remove_duplicate=False))
    mine.update(real.named_buffers(remove_duplicate=False))
    for name, tensor in [*container.named_parameters(remove_duplicate=False),
                         *container.named_buffers(remove_duplicate=False)]:
        if mine.get(name) is not tensor:
            raise BuildError(
                f"two stages hold different tensors under {_join(path, name)!r}", path=path,
                primitive="build", values={"key": _join(path, name)},
                fix="cut the model at module boundaries of the original tree")


class PipelineModel(nn.Module):
    """This rank's part of a pipelined model and the schedule that runs it.

    ``step(*inputs, target=None)`` runs one training step over ``n_microbatches``
    micro-batches: every rank passes the same full-batch inputs (only the first stage uses
    them) and target (only the last stage uses it). It returns the mean loss over the
    micro-batches on the rank holding the last stage, None elsewhere, and leaves in every
    local parameter's ``.grad`` the gradient of the full-batch mean loss.

    It is an ``nn.Module`` whose tree holds this rank's stage modules under their original
    paths, so ``state_dict()`` has the original model's keys, for the tensors of this
    rank's stages only, and ``parameters()``, ``named_parameters()``, ``load_state_dict``
    and ``train()`` / ``eval()`` work as on the model (a weight tied across stages, GPT-2's
    ``transformer.wte.weight`` / ``lm_head.weight``, is under its key on each rank that
    uses it; ``step`` keeps the copies equal). On top of that:

    * ``pipe(*inputs)``: an evaluation forward (no backward; under ``torch.no_grad``):
      the full batch (``n_microbatches`` micro-batches of the example's shape, as for
      ``step``) runs through the stages; the last stage's output (the logits), the
      micro-batches concatenated, is returned on the rank holding the last stage, None
      on the others (broadcast it yourself if every rank needs it). Dropout follows the
      module mode: call ``pipe.eval()`` first for deterministic outputs.
    * ``pipe.full_state_dict()`` (and ``torchloom.full_state_dict(pipe)``): the whole
      original state dict on every rank, gathered over the pipeline (and tensor-parallel)
      ranks; a collective of the default process group.
    * ``torchloom.save`` / ``torchloom.load``: each rank writes and reads its own stages'
      tensors; the checkpoint holds the whole model under the original keys, so it loads
      into the same layout or into the unpipelined model.
    * ``torchloom.save_pretrained(pipe, path)``: a Hugging Face folder of the whole model.
    """

    def __init__(self, stage_modules: list[nn.Module], stages: list[Any], schedule: Any,
                 ties: list[tuple[nn.Parameter, Any]], last: bool, simulated_steps: int, *,
                 split: Stages | None = None, source: nn.Module | None = None,
                 group: Any = None) -> None:
        super().__init__()
        self.stage_modules = stage_modules
        self.stages = stages
        self.schedule = schedule
        self.ties = ties
        self.is_last = last
        self.simulated_steps = simulated_steps
        self.pp_group = group
        for module in stage_modules:
            _mirror_into(self, module, "", source)
        everything = split.modules if split is not None else stage_modules
        whole = nn.Module()
        for module in everything:
            _mirror_into(whole, module, "", source)
        #: every key of the whole model, in stage order (read by save_pretrained and load)
        set_mark(self, KEY_ORDER, list(whole.state_dict().keys()))
        #: keys of one parameter held by several stages (tied weights)
        set_mark(self, TIED_KEYS, [list(dict.fromkeys(name for _, name in places))
                                   for places in (split.ties if split is not None else [])])
        if source is not None:
            from .pretrained import describe_model

            set_mark(self, PRETRAINED_INFO, describe_model(source))

    @property
    def stage_module(self) -> nn.Module:
        """The (first) stage module this rank holds."""
        return self.stage_modules[0]

    def all_state_dict_keys(self) -> list[str]:
        """The state-dict keys of the whole model (every stage's), in stage order."""
        return list(get_mark(self, KEY_ORDER))

    def train(self, mode: bool = True) -> PipelineModel:
        super().train(mode)
        for module in self.stage_modules:
            module.train(mode)
        return self

    def full_state_dict(self, group: Any = None) -> dict[str, torch.Tensor]:
        """The whole original state dict on every rank (see the class docstring); ``group``
        is the tensor-parallel group the stages were scheduled with."""
        from .pretrained import gather_full_state_dict

        return gather_full_state_dict(self, group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Evaluation forward (see the class docstring): the last stage's output on the
        rank holding it, None elsewhere."""
        loss_fn = getattr(self.schedule, "_loss_fn", None)
        try:
            # the runtime computes the loss whenever it has a loss function, and there is
            # no target here; eval() already skips the backward
            if loss_fn is not None:
                self.schedule._loss_fn = None
            with torch.no_grad():
                out = (self.schedule.eval(*inputs, **kwargs) if self._takes_inputs()
                       else self.schedule.eval())
        finally:
            if loss_fn is not None:
                self.schedule._loss_fn = loss_fn
        return out if self.is_last else None

    def _takes_inputs(self) -> bool:
        """Whether this rank hands the inputs to its schedule: not when its only stage is
        not the first (torch 2.11's shape inference refuses them there; later releases
        ignore them)."""
        return len(self.stages) != 1 or self.stages[0].is_first

    def step(self, *inputs: Any, target: torch.Tensor | None = None) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        inputs = inputs if self._takes_inputs() else ()
        if self.is_last:
            self.schedule.step(*inputs, target=target, losses=losses)
        else:
            self.schedule.step(*inputs)
        for param, group in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            with guard_collective("all_reduce", "build", group,
                                  fix="call pipe.step(...) on every rank of the pipeline"):
                dist.all_reduce(param.grad, group=group)
        if self.is_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return None


def _check_pipeline_args(example_inputs: Any, loss_fn: Any) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise BuildError(
            "a pipeline runs its stages on several ranks and needs a process group",
            primitive="build", values={"target": "pipeline"},
            fix="torchrun --nproc-per-node N ... (one rank per stage), or "
            "torch.distributed.init_process_group first",
        )
    if example_inputs is None:
        raise BuildError(
            "a pipeline needs an example micro-batch to size what crosses between stages",
            primitive="build", values={"example_inputs": None},
            fix="build(sch, target='pipeline', example_inputs=(micro_batch_input_ids,), ...)",
        )
    if loss_fn is None:
        raise BuildError("a pipeline trains with a loss computed on the last stage",
                         primitive="build", values={"loss_fn": None},
                         fix="build(sch, target='pipeline', loss_fn=lambda logits, target: ...)")


def stages_per_rank(schedule: str) -> int:
    """How many stages each pipeline rank runs under ``schedule`` (the interleaved
    schedule runs two, every other one)."""
    return 2 if schedule == "Interleaved1F1B" else 1


def _my_stages(num_stages: int, schedule: str, group: Any) -> list[int]:
    """The stages this rank runs (stage k on pipeline rank k mod ranks), after checking
    that the schedule has the number of stages the ranks need."""
    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    per_rank = stages_per_rank(schedule)
    if num_stages != ranks * per_rank:
        raise BuildError(
            f"{num_stages} stages for {ranks} pipeline ranks: {schedule} needs "
            f"{per_rank} stage{'s' if per_rank > 1 else ''} per rank",
            primitive="build", values={"stages": num_stages, "ranks": ranks, "schedule": schedule},
            fix=f"cut the model into {ranks * per_rank} stages "
            f"({ranks * per_rank - 1} cut_pipeline_stage() calls)",
        )
    return [k for k in range(num_stages) if k % ranks == rank]


def local_stage_tensors(sch: Schedule, *, schedule: str = "1F1B",
                        example_inputs: tuple | dict | None = None, loss_fn: Any = None,
                        group: Any = None) -> set[int]:
    """The ids of the parameters and buffers that this rank's stages hold, computed on the
    model as it is (``meta`` weights included: the split runs on fake values, nothing is
    allocated). ``build(target="pipeline", weights=PATH)`` materialises only these; the
    tensors of other ranks' stages stay on ``meta``."""
    _check_pipeline_args(example_inputs, loss_fn)
    _schedule_class(schedule)
    split = split_stages(sch, example_inputs)
    mine = _my_stages(len(split.modules), schedule, group)
    ids: set[int] = set()
    for k in mine:
        module = split.modules[k]
        for _, t in [*module.named_parameters(remove_duplicate=False),
                     *module.named_buffers(remove_duplicate=False)]:
            ids.add(id(t))
    return ids


def build_pipeline(sch: Schedule, *, schedule: str = "1F1B", n_microbatches: int = 4,
                   loss_fn: Callable[..., torch.Tensor] | None = None,
                   example_inputs: tuple | dict | None = None, group: Any = None,
                   device: str | torch.device = "cpu") -> PipelineModel:
    """Split, keep this rank's stages, and wrap them in the named schedule (see
    :func:`torchloom.build` with ``target="pipeline"``)."""
    from torch.distributed.pipelining import PipelineStage

    _check_pipeline_args(example_inputs, loss_fn)
    cls = _schedule_class(schedule)
    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    split = split_stages(sch, example_inputs)
    num_stages = len(split.modules)
    per_rank = stages_per_rank(schedule)
    mine = _my_stages(num_stages, schedule, group)
    dev = torch.device(device)
    stages = [PipelineStage(split.modules[k], k, num_stages, dev, group=group) for k in mine]
    runner = cls(stages if per_rank > 1 else stages[0], n_microbatches=n_microbatches,
                 loss_fn=loss_fn)
    simulated = check_schedule(runner, ranks, num_stages, n_microbatches)

    # Parameters held by stages on several ranks: one gradient sum per shared parameter.
    global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(ranks)]
    ties: list[tuple[nn.Parameter, Any]] = []
    for places in split.ties:
        holders = sorted({global_ranks[k % ranks] for k, _ in places})
        if len(holders) < 2:
            continue
        # Only the holders synchronise: with data parallelism every replica runs its own
        # pipeline, so ranks of different replicas ask for groups of different ranks.
        tie_group = dist.new_group(holders, use_local_synchronization=True)
        if global_ranks[rank] in holders:
            k, name = next((k, n) for k, n in places if k in mine)
            ties.append((split.modules[k].get_parameter(name), tie_group))
    return PipelineModel([split.modules[k] for k in mine], stages, runner, ties,
                         last=(num_stages - 1) in mine, simulated_steps=simulated,
                         split=split, source=sch.mod, group=group)
