"""The static placement check: do a schedule's shards and syncs compose?

:func:`check` runs before anything executes. It derives each module's output placement
from its shards (:func:`torchloom.core.placement.output_placement`), applies the module's own
``fwd_post`` syncs, and walks the module tree with the Megatron rules a tensor-parallel
region must obey. Each violation is a :class:`Finding` with the path, the problem and
the fix:

1. **partial never reduced**: a row-parallel module's partial sum is not all-reduced
   (nor reduce-scattered) by a ``fwd_post`` sync on it or on any module around it, so
   the next operation (an activation, a norm, the loss) sees a fraction of the value;
2. **sharded output never consumed**: a column-parallel module's output is still split
   along its features after its own ``fwd_post`` syncs (not gathered, nor resharded to
   another axis: ``"RS->SR"`` makes it whole features on a slice of the sequence, the
   sequence-parallel layout), its own block holds no row-parallel module, and the next
   module with weights (in module order, after any further column-parallel ones) is not
   row parallel, so it would get a slice of an activation it expects whole;
3. **gradient left partial**: a column-parallel module (or its enclosing block) has no
   ``bwd_post`` all-reduce and no ``fwd_pre`` all-gather, so the gradient of its input
   stays a per-rank partial sum (invisible in the forward pass); a ``shared=True``
   all-reduce counts (it reduces the siblings' summed parts, or the module's own);
4. **sharded norm**: a LayerNorm / RMSNorm with a sharded weight normalises a slice of
   the features, with other statistics than the full model;
5. **bias before reduction**: a row-parallel ``Linear`` / ``Conv1D`` whose unsharded bias
   is added before the partial sums are reduced (the reduction comes from a callable or
   from an enclosing module), so the bias is counted ``world_size`` times;
6. **parameter gradient left partial**: a module with whole (unsharded) parameters that
   runs on a slice of the sequence (sequence parallelism: after a ``fwd_post`` sync that
   splits the sequence, ``reduce_scatter`` / ``scatter`` along axis 1 or ``"->SR"``, and
   before a sync that gathers it again), or a row-parallel module whose whole bias is
   added after its output was reduce-scattered along the sequence, has no
   ``param_grad`` sync: each rank's gradient of those parameters covers its tokens only.
   The sequence state follows module order through the tree; a block whose ``fwd_pre``
   gathers the sequence is whole inside, whatever the order of its children, and
   leaves the sequence split when one of them reduce-scatters it;
7. **packed projection split plainly**: in a traced module (``sch[path].trace()``), a
   column-parallel projection sharded with ``chunks=1`` whose output the graph splits
   into ``k`` equal parts along its features (``split(size, dim=-1)``, ``chunk(k)``: a
   fused q/k/v, a gate|up pair) gives rank 0 the first blocks whole and the last none;
   it must be sharded with ``chunks=k``. Untraced modules are not inspected (their data
   flow is not visible).

The module tree is what is checked; inside a module the data flow is not visible, so
rules 1 and 3 accept any enclosing module as the place where a region closes, and rule
2 follows module order (the order in which models register, and Megatron regions run,
their layers).

>>> import torch, torchloom as tl
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
>>> sch = tl.create_schedule(mlp)
>>> sch["0"].shard("weight", 0); sch["0"].shard("bias", 0)
>>> sch["0"].sync("bwd_post", "all_reduce")
>>> sch["2"].shard("weight", 1)
>>> print(check(sch))
1 problem in the schedule:
  sch['2']: partial never reduced: the output of this row-parallel Linear is a partial sum (weight sharded along its input axis) and no fwd_post sync on it or around it reduces it
      fix: sch['2'].sync('fwd_post', 'all_reduce')
>>> sch["2"].sync("fwd_post", "all_reduce")
>>> check(sch).ok
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.marks import SYNCS, get_mark
from ..core.meta import shard_spec
from ..core.placement import Placement, output_placement
from ..runtime.adapters import is_lora_layer

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["Finding", "CheckReport", "check", "effective_output_placement"]

_REDUCING = ("all_reduce", "reduce_scatter")
_GATHERING = ("all_gather", "RS->RR", "SR->RR")


@dataclass(frozen=True)
class Finding:
    """One rule a schedule breaks."""

    path: str
    rule: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"sch[{self.path!r}]: {self.rule}: {self.problem}\n    fix: {self.fix}"


@dataclass
class CheckReport:
    """The findings of :func:`check`; ``ok`` when there are none."""

    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        if self.ok:
            return "the schedule's shards and syncs compose"
        head = f"{len(self.findings)} problem{'s' if len(self.findings) > 1 else ''} in the schedule:"
        return "\n".join([head] + ["  " + str(f).replace("\n", "\n  ") for f in self.findings])


def _syncs(module: nn.Module) -> list:
    return list(get_mark(module, SYNCS, []))


def _is_callable_sync(spec: object) -> bool:
    from ..primitives.sync import _OPS, RESHARD_SPECS

    return spec.op not in _OPS and spec.op not in RESHARD_SPECS  # type: ignore[attr-defined]


def effective_output_placement(module: nn.Module) -> Placement | None:
    """The placement of ``module``'s output after its own ``fwd_post`` syncs; None when
    unknown (no sharded weight, or a callable sync)."""
    placement = output_placement(module)
    if placement is None:
        return None
    for spec in _syncs(module):
        if spec.mode != "fwd_post":
            continue
        if _is_callable_sync(spec):
            return None
        if spec.op in ("all_reduce", "all_gather") or spec.op.endswith("->RR"):
            placement = Placement.replicate()
        elif spec.op in ("reduce_scatter", "scatter"):
            placement = Placement.shard(spec.axis)
        elif spec.op.endswith("->RS"):
            placement = Placement.shard(-1)
        elif spec.op.endswith("->SR"):
            placement = Placement.shard(-2)
    return placement


def _has_sync(module: nn.Module, mode: str, ops: tuple[str, ...], callables: bool = False) -> bool:
    return any(s.mode == mode and (s.op in ops or (callables and _is_callable_sync(s)))
               for s in _syncs(module))


def _ancestors(node: Schedule) -> list[Schedule]:
    found = []
    while node.parent is not None:
        node = node.parent
        found.append(node)
    return found


def _is_feature_norm(module: nn.Module) -> bool:
    names = [c.__name__ for c in type(module).__mro__]
    return any("LayerNorm" in n or "RMSNorm" in n for n in names)


def _next_weighted_leaf(leaves: list[tuple[str, nn.Module]],
                        module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first leaf with a weight after ``module`` in module order that is not itself
    column parallel (chains of column-parallel modules, such as q, k, v, are skipped)."""
    index = next((i for i, (_, m) in enumerate(leaves) if m is module), None)
    if index is None:
        return None
    for path, leaf in leaves[index + 1:]:
        if leaf._parameters.get("weight") is None and not is_lora_layer(leaf):
            continue
        placement = effective_output_placement(leaf)
        if placement is not None and placement.kind == "shard" and \
                output_placement(leaf) == placement:
            continue  # another column-parallel module of the same region
        return path, leaf
    return None


