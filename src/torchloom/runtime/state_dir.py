"""The save directory (part of :mod:`torchloom.runtime.state`): what a save may write
into, the claim of a directory, the rename of a complete checkpoint into place, the
pointer, the cleanup of old checkpoints and of crashed saves, the listing of checkpoints
and the setting aside of damaged ones at a resume.

Nothing here is a collective: :mod:`torchloom.runtime.state` runs these on one rank of the
group (rank 0) and shares the result. Only folders and files named and filled as a save
makes them are ever removed; anything else is left in place and named.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> _describe(d)
['(empty)']
>>> _claim(os.path.join(d, "run"), 1)      # makes the directory and its pointer
>>> sorted(os.listdir(os.path.join(d, "run")))
['torchloom-checkpoints.json']
>>> shutil.rmtree(d)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from typing import Any

from ..core.errors import CheckpointIOError
from .state_files import (
    _DAMAGED_RE,
    _DCP_FILE_RE,
    _DCP_TMP_RE,
    _JSON_TMP_RE,
    _KIND_DIR,
    _OLD_MARKER,
    _OLD_RE,
    _STEP_RE,
    _TMP_RE,
    DIR_MARKER,
    FORMAT,
    STEP_MARKER,
    Checkpoint,
    _clip,
    _dir_marker,
    _file_problem,
    _fsync_dir,
    _read_checkpoint,
    _save_fix,
    _write_json_atomic,
)

# --------------------------------------------------------------------------- listing


def _ours_inside(path: str) -> bool:
    """Whether a folder holds only files a save writes (so it may be deleted)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    for entry in entries:
        full = os.path.join(path, entry)
        if os.path.islink(full) or not os.path.isfile(full):
            return False
        if not (_DCP_FILE_RE.fullmatch(entry) or _DCP_TMP_RE.fullmatch(entry)
                or entry == STEP_MARKER or _JSON_TMP_RE.fullmatch(entry)):
            return False
    return True


def _remove_ours(path: str) -> None:
    """Delete a checkpoint folder this code wrote; anything else in it: leave and warn."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    if not _ours_inside(path):
        warnings.warn(f"torchloom.save: left {path!r} in place: it holds files torchloom "
                      "did not write", stacklevel=3)
        return
    shutil.rmtree(path, ignore_errors=True)


def _describe(path: str, limit: int = 10) -> list[str]:
    """What a directory holds, for error messages: each entry with what torchloom makes
    of it."""
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return [f"(unreadable: {exc.strerror})"]
    out = []
    for entry in entries[:limit]:
        full = os.path.join(path, entry)
        note = ""
        if os.path.islink(full):
            note = " (symbolic link)"
        elif entry == DIR_MARKER:
            note = " (the torchloom marker)"
        elif entry == _OLD_MARKER:
            note = " (a checkpoint of torchloom format 1)"
        elif _TMP_RE.fullmatch(entry):
            complete = os.path.isfile(os.path.join(full, STEP_MARKER))
            note = " (interrupted save, complete)" if complete else " (interrupted save)"
        elif _DAMAGED_RE.fullmatch(entry):
            note = " (set aside at a resume: damaged)"
        elif _OLD_RE.fullmatch(entry) or _STEP_RE.fullmatch(entry):
            complete = os.path.isfile(os.path.join(full, STEP_MARKER))
            note = "" if complete else " (no marker: incomplete or damaged)"
        elif os.path.isdir(full):
            note = "/"
        out.append(entry + note)
    if len(entries) > limit:
        out.append(f"... {len(entries) - limit} more")
    return out or ["(empty)"]


def _scan(path: str) -> tuple[list[Checkpoint], list[str]]:
    """The complete checkpoints of a save directory, newest first, and the problems of the
    folders that should have been checkpoints (damaged markers)."""
    found: list[Checkpoint] = []
    problems: list[str] = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        kind = ("step" if _STEP_RE.fullmatch(entry) else "tmp" if _TMP_RE.fullmatch(entry)
                else "old" if _OLD_RE.fullmatch(entry) else None)
        if kind is None or os.path.islink(full) or not os.path.isdir(full):
            continue
        if not os.path.lexists(os.path.join(full, STEP_MARKER)):
            if kind != "tmp":  # a temporary without a marker is an interrupted save
                problems.append(f"{entry}: no marker {STEP_MARKER!r}")
            continue
        try:
            found.append(_read_checkpoint(full))
        except CheckpointIOError as exc:
            problems.append(f"{entry}: {exc.problem}")
    found.sort(key=lambda c: (c.serial, c.name.startswith("step-")), reverse=True)
    return found, problems


def list_checkpoints(path: str | os.PathLike) -> list[Checkpoint]:
    """The complete checkpoints in save directory ``path``, newest first (by save order),
    read from their markers only (no checksum is checked: :func:`find_checkpoint` does).
    An empty list when ``path`` does not exist or holds none; a single checkpoint folder
    (``<dir>/step-N``) gives itself.

    >>> import torch, tempfile
    >>> from torchloom.runtime.state import save
    >>> d = os.path.join(tempfile.mkdtemp(), "run")
    >>> m = torch.nn.Linear(2, 2)
    >>> for step in (1, 2, 3):
    ...     _ = save(m, None, d, step)
    >>> [(c.name, c.step) for c in list_checkpoints(d)]   # keep=2: the two newest
    [('step-3', 3), ('step-2', 2)]
    >>> shutil.rmtree(os.path.dirname(d))
    """
    path = os.path.normpath(os.fspath(path))
    if not os.path.isdir(path):
        return []
    if os.path.lexists(os.path.join(path, STEP_MARKER)):
        try:
            return [_read_checkpoint(path)]
        except CheckpointIOError:
            return []
    return _scan(path)[0]


def describe_dir(path: str | os.PathLike) -> list[str]:
    """What a directory holds, as torchloom sees it (for messages): its first entries, each
    noted as a complete checkpoint, an interrupted save, torchloom's marker, ...

    >>> describe_dir("/nonexistent-dir")
    ['(missing)']
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        return ["(missing)"]
    if not os.path.isdir(path):
        return ["(a file, not a directory)"]
    return _describe(path)


