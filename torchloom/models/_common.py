"""Building blocks shared by the built-in schedules (Megatron-style tensor and sequence
parallelism, activation checkpointing), so each model's schedule is a short list of paths.

A *region* is a block whose first modules are column parallel (output features split)
and whose last module is row parallel (input features split, partial output):

* tensor parallelism: the block's input gradient is all-reduced in backward
  (``bwd_post``) and the row-parallel output is all-reduced in forward (``fwd_post``);
* sequence parallelism: activations outside regions are split along the sequence axis;
  the block all-gathers its input (``fwd_pre``, backward reduce-scatters) and the row
  module reduce-scatters its output; parameters used on sequence slices (norms, the row
  bias) get their gradients all-reduced (``param_grad``).
"""

from __future__ import annotations

from ..schedule import Schedule

__all__ = ["column", "row", "region", "sp_norms", "sp_final_norm", "SEQ_AXIS"]

SEQ_AXIS = 1  # activations are (batch, sequence, hidden)


def _is_conv1d(node: Schedule) -> bool:
    return type(node.mod).__name__ == "Conv1D"


def column(node: Schedule, chunks: int = 1) -> None:
    """Shard a Linear / Conv1D along its output features (``chunks=3`` for fused q/k/v)."""
    kw = {"chunks": chunks} if chunks > 1 else {}
    node.shard("weight", 1 if _is_conv1d(node) else 0, **kw)
    if getattr(node.mod, "bias", None) is not None:
        node.shard("bias", 0, **kw)


def row(node: Schedule) -> None:
    """Shard a Linear / Conv1D along its input features (the bias stays whole)."""
    node.shard("weight", 0 if _is_conv1d(node) else 1)


def region(block: Schedule, columns: list[str], row_path: str, sequence_parallel: bool,
           input_name: str | None = None, chunks: int = 1) -> None:
    """Make ``block`` one tensor-parallel region: ``columns`` column parallel, ``row_path``
    row parallel, with the syncs of plain TP or of sequence parallelism."""
    for path in columns:
        column(block[path], chunks)
    row(block[row_path])
    kw = {"input_name": input_name} if input_name else {}
    if sequence_parallel:
        block.sync("fwd_pre", "all_gather", axis=SEQ_AXIS, **kw)
        block[row_path].sync("fwd_post", "reduce_scatter", axis=SEQ_AXIS)
        if getattr(block[row_path].mod, "bias", None) is not None:
            block[row_path].sync("param_grad", "all_reduce")
    else:
        block.sync("bwd_post", "all_reduce", **kw)
        block[row_path].sync("fwd_post", "all_reduce")


def sp_norms(nodes: list[Schedule]) -> None:
    """Norms that run on sequence slices: all-reduce their parameter gradients."""
    for node in nodes:
        node.sync("param_grad", "all_reduce")


def sp_final_norm(node: Schedule) -> None:
    """The last norm of a sequence-parallel model: it runs on sequence slices (its
    gradients are all-reduced) and its output is gathered whole for the head. Every rank
    then computes the same head, so the gather's backward keeps this rank's slice."""
    sp_norms([node])
    node.sync("fwd_post", "all_gather", axis=SEQ_AXIS, tensor_parallel_output_grad=False)