def _has_row_parallel(node: Schedule) -> bool:
    return any(output_placement(s.mod) == Placement.partial() for _, s in node.named_schedules())


_SEQ_AXES = (1, -2)


def _splits_sequence(spec: object) -> bool | None:
    """True when a sync leaves the activation split along the sequence, False when it
    makes it whole, None when it does not change the sequence axis."""
    op, axis = spec.op, spec.axis  # type: ignore[attr-defined]
    if op in ("reduce_scatter", "scatter"):
        return True if axis in _SEQ_AXES else None
    if op == "all_gather":
        return False if axis in _SEQ_AXES else None
    from ..primitives.sync import RESHARD_SPECS

    if isinstance(op, str) and op in RESHARD_SPECS:
        before, after = op.split("->")
        if after[0] == "S":
            return True
        if before[0] == "S":
            return False
    return None


def _after_syncs(module: nn.Module, mode: str, state: bool) -> bool:
    for spec in _syncs(module):
        if spec.mode == mode:
            change = _splits_sequence(spec)
            if change is not None:
                state = change
    return state


def _whole_params(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items()
            if p is not None and p.requires_grad and shard_spec(p) is None]


def _sequence_findings(node: Schedule, split: bool, report: CheckReport,
                       seen: set[int]) -> bool:
    """Rule 6 at and below ``node``, entered with the sequence ``split`` or whole; returns
    the state of ``node``'s output."""
    module = node.mod
    inside = _after_syncs(module, "fwd_pre", split)
    has_param_grad = _has_sync(module, "param_grad", ("all_reduce",))
    if id(module) not in seen:
        seen.add(id(module))
        kind = type(module).__name__
        own = _whole_params(module)
        if own and inside and not has_param_grad:
            report.findings.append(Finding(
                node.path, "parameter gradient left partial",
                f"this {kind} runs on a slice of the sequence (sequence parallelism) with "
                f"whole parameters ({', '.join(own)}), so each rank's gradient covers only "
                "its own tokens and nothing all-reduces it",
                f"sch[{node.path!r}].sync('param_grad', 'all_reduce')"))
        bias = module._parameters.get("bias")
        if (not inside and output_placement(module) == Placement.partial()
                and _after_syncs(module, "fwd_post", False) and bias is not None
                and bias.requires_grad and shard_spec(bias) is None and not has_param_grad):
            report.findings.append(Finding(
                node.path, "parameter gradient left partial",
                f"this row-parallel {kind} reduce-scatters its output along the sequence and "
                "adds its whole bias to each rank's slice, so the bias gradient covers only "
                "this rank's tokens and nothing all-reduces it",
                f"sch[{node.path!r}].sync('param_grad', 'all_reduce')"))
    state = inside
    region = split and not inside  # a block that gathers the sequence: whole inside
    leaves_split = False
    for child in node.child.values():
        # inside a region every child sees the gathered sequence, whatever the module
        # order (OLMo-2's q_norm is registered after o_proj); elsewhere module order
        state = _sequence_findings(child, False if region else state, report, seen)
        leaves_split = leaves_split or state
    if region:
        state = leaves_split
    return _after_syncs(module, "fwd_post", state)


