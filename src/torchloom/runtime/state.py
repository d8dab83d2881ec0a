"""Checkpoints of scheduled models (``torchloom.state``): tensor-parallel, FSDP2 / HSDP
sharded, pipelined, or plain.

:func:`save` / :func:`load` write and read checkpoints with ``torch.distributed.checkpoint``
(DCP). The checkpoint holds *full-shape logical tensors*: a checkpoint written at
tensor-parallel degree 2 loads at 1, 2 or 4, one written by FSDP2 ranks loads into one
process, at TP 2 x FSDP 2 or HSDP 2 x 2, and the other way round. ``torchloom.state``
also holds :func:`full_state_dict` / :func:`full_optimizer_state_dict` (defined in
:mod:`torchloom.runtime.gather`) and :func:`init_distributed` (in
:mod:`torchloom.runtime.process_group`).

Who calls with which ``group`` (both are collectives over it; see
:mod:`~torchloom.runtime.state_group`):

* tensor parallelism, with or without DDP: the ranks of one tensor-parallel group with
  ``group=sch.group``; a save by the ranks of data-parallel rank 0 only, a load by every
  rank;
* FSDP2 / HSDP parameters (``DTensor``), with or without tensor parallelism: every rank of
  the pipeline stage, with ``group`` the process group of all its (data- x
  tensor-parallel) ranks, for a save and a load alike;
* a :class:`~torchloom.runtime.pipeline.PipelineModel` saved into one checkpoint: every
  rank of the pipeline with the group of them all (or each stage into its own directory
  with its group, as above).

The parts: :mod:`~torchloom.runtime.state_files` (names, markers, checksums),
:mod:`~torchloom.runtime.state_dir` (the save directory: claim, commit, pointer, cleanup,
set-aside), :mod:`~torchloom.runtime.state_dcp` (pieces of full-shape tensors and DCP's
planners), :mod:`~torchloom.runtime.state_group` (the group's collectives and checks),
:mod:`~torchloom.runtime.state_optim` (the optimizer's layout); every name stays
importable from here.

The format (pieces of full-shape tensors through DCP planners), the memory it takes, the
layout of a save directory, its atomicity and what the checksums do and do not protect
against are described in docs/design/checkpoints.md. In short: a save never writes into a
directory holding anything else, a crash leaves the previous checkpoint loadable, every
file is checked against its SHA-256 before it is read, and loading a checkpoint from an
untrusted source is running its code as far as the unpicklers allow.

>>> import torch, tempfile, os
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
>>> model(torch.ones(1, 4)).sum().backward(); opt.step()
>>> d = tempfile.mkdtemp()
>>> os.path.basename(save(model, opt, os.path.join(d, "run"), step=7))
'step-7'
>>> sorted(os.listdir(os.path.join(d, "run")))
['step-7', 'torchloom-checkpoints.json']
>>> fresh = torch.nn.Linear(4, 2)
>>> fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
>>> load(fresh, fresh_opt, os.path.join(d, "run"))
7
>>> torch.equal(fresh.weight, model.weight), fresh_opt.param_groups[0]["lr"]
(True, 0.1)
>>> shutil.rmtree(d)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Defined elsewhere, importable here (torchloom.state): CollectiveTimeoutError,
# guard_collective (the sync hooks' collectives use it too), the process group and the
# full state dicts; the private names of the parts through __getattr__ below.
from ..core.errors import CheckpointIOError, CollectiveTimeoutError, ScheduleError
from ..core.meta import shard_spec
from . import state_dcp, state_dir, state_files, state_group, state_optim
from .collectives import group_rank, group_size, guard_collective
from .gather import (
    CheckpointMismatchError,
    full_optimizer_state_dict,
    full_state_dict,
    is_dtensor,
)
from .gather import check_spec as check_spec
from .process_group import init_distributed
from .state_dcp import (
    _MODEL,
    _dcp_errors,
    _expected_full,
    _mismatch,
    _planners,
    _quiet,
    _safe_reader,
    _short_shape,
    _shorten,
    _stored_bytes,
    _tensor_pieces,
)
from .state_dir import (
    _candidates,
    _claim,
    _cleanup,
    _commit,
    _next_serial,
    _set_aside,
    _unusable_steps,
    _write_pointer,
    _write_step_marker,
    check_save_dir,
    check_writable,
    describe_dir,
    list_checkpoints,
    writable_problem,
)
from .state_files import (
    _DCP_FILE_RE,
    _KIND_STEP,
    FORMAT,
    Checkpoint,
    _clip,
    _clip_text,
    _file_problem,
    _is_int,
    _NotData,
    _sha256,
    _to_json,
)
from .state_files import DIR_MARKER as DIR_MARKER
from .state_files import STEP_MARKER as STEP_MARKER
from .state_group import _agree, _gather_all, _group_ranks, _on_rank0, check_layout
from .state_optim import (
    _merge_layouts,
    collect_optimizer,
    load_optimizer,
    match_groups,
    optimizer_targets,
)

__all__ = [
    "Checkpoint",
    "CheckpointIOError",
    "CheckpointMismatchError",
    "CollectiveTimeoutError",
    "check_save_dir",
    "check_writable",
    "writable_problem",
    "describe_dir",
    "find_checkpoint",
    "full_optimizer_state_dict",
    "full_state_dict",
    "guard_collective",
    "init_distributed",
    "list_checkpoints",
    "load",
    "load_checkpoint",
    "save",
]


_PARTS = (state_files, state_dir, state_dcp, state_group, state_optim)


def __getattr__(name: str) -> Any:
    """A private name of one of the parts (``torchloom.runtime.state._scan``, ...), as it
    was importable from here before the module was split. Patching one here patches it
    for this module's own functions only (``save`` calls ``_checksums``, ``_write_dcp``
    and, through ``_finish``, ``_write_step_marker``, ``_commit``, ``_write_pointer`` from
    here); patch the part's module for the others."""
    if name.startswith("_") and not name.startswith("__"):
        for part in _PARTS:
            if name in vars(part):
                return vars(part)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- save


