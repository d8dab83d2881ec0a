"""``context_parallel(group)``: split every sequence of a transformers model over the
ranks of ``group``.

Applied at a transformers model (a ``PreTrainedModel``: a causal LM or its base model),
it makes each of the group's ``cp`` ranks compute ``1 / cp`` of every sequence:

* **inputs**: a forward pre-hook takes the whole sequences every rank of the group was
  given (the same batch) and keeps this rank's positions, chunks ``r`` and
  ``2 cp - 1 - r`` of ``2 cp`` (:func:`~torchloom.ops.context_parallel.shard_index`, load
  balanced for causal masks): ``input_ids`` / ``inputs_embeds`` / ``token_type_ids``,
  and ``position_ids`` (made as ``0 .. S-1`` when not given), so rotary embeddings see
  each token's true position. A 2-D padding mask is kept whole and masks the gathered
  keys; ``use_cache`` is off (a cache of one rank's chunks would be wrong).
* **attention**: the model's attention implementation is set to
  :func:`~torchloom.ops.context_parallel.context_parallel_attention` (registered in
  transformers' ``AttentionInterface``): the keys and values are all-gathered over the
  group, each local query chunk attends to the keys its true positions may see (causal,
  the model's sliding window, the padding), on ``F.scaled_dot_product_attention``.
  transformers builds no attention mask for it.
* **loss**: ``labels`` are shifted over the whole sequence first (the next token of a
  chunk's last position lives on another rank), then sharded, and passed as
  ``shift_labels`` with ``num_items_in_batch`` = the targets of the whole sequence; the
  model's loss (a sum over this rank's targets divided by that count) is summed over the
  group with a differentiable all-reduce. Every rank returns the loss of the whole
  sequence; its backward gives each rank ``cp`` times its own tokens' gradient, so
  averaging the gradients over the data-parallel x context-parallel ranks (what
  :func:`torchloom.parallelize` sets up: DDP over them, or FSDP2 sharding over
  ``dp_shard x cp``) gives exactly the single-process gradient.
* **outputs**: ``logits`` (and hidden states) are this rank's positions, in
  :func:`~torchloom.ops.context_parallel.shard_index` order;
  :func:`~torchloom.ops.context_parallel.gather_sequence` puts them back together.

The parameters stay whole on every rank (context parallelism splits activations, not
weights): the checkpoint keys and shapes are the single-process ones.

Not recorded in a recipe: a process group does not serialise, and ``parallelize``
applies the primitive from ``Layout.cp`` over the mesh's ``cp`` group.

Preconditions:
    * the module is a transformers model whose attention modules call the attention
      interface (``ALL_ATTENTION_FUNCTIONS``, every family transformers writes with
      ``attn_implementation="sdpa"`` support: Llama, Mistral, Qwen2/3, Gemma, Phi-3,
      Mixtral, ...); a model without one, or whose attention was replaced by a module
      that does not call it, is refused;
    * not applied already; no pipeline cut yet (a pipeline with context parallelism is
      :func:`torchloom.parallelize`'s: :mod:`torchloom.parallel.context_pipeline`);
    * at run time: the sequence length is a multiple of ``2 cp``; no 4-D mask; no KV
      cache with past positions; attention without soft-capping or sinks (Gemma 2,
      gpt-oss: refused when called).

Before / after (one rank: the group has one member, the sequence is one shard and the
outputs are the model's own):

>>> import torch, torchloom as tl
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
>>> model = LlamaForCausalLM(cfg).eval()
>>> ids = torch.randint(0, 64, (2, 8))
>>> before = model(ids, labels=ids)
>>> sch = tl.create_schedule(model)
>>> sch.context_parallel()
>>> model.config._attn_implementation
'torchloom_context_parallel'
>>> after = model(ids, labels=ids)
>>> torch.allclose(before.logits, after.logits, atol=1e-5), torch.allclose(before.loss, after.loss)
(True, True)
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import ContextParallelError
from ..core.marks import CONTEXT_PARALLEL, PIPELINE_CUT, has_mark, set_mark
from ..core.registry import primitive
from ..runtime import collectives as C
from ..runtime.context_attention import CPState, register_attention, shard_index

if TYPE_CHECKING:
    from ..core.schedule import Schedule

NAME = "context_parallel"
IGNORE_INDEX = -100

__all__ = ["NAME", "apply", "attention_modules"]

_SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "token_type_ids")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` whose forward calls transformers' attention interface (the
    modules whose attention function ``context_parallel`` replaces)."""
    found = []
    seen: dict[type, bool] = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in seen:
            try:
                source = inspect.getsource(cls.forward)
            except (OSError, TypeError):
                source = ""
            seen[cls] = "ALL_ATTENTION_FUNCTIONS" in source
        if seen[cls]:
            found.append((name, module))
    return found


def _fail(sch: Schedule, what: str, values: dict[str, Any], fix: str) -> ContextParallelError:
    return ContextParallelError(what, path=sch.path, primitive=NAME, values=values, fix=fix)