def _split_parts(user: Any, features: int) -> int | None:
    """The number of equal parts ``user`` (a graph node) splits a ``features``-wide
    output into along its last axis, or None when it is no such split."""
    target = user.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if user.op not in ("call_method", "call_function") or name not in ("split", "chunk"):
        return None
    args = list(user.args[1:]) + [user.kwargs.get(k) for k in ("split_size_or_sections",
                                                               "split_size", "chunks")
                                  if k in user.kwargs]
    dim = user.kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(dim, int) or (dim != -1 and dim < 1) or not args or \
            not isinstance(args[0], int) or args[0] <= 0:
        return None
    if name == "chunk":
        return args[0] if args[0] > 1 and features % args[0] == 0 else None
    return features // args[0] if features % args[0] == 0 and features > args[0] else None


def _packed_findings(root: Schedule, report: CheckReport) -> None:
    """Rule 7, in every traced module of the tree."""
    from ..graph.graph_module import is_traced

    for _, node in root.named_schedules():
        module = node.mod
        if not is_traced(module):
            continue
        for gn in module.graph.nodes:
            if gn.op != "call_module":
                continue
            try:
                leaf = module.get_submodule(str(gn.target))
            except AttributeError:
                continue
            weight = leaf._parameters.get("weight")
            spec = shard_spec(weight) if weight is not None else None
            placement = output_placement(leaf)
            if spec is None or spec.chunks != 1 or placement is None or \
                    placement.kind != "shard":
                continue
            features = spec.full_shape[spec.axis]
            parts = next((k for u in gn.users if (k := _split_parts(u, features))), None)
            if parts is None:
                continue
            path = f"{node.path}.{gn.target}" if node.path else str(gn.target)
            report.findings.append(Finding(
                path, "packed projection split plainly",
                f"the graph of {node.path or 'the model'!r} splits this projection's output "
                f"into {parts} equal parts along its features (packed blocks such as q, k, v), "
                "and its weight is split as one block: each rank would hold a run of the "
                "packed blocks (rank 0 the first) instead of its share of every block",
                f"sch[{path!r}].shard('weight', {spec.axis}, chunks={parts}) (and the bias "
                f"with chunks={parts})"))