def _to_save(tensor: torch.Tensor, key: str, group: Any, ranks: set[int]) -> Any:
    """What DCP writes of the model tensor ``tensor``: its pieces (a tensor-parallel slice,
    a DTensor shard, both), or the tensor itself."""
    check_layout(key, tensor, group, ranks, "save")
    spec = shard_spec(tensor)
    if is_dtensor(tensor) or (spec is not None and spec.world_size > 1):
        return _tensor_pieces(tensor, spec, contiguous=True)
    return tensor.detach()


def _write_dcp(state: dict[str, Any], tmp: str, path: str, group: Any) -> None:
    """Every rank writes its pieces into the temporary folder ``tmp`` (DCP)."""
    import torch.distributed.checkpoint as dcp

    with _dcp_errors("save", path, True), \
            guard_collective("torch.distributed.checkpoint.save", "save", group), _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=_planners()[0](),
                 process_group=group, no_dist=not dist.is_initialized())


def _checksums(tmp: str, group: Any) -> dict[str, dict[str, Any]]:
    """SHA-256 and size of every file DCP wrote, the files split over the ranks."""
    names = sorted(e for e in os.listdir(tmp) if _DCP_FILE_RE.fullmatch(e))
    mine = {}
    for name in names[group_rank(group)::group_size(group)]:
        digest, size = _sha256(os.path.join(tmp, name))
        mine[name] = {"sha256": digest, "bytes": size}
    out: dict[str, dict[str, Any]] = {}
    for part in _gather_all(mine, group, "save"):
        out.update(part)
    return dict(sorted(out.items()))


def _finish(path: str, tmp: str, marker: dict[str, Any], keep: int) -> str:
    """Rank 0, after every rank wrote its files: the marker (written last: the checkpoint
    is complete from then on), the rename into place, the pointer, the cleanup."""
    marker["serial"] = _next_serial(path)
    _write_step_marker(tmp, marker)
    final = _commit(path, tmp, marker["step"])
    _write_pointer(path, final, marker)
    try:
        _cleanup(path, keep)
    except OSError as exc:  # the checkpoint is saved; leftovers go next time
        warnings.warn(f"torchloom.save: could not remove old files in {path!r}: {exc}",
                      stacklevel=3)
    return final


