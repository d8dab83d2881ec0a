"""Training text: the bytes of Python's own source (the default), or local text files
tokenised with a model folder's tokenizer (bytes without one).

The corpus is the source of the standard library: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and ``dist-packages`` excluded),
walked in sorted order and concatenated until ``max_bytes``. A token is a byte, so the
vocabulary has 256 entries and no tokenizer or download is needed. The corpus is the
same on every machine that has the same Python version.

>>> corpus = load_corpus(max_bytes=100_000)
>>> corpus.dtype, corpus.numel()
(torch.uint8, 100000)
>>> input_ids, labels = next(batches(batch_size=2, seq_len=16, seed=0, max_bytes=100_000))
>>> tuple(input_ids.shape), input_ids.dtype, bool((labels == input_ids).all())
((2, 16), torch.int64, True)
>>> again, _ = next(batches(batch_size=2, seq_len=16, seed=0, max_bytes=100_000))
>>> bool((again == input_ids).all())   # deterministic per seed
True

``torchloom train --data`` reads local files instead (:func:`token_stream`): every file
given, and every non-hidden file below a folder given (sorted), each tokenised on its
own and joined with the tokenizer's end-of-sequence token (bytes: joined as they are).
:func:`split` holds out the tail for evaluation; :func:`window_batch` draws the windows of
a step from ``(seed, step)`` alone, :func:`eval_windows` takes consecutive windows.

>>> import tempfile, os
>>> folder = tempfile.mkdtemp()
>>> _ = open(os.path.join(folder, "a.txt"), "w").write("hello world " * 50)
>>> tokens = token_stream((folder,), None)             # no tokenizer: bytes
>>> tokens.dtype, tokens.numel()
(torch.uint8, 600)
>>> train, held_out = split(tokens, 0.1)
>>> train.numel(), held_out.numel()
(540, 60)
>>> tuple(window_batch(train, step=1, batch_size=2, seq_len=16, seed=0).shape)
(2, 16)
>>> tuple(eval_windows(held_out, 8, 16).shape)        # as many as fit: 60 // 16
(3, 16)

**Files only.** ``--data`` reads regular files (a symbolic link is followed and its target
checked): a named pipe (FIFO), a socket, a character or block device (``/dev/zero``) or a
broken link is a :class:`DataError` naming it, raised before anything is read and so
before the first step. A pipe is never opened (it could block forever); files are opened
non-blocking and checked again after opening.

**Memory bound.** The tokens are not held in memory: each file is read in bounded pieces
(:data:`READ_BYTES` bytes without a tokenizer; :data:`TEXT_CHARS` characters at a time
with one: a file shorter than that is tokenised whole, as before; a longer one in pieces
cut at a single newline or space between words, where a byte-level BPE tokenizer splits
anyway, so its ids are the same) and the tokens are appended to a token
file in the temporary directory (``TMPDIR``; 1 byte a token for bytes, 4 for a tokenizer's
ids), which is then memory-mapped (``torch.from_file``) and unlinked. While reading, the
anonymous memory is one piece and its ids (about 16 MiB for bytes, tens of MiB with a
tokenizer), whatever the corpus' size; while training, a step copies only its windows
(``batch_size x seq_len`` tokens, :func:`window_batch`) out of the map, and the pages it
touched are file-backed page cache the kernel reclaims. The largest token id is recorded
while writing (:func:`token_info`), so checking it against the vocabulary reads nothing
again. The disk space used is the token file's size (on a tmpfs ``TMPDIR`` that is memory).
"""

from __future__ import annotations

import array
import contextlib
import functools
import logging
import os
import re
import stat
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.errors import DataError

_log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BYTES", "READ_BYTES", "TEXT_CHARS", "VOCAB_SIZE", "DataError",
           "TokenInfo", "batches", "eval_windows", "has_tokenizer", "load_corpus",
           "load_tokenizer", "rank_batches", "source_files", "split", "text_files",
           "token_info", "token_stream", "window_batch"]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4_000_000
READ_BYTES = 16 << 20
"""Bytes read from a data file at a time (no tokenizer)."""
TEXT_CHARS = 1 << 20
"""Characters tokenised at a time (a tokenizer); a shorter file is tokenised whole."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a model folder means it has a tokenizer."""


