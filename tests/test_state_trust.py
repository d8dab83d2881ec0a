"""A save never destroys, and a load finds what a crash left (single process).

* ``save`` writes only into a missing or empty directory or one torchloom made: a
  directory of user files, a regular file, a symbolic link, ``.`` and the current
  directory raise ``CheckpointIOError`` and are left byte for byte as they were;
* the ``keep`` newest checkpoints stay (``step-N`` folders, a JSON pointer);
* every file's SHA-256 is checked before it is read: a flipped byte names the file, a
  damaged newest checkpoint falls back to the previous one with a warning, and DCP's
  pickled ``.metadata`` is read with an unpickler that imports nothing;
* a crash at every point of a save (simulated by raising a ``BaseException``, which no
  cleanup catches, exactly where a SIGKILL could land) leaves the previous checkpoint
  loadable, ``load`` takes the newest complete one, and the next save removes the rest;
* a failed save (an ``OSError``: disk full) removes its partial files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import torchloom as tl
from torchloom.runtime import state as S
from torchloom.runtime import state_dir

POINTER = S.DIR_MARKER


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load(path, **kwargs) -> tuple[int, dict[str, torch.Tensor]]:
    model, opt = _model(99)
    step = S.load(model, opt, path, **kwargs)
    return step, _weights(model)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tree(root) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders, the target for links)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = os.readlink(full).encode()
            elif os.path.isdir(full):
                out[rel] = None
            else:
                with open(full, "rb") as f:
                    out[rel] = f.read()
    return out


class _Crash(BaseException):
    """A simulated SIGKILL: not an Exception, so no cleanup code runs."""


# --------------------------------------------------------------------------- refusals


def test_save_refuses_a_directory_of_user_files_and_leaves_it_intact(tmp_path):
    model, opt = _model(0)
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "data").mkdir()
    before = _tree(tmp_path)
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "save(...): the directory holds files torchloom did not write; a save writes only "
            "into an empty directory or one torchloom made")) as info:
        S.save(model, opt, tmp_path, step=1)
    assert str(info.value) == (
        "save(...): the directory holds files torchloom did not write; a save writes only "
        "into an empty directory or one torchloom made\n"
        f"    values: path={str(tmp_path)!r}, contents=['data/', 'notes.txt']\n"
        "    fix: save into a new directory: torchloom.save(model, optimizer, "
        "'checkpoints/run1', step)")
    assert _tree(tmp_path) == before


def test_save_refuses_a_file_a_symlink_and_the_current_directory(tmp_path, monkeypatch):
    model, opt = _model(0)
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\x00user data")
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "link"
    link.symlink_to(empty)
    before = _tree(tmp_path)
    with pytest.raises(S.CheckpointIOError, match=r"^save\(\.\.\.\): the save path is a file, "
                       r"not a directory; torchloom does not replace it\n"):
        S.save(model, opt, file, step=1)
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "save(...): the save directory is a symbolic link; torchloom writes only into a "
            "real")) as info:
        S.save(model, opt, link, step=1)
    assert str(info.value) == (
        "save(...): the save directory is a symbolic link; torchloom writes only into a real "
        "directory it can check\n"
        f"    values: path={str(link)!r}, link_to={str(empty)!r}\n"
        f"    fix: pass the directory itself: save(model, optimizer, {str(empty)!r}, step)")
    monkeypatch.chdir(empty)  # even an empty current directory: '.' is never a save dir
    for path in (".", "./", str(empty), os.path.join("..", "empty"), ".."):
        with pytest.raises(S.CheckpointIOError, match=r"(?s)refusing to save into the current "
                           r"directory.*fix: save into a new directory"):
            S.save(model, opt, path, step=1)
    assert _tree(tmp_path) == before
    # the same checks, read-only, for callers that want them up front (torchloom train)
    with pytest.raises(S.CheckpointIOError, match="the save path is a file"):
        S.check_save_dir(file)
    S.check_save_dir(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_save_refuses_an_old_format_checkpoint_and_load_names_the_format(tmp_path):
    old = tmp_path / "ckpt"
    old.mkdir()
    (old / "torchloom.pt").write_bytes(b"pickled marker")
    (old / ".metadata").write_bytes(b"pickle")
    model, opt = _model(0)
    with pytest.raises(S.CheckpointIOError, match=r"holds a checkpoint of torchloom's format 1 "
                       r"\('torchloom\.pt'\); this torchloom writes format 2"):
        S.save(model, opt, old, step=1)
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): a checkpoint of torchloom's format 1 ('torchloom.pt'); this torchloom "
            "reads format 2")) as info:
        S.load(model, opt, old)
    assert str(info.value) == (
        "load(...): a checkpoint of torchloom's format 1 ('torchloom.pt'); this torchloom "
        "reads format 2\n"
        f"    values: path={str(old)!r}\n"
        "    fix: load it with the torchloom version that wrote it and save it again with "
        "this one into a new directory")
    assert sorted(os.listdir(old)) == [".metadata", "torchloom.pt"]


def test_user_files_inside_a_save_directory_are_never_removed(tmp_path):
    path = tmp_path / "run"
    model, opt = _model(0)
    S.save(model, opt, path, step=1)
    (path / "README").write_text("mine")
    (path / "step-9").mkdir()  # looks like a checkpoint, has no marker: not ours to delete
    (path / "step-9" / "plot.png").write_bytes(b"png")
    (path / ".tmp-step-5-0123456789ab").mkdir()  # our temporary's name, a user's file
    (path / ".tmp-step-5-0123456789ab" / "keep.txt").write_text("x")
    with pytest.warns(UserWarning, match=r"left .*\.tmp-step-5-0123456789ab' in place: it "
                      "holds files torchloom did not write"):
        for step in (2, 3, 4):
            S.save(model, opt, path, step=step)
    assert sorted(os.listdir(path)) == [".tmp-step-5-0123456789ab", "README", "step-3",
                                        "step-4", "step-9", POINTER]
    assert (path / "README").read_text() == "mine"
    assert (path / "step-9" / "plot.png").read_bytes() == b"png"
    with pytest.raises(S.CheckpointIOError, match=r"(?s)'step-9' in the save directory is not a "
                       r"torchloom checkpoint \(it holds other files\).*contents=\['plot\.png'\]"):
        S.save(model, opt, path, step=9)
    assert os.listdir(path / "step-9") == ["plot.png"]
    assert not any(n.startswith(".tmp-step-9") for n in os.listdir(path))


# --------------------------------------------------------------------------- rotation


def test_keep_two_rotation_pointer_and_load_by_step(tmp_path):
    path = tmp_path / "run"
    weights = {}
    for step in (1, 2, 3, 4):
        model, opt = _model(step)
        weights[step] = _weights(model)
        written = S.save(model, opt, path, step=step, config={"lr": 0.01, "step_seen": step})
        assert written == str(path / f"step-{step}")
    assert sorted(os.listdir(path)) == ["step-3", "step-4", POINTER]
    pointer = json.loads((path / POINTER).read_text())
    assert (pointer["latest"], pointer["step"]) == ("step-4", 4)
    assert [(c.name, c.step, c.config) for c in S.list_checkpoints(path)] == [
        ("step-4", 4, {"lr": 0.01, "step_seen": 4}), ("step-3", 3, {"lr": 0.01, "step_seen": 3})]
    step, loaded = _load(path)
    assert step == 4 and _same(loaded, weights[4])
    step, loaded = _load(path, step=3)
    assert step == 3 and _same(loaded, weights[3])
    step, loaded = _load(path / "step-3")  # one checkpoint's folder
    assert step == 3 and _same(loaded, weights[3])
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): no complete checkpoint of step 1 in this directory")) as info:
        _load(path, step=1)
    assert str(info.value) == (
        "load(...): no complete checkpoint of step 1 in this directory\n"
        f"    values: path={str(path)!r}, steps=[3, 4]\n"
        f"    fix: pass one of the saved steps: load(model, optimizer, {str(path)!r}, step=4)")

    # saving a step again replaces it; keep=3 keeps three
    model, opt = _model(40)
    S.save(model, opt, path, step=4, keep=3)
    assert sorted(os.listdir(path)) == ["step-3", "step-4", POINTER]
    step, loaded = _load(path)
    assert step == 4 and _same(loaded, _weights(model))
    S.save(model, opt, path, step=5, keep=3)
    S.save(model, opt, path, step=6, keep=3)
    assert sorted(os.listdir(path)) == ["step-4", "step-5", "step-6", POINTER]


def test_save_arguments_are_checked_before_anything_is_written(tmp_path):
    model, opt = _model(0)
    for kwargs, pattern in [
        ({"keep": 0}, r"(?s)keep must be a positive int, not 0.*fix: save\(model, optimizer, path, "
                      r"step, keep=2\)"),
        ({"config": {"fn": print}}, r"config\.fn is not JSON data"),
        ({"step": -1}, r"step must be a non-negative int, not -1"),
    ]:
        with pytest.raises(S.CheckpointIOError, match=pattern):
            S.save(model, opt, tmp_path / "run", **{"step": 1, **kwargs})
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- checksums


def _flip_byte(file, offset: int = -20) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_flipped_byte_names_the_file(tmp_path):
    path = tmp_path / "run"
    model, opt = _model(0)
    S.save(model, opt, path, step=1)
    _flip_byte(path / "step-1" / "__0_0.distcp")
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): checkpoint 'step-1' (step 1) is damaged: file '__0_0.distcp' does not "
            "match the SHA-256 checksum its marker records")) as info:
        _load(path)
    assert str(info.value) == (
        "load(...): checkpoint 'step-1' (step 1) is damaged: file '__0_0.distcp' does not "
        "match the SHA-256 checksum its marker records\n"
        f"    values: path={str(path / 'step-1')!r}\n"
        "    fix: restore the file from a copy; no complete checkpoint in this directory "
        "matches its checksums")
    with open(path / "step-1" / "__0_0.distcp", "ab") as f:
        f.write(b"x")
    with pytest.raises(S.CheckpointIOError, match=r"file '__0_0\.distcp' has \d+ bytes, its "
                       r"marker records \d+"):
        _load(path)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    path = tmp_path / "run"
    first, opt = _model(1)
    S.save(first, opt, path, step=1)
    second, opt = _model(2)
    S.save(second, opt, path, step=2)
    _flip_byte(path / "step-2" / "__0_0.distcp")
    with pytest.warns(UserWarning, match=r"checkpoint '.*step-2' \(step 2\) is damaged \(file "
                      r"'__0_0\.distcp' does not match the SHA-256 checksum its marker "
                      r"records\); loading '.*step-1' \(step 1\) instead"):
        step, loaded = _load(path)
    assert step == 1 and _same(loaded, _weights(first))


def test_metadata_is_checked_before_it_is_unpickled_and_never_runs_code(tmp_path, monkeypatch):
    path = tmp_path / "run"
    model, opt = _model(0)
    S.save(model, opt, path, step=1)
    metadata = path / "step-1" / ".metadata"
    _flip_byte(metadata, 10)
    monkeypatch.setattr(S._MetadataUnpickler, "load", lambda self: pytest.fail("unpickled"))
    with pytest.raises(S.CheckpointIOError, match=r"file '\.metadata' does not match"):
        _load(path)
    monkeypatch.undo()

    # A forged checkpoint: a payload pickle with a matching checksum in the marker.
    payload = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {payload}",))

    metadata.write_bytes(pickle.dumps(Payload()))
    marker_file = path / "step-1" / S.STEP_MARKER
    marker = json.loads(marker_file.read_text())
    forged = metadata.read_bytes()
    marker["files"][".metadata"] = {"sha256": hashlib.sha256(forged).hexdigest(),
                                    "bytes": len(forged)}
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): cannot read the DCP metadata '.metadata': UnpicklingError: "
            "'posix.system' is not a DCP metadata type")) as info:
        _load(path)
    assert str(info.value).startswith(
        "load(...): cannot read the DCP metadata '.metadata': UnpicklingError: "
        "'posix.system' is not a DCP metadata type\n")
    assert not payload.exists()


def test_a_damaged_marker_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "run"
    first, opt = _model(1)
    S.save(first, opt, path, step=1)
    S.save(*_model(2), path, step=2)
    (path / "step-2" / S.STEP_MARKER).write_text('{"torchloom": "torchloom checkpoint", "form')
    with pytest.warns(UserWarning, match=r"skipped step-2: cannot read the marker "
                      r"'torchloom\.json' of checkpoint 'step-2'"):
        step, loaded = _load(path)
    assert step == 1 and _same(loaded, _weights(first))


# --------------------------------------------------------------------------- crashes

# (where, the function whose return is followed by the crash, the step load must find)
CRASH_POINTS = [
    ("during DCP's write", "_write_dcp", 2),
    ("after the checksums", "_checksums", 2),
    ("after the marker", "_write_step_marker", 3),
    ("after the rename into place", "_commit", 3),
    ("after the pointer", "_write_pointer", 3),
]


def _crash_after(monkeypatch, name: str) -> None:
    original = getattr(S, name)

    def crashing(*args, **kwargs):
        original(*args, **kwargs)
        raise _Crash(name)

    monkeypatch.setattr(S, name, crashing)


def _crash_on_call(monkeypatch, target, name: str, calls: int) -> None:
    """Crash on the ``calls``-th call of ``target.name`` (before it acts)."""
    original = getattr(target, name)
    count = [0]

    def crashing(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise _Crash(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, crashing)


@pytest.fixture
def two_saved(tmp_path):
    """A save directory with steps 1 and 2; the models whose weights they hold."""
    path = tmp_path / "run"
    models = {}
    for step in (1, 2):
        model, opt = _model(step)
        models[step] = _weights(model)
        S.save(model, opt, path, step=step)
    return path, models


@pytest.mark.parametrize(("where", "function", "expected"), CRASH_POINTS,
                         ids=[w for w, _, _ in CRASH_POINTS])
def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_checkpoint(
        two_saved, monkeypatch, where, function, expected):
    path, models = two_saved
    model, opt = _model(3)
    models[3] = _weights(model)
    _crash_after(monkeypatch, function)
    with pytest.raises(_Crash, match=rf"^{function}$"):
        S.save(model, opt, path, step=3)
    monkeypatch.undo()
    _check_after_crash(path, models, expected)


@pytest.mark.parametrize(("where", "calls", "expected"), [
    ("replacing the marker", 1, 2), ("replacing the pointer", 2, 3)])
def test_a_crash_inside_os_replace_leaves_a_loadable_checkpoint(
        two_saved, monkeypatch, where, calls, expected):
    path, models = two_saved
    model, opt = _model(3)
    models[3] = _weights(model)
    _crash_on_call(monkeypatch, os, "replace", calls)
    with pytest.raises(_Crash, match=r"^replace$"):
        S.save(model, opt, path, step=3)
    monkeypatch.undo()
    _check_after_crash(path, models, expected)


def test_a_crash_while_replacing_a_step_keeps_one_copy_of_it(two_saved, monkeypatch):
    # saving step 2 again: step-2 is renamed away, then the crash hits before the new one
    # is renamed into place; the complete new copy (a temporary) is the newest
    path, models = two_saved
    model, opt = _model(20)
    rename = os.rename

    def crash_on_the_rename_into_place(src, dst):
        if os.path.basename(src).startswith(".tmp-step-"):
            raise _Crash("rename")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_the_rename_into_place)
    with pytest.raises(_Crash, match=r"^rename$"):
        S.save(model, opt, path, step=2)
    monkeypatch.undo()
    names = sorted(os.listdir(path))
    assert names[0].startswith(".old-step-2-") and names[1].startswith(".tmp-step-2-"), names
    step, loaded = _load(path)
    assert step == 2 and _same(loaded, _weights(model))
    S.save(model, opt, path, step=4)  # keeps the new step 2 (renamed), not the old one
    assert sorted(os.listdir(path)) == ["step-2", "step-4", POINTER]
    step, loaded = _load(path, step=2)
    assert step == 2 and _same(loaded, _weights(model))


def test_a_crash_in_the_cleanup_leaves_everything_loadable(two_saved, monkeypatch):
    path, models = two_saved
    model, opt = _model(3)
    models[3] = _weights(model)
    _crash_on_call(monkeypatch, state_dir, "_remove_ours", 1)  # called by S._finish
    with pytest.raises(_Crash, match=r"^_remove_ours$"):
        S.save(model, opt, path, step=3)
    monkeypatch.undo()
    _check_after_crash(path, models, 3)


def _check_after_crash(path, models, expected: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged: no fallback warning
        step, loaded = _load(path)
    assert step == expected and _same(loaded, models[expected])
    # the next successful save keeps the two newest and removes what the crash left
    model, opt = _model(4)
    S.save(model, opt, path, step=4)
    assert sorted(os.listdir(path)) == [f"step-{expected}", "step-4", POINTER]
    assert _load(path)[0] == 4


def test_a_directory_with_only_an_interrupted_first_save(tmp_path, monkeypatch):
    path = tmp_path / "run"
    model, opt = _model(0)
    _crash_after(monkeypatch, "_checksums")
    with pytest.raises(_Crash, match=r"^_checksums$"):
        S.save(model, opt, path, step=1)
    monkeypatch.undo()
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): no complete checkpoint in this directory (only interrupted or damaged "
            "saves)")) as info:
        _load(path)
    message = str(info.value)
    assert message.startswith(
        "load(...): no complete checkpoint in this directory (only interrupted or damaged "
        f"saves)\n    values: path={str(path)!r}, contents=['.tmp-step-1-"), message
    assert message.endswith(" (interrupted save)', 'torchloom-checkpoints.json (the "
                            "torchloom marker)']\n    fix: train from the start (the directory holds "
                            "nothing loadable), or restore the checkpoint from a copy")
    S.save(model, opt, path, step=1)  # the directory is ours: the next save proceeds
    assert sorted(os.listdir(path)) == ["step-1", POINTER]


def test_a_crash_while_claiming_the_directory(tmp_path, monkeypatch):
    path = tmp_path / "run"
    model, opt = _model(0)
    _crash_on_call(monkeypatch, os, "replace", 1)
    with pytest.raises(_Crash, match=r"^replace$"):
        S.save(model, opt, path, step=1)
    monkeypatch.undo()
    assert [n.startswith(POINTER + ".tmp-") for n in os.listdir(path)] == [True]
    S.save(model, opt, path, step=1)
    assert sorted(os.listdir(path)) == ["step-1", POINTER]


def test_the_pointer_at_a_missing_checkpoint_is_reported(two_saved):
    path, models = two_saved
    for name in os.listdir(path / "step-2"):
        os.remove(path / "step-2" / name)
    os.rmdir(path / "step-2")
    with pytest.warns(UserWarning, match=r"the pointer names 'step-2' \(step 2\), which is "
                      "missing or damaged"):
        step, loaded = _load(path)
    assert step == 1 and _same(loaded, models[1])


# --------------------------------------------------------------------------- failed saves


def test_a_failed_save_removes_its_partial_files(two_saved, monkeypatch):
    path, models = two_saved
    model, opt = _model(3)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", disk_full)  # inside DCP
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "save(...): torch.distributed.checkpoint.save failed on rank(s) [0]")) as info:
        S.save(model, opt, path, step=3)
    assert str(info.value) == (
        "save(...): torch.distributed.checkpoint.save failed on rank(s) [0]\n"
        f"    values: path={str(path)!r}, failed_ranks=[0], error='OSError: [Errno 28] No "
        "space left on device'\n"
        "    fix: fix the cause (disk space, permissions) and save again; the partial files "
        "were removed and the previous checkpoints in the directory are intact")
    assert sorted(os.listdir(path)) == ["step-1", "step-2", POINTER]
    monkeypatch.undo()

    monkeypatch.setattr(S, "_write_step_marker", disk_full)  # after DCP: torchloom's marker
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "save(...): writing the checkpoint of step 3 failed: [Errno 28] No space left on "
            "device")) as info:
        S.save(model, opt, path, step=3)
    assert str(info.value).startswith(
        "save(...): writing the checkpoint of step 3 failed: [Errno 28] No space left on "
        "device\n")
    assert sorted(os.listdir(path)) == ["step-1", "step-2", POINTER]
    monkeypatch.undo()
    step, loaded = _load(path)
    assert step == 2 and _same(loaded, models[2])


def test_missing_and_foreign_directories(tmp_path):
    model, opt = _model(0)
    missing = str(tmp_path / "nope")
    with pytest.raises(S.CheckpointIOError, match=(
            r"^load\(\.\.\.\): no checkpoint at this path\n")) as info:
        S.load(model, opt, missing)
    assert str(info.value) == (
        "load(...): no checkpoint at this path\n"
        f"    values: path={missing!r}\n"
        "    fix: pass the directory given to torchloom.save(model, optimizer, path, step)")
    assert isinstance(info.value, tl.ScheduleError)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            "load(...): no checkpoint at this path: the directory holds no torchloom "
            "checkpoint")) as info:
        S.load(model, opt, tmp_path)
    assert str(info.value) == (
        "load(...): no checkpoint at this path: the directory holds no torchloom checkpoint\n"
        f"    values: path={str(tmp_path)!r}, contents=['notes.txt']\n"
        "    fix: pass the directory given to torchloom.save(model, optimizer, path, step)")
    assert S.list_checkpoints(tmp_path) == [] and S.list_checkpoints(missing) == []


# --------------------------------------------------------------------------- hostile files
# (issue 24 item 5: forged sizes, huge markers, damaged folders at a resume, a lost
# pointer, a save directory that cannot be written)


def _rewrite(step_dir, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record its checksum in the marker (a forgery: the
    checksums then hold, only the checks of the content can refuse it)."""
    (step_dir / name).write_bytes(data)
    marker_file = step_dir / S.STEP_MARKER
    marker = json.loads(marker_file.read_text())
    marker["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    marker_file.write_text(json.dumps(marker))


def _forge_metadata(step_dir, change) -> None:
    with open(step_dir / ".metadata", "rb") as f:
        metadata = S._MetadataUnpickler(f).load()
    change(metadata)
    _rewrite(step_dir, ".metadata", pickle.dumps(metadata))


def test_forged_sizes_in_the_metadata_are_refused_before_any_allocation(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = tmp_path / "run"
    S.save(*_model(0), path, step=1)
    key = "optim.state.0.weight.exp_avg"

    def huge(metadata):
        md = metadata.state_dict_metadata[key]
        md.size = torch.Size([100000, 100000])  # 40 GB of float32
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=md.size)]

    _forge_metadata(path / "step-1", huge)
    real_zeros = torch.zeros

    def zeros(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        assert torch.Size(shape).numel() < 10**6, f"allocated {shape}"
        return real_zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(S.CheckpointMismatchError, match=re.escape(
            f"load(...): optimizer state {key!r} does not fit its parameter: it claims "
            "10000000000 elements, more than its parameter '0.weight' has (32)")) as info:
        _load(path)
    assert "checkpoint_shape=torch.Size([100000, 100000]), parameter_shape=(8, 4)" in \
        str(info.value) or "checkpoint_shape=(100000, 100000), parameter_shape=(8, 4)" in \
        str(info.value)
    assert "fix: the checkpoint's '.metadata' is damaged or forged; load an earlier" in \
        str(info.value)

    # the parameter's own shape, but more bytes than the files hold for it
    S.save(*_model(0), path, step=2)

    def bigger_dtype(metadata):
        metadata.state_dict_metadata[key].properties.dtype = torch.complex128
        for index, info in metadata.storage_data.items():
            if index.fqn == key:
                info.length = 100  # fewer bytes than 32 complex numbers

    _forge_metadata(path / "step-2", bigger_dtype)
    with pytest.raises(S.CheckpointMismatchError, match=r"it claims 512 bytes, and the "
                       r"checkpoint's files hold 100 bytes of it"):
        _load(path, step=2)

    # a piece placed beyond the end of its file (DCP would read that many bytes)
    S.save(*_model(0), path, step=3)

    def far(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == key:
                info.length = 10**12

    _forge_metadata(path / "step-3", far)
    with pytest.raises(S.CheckpointIOError, match=r"(?s)the DCP metadata places a piece outside "
                       r"its file.*length=1000000000000"):
        _load(path, step=3)


def test_huge_markers_are_refused_unread_and_errors_stay_short(tmp_path):
    path = tmp_path / "run"
    first, opt = _model(1)
    S.save(first, opt, path, step=1)
    S.save(*_model(2), path, step=2)
    marker = path / "step-2" / S.STEP_MARKER
    with open(marker, "r+b") as f:  # sparse: big, and nothing to write
        f.truncate(S._MAX_MARKER_BYTES + 1)
    with pytest.warns(UserWarning, match=r"skipped step-2: cannot read the marker "
                      r"'torchloom\.json' of checkpoint 'step-2': it has 16777217 bytes, "
                      r"more than such a file can have \(16777216\)"):
        step, loaded = _load(path)
    assert step == 1 and _same(loaded, _weights(first))
    # within the limit, a field of a million characters is quoted in 80
    doc = json.loads((path / "step-1" / S.STEP_MARKER).read_text())
    doc["format"] = "x" * 10**6
    marker.write_text(json.dumps(doc))
    with pytest.warns(UserWarning) as caught:
        assert _load(path)[0] == 1
    assert [len(str(w.message)) < 500 for w in caught] == [True]
    assert re.search(r"skipped step-2: the marker 'torchloom\.json' of checkpoint 'step-2' is "
                     r"not valid: format 'x{79}\.\.\. \(1000002 characters\); this torchloom "
                     r"reads format 2", str(caught[0].message))
    with pytest.raises(S.CheckpointIOError) as info:
        S.load(*_model(9), path / "step-2")
    assert len(str(info.value)) < 1000 and "(1000002 characters)" in str(info.value)
    # the pointer: 64 KiB at most
    (path / POINTER).write_text(" " * (S._MAX_POINTER_BYTES + 1))
    with pytest.raises(S.CheckpointIOError, match=r"the directory's marker is not one "
                       r"torchloom wrote: 'torchloom-checkpoints\.json' is not readable JSON "
                       r"\(it has 65537 bytes, more than such a file can have \(65536\)\)"):
        S.check_save_dir(path)


def test_a_damaged_or_symlinked_step_is_set_aside_at_resume_so_the_next_save_works(tmp_path):
    path = tmp_path / "run"
    first, opt = _model(1)
    S.save(first, opt, path, step=2)
    S.save(*_model(2), path, step=4)
    # step-4's data file replaced by a symbolic link to an identical copy
    shard = path / "step-4" / "__0_0.distcp"
    copy = tmp_path / "copy.distcp"
    copy.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(copy)
    # and a step-6 that is a symbolic link to a folder elsewhere
    (tmp_path / "elsewhere").mkdir()
    (path / "step-6").symlink_to(tmp_path / "elsewhere")
    with pytest.warns(UserWarning) as caught:
        ckpt = S.find_checkpoint(path, set_aside=True)
    assert ckpt.step == 2
    text = "\n".join(str(w.message) for w in caught)
    assert re.search(r"set aside the damaged 'step-4' as '\.damaged-step-4-[0-9a-f]{12}', "
                     r"'step-6' as '\.damaged-step-6-[0-9a-f]{12}' \(kept for inspection", text)
    names = sorted(os.listdir(path))
    assert names[2:] == ["step-2", POINTER] and all(
        re.fullmatch(r"\.damaged-step-[46]-[0-9a-f]{12}", n) for n in names[:2])
    assert copy.exists() and (tmp_path / "elsewhere").is_dir()  # nothing deleted
    model, opt = _model(3)
    S.load_checkpoint(model, opt, ckpt)
    # the run goes on and saves steps 4 and 6 (it died here before)
    S.save(model, opt, path, step=4)
    S.save(model, opt, path, step=6)
    assert S.load(*_model(9), path) == 6
    assert {n for n in os.listdir(path) if not n.startswith(".damaged")} == \
        {"step-4", "step-6", POINTER}
    # without set_aside (a plain load), nothing is renamed
    S.save(model, opt, path, step=8)
    _flip_byte(path / "step-8" / "__0_0.distcp")
    with pytest.warns(UserWarning, match="is damaged"):
        assert S.find_checkpoint(path).step == 6
    assert (path / "step-8").is_dir()


def test_a_save_directory_without_its_pointer_is_recovered(tmp_path):
    path = tmp_path / "run"
    S.save(*_model(1), path, step=1)
    second, opt = _model(2)
    S.save(second, opt, path, step=2)
    os.remove(path / POINTER)
    S.check_save_dir(path)  # was: "the directory holds files torchloom did not write"
    assert S.load(*_model(9), path) == 2
    with pytest.warns(UserWarning, match=r"had lost its pointer file "
                      r"'torchloom-checkpoints\.json'; its complete checkpoints \(step-1, "
                      r"step-2\) were checked against their checksums"):
        S.save(second, opt, path, step=3)
    assert sorted(os.listdir(path)) == ["step-2", "step-3", POINTER]
    assert json.loads((path / POINTER).read_text())["latest"] == "step-3"
    # only a directory of complete checkpoints is taken back
    os.remove(path / POINTER)
    _flip_byte(path / "step-3" / "__0_0.distcp")
    with pytest.raises(S.CheckpointIOError, match="the directory holds files torchloom did "
                       "not write"):
        S.check_save_dir(path)
    _flip_byte(path / "step-3" / "__0_0.distcp")
    (path / "notes.txt").write_text("mine")
    with pytest.raises(S.CheckpointIOError, match="the directory holds files torchloom did "
                       "not write"):
        S.save(second, opt, path, step=4)
    assert (path / "notes.txt").read_text() == "mine"


def test_an_unwritable_save_directory_is_refused_before_training(tmp_path, monkeypatch):
    from torchloom.apps.train import TrainConfig, TrainOptionError, check_config

    (tmp_path / "file").write_text("x")
    under_a_file = str(tmp_path / "file" / "run")
    with pytest.raises(S.CheckpointIOError, match=re.escape(
            f"save(...): the save directory cannot be written: {str(tmp_path / 'file')!r} is "
            "a file, not a folder: nothing can be created under it")):
        S.check_writable(under_a_file)
    with pytest.raises(S.CheckpointIOError, match=r"(?s)torchloom train\(\.\.\.\): the save "
                       r"directory cannot be written: .* is a file, not a folder.*fix: pass a "
                       r"directory on a writable file system"):
        check_config(TrainConfig(save_dir=under_a_file))
    with pytest.raises(TrainOptionError, match=r"(?s)--save-pretrained '.*run' cannot be written: "
                       r".* is a file, not a folder.*fix: --save-pretrained /scratch/exported"):
        check_config(TrainConfig(save_pretrained=under_a_file))
    # a read-only file system (simulated: tests run as root, where chmod does not stop a
    # write), found by the probe file, and nothing is left behind
    real_open = os.open

    def read_only(file, flags, *args):
        if ".torchloom-probe-" in str(file):
            raise OSError(errno.EROFS, "Read-only file system", file)
        return real_open(file, flags, *args)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(S.CheckpointIOError, match=r"cannot create a file in '.*ro': "
                       r"Read-only file system"):
        check_config(TrainConfig(save_dir=str(tmp_path / "ro" / "run")))
    monkeypatch.undo()
    S.check_writable(tmp_path / "ro" / "run")
    assert os.listdir(tmp_path / "ro") == []
    if os.path.isdir("/sys") and S.writable_problem("/sys/torchloom-run") is not None:
        with pytest.raises(S.CheckpointIOError, match=r"cannot create a file in '/sys'"):
            S.check_writable("/sys/torchloom-run")  # a real failure, even as root
