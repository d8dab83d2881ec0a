"""The pieces a step is made of, measured on fake tensors with a fake process group.

A transformer's training step is the same few pieces repeated: the embedding part ``E``
(everything before the first layer), each layer (checkpointed or not), and the head part
``H`` (final norm, output layer and loss), forward then backward in reverse. The planner
measures those pieces once per distinct ``(tp, sp, micro-batch, sequence, dtypes, FSDP
degree, loss)`` and composes any depth, stage split and micro-batch count from them
(:mod:`torchloom.plan.predict`).

How a measurement runs (three layers, a fake process group, fake tensors, FSDP2 where
asked), what each segment records, why everything is affine in the micro-batch, and how
crossing tensors are found: docs/design/plan_units.md.

>>> from torchloom.plan.spec import model_spec
>>> spec = model_spec("gpt2")
>>> u = measure_units(spec, UnitKey(micro_batch=2, seq_len=16))
>>> [s for s in u.segments][:3], len(u.segments)
(['E.f', 'L0.f', 'L1.f'], 10)
>>> u.segments["L2.f"].flops == u.segments["L1.f"].flops > 0   # plain == checkpointed fwd
True
>>> u.segments["L1.b"].flops > u.segments["L2.b"].flops        # recompute counted
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from ..core.errors import PlanError
from ..core.meta import copy_meta
from ..core.outputs import no_cache_kwargs
from ..runtime.causal_mask import unpacked_sequences
from ..runtime.expert_dispatch import split_experts
from ..runtime.expert_routing_model import modeled_routing
from .opcost import OpCost, flop_counter, grouped_mm_on_fake
from .spec import DTYPES, ModelSpec
from .tracking import Collective, fsdp_storage_resizes

__all__ = ["UnitKey", "Units", "SegmentCost", "OpCost", "measure_units",
           "fake_world", "next_token_loss", "extrapolate", "flop_counter", "DEPTH",
           "CKPT_LAYERS"]

DEPTH = 3          # layers of the shortened model
CKPT_LAYERS = 2    # of which the first ones are checkpointed
_PRIMITIVE = "plan"

def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss a pipeline's last stage computes (as ``torchloom train``): next-token
    cross-entropy on the logits."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), target[:, 1:].reshape(-1))


@dataclass(frozen=True)
class UnitKey:
    """What a measurement depends on (one cache entry).

    Attributes:
        tp, sp: tensor-parallel degree and sequence parallelism.
        micro_batch, seq_len: the micro-batch's shape.
        param_dtype, mixed_precision: as in :class:`~torchloom.plan.layout.Layout`.
        fsdp: the FSDP2 degree, ``dp_shard`` (1: no FSDP, unless ``shard_cp``).
        loss: ``"model"`` (the model's own loss from ``labels``) or ``"next_token"``
            (the pipeline's: logits out, :func:`next_token_loss`).
        replicate: HSDP's replicas (``dp_replicate`` with ``fsdp`` > 1; 1 otherwise).
        reduce_dtype: the dtype FSDP2 reduces gradients in (None: the layout's default).
        ac: ``"op"``: the checkpointed layers use the op-level selective policy
            (``checkpoint(policy="op")``) instead of recomputing everything.
        loss_mode: how the cross-entropy is computed (:data:`~torchloom.parallel.layout.LOSSES`),
            as :func:`torchloom.parallelize` builds it.
        cp: the context-parallel degree: the measured rank is rank 0 of a fake ``cp``
            group, the model under the ``context_parallel`` primitive (its attention
            all-gathers the keys and values, its inputs are this rank's ``seq_len / cp``
            tokens); FSDP2 then shards over ``fsdp x cp`` ranks.
        ep: the expert-parallel degree (folded into the data-parallel ranks: of FSDP2's
            ``fsdp`` ranks, or DDP's replicas): the measured rank holds ``E / ep`` experts
            of every mixture-of-experts module (FSDP2 leaves them whole) and dispatches its
            tokens by all-to-all under
            :func:`~torchloom.runtime.expert_routing_model.modeled_routing`.
        imbalance: the routing model's load of the busiest expert-parallel rank over the
            average (1.0: balanced); the measured rank is that one.
    """

    tp: int = 1
    sp: bool = False
    micro_batch: int = 1
    seq_len: int = 16
    param_dtype: str = "fp32"
    mixed_precision: str | None = None
    fsdp: int = 1
    loss: str = "model"
    replicate: int = 1
    reduce_dtype: str | None = None
    ac: str | None = None
    loss_mode: str = "full"
    cp: int = 1
    ep: int = 1
    imbalance: float = 1.0
    lora: Any = None
    """LoRA fine-tuning (a :class:`~torchloom.parallel.lora.LoraSpec`): the adapters
    added after the schedule, as :func:`torchloom.parallelize` adds them."""
    shard_cp: bool = False
    """With ``fsdp`` 1 and ``cp`` > 1: FSDP2 over the ``cp`` ranks alone
    (:attr:`Layout.shard_cp <torchloom.Layout.shard_cp>`)."""

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards the measured model (over ``fsdp x cp`` ranks)."""
        return self.fsdp > 1 or (self.shard_cp and self.cp > 1)

    def layout(self) -> Any:
        """The :class:`torchloom.Layout` of the measured ranks (no pipeline, no data
        parallelism besides FSDP2 / HSDP): its mesh and FSDP2 policy are
        :func:`torchloom.parallel.init_mesh`'s and :func:`torchloom.parallelize`'s."""
        from ..parallel.layout import Layout

        replicate = self.replicate if self.sharded else max(1, self.ep)
        return Layout(tp=self.tp, sp=self.sp, dp_shard=self.fsdp,
                      dp_replicate=replicate, ep=self.ep, shard_cp=self.sharded and self.cp > 1,
                      micro_batch=self.micro_batch, seq_len=self.seq_len,
                      param_dtype=self.param_dtype, mixed_precision=self.mixed_precision,
                      reduce_dtype=self.reduce_dtype, loss=self.loss_mode, cp=self.cp)


@dataclass
class SegmentCost:
    """One segment of the measured step (see the module docstring)."""

    name: str
    start: int
    delta: int
    rise: int
    flops: int
    matmuls: list[tuple[int, int, str, str]]
    """``(flops, bytes moved, dtype, kind)`` per matrix-product operator; kind ``linear``
    (``mm`` / ``addmm``: a linear layer's product), ``causal`` (causal attention, whose
    kernels skip the masked half), ``attention`` or ``other``."""
    other_bytes: int
    collectives: list[Collective]
    ops: int = 0  # operators dispatched (each costs the profile's op_overhead)


@dataclass
class Units:
    """A measurement: segments, and the state each part holds.

    Attributes:
        key: what was measured.
        segments: by name, in step order.
        params: bytes of the parameters each part (``E``, ``L0`` ... ``L2``, ``H``) holds
            (as this rank holds them; a weight used by ``E`` and ``H``, GPT-2's tied
            embedding, in both).
        shared: bytes of the parameters held by both ``E`` and ``H``.
        grads: gradient bytes per part (created in its backward).
        largest: the largest parameter tensor of each part (bytes).
        param_tensors: parameter tensors per part.
        buffers: bytes of buffers: ``"L"`` per layer, ``"E"`` the others.
        inputs: bytes of one micro-batch's inputs.
        start: live bytes when the step started (parameters, buffers, inputs).
        flops_total: FLOPs of the whole step.
        leftover: bytes still held after backward by the step's outputs (logits, loss),
            freed when the training loop drops them.
    """

    key: UnitKey
    segments: dict[str, SegmentCost]
    params: dict[str, int]
    shared: int
    grads: dict[str, int]
    largest: dict[str, int]
    param_tensors: dict[str, int]
    buffers: dict[str, int]
    inputs: int
    start: int
    flops_total: int
    leftover: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- fake world

_OURS = {"active": False}


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of ``world`` ranks, this process being ``rank``
    (collectives do nothing); the previous fake group of the planner is replaced, a real
    one is refused."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if not _OURS["active"]:
            raise PlanError(
                "the planner runs on its own fake process group, and this process already "
                f"has one ({dist.get_backend()}, {dist.get_world_size()} ranks)",
                primitive=_PRIMITIVE, values={"backend": dist.get_backend()},
                fix="plan before init_process_group, or in another process")
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    _OURS["active"] = True
    try:
        yield
    finally:
        dist.destroy_process_group()
        _OURS["active"] = False


# --------------------------------------------------------------------------- the model

ScheduleFn = Callable[[Any, dict[str, Any]], None]


def apply_knobs(sch: Any, spec: ModelSpec, knobs: dict[str, Any],
                schedule: ScheduleFn | None = None) -> None:
    """Apply the schedule: ``schedule(sch, knobs)`` when given, else the model's built-in
    schedule (``schedules.apply_schedule(sch, **knobs)``); a model without one is only
    checkpointed (and refuses ``tp``)."""
    from .. import schedules
    from ..core.errors import ScheduleError

    if schedule is not None:
        schedule(sch, dict(knobs))
        return
    try:
        schedules.schedule_for(sch.mod)
    except ScheduleError:
        if knobs.get("tp"):
            raise PlanError(
                f"{type(sch.mod).__name__} has no built-in schedule to split it between "
                "tensor-parallel ranks", primitive=_PRIMITIVE,
                values={"model": type(sch.mod).__name__}, fix="--tp 1, or pass schedule=") from None
        if knobs.get("ckpt_ratio"):
            sch[spec.layers].checkpoint(ratio=knobs["ckpt_ratio"])
        return
    schedules.apply_schedule(sch, **knobs)


def fake_params(model: nn.Module, mode: Any) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of its shape (tied
    parameters stay tied, gradient hooks stay on them); nothing is allocated."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in memo:
                    with mode:
                        fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    if is_param:
                        fake = nn.Parameter(fake, requires_grad=t.requires_grad)
                        copy_meta(t, fake)
                        # gradient hooks (sync("param_grad", ...)) stay with the parameter
                        hooks = getattr(t, "_backward_hooks", None) or {}
                        for hook in hooks.values() if fake.requires_grad else ():
                            fake.register_hook(hook)  # (a frozen one's never run: LoRA)
                    memo[id(t)] = fake
                table[name] = memo[id(t)]  # type: ignore[assignment]


def _first_tensor(value: Any) -> torch.Tensor | None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            return t
    return None


def _autocast(key: UnitKey) -> Any:
    if key.mixed_precision is None or key.sharded:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[key.mixed_precision])


def _fully_shard(model: nn.Module, spec: ModelSpec, mesh: Any, key: UnitKey) -> None:
    """FSDP2 as :func:`torchloom.parallelize` applies it: each layer, then the root, over
    the mesh's FSDP2 dimension(s), with the layout's mixed-precision policy; the experts
    of expert parallelism sharded over the ranks holding the same experts, or left whole
    where no other rank holds them (as :func:`torchloom.parallelize`)."""
    from ..parallel.parallelize import mp_policy, shard_experts
    from ..runtime.parallel import fully_shard_model

    layers: Any = model.get_submodule(spec.layers)
    units = [f"{spec.layers}.{i}" for i in range(len(layers))]
    policy = mp_policy(key.layout())
    whole = shard_experts(model, mesh, policy)
    fully_shard_model(model, mesh, units, mp_policy=policy, ignored=whole or None)


def _groups(mesh: Any, key: UnitKey) -> dict[str, str]:
    """Process-group name -> the planner's label: ``tp``; ``dp`` for FSDP2's shards (and
    every data-parallel rank); ``dp_replicate`` for HSDP's replicas."""
    if mesh is None:
        return {}
    hsdp = key.sharded and key.replicate > 1
    out: dict[str, str] = {}
    for dim, label in (("dp", "dp"), ("dp_replicate", "dp_replicate" if hsdp else "dp"),
                       ("dp_shard", "dp"), ("tp", "tp"), ("cp", "cp")):
        if mesh.size(dim) > 1:
            out[mesh.group(dim).group_name] = label
    if key.cp > 1 and key.sharded:
        # FSDP2 shards over dp_shard x cp flattened (one group, labelled as FSDP2's)
        out[mesh.shard_group().group_name] = "dp"
    if key.ep > 1:
        out[mesh.group("ep").group_name] = "ep"
        if mesh.group("ep_replicas") is not None:
            out[mesh.group("ep_replicas").group_name] = "ep_replicas"
    return out


@contextlib.contextmanager
def _cp_kernels(cp: int) -> Iterator[None]:
    """Run the context-parallel attention as it runs on a GPU: there each causal query
    chunk takes a lower-right causal ``CausalBias`` (no mask in memory); on fake tensors
    that tensor subclass cannot be made and the kernel would build the same mask as a
    tensor kept for backward, which no GPU run holds. Measured without a mask instead
    (:func:`~torchloom.ops.context_parallel.mask_free_causal_chunks`): the SDPA shapes,
    FLOPs and saved tensors are the GPU's."""
    if cp == 1:
        yield
        return
    from ..ops.context_parallel import mask_free_causal_chunks

    with mask_free_causal_chunks():
        yield


def _nbytes(t: torch.Tensor) -> int:
    inner = getattr(t, "_local_tensor", None)
    t = inner if isinstance(inner, torch.Tensor) else t
    return t.numel() * t.element_size()


def loss_knobs(sch: Any, key: UnitKey, knobs: dict[str, Any]) -> Any:
    """The loss :func:`torchloom.parallelize` gives the measured model
    (:func:`~torchloom.parallel.parallelize.loss_plan`): add the ``loss_parallel`` knob to
    ``knobs`` when it splits the head along the vocabulary (a ``schedule`` function is
    handed the knob too), and return ``(mode, group)``: the loss and the group its logits
    are split over (None: whole logits)."""
    from ..parallel.parallelize import loss_plan

    mode, sharded = loss_plan(sch, key.layout())
    if sharded:
        knobs["loss_parallel"] = True
    return mode, sch.group if sharded else None


def pipeline_loss(mode: str, group: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A pipeline's last-stage loss in ``mode`` (:func:`next_token_loss` for ``full``)."""
    if mode == "full" and group is None:
        return next_token_loss
    from ..ops.loss import next_token_loss as make

    return make(mode, group)


def measure_units(spec: ModelSpec, key: UnitKey, schedule: ScheduleFn | None = None,
                  depth: int = DEPTH, ckpt_layers: int = CKPT_LAYERS) -> Units:
    """Measure the pieces of a step (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..parallel.mesh import init_mesh
    from ..parallel.parallelize import create_schedule

    layout = key.layout()
    with fake_world(layout.world):
        mesh = init_mesh(layout, "cpu")
        groups = _groups(mesh, key)
        model = spec.build(depth=depth, dtype=DTYPES[key.param_dtype])
        sch = create_schedule(model, mesh if key.tp > 1 else None)
        # the first ``ckpt_layers`` layers are checkpointed: the ratio that gives them by
        # the rule checkpoint(ratio=...) and the planner share (core.rules)
        knobs: dict[str, Any] = {} if key.ac == "op" else {"ckpt_ratio": ckpt_layers / depth}
        if key.tp > 1:
            knobs["tp"] = True
        if key.sp:
            knobs["sequence_parallel"] = True
        loss, group = loss_knobs(sch, key, knobs)
        apply_knobs(sch, spec, knobs, schedule)
        if key.ac == "op":
            sch[spec.layers].checkpoint(ratio=ckpt_layers / depth, policy="op")
        if key.lora is not None:  # as torchloom.parallelize: after the schedule
            from ..parallel.lora import apply_lora

            apply_lora(sch, key.lora)
        if key.cp > 1:  # as torchloom.parallelize: after the schedule, over the cp group
            sch.context_parallel(mesh.group("cp") if mesh is not None else None)
        if key.ep > 1:  # likewise, over the ep group
            sch.expert_parallel(mesh.group("ep") if mesh is not None else None)
        layers: Any = model.get_submodule(spec.layers)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        if key.sharded:
            _fully_shard(model, spec, mesh, key)
            # to_empty may swap a parameter's contents in place (its attributes too): the
            # metadata is kept on stand-ins
            before = {}
            for name, p in model.named_parameters():
                before[name] = torch.empty(0)
                copy_meta(p, before[name])
            with mode:
                model.to_empty(device="cpu")
            for name, p in model.named_parameters():  # shard specs the hooks read
                copy_meta(before[name], p)
        else:
            fake_params(model, mode)
        with mode:
            inputs = spec.inputs(key.micro_batch, key.seq_len, device="cpu",
                                 labels=key.loss == "model")
        if key.loss == "model" and loss != "full":
            from ..ops.loss import set_loss

            set_loss(model, loss, group)
        last_loss = None if key.loss == "model" else pipeline_loss(loss, group)
        if key.loss != "model" and key.cp > 1:
            # a context-parallel pipeline's last stage: this rank's logits against the
            # whole sequences' shifted targets, summed over the cp group
            from ..core.marks import CONTEXT_PARALLEL, get_mark
            from ..parallel.context_pipeline import ContextParallelLoss

            last_loss = ContextParallelLoss(loss, group, get_mark(model, CONTEXT_PARALLEL))
        units = _run(spec, key, model, layers, inputs, mode, groups, last_loss)
        # the bytes of a layer's experts (split by ep, left whole by FSDP2): their
        # gradients are averaged over the ranks holding the same experts, not by DDP
        # or FSDP2
        mine = split_experts(layers[depth - 1])
        units.extra["expert_params"] = sum(_nbytes(p) for p in mine)
        units.extra["experts_sharded"] = any(hasattr(p, "to_local") for p in mine)
        units.extra["expert_tensors"] = len(mine)
        if key.lora is not None:
            units.extra["trainable"] = _trainable(model, layers[depth - 1], layers)
        return units


def _trainable(model: nn.Module, layer: nn.Module, layers: nn.Module
               ) -> dict[str, tuple[int, int, int]]:
    """What trains (LoRA's adapters): ``{"L": (bytes, tensors, largest) of one layer,
    "rest": the same outside the layers}``."""
    def count(params: list[nn.Parameter]) -> tuple[int, int, int]:
        sizes = [_nbytes(p) for p in params if p.requires_grad]
        return sum(sizes), len(sizes), max(sizes, default=0)

    inside = {id(p) for p in layers.parameters()}
    return {"L": count(list(layer.parameters())),
            "rest": count([p for p in model.parameters() if id(p) not in inside])}


def _run(spec: ModelSpec, key: UnitKey, model: nn.Module, layers: nn.ModuleList,
         inputs: dict[str, torch.Tensor], mode: Any, groups: dict[str, str],
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
         ) -> Units:
    depth = len(layers)
    tracker = OpCost(groups, causal=spec.kind == "causal")
    segments: dict[str, SegmentCost] = {}
    state: dict[str, Any] = {"part": "E", "flops": 0}
    # which parts use each module's own parameters: layer i's modules are Li's, the
    # others are recorded when the forward calls them (by module, since FSDP2 swaps the
    # parameter objects during the forward)
    layer_of = {id(m): f"L{i}" for i, layer in enumerate(layers) for m in layer.modules()}
    module_parts: dict[int, set[str]] = {}

    def mark(name: str) -> None:
        seg = tracker.mark(name)
        total = tracker.flops
        matmuls, other = tracker.take()
        segments[name] = SegmentCost(name, seg.start, seg.delta, seg.rise,
                                     total - state["flops"], matmuls, other, seg.collectives,
                                     tracker.take_ops())
        state["flops"] = total

    handles = []

    def grad_mark(name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            mark(name)
        return hook

    def pre(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            mark("E.f" if i == 0 else f"L{i - 1}.f")
            state["part"] = f"L{i}"
            if i == 0:
                x = _first_tensor((args, kwargs))
                if x is not None and x.requires_grad:
                    x.register_hook(grad_mark("L0.b"))
        return hook

    def post_first(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            y = _first_tensor(output)
            if y is not None and y.requires_grad:
                y.register_hook(grad_mark("H.b" if i == depth - 1 else f"L{i + 1}.b"))
        return hook

    def post_last(module: nn.Module, args: Any, output: Any) -> None:
        mark(f"L{depth - 1}.f")
        state["part"] = "H"

    def use(module: nn.Module, args: Any) -> None:
        module_parts.setdefault(id(module), set()).add(state["part"])

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), prepend=True, with_kwargs=True))
        handles.append(layer.register_forward_hook(post_first(i), prepend=True))
    handles.append(layers[depth - 1].register_forward_hook(post_last))
    for module in model.modules():
        if module is not model and id(module) not in layer_of:
            handles.append(module.register_forward_pre_hook(use))

    params = {id(p): p for p in model.parameters()}
    try:
        with mode, grouped_mm_on_fake(), fsdp_storage_resizes(tracker), tracker, \
                unpacked_sequences(), _cp_kernels(key.cp), modeled_routing(key.imbalance):
            for t in [*params.values(), *model.buffers(), *inputs.values()]:
                tracker.track(t)
            start = tracker.current
            tracker.reset_peak()
            with _autocast(key):
                # the model's loss: the loop keeps only the loss (the logits go); the
                # pipeline's: its last stage keeps every micro-batch's output
                out = model(**inputs, **no_cache_kwargs(model))
                result: dict[str, Any] = {} if key.loss == "model" else {"out": out}
                if key.loss == "model":
                    result["loss"] = out.loss
                else:
                    logits = out.logits if hasattr(out, "logits") else _first_tensor(out)
                    assert logits is not None
                    result["loss"] = (loss_fn or next_token_loss)(logits, inputs["input_ids"])
                    del logits
                del out
            mark("H.f")
            state["part"] = "H"
            result["loss"].backward()
            if "L0.b" not in segments:  # a frozen embedding (LoRA): backward ends in L0
                mark("L0.b")
            mark("E.b")
            before = tracker.current
            result.clear()
            leftover = before - tracker.current
    finally:
        for h in handles:
            h.remove()
    parts = ["E", *[f"L{i}" for i in range(depth)], "H"]
    part_params: dict[str, int] = {p: 0 for p in parts}
    part_grads: dict[str, int] = {p: 0 for p in parts}
    largest: dict[str, int] = {p: 0 for p in parts}
    count: dict[str, int] = {p: 0 for p in parts}
    owners: dict[int, set[str]] = {}
    for module in model.modules():
        parts_of = {layer_of[id(module)]} if id(module) in layer_of else \
            module_parts.get(id(module), set())
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).update(parts_of)
    shared = 0
    for pid, p in params.items():
        used = owners.get(pid) or {"E"}
        size = _nbytes(p)
        grad = _nbytes(p.grad) if p.grad is not None else 0
        if {"E", "H"} <= used:
            shared += size
        for part in used:
            part_params[part] += size
            part_grads[part] += grad
            largest[part] = max(largest[part], size)
            count[part] += 1
    expected = ["E.f", *[f"L{i}.f" for i in range(depth)], "H.f", "H.b",
                *[f"L{i}.b" for i in reversed(range(depth))], "E.b"]
    missing = [s for s in expected if s not in segments]
    if missing:
        raise PlanError(
            f"the step of {spec.name} did not pass the layer boundaries the planner marks "
            f"({', '.join(missing)} missing)", primitive=_PRIMITIVE,
            values={"model": spec.name, "missing": missing},
            fix="plan a model whose layers take the hidden states as their first input "
            "and return them first")
    ordered = {name: segments[name] for name in expected}
    layer_buffers = sum(_nbytes(b) for b in layers[depth - 2].buffers())
    buffers = sum(_nbytes(b) for b in model.buffers()) - depth * layer_buffers
    in_bytes = sum(_nbytes(t) for t in inputs.values())
    return Units(key, ordered, part_params, shared, part_grads, largest, count,
                 {"E": buffers, "L": layer_buffers}, in_bytes, start, tracker.flops,
                 leftover)


# --------------------------------------------------------------------------- batch sizes


def extrapolate(one: Units, two: Units, micro_batch: int) -> Units | None:
    """The measurement at ``micro_batch`` sequences from those at one and two (every
    quantity affine in the batch, operator by operator); None when the two steps did not
    run the same operators (then measure it)."""
    import dataclasses

    t = micro_batch - 1

    def lin(a: int, b: int) -> int:
        return a + t * (b - a)

    segments: dict[str, SegmentCost] = {}
    for name, s1 in one.segments.items():
        s2 = two.segments.get(name)
        if s2 is None or len(s1.matmuls) != len(s2.matmuls) or \
                [(c.kind, c.group) for c in s1.collectives] != \
                [(c.kind, c.group) for c in s2.collectives]:
            return None
        matmuls = [(lin(f1, f2), lin(b1, b2), d1, k1)
                   for (f1, b1, d1, k1), (f2, b2, _, _) in zip(s1.matmuls, s2.matmuls)]
        colls = [Collective(c1.kind, lin(c1.bytes, c2.bytes), c1.group, c1.size)
                 for c1, c2 in zip(s1.collectives, s2.collectives)]
        segments[name] = SegmentCost(name, lin(s1.start, s2.start), lin(s1.delta, s2.delta),
                                     lin(s1.rise, s2.rise), lin(s1.flops, s2.flops), matmuls,
                                     lin(s1.other_bytes, s2.other_bytes), colls,
                                     lin(s1.ops, s2.ops))
    key = dataclasses.replace(one.key, micro_batch=micro_batch)
    return Units(key, segments, one.params, one.shared, one.grads, one.largest,
                 one.param_tensors, one.buffers, lin(one.inputs, two.inputs),
                 lin(one.start, two.start), lin(one.flops_total, two.flops_total),
                 lin(one.leftover, two.leftover), {**one.extra, "extrapolated_from": (1, 2)})