# --------------------------------------------------------------------------- saving into it


def _refusal(path: str, primitive: str) -> CheckpointIOError | None:
    """Why ``save`` must not write into ``path`` (None if it may)."""
    values: dict[str, Any] = {"path": path}
    save_fix = _save_fix(primitive)
    if path in (".", "..") or os.path.basename(path) in (".", ".."):
        return CheckpointIOError(
            "refusing to save into the current directory (or its parent): a save directory "
            "holds only checkpoints", primitive=primitive, values=values, fix=save_fix)
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if real == cwd or cwd.startswith(real.rstrip(os.sep) + os.sep) or real == os.sep:
        return CheckpointIOError(
            "refusing to save into the current directory or one above it: a save directory "
            "holds only checkpoints", primitive=primitive,
            values={**values, "resolves_to": real}, fix=save_fix)
    if os.path.islink(path):
        return CheckpointIOError(
            "the save directory is a symbolic link; torchloom writes only into a real "
            "directory it can check", primitive=primitive,
            values={**values, "link_to": os.readlink(path)},
            fix=f"pass the directory itself: --save-dir {real}" if primitive != "save" else
            f"pass the directory itself: save(model, optimizer, {real!r}, step)")
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return CheckpointIOError(
            "the save path is a file, not a directory; torchloom does not replace it",
            primitive=primitive, values=values, fix=save_fix)
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        return CheckpointIOError(
            f"cannot list the save directory: {exc.strerror}", primitive=primitive,
            values=values, fix="fix its permissions, or " + save_fix)
    if all(_JSON_TMP_RE.fullmatch(e) for e in entries):
        return None  # empty, or a claim that crashed before its marker was in place
    marker, problem = _dir_marker(path)
    if marker is not None:
        return None
    if _OLD_MARKER in entries:
        return CheckpointIOError(
            f"the directory holds a checkpoint of torchloom's format 1 ({_OLD_MARKER!r}); "
            f"this torchloom writes format {FORMAT} and does not replace it",
            primitive=primitive, values={**values, "contents": _describe(path, 6)},
            fix=save_fix + "; or delete the old checkpoint: shutil.rmtree(path)")
    if DIR_MARKER in entries:
        return CheckpointIOError(
            f"the directory's marker is not one torchloom wrote: {problem}",
            primitive=primitive, values={**values, "contents": _describe(path, 6)},
            fix=save_fix)
    if _recoverable(path, entries):
        return None  # its pointer was deleted: the next save writes it again
    return CheckpointIOError(
        "the directory holds files torchloom did not write; a save writes only into an "
        "empty directory or one torchloom made", primitive=primitive,
        values={**values, "contents": _describe(path, 6)}, fix=save_fix)


