"""Metadata that lives with a parameter (or buffer) tensor.

torchloom keeps what it knows about a tensor *on the tensor*, not in a per-schedule-node
dictionary. A parameter that is moved to another module (``replace``), seen through a
traced graph (``trace`` keeps the same Parameter objects) or re-created by ``build``
(which calls :func:`copy_meta`) keeps its metadata. This is what makes the order of
``shard``, ``trace`` and ``replace`` irrelevant, unlike Slapo.

Two things are stored:

* :class:`ShardSpec`: set by ``shard``; the axis, the full (unsharded) shape, and the
  rank/world size the slice belongs to.
* user tags: set by ``annotate``; also exposed as plain attributes of the tensor.

>>> import torch
>>> p = torch.nn.Parameter(torch.zeros(4, 2))
>>> set_tag(p, "replicated", True)
>>> p.replicated, get_meta(p).tags
(True, {'replicated': True})
>>> q = torch.nn.Parameter(torch.zeros(4, 2))
>>> copy_meta(p, q)
>>> q.replicated
True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from .marks import META, mark_attr

__all__ = ["ShardSpec", "TensorMeta", "get_meta", "has_meta", "copy_meta", "set_tag", "shard_spec"]

_ATTR = mark_attr(META)


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor was sliced by ``shard``.

    Attributes:
        axis: the tensor dimension that was split (non-negative).
        full_shape: the shape before slicing.
        world_size: number of slices.
        rank: which slice this tensor holds.
        chunks: the number of equal blocks the axis is made of (3 for a fused q/k/v
            projection); each block is split on its own and a rank keeps its piece of
            every block, so rank r holds ``[q_r | k_r | v_r]``. 1 for a plain split.
        replicas: how many consecutive ranks hold the same piece (1: every rank holds its
            own). The axis is then split into ``pieces = world_size // replicas`` pieces
            and rank r holds piece ``r // replicas``: the layout of GQA key/value heads
            when there are fewer of them than tensor-parallel ranks (Llama with 2 KV heads
            at TP=4: ranks 0, 1 hold head 0 and ranks 2, 3 head 1). ``gather`` takes one
            copy of each piece; the ranks sharing a piece must keep equal values (their
            gradients summed over those ranks, see :mod:`torchloom.schedules.llama`).
        group: the process group the pieces are spread over when it is not the schedule's
            tensor-parallel group (the expert-parallel group of the experts' weights,
            :mod:`torchloom.primitives.expert_parallel`); None: the schedule's group.
            ``world_size`` and ``rank`` are then this group's. Not compared, not copied
            (a process group is shared, never duplicated).
    """

    axis: int
    full_shape: tuple[int, ...]
    world_size: int
    rank: int
    chunks: int = 1
    replicas: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardSpec:
        return self  # frozen, and its process group must be shared, not copied

    def __repr__(self) -> str:
        extra = f", replicas={self.replicas}" if self.replicas != 1 else ""
        return (f"ShardSpec(axis={self.axis}, full_shape={self.full_shape}, "
                f"world_size={self.world_size}, rank={self.rank}, chunks={self.chunks}{extra})")

    @property
    def pieces(self) -> int:
        """The number of distinct pieces the axis (each block of it) is split into.

        >>> ShardSpec(axis=0, full_shape=(8, 4), world_size=4, rank=3, replicas=2).pieces
        2
        """
        return self.world_size // self.replicas

    @property
    def piece(self) -> int:
        """The piece this rank holds (its rank when nothing is replicated).

        >>> ShardSpec(axis=0, full_shape=(8, 4), world_size=4, rank=3, replicas=2).piece
        1
        """
        return self.rank // self.replicas

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (a view where possible).

        >>> t = torch.arange(12)
        >>> ShardSpec(axis=0, full_shape=(12,), world_size=2, rank=1).slice(t).tolist()
        [6, 7, 8, 9, 10, 11]
        >>> ShardSpec(axis=0, full_shape=(12,), world_size=2, rank=1, chunks=3).slice(t).tolist()
        [2, 3, 6, 7, 10, 11]
        >>> ShardSpec(axis=0, full_shape=(12,), world_size=4, rank=1, replicas=2).slice(t).tolist()
        [0, 1, 2, 3, 4, 5]
        """
        blocks = full.chunk(self.chunks, dim=self.axis)
        pieces = [b.chunk(self.pieces, dim=self.axis)[self.piece] for b in blocks]
        return pieces[0] if self.chunks == 1 else torch.cat(pieces, dim=self.axis)

    def gather(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order (inverse of ``slice``).

        >>> specs = [ShardSpec(0, (12,), 2, r, chunks=3) for r in range(2)]
        >>> t = torch.arange(12)
        >>> torch.equal(specs[0].gather([s.slice(t) for s in specs]), t)
        True
        >>> specs = [ShardSpec(0, (12,), 4, r, replicas=2) for r in range(4)]
        >>> torch.equal(specs[0].gather([s.slice(t) for s in specs]), t)
        True
        """
        pieces = pieces[::self.replicas]  # one copy of each piece
        split = [p.chunk(self.chunks, dim=self.axis) for p in pieces]
        blocks = [torch.cat([s[c] for s in split], dim=self.axis) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.axis)

    def ranges(self) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of the full axis this rank holds, in local order
        (one per block): what a reader of the full tensor must fetch.

        >>> ShardSpec(axis=0, full_shape=(12,), world_size=2, rank=1, chunks=3).ranges()
        [(2, 4), (6, 8), (10, 12)]
        >>> ShardSpec(axis=0, full_shape=(12,), world_size=4, rank=3, replicas=2).ranges()
        [(6, 12)]
        """
        block = self.full_shape[self.axis] // self.chunks
        piece = block // self.pieces
        return [(b * block + self.piece * piece, b * block + (self.piece + 1) * piece)
                for b in range(self.chunks)]

    def local_shape(self) -> tuple[int, ...]:
        """The shape of one slice.

        >>> ShardSpec(axis=1, full_shape=(4, 6), world_size=2, rank=0).local_shape()
        (4, 3)
        """
        shape = list(self.full_shape)
        shape[self.axis] //= self.pieces
        return tuple(shape)


@dataclass
class TensorMeta:
    """Everything torchloom records about one tensor."""

    shard: ShardSpec | None = None
    tags: dict[str, Any] = field(default_factory=dict)


def has_meta(tensor: torch.Tensor) -> bool:
    """Whether torchloom recorded anything about ``tensor``."""
    return isinstance(getattr(tensor, _ATTR, None), TensorMeta)


def get_meta(tensor: torch.Tensor) -> TensorMeta:
    """The metadata record of ``tensor``, created empty on first use."""
    meta = getattr(tensor, _ATTR, None)
    if not isinstance(meta, TensorMeta):
        meta = TensorMeta()
        setattr(tensor, _ATTR, meta)
    return meta


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` of ``tensor``, or None if it was never sharded."""
    meta = getattr(tensor, _ATTR, None)
    return meta.shard if isinstance(meta, TensorMeta) else None


def set_tag(tensor: torch.Tensor, key: str, value: Any) -> None:
    """Record a user tag and expose it as ``tensor.<key>``."""
    get_meta(tensor).tags[key] = value
    setattr(tensor, key, value)


def copy_meta(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give ``dst`` the metadata (shard spec and tags) of ``src``; a no-op if there is none."""
    meta = getattr(src, _ATTR, None)
    if not isinstance(meta, TensorMeta):
        return
    new = TensorMeta(shard=meta.shard, tags=copy.copy(meta.tags))
    setattr(dst, _ATTR, new)
    for key, value in new.tags.items():
        setattr(dst, key, value)
