"""``build``: turn a schedule into a trainable model, materialising delayed weights.

A large model is best scheduled *before* its weights exist: construct it under
:func:`~torchloom.init_empty_weights` (every parameter lands on the ``meta`` device,
nothing is allocated), apply primitives (``shard`` slices meta tensors for free), then call
:func:`build`, which materialises every meta tensor on a real device and initialises it
with the model's own init code. The result equals initialising the full model and then
slicing each sharded tensor, without ever holding the whole model at once in between.
How (memory, init order, what is kept): ``docs/design/build.md``.

Preconditions:
    * ``sch`` is the root :class:`~torchloom.Schedule` (``sch.root``), not a child node;
    * ``target`` is one of :data:`SUPPORTED_TARGETS`;
    * every module that holds a meta *parameter* can be initialised: it (or an ancestor)
      defines ``reset_parameters()``, or it sits inside a transformers ``PreTrainedModel``
      whose ``_init_weights`` covers it, or ``param_init_fn`` is given;
    * an optimizer is passed as a *factory* ``params -> Optimizer``, never as an
      instance: an optimizer made before ``build`` holds the meta parameters, which
      ``build`` replaces by new ones, so it would train nothing.

Before / after:

>>> import torch, torchloom as tl
>>> from torch import nn
>>> with tl.init_empty_weights():
...     model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
>>> model[0].weight.device
device(type='meta')
>>> sch = tl.create_schedule(model)
>>> sch["0"].shard("weight", 0)
>>> _ = torch.manual_seed(0)
>>> built, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
>>> built is model, built[0].weight.device, tl.shard_spec(built[0].weight).full_shape
(True, device(type='cpu'), (8, 4))
>>> _ = torch.manual_seed(0)
>>> eager = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
>>> torch.equal(built[0].weight, eager[0].weight), len(opt.param_groups[0]["params"])
(True, 4)
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .materialise import INIT_MODES, PRIMITIVE, _error, _materialise, has_meta_tensors

__all__ = ["build", "SUPPORTED_TARGETS", "PLANNED_TARGETS"]

SUPPORTED_TARGETS: tuple[str | None, ...] = (None, "ddp", "fsdp", "pipeline")
PLANNED_TARGETS: tuple[str, ...] = ("deepspeed",)


def _check_schedule(sch: Any) -> None:
    from ..core.schedule import Schedule

    if not isinstance(sch, Schedule):
        raise _error(
            f"build takes the root schedule, not a {type(sch).__name__}",
            {"sch": type(sch).__name__},
            "make a schedule first: sch = torchloom.create_schedule(model); "
            "model, opt = torchloom.build(sch)",
            path=None,
        )
    if sch.parent is not None:
        raise _error(
            "build takes the root schedule, not a child node",
            {"path": sch.path},
            "pass the root schedule: torchloom.build(sch.root)",
            path=sch.path,
        )


def _check_rebuild(sch: Any, rebuild: Any) -> None:
    """``build`` once per schedule, unless ``rebuild=True`` (see :func:`build`)."""
    if not isinstance(rebuild, bool):
        raise _error(f"rebuild must be True or False, not {rebuild!r}", {"rebuild": rebuild},
                     "torchloom.build(sch, rebuild=True)")
    if not sch._built:
        return
    if not rebuild:
        raise _error(
            "this schedule was already built; a second build would make a second optimizer "
            "(and wrapper) over the same parameters while the first ones stay in use",
            {"built_for_target": sch._built_target},
            "use the model and optimizer the first build returned; to build again on "
            "purpose (a new optimizer or target): torchloom.build(sch, rebuild=True, ...)",
        )
    if sch._built_target == "fsdp":
        raise _error(
            "a schedule built for FSDP cannot be rebuilt: fully_shard replaced its "
            "parameters by sharded DTensors in place",
            {"built_for_target": sch._built_target},
            "build a fresh model: sch = torchloom.apply_recipe(make_model(), sch.recipe); "
            "torchloom.build(sch, target='fsdp', ...)",
        )


# Primitives whose effect exists only in training mode.
_TRAINING_ONLY = ("checkpoint", "fork_rng")


def _warn_eval_mode(sch: Any) -> None:
    """One UserWarning when modules that ``checkpoint`` / ``fork_rng`` act on are in eval
    mode (``from_pretrained`` returns an eval-mode model): those primitives do nothing
    there until ``model.train()``."""
    import warnings

    idle: list[str] = []
    for entry in sch.recipe:
        if entry.primitive not in _TRAINING_ONLY or entry.path in idle:
            continue
        try:
            module = sch.mod.get_submodule(entry.path)
        except AttributeError:
            continue
        if not module.training:
            idle.append(entry.path)
    if idle:
        shown = ", ".join(repr(p) for p in idle[:4]) + (", ..." if len(idle) > 4 else "")
        warnings.warn(
            f"build: the model is in eval mode, so checkpoint / fork_rng at {shown} do "
            "nothing (no recomputation, no forked dropout) until you call model.train(); "
            "from_pretrained returns an eval-mode model. fix: model.train() before "
            "training (build keeps the mode it was given)",
            UserWarning,
            stacklevel=3,
        )


def _check_target(target: Any) -> None:
    if target in SUPPORTED_TARGETS:
        return
    planned = isinstance(target, str) and target.lower() in PLANNED_TARGETS
    problem = (f"target {target!r} is not available in this version" if planned
               else f"unknown build target {target!r}")
    raise _error(
        problem,
        {"target": target, "supported": list(SUPPORTED_TARGETS),
         "planned": list(PLANNED_TARGETS)},
        "build the scheduled module itself with target=None: model, opt = "
        "torchloom.build(sch), then wrap it yourself if needed",
    )


def _check_weights_args(init: Any, weights: Any, strict: Any) -> None:
    if init not in INIT_MODES:
        raise _error(f"unknown init mode {init!r}", {"init": init, "modes": list(INIT_MODES)},
                     "build(sch, init='full') (values of an unsharded init, sliced) or "
                     "build(sch, init='local') (each rank draws only its slices)")
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        raise _error(f"weights must be a folder path, not a {type(weights).__name__}",
                     {"weights": type(weights).__name__},
                     "build(sch, weights='path/to/save_pretrained/folder')")
    if not isinstance(strict, bool):
        raise _error(f"strict must be True or False, not {strict!r}", {"strict": strict},
                     "build(sch, weights=path, strict=True)")


def build(
    sch: Any,
    target: str | None = None,
    init_weights: bool = False,
    param_init_fn: Callable[..., Any] | None = None,
    optimizer: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None = None,
    *,
    device: str | torch.device = "cpu",
    mesh: Any = None,
    fsdp_units: list[str] | None = None,
    schedule: str = "1F1B",
    n_microbatches: int = 4,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_inputs: tuple | dict | None = None,
    rebuild: bool = False,
    weights: str | os.PathLike | None = None,
    init: str = "full",
    strict: bool = True,
    stage_wrapper: Callable[[nn.Module], nn.Module] | None = None,
    send_dtype: torch.dtype | None = None,
) -> tuple[Any, torch.optim.Optimizer | None]:
    """Materialise and return the scheduled model, and optionally its optimizer.

    Args:
        sch: the root schedule (``torchloom.create_schedule(model)``).
        target: the form of the result: None (the scheduled module itself), ``"ddp"``
            (``DistributedDataParallel`` on the data-parallel ranks) or ``"fsdp"`` (FSDP2
            ``fully_shard`` of each layer and the root); see :mod:`torchloom.runtime.parallel`;
            ``"pipeline"``: the stages cut by ``cut_pipeline_stage`` run by
            ``torch.distributed.pipelining`` (a :class:`torchloom.runtime.pipeline.PipelineModel`
            holding this rank's stages); see :mod:`torchloom.runtime.pipeline`.
            ``"deepspeed"`` is planned.
        init_weights: also re-initialise tensors that are already real (by default they
            keep their values; only ``meta`` tensors are initialised).
        param_init_fn: initialise modules with this instead of their own init code; called
            as ``fn(module)`` or ``fn(module, path)`` on every module that directly holds a
            tensor being initialised, children first.
        optimizer: a factory ``params -> Optimizer``, called on the materialised
            ``model.parameters()`` (tied weights appear once). It must be a factory: an
            optimizer created before ``build`` would hold the meta parameters that
            ``build`` replaces.
        device: where meta tensors are materialised (real tensors are not moved).
        mesh: for ``"ddp"`` / ``"fsdp"``, a mesh from :func:`torchloom.runtime.parallel.init_mesh`
            (its ``"dp"`` dimension is used) or a 1-D data-parallel mesh; None: all ranks of
            the default group are data-parallel ranks.
        fsdp_units: for ``"fsdp"``, the module paths (wildcards allowed) sharded as units
            before the root; default: every item of every ``ModuleList``.
        schedule, n_microbatches, loss_fn, example_inputs: for ``"pipeline"``: the
            schedule (``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``), the micro-batches
            per step, ``loss_fn(output, target)`` on the last stage, and one example
            micro-batch (what crosses between stages is sized on it). The pipeline runs
            on the ``"pp"`` dimension of ``mesh`` (or all ranks); the schedule is
            checked for deadlocks with PyTorch's simulator before anything runs.
        rebuild: a schedule is built once; a second ``build`` raises unless
            ``rebuild=True``. A rebuild runs build again on the same, already built
            model: the argument checks and the agreement across ranks, the
            materialisation of any tensor still on ``meta`` (none after a first build;
            with ``init_weights=True`` every tensor is initialised again, as in a first
            build), a new wrapper for ``target`` around ``sch.mod`` and a new optimizer
            from the factory. It does not undo, re-apply or replay primitives (the model
            keeps its shards, syncs and replacements, and primitives stay refused after
            build), does not unwrap or stop the previous wrapper (drop it), does not
            carry the previous optimizer's state over (the old optimizer still holds the
            same parameter objects unless they were re-initialised), and is refused
            after a ``target="fsdp"`` build (FSDP2 shards the parameters in place).
        weights: a local Hugging Face folder (``model.safetensors``, a sharded
            ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with
            ``weights_only=True``) or a torchloom checkpoint directory
            (:func:`torchloom.runtime.state.save`). Each rank reads only the slices it keeps, cast
            to the dtype of the model's tensor; what the files hold is never initialised
            (no draws, no full-size scratch); a tensor they lack is an error (see
            ``strict``). A folder with no weight files at all (a config only) is not
            a ``weights`` folder: build without ``weights`` to initialise at random.
            Real tensors the files hold are overwritten. See
            :mod:`torchloom.runtime.weights` (key renames as transformers' ``from_pretrained``).
            With ``target="pipeline"`` and a model with ``meta`` tensors, the model is
            split first (on fake values) and each rank reads and materialises only the
            tensors of its own stages; the other stages' tensors stay on ``meta`` in
            ``sch.mod``. (Without ``weights``, a pipeline build initialises the whole
            model on every rank, so that every rank draws the same values, tied weights
            included, and keeps its stages.)
        init: ``"full"`` (default): the values equal initialising the whole model and
            slicing; ``"local"``: each rank draws only its own slices,
            from a per-shard stream: faster, the same
            distribution, not the same values.
        strict: with ``weights``, a tensor of the model that the files lack is a
            :class:`~torchloom.runtime.state.CheckpointMismatchError` naming the key and
            the folder's file (the default, on every layout: one process, TP, FSDP and
            every pipeline rank, which checks the whole model); ``strict=False``
            initialises it as usual and lists it in one warning.
        stage_wrapper: for ``"pipeline"``, applied to each of this rank's stage modules
            after materialisation and before the pipeline runtime sees them (FSDP2 per
            stage: :func:`torchloom.parallelize` passes ``fully_shard``).
        send_dtype: for ``"pipeline"``, the dtype the floating-point tensors that cross a
            cut are sent in (None: as traced). :func:`torchloom.parallelize` passes bf16
            for stages that compute in bf16 under FSDP2's mixed precision.

    Returns:
        ``(model, optimizer)``: ``model`` is ``sch.mod`` (changed in place; wrapped in
        ``DistributedDataParallel`` for ``"ddp"``), ``optimizer`` is what the factory
        returned, or None.

    Raises:
        BuildError: on a bad argument, a module with meta parameters and no init code, init
            code that fails or leaves a parameter uninitialised (the model's meta tensors
            are then put back), or a tensor whose shape does not match its shard spec; a
            schedule built before (without ``rebuild=True``); an optimizer factory that
            does not return a ``torch.optim.Optimizer``.
        ScheduleMismatchError: on every rank, when the ranks of the schedule's group
            scheduled differently (another recipe line, or other local parameter
            shapes); see :mod:`torchloom.runtime.agree`. Checked before anything is
            materialised, with one small all-gather.
        CheckpointMismatchError: ``weights`` holds a tensor of another shape (the key, the
            file and both shapes are named), a fused tensor's parts only in part, a tensor
            transformers would convert, or (unless ``strict=False``) lacks a tensor of
            the model.
        CheckpointIOError: ``weights`` is not a weights folder or a file is unreadable.

    Warns:
        UserWarning: once per call, when modules that ``checkpoint`` or ``fork_rng`` act on
            are in eval mode (``from_pretrained`` returns an eval-mode model): call
            ``model.train()``; build does not change the mode.

    See ``docs/design/build.md`` for the init order and what is kept.
    """
    _check_schedule(sch)
    _check_target(target)
    _check_rebuild(sch, rebuild)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise _error(f"{device!r} is not a device: {exc}", {"device": device},
                     "pass a device such as device='cpu' or device='cuda:0'") from exc
    if dev.type == "meta":
        raise _error("cannot materialise onto the meta device", {"device": str(dev)},
                     "pass a real device, e.g. device='cpu'")
    if param_init_fn is not None and not callable(param_init_fn):
        raise _error(
            f"param_init_fn must be callable, not a {type(param_init_fn).__name__}",
            {"param_init_fn": param_init_fn},
            "pass a function: build(sch, param_init_fn=lambda module: module.reset_parameters())",
        )
    if isinstance(optimizer, torch.optim.Optimizer) or (
            optimizer is not None and not callable(optimizer)):
        raise _error(
            "optimizer must be a factory params -> Optimizer, not an optimizer instance: one "
            "made before build holds the meta parameters that build replaces",
            {"optimizer": type(optimizer).__name__},
            "build(sch, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4))",
        )
    _check_weights_args(init, weights, strict)
    _warn_eval_mode(sch)
    # Every rank of the group scheduled the same way (one small all-gather), checked
    # before anything is materialised or wrapped.
    from .agree import check_ranks_agree

    check_ranks_agree(sch, primitive=PRIMITIVE)

    pp_group = None
    keep: set[int] | None = None
    if target == "pipeline":
        from .pipeline import local_stage_tensors

        names = getattr(mesh, "mesh_dim_names", None) or ()
        pp_group = mesh["pp"].get_group() if "pp" in names else (
            mesh.get_group() if mesh is not None else None)
        if weights is not None and has_meta_tensors(sch.mod):
            # read only this rank's stages from the files: split the (meta) model first
            keep = local_stage_tensors(sch, schedule=schedule, example_inputs=example_inputs,
                                       loss_fn=loss_fn, group=pp_group)
    from .model_check import check_before_build

    check_before_build(sch.mod, dev, keep)  # config sizes; this rank's tensors fit memory
    _materialise(sch, init_weights, dev, param_init_fn, init, weights, strict, keep)
    model = sch.mod

    # Data-parallel wrapping comes last (after materialisation); FSDP2 replaces the
    # parameters, so the optimizer is made after it.
    from .parallel import wrap_data_parallel

    if target == "pipeline":
        from .pipeline import build_pipeline

        model = build_pipeline(sch, schedule=schedule, n_microbatches=n_microbatches,
                               loss_fn=loss_fn, example_inputs=example_inputs, group=pp_group,
                               device=dev, stage_wrapper=stage_wrapper,
                               send_dtype=send_dtype)
    else:
        model = wrap_data_parallel(model, target, mesh, fsdp_units)
    opt = None
    if optimizer is not None:
        try:
            opt = optimizer(model.parameters())
        except Exception as exc:
            raise _error(
                f"the optimizer factory raised {type(exc).__name__}: {exc}",
                {"optimizer": getattr(optimizer, "__name__", type(optimizer).__name__)},
                "pass a factory that takes the parameters, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)",
            ) from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise _error(
                f"the optimizer factory returned a {type(opt).__name__}, not a "
                "torch.optim.Optimizer",
                {"optimizer": getattr(optimizer, "__name__", type(optimizer).__name__),
                 "returned": type(opt).__name__},
                "return the optimizer made from the parameters: "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4)",
            )
    # primitives and a second build are refused from now on
    sch._built, sch._built_target = True, target
    return model, opt
