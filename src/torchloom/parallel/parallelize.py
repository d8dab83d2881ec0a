"""``torchloom.parallelize(sch, layout)``: the one path from a layout to a built model.

``torchloom train``, the planner's measurements and validation, ``torchloom bench``,
``torchloom verify`` and the tuner all build through it, so the rules of a layout (which
layers a ratio checkpoints, where the default stage cuts fall, which group each piece
uses) are applied in one place. In order:

1. **Tensor and sequence parallelism**: the model's schedule (built-in, derived from
   transformers' tensor-parallel plan, or the automatic one; :func:`torchloom.schedules.apply_schedule`)
   at degree ``layout.tp``, over the schedule's group, which must be the mesh's ``tp``
   group (:func:`create_schedule` makes it so). Skipped with ``apply_schedule=False``
   (the caller applied its own primitives). **Loss parallelism** (the schedule's
   ``loss_parallel`` knob: the head split along the vocabulary, its logits not gathered)
   with ``layout.loss="parallel"``, and with ``"chunked"`` (the default) wherever it
   applies: ``tp > 1``, the model's schedule takes the knob, its head is not tied to the
   embedding and the degree divides its vocabulary (otherwise the logits stay whole:
   :func:`loss_plan`).
2. **Context parallelism** (``cp > 1``): ``context_parallel`` at the model over the
   mesh's ``cp`` group. **Expert parallelism** (``ep > 1``): ``expert_parallel`` at the
   model over its ``ep`` group (each rank keeps ``E / ep`` experts of every
   mixture-of-experts module; :attr:`Parallelized.experts`); the experts are left out of
   DDP and of FSDP2 (``ignored_params``), and :meth:`Parallelized.reduce_gradients`
   averages their gradients over the data-parallel ranks that hold the same experts.
   **LoRA** (``lora=``, a :class:`~torchloom.parallel.lora.LoraSpec`): the ``lora``
   primitive at the model, after its shards and syncs (the adapters follow the shards),
   the rest frozen (optionally in bf16); :meth:`Parallelized.parameters` is then the
   adapters.
3. **Pipeline cuts** (``pp > 1``): the model is traced down to the layers of its first
   stack of layers (:func:`~torchloom.core.rules.layer_stacks`) and a stage ends after
   each layer of ``layout.cuts`` (an even split of ``pp x stages_per_rank`` stages by
   default). The cuts are marked before the layers are wrapped for checkpointing, since
   a trace does not enter a checkpointed layer; the model is split at build.
4. **Activation checkpointing**: the first ``ckpt_ratio`` of every stack's layers, or
   all of them under ``ac="full"`` (recompute everything) or ``ac="op"`` (op-level
   selective), with the ``checkpoint`` primitive.
5. **Compile** (``layout.compile``): each layer of the stacks, with ``compile``. Float8
   (``layout.float8``, CUDA and torchao: :mod:`torchloom.ops.float8`) has by then
   replaced the layers' linear layers (after step 2); ``layout.async_tp`` is refused
   (planner only for now).
6. **Build**: materialise (``weights``: each rank reads its own slices), then the data
   parallelism, per pipeline stage: FSDP2 ``fully_shard`` of each layer and of the root
   (of each stage module under a pipeline) over ``dp_shard`` (``dp_shard x cp`` with
   context parallelism, the ``cp`` ranks alone with ``layout.shard_cp``; HSDP: the 2-D
   ``(dp_replicate, shards)`` mesh), with the layout's ``MixedPrecisionPolicy``; DDP
   over the ``dp`` group (``dp x cp``) without FSDP (under a pipeline, :meth:`Parallelized.reduce_gradients`
   averages the gradients after each step).

A training loop calls :meth:`Parallelized.reduce_gradients` after each step's backward
(before clipping and the optimizer): it does nothing unless a pipeline without FSDP2 or
expert parallelism leaves gradients to average (``torchloom train`` and the planner's
validation call it).

After the build, the loss: :func:`~torchloom.ops.loss.set_loss` makes a
transformers causal LM compute ``layout.loss`` (over the tensor-parallel group when the
logits are split), and a pipeline's last stage computes
:attr:`Parallelized.next_token_loss` unless the caller gave its own ``loss_fn``.

Everything it did is recorded in the :class:`Parallelized` it returns (the modules it
checkpointed, the layers after which stages end, the FSDP2 units, the mesh dimension
each piece used, the loss and whether the logits are split), so two callers can be
checked to have built the same thing.

>>> import torch
>>> from torchloom.parallel.layout import Layout
>>> from torchloom.schedules import zoo
>>> model = zoo.make_model("llama")
>>> done = parallelize(create_schedule(model, None), Layout(ckpt_ratio=0.5))
>>> done.stacks, done.checkpointed, done.loss, done.vocab_sharded
(['model.layers'], ['model.layers.0'], 'chunked', False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import LayoutError, ModelSizeError
from ..core.marks import CHECKPOINTED, CONTEXT_PARALLEL, LORA, get_mark, has_mark, set_mark
from ..core.rules import layer_stacks
from ..core.schedule import Schedule, join_path
from ..core.schedule import create_schedule as _create_schedule
from ..ops.float8 import FIX as FLOAT8_FIX
from ..ops.float8 import apply_float8, float8_problem
from ..ops.loss import is_causal_lm, next_token_loss, set_loss
from ..runtime.build import build
from ..runtime.causal_mask import unpacked_sequences
from ..runtime.collectives import guard_collective
from ..runtime.expert_dispatch import expert_gradients, split_experts
from ..runtime.mesh import Mesh
from ..runtime.parallel import fully_shard_model
from ..schedules._common import loss_parallel_head, node_at
from .context_pipeline import (
    ContextParallelLoss,
    ContextParallelPipeline,
    local_inputs,
)
from .layout import Layout
from .lora import LoraSpec, apply_lora
from .mesh import PIECES

__all__ = ["Parallelized", "create_schedule", "loss_plan", "mp_policy", "parallelize"]

_PRIMITIVE = "parallelize"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def create_schedule(model: nn.Module, mesh: Mesh | None) -> Schedule:
    """The schedule of ``model`` over the mesh's tensor-parallel group (one rank: no
    group)."""
    return _create_schedule(model, group=mesh.group("tp") if mesh is not None else None)


@dataclass
class Parallelized:
    """What :func:`parallelize` built, and how."""

    model: Any
    """What a step calls: the module (FSDP2-sharded in place), its
    ``DistributedDataParallel`` wrapper, or a :class:`~torchloom.runtime.pipeline.PipelineModel`."""
    module: nn.Module
    """What ``save`` / ``load`` / ``save_pretrained`` take: the module (unwrapped), or the
    pipeline model."""
    schedule: Schedule
    layout: Layout
    mesh: Mesh | None
    stacks: list[str] = field(default_factory=list)
    """The stacks of layers (full paths)."""
    checkpointed: list[str] = field(default_factory=list)
    """The modules wrapped for activation checkpointing."""
    cut_after: list[str] = field(default_factory=list)
    """The layers after which a pipeline stage ends."""
    fsdp_units: list[str] = field(default_factory=list)
    """The modules FSDP2 shards as units (the roots besides)."""
    groups: dict[str, str] = field(default_factory=dict)
    """Piece -> the mesh dimension its collectives use (pieces in use only)."""
    ties: dict[int, int] = field(default_factory=dict)
    """id(parameter) -> the number of pipeline stages holding a copy of it."""
    loss: str = "full"
    """The loss the step computes (:data:`~torchloom.parallel.layout.LOSSES`): the
    layout's, or ``"full"`` where the model's own loss stays (not a transformers causal
    LM, a module inside a wrapper that computes the loss, a caller's ``loss_fn``)."""
    vocab_sharded: bool = False
    """Whether each tensor-parallel rank's logits hold only its ``V / tp`` columns."""
    float8: list[str] = field(default_factory=list)
    """The linear layers made torchao ``Float8Linear`` (``layout.float8``)."""
    experts: list[str] = field(default_factory=list)
    """The experts modules whose experts are split over the ``ep`` ranks (``layout.ep``)."""
    lora: LoraSpec | None = None
    """The LoRA adapters added (``lora=``): only they train."""

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the weights (:attr:`Layout.fsdp <torchloom.Layout.fsdp>`)."""
        return self.layout.fsdp

    @property
    def loss_group(self) -> Any:
        """The group the logits' vocabulary is split over (None: whole logits)."""
        if not self.vocab_sharded or self.mesh is None:
            return None
        return self.mesh.group("tp")

    @property
    def next_token_loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss of ``(logits, input_ids)`` (each position predicts the next token) for
        the logits this build makes: :func:`torchloom.ops.loss.next_token_loss` of
        :attr:`loss` over :attr:`loss_group` (a pipeline's last stage computes it); a
        context-parallel pipeline's takes this rank's logits and the whole sequences'
        targets (:class:`~torchloom.parallel.context_pipeline.ContextParallelLoss`)."""
        state = next((get_mark(m, CONTEXT_PARALLEL) for m in self.schedule.mod.modules()
                      if has_mark(m, CONTEXT_PARALLEL)), None) if self.layout.cp > 1 else None
        if state is not None and self.layout.pp > 1:
            return ContextParallelLoss(self.loss, self.loss_group, state)
        return next_token_loss(self.loss, self.loss_group)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters that train (all of them, or LoRA's adapters: the base is frozen)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def autocast(self, device_type: str) -> Any:
        """The compute dtype's autocast (the layout's ``mixed_precision``) where FSDP2's
        policy does not already cast: without FSDP2."""
        dtype = self.layout.mixed_precision
        enabled = dtype is not None and dtype != self.layout.param_dtype and not self.fsdp
        return torch.autocast(device_type, dtype=_DTYPES[dtype or "bf16"], enabled=enabled)

    def no_sync(self, skip: bool) -> Any:
        """Skip the data-parallel gradient reduction of a micro-step that is not the last
        (no pipeline: a pipeline accumulates inside its schedule)."""
        if not skip or self.layout.dp * self.layout.cp == 1 or self.layout.pp > 1:
            return contextlib.nullcontext()
        if self.fsdp:
            return _fsdp_no_sync(self.model)
        return self.model.no_sync()

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters split over the expert-parallel ranks (each rank its own experts)."""
        return split_experts(self.module)

    def reduce_gradients(self) -> None:
        """Average what backward left unaveraged; call it after each step's backward.

        * a pipeline without FSDP2: every gradient over the data-parallel replicas (FSDP2,
          and DDP without a pipeline, reduce in backward);
        * expert parallelism: the experts' gradients (each the sum over the ``ep`` ranks'
          tokens routed to it) summed over the ranks that hold the same experts and
          divided by the data-parallel degree, as DDP / FSDP2 average the rest."""
        if self.mesh is None:
            return
        if self.layout.ep > 1:
            mine = self.expert_parameters()
            whole = [p for p in mine if not hasattr(p, "to_local")]
            # over every data-parallel x context-parallel rank, as the rest
            expert_gradients(whole, self.mesh.group("ep_replicas"),
                             self.layout.dp * self.layout.cp)
            for p in mine:  # FSDP2's shards: averaged over the ep replicas in backward
                if hasattr(p, "to_local") and p.grad is not None:
                    p.grad.div_(self.layout.ep)
        if self.layout.pp == 1 or self.fsdp or self.layout.dp * self.layout.cp == 1:
            return
        # the data-parallel replicas, and the context-parallel ranks of each
        cp = self.layout.cp
        group = self.mesh.group("dp_cp" if cp > 1 else "dp")
        experts = {id(p) for p in self.expert_parameters()}
        for p in self.parameters():
            if id(p) in experts:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            with guard_collective("all_reduce", _PRIMITIVE, group):
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.layout.dp * cp)


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _fail(problem: str, values: dict[str, Any], fix: str) -> LayoutError:
    return LayoutError(problem, primitive=_PRIMITIVE, values=values, fix=fix)


