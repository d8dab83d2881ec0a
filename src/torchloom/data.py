"""Byte-level training text that ships with Python itself.

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
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import ScheduleError

__all__ = ["DEFAULT_MAX_BYTES", "VOCAB_SIZE", "batches", "load_corpus", "source_files"]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4_000_000

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


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
        raise ScheduleError(
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
        except OSError:
            continue
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    if size == 0:
        raise ScheduleError(
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
        raise ScheduleError(
            "batch_size and seq_len must be positive",
            primitive="batches",
            values={"batch_size": batch_size, "seq_len": seq_len},
            fix="batches(batch_size=8, seq_len=128, seed=0)",
        )
    corpus = load_corpus(max_bytes)
    if corpus.numel() <= seq_len:
        raise ScheduleError(
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
