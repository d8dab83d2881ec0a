"""Reading transformers' tensor-parallel plans: which module or parameter gets which style.

transformers 5 declares, for most of its model families, how to split the model over
tensor-parallel ranks: the config class's ``base_model_tp_plan`` (paths relative to the
base model, ``*`` for a layer index), the model class's ``_tp_plan`` (the head) and, for a
base model with an ``embed_tokens`` embedding, a vocabulary-parallel embedding; a model
instance merges them under its own paths (``model.tp_plan``). This module reads that plan
(:func:`tp_plan_of`), matches its keys against a schedule's module tree
(:func:`expand_plan`, one :class:`PlanEntry` per match), finds the stacks of layers the
plans name (:func:`layer_stacks`) and where pipeline stages are cut in the pipeline
plan's stack (:func:`pipeline_stack`). It names the styles (``COLUMN``, ``ROW``, ...,
:data:`SUPPORTED_STYLES`, :data:`REFUSED_STYLES`); what each style becomes is
:mod:`torchloom.schedules.hf_plan`'s business.

>>> import transformers, torchloom as tl
>>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
...     num_attention_heads=2, num_hidden_layers=2, vocab_size=32)
>>> sch = tl.create_schedule(transformers.LlamaForCausalLM(cfg))
>>> entries = expand_plan(sch, {"model.layers.*.mlp.up_proj": "colwise_fused(2)"})
>>> [(e.path, e.style, e.chunks) for e in entries]
[('model.layers.0.mlp.up_proj', 'colwise', 2), ('model.layers.1.mlp.up_proj', 'colwise', 2)]
>>> layer_stacks(sch)
['model.layers']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..core.errors import TPPlanError as PlanError
from ..core.rules import even_cuts
from ..core.schedule import Schedule

__all__ = ["PlanError", "PlanEntry", "PRIMITIVE", "COLUMN", "GATHERED", "ROW", "SPLIT_INPUT",
           "EMBEDDING", "NOTHING", "SUPPORTED_STYLES", "REFUSED_STYLES", "tp_plan_of",
           "has_tp_plan", "family_of", "expand_plan", "layer_stacks", "pipeline_stack"]

PRIMITIVE = "schedules.from_hf_plan"

COLUMN = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
GATHERED = ("colwise_gather_output", "colwise_rep")
ROW = ("rowwise", "rowwise_split_input", "rowwise_rep")
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