ASYNC_TP_PROBLEM = ("asynchronous tensor parallelism (overlapping the sequence-parallel "
                    "collectives with the matmuls of compiled layers) is modelled by the "
                    "planner only for now: parallelize does not build it")


def _check(sch: Schedule, layout: Layout, mesh: Mesh | None,
           device: str | torch.device) -> None:
    if layout.async_tp:
        raise _fail(ASYNC_TP_PROBLEM, {"async_tp": True},
                    "Layout(async_tp=False) to build and train; plan with async_tp=True")
    if layout.float8:
        problem = float8_problem(device)
        if problem is not None:
            raise _fail(problem[0], {"float8": True, **problem[1]},
                        f"{FLOAT8_FIX}: Layout(float8=False)")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout.check_world(world)
    if world > 1 and mesh is None:
        raise _fail(f"{world} ranks and no mesh", {"world_size": world},
                    "parallelize(sch, layout, mesh=torchloom.parallel.init_mesh(layout))")
    if sch.world_size != layout.tp:
        raise _fail(f"the schedule's group has {sch.world_size} ranks and the layout's "
                    f"tensor parallelism {layout.tp}",
                    {"schedule_ranks": sch.world_size, "tp": layout.tp},
                    "make the schedule over the mesh's tp group: "
                    "torchloom.parallel.create_schedule(model, mesh)")


