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
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..core.errors import DataError

_log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_BYTES", "VOCAB_SIZE", "DataError", "batches", "eval_windows",
           "has_tokenizer", "load_corpus", "load_tokenizer", "source_files", "split",
           "text_files", "token_stream", "window_batch"]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4_000_000

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


def text_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The files of ``paths``: a file as it is, a folder as every non-hidden file below it
    (hidden folders skipped, names sorted); a folder without any is a :class:`DataError`."""
    out: list[Path] = []
    for given in paths:
        top = Path(given)
        if top.is_file():
            out.append(top)
            continue
        if not top.is_dir():
            raise DataError("no such file or folder", primitive="torchloom train",
                            values={"data": given}, fix="--data corpus/ (text files or folders)")
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found += [Path(dirpath, n) for n in sorted(filenames) if not n.startswith(".")]
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


@functools.lru_cache(maxsize=2)
def token_stream(paths: tuple[str, ...], tokenizer_folder: str | None) -> torch.Tensor:
    """The tokens of the files of ``paths`` (see :func:`text_files`), one 1-D tensor:
    ``uint8`` bytes without a tokenizer, else ``int32`` ids of the tokenizer of
    ``tokenizer_folder``, each file tokenised without special tokens and followed by the
    end-of-sequence token (if the tokenizer has one). Cached per process."""
    files = text_files(paths)
    if tokenizer_folder is None:
        chunks = []
        for path in files:
            try:
                chunks.append(path.read_bytes())
            except OSError as exc:
                raise _unreadable(path, exc) from None
        joined = bytearray(b"".join(chunks))
        return torch.frombuffer(joined, dtype=torch.uint8) if joined else \
            torch.zeros(0, dtype=torch.uint8)
    tokenizer = load_tokenizer(tokenizer_folder)
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise _unreadable(path, exc) from None
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.int32)


def _unreadable(path: Path, exc: OSError) -> DataError:
    return DataError(f"cannot read a data file: {exc.strerror}", primitive="torchloom train",
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


def eval_windows(tokens: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """The first ``count`` consecutive windows of ``seq_len`` tokens (as many as fit)."""
    n = min(count, tokens.numel() // seq_len)
    return tokens[:n * seq_len].reshape(n, seq_len).long()
