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

Loss parallelism (the ``loss_parallel`` knob): the head (the model's output embedding, a
``Linear`` not tied to the input embedding) is column parallel along the vocabulary and
its output stays split, so no rank holds whole logits; :func:`loss_parallel_head` checks
the model allows it, :func:`install_sharded_loss` makes the model's loss take the split
logits.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

from torch import nn

from ..core.errors import ModelSizeError, PathError
from ..core.schedule import Schedule, ScheduleGroup, join_path
from ..graph.graph_module import is_conv1d
from ..primitives._common import tied_names
from .config import KNOBS, ScheduleConfig, ScheduleConfigError

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["column", "row", "region", "region_syncs", "sp_norms", "sp_final_norm",
           "finish_layers", "check_knobs", "check_tp_sizes", "takes", "tp_divisors", "SEQ_AXIS",
           "node_at", "loss_parallel_head", "install_sharded_loss"]

SEQ_AXIS = 1  # activations are (batch, sequence, hidden)


def node_at(sch: Schedule, path: str) -> Schedule:
    """The one node at ``path`` below ``sch`` (``""``: ``sch`` itself).

    ``sch[path]`` is a :class:`~torchloom.core.schedule.Schedule`, or a
    :class:`~torchloom.core.schedule.ScheduleGroup` for a path with wildcards; the built-in
    schedules name single modules where they read a node's module or pass it on, and this
    says so (a path that matches a group is refused).

    >>> import torch, torchloom as tl
    >>> sch = tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> node_at(sch, "0").path, node_at(sch, "") is sch
    ('0', True)
    """
    found = sch[path]
    if isinstance(found, ScheduleGroup):
        raise PathError(
            f"this schedule step acts on one module, and the path matches {len(found)}",
            path=join_path(sch.path, path), primitive="schedules",
            values={"matches": found.paths[:5]},
            fix="name one module: a path without *, ? or [")
    return found


def column(node: Schedule, chunks: int = 1) -> None:
    """Shard a Linear / Conv1D along its output features (``chunks=3`` for fused q/k/v)."""
    def shard(name: str, axis: int) -> None:  # the recipe names chunks only when not 1
        if chunks > 1:
            node.shard(name, axis, chunks=chunks)
        else:
            node.shard(name, axis)

    shard("weight", 1 if is_conv1d(node.mod) else 0)
    if getattr(node.mod, "bias", None) is not None:
        shard("bias", 0)


def row(node: Schedule) -> None:
    """Shard a Linear / Conv1D along its input features (the bias stays whole)."""
    node.shard("weight", 0 if is_conv1d(node.mod) else 1)


def region(block: Schedule, columns: list[str], row_path: str, sequence_parallel: bool,
           input_name: str | None = None, chunks: int = 1) -> None:
    """Make ``block`` one tensor-parallel region: ``columns`` column parallel, ``row_path``
    row parallel, with the syncs of plain TP or of sequence parallelism."""
    for path in columns:
        column(node_at(block, path), chunks)
    row(node_at(block, row_path))
    region_syncs(block, row_path, sequence_parallel, input_name)


def region_syncs(block: Schedule, row_path: str, sequence_parallel: bool,
                 input_name: str | None = None) -> None:
    """The syncs of :func:`region` alone, for a block whose modules are already sharded."""
    kw = {"input_name": input_name} if input_name else {}
    if sequence_parallel:
        block.sync("fwd_pre", "all_gather", axis=SEQ_AXIS, **kw)
        block[row_path].sync("fwd_post", "reduce_scatter", axis=SEQ_AXIS)
        if getattr(block[row_path].mod, "bias", None) is not None:
            block[row_path].sync("param_grad", "all_reduce")
    else:
        block.sync("bwd_post", "all_reduce", **kw)
        block[row_path].sync("fwd_post", "all_reduce")


