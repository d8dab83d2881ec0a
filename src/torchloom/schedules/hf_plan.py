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

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import TPPlanError as PlanError
from ..core.marks import FOREIGN_IDS, pop_mark, set_mark, transfer_hooks
from ..core.meta import get_meta, shard_spec
from ..core.refs import schedule_safe
from ..core.rules import even_cuts
from ..core.schedule import Schedule
from ..primitives._common import tied_names
from ._common import SEQ_AXIS, finish_layers, takes, tp_divisors
from .config import ScheduleConfig
from .llama import GradSum, replicate_kv_heads

__all__ = ["PlanError", "PlanEntry", "MlaKvAProjection", "SUPPORTED_STYLES",
           "REFUSED_STYLES", "from_hf_plan", "schedule_hf_plan", "tp_plan_of",
           "has_tp_plan", "expand_plan", "layer_stacks", "pipeline_stack", "vocab_ids_local",
           "vocab_rows_masked", "localise_padding_idx", "whole_sizes",
           "make_mla_kv_a_projection"]

PRIMITIVE = "schedules.from_hf_plan"

COLUMN = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
GATHERED = ("colwise_gather_output", "colwise_rep")
ROW = ("rowwise", "rowwise_split_input", "rowwise_rep")
# the usual names of the projections into attention heads
_HEAD_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_b_proj", "kv_b_proj",
               "query_key_value")
# modules that mix sequence positions (by class or attribute name): never on SP slices
_MIXES_POSITIONS = re.compile(r"(?i)attention|attn|mamba|mixer|conv|recurren|deltanet|ssm|"
                              r"rwkv|retention|linear_attn")
# layer inputs that are masks over (query, key) pairs, not per token
_WHOLE_MASKS = ("attention_mask", "causal_mask", "head_mask", "encoder_attention_mask",
                "cross_attention_mask")
# projection names whose output is split into attention heads
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv", "query", "key", "value", "q_b_proj",
                     "kv_b_proj")
SPLIT_INPUT = ("rowwise_split_input", "rowwise_rep")
EMBEDDING = ("embedding_rowwise", "embedding_colwise")
NOTHING = ("replicate", "local_params")
SUPPORTED_STYLES = (*COLUMN, *ROW, "packed_rowwise", *EMBEDDING,
                    "replicated_with_grad_allreduce", "all_reduce", "moe_tp_experts",
                    "mla_kv_a_proj", *NOTHING)
#: styles that are refused, and why
REFUSED_STYLES = {
    "moe_identity_expert": "an identity expert would need its input divided by the "
    "tensor-parallel degree so that the experts' all-reduce counts it once; torchloom has "
    "no primitive that scales an activation",
    "sequence_parallel": "transformers' sequence_parallel style is not a tensor-parallel "
    "split; use the knob from_hf_plan(sch, sequence_parallel=True)",
    "grouped_gemm": "expert parallelism (each rank a subset of the experts) is not "
    "supported; the plan's moe_tp_experts splits every expert instead",
    "ep_dispatch_experts": "expert parallelism (each rank a subset of the experts) is not "
    "supported; the plan's moe_tp_experts splits every expert instead",
    "ep_router": "expert parallelism (each rank a subset of the experts) is not "
    "supported; the plan's moe_tp_experts splits every expert instead",
}


@dataclass(frozen=True)
class PlanEntry:
    """One plan key matched in the model: the module at ``path`` (or its parameter
    ``param``) gets ``style``; ``key`` is the plan key that matched."""

    path: str
    style: str
    key: str
    param: str | None = None
    chunks: int = 1  # "colwise_fused(3)": a projection packing 3 outputs side by side

    @property
    def target(self) -> str:
        """The module path, or the parameter's full name."""
        return f"{self.path}.{self.param}" if self.param else self.path


