"""Causal attention without a materialised mask when transformers cannot look at values.

transformers decides per forward whether SDPA may run its causal kernel (``is_causal=True``,
no mask) or needs an explicit ``(batch, 1, seq, seq)`` mask: it looks at the position ids
for packed sequences (several documents in one row). When it cannot read their values
(fake tensors, a trace) it assumes packing and builds the mask. A traced pipeline then
sends that mask from stage to stage (64 MiB per 8,192-token sequence, per boundary) and
every attention runs with it (on a GPU: not the flash kernel); the planner's fake-tensor
step keeps it in every checkpointed layer.

:func:`unpacked_sequences` tells transformers, inside the block, that the sequences are
not packed, which is what torchloom's training batches are (whole token rows, no
``position_ids``, no padding mask). Precondition: the inputs are such rows; a model fed
packed sequences must not be traced inside the block.

>>> with unpacked_sequences():
...     pass
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["unpacked_sequences"]


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Inside the block transformers' packed-sequence search reports none (see the module
    docstring); a transformers without that search: nothing changes."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    found = getattr(masking_utils, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found