def check(sch: Schedule) -> CheckReport:
    """Check the whole tree of ``sch`` (from its root) against the rules above."""
    root = sch.root
    report = CheckReport()
    # a LoRA layer is checked as one module (its base's placement, its own syncs): the
    # base and the adapters inside it are parallel branches summed at its output
    lora = tuple(f"{path}." for path, m in root.mod.named_modules() if is_lora_layer(m))
    leaves = [(path, m) for path, m in root.mod.named_modules()
              if (not m._modules or is_lora_layer(m)) and not path.startswith(lora)]
    seen: set[int] = set()
    for _, node in root.named_schedules():
        module = node.mod
        if id(module) in seen or node.path.startswith(lora):
            continue
        seen.add(id(module))
        kind = type(module).__name__
        placement = output_placement(module)
        effective = effective_output_placement(module)
        ancestors = _ancestors(node)
        where = node.path

        if placement == Placement.partial():
            reduced_around = any(_has_sync(a.mod, "fwd_post", _REDUCING, callables=True)
                                 for a in ancestors)
            own_callable = _has_sync(module, "fwd_post", (), callables=True)
            if effective == Placement.partial() and not reduced_around and not own_callable:
                report.findings.append(Finding(
                    where, "partial never reduced",
                    f"the output of this row-parallel {kind} is a partial sum (weight sharded "
                    "along its input axis) and no fwd_post sync on it or around it reduces it",
                    f"sch[{where!r}].sync('fwd_post', 'all_reduce')"))
            bias = module._parameters.get("bias")
            late = own_callable or (effective == Placement.partial() and reduced_around)
            if bias is not None and shard_spec(bias) is None and late:
                report.findings.append(Finding(
                    where, "bias before reduction",
                    f"this row-parallel {kind} adds its whole bias on every rank before the "
                    "partial sums are reduced, so the bias is counted world_size times",
                    f"reduce at the module itself with a string op: sch[{where!r}].sync("
                    "'fwd_post', 'all_reduce') (torchloom then adds the bias after the "
                    "reduction), or shard the bias"))

        if placement is not None and placement.kind == "shard" and not _is_feature_norm(module):
            # Still split along the same axis: a reshard to another axis ("RS->SR") makes
            # the features whole (on a slice of the sequence), which any module consumes.
            if effective is not None and effective == placement:
                consumer = _next_weighted_leaf(leaves, module)
                in_region = node.parent is not None and _has_row_parallel(node.parent)
                if not in_region and (consumer is None or
                                      output_placement(consumer[1]) != Placement.partial()):
                    whom = (f"the next module with weights, {consumer[0]!r}, holds them whole "
                            "and expects the whole activation" if consumer is not None
                            else "no row-parallel module follows it")
                    report.findings.append(Finding(
                        where, "sharded output never consumed",
                        f"the output of this column-parallel {kind} is sharded along axis "
                        f"{placement.axis} and is not gathered; {whom}",
                        f"sch[{where!r}].sync('fwd_post', 'all_gather', axis={placement.axis}) "
                        "or shard the consumer along its input axis (row parallel)"))
            covered = any(
                _has_sync(m, "bwd_post", ("all_reduce",), callables=True)
                or _has_sync(m, "fwd_pre", ("all_gather", "SR->RR", "RS->RR"))
                for m in [module] + [a.mod for a in ancestors])
            if not covered:
                report.findings.append(Finding(
                    where, "gradient left partial",
                    f"this column-parallel {kind} computes only part of its input's gradient "
                    "on each rank and nothing all-reduces it in backward",
                    f"sch[{where!r}].sync('bwd_post', 'all_reduce') (or on the block that "
                    "feeds several column-parallel modules, once)"))

        if _is_feature_norm(module):
            weight = module._parameters.get("weight")
            if weight is not None and shard_spec(weight) is not None:
                report.findings.append(Finding(
                    where, "sharded norm",
                    f"this {kind} has a sharded weight, so it normalises a slice of the "
                    "features with other mean and variance than the full model",
                    "keep norm weights whole (replicated); for sequence parallelism shard "
                    f"the activation instead and sync the gradients: sch[{where!r}].sync("
                    "'param_grad', 'all_reduce')"))
    _sequence_findings(root, False, report, set())
    _packed_findings(root, report)
    return report