def sp_norms(nodes: Sequence[Schedule | ScheduleGroup]) -> None:
    """Norms that run on sequence slices: all-reduce their parameter gradients."""
    for node in nodes:
        node.sync("param_grad", "all_reduce")


def sp_final_norm(node: Schedule | ScheduleGroup, split_head: bool = False) -> None:
    """The last norm of a sequence-parallel model: it runs on sequence slices (its
    gradients are all-reduced) and its output is gathered whole for the head. Every rank
    then computes the same head, so the gather's backward keeps this rank's slice; a head
    split along the vocabulary (``split_head``, loss parallelism) gives each rank a part
    of the gradient, so the gather's backward reduce-scatters it."""
    sp_norms([node])
    node.sync("fwd_post", "all_gather", axis=SEQ_AXIS, tensor_parallel_output_grad=split_head)


_WHOLE_LOGITS = ("or keep whole logits: drop loss_parallel (a Layout's loss='chunked' falls "
                 "back to whole logits by itself)")


def loss_parallel_head(sch: Schedule, primitive: str) -> str:
    """The path of the head that loss parallelism splits along the vocabulary over
    ``sch``'s group: the model's output embedding (``get_output_embeddings()``), an
    ``nn.Linear`` not tied to another module, with a vocabulary the group's size divides,
    in a model whose causal-LM loss can be replaced
    (:func:`torchloom.ops.loss.is_causal_lm`). Refuses
    anything else with a :class:`~torchloom.core.errors.ModelSizeError`, before any
    primitive is applied.

    >>> import torch, torchloom as tl, transformers
    >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_attention_heads=2, num_hidden_layers=1, vocab_size=64, tie_word_embeddings=True)
    >>> loss_parallel_head(tl.create_schedule(transformers.LlamaForCausalLM(config)), "demo")
    Traceback (most recent call last):
    ...
    torchloom.core.errors.ModelSizeError: sch['lm_head'].demo(...): loss parallelism splits the head lm_head along the vocabulary, and its weight is tied to model.embed_tokens: only an untied head is split
        values: head='lm_head', tied_to='model.embed_tokens'
        fix: untie it (config.tie_word_embeddings = False before the model is made), or keep whole logits: drop loss_parallel (a Layout's loss='chunked' falls back to whole logits by itself)
    """
    model = sch.mod
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except Exception:  # noqa: BLE001 (not implemented by every model)
        head = None
    from ..ops.loss import is_causal_lm

    path = next((p for p, m in model.named_modules() if head is not None and m is head), None)
    if not isinstance(head, nn.Linear) or path is None or not is_causal_lm(model):
        raise ModelSizeError(
            "loss parallelism splits the model's head (its output embedding, a Linear) "
            f"along the vocabulary and replaces its loss, and {type(model).__name__} has "
            "no such head or no transformers causal-LM loss_function", path=sch.path,
            primitive=primitive, values={"model": type(model).__name__,
                                         "head": type(head).__name__ if head is not None
                                         else None},
            fix=f"schedule the ...ForCausalLM model; {_WHOLE_LOGITS}")
    full = join_path(sch.path, path)
    others = [name.rpartition(".")[0] for _, _, name in tied_names(model, head.weight)
              if name.rpartition(".")[0] != path]
    if others:
        raise ModelSizeError(
            f"loss parallelism splits the head {full} along the vocabulary, and its weight "
            f"is tied to {others[0]}: only an untied head is split", path=full,
            primitive=primitive,
            values={"head": full, "tied_to": others[0]},
            fix=f"untie it (config.tie_word_embeddings = False before the model is made), "
            f"{_WHOLE_LOGITS}")
    world, vocab = sch.world_size, head.out_features
    if vocab % world:
        raise ModelSizeError(
            f"loss parallelism splits the head {full} along the vocabulary over {world} "
            f"ranks, and its {vocab} outputs do not divide by {world}", path=full,
            primitive=primitive, values={"vocab_size": vocab, "tp_degree": world},
            fix=f"pad the vocabulary: model.resize_token_embeddings("
            f"{-(-vocab // world) * world}); {_WHOLE_LOGITS}")
    return path


