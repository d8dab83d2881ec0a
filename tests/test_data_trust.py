"""``--data`` is read as regular files, with bounded memory (issue 24 item 3).

* a named pipe, a socket, a device (a link to ``/dev/zero``) or a broken link, given or
  inside a data folder, is a DataError naming it, raised by ``check_config`` before any
  step; a pipe is never opened (the check cannot hang);
* the tokens are written to a memory-mapped token file: reading a large (sparse) file
  keeps the peak resident memory near one read piece, not a multiple of the file;
* a file longer than one text piece is tokenised piece by piece, with the same ids as
  whole for a byte-level BPE tokenizer; the largest id is recorded while writing.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch

from torchloom.apps import data
from torchloom.apps import train as T
from torchloom.apps.data import DataError
from torchloom.apps.jobconfig import TrainConfig


@pytest.fixture(autouse=True)
def _fresh_cache():
    data.token_info.cache_clear()
    yield
    data.token_info.cache_clear()


def _folder_with(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("to be or not to be " * 200)
    return folder


def _in_thread(fn, timeout: float = 10.0):
    """Run ``fn`` in a daemon thread; a hang fails the test instead of blocking it."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "reading --data hung"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def test_a_named_pipe_in_a_data_folder_is_refused_without_hanging(tmp_path):
    folder = _folder_with(tmp_path)
    os.mkfifo(folder / "b.pipe")
    cfg = TrainConfig(data=[str(folder)], steps=1)
    with pytest.raises(DataError, match=r"--data reads regular files only; '.*b\.pipe' is "
                       r"a named pipe \(FIFO\)(.|\n)*kind='a named pipe \(FIFO\)'(.|\n)*"
                       r"fix: pass regular text files"):
        _in_thread(lambda: T.check_config(cfg))


def test_a_named_pipe_given_as_data_is_refused(tmp_path):
    pipe = tmp_path / "fifo"
    os.mkfifo(pipe)
    with pytest.raises(DataError, match=r"'.*fifo' is a named pipe \(FIFO\)"):
        _in_thread(lambda: data.token_info((str(pipe),), None))


def test_a_link_to_dev_zero_is_refused_as_a_device(tmp_path):
    folder = _folder_with(tmp_path)
    (folder / "zero.txt").symlink_to("/dev/zero")
    with pytest.raises(DataError, match=r"'.*zero\.txt' is a character device \(through a "
                       r"symbolic link\)(.|\n)*target='/dev/zero'"):
        _in_thread(lambda: T.check_config(TrainConfig(data=[str(folder)], steps=1)))
    with pytest.raises(DataError, match=r"is a character device(.|\n)*fix: pass regular"):
        _in_thread(lambda: data.token_info(("/dev/zero",), None))


def test_a_socket_in_a_data_folder_is_refused(tmp_path):
    folder = _folder_with(tmp_path)
    sock = socket.socket(socket.AF_UNIX)
    short = Path("/tmp") / f"tl-sock-{os.getpid()}"
    try:
        sock.bind(str(short))
        os.symlink(short, folder / "s.txt")
        with pytest.raises(DataError, match=r"'.*s\.txt' is a socket"):
            _in_thread(lambda: data.text_files([str(folder)]))
    finally:
        sock.close()
        short.unlink(missing_ok=True)


def test_a_broken_link_in_a_data_folder_is_refused(tmp_path):
    folder = _folder_with(tmp_path)
    (folder / "gone.txt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"--data names a broken symbolic link(.|\n)*"
                       r"gone\.txt(.|\n)*target='.*nowhere'"):
        data.text_files([str(folder)])


def test_a_link_to_a_regular_file_is_read(tmp_path):
    folder = _folder_with(tmp_path)
    (tmp_path / "other.txt").write_text("xyz")
    (folder / "b.txt").symlink_to(tmp_path / "other.txt")
    info = data.token_info((str(folder),), None)
    assert info.files == 2 and info.tokens.numel() == 19 * 200 + 3
    assert bytes(info.tokens[-3:].tolist()) == b"xyz"