def _model_state(model: nn.Module, trainable_only: bool) -> dict[str, Any]:
    """The model's state-dict tensors a checkpoint holds: all, or (``trainable_only``) the
    parameters that train (LoRA's adapters; the frozen base comes from its weights)."""
    state = model.state_dict(keep_vars=True)
    if not trainable_only:
        return state
    return {k: t for k, t in state.items() if isinstance(t, nn.Parameter) and t.requires_grad}


def _collect(model: nn.Module, optimizer: torch.optim.Optimizer | None, group: Any,
             trainable_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (tensors) and this rank's layout for the marker (everything else)."""
    ranks = set(_group_ranks(group))
    state: dict[str, Any] = {}
    for key, tensor in _model_state(model, trainable_only).items():
        state[_MODEL + key] = _to_save(tensor, key, group, ranks)
    optim_state, layout = collect_optimizer(model, optimizer)
    state.update(optim_state)
    return state, layout


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
         step: int, *, group: Any = None, keep: int = 2,
         config: dict[str, Any] | None = None, trainable_only: bool = False) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``, if given) at ``step`` into the
    save directory ``path``; returns the checkpoint's folder (``path/step-N``).

    A collective: every rank of ``group`` calls it with the same arguments; all ranks must
    see one file system. Which ranks, with which group (see the module docstring): with
    tensor parallelism (and DDP), the ranks of one tensor-parallel group with
    ``group=sch.group`` (data-parallel rank 0's: the replicas hold the same tensors); with
    FSDP2 / HSDP parameters, every rank of the pipeline stage with the group of them all
    (data- x tensor-parallel); a pipeline into one checkpoint: every rank of it. Pieces
    that several ranks hold are written once. A group that misses a rank of a DTensor's
    mesh, or whose ranks do not hold every piece of a tensor, raises
    :class:`CheckpointMismatchError` on every rank; so does an error any rank finds before
    writing (every rank raises it, none waits for the others).

    Preconditions: ``path`` is missing, empty, or a directory torchloom made; anything
    else (other files, a regular file, a symbolic link, ``.``) raises
    :class:`CheckpointIOError` before anything is written (see :func:`check_save_dir`).

    Guarantees: the new checkpoint becomes visible (as ``step-N``, and in the pointer
    ``torchloom-checkpoints.json``) only once complete; a crash at any point leaves the
    previous checkpoints loadable, and :func:`load` finds the newest complete one. A save
    that fails (a full disk) removes its partial files and raises. After a successful
    save the directory holds the ``keep`` newest checkpoints (one per step: saving a step
    again replaces it); older ones and the temporaries of interrupted saves, recognised
    by name and content, are removed. ``config`` (JSON data: numbers, strings, lists,
    dicts) is stored with the checkpoint (:attr:`Checkpoint.config`). ``trainable_only``:
    only the parameters that train (``requires_grad``: LoRA's adapters) and the optimizer
    state; :func:`load` then reads only those into a model whose frozen base is already
    loaded (the marker records it).

    Cost: besides DCP's write, one exchange of the ranks' layouts (names, optimizer
    hyperparameters) and the files read back once to record their SHA-256 (split over the
    ranks).
    """
    path = os.path.normpath(os.fspath(path))
    if not _is_int(step) or step < 0:
        raise CheckpointIOError(
            f"step must be a non-negative int, not {step!r}", primitive="save",
            values={"step": step}, fix="save(model, optimizer, path, step=int(step))")
    if not _is_int(keep) or keep < 1:
        raise CheckpointIOError(
            f"keep must be a positive int, not {keep!r}", primitive="save",
            values={"keep": keep}, fix="save(model, optimizer, path, step, keep=2)")
    try:
        config_json = None if config is None else _to_json(dict(config), "config")
    except (_NotData, TypeError, ValueError) as exc:
        where = exc.where if isinstance(exc, _NotData) else "config"
        raise CheckpointIOError(
            f"{where} is not JSON data", primitive="save", values={"where": where},
            fix="pass config as a dict of numbers, strings, booleans, None, lists and dicts"
        ) from None
    state: dict[str, Any] = {}
    layout: dict[str, Any] | None = None
    error: ScheduleError | None = None
    try:
        state, layout = _collect(model, optimizer, group, trainable_only)
    except ScheduleError as exc:
        error = exc
    layouts = _agree(layout, error, group, "save")
    marker = {"torchloom": _KIND_STEP, "format": FORMAT, "world_size": group_size(group),
              **_merge_layouts(layouts)}
    marker.update(step=step, config=config_json, trainable_only=bool(trainable_only))
    token = uuid.uuid4().hex[:12]

    def claim() -> str:
        _claim(path, step)
        return token

    token = _on_rank0(claim, group, "save")
    tmp = os.path.join(path, f".tmp-step-{step}-{token}")
    try:
        _write_dcp(state, tmp, path, group)
        marker["files"] = _checksums(tmp, group)
        return _on_rank0(lambda: _finish(path, tmp, marker, keep), group, "save")
    except Exception as exc:
        if group_rank(group) == 0 and os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)  # this save's partial files
        if isinstance(exc, OSError):
            raise CheckpointIOError(
                f"writing the checkpoint of step {step} failed: {exc}", primitive="save",
                values={"path": path, "step": step},
                fix="fix the cause (disk space, permissions) and save again; the partial "
                "files were removed and the previous checkpoints are intact") from exc
        raise


# --------------------------------------------------------------------------- load


def _verify(ckpt: Checkpoint, group: Any) -> str | None:
    """Check the checksum of every file of ``ckpt`` (the files split over the ranks); the
    first problem by file name, the same on every rank, or None."""
    files = ckpt.marker["files"]
    names = sorted(files)
    mine = None
    for name in names[group_rank(group)::group_size(group)]:
        problem = _file_problem(ckpt.path, name, files[name])
        if problem is not None:
            mine = (name, problem)
            break
    found = [p for p in _gather_all(mine, group, "load") if p is not None]
    return min(found)[1] if found else None


def find_checkpoint(path: str | os.PathLike, *, step: int | None = None, group: Any = None,
                    primitive: str = "load", set_aside: bool = False) -> Checkpoint:
    """The newest complete checkpoint in save directory ``path`` (or the one of ``step``)
    whose files match their checksums; a collective over ``group`` (the checksums are
    checked split over its ranks, one read of the checkpoint in all).

    ``path`` may also be one checkpoint's folder (``<dir>/step-N``). A damaged newest
    checkpoint (a file whose checksum differs, a file or marker missing) is skipped with
    a warning naming it and the file, and the previous one is taken; when none is left,
    :class:`CheckpointIOError` names the first damaged file. Raises it too when nothing
    loadable is there (the message lists what the directory holds).

    ``set_aside=True`` (a run that resumes and will save into ``path`` again): once a
    checkpoint is found, the group's rank 0 renames the damaged folders of the directory
    (those skipped, and ``step-N`` entries that are symbolic links, files or folders
    without a valid marker) to ``.damaged-step-N-<id>`` and names them in a warning: they
    are kept, and the run's save of step N can write ``step-N``. Pass it on one group per
    directory (e.g. data-parallel replica 0).
    """
    if step is not None and (not _is_int(step) or step < 0):
        raise CheckpointIOError(
            f"step must be a non-negative int, not {step!r}", primitive=primitive,
            values={"step": step}, fix=f"{primitive}(model, optimizer, path, step=8)")
    path = os.path.normpath(os.fspath(path))
    found, notes = _on_rank0(lambda: _candidates(path, step, primitive), group, primitive)
    damaged: list[tuple[Checkpoint, str]] = []
    for ckpt in found:
        problem = _verify(ckpt, group)
        if problem is None:
            if group_rank(group) == 0:
                for note in notes:
                    warnings.warn(f"torchloom.load: in {path!r}, {note}", stacklevel=2)
                for bad, why in damaged:
                    warnings.warn(
                        f"torchloom.load: checkpoint {bad.path!r} (step {bad.step}) is damaged "
                        f"({why}); loading {ckpt.path!r} (step {ckpt.step}) instead",
                        stacklevel=2)
                if set_aside and os.path.dirname(ckpt.path) == path:
                    names = {b.name for b, _ in damaged} | set(_unusable_steps(path))
                    names.discard(ckpt.name)
                    moved = _set_aside(path, sorted(names))
                    if moved:
                        warnings.warn(
                            f"torchloom.load: in {path!r}, set aside the damaged "
                            + ", ".join(f"{old!r} as {new!r}" for old, new in moved)
                            + " (kept for inspection; delete them when done), so that the "
                            "run's saves can write those steps again", stacklevel=2)
            return dataclasses.replace(ckpt, verified=True)
        damaged.append((ckpt, problem))
    bad, why = damaged[0]
    raise CheckpointIOError(
        f"checkpoint {bad.name!r} (step {bad.step}) is damaged: {why}", primitive=primitive,
        values={"path": bad.path, "damaged": [f"{c.name}: {w}" for c, w in damaged[1:]]}
        if len(damaged) > 1 else {"path": bad.path},
        fix="restore the file from a copy; no complete checkpoint in this directory matches "
        "its checksums")


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None,
         path: str | os.PathLike | Checkpoint, *, step: int | None = None,
         group: Any = None) -> int:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``) in
    their current layout, whatever the world size at save time; returns its step.

    ``path`` is a save directory (its newest complete checkpoint is loaded, or the one of
    ``step``), one checkpoint's folder, or a :class:`Checkpoint` from
    :func:`find_checkpoint` (already verified). A collective: every rank of ``group``
    calls it (which ranks, with which group: see :func:`save`; a load is by every rank).
    The model must have the checkpoint's keys and full shapes, in any layout (tensor
    parallel, FSDP2 / HSDP ``DTensor`` s, both, a pipeline rank's stages); the optimizer
    must be of the saved class, with the saved number of parameter groups, each holding
    parameters of the saved group (all of them, unless the model is a pipeline rank's
    part); the saved hyperparameters replace its own. The model's parameters are
    written in place, so it works on a model that is already built and trained. Raises
    :class:`CheckpointIOError` for a missing, incomplete or damaged checkpoint (a file
    whose SHA-256 differs from its marker's is named) and
    :class:`CheckpointMismatchError` for one that does not fit.

    Trust: the checksums catch damage, not forgery. DCP's ``.metadata`` is a pickle; it
    is read only after its checksum matched, with an unpickler that accepts DCP's
    metadata types only and tensors are read with ``torch.load(weights_only=True)``;
    still, treat a checkpoint from an untrusted source like any pickle: loading it is
    running its code, as far as those unpicklers let it.
    """
    if isinstance(path, Checkpoint):
        ckpt = path if path.verified else find_checkpoint(path.path, group=group)
    else:
        ckpt = find_checkpoint(path, step=step, group=group)
    return load_checkpoint(model, optimizer, ckpt, group=group)


def _load_targets(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  ckpt: Checkpoint, group: Any) -> tuple[Any, dict[str, Any], list[Any], Any]:
    """Everything checked before DCP reads: the reader, what it reads into (``targets``),
    the ``(read buffer, tensor)`` copies to make after, and the optimizer's matched groups
    and state buffers (None without an optimizer)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = ckpt.path
    marker = ckpt.marker
    reader = _safe_reader(path)
    try:
        full_metadata = reader.read_metadata()
        metadata = full_metadata.state_dict_metadata
        stored = {info.relative_path for info in (full_metadata.storage_data or {}).values()}
    except Exception as exc:
        raise CheckpointIOError(
            f"cannot read the DCP metadata '.metadata': {type(exc).__name__}: {exc}"[:400],
            primitive="load", values={"path": path},
            fix="the checkpoint is damaged or was not written by torchloom.save; load an "
            "earlier one") from exc
    unlisted = sorted(_clip(p) for p in stored if p not in marker["files"])
    if unlisted:
        raise CheckpointIOError(
            "the DCP metadata names files that the marker has no checksum of",
            primitive="load", values={"path": path, "files": _shorten(unlisted)},
            fix="the checkpoint was not written by torchloom.save; do not load it")
    stored_bytes = _stored_bytes(full_metadata, marker["files"], path)

    def saved_shape(key: str) -> tuple[int, ...] | None:
        md = metadata.get(key)
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    model_state = _model_state(model, marker.get("trainable_only") is True)
    saved_keys = [k[len(_MODEL):] for k in metadata if k.startswith(_MODEL)]
    missing = [k for k in model_state if _MODEL + k not in metadata]
    # a pipeline rank holds some stages: the other stages' keys are not unexpected
    whole = getattr(model, "all_state_dict_keys", None)
    known = set(whole()) if callable(whole) else model_state
    unexpected = [_clip_text(k, 80) for k in saved_keys if k not in known]
    if missing or unexpected:
        raise _mismatch(
            "the checkpoint holds another model: its keys differ from the model's",
            {"path": path, "missing_keys": _shorten(missing),
             "unexpected_keys": _shorten(unexpected)},
            "load it into the model it was saved from (same architecture and config), or "
            "load it into that model and copy the matching tensors over")
    wrong = [(k, _short_shape(saved_shape(_MODEL + k)), _expected_full(t))
             for k, t in model_state.items() if saved_shape(_MODEL + k) != _expected_full(t)]
    if wrong:
        raise _mismatch(
            "full shapes differ between the checkpoint and the model",
            {"path": path, "shapes (key, checkpoint, model)": _shorten(wrong)},
            "load into a model with the saved configuration (check hidden sizes, vocab size, "
            "number of heads)")

    ranks = set(_group_ranks(group))
    targets: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read buffer, tensor)
    for key, tensor in model_state.items():
        check_layout(key, tensor, group, ranks, "load")
        spec = shard_spec(tensor)
        if is_dtensor(tensor) or (spec is not None and spec.world_size > 1):
            target: Any = _tensor_pieces(tensor, spec, contiguous=False)  # views: in place
        else:
            local = tensor.detach()
            target = local if local.is_contiguous() else torch.empty_like(
                local, memory_format=torch.contiguous_format)
            if target is not local:
                copies.append((target, tensor))
        targets[_MODEL + key] = target

    optim: Any = None
    if optimizer is not None:
        if not marker["has_optimizer"]:
            raise _mismatch(
                "the checkpoint holds no optimizer state", {"path": path},
                "load(model, None, path), or save with the optimizer: "
                "save(model, optimizer, path, step)")
        groups = match_groups(model, optimizer, marker, path)
        if marker["optimizer_class"] != type(optimizer).__name__:
            saved_class = _clip_text(str(marker["optimizer_class"]), 80)
            raise _mismatch(
                "the checkpoint holds the state of another optimizer class",
                {"path": path, "checkpoint": saved_class,
                 "optimizer": type(optimizer).__name__},
                f"load it into a {saved_class} optimizer")
        optim = groups, optimizer_targets(groups, marker, metadata, stored_bytes, path, targets)
    return reader, targets, copies, optim


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    ckpt: Checkpoint, *, group: Any = None) -> int:
    """Read the verified checkpoint ``ckpt`` (from :func:`find_checkpoint`) into ``model``
    (and ``optimizer``), in place; returns its step. A collective over ``group`` (who
    calls with which group: see :func:`save`); a checkpoint that does not fit one rank's
    part raises on every rank. The model's parameters must be real tensors (not meta);
    they keep their identity, and a DTensor's optimizer state is a DTensor like it."""
    import torch.distributed.checkpoint as dcp

    error: ScheduleError | None = None
    try:
        reader, targets, copies, optim = _load_targets(model, optimizer, ckpt, group)
    except ScheduleError as exc:
        error = exc
    _agree(None, error, group, "load")

    with _dcp_errors("load", ckpt.path, False), \
            guard_collective("torch.distributed.checkpoint.load", "load", group), _quiet():
        dcp.load(targets, storage_reader=reader, planner=_planners()[1](), process_group=group,
                 no_dist=not dist.is_initialized())

    with torch.no_grad():
        for target, tensor in copies:
            tensor.copy_(target)
    if optimizer is not None:
        groups, loads = optim
        load_optimizer(optimizer, groups, ckpt.marker, loads, ckpt.path)
    return int(ckpt.marker["step"])