def install_sharded_loss(sch: Schedule) -> None:
    """Make the model's loss take logits split along the vocabulary over ``sch``'s group
    (the chunked cross-entropy of :mod:`torchloom.ops.loss`): its own loss would read
    them as whole. ``torchloom.parallelize`` then installs the layout's loss."""
    from ..ops.loss import set_loss

    set_loss(sch.mod, "chunked", sch.group)


def finish_layers(stack: Schedule | ScheduleGroup, config: ScheduleConfig) -> None:
    """The last two steps of every built-in schedule, on a stack of layers (a
    ``ModuleList``): checkpoint the first ``config.ckpt_ratio`` of them, then compile each
    layer in place (``compile=True``: inductor; a string: that backend). The compiled code
    sits inside the checkpoint, so the recompute runs the compiled layer again."""
    if config.ckpt_ratio:
        stack.checkpoint(ratio=config.ckpt_ratio)
    if config.compile is not False:
        stack["*"].compile("inductor" if config.compile is True else config.compile)


def takes(*knobs: str) -> Callable[[F], F]:
    """Declare the knobs a schedule function uses (in the order errors list them); a
    non-default value of another knob is refused by ``apply_schedule``."""
    def declare(fn: F) -> F:
        fn.knobs = knobs  # type: ignore[attr-defined]
        return fn

    return declare


def tp_divisors(n: int) -> list[int]:
    """The tensor-parallel degrees that split ``n`` evenly.

    >>> tp_divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_sizes(sch: Schedule, model: str, sizes: list[tuple[str, int, str, str]]) -> None:
    """Refuse, before any primitive is applied, config sizes that tensor parallelism cannot
    split evenly between the ranks of ``sch``'s group. ``sizes`` holds
    ``(config field, value, path of the sharded modules, what each rank keeps)``; a
    built-in TP schedule gives every rank whole attention heads and an equal share of the
    MLP's features, so with a size that does not divide, the first forward would fail
    with a reshape error, or heads would be cut in half.

    >>> import torch, torchloom as tl
    >>> sch = tl.create_schedule(torch.nn.Linear(2, 2))  # a world of one: every size divides
    >>> check_tp_sizes(sch, "gpt2", [("n_head", 4, "h.*.attn", "whole attention heads")])
    """
    world = sch.world_size
    for field, value, path, what in sizes:
        if value % world == 0:
            continue
        up = -(-value // world) * world
        raise ModelSizeError(
            f"tensor parallelism gives each of the {world} ranks {what}, and {field}="
            f"{value} does not divide by {world}",
            path=path, primitive=f"schedules.schedule_{model}",
            values={field: value, "tp_degree": world},
            fix=f"use a tensor-parallel group whose size divides {value} (one of "
            f"{tp_divisors(value)}), or a config with {field} a multiple of {world}, e.g. "
            f"config.{field} = {up}",
        )


def check_knobs(sch: Schedule, fn: Callable[..., Any], knobs: dict[str, Any]) -> None:
    """Refuse knobs that the schedule function ``fn`` does not use (its ``takes``; a
    function without that declaration accepts every knob), listing the valid ones."""
    valid = list(getattr(fn, "knobs", KNOBS))
    unknown = [k for k in knobs if k not in valid]
    if not unknown:
        return
    first = unknown[0]
    close = difflib.get_close_matches(first, valid, n=1, cutoff=0.5)
    if close:
        fix = f"apply_schedule(sch, {close[0]}={knobs[first]!r})"
    else:
        fix = f"drop {first!r}; the knobs of this schedule are {', '.join(valid)}"
    raise ScheduleConfigError(
        f"unknown knob{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
        f"the built-in schedule of {type(sch.mod).__name__}",
        path=sch.path, primitive="schedules.apply_schedule",
        values={"unknown": unknown, "knobs": valid}, fix=fix,
    )