def source_files(root: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """The standard library's ``.py`` files, in a deterministic order.

    Directories are walked top-down with names sorted; installed third-party packages
    (``site-packages``, ``dist-packages``) are skipped.
    """
    top = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library source, as a ``uint8`` tensor.

    Raises:
        ScheduleError: no source files were found (a Python installed without them).
    """
    if max_bytes <= 0:
        raise DataError(
            "max_bytes must be positive",
            primitive="load_corpus",
            values={"max_bytes": max_bytes},
            fix="load_corpus(max_bytes=4_000_000)",
        )
    chunks: list[bytes] = []
    size = 0
    for path in source_files():
        try:
            data = path.read_bytes()
        except OSError as exc:  # a standard-library file this user cannot read: skip it
            _log.warning("skipping %s: %s", path, exc)
            continue
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    if size == 0:
        raise DataError(
            "no Python standard-library source files found",
            primitive="load_corpus",
            values={"stdlib": sysconfig.get_paths()["stdlib"]},
            fix="use a Python installation that ships its .py sources",
        )
    buffer = bytearray(b"".join(chunks))
    return torch.frombuffer(buffer, dtype=torch.uint8)


def batches(
    batch_size: int, seq_len: int, seed: int = 0, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of ``(input_ids, labels)`` from random windows of the corpus.

    Both are ``int64`` tensors of shape ``(batch_size, seq_len)``; ``labels`` equals
    ``input_ids``, which is what Hugging Face causal LMs expect (they shift the labels by
    one position themselves). The windows depend only on ``seed``.
    """
    if batch_size <= 0 or seq_len <= 0:
        raise DataError(
            "batch_size and seq_len must be positive",
            primitive="batches",
            values={"batch_size": batch_size, "seq_len": seq_len},
            fix="batches(batch_size=8, seq_len=128, seed=0)",
        )
    corpus = load_corpus(max_bytes)
    if corpus.numel() <= seq_len:
        raise DataError(
            "the corpus is shorter than one sequence",
            primitive="batches",
            values={"corpus_bytes": corpus.numel(), "seq_len": seq_len},
            fix="use a smaller seq_len or a larger max_bytes",
        )
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, corpus.numel() - seq_len + 1, (batch_size, 1),
                               generator=generator)
        input_ids = corpus[starts + offsets].long()
        yield input_ids, input_ids.clone()


# --------------------------------------------------------------------------- local text


_FIX_REGULAR = "pass regular text files (or folders of them): --data corpus/ or --data a.txt b.txt"


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, words in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISDIR, "a folder")):
        if test(mode):
            return words
    return "not a regular file"


def _not_regular(path: str | os.PathLike[str], mode: int, given: str) -> DataError:
    shown = os.fspath(path)
    values: dict[str, Any] = {"data": given, "file": shown, "kind": _kind(mode)}
    via = ""
    if os.path.islink(shown):
        values["target"] = os.path.realpath(shown)
        via = " (through a symbolic link)"
    return DataError(f"--data reads regular files only; {shown!r} is {_kind(mode)}{via}",
                     primitive="torchloom train", values=values, fix=_FIX_REGULAR)


def _stat(path: str | os.PathLike[str], given: str) -> os.stat_result:
    """``os.stat`` (symbolic links followed) of a data path; a missing one is a DataError."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise DataError("--data names a broken symbolic link", primitive="torchloom train",
                            values={"data": given, "file": os.fspath(path),
                                    "target": os.readlink(path)},
                            fix=_FIX_REGULAR) from None
        raise DataError("no such file or folder", primitive="torchloom train",
                        values={"data": given},
                        fix="--data corpus/ (text files or folders)") from None
    except OSError as exc:
        raise _unreadable(Path(path), exc) from None


def text_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The files of ``paths``: a file as it is, a folder as every non-hidden file below it
    (hidden folders skipped, names sorted; links to folders are not followed); a folder
    without any is a :class:`DataError`. Only regular files: a path (or a link's target)
    that is a named pipe, socket or device is a :class:`DataError` naming it (nothing is
    opened here)."""
    out: list[Path] = []
    for given in paths:
        top = Path(given)
        mode = _stat(top, given).st_mode
        if stat.S_ISREG(mode):
            out.append(top)
            continue
        if not stat.S_ISDIR(mode):
            raise _not_regular(top, mode, given)
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = Path(dirpath, name)
                mode = _stat(path, given).st_mode
                if not stat.S_ISREG(mode):
                    raise _not_regular(path, mode, given)
                found.append(path)
        if not found:
            raise DataError("the folder holds no files", primitive="torchloom train",
                            values={"data": given},
                            fix="put .txt files in it, or pass the files: --data a.txt b.txt")
        out += found
    return out


