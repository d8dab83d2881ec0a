"""Pipeline stages: split a traced model at its ``cut_pipeline_stage`` marks (the stages
run in :mod:`torchloom.runtime.pipeline`).

The model is flattened along the way to the cuts, every node assigned to a stage, the
values that cross a boundary found by liveness (non-tensor values are fixed to the example
micro-batch's), and each stage is a GraphModule over the original modules; weights shared
by stages are listed by tied_weights. A meta model splits the same way on fake tensors:
docs/design/pipeline_split.md.

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
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from ..core.errors import BuildError
from ..core.marks import PIPELINE_CUT, has_mark
from ..core.outputs import main_tensor
from ..core.schedule import join_path
from ..graph.examples import dummy_inputs
from ..graph.fake import _tensors_on_meta, on_meta, value_mode
from ..graph.graph_module import is_traced
from ..graph.guards import guard_equal, is_guard
from .compat import (
    PIPELINE_SENDS_NON_FLOAT,
    from_transport,
    is_non_float,
    tie_zero_grads,
    to_transport,
)

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["cut_paths", "split_stages", "Stages", "TiedWeight", "tied_weights", "replay_stages"]


def cut_paths(sch: Schedule) -> list[str]:
    """The paths of the modules after which a stage ends, in tree order."""
    return [path for path, node in sch.root.named_schedules() if has_mark(node.mod, PIPELINE_CUT)]


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
            path = join_path(prefix, node.target)
            sub = gm.get_submodule(node.target)
            if path in way and is_traced(sub):
                bound = _bind(sub, arg(node.args), arg(node.kwargs), path)
                env[node] = _inline(graph, sub, path, bound, way)
            else:
                env[node] = graph.call_module(path, arg(node.args), arg(node.kwargs))
        elif node.op == "get_attr":
            env[node] = graph.get_attr(join_path(prefix, node.target))
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
            return fx.map_arg(a, lambda m: env[m] if m in env else values[m])

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
                graph.call_function(guard_equal, (env[node], values[node],
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
