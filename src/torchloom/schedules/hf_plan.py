"""Tensor-parallel schedules derived from transformers' own parallel plans.

transformers 5 declares, for most of its model families, how to split the model over
tensor-parallel ranks: the config class's ``base_model_tp_plan`` (paths relative to the
base model, ``*`` for a layer index), the model class's ``_tp_plan`` (the head, e.g.
``{"lm_head": "colwise_gather_output"}``) and, for a base model with an ``embed_tokens``
embedding, a vocabulary-parallel embedding. A model instance merges them under its own
paths (``model.tp_plan``: the base model's keys prefixed with ``base_model_prefix``,
``"model."`` in a ``...ForCausalLM``). :func:`from_hf_plan` reads that merged plan and
applies the equivalent torchloom primitives, so the result is an ordinary recipe: it
prints, replays with ``apply_recipe``, verifies and tunes like a hand-written schedule.

The styles and what each becomes, the checks made before any primitive is applied, and
the knobs are described in docs/design/hf_plan.md.

This module applies the plan: the hooks and ``replace`` factories the recipe names
(``torchloom.schedules.hf_plan.whole_sizes``, ...), the planner that turns each style
into primitive calls, and :func:`from_hf_plan` / :func:`schedule_hf_plan`. Reading the
plan is :mod:`~torchloom.schedules.hf_plan_read`'s part (its names are importable from
here too), the checks are :mod:`~torchloom.schedules.hf_plan_checks`'.

Before / after (a world of one: shards and syncs are recorded and change no value):

>>> import torch, torchloom as tl, transformers
>>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
...     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
>>> sch = tl.create_schedule(transformers.LlamaForCausalLM(config))
>>> from_hf_plan(sch, ckpt_ratio=1.0)
>>> for entry in sch.recipe[:5]:
...     print(entry.call_text())
sch['model.embed_tokens'].shard('weight', 0)
sch['model.embed_tokens'].replace(torchloom.schedules.hf_plan.whole_sizes)
sch['model.embed_tokens'].sync('fwd_pre', torchloom.schedules.hf_plan.vocab_ids_local)
sch['model.embed_tokens'].sync('fwd_post', torchloom.schedules.hf_plan.vocab_rows_masked)
sch['model.embed_tokens'].sync('fwd_post', 'all_reduce')
>>> sch.recipe[-1].call_text()
"sch['model.layers'].checkpoint(ratio=1.0)"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.marks import FOREIGN_IDS, WEIGHT_SPEC, get_mark, pop_mark, set_mark, transfer_hooks
from ..core.meta import ShardSpec, get_meta, shard_spec
from ..core.refs import schedule_safe
from ..core.schedule import Schedule
from ..primitives._common import tied_names
from ._common import SEQ_AXIS, finish_layers, install_sharded_loss, takes, tp_divisors
from .config import ScheduleConfig
from .hf_plan_checks import PlanChecks, has_own_params
from .hf_plan_read import (
    COLUMN,
    GATHERED,
    PRIMITIVE,
    REFUSED_STYLES,
    ROW,
    SPLIT_INPUT,
    SUPPORTED_STYLES,
    PlanEntry,
    PlanError,
    expand_plan,
    family_of,
    has_tp_plan,
    layer_stacks,
    pipeline_stack,
    tp_plan_of,
)
from .llama import GradSum, replicate_kv_heads

__all__ = ["PlanError", "PlanEntry", "MlaKvAProjection", "SUPPORTED_STYLES",
           "REFUSED_STYLES", "from_hf_plan", "schedule_hf_plan", "tp_plan_of",
           "has_tp_plan", "expand_plan", "layer_stacks", "pipeline_stack", "vocab_ids_local",
           "vocab_rows_masked", "localise_padding_idx", "whole_sizes",
           "make_mla_kv_a_projection"]

# --------------------------------------------------------------------------- hooks, factories


def _weight_spec(module: nn.Module) -> ShardSpec | None:
    """The shard spec of ``module.weight`` (None: not sharded, or not a tensor). Under
    FSDP2 the weight a forward sees is the gathered parameter, which carries no spec: the
    one :func:`whole_sizes` kept on the module when the schedule was applied answers."""
    weight = module.weight
    found = shard_spec(weight) if isinstance(weight, torch.Tensor) else None
    return found if found is not None else get_mark(module, WEIGHT_SPEC)


@schedule_safe
def vocab_ids_local(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fwd_pre`` hook of a vocabulary-parallel embedding (weight sharded along its rows):
    the ids become row numbers of this rank's slice (an id another rank owns becomes 0 and
    is remembered, for :func:`vocab_rows_masked`)."""
    spec = _weight_spec(module)
    if spec is None:
        raise PlanError(
            "vocab_ids_local needs the embedding's weight sharded along its rows",
            primitive="sync", values={"module": type(module).__name__},
            fix="shard first: sch[path].shard('weight', 0), then the two hooks")
    rows = spec.full_shape[0] // spec.world_size
    start = spec.rank * rows

    def localise(ids: torch.Tensor) -> torch.Tensor:
        foreign = (ids < start) | (ids >= start + rows)
        set_mark(module, FOREIGN_IDS, foreign)
        return (ids - start).masked_fill(foreign, 0)

    if args and isinstance(args[0], torch.Tensor):
        return (localise(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("input"), torch.Tensor):
        return args, {**kwargs, "input": localise(kwargs["input"])}
    return args, kwargs


@schedule_safe
def vocab_rows_masked(module: nn.Module, args: tuple, output: Any) -> Any:
    """``fwd_post`` hook after :func:`vocab_ids_local`: the rows of ids another rank owns
    become zeros, so the all-reduce that follows sums exactly one row per id."""
    foreign = pop_mark(module, FOREIGN_IDS)
    if foreign is None or not isinstance(output, torch.Tensor):
        return output
    return output.masked_fill(foreign.unsqueeze(-1), 0.0)


@schedule_safe
def localise_padding_idx(old: nn.Module) -> nn.Module:
    """``replace`` factory for a vocabulary-parallel embedding: its ``padding_idx`` (the
    row that gets no gradient) becomes the row of this rank's slice, or None where another
    rank owns it. Returns the same module."""
    spec = _weight_spec(old)
    pad = getattr(old, "padding_idx", None)
    if spec is not None and pad is not None:
        rows = spec.full_shape[0] // spec.world_size
        start = spec.rank * rows
        embedding: Any = old  # an nn.Embedding or look-alike: a plain int attribute
        embedding.padding_idx = pad - start if start <= pad < start + rows else None
    return old


@schedule_safe
def whole_sizes(old: nn.Module) -> nn.Module:
    """``replace`` factory for a sharded ``Linear`` or ``Embedding`` whose input and output
    are whole (a gathered column, a row fed a whole input that it splits itself, a
    vocabulary-parallel embedding): its size attributes (``in_features`` /
    ``out_features``, ``num_embeddings`` / ``embedding_dim``) go back to the full sizes,
    which is what the model sees (transformers reads ``lm_head.out_features`` as the
    vocabulary size of the loss). Returns the same module."""
    spec = _weight_spec(old)
    if spec is not None:
        set_mark(old, WEIGHT_SPEC, spec)
        first, second = spec.full_shape[:2]
        if isinstance(old, nn.Linear):
            old.out_features, old.in_features = first, second
        elif isinstance(old, nn.Embedding):
            old.num_embeddings, old.embedding_dim = first, second
    return old


class MlaKvAProjection(nn.Linear):
    """The ``kv_a_proj_with_mqa`` of multi-head latent attention (DeepSeek-V2 style) under
    tensor parallelism: a replicated ``Linear`` whose output is ``[latent | rotary key]``.
    The latent goes through ``kv_b_proj`` (column parallel, its input gradient summed
    there); the rotary key feeds this rank's heads directly, so its gradient is a per-rank
    part: it passes through the ``grad_sum`` child (an identity), on which the schedule
    puts ``sync("bwd_post", "all_reduce")``. Parameters and state-dict keys are the
    Linear's."""

    rope_dim: int
    grad_sum: GradSum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([latent, self.grad_sum(rope)], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rope_dim={self.rope_dim}"


ROPE_TAG = "hf_plan_rope_dim"


@schedule_safe
def make_mla_kv_a_projection(old: nn.Module) -> MlaKvAProjection:
    """``replace`` factory: :class:`MlaKvAProjection` around ``old``'s parameters (the
    same tensors), the rotary width read from the tag ``hf_plan_rope_dim`` that the
    schedule puts on the weight with ``annotate``."""
    weight = old.weight
    rope_dim = get_meta(weight).tags.get(ROPE_TAG) if isinstance(weight, torch.Tensor) else None
    if not isinstance(old, nn.Linear) or not isinstance(rope_dim, int):
        raise PlanError(
            "make_mla_kv_a_projection takes an nn.Linear whose weight carries the tag "
            f"{ROPE_TAG!r} (the rotary head width)",
            primitive="replace", values={"module": type(old).__name__, "rope_dim": rope_dim},
            fix=f"sch[path].annotate('weight', {ROPE_TAG!r}, config.qk_rope_head_dim) first")
    new = MlaKvAProjection.__new__(MlaKvAProjection)
    nn.Module.__init__(new)
    new.in_features, new.out_features = old.in_features, old.out_features
    new.weight = old.weight
    new.bias = old.bias
    new.rope_dim = rope_dim
    new.grad_sum = GradSum()
    new.train(old.training)
    transfer_hooks(old, new)
    return new


# --------------------------------------------------------------------------- planning


@dataclass
class _Op:
    """One primitive call the schedule will make: ``sch[path].<primitive>(*args, **kw)``."""

    path: str
    primitive: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


class _Planner(PlanChecks):
    """Turns the matched plan into a list of primitive calls, checking everything first."""

    def __init__(self, sch: Schedule, entries: list[PlanEntry], *, family: str,
                 sequence_parallel: bool, vocab_parallel: bool,
                 loss_parallel: bool = False) -> None:
        super().__init__(sch, entries, family=family, sequence_parallel=sequence_parallel,
                         vocab_parallel=vocab_parallel, loss_parallel=loss_parallel)
        self.ops: list[_Op] = []
        self.shared_parents: set[str] = set()

    def add(self, path: str, primitive: str, *args: Any, **kwargs: Any) -> None:
        self.ops.append(_Op(path, primitive, args, kwargs))

    def shard(self, entry: PlanEntry, path: str, pname: str, axis: int, chunks: int = 1
              ) -> None:
        """Plan ``sch[path].shard(pname, axis, chunks)``, checking it first."""
        module = self.root.get_submodule(path) if path else self.root
        tensor = module._parameters.get(pname)
        if tensor is None:
            return
        axis %= tensor.dim()
        previous = self.sharded.get(id(tensor))
        if previous is not None:  # a tied tensor another entry sharded already
            if previous[:2] != (axis, chunks):
                raise self.error(
                    f"{path}.{pname} is one tensor with {previous[2]}, which the plan splits "
                    f"along axis {previous[0]} (chunks={previous[1]}); this entry wants axis "
                    f"{axis} (chunks={chunks})", entry,
                    "untie the weights (config.tie_word_embeddings = False) or pass "
                    "vocab_parallel=False", tied_to=previous[2])
            return
        if shard_spec(tensor) is not None:
            raise self.error(
                f"{path}.{pname} is already sharded; from_hf_plan starts from an unsharded "
                "model", entry, "apply from_hf_plan to a fresh schedule of a fresh model")
        size = tensor.shape[axis]
        if size % (self.world * chunks):
            what = f"{chunks} packed blocks of " if chunks > 1 else ""
            per = size // chunks
            fields = self.config_fields(module, per)
            if path in self.vocab_paths:
                raise self.error(
                    f"the plan splits the vocabulary of {path} ({per} rows) over "
                    f"{self.world} ranks, and {per} does not divide by {self.world}", entry,
                    "keep the embeddings and the head whole: from_hf_plan(sch, "
                    "vocab_parallel=False); or pad the vocabulary: model."
                    f"resize_token_embeddings({-(-per // self.world) * self.world})",
                    shape=tuple(tensor.shape), tp_degree=self.world, config_fields=fields)
            raise self.error(
                f"the plan splits {what}axis {axis} of {path}.{pname} (size {size}) over "
                f"{self.world} ranks, and {per} does not divide by {self.world}", entry,
                f"use a tensor-parallel degree in {tp_divisors(per)}, or a config whose "
                f"{' / '.join(fields) or 'size'} is a multiple of {self.world}",
                shape=tuple(tensor.shape), tp_degree=self.world, config_fields=fields)
        owners = [name.rpartition(".")[0] for _, _, name in tied_names(self.root, tensor)]
        self.sharded[id(tensor)] = (axis, chunks, path)
        if len(owners) > 1:
            self.tied[id(tensor)] = owners
        kwargs: dict[str, Any] = {}
        if chunks > 1:
            kwargs["chunks"] = chunks
        if len(owners) > 1:
            kwargs["tied"] = True
        self.add(path, "shard", pname, axis, **kwargs)

    # ---------------------------------------------------------------- styles

    def column(self, entry: PlanEntry, module: nn.Module, *, chunks: int = 1) -> None:
        for pname, param in module._parameters.items():
            if param is not None and not self.param_has_entry(entry.path, pname):
                self.shard(entry, entry.path, pname, 0, chunks)

    def input_grad_sync(self, path: str) -> None:
        """The all-reduce of a column-parallel module's input gradient: ``shared=True``
        where its parent holds other column-parallel modules (q, k and v; gate and up),
        so that the siblings handed the same tensor reduce it once."""
        if path.rpartition(".")[0] in self.shared_parents:
            self.add(path, "sync", "bwd_post", "all_reduce", shared=True)
        else:
            self.add(path, "sync", "bwd_post", "all_reduce")

    def column_siblings(self) -> set[str]:
        """The parents of two or more column-parallel modules of the plan (the modules
        whose input gradients the schedule all-reduces)."""
        parents: dict[str, int] = {}
        for e in self.entries:
            if e.param is None and e.style in COLUMN and "." in e.path and \
                    (self.vocab_parallel or e.path not in self.vocab_paths):
                parent = e.path.rpartition(".")[0]
                parents[parent] = parents.get(parent, 0) + 1
        return {p for p, n in parents.items() if n > 1}

    def param_has_entry(self, path: str, pname: str) -> bool:
        return any(e.path == path and e.param == pname for e in self.entries)

    def module_style(self, entry: PlanEntry) -> None:
        style = entry.style
        path = entry.path
        module = self.root.get_submodule(path) if path else self.root
        if style in COLUMN:
            self.column(entry, module, chunks=2 if style == "packed_colwise" else entry.chunks)
            if style in GATHERED and not self.is_loss_head(path):  # loss parallel: split
                self.add(path, "replace", whole_sizes)
                self.add(path, "sync", "fwd_post", "all_gather", axis=-1,
                         tensor_parallel_output_grad=False)
            # inside a sequence-parallel region too: the region's gather then keeps
            # this rank's slice of a whole gradient in backward
            self.input_grad_sync(path)
        elif style in ROW:
            if module._parameters.get("weight") is not None and \
                    not self.param_has_entry(path, "weight"):
                self.shard(entry, path, "weight", 1)
            if style in SPLIT_INPUT:
                self.add(path, "replace", whole_sizes)
                self.add(path, "sync", "fwd_pre", "scatter", axis=-1)
            if path in self.sp_row_closers:  # it ends a sequence-parallel region
                self.add(path, "sync", "fwd_post", "reduce_scatter", axis=SEQ_AXIS)
                if getattr(module, "bias", None) is not None:
                    self.add(path, "sync", "param_grad", "all_reduce")
            else:
                self.add(path, "sync", "fwd_post", "all_reduce")
        elif style == "embedding_rowwise":
            if any(True for _ in module.children()):
                return  # its forward runs a module of its own (a norm) on the rows: whole
            self.shard(entry, path, "weight", 0)
            if getattr(module, "padding_idx", None) is not None:
                self.add(path, "replace", localise_padding_idx)
            self.add(path, "replace", whole_sizes)
            self.add(path, "sync", "fwd_pre", vocab_ids_local)
            self.add(path, "sync", "fwd_post", vocab_rows_masked)
            self.add(path, "sync", "fwd_post", "all_reduce")
        elif style == "embedding_colwise":
            if any(True for _ in module.children()):
                return
            self.shard(entry, path, "weight", 1)
            self.add(path, "replace", whole_sizes)
            self.add(path, "sync", "fwd_post", "all_gather", axis=-1,
                     tensor_parallel_output_grad=False)
        elif style == "replicated_with_grad_allreduce":
            if has_own_params(module):
                self.add(path, "sync", "param_grad", "all_reduce")
        elif style == "all_reduce":
            inside = [e for e in self.entries if e.path.startswith(f"{path}.")
                      and e.param is None and e.style in (*COLUMN, *ROW)]
            if any(e.style in ROW for e in inside):
                raise self.error(
                    f"the plan all-reduces the output of {path}, and {inside[0].path} inside "
                    "it already reduces its own: the sum would be taken twice", entry,
                    "drop one of the two from the plan (plan=...)")
            if not inside:  # its own split parameters: the inputs' gradients are parts too
                for name in self.float_inputs(entry, module):
                    self.add(path, "sync", "bwd_post", "all_reduce", input_name=name)
            self.add(path, "sync", "fwd_post", "all_reduce")
        elif style == "moe_tp_experts":
            self.check_experts(entry, module)
            # (hidden_states, top_k_index, top_k_weights): the hidden states and the
            # routing weights reach this rank's share of every expert only
            for name in self.float_inputs(entry, module):
                self.add(path, "sync", "bwd_post", "all_reduce", input_name=name)
            self.add(path, "sync", "fwd_post", "all_reduce")
        elif style == "mla_kv_a_proj":
            rope = self.rope_dim(entry)
            self.add(path, "annotate", "weight", ROPE_TAG, rope)
            self.add(path, "replace", make_mla_kv_a_projection)
            self.add(f"{path}.grad_sum", "sync", "bwd_post", "all_reduce")

    def param_style(self, entry: PlanEntry, pname: str) -> None:
        """The style of a parameter entry (``pname`` is ``entry.param``)."""
        module = self.root.get_submodule(entry.path) if entry.path else self.root
        param = module._parameters[pname]
        assert param is not None  # expand_plan matched only parameters that are set
        ndim = param.dim()
        style = entry.style
        packed = 2 if getattr(module, "is_concatenated", True) else 1
        if style == "colwise" and packed == 2 and getattr(module, "has_gate", False) and \
                "gate_up" in pname:
            style = "packed_colwise"  # [gate | up] split as one block would mix them up
        if style in ("colwise", "colwise_gather_output", "colwise_rep"):
            self.shard(entry, entry.path, pname, ndim - 2 if ndim >= 2 else 0)
        elif style == "packed_colwise":
            self.shard(entry, entry.path, pname, ndim - 2 if ndim >= 2 else 0, packed)
        elif style in ROW and ndim >= 2:
            self.shard(entry, entry.path, pname, ndim - 1)
        elif style == "packed_rowwise" and ndim >= 2:
            self.shard(entry, entry.path, pname, ndim - 1, packed)

    # ---------------------------------------------------------------- all of it

    def plan(self, stacks: list[str]) -> list[_Op]:
        self.sp_param_grads = []
        self.sp_regions = []
        self.shared_parents = self.column_siblings()
        for entry in self.entries:
            self.check_style(entry)
        if self.sp:
            self.plan_sequence_parallel(stacks)
        replicated = self.kv_replicated()
        for entry in self.entries:
            module = self.root.get_submodule(entry.path) if entry.path else self.root
            if not self.vocab_parallel and entry.path in self.vocab_paths and \
                    not self.is_loss_head(entry.path):
                continue
            parent, _, name = entry.path.rpartition(".")
            if parent in replicated and name in ("k_proj", "v_proj"):
                continue  # replicated below
            if entry.param is not None:
                self.param_style(entry, entry.param)
                continue
            if entry.style in COLUMN and entry.style not in GATHERED and \
                    entry.style != "packed_colwise":
                assert isinstance(module, nn.Linear)  # check_style: column styles split Linears
                self.check_heads(entry, module)
                self.check_norms_of_split_heads(entry, module)
            if entry.style == "rowwise" and isinstance(module, nn.Linear):
                self.check_norms_of_split_input(entry, module)
            self.module_style(entry)
        for path in self.partial_grad_modules(replicated):
            self.add(path, "sync", "param_grad", "all_reduce")
        for attn in replicated:  # fewer KV heads than ranks: each shared by tp / kv ranks
            self.add(attn, "replace", replicate_kv_heads)
            for name in ("k_proj", "v_proj"):
                self.input_grad_sync(f"{attn}.{name}")
                self.add(f"{attn}.{name}.grad_sum", "sync", "bwd_post", "all_reduce")
        for region, input_name in self.sp_regions:  # gather each region's input
            self.add(region, "sync", "fwd_pre", "all_gather", axis=SEQ_AXIS,
                     tensor_parallel_output_grad=False,
                     **({"input_name": input_name} if input_name else {}))
        for path in self.sp_param_grads:
            self.add(path, "sync", "param_grad", "all_reduce")
        if self.sp:
            start, input_name = self.sp_start
            self.add(start, "sync", "fwd_pre", "scatter", axis=SEQ_AXIS,
                     **({"input_name": input_name} if input_name else {}))
            self.add(self.sp_end, "sync", "fwd_post", "all_gather", axis=SEQ_AXIS,
                     tensor_parallel_output_grad=False)
        self.check_ties()
        return self.ops


# --------------------------------------------------------------------------- the schedule


def _check_knob_types(sch: Schedule, tp: Any, sequence_parallel: Any, ckpt_ratio: Any,
                      compile: Any, vocab_parallel: Any, plan: Any,
                      loss_parallel: Any = False) -> ScheduleConfig:
    if not isinstance(tp, bool):
        raise PlanError("tp must be True or False", path=sch.path, primitive=PRIMITIVE,
                        values={"tp": repr(tp)}, fix="from_hf_plan(sch, tp=True)")
    config = ScheduleConfig(tp=2 if tp else 1, sequence_parallel=sequence_parallel,
                            ckpt_ratio=ckpt_ratio, compile=compile, vocab_parallel=vocab_parallel,
                            loss_parallel=loss_parallel)
    if plan is not None and not (isinstance(plan, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in plan.items())):
        raise PlanError("plan must map module or parameter paths (with * for a layer "
                        "index) to style names", path=sch.path, primitive=PRIMITIVE,
                        values={"plan": repr(plan)[:80]},
                        fix="plan={'model.layers.*.mlp.up_proj': 'colwise', ...}")
    return config



def from_hf_plan(sch: Schedule, tp: bool = True, sequence_parallel: bool = False,
                 ckpt_ratio: float = 0.0, compile: bool | str = False, *,
                 vocab_parallel: bool = True, plan: dict[str, str] | None = None,
                 pipeline_stages: int = 1, example_inputs: Any = None,
                 loss_parallel: bool = False) -> None:
    """Apply the tensor-parallel schedule that ``sch.mod``'s transformers plan describes
    (see the module docstring for each style), then cut ``pipeline_stages`` stages in the
    pipeline plan's stack of layers (``trace_until`` with ``example_inputs``, the batch
    the model will be called with, then ``cut_pipeline_stage`` after every
    ``layers / pipeline_stages`` layers), checkpoint the first ``ckpt_ratio`` of each
    stack of layers and compile each layer (``compile``).

    Everything is checked before any primitive is applied (a refusal leaves the model
    unchanged): the knobs, every style, the module types, and the sizes the ranks must
    split (heads and KV heads by config field, the vocabulary, the MLP's features).
    ``plan`` replaces the model's own plan (keys are paths from ``sch``'s module).
    ``loss_parallel``: the (untied) head stays split along the vocabulary, its logits not
    gathered (its input gradient all-reduced, also under sequence parallelism), and the
    model's loss becomes the vocabulary-parallel chunked one.
    """
    config = _check_knob_types(sch, tp, sequence_parallel, ckpt_ratio, compile,
                               vocab_parallel, plan, loss_parallel)
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or \
            pipeline_stages < 1:
        raise PlanError("pipeline_stages must be a positive integer", path=sch.path,
                        primitive=PRIMITIVE, values={"pipeline_stages": repr(pipeline_stages)},
                        fix="from_hf_plan(sch, pipeline_stages=2, example_inputs=batch)")
    model = sch.mod
    family = family_of(model)
    the_plan = dict(plan) if plan is not None else tp_plan_of(model)
    stacks = layer_stacks(sch, the_plan)
    cuts: list[str] = []
    if pipeline_stages > 1:
        pipe, cuts = pipeline_stack(sch, pipeline_stages, stacks)
    ops: list[_Op] = []
    if tp:
        if not the_plan:
            raise PlanError(
                f"{type(model).__name__} has no tensor-parallel plan (its config class "
                "declares no base_model_tp_plan)", path=sch.path, primitive=PRIMITIVE,
                values={"style": None, "family": family, "model": type(model).__name__},
                fix="pass one: from_hf_plan(sch, plan={'layers.*.mlp.up_proj': 'colwise', "
                "...}), or write the schedule with shard and sync")
        entries = expand_plan(sch, the_plan)
        if not entries:
            raise PlanError(
                "no key of the tensor-parallel plan matches a module or parameter of "
                f"{type(model).__name__}", path=sch.path, primitive=PRIMITIVE,
                values={"style": None, "family": family, "keys": sorted(the_plan)[:5]},
                fix="schedule the model the plan belongs to (its ...ForCausalLM or base "
                "model), or pass plan= with this module's paths")
        planner = _Planner(sch, entries, family=family,
                           sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel,
                           loss_parallel=loss_parallel)
        ops = planner.plan(stacks)
    if (ckpt_ratio or compile is not False) and not stacks:
        raise PlanError(
            "ckpt_ratio and compile act on the stacks of layers the plans name, and this "
            "model's plans name none", path=sch.path, primitive=PRIMITIVE,
            values={"style": None, "family": family, "ckpt_ratio": ckpt_ratio,
                    "compile": compile},
            fix="checkpoint / compile the layers by hand: sch['...layers'].checkpoint("
            "ratio=0.5)")
    for op in ops:
        node = sch[op.path] if op.path else sch
        getattr(node, op.primitive)(*op.args, **op.kwargs)
    if cuts:  # before checkpoint: a checkpointed layer is a leaf the tracer does not enter
        rel = f"{pipe}.*"
        if example_inputs is None:
            sch.trace_until(rel)
        else:
            sch.trace_until(rel, example_inputs=example_inputs)
        for cut in cuts:
            sch[cut].cut_pipeline_stage()
    for stack in stacks:
        finish_layers(sch[stack], config)
    if tp and loss_parallel:
        install_sharded_loss(sch)


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile", "vocab_parallel", "loss_parallel")
def schedule_hf_plan(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """The built-in schedule of a model class with no hand-written one and a transformers
    tensor-parallel plan: :func:`from_hf_plan` with the knobs of every built-in schedule
    (``tp`` off unless asked, as in the others)."""
    from_hf_plan(sch, tp=config.tp_over(sch), sequence_parallel=config.sequence_parallel,
                 ckpt_ratio=config.ckpt_ratio, compile=config.compile,
                 vocab_parallel=config.vocab_parallel, loss_parallel=config.loss_parallel)
