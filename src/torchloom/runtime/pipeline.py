"""Pipeline parallelism at run time: this rank's stages, run by ``torch.distributed.pipelining``.

:func:`build_pipeline` (``build(sch, target="pipeline")``) cuts the model into stages
(:mod:`torchloom.runtime.pipeline_split`), keeps this rank's, checks the schedule with
PyTorch's simulator and wraps them in a :class:`PipelineModel`. Parameters shared by
several stages (GPT-2's ``lm_head`` and ``wte``) stay tied: after backward their gradients
are summed across the stages that hold them, so every copy takes the same optimizer step.
The split's public names (:func:`tied_weights`, ...) are reachable here too, as
``torchloom.pipeline``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..core.errors import BuildError
from ..core.marks import KEY_ORDER, PRETRAINED_INFO, TIED_KEYS, get_mark, set_mark
from ..core.schedule import join_path
from .collectives import guard_collective
from .pipeline_split import Stages, TiedWeight, cut_paths, split_stages, tied_weights

if TYPE_CHECKING:
    from ..core.schedule import Schedule

__all__ = ["cut_paths", "split_stages", "Stages", "TiedWeight", "tied_weights",
           "PipelineModel", "build_pipeline", "check_schedule", "local_stage_tensors"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""The schedules of ``torch.distributed.pipelining``, named as their classes without
``Schedule``."""
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules that run several stages per rank (default 2)."""


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import schedules

    if name not in SCHEDULES:
        raise BuildError(
            f"unknown pipeline schedule {name!r}", primitive="build",
            values={"schedule": name, "schedules": list(SCHEDULES)},
            fix="build(sch, target='pipeline', schedule='1F1B', ...)",
        )
    return getattr(schedules, f"Schedule{name}")


def stage_rank(stage: int, ranks: int, schedule: str) -> int:
    """The pipeline rank that runs ``stage``: ``stage mod ranks`` (looped), or in a V for
    ZBVZeroBubble (rank r runs stages r and 2 ranks - 1 - r).

    >>> [stage_rank(k, 2, "Interleaved1F1B") for k in range(4)]
    [0, 1, 0, 1]
    >>> [stage_rank(k, 2, "ZBVZeroBubble") for k in range(4)]
    [0, 1, 1, 0]
    """
    if schedule == "ZBVZeroBubble":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


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


def check_schedule(schedule: Any, num_ranks: int, num_stages: int, n_microbatches: int,
                   name: str = "1F1B") -> int:
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
    kind = type(schedule).__name__  # the class; ``name`` is the schedule's short name
    order: dict[int, list[Any]] | None
    if kind in ("ScheduleGPipe", "Schedule1F1B"):
        # One stage per rank: these run their own loop, and torch 2.13's
        # Schedule1F1B.pipeline_order starts the last rank at micro-batch 1; check the order
        # the runtime follows instead.
        order = _single_stage_order(kind == "Schedule1F1B", num_ranks, n_microbatches)
    else:
        order = getattr(schedule, "pipeline_order", None)
    if order is None:
        raise BuildError("this schedule exposes no action order to check", primitive="build",
                         values={"schedule": type(schedule).__name__},
                         fix="use GPipe, 1F1B or Interleaved1F1B")
    stages_per_rank = num_stages // num_ranks

    def stage_to_rank(stage: int) -> int:
        return stage_rank(stage, num_ranks, name)

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
        sub = join_path(path, name)
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
    where = join_path(path, name)
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
    mine: dict[str, torch.Tensor] = dict(real.named_parameters(remove_duplicate=False))
    mine.update(real.named_buffers(remove_duplicate=False))
    for name, tensor in [*container.named_parameters(remove_duplicate=False),
                         *container.named_buffers(remove_duplicate=False)]:
        if mine.get(name) is not tensor:
            raise BuildError(
                f"two stages hold different tensors under {join_path(path, name)!r}", path=path,
                primitive="build", values={"key": join_path(path, name)},
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
                 group: Any = None, n_microbatches: int = 1) -> None:
        super().__init__()
        self.n_microbatches = n_microbatches
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
            from .pretrained_info import describe_model

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
        from .gather_plan import gather_full_state_dict

        return gather_full_state_dict(self, group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Evaluation forward (see the class docstring): the last stage's output on the
        rank holding it, None elsewhere."""
        if type(self.schedule).__name__ == "ScheduleZBVZeroBubble":
            raise BuildError(
                "a ZBVZeroBubble pipeline cannot evaluate: torch's schedule runs its backward "
                "actions in a forward-only pass too", primitive="build",
                values={"schedule": "ZBVZeroBubble"},
                fix="build with schedule='InterleavedZeroBubble' to evaluate, or evaluate "
                "the gathered model (torchloom.full_state_dict) in one process")
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

    def step(self, *inputs: Any, target: torch.Tensor | None = None,
             **kwargs: Any) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        if not self._takes_inputs():
            inputs, kwargs = (), {}
        if self.is_last:
            self.schedule.step(*inputs, target=target, losses=losses, **kwargs)
        else:
            self.schedule.step(*inputs, **kwargs)
        # the mean over the micro-batches: each parameter once, also one that two of this
        # rank's stages share (a tied weight in ZBVZeroBubble's V)
        n = self.n_microbatches
        for param in {id(p): p for m in self.stage_modules for p in m.parameters()}.values():
            if param.grad is not None and n != 1:
                param.grad.div_(n)
        for param, group in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            # an FSDP2 shard: the holders keep the same shard of the tied weight
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            with guard_collective("all_reduce", "build", group,
                                  fix="call pipe.step(...) on every rank of the pipeline"):
                dist.all_reduce(grad, group=group)
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
    """How many stages each pipeline rank runs under ``schedule`` by default (the
    interleaved and zero-bubble schedules run two)."""
    return 2 if schedule in MULTI_STAGE else 1