def _peak_growth(fn) -> int:
    """Bytes by which the process' peak resident set grew while ``fn`` ran."""
    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_large_sparse_file_is_read_in_bounded_memory(tmp_path):
    big = tmp_path / "sparse.txt"
    size = 128 << 20  # the old reader peaked at twice this
    with open(big, "wb") as f:
        f.truncate(size)
    out: dict[str, data.TokenInfo] = {}
    growth = _peak_growth(lambda: out.setdefault("info", data.token_info((str(big),), None)))
    info = out["info"]
    assert info.tokens.numel() == size and info.largest == 0
    # one read piece (16 MiB) and small change, whatever the file's size
    assert growth < data.READ_BYTES + (24 << 20), f"peak grew by {growth >> 20} MiB"
    # a step copies only its windows out of the map
    batch = data.window_batch(info.tokens, step=1, batch_size=4, seq_len=32, seed=0)
    assert batch.shape == (4, 32) and batch.dtype == torch.int64 and int(batch.max()) == 0


def test_the_token_file_is_unlinked_and_gives_the_same_windows(tmp_path):
    folder = _folder_with(tmp_path)
    (folder / "b.txt").write_bytes(bytes(range(256)) * 8)
    before = {p for p in os.listdir(os.environ.get("TMPDIR", "/tmp"))
              if p.startswith("torchloom-tokens-")}
    tokens = data.token_stream((str(folder),), None)
    after = {p for p in os.listdir(os.environ.get("TMPDIR", "/tmp"))
             if p.startswith("torchloom-tokens-")}
    assert after <= before
    joined = (folder / "a.txt").read_bytes() + (folder / "b.txt").read_bytes()
    expected = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
    assert tokens.dtype == torch.uint8 and torch.equal(tokens, expected)
    assert torch.equal(data.window_batch(tokens, 3, 4, 16, 7),
                       data.window_batch(expected, 3, 4, 16, 7))
    assert data.token_info((str(folder),), None).largest == 255


def test_a_long_file_is_tokenised_in_pieces_with_the_same_ids(tmp_path, monkeypatch):
    from tests.test_train_real import make_tokenizer, text

    body = text()
    model = tmp_path / "model"
    make_tokenizer(body).save_pretrained(model)
    (tmp_path / "long.txt").write_text(body * 3, encoding="utf-8")
    whole = data.token_info((str(tmp_path / "long.txt"),), str(model))
    data.token_info.cache_clear()
    monkeypatch.setattr(data, "TEXT_CHARS", 500)
    pieces = list(data._pieces(tmp_path / "long.txt"))
    assert len(pieces) > 3 and "".join(pieces) == body * 3
    assert max(len(p) for p in pieces) <= 2 * 500
    chunked = data.token_info((str(tmp_path / "long.txt"),), str(model))
    assert whole.tokens.dtype == torch.int32
    assert torch.equal(chunked.tokens, whole.tokens)
    assert chunked.largest == int(whole.tokens.max())


def test_a_full_temporary_directory_is_a_data_error(tmp_path, monkeypatch):
    folder = _folder_with(tmp_path)
    made: list[str] = []
    real = data.tempfile.NamedTemporaryFile

    class Full:
        def __init__(self, **kwargs):
            self._file = real(**kwargs)
            self.name = self._file.name
            made.append(self.name)

        def write(self, payload):
            raise OSError(28, "No space left on device")

        def close(self):
            self._file.close()

    monkeypatch.setattr(data.tempfile, "NamedTemporaryFile", Full)
    with pytest.raises(DataError, match=r"cannot write the token file: No space left on "
                       r"device(.|\n)*fix: free disk space in the temporary directory, or "
                       r"point TMPDIR"):
        data.token_info((str(folder),), None)
    assert made and not os.path.exists(made[0])  # the partial token file is removed