def has_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether a model folder holds a tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any(Path(folder, name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The folder's tokenizer (``AutoTokenizer``, local files only, no remote code)."""
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(
            os.fspath(folder), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - any failure of a user's files
        raise DataError(
            f"the tokenizer of the model folder does not load: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}", primitive="torchloom train",
            values={"folder": os.fspath(folder)},
            fix="fix or remove the tokenizer files (then the text is read as bytes)") from None


def _open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``: opened non-blocking (a file
    swapped for a pipe after :func:`text_files` looked cannot block) and checked again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode, os.fspath(path))
    return fd


class _TokenFile:
    """Tokens appended to an unlinked-on-finish file of the temporary directory, then
    memory-mapped as one 1-D tensor."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.count = 0
        self.largest = -1
        self.file = tempfile.NamedTemporaryFile(prefix="torchloom-tokens-", delete=False)

    def write(self, payload: bytes | memoryview, count: int, largest: int) -> None:
        try:
            self.file.write(payload)
        except OSError as exc:
            self.discard()
            raise DataError(
                f"cannot write the token file: {exc.strerror}", primitive="torchloom train",
                values={"token_file": self.file.name, "tokens": self.count},
                fix="free disk space in the temporary directory, or point TMPDIR at a "
                "folder with room (the token file takes 1 byte a token for bytes, 4 with "
                "a tokenizer)") from None
        self.count += count
        self.largest = max(self.largest, largest)

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.file.name)

    def tensor(self) -> torch.Tensor:
        try:
            self.file.close()
            if not self.count:
                return torch.zeros(0, dtype=self.dtype)
            return torch.from_file(self.file.name, shared=False, size=self.count,
                                   dtype=self.dtype)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.file.name)


_LINE_CUT = re.compile(r"(?<=\S)\n(?=\S)")
_WORD_CUT = re.compile(r"(?<=\S) (?=\S)")


def _cut(text: str) -> int:
    """Where to cut ``text`` (a full piece, more follows), in its second half: after the
    last single newline between two non-space characters, else before the last single
    space between two, else at the end. Byte-level BPE tokenizers (GPT-2's split at
    whitespace) give the same ids for the two sides as for the whole at either place."""
    start = len(text) // 2
    for pattern, after in ((_LINE_CUT, True), (_WORD_CUT, False)):
        last = None
        for match in pattern.finditer(text, start):
            last = match
        if last is not None:
            return last.end() if after else last.start()
    return len(text)


def _pieces(path: Path) -> Iterator[str]:
    """The text of ``path`` (UTF-8, bad bytes replaced, universal newlines, as
    ``Path.read_text`` reads it) in pieces of about :data:`TEXT_CHARS` characters."""
    fd = _open_regular(path)
    try:
        handle = open(fd, encoding="utf-8", errors="replace", closefd=False)
        pending = ""
        while True:
            try:
                chunk = handle.read(TEXT_CHARS)
            except OSError as exc:
                raise _unreadable(path, exc) from None
            if not chunk:
                if pending:
                    yield pending
                return
            pending += chunk
            if len(pending) <= TEXT_CHARS:
                continue
            cut = _cut(pending)
            yield pending[:cut]
            pending = pending[cut:]
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TokenInfo:
    """The tokens of ``--data`` (a memory-mapped 1-D tensor), their largest id (-1: none)
    and the number of files read."""

    tokens: torch.Tensor
    largest: int
    files: int


@functools.lru_cache(maxsize=2)
def token_info(paths: tuple[str, ...], tokenizer_folder: str | None) -> TokenInfo:
    """The tokens of the files of ``paths`` (see :func:`text_files`), one 1-D tensor:
    ``uint8`` bytes without a tokenizer, else ``int32`` ids of the tokenizer of
    ``tokenizer_folder``, each file tokenised without special tokens and followed by the
    end-of-sequence token (if the tokenizer has one). Read in bounded pieces and
    memory-mapped (see the module docstring for the memory bound). Cached per process."""
    files = text_files(paths)
    if tokenizer_folder is None:
        out = _TokenFile(torch.uint8)
        buffer = bytearray(READ_BYTES)
        try:
            for path in files:
                fd = _open_regular(path)
                try:
                    with open(fd, "rb", buffering=0, closefd=False) as handle:
                        while True:
                            try:
                                n = handle.readinto(buffer)
                            except OSError as exc:
                                raise _unreadable(path, exc) from None
                            if not n:
                                break
                            largest = int(torch.frombuffer(buffer, dtype=torch.uint8,
                                                           count=n).max())
                            out.write(memoryview(buffer)[:n], n, largest)
                finally:
                    os.close(fd)
        except BaseException:
            out.discard()
            raise
        return TokenInfo(out.tensor(), out.largest, len(files))
    tokenizer = load_tokenizer(tokenizer_folder)
    eos = getattr(tokenizer, "eos_token_id", None)
    out = _TokenFile(torch.int32)
    try:
        for path in files:
            for text in _pieces(path):
                ids = array.array("i", tokenizer(text, add_special_tokens=False,
                                                 verbose=False)["input_ids"])
                if ids:
                    out.write(memoryview(ids).cast("B"), len(ids), max(ids))
            if eos is not None:
                out.write(array.array("i", [int(eos)]).tobytes(), 1, int(eos))
    except BaseException:
        out.discard()
        raise
    return TokenInfo(out.tensor(), out.largest, len(files))


def token_stream(paths: tuple[str, ...], tokenizer_folder: str | None) -> torch.Tensor:
    """The tokens of :func:`token_info` (the memory-mapped 1-D tensor)."""
    return token_info(paths, tokenizer_folder).tokens


def _unreadable(path: Path, exc: OSError) -> DataError:
    return DataError(f"cannot read a data file: {exc.strerror or exc}",
                     primitive="torchloom train",
                     values={"file": str(path)}, fix="check the file's permissions")


def split(tokens: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)``: the held-out part is the last ``eval_fraction`` of the tokens."""
    cut = tokens.numel() - int(tokens.numel() * eval_fraction)
    return tokens[:cut], tokens[cut:]


def window_batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int,
                 seed: int) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len`` tokens (``int64``), drawn with a
    generator seeded by ``(seed, step)`` only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s:s + seq_len] for s in starts.tolist()]).long()