def _my_stages(num_stages: int, schedule: str, group: Any) -> list[int]:
    """The stages this rank runs (:func:`stage_rank`), after checking that the schedule
    can run ``num_stages`` stages on the ranks: one per rank for GPipe and 1F1B, two or
    more for the interleaved ones, exactly two for ZBVZeroBubble."""
    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    per_rank = num_stages // ranks if schedule in MULTI_STAGE and num_stages % ranks == 0 \
        and num_stages >= 2 * ranks else stages_per_rank(schedule)
    if schedule == "ZBVZeroBubble":
        per_rank = 2
    if num_stages != ranks * per_rank:
        raise BuildError(
            f"{num_stages} stages for {ranks} pipeline ranks: {schedule} needs "
            f"{per_rank} stage{'s' if per_rank > 1 else ''} per rank",
            primitive="build", values={"stages": num_stages, "ranks": ranks, "schedule": schedule},
            fix=f"cut the model into {ranks * per_rank} stages "
            f"({ranks * per_rank - 1} cut_pipeline_stage() calls)",
        )
    return [k for k in range(num_stages) if stage_rank(k, ranks, schedule) == rank]


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
                   device: str | torch.device = "cpu",
                   stage_wrapper: Callable[[nn.Module], nn.Module] | None = None,
                   send_dtype: torch.dtype | None = None) -> PipelineModel:
    """Split, keep this rank's stages, and wrap them in the named schedule (see
    :func:`torchloom.build` with ``target="pipeline"``). ``stage_wrapper``: applied to
    each of this rank's stage modules before the runtime sees them (FSDP2's
    ``fully_shard``; it must shard in place and return the module). ``send_dtype``: the
    dtype floating-point tensors cross the cuts in (:func:`split_stages`)."""
    from torch.distributed.pipelining import PipelineStage

    _check_pipeline_args(example_inputs, loss_fn)
    cls = _schedule_class(schedule)
    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    split = split_stages(sch, example_inputs, send_dtype)
    num_stages = len(split.modules)
    mine = _my_stages(num_stages, schedule, group)
    dev = torch.device(device)
    if stage_wrapper is not None:
        for k in mine:
            if stage_wrapper(split.modules[k]) is not split.modules[k]:
                raise BuildError(
                    "stage_wrapper returned another module; it must change the stage module "
                    "in place and return it (as fully_shard does)", primitive="build",
                    values={"stage": k, "stage_wrapper": repr(stage_wrapper)},
                    fix="def stage_wrapper(stage): fully_shard(stage, ...); return stage")
    # the shapes and dtypes of what crosses, from the split (the runtime would otherwise
    # infer them by running each stage on uninitialised inputs: integer ids or targets
    # crossing a cut would be garbage there)
    metas = split.metas or [((), ())] * num_stages
    stages = [PipelineStage(split.modules[k], k, num_stages, dev, group=group,
                            input_args=metas[k][0] or None, output_args=metas[k][1] or None)
              for k in mine]
    # scale_grads=False: PipelineModel.step averages over the micro-batches itself, once
    # per parameter (torch scales per stage, twice for a weight two local stages share)
    runner = cls(stages if schedule in MULTI_STAGE else stages[0],
                 n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    simulated = check_schedule(runner, ranks, num_stages, n_microbatches, schedule)

    # Parameters held by stages on several ranks: one gradient sum per shared parameter.
    global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(ranks)]
    ties: list[tuple[nn.Parameter, Any]] = []
    for places in split.ties:
        holders = sorted({global_ranks[stage_rank(k, ranks, schedule)] for k, _ in places})
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
                         split=split, source=sch.mod, group=group,
                         n_microbatches=n_microbatches)