def _recoverable(path: str, entries: list[str]) -> bool:
    """Whether a directory without its pointer file is a save directory whose pointer was
    deleted: it holds nothing but what saves write (``step-N`` checkpoints, complete and
    matching their checksums; temporaries of saves; folders set aside at a resume) and at
    least one complete checkpoint. Reads every checkpoint's files once."""
    complete = False
    for entry in entries:
        full = os.path.join(path, entry)
        if _JSON_TMP_RE.fullmatch(entry) and os.path.isfile(full) and not os.path.islink(full):
            continue
        if os.path.islink(full) or not os.path.isdir(full):
            return False
        if _DAMAGED_RE.fullmatch(entry):
            continue  # never removed by torchloom: nothing of it is at risk
        if not (_STEP_RE.fullmatch(entry) or _TMP_RE.fullmatch(entry)
                or _OLD_RE.fullmatch(entry)) or not _ours_inside(full):
            return False
        if _STEP_RE.fullmatch(entry):
            try:
                ckpt = _read_checkpoint(full)
            except CheckpointIOError:
                return False
            files = ckpt.marker["files"]
            if any(_file_problem(full, name, files[name]) for name in sorted(files)):
                return False
            complete = True
    return complete


def writable_problem(path: str) -> str | None:
    """Why nothing can be written at ``path`` (a folder, made if missing), or None: a probe
    file is created (``O_CREAT | O_EXCL``) and removed in it, or in its nearest existing
    parent when it is missing. Permission bits do not tell (root ignores them; a
    read-only file system does not show in them), a real write does."""
    folder = os.path.abspath(path)
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder!r} is a file, not a folder: nothing can be created under it"
    probe = os.path.join(folder, f".torchloom-probe-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        return f"cannot create a file in {folder!r}: {exc.strerror or exc}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(probe)
    return None


def check_writable(path: str | os.PathLike, primitive: str = "save") -> None:
    """Raise :class:`CheckpointIOError` unless a save can write into ``path`` (see
    :func:`writable_problem`); ``torchloom train`` checks its ``--save-dir`` so before
    the first step.

    >>> check_writable("/proc/torchloom-run")
    Traceback (most recent call last):
    ...
    torchloom.core.errors.CheckpointIOError: save(...): the save directory cannot be written: ...
    """
    path = os.path.normpath(os.fspath(path))
    problem = writable_problem(path)
    if problem is not None:
        raise CheckpointIOError(
            f"the save directory cannot be written: {problem}", primitive=primitive,
            values={"path": path},
            fix="pass a directory on a writable file system: --save-dir /scratch/runs/run1"
            if primitive != "save" else "save into a writable directory: "
            "torchloom.save(model, optimizer, '/scratch/runs/run1', step)")


def check_save_dir(path: str | os.PathLike, primitive: str = "save") -> None:
    """Raise :class:`CheckpointIOError` if :func:`save` would refuse ``path``; reads only.

    A save directory is missing (it will be made), empty, or one torchloom made (it holds
    ``torchloom-checkpoints.json``). A directory of other files, a regular file, a symbolic
    link, ``.`` or the current directory is refused: a save never deletes or replaces
    anything it did not write.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> check_save_dir(os.path.join(d, "run"))            # missing: fine
    >>> open(os.path.join(d, "notes.txt"), "w").close()
    >>> check_save_dir(d)
    Traceback (most recent call last):
    ...
    torchloom.core.errors.CheckpointIOError: save(...): the directory holds files torchloom did not write; ...
    >>> shutil.rmtree(d)
    """
    error = _refusal(os.path.normpath(os.fspath(path)), primitive)
    if error is not None:
        raise error


def _claim(path: str, step: int) -> None:
    """Make ``path`` a save directory (rank 0), or raise if it is not one we may use (or
    if its ``step-N`` folder, which this save replaces, is not a checkpoint of ours)."""
    error = _refusal(path, "save")
    if error is not None:
        raise error
    final = os.path.join(path, f"step-{step}")
    if os.path.lexists(final) and (os.path.islink(final) or not os.path.isdir(final)
                                   or not _ours_inside(final)):
        raise CheckpointIOError(
            f"'step-{step}' in the save directory is not a torchloom checkpoint (it holds "
            "other files); the save of that step would replace it",
            primitive="save", values={"path": path, "contents": _describe(final, 6)},
            fix=f"move it out of the way, or {_save_fix('save')}")
    if not os.path.lexists(path):
        try:
            os.makedirs(path)
        except OSError as exc:
            raise CheckpointIOError(
                f"cannot create the save directory: {exc.strerror}", primitive="save",
                values={"path": path}, fix="fix the parent's permissions, or " + _save_fix("save")
            ) from exc
    if _dir_marker(path)[0] is None:
        steps = sorted(e for e in os.listdir(path) if _STEP_RE.fullmatch(e))
        if steps:  # _refusal found them complete: the pointer was deleted
            warnings.warn(
                f"torchloom.save: {path!r} had lost its pointer file {DIR_MARKER!r}; its "
                f"complete checkpoints ({', '.join(steps[:6])}) were checked against their "
                "checksums and the pointer is written again", stacklevel=3)
        for entry in os.listdir(path):  # a crashed claim's temporary
            if _JSON_TMP_RE.fullmatch(entry):
                os.remove(os.path.join(path, entry))
        _write_json_atomic(os.path.join(path, DIR_MARKER), {
            "torchloom": _KIND_DIR, "format": FORMAT, "latest": None, "step": None,
            "serial": 0})


# --------------------------------------------------------------------------- committing a save


def _next_serial(path: str) -> int:
    marker, _ = _dir_marker(path)
    serials = [marker["serial"]] if marker else []
    serials += [c.serial for c in _scan(path)[0]]
    return max(serials, default=0) + 1


def _write_step_marker(tmp: str, marker: dict[str, Any]) -> None:
    _write_json_atomic(os.path.join(tmp, STEP_MARKER), marker)


def _commit(path: str, tmp: str, step: int) -> str:
    """Rename the complete temporary folder to ``step-N`` (a checkpoint of the same step
    already there is renamed away first and removed by the cleanup)."""
    final = os.path.join(path, f"step-{step}")
    old = None
    if os.path.lexists(final):
        old = os.path.join(path, ".old" + os.path.basename(tmp)[len(".tmp"):])
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except Exception:
        if old is not None:
            os.rename(old, final)
        raise
    _fsync_dir(path)
    return final


def _write_pointer(path: str, checkpoint: str, marker: dict[str, Any]) -> None:
    _write_json_atomic(os.path.join(path, DIR_MARKER), {
        "torchloom": _KIND_DIR, "format": FORMAT, "latest": os.path.basename(checkpoint),
        "step": marker["step"], "serial": marker["serial"]})


def _cleanup(path: str, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (one per step); remove older ones,
    temporaries of interrupted saves and stale marker temporaries. Only folders and files
    named and filled as a save makes them are removed."""
    found, _ = _scan(path)
    kept: list[Checkpoint] = []
    steps: set[int] = set()
    for ckpt in found:  # newest first
        if ckpt.step not in steps and len(kept) < keep:
            kept.append(ckpt)
            steps.add(ckpt.step)
    names = {c.name for c in kept}
    for ckpt in found:
        if ckpt.name not in names:
            _remove_ours(ckpt.path)
    for ckpt in kept:  # a complete checkpoint a crash left under a temporary name
        final = os.path.join(path, f"step-{ckpt.step}")
        if ckpt.name != os.path.basename(final) and not os.path.lexists(final):
            os.rename(ckpt.path, final)
            names.add(os.path.basename(final))
    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if entry in names:
            continue
        if (_TMP_RE.fullmatch(entry) or _OLD_RE.fullmatch(entry)) and os.path.isdir(full):
            _remove_ours(full)
        elif _JSON_TMP_RE.fullmatch(entry) and os.path.isfile(full) \
                and not os.path.islink(full):
            os.remove(full)


# --------------------------------------------------------------------------- loading from it


def _candidates(path: str, step: int | None, primitive: str
                ) -> tuple[list[Checkpoint], list[str]]:
    """The complete checkpoints ``load`` may take from ``path``, newest first, and the
    warnings to give (damaged folders, a pointer at a missing checkpoint)."""
    missing_fix = "pass the directory given to torchloom.save(model, optimizer, path, step)"
    if not os.path.lexists(path):
        raise CheckpointIOError("no checkpoint at this path", primitive=primitive,
                                values={"path": path}, fix=missing_fix)
    if not os.path.isdir(path):
        raise CheckpointIOError("no checkpoint at this path: it is a file, not a directory",
                                primitive=primitive, values={"path": path}, fix=missing_fix)
    entries = os.listdir(path)
    notes: list[str] = []
    if STEP_MARKER in entries:  # a checkpoint folder itself
        found = [_read_checkpoint(path)]
    elif DIR_MARKER in entries or any(
            _STEP_RE.fullmatch(e) or _TMP_RE.fullmatch(e) or _OLD_RE.fullmatch(e)
            for e in entries):
        found, problems = _scan(path)
        notes += [f"skipped {p}" for p in problems]
        pointer, _ = _dir_marker(path)
        if (pointer and pointer.get("latest") and found and pointer["serial"] > found[0].serial
                and not any(p.startswith(f"{pointer['latest']}:") for p in problems)):
            notes.append(f"the pointer names {_clip(pointer['latest'])} (step "
                         f"{_clip(pointer.get('step'))}), which is missing or damaged")
    elif _OLD_MARKER in entries:
        raise CheckpointIOError(
            f"a checkpoint of torchloom's format 1 ({_OLD_MARKER!r}); this torchloom reads "
            f"format {FORMAT}", primitive=primitive, values={"path": path},
            fix="load it with the torchloom version that wrote it and save it again with "
            "this one into a new directory")
    else:
        raise CheckpointIOError(
            "no checkpoint at this path: the directory holds no torchloom checkpoint",
            primitive=primitive, values={"path": path, "contents": _describe(path, 6)},
            fix=missing_fix)
    if step is not None:
        steps = sorted({c.step for c in found})
        found = [c for c in found if c.step == step]
        if not found:
            raise CheckpointIOError(
                f"no complete checkpoint of step {step} in this directory",
                primitive=primitive, values={"path": path, "steps": steps},
                fix=f"pass one of the saved steps: load(model, optimizer, {path!r}, "
                f"step={steps[-1] if steps else 0})")
    if not found:
        raise CheckpointIOError(
            "no complete checkpoint in this directory (only interrupted or damaged saves)",
            primitive=primitive, values={"path": path, "contents": _describe(path, 6)},
            fix="train from the start (the directory holds nothing loadable), or restore "
            "the checkpoint from a copy")
    return found, notes


def _unusable_steps(path: str) -> list[str]:
    """The ``step-N`` entries of save directory ``path`` that cannot be checkpoints: a
    symbolic link, a file, a folder without a valid marker."""
    out = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if not _STEP_RE.fullmatch(entry):
            continue
        if os.path.islink(full) or not os.path.isdir(full):
            out.append(entry)
            continue
        try:
            _read_checkpoint(full)
        except CheckpointIOError:
            out.append(entry)
    return out


def _set_aside(path: str, names: list[str]) -> list[tuple[str, str]]:
    """Rename each damaged checkpoint folder ``names`` of save directory ``path`` to
    ``.damaged-step-N-<id>`` (kept, never removed by torchloom), so that the save of its
    step can write ``step-N`` again; returns ``(old, new)`` names."""
    moved = []
    for name in names:
        match = _STEP_RE.fullmatch(name) or _TMP_RE.fullmatch(name) or _OLD_RE.fullmatch(name)
        if match is None:
            continue
        new = f".damaged-step-{match.group(1)}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(os.path.join(path, name), os.path.join(path, new))
        except OSError:  # gone already (another process set it aside), or not ours to move
            continue
        moved.append((name, new))
    if moved:
        _fsync_dir(path)
    return moved