def rank_batches(tokens: torch.Tensor, step: int, *, batch_size: int, seq_len: int,
                 seed: int, dp: int = 1, dp_rank: int = 0,
                 grad_accum: int = 1) -> list[torch.Tensor]:
    """The micro-batches data-parallel rank ``dp_rank`` of ``dp`` trains on at ``step``
    (1-based), exactly as ``torchloom train`` draws them, to check a baseline against:
    the step's ``batch_size`` windows (:func:`window_batch` of the training tokens), this
    rank's ``batch_size / dp`` consecutive rows of them, cut into ``grad_accum`` equal
    micro-batches. A pipeline takes the rank's rows whole and cuts them into
    ``n_microbatches x grad_accum`` micro-batches of one step. Labels are the ids
    themselves (the model shifts them).

    >>> tokens = torch.arange(1000, dtype=torch.uint8)
    >>> parts = rank_batches(tokens, 1, batch_size=8, seq_len=4, seed=0, dp=2, dp_rank=1,
    ...                      grad_accum=2)
    >>> [tuple(p.shape) for p in parts]
    [(2, 4), (2, 4)]
    >>> whole = window_batch(tokens, 1, 8, 4, 0)
    >>> torch.equal(torch.cat(parts), whole[4:8])
    True
    """
    ids = window_batch(tokens, step, batch_size, seq_len, seed)
    share = batch_size // dp
    return list(ids[dp_rank * share:(dp_rank + 1) * share].chunk(grad_accum))


def eval_windows(tokens: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """The first ``count`` consecutive windows of ``seq_len`` tokens (as many as fit)."""
    n = min(count, tokens.numel() // seq_len)
    return tokens[:n * seq_len].reshape(n, seq_len).long()
