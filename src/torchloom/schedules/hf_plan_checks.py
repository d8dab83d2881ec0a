"""The checks of :func:`~torchloom.schedules.hf_plan.from_hf_plan`, made before any
primitive is applied, and what they work out about the model.

:class:`PlanChecks` holds a matched plan (:class:`~torchloom.schedules.hf_plan_read.PlanEntry`
list) and the model, and refuses, with a :class:`~torchloom.core.errors.TPPlanError` that
names the plan key, the style and the model family:

* styles that are unknown or refused, or put on a module of the wrong type;
* sizes the ranks cannot split: heads (named by config field), the vocabulary, features;
* norms that would see only this rank's share of the features they normalise;
* expert parameters the plan leaves whole; tied tensors the plan splits in one place only;
* sequence parallelism over modules that mix positions or outside the plan's regions.

It also finds what the schedule needs beyond the plan's own styles: the regions of
sequence parallelism (:meth:`PlanChecks.plan_sequence_parallel`), the attentions whose
KV heads are replicated (:meth:`PlanChecks.kv_replicated`) and the modules whose
parameter gradients are per-rank parts (:meth:`PlanChecks.partial_grad_modules`). The
planner that records the primitives (:mod:`torchloom.schedules.hf_plan`) builds on it.

>>> import torch
>>> is_norm(torch.nn.LayerNorm(4)), is_norm(torch.nn.Linear(4, 4))
(True, False)
>>> first_input(torch.nn.Linear(4, 4))
'input'
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from ..core.schedule import Schedule
from ._common import loss_parallel_head, node_at, tp_divisors
from .hf_plan_read import (
    COLUMN,
    EMBEDDING,
    GATHERED,
    NOTHING,
    PRIMITIVE,
    REFUSED_STYLES,
    ROW,
    SUPPORTED_STYLES,
    PlanEntry,
    PlanError,
)

__all__ = ["PlanChecks", "first_input", "has_own_params", "is_norm"]

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


def first_input(module: nn.Module) -> str | None:
    """The name of the first parameter of ``module.forward`` (its activation input)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a norm (a class named ``...Norm...`` in its MRO)."""
    return any("Norm" in c.__name__ for c in type(module).__mro__)


def has_own_params(module: nn.Module) -> bool:
    """Whether ``module`` holds a trainable parameter itself (not in a child)."""
    return any(p is not None and p.requires_grad for p in module._parameters.values())


class PlanChecks:
    """A matched plan and the model it splits: the checks made before any primitive and
    what they find (see the module docstring). The planner subclasses it."""

    def __init__(self, sch: Schedule, entries: list[PlanEntry], *, family: str,
                 sequence_parallel: bool, vocab_parallel: bool,
                 loss_parallel: bool = False) -> None:
        self.sch = sch
        self.root = sch.mod
        self.world = sch.world_size
        self.family = family
        self.sp = sequence_parallel
        self.vocab_parallel = vocab_parallel
        self.entries = entries
        self.sharded: dict[int, tuple[int, int, str]] = {}  # id(tensor) -> axis, chunks, by
        self.tied: dict[int, list[str]] = {}  # id(tensor) -> module paths holding it
        self.sp_row_closers: set[str] = set()  # SP: row-parallel modules ending a region
        # found by plan_sequence_parallel: the modules whose parameter gradients are
        # all-reduced, each region and its input's name, the first layer and its input's
        # name (scattered), the last layer (gathered)
        self.sp_param_grads: list[str] = []
        self.sp_regions: list[tuple[str, str | None]] = []
        self.sp_start: tuple[str, str | None] = ("", None)
        self.sp_end = ""
        self.planned_paths = {e.path for e in entries if e.param is None}
        self.vocab_paths = self._vocab_paths()
        # loss parallelism: the head (its path) is split along the vocabulary, not gathered
        self.loss_head: str | None = None
        if loss_parallel:
            self.loss_head = self.check_loss_head()

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
        return node_at(self.sch, path)

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

    # ---------------------------------------------------------------- checks

    def check_loss_head(self) -> str:
        """The head loss parallelism splits (untied, a vocabulary the degree divides; see
        :func:`~torchloom.schedules._common.loss_parallel_head`), which the plan must
        split column-wise."""
        path = loss_parallel_head(self.sch, PRIMITIVE)
        if not any(e.path == path and e.param is None and e.style in COLUMN
                   for e in self.entries):
            raise self.error(
                f"loss parallelism splits the head {path} along the vocabulary, and the "
                "plan does not split it column-wise", None,
                f"add it to the plan: plan={{..., '{path}': 'colwise_gather_output'}}; or "
                "drop loss_parallel", path=path, style=None)
        return path

    def is_loss_head(self, path: str) -> bool:
        """Whether ``path`` is the head loss parallelism keeps split."""
        return self.loss_head is not None and path == self.loss_head

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

    def check_heads(self, entry: PlanEntry, module: nn.Linear) -> None:
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

    def check_norms_of_split_heads(self, entry: PlanEntry, module: nn.Linear) -> None:
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
            if not is_norm(child) or weight is None or weight.dim() != 1 or \
                    not name.startswith(f"{stem}_"):
                continue
            if weight.shape[0] == out and out != head_dim:
                raise self.error(
                    f"the plan splits the features of {entry.path} ({out}) over the ranks, "
                    f"but {name} normalises all {out} of them together, which no rank holds",
                    entry, "gather the projection's output instead: the style "
                    "colwise_gather_output (with rowwise_split_input on the output "
                    "projection), in plan=", norm=f"{parent_path}.{name}", features=out)

    def check_norms_of_split_input(self, entry: PlanEntry, module: nn.Linear) -> None:
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
        first = columns[0]
        assert isinstance(first, nn.Linear)  # check_style: a column style splits a Linear
        model_width = first.weight.shape[1]
        for name, child in parent.named_children():
            weight = child._parameters.get("weight")
            if f"{parent_path}.{name}" in self.planned_paths or not is_norm(child) or \
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

    # ---------------------------------------------------------------- what styles need

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
        self.sp_start = (f"{stack}.{names[0]}", first_input(node.child[names[0]].mod))
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
            if path and not is_norm(module) and any(True for _ in module.parameters()) \
                    and _MIXES_POSITIONS.search(
                        f"{type(module).__name__} {path.rpartition('.')[2]}"):
                raise self.error(
                    f"sequence parallelism would run {full} ({type(module).__name__}) on a "
                    "slice of the sequence, outside the plan's tensor-parallel regions, and "
                    "it mixes positions", None,
                    "from_hf_plan(sch, tp=True) without sequence_parallel", path=full,
                    style=None, module=type(module).__name__)
            if not has_own_params(module) or full in self.planned_paths:
                continue
            if not (is_norm(module) or isinstance(module, (nn.Linear, nn.Embedding))
                    or full == layer.path):
                raise self.error(
                    f"sequence parallelism runs {full} ({type(module).__name__}) on a slice "
                    "of the sequence, and a module of this type may mix positions", None,
                    "from_hf_plan(sch, tp=True) without sequence_parallel", path=full,
                    style=None, module=type(module).__name__)
            self.sp_param_grads.append(full)
        for region in regions:
            self.sp_regions.append((region, first_input(self.root.get_submodule(region))))

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
                if full in self.planned_paths or full in found or not has_own_params(child):
                    continue
                params = [p for p in child.parameters() if p.requires_grad]
                per_head = is_norm(child) and child_name.startswith(f"{stem}_") and \
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
            q, k, v = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj"))
            head_dim = getattr(attn, "head_dim", None)
            if not all(styles.get(f"{path}.{n}") == "colwise"
                       for n in ("q_proj", "k_proj", "v_proj")) or \
                    not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear)
                         and isinstance(v, nn.Linear)) or \
                    not isinstance(head_dim, int) or \
                    not isinstance(getattr(attn, "num_key_value_groups", None), int):
                continue
            if any(n not in ("q_proj", "k_proj", "v_proj", "o_proj") and
                   (is_norm(m) or any(True for _ in m.parameters()))
                   for n, m in attn.named_children()):
                continue  # a k / v norm would see per-rank parts of the shared head's grads
            heads = q.weight.shape[0] // head_dim
            kv = k.weight.shape[0] // head_dim
            if kv and kv % self.world and self.world % kv == 0 and heads % self.world == 0 \
                    and v.weight.shape[0] == kv * head_dim:
                found.append(path)
        return found

    # ---------------------------------------------------------------- ties

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

