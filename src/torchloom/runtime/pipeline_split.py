"""Pipeline stages: split a traced model at its ``cut_pipeline_stage`` marks (the stages
run in :mod:`torchloom.runtime.pipeline`).

The model is flattened along the way to the cuts, every node assigned to a stage, the
values that cross a boundary found by liveness (tensors are sent, contiguous and with
their dtype; tuples, lists and dicts of them are taken apart in the stage that makes them;
non-tensor values are fixed to the example micro-batch's), and each stage is a GraphModule
over the original modules; weights shared by stages are listed by tied_weights. A meta model splits the same way on fake tensors:
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
from ..core.outputs import main_tensor, tensors_in
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


def flatten(root: fx.GraphModule, cuts: list[str]) -> fx.GraphModule:
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
    metas: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None = None
    """Per stage, ``(inputs, outputs)`` as ``meta`` tensors of the example micro-batch's
    shapes and dtypes (``requires_grad`` on floating-point ones): what the stage receives
    and sends, given to ``PipelineStage`` so that the pipelining runtime does not infer
    them by running the stage on uninitialised inputs (integer token ids or targets
    would then be garbage). None when the model inputs are not positional tensors."""


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


def _pack_list(*items: Any) -> list:
    return list(items)


def _pack_as(kind: type, *items: Any) -> Any:
    """A named tuple of ``kind`` from its items."""
    return kind(*items)


def _pack_dict(keys: tuple, *items: Any) -> dict:
    return dict(zip(keys, items))


#: node.meta key of the nodes that take a crossing container apart: the node whose value
#: they unpack (they run in that node's stage, right after it)
_UNPACKS = "torchloom_unpacks"


def _carried(value: Any) -> bool:
    """Whether ``value`` is a container the split carries item by item: a tuple (named
    ones too), list or dict that holds a tensor somewhere inside."""
    if isinstance(value, (tuple, list)):
        items: Any = value
    elif type(value) is dict:
        items = value.values()
    else:
        return False
    return any(isinstance(v, torch.Tensor) or _carried(v) for v in items)


def _unpack(graph: fx.Graph, src: fx.Node, value: Any, origin: fx.Node, after: fx.Node,
            values: dict[fx.Node, Any]) -> tuple[Any, fx.Node]:
    """The tree ``(value, keys, items)`` of getitem nodes that take ``value`` (the value of
    ``src``) apart, made after ``after`` and marked to run in ``origin``'s stage; and the
    last node made."""
    import operator

    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    items: list[Any] = []
    for key in keys:
        with graph.inserting_after(after):
            item = graph.call_function(operator.getitem, (src, key))
        after = item
        item.meta[_UNPACKS] = origin
        values[item] = value[key]
        if _carried(value[key]):
            tree, after = _unpack(graph, item, value[key], origin, after, values)
            items.append(tree)
        else:
            items.append(item)
    return (value, keys, items), after


def _repack(graph: fx.Graph, tree: Any, before: fx.Node, values: dict[fx.Node, Any]
            ) -> fx.Node:
    """A node rebuilding the container of ``tree`` (see :func:`_unpack`) before ``before``."""
    if isinstance(tree, fx.Node):
        return tree
    value, keys, items = tree
    args = tuple(_repack(graph, item, before, values) for item in items)
    with graph.inserting_before(before):
        if isinstance(value, dict):
            made = graph.call_function(_pack_dict, (tuple(keys), *args))
        elif isinstance(value, list):
            made = graph.call_function(_pack_list, args)
        elif type(value) is tuple:
            made = graph.call_function(_pack, args)
        else:  # a named tuple
            named: Any = type(value)  # a class, as fx takes it
            made = graph.call_function(_pack_as, (named, *args))
    values[made] = value
    return made


def _unpack_crossing_tuples(flat: fx.GraphModule, values: dict[fx.Node, Any],
                            stage_of: dict[fx.Node, int]) -> bool:
    """A container with tensors used by a later stage (a layer's ``(hidden, None)``,
    Llama's rotary ``(cos, sin)``) cannot be sent whole: take it apart in its own stage
    (the ``getitem`` nodes are marked to run there, also after a cut module) and rebuild
    it where it is used (``outputs[0]`` there takes just that item). Its tensors cross the
    boundary; its other items (None, sizes, flags) are constants of the example that both
    stages agree on (checked at run time)."""
    import operator

    graph = flat.graph
    changed = False
    for node in list(graph.nodes):
        value = values.get(node)
        if not _carried(value):
            continue
        later = [u for u in node.users if stage_of.get(u, -1) > stage_of[node]]
        if not later:
            continue
        tree, _ = _unpack(graph, node, value, node, node, values)
        keys, items = tree[1], tree[2]
        for user in later:
            key = user.args[1] if len(user.args) == 2 else None
            if user.op == "call_function" and user.target is operator.getitem and \
                    user.args[0] is node and not isinstance(key, fx.Node) and key in keys:
                user.replace_all_uses_with(_repack(graph, items[keys.index(key)], user,
                                                   values))
                graph.erase_node(user)
            else:
                user.replace_input_with(node, _repack(graph, tree, user, values))
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


def split_stages(sch: Schedule, example_inputs: tuple | dict | None = None,
                 send_dtype: torch.dtype | None = None) -> Stages:
    """Split the model of ``sch`` at its cut marks (see the module docstring).

    ``example_inputs`` is one micro-batch (a tuple of positional inputs or a dict of
    keyword inputs); None: :func:`torchloom.graph.tracing.dummy_inputs` of a transformers model.
    On a model with ``meta`` weights the example values are fake tensors.

    ``send_dtype``: the floating-point tensors that cross a cut are cast to it where they
    leave a stage, and the next stage receives them so (the stages of a model that computes in bf16 under
    FSDP2's mixed precision send bf16, as their layers make it: half the bytes and half the
    receive buffers of the parameters' fp32; the receiving stage's FSDP2 would cast them
    to bf16 anyway). None: sent in the dtype the trace gave them.
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
            origin = node.meta.get(_UNPACKS)
            stage_of[node] = stage if origin is None else stage_of[origin]
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
            value = values.get(n)
            if not crosses(n) and tensors_in(value):
                raise BuildError(
                    f"a {type(value).__name__} with tensors ({n.name}) crosses into stage "
                    f"{k}; tensors, and tuples, lists and dicts of them, can be sent between "
                    "stages, other containers cannot",
                    path=cuts[k - 1], primitive="build",
                    values={"value": n.name, "type": type(value).__name__},
                    fix="cut after a module that returns tensors or a tuple of them (e.g. "
                    "a whole layer), or make the module return a tuple",
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
            # the pipelining runtime sends only contiguous tensors (a transposed or
            # sliced activation is made contiguous here; a no-op for the others)
            outs = [graph.call_method("contiguous", (env[n] if n in env else arg(n),))
                    for n in live[k + 1]]
            if send_dtype is not None:
                outs = [graph.call_method("to", (o, send_dtype)) if _is_float(values.get(n))
                        else o for n, o in zip(live[k + 1], outs)]
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
    metas = _stage_metas(flat, args, kwargs, live, values, output_node, send_dtype)
    return Stages(modules=modules, inputs=inputs, ties=ties, folded=folded, cuts=cuts, flat=flat,
                  metas=metas)


_NO_GRAD_METHODS = frozenset({"detach", "detach_", "requires_grad_", "numel", "size", "dim"})


def _needs_grad(flat: fx.GraphModule, values: dict[fx.Node, Any], args: tuple
                ) -> set[fx.Node]:
    """The nodes whose values carry a gradient in training: floating-point results of a
    trainable parameter or input, through anything but ``detach`` (what the pipelining
    runtime sends gradients back for). Errs towards a gradient: a gradient too many is
    a zero sent back, one too few a silently frozen earlier stage."""
    needs: set[fx.Node] = set()
    positional = iter(args)
    for node in flat.graph.nodes:
        value = values.get(node)
        floating = isinstance(value, torch.Tensor) and (value.is_floating_point() or
                                                        value.is_complex())
        if node.op == "placeholder":
            given = next(positional, None)
            grad = isinstance(given, torch.Tensor) and given.requires_grad
        elif node.op == "get_attr":
            try:
                grad = bool(getattr(flat.get_parameter(str(node.target)), "requires_grad",
                                    False))
            except AttributeError:
                grad = False  # a buffer or constant
        elif node.op == "call_module":
            module = flat.get_submodule(str(node.target))
            grad = any(p.requires_grad for p in module.parameters()) or (
                any(n in needs for n in node.all_input_nodes) and
                _passes_grad(module, node, values, needs))
        elif node.op == "call_method" and node.target in _NO_GRAD_METHODS:
            grad = False
        elif node.op == "call_function" and node.target is torch.detach:
            grad = False
        else:
            grad = any(n in needs for n in node.all_input_nodes)
        if grad and (floating or (not isinstance(value, torch.Tensor) and
                                  (value is None or tensors_in(value)))):
            needs.add(node)  # (a container with tensors, or unknown: its items may)
    return needs


def _passes_grad(module: nn.Module, node: fx.Node, values: dict[fx.Node, Any],
                 needs: set[fx.Node]) -> bool:
    """Whether the parameterless ``module`` called at ``node`` returns a value with a
    gradient from its inputs that have one. torch.nn's do (activations, dropout); another
    (a rotary embedding reading only its input's dtype) is run once on the example values,
    the random state restored; if that fails: yes."""
    if type(module).__module__.startswith("torch.nn"):
        return True
    if any(n in needs and not isinstance(values.get(n), torch.Tensor)
           for n in node.all_input_nodes):
        return True

    def value(n: fx.Node) -> Any:
        v = values.get(n)
        if not isinstance(v, torch.Tensor):
            return v
        v = v.detach()
        return v.requires_grad_(True) if n in needs else v

    devices = sorted({str(v.device) for v in values.values() if isinstance(v, torch.Tensor)
                      and v.device.type == "cuda"})
    try:
        args, kwargs = fx.map_arg((node.args, node.kwargs), value)
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            out = module(*args, **kwargs)
    except Exception:  # noqa: BLE001 - then assume a gradient (one too many is harmless)
        return True
    return any(t.requires_grad for t in tensors_in(out))


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _stage_metas(flat: fx.GraphModule, args: tuple, kwargs: dict, live: list[list[fx.Node]],
                 values: dict[fx.Node, Any], output_node: fx.Node,
                 send_dtype: torch.dtype | None = None
                 ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None:
    """:attr:`Stages.metas` (see there); None where they cannot be given."""
    if not PIPELINE_SENDS_NON_FLOAT or kwargs or \
            not all(isinstance(a, torch.Tensor) for a in args):
        return None  # (older torch sends non-float tensors as float: its own inference)
    final = main_tensor(values.get(output_node))
    if not isinstance(final, torch.Tensor):
        return None
    needs = _needs_grad(flat, values, args)

    def meta(v: torch.Tensor, grad: bool, sent: bool = False) -> torch.Tensor:
        dtype = send_dtype if sent and send_dtype is not None and _is_float(v) else v.dtype
        t = torch.empty(tuple(v.shape), dtype=dtype, device="meta")
        return t.requires_grad_(grad and (v.is_floating_point() or v.is_complex()))

    ins = [tuple(meta(a, a.requires_grad) for a in args)]
    ins += [tuple(meta(values[n], n in needs, sent=True) for n in live[k])
            for k in range(1, len(live))]
    outs = [ins[k + 1] for k in range(len(live) - 1)] + [(meta(final, True),)]
    return list(zip(ins, outs))


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