# --------------------------------------------------------------------------- the plan


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` under its own paths: transformers' merged
    ``model.tp_plan`` (config ``base_model_tp_plan`` prefixed with ``base_model_prefix``,
    the class's ``_tp_plan``, the vocabulary-parallel ``embed_tokens``), or ``{}``.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
    ...     num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
    >>> plan = tp_plan_of(transformers.LlamaForCausalLM(cfg))
    >>> plan["lm_head"], plan["model.layers.*.self_attn.o_proj"]
    ('colwise_gather_output', 'rowwise')
    """
    try:
        plan = getattr(model, "tp_plan", None)
    except Exception:  # noqa: BLE001 (a model class whose plans were never initialised)
        plan = None
    return dict(plan) if isinstance(plan, dict) else {}


def has_tp_plan(model: nn.Module) -> bool:
    """Whether transformers declares a tensor-parallel plan for ``model``."""
    return bool(tp_plan_of(model))


def _generic(name: str) -> str:
    """``name`` with every numeric path component replaced by ``*`` (a plan key)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def family_of(model: nn.Module) -> str:
    """The transformers model type of ``model`` (its class name without a config)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


_FUSED = re.compile(r"colwise_fused\((\d{1,2})\)")


def _entry(path: str, style: str, key: str, param: str | None = None) -> PlanEntry:
    """A plan entry; ``colwise_fused(N)`` is ``colwise`` of a projection whose output
    packs N blocks side by side (q | k | v: each rank keeps its share of each block)."""
    found = _FUSED.fullmatch(style) if isinstance(style, str) else None
    if found and int(found.group(1)) >= 2:
        return PlanEntry(path, "colwise", key, param, chunks=int(found.group(1)))
    return PlanEntry(path, style, key, param)


def expand_plan(sch: Schedule, plan: dict[str, str]) -> list[PlanEntry]:
    """The plan's keys matched against the module tree of ``sch``, in module order (a
    module's parameter keys right after it); keys that match nothing are left out.
    ``colwise_fused(N)`` (N >= 2) is ``colwise`` with the weight split as N packed blocks
    (a fused q/k/v projection: ``colwise_fused(3)``)."""
    entries: list[PlanEntry] = []
    seen: set[int] = set()
    for path, node in sch.named_schedules():
        if id(node.mod) in seen:
            continue
        seen.add(id(node.mod))
        generic = _generic(path)
        if path and generic in plan:
            entries.append(_entry(path, plan[generic], generic))
        for pname, param in node.mod._parameters.items():
            if param is None:
                continue
            key = _generic(f"{path}.{pname}" if path else pname)
            if key in plan:
                entries.append(_entry(path, plan[key], key, pname))
    return entries


def layer_stacks(sch: Schedule, plan: dict[str, str] | None = None) -> list[str]:
    """Paths of the layer lists (``ModuleList`` / ``Sequential``) the plans name: the
    prefix before ``.*.`` of the tensor-parallel plan's keys and the pipeline plan's
    entries, in module order; when they name none, the outermost ``ModuleList``s."""
    model = sch.mod
    plan = tp_plan_of(model) if plan is None else plan
    names = {key.split(".*.")[0] for key in plan if ".*." in key}
    try:
        pp = getattr(model, "pp_plan", None) or {}
    except Exception:  # noqa: BLE001
        pp = {}
    names |= set(pp)
    stacks = []
    for path, node in sch.named_schedules():
        if path in names and isinstance(node.mod, (nn.ModuleList, nn.Sequential)) and \
                node.child:
            stacks.append(path)
    if not stacks:  # plans that name no layer list: the outermost ModuleLists
        for path, node in sch.named_schedules():
            if path and isinstance(node.mod, nn.ModuleList) and node.child and \
                    not any(path.startswith(f"{s}.") for s in stacks):
                stacks.append(path)
    return stacks


# --------------------------------------------------------------------------- hooks, factories


@schedule_safe
def vocab_ids_local(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fwd_pre`` hook of a vocabulary-parallel embedding (weight sharded along its rows):
    the ids become row numbers of this rank's slice (an id another rank owns becomes 0 and
    is remembered, for :func:`vocab_rows_masked`)."""
    spec = shard_spec(module.weight)
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
    spec = shard_spec(old.weight)
    pad = getattr(old, "padding_idx", None)
    if spec is not None and pad is not None:
        rows = spec.full_shape[0] // spec.world_size
        start = spec.rank * rows
        old.padding_idx = pad - start if start <= pad < start + rows else None
    return old


@schedule_safe
def whole_sizes(old: nn.Module) -> nn.Module:
    """``replace`` factory for a sharded ``Linear`` or ``Embedding`` whose input and output
    are whole (a gathered column, a row fed a whole input that it splits itself, a
    vocabulary-parallel embedding): its size attributes (``in_features`` /
    ``out_features``, ``num_embeddings`` / ``embedding_dim``) go back to the full sizes,
    which is what the model sees (transformers reads ``lm_head.out_features`` as the
    vocabulary size of the loss). Returns the same module."""
    spec = shard_spec(old.weight)
    if spec is not None:
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
    rope_dim = get_meta(old.weight).tags.get(ROPE_TAG)
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


def _first_input(module: nn.Module) -> str | None:
    """The name of the first parameter of ``module.forward`` (its activation input)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def _is_norm(module: nn.Module) -> bool:
    return any("Norm" in c.__name__ for c in type(module).__mro__)


def _has_own_params(module: nn.Module) -> bool:
    return any(p is not None and p.requires_grad for p in module._parameters.values())


class _Planner:
    """Turns the matched plan into a list of primitive calls, checking everything first."""

    def __init__(self, sch: Schedule, entries: list[PlanEntry], *, family: str,
                 sequence_parallel: bool, vocab_parallel: bool) -> None:
        self.sch = sch
        self.root = sch.mod
        self.world = sch.world_size
        self.family = family
        self.sp = sequence_parallel
        self.vocab_parallel = vocab_parallel
        self.entries = entries
        self.ops: list[_Op] = []
        self.sharded: dict[int, tuple[int, int, str]] = {}  # id(tensor) -> axis, chunks, by
        self.tied: dict[int, list[str]] = {}  # id(tensor) -> module paths holding it
        self.sp_row_closers: set[str] = set()  # SP: row-parallel modules ending a region
        self.planned_paths = {e.path for e in entries if e.param is None}
        self.vocab_paths = self._vocab_paths()

    # ---------------------------------------------------------------- errors

    def error(self, problem: str, entry: PlanEntry | None, fix: str, path: str | None = None,
              **values: Any) -> PlanError:
        style = values.pop("style", entry.style if entry else None)
        base = {"style": style, "family": self.family}
        if entry is not None:
            base["plan_key"] = entry.key
        return PlanError(problem, path=path if path is not None else (entry.target if entry
                                                                      else self.sch.path),
                         primitive=PRIMITIVE, values={**base, **values}, fix=fix)

    def config_fields(self, module: nn.Module | None, value: int) -> list[str]:
        """Config fields (of the module's config, else the model's) equal to ``value``."""
        found: list[str] = []
        configs = [getattr(module, "config", None), getattr(self.root, "config", None)]
        for config in configs:
            if config is None:
                continue
            for name, v in sorted(vars(config).items()):
                if isinstance(v, int) and not isinstance(v, bool) and v == value and \
                        not name.startswith("_") and name not in found and \
                        not name.endswith("token_id"):
                    found.append(name)
        return found

    # ---------------------------------------------------------------- helpers

    def node(self, path: str) -> Schedule:
        return self.sch[path] if path else self.sch

    def add(self, path: str, primitive: str, *args: Any, **kwargs: Any) -> None:
        self.ops.append(_Op(path, primitive, args, kwargs))

    def _vocab_paths(self) -> set[str]:
        """Paths of the input and output embeddings (and every nn.Embedding the plan
        splits along the vocabulary)."""
        paths: set[str] = set()
        targets = []
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            fn = getattr(self.root, getter, None)
            try:
                module = fn() if callable(fn) else None
            except Exception:  # noqa: BLE001 (not implemented by every model)
                module = None
            if isinstance(module, nn.Module):
                targets.append(module)
        for path, module in self.root.named_modules():
            if any(module is t for t in targets) or (
                    isinstance(module, nn.Embedding) and any(
                        e.path == path and e.style in EMBEDDING for e in self.entries)):
                paths.add(path)
        return paths

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

    # ---------------------------------------------------------------- checks

    def check_style(self, entry: PlanEntry) -> None:
        style = entry.style
        if style in REFUSED_STYLES:
            raise self.error(f"the plan's style {style!r} is not supported: "
                             f"{REFUSED_STYLES[style]}", entry,
                             "pass a plan without it: from_hf_plan(sch, plan={...})")
        if style not in SUPPORTED_STYLES:
            raise self.error(f"unknown tensor-parallel style {style!r}", entry,
                             f"use one of {', '.join(SUPPORTED_STYLES)} in plan=")
        module = self.root.get_submodule(entry.path) if entry.path else self.root
        if entry.param is not None:
            if style not in (*COLUMN, *ROW, "packed_rowwise", *NOTHING):
                raise self.error(f"the style {style!r} applies to a module, not to the "
                                 f"parameter {entry.param!r}", entry,
                                 "name the module in the plan key")
            return
        linear_styles = (*COLUMN, *ROW, "mla_kv_a_proj")
        if style in linear_styles and not isinstance(module, nn.Linear):
            raise self.error(f"the style {style!r} splits a Linear layer, and "
                             f"{entry.path} is a {type(module).__name__}", entry,
                             "name the Linear in the plan, or write the schedule by hand")
        if style in EMBEDDING and not isinstance(module, nn.Embedding):
            raise self.error(f"the style {style!r} splits an nn.Embedding, and "
                             f"{entry.path} is a {type(module).__name__}", entry,
                             "name the embedding in the plan")
        if style == "packed_rowwise":
            raise self.error("packed_rowwise is a style of a packed expert parameter, not of "
                             "a module", entry, "name the parameter in the plan key")

    def check_heads(self, entry: PlanEntry, module: nn.Module) -> None:
        """A column-parallel projection whose output is split into heads: every rank must
        get whole heads, named by config field."""
        parent = self.root.get_submodule(entry.path.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None) or getattr(parent, "head_size", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            return
        out = module.weight.shape[0]
        if out % head_dim:
            return
        heads = out // head_dim
        if heads % self.world == 0:
            return
        name = entry.path.rpartition(".")[2]
        fields = [f for f in self.config_fields(parent, heads) if "head" in f]
        if not fields and not any(t in name for t in _HEAD_PROJECTIONS):
            return  # not a projection into heads (e.g. one gate value per head)
        kv_like = name.startswith(("k", "v"))
        fields.sort(key=lambda f: ("key_value" in f or "kv" in f) != kv_like)
        if fields:
            what, fix_what = f"{fields[0]}={heads}", f"a config whose {fields[0]} is a " \
                f"multiple of {self.world}"
        else:
            what, fix_what = f"its head count {heads}", "a config with more heads"
        kv = kv_like and (not fields or "key_value" in fields[0] or "kv" in fields[0])
        fix = (f"use a tensor-parallel degree that divides {what} (one of "
               f"{tp_divisors(heads)}), or {fix_what}")
        if kv and self.world % heads == 0:
            fix += ("; fewer KV heads than ranks are replicated only in an attention whose "
                    "q_proj, k_proj and v_proj are all colwise Linears and which has "
                    "head_dim and num_key_value_groups (as Llama's)")
        raise self.error(
            f"tensor parallelism gives each of the {self.world} ranks whole heads of "
            f"{name}, and {what} does not divide by {self.world}", entry, fix,
            path=entry.path, **{fields[0] if fields else "heads": heads},
            head_dim=head_dim, tp_degree=self.world)

    def check_norms_of_split_heads(self, entry: PlanEntry, module: nn.Module) -> None:
        """A norm next to a column-parallel projection that normalises all of that
        projection's features (not one head) cannot run on this rank's heads; and the
        other projections into heads next to it must be split too (a config can enable a
        projection the plan does not name, e.g. ``q_proj`` where the plan names the
        low-rank ``q_b_proj``)."""
        parent_path = entry.path.rpartition(".")[0]
        parent = self.root.get_submodule(parent_path)
        if entry.path.rpartition(".")[2] in _HEAD_NAMES:
            for name, child in parent.named_children():
                full = f"{parent_path}.{name}"
                if name in _HEAD_NAMES and isinstance(child, nn.Linear) and \
                        full not in self.planned_paths:
                    raise self.error(
                        f"the plan splits the heads of {entry.path} but not those of {full}, "
                        "which the attention combines with them", entry,
                        f"add {full} to the plan, as colwise (plan=...)", unsplit=full)
        out = module.weight.shape[0]
        head_dim = getattr(parent, "head_dim", None)
        stem = entry.path.rpartition(".")[2].split("_")[0]  # q_proj -> q
        for name, child in parent.named_children():
            weight = child._parameters.get("weight")
            if not _is_norm(child) or weight is None or weight.dim() != 1 or \
                    not name.startswith(f"{stem}_"):
                continue
            if weight.shape[0] == out and out != head_dim:
                raise self.error(
                    f"the plan splits the features of {entry.path} ({out}) over the ranks, "
                    f"but {name} normalises all {out} of them together, which no rank holds",
                    entry, "gather the projection's output instead: the style "
                    "colwise_gather_output (with rowwise_split_input on the output "
                    "projection), in plan=", norm=f"{parent_path}.{name}", features=out)

    def check_norms_of_split_input(self, entry: PlanEntry, module: nn.Module) -> None:
        """A norm next to a row-parallel projection that normalises all of its (split)
        input features, e.g. a "sub-norm" before the output projection, cannot run on this
        rank's features."""
        parent_path = entry.path.rpartition(".")[0]
        parent = self.root.get_submodule(parent_path)
        width = module.weight.shape[1]  # the full input width, before the shard
        block = parent_path  # the lowest module around it that holds column-parallel ones
        while True:
            columns = [self.root.get_submodule(e.path) for e in self.entries
                       if e.param is None and e.style in COLUMN and e.style not in GATHERED
                       and e.path.startswith(f"{block}.")]
            up, above = block.rpartition(".")[0], block.rpartition(".")[0].rpartition(".")[0]
            if columns or not up or isinstance(
                    self.root.get_submodule(above) if above else self.root, nn.ModuleList):
                break  # found, or the next step would reach the layer (or the root)
            block = up
        if not columns:
            raise self.error(
                f"the plan splits the input features of {entry.path}, and nothing in "
                f"{parent_path} is column parallel: its input is whole on every rank (a "
                "layer of another type whose output projection has the same name?)", entry,
                "rowwise_split_input splits a whole input itself; or a plan without this "
                "module (plan=...)", parent=parent_path)
        model_width = columns[0].weight.shape[1]
        for name, child in parent.named_children():
            weight = child._parameters.get("weight")
            if f"{parent_path}.{name}" in self.planned_paths or not _is_norm(child) or \
                    weight is None or weight.dim() != 1 or weight.shape[0] != width:
                continue
            if width != model_width or "sub" in name:
                raise self.error(
                    f"the plan splits the input features of {entry.path} ({width}) over the "
                    f"ranks, but {name} normalises all {width} of them together, which no "
                    "rank holds", entry, "gather instead: colwise_gather_output on the "
                    "projections that feed it and rowwise_split_input here, in plan=",
                    norm=f"{parent_path}.{name}", features=width)

    def check_experts(self, entry: PlanEntry, module: nn.Module) -> None:
        split = {id(module._parameters[e.param]) for e in self.entries
                 if e.param is not None and e.path == entry.path and e.style not in NOTHING
                 and module._parameters.get(e.param) is not None}
        for name, param in module.named_parameters():
            if "." in name:  # a child module's: it needs a plan entry of its own
                child = name.rpartition(".")[0]
                if f"{entry.path}.{child}" in self.planned_paths:
                    continue
            if id(param) not in split and param.dim() > 0:
                raise self.error(
                    f"the experts' parameter {name!r} is not split by the plan; each rank's "
                    "partial output would add it whole, and the all-reduce would count it "
                    f"{self.world} times", entry,
                    f"add a style for {entry.key}.{name} to the plan (plan=...)",
                    parameter=name)

    # ---------------------------------------------------------------- styles

    def column(self, entry: PlanEntry, module: nn.Module, *, chunks: int = 1) -> None:
        for pname, param in module._parameters.items():
            if param is not None and not self.param_has_entry(entry.path, pname):
                self.shard(entry, entry.path, pname, 0, chunks)

    def param_has_entry(self, path: str, pname: str) -> bool:
        return any(e.path == path and e.param == pname for e in self.entries)

    def module_style(self, entry: PlanEntry) -> None:
        style = entry.style
        path = entry.path
        module = self.root.get_submodule(path) if path else self.root
        if style in COLUMN:
            self.column(entry, module, chunks=2 if style == "packed_colwise" else entry.chunks)
            if style in GATHERED:
                self.add(path, "replace", whole_sizes)
                self.add(path, "sync", "fwd_post", "all_gather", axis=-1,
                         tensor_parallel_output_grad=False)
            # inside a sequence-parallel region too: the region's gather then keeps
            # this rank's slice of a whole gradient in backward
            self.add(path, "sync", "bwd_post", "all_reduce")
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
            if _has_own_params(module):
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

    def float_inputs(self, entry: PlanEntry, module: nn.Module) -> list[str]:
        """The required inputs of ``module.forward`` that can carry a gradient (not ids,
        indices or masks): each reaches only this rank's split parameters, so each one's
        gradient is summed over the ranks."""
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
        names = [p.name for p in params
                 if not re.search(r"index|indices|ids|mask|position", p.name)]
        if not names:
            raise self.error(f"the forward of {entry.path} takes no named activation input",
                             entry, "write the schedule by hand")
        return names

    def rope_dim(self, entry: PlanEntry) -> int:
        for owner in (self.root.get_submodule(entry.path.rpartition(".")[0]), self.root):
            config = getattr(owner, "config", None)
            if config is not None and hasattr(config, "get_text_config"):
                config = config.get_text_config()
            rope = getattr(config, "qk_rope_head_dim", None)
            if isinstance(rope, int):
                return rope
        raise self.error("mla_kv_a_proj splits the projection's output at the rotary "
                         "head width, and the config has no qk_rope_head_dim", entry,
                         "write the schedule by hand")

    def param_style(self, entry: PlanEntry) -> None:
        module = self.root.get_submodule(entry.path) if entry.path else self.root
        param = module._parameters[entry.param]
        ndim = param.dim()
        style = entry.style
        packed = 2 if getattr(module, "is_concatenated", True) else 1
        if style == "colwise" and packed == 2 and getattr(module, "has_gate", False) and \
                "gate_up" in entry.param:
            style = "packed_colwise"  # [gate | up] split as one block would mix them up
        if style in ("colwise", "colwise_gather_output", "colwise_rep"):
            self.shard(entry, entry.path, entry.param, ndim - 2 if ndim >= 2 else 0)
        elif style == "packed_colwise":
            self.shard(entry, entry.path, entry.param, ndim - 2 if ndim >= 2 else 0, packed)
        elif style in ROW and ndim >= 2:
            self.shard(entry, entry.path, entry.param, ndim - 1)
        elif style == "packed_rowwise" and ndim >= 2:
            self.shard(entry, entry.path, entry.param, ndim - 1, packed)

    # ---------------------------------------------------------------- sequence parallelism

    def plan_sequence_parallel(self, stacks: list[str]) -> None:
        """Find the regions of every layer and plan SP's syncs around them (see
        :meth:`plan_layer_regions`); the first layer scatters its input along the
        sequence, the last gathers its output."""
        used = [s for s in stacks if any(e.path.startswith(f"{s}.") for e in self.entries)]
        if len(used) != 1:
            raise self.error(
                "sequence parallelism splits the activations of one stack of layers; this "
                f"plan covers {len(used)} ({used})", None,
                "from_hf_plan(sch, tp=True) without sequence_parallel", style=None,
                stacks=used)
        stack = used[0]
        node = self.node(stack)
        first = next(iter(node.child.values()))
        per_token = [n for n in inspect.signature(first.mod.forward).parameters
                     if "per_layer" in n or (n.endswith("mask") and n not in _WHOLE_MASKS)]
        if per_token:  # a second per-token input, which would stay whole
            raise self.error(
                f"sequence parallelism splits the layers' hidden states along the sequence, "
                f"and they also take {per_token[0]!r} per token, which would stay whole",
                None, "from_hf_plan(sch, tp=True) without sequence_parallel",
                path=first.path, style=None, input=per_token[0])
        for layer in node.child.values():
            self.plan_layer_regions(layer)
        names = list(node.child)
        self.sp_start = (f"{stack}.{names[0]}", _first_input(node.child[names[0]].mod))
        self.sp_end = f"{stack}.{names[-1]}"

    def plan_layer_regions(self, layer: Schedule) -> None:
        """The regions of one layer: the lowest module holding a row-parallel module and
        the column-parallel ones feeding it. A region's input is all-gathered along the
        sequence and every rank computes the same thing from it: its column-parallel
        modules sum their input gradients themselves (``bwd_post``), so the gather's
        backward keeps this rank's slice, and any other consumer of the input inside the
        region stays correct; the row-parallel module reduce-scatters. Parameters used
        outside the regions (norms) run on sequence slices: their gradients are
        all-reduced. Mixture-of-experts blocks are refused: several of them return their
        tokens flattened to ``(batch * sequence, hidden)``, where no axis is the
        sequence."""
        prefix = f"{layer.path}."
        mine = [e for e in self.entries if e.path.startswith(prefix)]
        for e in mine:
            if e.param is not None or e.style in ("moe_tp_experts", "all_reduce",
                                                  *EMBEDDING):
                raise self.error(
                    f"sequence parallelism is supported for plans of attention and MLP "
                    f"regions; {e.target} has the style {e.style!r}", e,
                    "from_hf_plan(sch, tp=True) without sequence_parallel")
        columns = [e.path for e in mine if e.style in COLUMN]
        regions: list[str] = []
        for row in (e for e in mine if e.style in ROW):
            region = row.path.rpartition(".")[0]
            while region != layer.path and not any(c.startswith(f"{region}.")
                                                   for c in columns):
                region = region.rpartition(".")[0]
            if region == layer.path:
                raise self.error(
                    f"sequence parallelism needs the row-parallel {row.path} inside a module "
                    "that also holds the column-parallel modules feeding it", row,
                    "from_hf_plan(sch, tp=True) without sequence_parallel")
            self.sp_row_closers.add(row.path)
            if region not in regions:
                regions.append(region)
        for c in columns:
            if not any(c.startswith(f"{r}.") for r in regions):
                entry = next(e for e in mine if e.path == c)
                raise self.error(
                    f"sequence parallelism needs every column-parallel module inside a "
                    f"region closed by a row-parallel one; {c} is not", entry,
                    "from_hf_plan(sch, tp=True) without sequence_parallel")
        for path, module in layer.mod.named_modules():
            full = f"{layer.path}.{path}" if path else layer.path
            if any(full == r or full.startswith(f"{r}.") for r in regions):
                continue
            if path and not _is_norm(module) and any(True for _ in module.parameters()) \
                    and _MIXES_POSITIONS.search(
                        f"{type(module).__name__} {path.rpartition('.')[2]}"):
                raise self.error(
                    f"sequence parallelism would run {full} ({type(module).__name__}) on a "
                    "slice of the sequence, outside the plan's tensor-parallel regions, and "
                    "it mixes positions", None,
                    "from_hf_plan(sch, tp=True) without sequence_parallel", path=full,
                    style=None, module=type(module).__name__)
            if not _has_own_params(module) or full in self.planned_paths:
                continue
            if not (_is_norm(module) or isinstance(module, (nn.Linear, nn.Embedding))
                    or full == layer.path):
                raise self.error(
                    f"sequence parallelism runs {full} ({type(module).__name__}) on a slice "
                    "of the sequence, and a module of this type may mix positions", None,
                    "from_hf_plan(sch, tp=True) without sequence_parallel", path=full,
                    style=None, module=type(module).__name__)
            self.sp_param_grads.append(full)
        for region in regions:
            self.sp_regions.append((region, _first_input(self.root.get_submodule(region))))

    def partial_grad_modules(self, replicated: list[str]) -> list[str]:
        """Modules the plan leaves out whose parameter gradients are per-rank parts: next
        to a column-parallel projection (not gathered), a per-head norm of its heads
        (``q_norm`` of ``q_proj``, one ``head_dim`` wide) and an activation with scalar
        parameters (``act_fn``) see this rank's features only. transformers' plans name
        the norms ``replicated_with_grad_allreduce`` in most families, not in all."""
        found: list[str] = []
        for entry in self.entries:
            if entry.param is not None or entry.style not in COLUMN or \
                    entry.style in GATHERED or entry.path in self.vocab_paths:
                continue
            parent_path, _, name = entry.path.rpartition(".")
            if parent_path in replicated:
                continue
            parent = self.root.get_submodule(parent_path)
            head_dim = getattr(parent, "head_dim", None)
            stem = name.split("_")[0]
            for child_name, child in parent.named_children():
                full = f"{parent_path}.{child_name}"
                if full in self.planned_paths or full in found or not _has_own_params(child):
                    continue
                params = [p for p in child.parameters() if p.requires_grad]
                per_head = _is_norm(child) and child_name.startswith(f"{stem}_") and \
                    isinstance(head_dim, int) and all(p.shape[-1:] == (head_dim,)
                                                      for p in params)
                scalar_act = "act" in child_name and all(p.numel() == 1 for p in params)
                if per_head or scalar_act:
                    found.append(full)
        return found

    def kv_replicated(self) -> list[str]:
        """Attention modules with fewer KV heads than ranks (``tp % kv == 0``) that the
        plan splits Llama-style (q/k/v ``colwise``, modules with ``head_dim`` and
        ``num_key_value_groups``): their KV heads are replicated on the ranks whose query
        heads use them (:func:`torchloom.schedules.llama.replicate_kv_heads`) instead of
        split, which transformers' plan cannot do."""
        found = []
        styles = {e.path: e.style for e in self.entries if e.param is None}
        for path in sorted({p.rpartition(".")[0] for p in styles if p.endswith(".k_proj")}):
            attn = self.root.get_submodule(path)
            projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
            head_dim = getattr(attn, "head_dim", None)
            if not all(styles.get(f"{path}.{n}") == "colwise"
                       for n in ("q_proj", "k_proj", "v_proj")) or \
                    not all(isinstance(m, nn.Linear) for m in projections) or \
                    not isinstance(head_dim, int) or \
                    not isinstance(getattr(attn, "num_key_value_groups", None), int):
                continue
            if any(n not in ("q_proj", "k_proj", "v_proj", "o_proj") and
                   (_is_norm(m) or any(True for _ in m.parameters()))
                   for n, m in attn.named_children()):
                continue  # a k / v norm would see per-rank parts of the shared head's grads
            heads = projections[0].weight.shape[0] // head_dim
            kv = projections[1].weight.shape[0] // head_dim
            if kv and kv % self.world and self.world % kv == 0 and heads % self.world == 0 \
                    and projections[2].weight.shape[0] == kv * head_dim:
                found.append(path)
        return found

    # ---------------------------------------------------------------- all of it

    def plan(self, stacks: list[str]) -> list[_Op]:
        self.sp_param_grads: list[str] = []
        self.sp_regions: list[tuple[str, str | None]] = []
        for entry in self.entries:
            self.check_style(entry)
        if self.sp:
            self.plan_sequence_parallel(stacks)
        replicated = self.kv_replicated()
        for entry in self.entries:
            module = self.root.get_submodule(entry.path) if entry.path else self.root
            if not self.vocab_parallel and entry.path in self.vocab_paths:
                continue
            parent, _, name = entry.path.rpartition(".")
            if parent in replicated and name in ("k_proj", "v_proj"):
                continue  # replicated below
            if entry.param is not None:
                self.param_style(entry)
                continue
            if entry.style in COLUMN and entry.style not in GATHERED and \
                    entry.style != "packed_colwise":
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
                self.add(f"{attn}.{name}", "sync", "bwd_post", "all_reduce")
                self.add(f"{attn}.{name}.grad_sum", "sync", "bwd_post", "all_reduce")
        for region, name in self.sp_regions:  # gather each region's input
            self.add(region, "sync", "fwd_pre", "all_gather", axis=SEQ_AXIS,
                     tensor_parallel_output_grad=False,
                     **({"input_name": name} if name else {}))
        for path in self.sp_param_grads:
            self.add(path, "sync", "param_grad", "all_reduce")
        if self.sp:
            start, name = self.sp_start
            self.add(start, "sync", "fwd_pre", "scatter", axis=SEQ_AXIS,
                     **({"input_name": name} if name else {}))
            self.add(self.sp_end, "sync", "fwd_post", "all_gather", axis=SEQ_AXIS,
                     tensor_parallel_output_grad=False)
        self.check_ties()
        return self.ops

    def check_ties(self) -> None:
        """A sharded tensor tied to a module the plan does not split alike would be cut
        under that module's feet."""
        for key, owners in self.tied.items():
            axis, chunks, by = self.sharded[key]
            for owner in owners:
                if owner in self.planned_paths and (self.vocab_parallel or
                                                    owner not in self.vocab_paths):
                    continue
                entry = next(e for e in self.entries if e.path == by)
                raise self.error(
                    f"{by}'s weight is tied to {owner}, which the plan does not split, so "
                    "sharding it would give that module a slice it does not expect", entry,
                    "untie the weights (config.tie_word_embeddings = False), or pass "
                    "vocab_parallel=False", tied_to=owner)


# --------------------------------------------------------------------------- the schedule


def _check_knob_types(sch: Schedule, tp: Any, sequence_parallel: Any, ckpt_ratio: Any,
                      compile: Any, vocab_parallel: Any, plan: Any) -> ScheduleConfig:
    if not isinstance(tp, bool):
        raise PlanError("tp must be True or False", path=sch.path, primitive=PRIMITIVE,
                        values={"tp": repr(tp)}, fix="from_hf_plan(sch, tp=True)")
    config = ScheduleConfig(tp=2 if tp else 1, sequence_parallel=sequence_parallel,
                            ckpt_ratio=ckpt_ratio, compile=compile, vocab_parallel=vocab_parallel)
    if plan is not None and not (isinstance(plan, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in plan.items())):
        raise PlanError("plan must map module or parameter paths (with * for a layer "
                        "index) to style names", path=sch.path, primitive=PRIMITIVE,
                        values={"plan": repr(plan)[:80]},
                        fix="plan={'model.layers.*.mlp.up_proj': 'colwise', ...}")
    return config


def pipeline_stack(sch: Schedule, stages: int, stacks: list[str]) -> tuple[str, list[str]]:
    """The layer stack that ``base_model_pp_plan`` names and the layers after which
    ``stages`` pipeline stages end (the layers split as evenly as they go)."""
    try:
        pp = list(getattr(sch.mod, "pp_plan", None) or {})
    except Exception:  # noqa: BLE001
        pp = []
    named = [s for s in stacks if s in pp]
    family = family_of(sch.mod)
    if len(named) != 1:
        raise PlanError(
            f"pipeline stages are cut in the one stack of layers of the pipeline plan "
            f"(base_model_pp_plan), and this model's names {len(named)}: {named}",
            path=sch.path, primitive=PRIMITIVE,
            values={"style": None, "family": family, "pipeline_stages": stages, "stacks": named},
            fix="cut the stages by hand: sch.trace_until('...layers.*'); "
            "sch['...layers.3'].cut_pipeline_stage()")
    layers = list(sch[named[0]].child)
    if not 2 <= stages <= len(layers):
        raise PlanError(
            f"{stages} pipeline stages over {len(layers)} layers: each stage needs a layer",
            path=named[0], primitive=PRIMITIVE,
            values={"style": None, "family": family, "pipeline_stages": stages,
                    "layers": len(layers)},
            fix=f"pipeline_stages between 2 and {len(layers)} (1: no pipeline)"
            if len(layers) >= 2 else "pipeline_stages=1: one layer makes one stage")
    cuts = [layers[k] for k in even_cuts(len(layers), stages)]
    return named[0], [f"{named[0]}.{name}" for name in cuts]


def from_hf_plan(sch: Schedule, tp: bool = True, sequence_parallel: bool = False,
                 ckpt_ratio: float = 0.0, compile: bool | str = False, *,
                 vocab_parallel: bool = True, plan: dict[str, str] | None = None,
                 pipeline_stages: int = 1, example_inputs: Any = None) -> None:
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
    """
    config = _check_knob_types(sch, tp, sequence_parallel, ckpt_ratio, compile,
                               vocab_parallel, plan)
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
                           sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
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


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile", "vocab_parallel")
def schedule_hf_plan(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """The built-in schedule of a model class with no hand-written one and a transformers
    tensor-parallel plan: :func:`from_hf_plan` with the knobs of every built-in schedule
    (``tp`` off unless asked, as in the others)."""
    from_hf_plan(sch, tp=config.tp_over(sch), sequence_parallel=config.sequence_parallel,
                 ckpt_ratio=config.ckpt_ratio, compile=config.compile,
                 vocab_parallel=config.vocab_parallel)