def _schedule_fn(root: Schedule) -> Callable[..., None] | None:
    from .. import schedules

    try:
        return schedules.schedule_for(root.mod)
    except Exception:  # noqa: BLE001 - no schedule: only the layout's own steps apply
        return None


def loss_plan(sch: Schedule, layout: Layout, *, schedule_at: str = "",
              apply_schedule: bool = True, own_loss_fn: bool = False) -> tuple[str, bool]:
    """``(loss, vocab_sharded)``: the loss :func:`parallelize` gives the model of ``sch``
    under ``layout`` and whether its logits are split along the vocabulary. Refuses
    ``loss="parallel"`` where the logits cannot be split (naming why and the fix);
    ``"chunked"`` then keeps whole logits, and a model whose loss cannot be replaced
    keeps its own (``"full"``).

    >>> from torchloom.schedules import zoo
    >>> loss_plan(create_schedule(zoo.make_model("llama"), None), Layout())
    ('chunked', False)
    >>> loss_plan(create_schedule(zoo.make_model("bert"), None), Layout())
    ('full', False)
    """
    root = node_at(sch, schedule_at)
    mode = layout.loss
    causal = schedule_at == "" and not own_loss_fn and (layout.pp > 1 or is_causal_lm(root.mod))
    if mode == "full" or layout.tp == 1:
        return (mode if causal else "full"), False
    why: tuple[str, dict[str, Any], str] | None = None
    fn = _schedule_fn(root) if apply_schedule else None
    if not causal:
        why = ("the model's loss is its own (not a transformers causal LM at the root, or "
               "the caller's loss_fn), so its logits must stay whole",
               {"model": type(root.mod).__name__, "schedule_at": schedule_at,
                "own_loss_fn": own_loss_fn}, "Layout(loss='chunked') or loss='full'")
    elif fn is None or "loss_parallel" not in getattr(fn, "knobs", ()):
        why = (f"the schedule of {type(root.mod).__name__} keeps the head whole (it takes no "
               "loss_parallel knob)", {"model": type(root.mod).__name__,
                                       "apply_schedule": apply_schedule},
               "Layout(loss='chunked') (whole logits, chunked), or a schedule that splits "
               "the head (register_schedule with @takes(..., 'loss_parallel'))")
    else:
        try:
            loss_parallel_head(root, "parallelize")
        except ModelSizeError:
            if mode == "parallel":
                raise
            why = ("", {}, "")
    if why is None:
        return mode, True
    if mode == "parallel":
        problem, values, fix = why
        raise _fail(f"loss='parallel' splits the logits along the vocabulary, and {problem}",
                    {"loss": "parallel", **values}, fix)
    return (mode if causal else "full"), False