def _check(sch: Schedule) -> list[tuple[str, nn.Module]]:
    model = sch.mod
    if has_mark(model, CONTEXT_PARALLEL):
        raise _fail(sch, "context_parallel was already applied to this model",
                    {"model": type(model).__name__},
                    f"apply it once: remove the second sch[{sch.path!r}].context_parallel()")
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise _fail(sch, f"a {type(model).__name__} is not a transformers model: the primitive "
                    "sets the attention implementation of its config",
                    {"model": type(model).__name__},
                    "apply it at the transformers model (the causal LM or its base model)")
    found = attention_modules(model)
    if not found:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules()
                        if "attention" in type(m).__name__.lower()})
        raise _fail(sch, f"no attention module of {type(model).__name__} calls transformers' "
                    "attention interface, so none can attend over a split sequence",
                    {"attention_modules": kinds or None},
                    "keep the model's own attention classes (do not replace them with a module "
                    "that does not call ALL_ATTENTION_FUNCTIONS), or train without context "
                    "parallelism")
    cuts = [name for name, m in model.named_modules() if has_mark(m, PIPELINE_CUT)]
    if cuts:
        raise _fail(sch, "the model is already cut into pipeline stages: its inputs would "
                    "be split inside the first stage's graph, which a pipeline runs without "
                    "this primitive's input hook", {"cuts": cuts[:4]},
                    "apply context_parallel before cutting and let torchloom.parallelize "
                    "build the pipeline (Layout(pp=..., cp=...)): it hands the first stage "
                    "each rank's positions")
    return found


def _group_of(group: Any) -> tuple[int, int]:
    return C.group_size(group), C.group_rank(group)


def _take(kwargs: dict[str, Any], args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Move a positional ``input_ids`` into the keyword arguments."""
    if args:
        kwargs = {"input_ids": args[0], **kwargs}
        args = args[1:]
    return args, kwargs


class _ShardInputs:
    """The model's forward pre-hook: this rank's positions of every sequence input."""

    def __init__(self, state: CPState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        state = self.state
        args, kwargs = _take(kwargs, args)
        ref = next((kwargs[k] for k in ("input_ids", "inputs_embeds")
                    if kwargs.get(k) is not None), None)
        if ref is None:
            raise ContextParallelError(
                "the model was called without input_ids or inputs_embeds", path=state.path,
                primitive=NAME, values={"kwargs": sorted(kwargs)},
                fix="pass input_ids (or inputs_embeds) of the whole sequences")
        batch, seq = ref.shape[0], ref.shape[1]
        if kwargs.get("past_key_values") is not None:
            raise ContextParallelError(
                "a KV cache was passed to a context-parallel model", path=state.path,
                primitive=NAME, values={"past_key_values": type(kwargs["past_key_values"]).__name__},
                fix="train and evaluate without a cache (generation runs on the gathered model)")
        index = shard_index(seq, state.size, state.rank, ref.device)
        for name in _SEQUENCE_INPUTS:
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].index_select(1, index)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=ref.device).expand(batch, seq)
        kwargs["position_ids"] = positions.index_select(positions.dim() - 1, index)
        mask = kwargs.pop("attention_mask", None)
        state.key_padding = None
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (batch, seq):
                raise ContextParallelError(
                    "a context-parallel model takes a (batch, seq) padding mask, not a full "
                    "attention mask", path=state.path, primitive=NAME,
                    values={"attention_mask": tuple(mask.shape), "batch": batch, "seq": seq},
                    fix="pass the 2-D padding mask (1 for tokens, 0 for padding) or none")
            if not bool(mask.to(torch.bool).all()):
                state.key_padding = mask.to(torch.bool)
        labels = kwargs.get("labels")
        if labels is not None:
            shifted = kwargs.pop("shift_labels", None)
            if shifted is None:
                shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            local = shifted.index_select(1, index)
            kwargs["labels"] = kwargs["shift_labels"] = local
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
        kwargs["use_cache"] = False
        return args, kwargs


class _SumLoss:
    """The model's forward hook: the loss summed over the context-parallel group."""

    def __init__(self, state: CPState) -> None:
        self.state = state

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if loss is None or self.state.size == 1:
            return output
        # forward: the sum over the group; backward: the sum of the ranks' gradients
        # (each rank's loss feeds every rank's sum), cp times each rank's own share
        group = self.state.group
        output.loss = C.copy_to_group(C.all_reduce(loss, group), group)
        return output


@primitive(NAME, errors=(ContextParallelError,), recorded=False)
def apply(sch: Schedule, group: Any = None) -> None:
    """Split every sequence of the transformers model at ``sch`` over ``group`` (None: the
    default group, or one rank without torch.distributed)."""
    found = _check(sch)
    size, rank = _group_of(group)
    state = CPState(group=group, size=size, rank=rank, path=sch.path)
    name = register_attention()
    sch.mod.set_attn_implementation(name)  # type: ignore[operator]
    for _, module in found:
        set_mark(module, CONTEXT_PARALLEL, state)
    set_mark(sch.mod, CONTEXT_PARALLEL, state)
    sch.mod.register_forward_pre_hook(_ShardInputs(state), with_kwargs=True)
    sch.mod.register_forward_hook(_SumLoss(state), with_kwargs=True)