def _apply_schedule(root: Schedule, layout: Layout, knobs: dict[str, Any]) -> None:
    from .. import schedules

    fn = _schedule_fn(root)
    if fn is None:
        if layout.tp > 1:
            raise _fail(f"{type(root.mod).__name__} has no schedule to spread over "
                        f"{layout.tp} tensor-parallel ranks", {"tp": layout.tp},
                        "Layout(tp=1), or write a schedule (torchloom.schedules.register_schedule)")
        return
    config = {"tp": layout.tp, "sequence_parallel": layout.sp, **knobs}
    schedules.apply_schedule(root, schedules.ScheduleConfig(**config))


def _stacks(sch: Schedule, schedule_at: str, stacks: list[str] | None) -> list[str]:
    if stacks is not None:
        return list(stacks)
    root = node_at(sch, schedule_at)
    return [join_path(schedule_at, path) for path in layer_stacks(root.mod)]


def _cut(sch: Schedule, layout: Layout, stacks: list[str], example_inputs: Any) -> list[str]:
    if not stacks:
        raise _fail(f"{type(sch.mod).__name__} has no stack of layers to cut into "
                    f"{layout.stages} pipeline stages", {"pp": layout.pp},
                    "Layout(pp=1), or cut it yourself with cut_pipeline_stage and build "
                    "with target='pipeline'")
    stack = stacks[0]
    count = len(sch[stack].child)
    layout.check_layers(count)
    with unpacked_sequences():  # SDPA's causal kernel, no mask sent between stages
        sch.trace_until(f"{stack}.*", example_inputs=example_inputs)
    cut_after = [f"{stack}.{cut}" for cut in layout.cuts(count)]
    for path in cut_after:
        sch[path].cut_pipeline_stage()
    return cut_after


def _checkpoint(sch: Schedule, layout: Layout, stacks: list[str]) -> list[str]:
    ratio = layout.checkpoint_ratio
    if not ratio:
        return []
    policy = "op" if layout.ac == "op" else None
    for stack in stacks:
        sch[stack].checkpoint(ratio=ratio, policy=policy)
    return [path for stack in stacks for path, _ in _items(sch, stack)
            if has_mark(sch[path].mod, CHECKPOINTED)]


def _items(sch: Schedule, stack: str) -> list[tuple[str, Schedule]]:
    return [(node.path, node) for node in sch[stack].child.values()]


def mp_policy(layout: Layout) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` of ``layout``: parameters all-gathered in the
    compute dtype (``mixed_precision``) when it differs from ``param_dtype``, gradients
    reduced in ``reduce_dtype`` (default: ``param_dtype`` under mixed precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = layout.mixed_precision if layout.mixed_precision != layout.param_dtype else None
    reduce = layout.reduce_dtype or (layout.param_dtype if param else None)
    return MixedPrecisionPolicy(param_dtype=_DTYPES[param] if param else None,
                                reduce_dtype=_DTYPES[reduce] if reduce else None)


def parallelize(sch: Schedule, layout: Layout, *, mesh: Mesh | None = None,
                device: str | torch.device = "cpu", weights: str | None = None,
                strict: bool = True, example_inputs: dict[str, torch.Tensor] | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None, schedule_at: str = "",
                apply_schedule: bool = True, knobs: dict[str, Any] | None = None,
                stacks: list[str] | None = None,
                before_build: Callable[[], None] | None = None,
                lora: LoraSpec | None = None) -> Parallelized:
    """Apply ``layout`` to the model of ``sch`` and build it (see the module docstring).

    Args:
        sch: the root schedule, made over ``mesh``'s tensor-parallel group
            (:func:`create_schedule`), not built yet.
        layout: the layout; its degrees multiply to the world size.
        mesh: :func:`torchloom.parallel.init_mesh` of ``layout`` (None for one rank).
        device, weights, strict: as :func:`torchloom.build` (each rank reads its slices
            of ``weights``; a pipeline rank only its stages').
        example_inputs: with ``pp > 1``: keyword inputs of one micro-batch (what crosses
            between stages is sized on it; ``input_ids`` is the pipeline's input).
        loss_fn: with ``pp > 1``: ``loss_fn(logits, target)`` on the last stage (default:
            :attr:`Parallelized.next_token_loss`, the layout's loss; a caller's own
            loss keeps the logits whole).
        schedule_at: the path of the module whose schedule applies (a user's module
            inside a wrapper that adds the loss).
        apply_schedule: apply the model's schedule (step 1); False when the caller
            applied its own primitives.
        knobs: more knobs of the model's schedule (kernels: ``attention``, ``fused``).
        stacks: the stacks of layers (full paths); default
            :func:`~torchloom.core.rules.layer_stacks` of the module at ``schedule_at``.
        before_build: called just before build (the random initialisation's seed).
        lora: LoRA adapters (:mod:`torchloom.parallel.lora`) on the model at
            ``schedule_at``, after its schedule and before the pipeline cuts: only they
            train (:meth:`Parallelized.parameters`).

    Raises:
        LayoutError: the degrees do not multiply to the world size, the schedule's group
            is not the layout's tensor parallelism, the layers do not split into the
            stages, a pipeline without example inputs, ``loss="parallel"`` where the
            logits cannot be split (:func:`loss_plan`).
    """
    _check(sch, layout, mesh, device)
    root = node_at(sch, schedule_at)
    done = Parallelized(model=None, module=sch.mod, schedule=sch, layout=layout, mesh=mesh)
    done.loss, done.vocab_sharded = loss_plan(sch, layout, schedule_at=schedule_at,
                                              apply_schedule=apply_schedule,
                                              own_loss_fn=loss_fn is not None)
    # 1. tensor and sequence parallelism (and loss parallelism): the model's schedule
    if apply_schedule:
        more = {"loss_parallel": True} if done.vocab_sharded else {}
        _apply_schedule(root, layout, {**(knobs or {}), **more})
    if layout.tp > 1:
        done.groups["schedule"] = PIECES["schedule"]
    # 2. context and expert parallelism
    if layout.cp > 1:
        root.context_parallel(mesh.group("cp") if mesh is not None else None)
        done.groups["context"] = PIECES["context"]
    ignored: list[str] = []
    if layout.ep > 1:
        done.experts, ignored = _experts(root, mesh, schedule_at)
        done.groups["experts"] = PIECES["experts"]
    done.stacks = _stacks(sch, schedule_at, stacks)
    # (LoRA: adapters on the sharded layers, the rest frozen)
    if lora is not None:
        if layout.float8:
            raise _fail("Float8 replaces the linear layers LoRA adapts", {"float8": True,
                        "lora": lora.text()}, "Layout(float8=False) with LoRA")
        apply_lora(root, lora)
        done.lora = lora
    # (Float8: the layers' linear layers, after their shards and syncs, with replace)
    if layout.float8:
        done.float8 = apply_float8(sch, done.stacks)
    # 3. pipeline cuts, on the traced top, before checkpointing hides the layers
    if layout.pp > 1:
        if example_inputs is None:
            raise _fail("a pipeline needs one micro-batch of example inputs",
                        {"example_inputs": False},
                        "parallelize(sch, layout, example_inputs={'input_ids': ids})")
        if loss_fn is None:  # the layout's next-token loss, on the logits this build makes
            loss_fn = done.next_token_loss
        cp_state = get_mark(root.mod, CONTEXT_PARALLEL) if layout.cp > 1 else None
        if cp_state is not None:  # the first stage takes this rank's positions and ids
            local, positions = local_inputs(example_inputs["input_ids"], cp_state)
            example_inputs = {"input_ids": local, "position_ids": positions}
        done.cut_after = _cut(sch, layout, done.stacks, example_inputs)
        done.groups["pipeline"] = PIECES["pipeline"]
    # 4. activation checkpointing
    done.checkpointed = _checkpoint(sch, layout, done.stacks)
    # 5. compile each layer
    if layout.compile:
        for stack in done.stacks:
            sch[f"{stack}.*"].compile()
    # 6. build: materialise, split, then FSDP2 / HSDP / DDP per stage
    if before_build is not None:
        before_build()
    units = [path for stack in done.stacks for path, _ in _items(sch, stack)]
    if layout.fsdp:
        done.groups["fsdp"] = PIECES["fsdp"]
        done.groups["data"] = PIECES["data"]
    elif layout.dp_replicate > 1:
        done.groups["data"] = PIECES["data"]
    policy = mp_policy(layout) if layout.fsdp else None
    if layout.pp > 1:
        wrapper = None
        if layout.fsdp:
            def wrapper(stage: nn.Module) -> nn.Module:
                return _shard_stage(stage, mesh, policy, done)
        micro: tuple[Any, ...] | dict[str, Any] = \
            (example_inputs["input_ids"],) if example_inputs else ()
        if cp_state is not None and example_inputs:
            micro = dict(example_inputs)  # input_ids and position_ids
        # stages computing in bf16 under FSDP2's policy send bf16 (what their layers make)
        send = policy.param_dtype if policy is not None else None
        pipe, _ = build(sch, target="pipeline", mesh=mesh, schedule=layout.pipeline_schedule,
                        n_microbatches=layout.micro_steps, loss_fn=loss_fn,
                        example_inputs=micro, device=device, weights=weights,
                        strict=strict, stage_wrapper=wrapper, send_dtype=send)
        done.model = done.module = pipe
        if lora is not None:  # what the adapters are, for save_adapter on the stages
            set_mark(pipe, LORA, get_mark(root.mod, LORA))
        if cp_state is not None:
            done.model = ContextParallelPipeline(pipe, cp_state)
        done.ties = {id(p): dist.get_world_size(g) for p, g in pipe.ties}
        return done
    # context-parallel ranks average their gradients too (DDP over dp x cp when no FSDP2)
    replicas = layout.dp_replicate * layout.cp
    target = "ddp" if replicas > 1 and not layout.fsdp else None
    if target == "ddp" and ignored:  # each rank's own experts: averaged by reduce_gradients
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(sch.mod, ignored)
    built, _ = build(sch, target=target, mesh=mesh, device=device, weights=weights,
                     strict=strict)
    if layout.fsdp:
        done.fsdp_units = units
        whole = shard_experts(built, mesh, policy)
        built = fully_shard_model(built, mesh, units, mp_policy=policy, ignored=whole)
    done.model = built
    if done.loss != "full" or done.vocab_sharded:
        set_loss(root.mod, done.loss, done.loss_group)
    return done


def _experts(root: Schedule, mesh: Mesh | None, schedule_at: str) -> tuple[list[str], list[str]]:
    """Split the experts of the model at ``root`` over the mesh's ``ep`` group: the paths
    of its experts modules and the names (from the top module) of their split tensors."""
    from ..primitives.expert_parallel import experts_modules, num_experts_of
    from ..runtime.expert_dispatch import expert_params

    found = experts_modules(root.mod)
    names = [join_path(join_path(schedule_at, path), pname) for path, module in found
             for pname in expert_params(module, num_experts_of(module) or 0)]
    root.expert_parallel(mesh.group("ep") if mesh is not None else None)
    return [join_path(schedule_at, path) for path, _ in found], names


def shard_experts(model: nn.Module, mesh: Mesh | None, policy: Any) -> set[nn.Parameter]:
    """FSDP2 of the experts of expert parallelism (under FSDP2): each experts module of
    ``model`` sharded over the data-parallel ranks that hold the same experts (the mesh's
    ``ep_replicas``); FSDP2 averages their gradients over those ranks, and
    :meth:`Parallelized.reduce_gradients` divides them by ``ep`` (each expert's gradient
    is the sum over its ep group's tokens: together the gradient of the mean loss;
    FSDP2's own divide factor needs a PREMUL_SUM reduction, which gloo lacks). Returns the expert parameters left
    whole, for the outer ``fully_shard`` to ignore: all of them when every data-parallel
    rank of an ep group holds its own experts alone (``dp == ep``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from ..core.marks import EXPERT_PARALLEL, has_mark
    from ..core.meta import copy_meta

    experts = set(split_experts(model))
    group = mesh.group("ep_replicas") if mesh is not None and experts else None
    if mesh is None or group is None:
        return experts
    emesh = DeviceMesh.from_group(group, device_type=mesh.root.device_type)
    kwargs: dict[str, Any] = {"mesh": emesh}
    if policy is not None:
        kwargs["mp_policy"] = policy
    for module in [m for m in model.modules() if has_mark(m, EXPERT_PARALLEL)]:
        before = dict(module.named_parameters())
        fully_shard(module, **kwargs)
        for name, param in module.named_parameters():
            if name in before:
                copy_meta(before[name], param)
    return set()


def _shard_stage(stage: nn.Module, mesh: Mesh | None, policy: Any,
                 done: Parallelized) -> nn.Module:
    """FSDP2 of one pipeline stage module: each of its layers, then the stage."""
    names = {name for name, _ in stage.named_modules() if name}
    units = []
    for stack in done.stacks:
        node = done.schedule[stack]
        for path in (child.path for child in node.child.values()):
            if path in names:
                units.append(path)
    done.fsdp_units += units
    experts = shard_experts(stage, mesh, policy)
    return fully_shard_model(stage, mesh, units, mp_policy=policy, ignored=experts)
