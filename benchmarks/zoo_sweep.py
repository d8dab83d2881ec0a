"""The model-zoo sweep: every transformers model class whose config carries a tensor-parallel
plan, scheduled at TP=2 by torchloom on two gloo ranks, verified and trained.

For each *family* (a ``CONFIG_MAPPING`` key whose config class has a
``base_model_tp_plan``, or whose sub-configs have one: a multimodal or encoder-decoder
model whose text config carries the plan) the sweep

1. builds the model class (causal LM first, then masked LM, sequence-to-sequence,
   image-text-to-text, the base model) from a **tiny config**: transformers' defaults with
   only sizes shrunk (:func:`tiny_kwargs`: hidden 64, 2 layers, 4 heads, 2 KV heads where
   the default has grouped KV heads, head dim 16, intermediate 128, vocabulary 256, 4
   experts of which 2 are routed per token, the same in nested text / vision / audio
   sub-configs; token ids beyond the shrunk vocabulary are moved to its top);
2. trains a copy of it for 3 SGD steps in one process (the reference losses; a family
   whose tiny model does not build or run here is counted separately, with its error);
3. on 2 gloo ranks applies ``torchloom.schedules.apply_schedule(sch, tp=True,
   sequence_parallel=True, ckpt_ratio=0.5)`` (or ``hf_plan.from_hf_plan``, ``--schedule``)
   under ``tl.Verify`` (forward and backward against the single-process model); a
   ``ScheduleError`` with sequence parallelism on is retried without it (the ``sp`` column
   says which ran, and why not);
4. builds the scheduled model and trains it for the same 3 steps: the losses must equal
   the reference's (within ``LOSS_TOL``) unless the config has dropout, where they must
   be finite.

All families run in sequence in **one** launch of two ranks. Each family is guarded: an
exception is recorded and the ranks go on to the next family; the launcher hands the
ranks each family in lock-step and, when a family outlasts ``--timeout`` (a hang) or the
ranks disagree about its outcome (one raised while the other waits in a collective),
ends both ranks and starts two new ones for the remaining families.

``--layouts tp,fsdp,pp`` runs the **loading sweep** instead (:func:`prepare_load`,
:func:`run_load`): this process writes each family's tiny model with ``save_pretrained``
and takes the first loss of the model class's ``from_pretrained`` (eval mode, a fixed
batch); on the two ranks a meta copy of the folder's config is loaded with
``build(..., weights=folder)`` at TP 2, FSDP 2 and PP 2 (``from_hf_plan(tp=False,
pipeline_stages=2)``) and its first loss must be within ``LOAD_TOL`` of the reference.
One job per family and layout, in the same lock-step launch.

``--layouts ep`` runs the **expert-parallel sweep** (``benchmarks/ep_sweep.py``): every
mixture-of-experts family at ``Layout(dp_replicate=2, ep=2)``, its loss and every
gradient against one process.

Output: a Markdown table family -> result (``passed``, or the stage, the style / module
that failed and the first line of the error), with counts; ``--json PATH`` writes the
rows and counts.

Usage::

    python benchmarks/zoo_sweep.py                          # every family (long)
    python benchmarks/zoo_sweep.py --families llama,qwen2,mixtral --json out.json
    python benchmarks/zoo_sweep.py --limit 10 --timeout 120
    python benchmarks/zoo_sweep.py --ci                     # the CI subset (12 families)
    python benchmarks/zoo_sweep.py --layouts tp,fsdp,pp --timeout 60   # loading, every family
    python benchmarks/zoo_sweep.py --ci --layouts pp,fsdp   # loading, the CI subset (7)
    python benchmarks/zoo_sweep.py --layouts ep --timeout 120   # expert parallelism, MoE

>>> kw = tiny_kwargs(__import__("transformers").LlamaConfig)   # Llama's defaults: sizes only
>>> sorted(kw.items())                       # (its head_dim and KV heads are derived: 128, 32)
[('head_dim', 16), ('hidden_size', 64), ('intermediate_size', 128), ('num_attention_heads', 4), ('num_hidden_layers', 2), ('num_key_value_heads', 4), ('vocab_size', 256)]
>>> args = parse_args(["--families", "llama,qwen2", "--timeout", "60"])
>>> args.families, args.timeout
(['llama', 'qwen2'], 60.0)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import importlib
import inspect
import json
import math
import os
import platform
import queue
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
LR = 1e-3
STEPS = 3
BATCH, SEQ = 2, 16
#: training losses of the scheduled model against one process: |a - b| <= LOSS_TOL * (1 + |b|)
LOSS_TOL = 1e-4
#: extra seconds the launcher grants the first family (starting the ranks, importing)
START_S = 240.0

# ----------------------------------------------------------------------- discovery

#: model-class mappings tried in order; the first that has the family is used
CLASS_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)


@dataclass(frozen=True)
class Family:
    """One family of the sweep: a config key, its config class and the model class."""

    name: str
    config_class: str
    model_class: str
    mapping: str  # which auto mapping the model class came from
    plan_in: str  # "config", or the sub-config attribute holding the plan ("text_config")


def _plan_holder(config_cls: type, depth: int = 0) -> str | None:
    """Where ``config_cls`` carries a tensor-parallel plan: "config", a sub-config path, or
    None."""
    if getattr(config_cls, "base_model_tp_plan", None):
        return "config"
    if depth > 2:
        return None
    for name, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):
            inner = _plan_holder(sub, depth + 1)
            if inner is not None:
                return name if inner == "config" else f"{name}.{inner}"
    return None


def model_class_of(name: str) -> type | None:
    """The transformers model class called ``name`` (None when it cannot be imported)."""
    import transformers

    try:
        return getattr(transformers, name)
    except Exception:  # noqa: BLE001 - missing optional dependency, or not exported
        return None


def _takes_config(model_class: str, config_cls: type) -> bool | None:
    """Whether ``model_class`` is built from ``config_cls``: False when it takes one of
    the config's sub-configs (an auto mapping may name a causal LM class of a multimodal
    family that takes only its text config), None when it cannot be imported. A class of
    another family (``exaone`` -> ``LlamaForCausalLM``) takes any config with its
    fields."""
    cls = model_class_of(model_class)
    if cls is None:
        return None
    wanted = getattr(cls, "config_class", None)
    subs = [c for c in (getattr(config_cls, "sub_configs", None) or {}).values()
            if isinstance(c, type)]
    return not (wanted is not None and not issubclass(config_cls, wanted)
                and any(issubclass(c, wanted) for c in subs))


def discover() -> tuple[list[Family], list[dict[str, str]]]:
    """Every family with a tensor-parallel plan and a model class; and those skipped
    (a plan-carrying sub-config without a model class of its own), with the reason."""
    families, skipped = _discover()
    return list(families), [dict(s) for s in skipped]


@functools.lru_cache(maxsize=1)
def _discover() -> tuple[tuple[Family, ...], tuple[dict[str, str], ...]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    families: list[Family] = []
    skipped: list[dict[str, str]] = []
    for key in CONFIG_MAPPING.keys():
        try:
            config_cls = CONFIG_MAPPING[key]
        except Exception as err:  # noqa: BLE001 - an optional dependency is missing
            skipped.append({"family": key, "reason": f"config class not importable: {err}"})
            continue
        holder = _plan_holder(config_cls)
        if holder is None:
            continue
        found = model_class_for(key, config_cls)
        if isinstance(found, str):
            skipped.append({"family": key, "reason": found})
            continue
        families.append(Family(key, config_cls.__name__, found[0], found[1], holder))
    return tuple(families), tuple(skipped)


def model_class_for(key: str, config_cls: type) -> tuple[str, str] | str:
    """``(model class, mapping)`` of family ``key``: the first of :data:`CLASS_MAPPINGS`
    naming a class that takes ``config_cls``; or why it has none."""
    from transformers.models.auto import modeling_auto

    missing = []
    for mapping in CLASS_MAPPINGS:
        name = getattr(modeling_auto, mapping, {}).get(key)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if not name:
            continue
        takes = _takes_config(name, config_cls)
        if takes:
            return name, mapping.removesuffix("_MAPPING_NAMES")
        if takes is None:
            missing.append(name)
    return (f"model class {missing[0]} cannot be imported" if missing else
            "no model class of its own (a sub-config; its parent family runs it)")


#: the fixed subset CI runs (``--ci``), one 2-rank launch: dense with grouped KV heads
#: (llama), with biases (qwen2, starcoder2, phi), with tied embeddings (gemma, gemma3),
#: mixtures of experts (mixtral; qwen2_moe with a shared expert; deepseek_v3 with latent
#: attention), an encoder (eurobert), an encoder-decoder (t5gemma), multimodal models
#: whose text config carries the plan (qwen2_vl, gemma3)
CI_FAMILIES = ("llama", "qwen2", "gemma", "starcoder2", "phi", "mixtral", "qwen2_moe",
               "deepseek_v3", "eurobert", "t5gemma", "qwen2_vl", "gemma3")

# ----------------------------------------------------------------------- tiny configs

TARGET = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
          "intermediate": 128, "moe_intermediate": 64, "vocab": 256, "experts": 4,
          "top_k": 2}

@contextlib.contextmanager
def sizes(**target: int) -> Iterator[None]:
    """Shrink to other sizes than ``TARGET`` inside the block (``sizes(hidden=256,
    layers=4)``): the benchmarks build the same families a little larger."""
    unknown = set(target) - set(TARGET)
    if unknown:
        raise KeyError(f"unknown sizes {sorted(unknown)}; known: {sorted(TARGET)}")
    saved = dict(TARGET)
    TARGET.update(target)
    try:
        yield
    finally:
        TARGET.clear()
        TARGET.update(saved)


_HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "out_hidden_size",
           "text_hidden_size", "projection_dim", "vision_output_dim", "projector_hidden_size",
           "output_hidden_size", "encoder_hidden_size", "decoder_hidden_size",
           "audio_hidden_size", "embedding_size", "word_embed_proj_dim", "model_dim",
           "projector_input_dim", "projector_output_dim", "hidden_dim", "vision_hidden_size",
           "text_config_hidden_size", "image_embedding_size", "hidden_size_global"}
_LAYERS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
           "decoder_layers", "num_decoder_layers", "num_encoder_layers", "depth",
           "decoder_num_layers", "num_global_layers"}
_HEADS = {"num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads", "attention_heads", "swa_num_attention_heads",
          "index_n_heads", "decoder_num_attention_heads", "linear_num_value_heads",
          "resampler_n_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
             "swa_num_key_value_heads", "linear_num_key_heads"}
_HEAD_DIM = {"head_dim", "d_kv", "dim_head", "attention_head_size", "kv_channels",
             "swa_head_dim", "index_head_dim", "linear_key_head_dim", "linear_value_head_dim",
             "resampler_head_dim", "mamba_d_head", "mamba_head_dim", "qk_nope_head_dim",
             "v_head_dim", "linear_head_dim", "global_head_dim"}
_INTERMEDIATE = {"intermediate_size", "ffn_dim", "d_ff", "ffn_hidden_size", "encoder_ffn_dim",
                 "decoder_ffn_dim", "mlp_dim", "n_inner", "decoder_intermediate_size",
                 "intermediate_size_mlp", "dense_intermediate_size",
                 "projection_intermediate_size", "d_inner"}
_MOE_INTERMEDIATE = {"moe_intermediate_size", "shared_expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "expert_intermediate_size", "moe_hidden_size", "shared_intermediate_size"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"}
_VOCAB = {"vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"}
#: other sizes, each with its tiny value
_FIXED = {"qk_rope_head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_head_dim": 24,
          "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_state": 16, "ssm_state_size": 16,
          "state_size": 16, "mamba_n_groups": 1, "n_groups": 1, "n_group": 1,
          "topk_group": 1, "first_k_dense_replace": 1, "hidden_size_per_layer_input": 16,
          "time_step_rank": 8, "mamba_dt_rank": 8, "num_kv_shared_layers": 0,
          "moe_layer_start_index": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
          "expert_layer_period": 2, "expert_layer_offset": 1, "full_attention_interval": 2,
          "decoder_sparse_step": 1, "moe_layer_freq": 1, "rotary_dim": 16,
          "global_head_dim": 16, "codebook_dim": 64}
#: the fields that count layers, in the order they are looked for
_LAYER_COUNT = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth")
_LAYER_LISTS = ("index", "indices", "indexes", "_layers", "layer_ids", "layer_map")
_MAX_LAYERS = 6  # more layers than 2 only to keep every kind of a per-layer list


def _init_params(config_cls: type) -> set[str]:
    return {n for n, p in inspect.signature(config_cls.__init__).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get(config: Any, name: str) -> Any:
    """``config.name`` (None when absent), also a per-layer attribute of a heterogeneous
    config (its global value)."""
    getter = getattr(config, "_getattr_without_heterogeneous_validation", None)
    try:
        return getter(name, None) if getter else getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a property that needs more than the defaults
        return None


class _Layer:
    """One layer's view of a heterogeneous config: its overrides, then the globals."""

    def __init__(self, config: Any, overrides: dict[str, Any]) -> None:
        self._config, self._overrides = config, overrides

    def _getattr_without_heterogeneous_validation(self, name: str, default: Any = None) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        value = _get(self._config, name)
        return default if value is None else value


def _shrunk(name: str, value: Any, config: Any) -> Any:
    """The tiny value of the size field ``name`` (``value`` in the default ``config``),
    or ``value`` itself."""
    if name in _EXPERTS and value is None and any(
            _is_int(_get(config, n)) for n in (*_MOE_INTERMEDIATE, *_TOP_K)):
        return TARGET["experts"]  # a mixture-of-experts default that leaves the count open
    if name in _TOP_K and value is None and any(_is_int(_get(config, n)) for n in _EXPERTS):
        return TARGET["top_k"]
    if not _is_int(value):
        return value
    if name == "head_dim" and _is_int(_get(config, "qk_rope_head_dim")) \
            and value == _get(config, "qk_rope_head_dim"):
        return _FIXED["qk_rope_head_dim"]  # multi-head latent attention: rotary part
    if name == "head_dim" and _is_int(_get(config, "qk_rope_head_dim")) \
            and _is_int(_get(config, "qk_nope_head_dim")) \
            and value == _get(config, "qk_rope_head_dim") + _get(config, "qk_nope_head_dim"):
        return _FIXED["qk_rope_head_dim"] + TARGET["head_dim"]  # q/k width of MLA
    if name in _HIDDEN:
        return min(value, TARGET["hidden"])
    if name in _LAYERS:
        return min(value, TARGET["layers"])
    if name in _HEADS:
        return min(value, TARGET["heads"])
    if name in _KV_HEADS:
        heads = _get(config, "num_attention_heads") or _get(config, "n_head")
        if value <= 1:
            return value
        if _is_int(heads) and value >= heads:  # plain multi-head attention stays so
            return min(value, TARGET["heads"])
        return min(value, TARGET["kv_heads"])
    if name in _HEAD_DIM:
        return min(value, TARGET["head_dim"])
    if name in _INTERMEDIATE:
        return min(value, TARGET["intermediate"])
    if name in _MOE_INTERMEDIATE:
        return min(value, TARGET["moe_intermediate"])
    if name in _EXPERTS:
        return min(value, TARGET["experts"])
    if name in _TOP_K:
        return min(value, TARGET["top_k"])
    if name in _VOCAB:
        return min(value, TARGET["vocab"])
    if name in _FIXED:
        return min(value, _FIXED[name])
    if name == "image_size" and _is_int(_get(config, "patch_size")):
        return min(value, 4 * _get(config, "patch_size"))
    return value


def _head_dim(config: Any, kwargs: dict[str, Any] | None = None) -> int | None:
    """The attention head width of ``config`` (with ``kwargs`` applied)."""
    kw = kwargs or {}

    def val(n: str) -> Any:
        return kw[n] if n in kw else _get(config, n)

    if _is_int(val("head_dim")):
        return val("head_dim")
    hidden, heads = val("hidden_size"), val("num_attention_heads")
    return hidden // heads if _is_int(hidden) and _is_int(heads) and heads else None


def _scaled_sections(sections: list[int], target: int) -> list[int]:
    """``sections`` scaled to sum to ``target`` (largest remainders)."""
    total = sum(sections)
    raw = [s * target / total for s in sections]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True):
        if sum(out) >= target:
            break
        out[i] += 1
    return out


def _scale_rope(rope: Any, head_dim: int, factor: float = 1.0) -> Any:
    """A ``rope_parameters`` dict whose multimodal rotary sections (``mrope_section``) sum
    to half the rotary width of a head of ``head_dim`` (times ``partial_rotary_factor``)."""
    if not isinstance(rope, dict):
        return rope
    factor = rope.get("partial_rotary_factor", factor)
    out = {}
    for key, value in rope.items():
        if isinstance(value, dict):
            out[key] = _scale_rope(value, head_dim, factor)
        elif "section" in key and isinstance(value, (list, tuple)) and value \
                and all(_is_int(v) for v in value):
            target = max(len(value), int(head_dim * factor) // 2)
            out[key] = type(value)(_scaled_sections(list(value), target))
        else:
            out[key] = value
    return out


def _pick_layers(lists: list[list[Any]], old_layers: int) -> list[int]:
    """Which of the ``old_layers`` layers to keep: at least ``TARGET['layers']``, and for
    every per-layer list (``layer_types``, ``mlp_layer_types``) one layer of each kind."""
    chosen: list[int] = []
    for values in lists:
        for kind in dict.fromkeys(map(repr, values)):
            if not any(repr(values[i]) == kind for i in chosen):
                chosen.append(next(i for i, v in enumerate(values) if repr(v) == kind))
    chosen = sorted(chosen)[:_MAX_LAYERS]
    for i in range(old_layers):
        if len(chosen) >= min(TARGET["layers"], old_layers):
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _modeling_mrope(config_cls: type) -> list[int] | None:
    """The rotary sections a model's code assumes when its config names none
    (``rope_parameters.get("mrope_section", [16, 24, 24])``): they are sized for the
    default head width, so a tiny config must name them, scaled."""
    module = sys.modules.get(config_cls.__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        try:
            module = importlib.import_module(
                config_cls.__module__.replace(".configuration_", ".modeling_"))
        except Exception:  # noqa: BLE001 - no modeling module, or an optional dependency
            return None
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    found = re.search(r'get\(\s*"mrope_section"\s*,\s*\[([\d,\s]+)\]\s*\)', source)
    return [int(x) for x in found.group(1).split(",") if x.strip()] if found else None


def tiny_kwargs(config_cls: type, base: Any = None, _depth: int = 0) -> dict[str, Any]:
    """The keyword arguments of a tiny ``config_cls``: its default's size fields shrunk
    (``base``: the default instance a parent config made, whose non-default values are
    kept), sub-configs shrunk the same way (returned as ``(class, kwargs)`` pairs).

    Per-layer lists (``layer_types``) keep one layer of each kind, so a hybrid model
    keeps an attention layer (and may get up to ``_MAX_LAYERS`` layers); per-layer
    overrides of a heterogeneous config follow the layers kept."""
    default = base if base is not None else config_cls()
    params = _init_params(config_cls)
    modeling_mrope = _modeling_mrope(config_cls) if "rope_parameters" in params else None
    sub_names = set(getattr(config_cls, "sub_configs", None) or {})
    kwargs: dict[str, Any] = {}
    if base is not None:  # what the parent chose differently from the class default
        plain = config_cls()
        for name in params - sub_names:
            mine, theirs = _get(base, name), _get(plain, name)
            if mine != theirs:
                kwargs[name] = mine
    layer_field = next((n for n in _LAYER_COUNT if n in params and _is_int(_get(default, n))),
                       None)
    old_layers = _get(default, layer_field) if layer_field else None
    per_layer = {n: list(_get(default, n)) for n in sorted(params - sub_names)
                 if old_layers and isinstance(_get(default, n), (list, tuple))
                 and len(_get(default, n)) == old_layers}
    overrides = getattr(getattr(default, "_heterogeneity_spec", None), "per_layer_overrides",
                        None)
    keep = None
    if old_layers:
        lists = list(per_layer.values())
        if overrides:
            lists.append([repr(sorted(overrides.get(i, {}).items()))
                          for i in range(old_layers)])
        keep = _pick_layers(lists, old_layers)
    for name in sorted(params - sub_names):
        value = _get(default, name)
        if name == layer_field and keep is not None:
            new = len(keep)
        elif name in per_layer and keep is not None:
            new = type(_get(default, name))(per_layer[name][i] for i in keep)
        else:
            new = _shrunk(name, value, default)
            if isinstance(new, (list, tuple)) and new and all(_is_int(v) for v in new) \
                    and any(part in name for part in _LAYER_LISTS) and name not in per_layer:
                kept = [v for v in new if 0 <= v < (len(keep) if keep else TARGET["layers"])]
                new = type(new)(kept or [(len(keep) if keep else TARGET["layers"]) - 1])
        if new != value:
            kwargs[name] = new
    if overrides and keep is not None:
        kwargs["per_layer_config"] = {
            new_i: {k: _shrunk(k, v, _Layer(default, overrides[old_i]))
                    for k, v in overrides[old_i].items()}
            for new_i, old_i in enumerate(keep) if old_i in overrides}
    old_hd, new_hd = _head_dim(default), _head_dim(default, kwargs)
    rope = kwargs.get("rope_parameters", _get(default, "rope_parameters"))
    if isinstance(rope, dict) and "mrope_section" not in rope and modeling_mrope:
        rope = {**rope, "mrope_section": list(modeling_mrope)}  # the modeling code's default
    if old_hd and new_hd and old_hd != new_hd and isinstance(rope, dict):
        scaled = _scale_rope(rope, new_hd)
        if scaled != rope:
            kwargs["rope_parameters"] = scaled
    for name in sorted(sub_names):
        sub = _get(default, name)
        if sub is None or not hasattr(sub, "to_dict") or _depth > 3:
            continue
        kwargs[name] = (type(sub), tiny_kwargs(type(sub), base=sub, _depth=_depth + 1))
    return kwargs


def _special_ids(config: Any, seen: set[int] | None = None) -> set[int]:
    """Every token id the config (and its sub-configs) names."""
    seen = set() if seen is None else seen
    ids: set[int] = set()
    if id(config) in seen:
        return ids
    seen.add(id(config))
    for name, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            ids |= _special_ids(value, seen)
        elif name.endswith(("token_id", "token_index", "token_ids")):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if _is_int(v) and v >= 0:
                    ids.add(v)
    return ids


def _remap_ids(kwargs: dict[str, Any], mapping: dict[int, int], vocab: int) -> None:
    """Move token ids at or beyond the shrunk vocabulary to its top (the same old id to the
    same new id at every level)."""
    def move(v: Any) -> Any:
        if _is_int(v) and v >= vocab:
            if v not in mapping:
                mapping[v] = vocab - 1 - len(mapping)
            return mapping[v]
        return v

    for name, value in list(kwargs.items()):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
            _remap_ids(value[1], mapping, vocab)
        elif name.endswith(("token_id", "token_index", "token_ids")):
            kwargs[name] = ([move(v) for v in value] if isinstance(value, list) else move(value))


def _instantiate(config_cls: type, kwargs: dict[str, Any]) -> Any:
    built = {k: (_instantiate(*v) if isinstance(v, tuple) and len(v) == 2
                 and isinstance(v[0], type) else v) for k, v in kwargs.items()}
    return config_cls(**built)


def _with_ids(config_cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` plus every token id of the default config (at every level) that lies
    beyond the shrunk vocabulary, moved into it."""
    default = config_cls()

    def add(cls_kwargs: dict[str, Any], conf: Any) -> None:
        for name in _init_params(type(conf)):
            value = _get(conf, name)
            if name.endswith(("token_id", "token_index", "token_ids")) and name not in cls_kwargs:
                if value is not None:
                    cls_kwargs[name] = value
            sub = cls_kwargs.get(name)
            if isinstance(sub, tuple) and len(sub) == 2 and isinstance(sub[0], type):
                add(sub[1], value)

    out = copy.deepcopy(kwargs)
    add(out, default)
    _remap_ids(out, {}, TARGET["vocab"])
    return out


def tiny_config(family: Family) -> Any:
    """The tiny config of ``family`` (see :func:`tiny_kwargs`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[family.name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _instantiate(config_cls, _with_ids(config_cls, tiny_kwargs(config_cls)))


def config_changes(family: Family) -> dict[str, Any]:
    """What :func:`tiny_config` changed from the defaults, as plain data (for the report)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[family.name]

    def plain(kw: dict[str, Any]) -> dict[str, Any]:
        return {k: plain(v[1]) if isinstance(v, tuple) and len(v) == 2
                and isinstance(v[0], type) else v for k, v in kw.items()}

    return plain(_with_ids(config_cls, tiny_kwargs(config_cls)))


def build_model(family: Family, seed: int = 0) -> nn.Module:
    """The family's model class on its tiny config, initialised from ``seed``, in
    training mode."""
    config = tiny_config(family)
    model_cls = model_class_of(family.model_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_cls(config)
    return model.train()


def _text_config(config: Any) -> Any:
    for name in ("text_config", "decoder", "thinker_config"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return _text_config(sub) if name == "thinker_config" else sub
    return config


def example_inputs(model: nn.Module, seed: int, batch: int = BATCH, seq: int = SEQ
                   ) -> dict[str, torch.Tensor]:
    """One training batch: token ids avoiding every special token id of the config, with
    ``labels`` where the forward takes them; pixels for an image-only model."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values" and "input_ids" not in params:
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(vision, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=gen)}
    vocab = getattr(_text_config(config), "vocab_size", None) or TARGET["vocab"]
    allowed = torch.tensor([i for i in range(vocab) if i not in _special_ids(config)])
    ids = allowed[torch.randint(0, len(allowed), (batch, seq), generator=gen)]
    inputs = {"input_ids": ids}
    if "labels" in params and type(model).__name__.endswith(
            ("ForCausalLM", "ForMaskedLM", "ForConditionalGeneration", "LMHeadModel")):
        inputs["labels"] = ids.clone()
    return inputs


def loss_of(output: Any) -> torch.Tensor:
    """``output.loss``, else a fixed random projection of the first output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = output[0] if isinstance(output, (tuple, list)) else next(
        v for v in output.values() if isinstance(v, torch.Tensor))
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(0))
    return (first.float() * weights).sum() / first.numel() ** 0.5


def has_dropout(model: nn.Module) -> bool:
    """Whether the model draws dropout masks in training: a dropout module with p > 0,
    or an attention dropout probability above zero in its config (or a sub-config)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    seen: set[int] = set()

    def attention_dropout(config: Any) -> bool:
        if id(config) in seen:
            return False
        seen.add(id(config))
        for name, value in vars(config).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                if attention_dropout(value):
                    return True
            elif ("attention_dropout" in name or "attn_pdrop" in name
                  or "attention_probs_dropout" in name) and _is_number(value) and value > 0:
                return True
        return False

    return attention_dropout(model.config)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int,
                steps: int = STEPS) -> list[float]:
    """``steps`` SGD steps, batch ``i`` drawn from ``seed + i``; the losses."""
    losses = []
    for step in range(steps):
        inputs = example_inputs(model, seed + 1 + step)
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(seed + 100 + step)
        loss = loss_of(model(**inputs))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------- one family


def _first_line(err: BaseException) -> str:
    """The exception's type and first line (and the next one when the first only
    announces it, as a config validator's error does)."""
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    first = text[0] if text else ""
    if first.endswith(":") and len(text) > 1:
        first = f"{first} {text[1]}"
    return f"{type(err).__name__}: {first}"[:300]


def _culprit(err: BaseException) -> str:
    """The style or module a failure names: a ScheduleError's style / path, else the
    innermost transformers or torchloom frame."""
    values = getattr(err, "values", None) or {}
    parts = []
    for key in ("style", "styles"):
        if key in values:
            parts.append(f"style {values[key]}")
    path = getattr(err, "path", None)
    if path:
        parts.append(path)
    if parts:
        return ", ".join(str(p) for p in parts)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "site-packages/transformers" in f.filename or "torchloom" in f.filename]
    if frames:
        f = frames[-1]
        return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
    return ""


def _apply(sch: Any, schedule: str, sequence_parallel: bool) -> None:
    knobs = dict(tp=True, sequence_parallel=sequence_parallel, ckpt_ratio=0.5)
    if schedule == "hf_plan":
        from torchloom.schedules.hf_plan import from_hf_plan

        from_hf_plan(sch, **knobs)
    else:
        from torchloom import schedules

        schedules.apply_schedule(sch, **knobs)


def run_family(family: Family, schedule: str = "auto", try_sp: bool = True,
               seed: int = 0) -> dict[str, Any]:
    """Steps 1-4 of the module docstring on this rank; the row of the table (an exception
    becomes ``stage`` / ``culprit`` / ``error``)."""
    import torchloom as tl
    from torchloom.core.errors import ScheduleError

    row: dict[str, Any] = {"family": family.name, "model_class": family.model_class,
                           "plan_in": family.plan_in, "status": "failed", "stage": "build",
                           "sp": None, "sp_refused": None, "culprit": "", "error": ""}
    start = time.perf_counter()
    try:
        model = build_model(family, seed)
        row["stage"] = "reference"
        row["parameters"] = sum(p.numel() for p in model.parameters())
        dropout = has_dropout(model)
        reference = copy.deepcopy(model)
        ref_losses = train_steps(reference, torch.optim.SGD(reference.parameters(), lr=LR),
                                 seed)
        if not all(math.isfinite(x) for x in ref_losses):
            raise FloatingPointError(f"single-process losses not finite: {ref_losses}")
        del reference
        inputs = example_inputs(model, seed)
        for sp in ((True, False) if try_sp else (False,)):
            row["stage"] = "schedule"
            attempt = copy.deepcopy(model) if sp and try_sp else model
            sch = tl.create_schedule(attempt)
            try:
                with tl.Verify(sch, inputs) as verify:
                    row["stage"] = "schedule"
                    _apply(sch, schedule, sp)
                    row["stage"] = "verify"
            except ScheduleError as err:
                if sp and row["stage"] == "schedule" and not isinstance(
                        err, tl.VerificationError):
                    row["sp_refused"] = _first_line(err)
                    continue  # the same without sequence parallelism
                raise
            row["sp"] = sp
            row["verified"] = dict(verify.stats)
            break
        row["stage"] = "train"
        built, opt = tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        # what this rank keeps of the parameters: under 1 when the plan split anything
        row["local_share"] = round(sum(p.numel() for p in built.parameters())
                                   / row["parameters"], 3)
        losses = train_steps(built, opt, seed)
        row["losses"], row["reference_losses"] = losses, ref_losses
        if dropout:
            row["loss_check"] = "finite (dropout)"
            if not all(math.isfinite(x) for x in losses):
                raise FloatingPointError(f"losses not finite: {losses}")
        else:
            row["loss_check"] = f"equal within {LOSS_TOL:g}"
            bad = [(a, b) for a, b in zip(losses, ref_losses)
                   if not abs(a - b) <= LOSS_TOL * (1 + abs(b))]
            if bad:
                raise AssertionError(f"training losses differ from one process: {losses} vs "
                                     f"{ref_losses}")
        row["status"], row["stage"] = "passed", ""
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table
        row["error"] = _first_line(err)
        row["error_detail"] = str(err)[:2000]  # all of it: values, fix
        row["error_type"] = type(err).__name__
        row["culprit"] = _culprit(err)
        row["schedule_error"] = isinstance(err, ScheduleError)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


# ----------------------------------------------------------------------- loading layouts

#: the layouts ``--layouts`` knows: tensor parallel (the schedule ``--schedule`` picks, TP
#: only), FSDP2 over both ranks, two pipeline stages (``from_hf_plan(tp=False,
#: pipeline_stages=2)``, the layer stack of ``base_model_pp_plan`` cut in two)
LAYOUTS = ("tp", "fsdp", "pp")
#: the first loss of a layout against ``from_pretrained`` in one process:
#: |a - b| <= LOAD_TOL * max(1, |b|) (fp32; the losses are cross-entropies near ln 256)
LOAD_TOL = 1e-5
#: the batch every layout and the reference see (the pipeline: 2 micro-batches of 2)
LOAD_BATCH, LOAD_MICROBATCHES = 4, 2
#: the CI subset of the loading sweep (``--ci --layouts ...``): dense with grouped KV heads
#: (llama, mistral), biases (qwen2), a renamed head (gpt_neox: ``embed_out``), tied
#: embeddings (gemma), q/k norms (olmo2), fused q/k/v and gate/up (phi3)
LOAD_CI_FAMILIES = ("llama", "gpt_neox", "qwen2", "mistral", "gemma", "olmo2", "phi3")


@dataclass
class LoadJob:
    """One family under one layout: where its ``save_pretrained`` folder is, the batch
    and the first loss of ``from_pretrained`` in one process."""

    family: Family
    layout: str
    folder: str
    inputs: dict[str, torch.Tensor]
    reference_loss: float
    parameters: int
    roundtrip_diff: float = 0.0


def _family(item: Any) -> Family:
    """The family of a job (a :class:`LoadJob`, ``ep_sweep.EpJob``) or of a family."""
    return item if isinstance(item, Family) else item.family


def _label(item: Any) -> str:
    return item.name if isinstance(item, Family) else f"{item.family.name} [{item.layout}]"


def _first_tensor(output: Any) -> torch.Tensor:
    """The first tensor of a model's output (a ``ModelOutput`` without ``loss``: the
    logits, or the last hidden state of a base model)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    for value in output:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list, dict)):
            return _first_tensor(value)
    raise TypeError(f"no tensor in the model's output ({type(output).__name__})")


def first_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss every layout is compared on: next-token cross-entropy of the logits
    against the input ids; for an output that is not logits over the ids (a base model's
    hidden states, an image model), the mean of a fixed random projection of its last
    dimension. Both are means over the batch, so the pipeline's mean over equal
    micro-batches is the same number."""
    out = _first_tensor(output).float()
    if out.dim() == 3 and target.dim() == 2 and not target.is_floating_point() \
            and out.shape[:2] == target.shape and int(target.max()) < out.size(-1):
        return nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.size(-1)),
                                           target[:, 1:].reshape(-1))
    weights = torch.randn(out.size(-1), generator=torch.Generator().manual_seed(0))
    return (out * weights).sum(-1).mean()


def load_inputs(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The fixed batch of the loading sweep: :func:`example_inputs` of ``LOAD_BATCH``
    rows without ``labels`` (the loss is :func:`first_loss`); an encoder-decoder also
    gets the ids as its decoder's input."""
    inputs = example_inputs(model, seed, batch=LOAD_BATCH)
    inputs.pop("labels", None)
    params = inspect.signature(model.forward).parameters
    if "input_ids" in inputs and "decoder_input_ids" in params and \
            getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"].clone()
    return inputs


def _main_input(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["input_ids"] if "input_ids" in inputs else next(iter(inputs.values()))


def _pretrained_class(job_or_family: Any) -> type:
    cls = model_class_of(_family(job_or_family).model_class)
    if cls is None:
        raise ImportError(f"{_family(job_or_family).model_class} cannot be imported")
    return cls


def _load_config(folder: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def prepare_load(family: Family, root: str, seed: int = 0
                 ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """In this process: build the family's tiny model, ``save_pretrained`` it into
    ``root/<family>``, load it back with the model class's ``from_pretrained`` and take
    its first loss on the fixed batch (eval mode). Returns a row (stage ``build``,
    ``save`` or ``reference`` when that failed: the family does not build) and, when it
    built, what the ranks need (``folder``, ``inputs``, ``reference_loss``)."""
    row: dict[str, Any] = {"family": family.name, "model_class": family.model_class,
                           "plan_in": family.plan_in, "status": "failed", "stage": "build",
                           "culprit": "", "error": ""}
    start = time.perf_counter()
    try:
        model = build_model(family, seed).eval()
        row["parameters"] = sum(p.numel() for p in model.parameters())
        inputs = load_inputs(model, seed)
        target = _main_input(inputs)
        with torch.no_grad():
            source_loss = first_loss(model(**inputs), target).item()
        row["stage"] = "save"
        folder = os.path.join(root, family.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(folder)
        del model
        row["stage"] = "reference"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = _pretrained_class(family).from_pretrained(
                folder, config=_load_config(folder)).eval()
            with torch.no_grad():
                reference_loss = first_loss(reference(**inputs), target).item()
        if not math.isfinite(reference_loss):
            raise FloatingPointError(f"from_pretrained's first loss is {reference_loss}")
        row["reference_loss"] = reference_loss
        # transformers' own round trip (not checked: the reference is from_pretrained)
        row["roundtrip_diff"] = abs(reference_loss - source_loss)
        row["status"], row["stage"] = "prepared", ""
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row, {"folder": folder, "inputs": inputs, "reference_loss": reference_loss,
                     "parameters": row["parameters"], "roundtrip_diff": row["roundtrip_diff"]}
    except Exception as err:  # noqa: BLE001 - a family that does not build is a row too
        row["error"] = _first_line(err)
        row["error_detail"] = str(err)[:2000]
        row["error_type"] = type(err).__name__
        row["culprit"] = _culprit(err)
        row["seconds"] = round(time.perf_counter() - start, 2)
        return row, None


def _quiet() -> None:
    """No progress bars from save_pretrained / from_pretrained in this process, and no
    tracebacks torch logs when a fake-tensor kernel refuses (the row has the error)."""
    import logging

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with contextlib.suppress(Exception):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _gather_loss(loss: torch.Tensor | None) -> float:
    """The loss of the rank that has one (a pipeline's last stage), on every rank."""
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, None if loss is None else float(loss))
    losses = [x for x in got if x is not None]
    if not losses:
        raise RuntimeError("no rank returned a loss")
    return losses[-1]


def run_load(job: LoadJob, schedule: str = "auto") -> dict[str, Any]:
    """One family under one layout on this rank: a meta model of the folder's config,
    the layout's schedule, ``build(..., weights=folder)``, the first loss on the fixed
    batch (the pipeline: ``pipe.step``'s loss, on every rank), compared with
    ``from_pretrained``'s. The row (an exception becomes ``stage`` / ``culprit`` /
    ``error``; warnings ``build`` gave are in ``warnings``)."""
    import torchloom as tl

    family = job.family
    row: dict[str, Any] = {"family": family.name, "layout": job.layout,
                           "model_class": family.model_class, "plan_in": family.plan_in,
                           "status": "failed", "stage": "schedule", "culprit": "",
                           "error": "", "reference_loss": job.reference_loss,
                           "roundtrip_diff": job.roundtrip_diff}
    _quiet()
    start = time.perf_counter()
    inputs = job.inputs
    target = _main_input(inputs)
    try:
        config = _load_config(job.folder)
        with tl.init_empty_weights():
            model = _pretrained_class(job)(config)
        model.eval()  # as from_pretrained returns it (dropout off)
        sch = tl.create_schedule(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if job.layout == "tp":
                from torchloom import schedules
                from torchloom.schedules.hf_plan import from_hf_plan

                if schedule == "hf_plan":
                    from_hf_plan(sch, tp=True)
                else:
                    schedules.apply_schedule(sch, tp=True)
                row["stage"] = "build"
                built, _ = tl.build(sch, weights=job.folder)
                row["local_share"] = round(sum(p.numel() for p in built.parameters())
                                           / job.parameters, 3)
            elif job.layout == "fsdp":
                row["stage"] = "build"
                built, _ = tl.build(sch, target="fsdp", weights=job.folder)
            elif job.layout == "pp":
                from torchloom.schedules.hf_plan import from_hf_plan

                micro = {k: v[:LOAD_BATCH // LOAD_MICROBATCHES] for k, v in inputs.items()}
                from_hf_plan(sch, tp=False, pipeline_stages=2, example_inputs=micro)
                if len(inputs) != 1:  # build and step take the inputs by position
                    raise ValueError(f"the sweep feeds a pipeline one input, not "
                                     f"{sorted(inputs)}")
                row["stage"] = "build"
                built, _ = tl.build(sch, target="pipeline", schedule="1F1B",
                                    n_microbatches=LOAD_MICROBATCHES, loss_fn=first_loss,
                                    example_inputs=tuple(micro.values()), weights=job.folder)
            else:
                raise ValueError(f"unknown layout {job.layout!r}; known: {', '.join(LAYOUTS)}")
        row["warnings"] = list(dict.fromkeys(
            str(w.message).splitlines()[0][:200] for w in caught
            if issubclass(w.category, UserWarning) and "eval mode" not in str(w.message)))
        row["stage"] = "forward"
        if job.layout == "pp":
            loss = _gather_loss(built.step(*inputs.values(), target=target))
        else:
            with torch.no_grad():
                loss = first_loss(built(**inputs), target).item()
            _gather_loss(torch.tensor(loss))  # the ranks stay in step
        row["loss"] = loss
        row["stage"] = "compare"
        diff = abs(loss - job.reference_loss)
        row["diff"] = diff
        if not diff <= LOAD_TOL * max(1.0, abs(job.reference_loss)):
            raise AssertionError(
                f"first loss {loss!r} differs from from_pretrained's {job.reference_loss!r} "
                f"by {diff:.3g} (tolerance {LOAD_TOL:g} relative)")
        row["status"], row["stage"] = "passed", ""
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table
        row["error"] = _first_line(err)
        cause = err.__cause__ or err.__context__
        if cause is not None and len(str(err).strip().splitlines()) > 1 \
                and "failed to run" in str(err):  # a pipeline stage's wrapper: say why
            row["error"] = f"{row['error']} <- {_first_line(cause)}"[:400]
            row["culprit"] = _culprit(cause)
        row["error_detail"] = str(err)[:2000]
        row["error_type"] = type(err).__name__
        row["culprit"] = row.get("culprit") or _culprit(err)
        # a pipeline step that failed on one stage leaves the other's sends and receives
        # in flight: the next family gets two new ranks
        row["restart"] = job.layout == "pp" and row["stage"] == "forward"
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def load_jobs(families: list[Family], layouts: list[str], root: str, seed: int = 0,
              log: Callable[[str], None] = print
              ) -> tuple[list[LoadJob], list[dict[str, Any]]]:
    """:func:`prepare_load` for every family (in this process), then one job per family
    and layout, family by family; and the rows of the families that do not build."""
    jobs: list[LoadJob] = []
    not_building: list[dict[str, Any]] = []
    for i, family in enumerate(families):
        row, ready = prepare_load(family, root, seed)
        if ready is None:
            not_building.append(row)
            log(f"[prepare {i + 1}/{len(families)}] {family.name}: does not build "
                f"({row['stage']}) {row['error'][:120]}")
            continue
        jobs += [LoadJob(family, layout, ready["folder"], ready["inputs"],
                         ready["reference_loss"], ready["parameters"], ready["roundtrip_diff"])
                 for layout in layouts]
    return jobs, not_building


def load_counts(rows: list[dict[str, Any]], not_building: list[dict[str, Any]],
                layouts: list[str]) -> dict[str, Any]:
    """Per layout: passed of the families that build, and the failures by stage."""
    building = sorted({r["family"] for r in rows})
    out: dict[str, Any] = {"families": len(building) + len(not_building),
                           "building": len(building), "not_building": len(not_building)}
    for layout in layouts:
        mine = [r for r in rows if r.get("layout") == layout]
        failed = [r for r in mine if r["status"] != "passed"]
        by_stage: dict[str, int] = {}
        for r in failed:
            by_stage[r["stage"]] = by_stage.get(r["stage"], 0) + 1
        out[layout] = {"passed": len(mine) - len(failed), "failed": len(failed),
                       "of": len(mine), "failed_by_stage": by_stage}
    out["all_layouts"] = sum(
        1 for name in building
        if all(r["status"] == "passed" for r in rows if r["family"] == name))
    return out


LAYOUT_NAMES = {"tp": "TP 2", "fsdp": "FSDP 2", "pp": "PP 2"}


def load_markdown(rows: list[dict[str, Any]], not_building: list[dict[str, Any]],
                  layouts: list[str], header: str = "") -> str:
    """The loading sweep's counts, its table family x layout, every failure with its
    reason, and the families that do not build."""
    c = load_counts(rows, not_building, layouts)
    lines = [header] if header else []
    lines += [
        f"Each family's tiny model is written with `save_pretrained`; on 2 gloo ranks a meta "
        f"copy (`tl.init_empty_weights()`, the model class from the folder's config) is "
        f"loaded with `tl.build(sch, ..., weights=folder)` under each layout and its first "
        f"loss (eval mode, a fixed batch of {LOAD_BATCH} x {SEQ} tokens, before any step; "
        f"the pipeline: `pipe.step`'s loss over {LOAD_MICROBATCHES} micro-batches) is "
        f"compared with the model class's `from_pretrained` in one process (within "
        f"{LOAD_TOL:g} relative, fp32).",
        "",
        "; ".join(f"**{LAYOUT_NAMES[k]}: {c[k]['passed']} of {c[k]['of']} pass**"
                  for k in layouts)
        + f" ({c['building']} families build; {c['all_layouts']} pass every layout); "
        f"{c['not_building']} do not build, save or load from a tiny config.",
        "",
        "| family | model class | " + " | ".join(LAYOUT_NAMES[k] for k in layouts) + " |",
        "|---|---|" + "---|" * len(layouts),
    ]
    by_family: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_family.setdefault(r["family"], {})[r.get("layout", "")] = r
    for name in sorted(by_family):
        cells = []
        for k in layouts:
            r = by_family[name].get(k)
            cells.append("-" if r is None else "passed" if r["status"] == "passed"
                         else f"failed ({r.get('stage', '')})")
        model_class = next(iter(by_family[name].values())).get("model_class", "")
        lines.append("| " + " | ".join(_cell(x) for x in (name, model_class, *cells)) + " |")
    failed = [r for r in rows if r["status"] != "passed"]
    lines += ["", f"Failures ({len(failed)}):", "",
              "| family | layout | failed at | where | error |", "|---|---|---|---|---|"]
    for r in sorted(failed, key=lambda r: (r["family"], layouts.index(r["layout"])
                                           if r.get("layout") in layouts else 0)):
        lines.append("| " + " | ".join(_cell(x) for x in (
            r["family"], LAYOUT_NAMES.get(r.get("layout", ""), r.get("layout", "")),
            r.get("stage", ""), r.get("culprit", ""), r.get("error", ""))) + " |")
    warned = [r for r in rows if r.get("warnings")]
    if warned:
        lines += ["", "Warnings `build` gave:", ""] + [
            f"- {r['family']} [{r['layout']}]: " + "; ".join(_cell(w) for w in r["warnings"])
            for r in warned]
    if not_building:
        lines += ["", f"Do not build ({len(not_building)}):", "",
                  "| family | model class | failed at | error |", "|---|---|---|---|"]
        for r in sorted(not_building, key=lambda r: r["family"]):
            lines.append("| " + " | ".join(_cell(x) for x in (
                r["family"], r.get("model_class", ""), r.get("stage", ""),
                r.get("error", ""))) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------- the launcher


#: tests only: make one rank of one family fail ("family:rank:die", ":raise", ":hang")
FAULT_ENV = "TORCHLOOM_ZOO_SWEEP_FAULT"


def _inject(kind: str) -> None:
    if kind == "die":
        os._exit(3)
    if kind == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"{FAULT_ENV}: injected failure")


def _rank_main(rank: int, port: int, families: list[Any], args: argparse.Namespace,
               results: Any, conn: Any) -> None:
    """One rank: every family (or :class:`LoadJob`) in order, each after the launcher's
    go."""
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        fault = os.environ.get(FAULT_ENV, "")  # tests only: "family:rank:die|raise|hang"
        for index, family in enumerate(families):
            if index and conn.recv() != "go":
                break
            if fault.startswith(f"{_family(family).name}:{rank}:"):
                _inject(fault.rsplit(":", 1)[1])
            if hasattr(family, "run"):  # a job that runs itself (ep_sweep.EpJob)
                row = family.run(args)
            elif isinstance(family, LoadJob):
                row = run_load(family, args.schedule)
            else:
                row = run_family(family, args.schedule, not args.no_sp, args.seed)
            results.put((rank, index, row))
    finally:
        dist.destroy_process_group()


def _merge(rows: list[dict[str, Any] | None]) -> tuple[dict[str, Any], bool]:
    """One row from the ranks' rows; and whether the ranks may go on (they agree)."""
    present = [r for r in rows if r is not None]
    if len(present) < len(rows):
        row = dict(present[0]) if present else {}
        return row, False
    if all(r["status"] == "passed" for r in present):
        return present[0], True
    if any(r.get("restart") for r in present):
        return next(r for r in present if r["status"] != "passed"), False
    failed = [r for r in present if r["status"] != "passed"]
    # the root cause: a rank's own error rather than a collective that lost its peer
    failed.sort(key=lambda r: ("Collective" in r.get("error_type", "")
                               or "DistError" in r.get("error_type", "")))
    agree = (len(failed) == len(present)
             and len({(r["stage"], r["error_type"]) for r in present}) == 1
             and not any("Collective" in r.get("error_type", "") for r in present))
    return failed[0], agree


def sweep(families: list[Any], args: argparse.Namespace,
          log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``families`` (or :class:`LoadJob` s) on two ranks; the merged rows in order."""
    from torchloom.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    pending = list(families)
    launches = 0
    while pending:
        launches += 1
        results = ctx.Queue()
        pipes = [ctx.Pipe() for _ in range(WORLD)]
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, port, pending, args, results,
                                                       pipes[r][1]), daemon=True)
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        done = 0
        restart = False
        for index, family in enumerate(pending):
            got: list[dict[str, Any] | None] = [None] * WORLD
            deadline = time.monotonic() + args.timeout + 15 + (START_S if index == 0 else 0)
            while any(g is None for g in got) and time.monotonic() < deadline:
                try:
                    rank, i, row = results.get(timeout=0.5)
                except queue.Empty:
                    if not all(p.is_alive() for p in procs) and results.empty():
                        time.sleep(1.0)
                        if results.empty():
                            break
                    continue
                if i == index:
                    got[rank] = row
            row, agree = _merge(got)
            if not row or any(g is None for g in got):
                missing = [r for r in range(WORLD) if got[r] is None]
                dead = [r for r in missing if not procs[r].is_alive()]
                why = (f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})" if dead
                       else f"timed out after {args.timeout:g} s")
                fam = _family(family)
                row = {**(row or {}), "family": fam.name,
                       "model_class": fam.model_class, "plan_in": fam.plan_in,
                       "status": "failed", "stage": (row or {}).get("stage") or "timeout",
                       "error": (row or {}).get("error") or why, "culprit":
                       (row or {}).get("culprit", "")}
                if not isinstance(family, Family):
                    row["layout"] = family.layout
                row["error"] = row["error"] + f" [{why}]" if why not in row["error"] else \
                    row["error"]
            rows.append(row)
            done = index + 1
            mark = "ok" if row["status"] == "passed" else f"FAILED ({row['stage']})"
            log(f"[{len(rows)}/{len(families)}] {_label(family)}: {mark} "
                f"{row.get('seconds', '')}s {row.get('error', '')[:120]}")
            if not agree:
                restart = done < len(pending)
                break
            if done < len(pending):
                for parent_end, _ in pipes:
                    parent_end.send("go")
        for parent_end, _ in pipes:
            try:
                parent_end.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=5 if not restart else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        pending = pending[done:]
    for row in rows:
        row.setdefault("launches", launches)
    return rows


# ----------------------------------------------------------------------- the report

#: stages at which the unscheduled tiny model itself failed: not torchloom's failures
NOT_BUILDING = ("build", "save", "reference")


def counts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """passed / failed / not building, and the pass rate over the families that build."""
    building = [r for r in rows if r.get("stage") not in NOT_BUILDING]
    passed = [r for r in building if r["status"] == "passed"]
    failed = [r for r in building if r["status"] != "passed"]
    by_stage: dict[str, int] = {}
    for r in failed:
        by_stage[r["stage"]] = by_stage.get(r["stage"], 0) + 1
    return {
        "families": len(rows),
        "not_building": len(rows) - len(building),
        "building": len(building),
        "passed": len(passed),
        "failed": len(failed),
        "failed_by_stage": by_stage,
        "with_sp": sum(1 for r in passed if r.get("sp")),
        # passed, but the plan split nothing of this model (each rank holds all of it)
        "passed_unsplit": sum(1 for r in passed if r.get("local_share", 0) >= 1.0),
        "pass_rate": round(len(passed) / len(building), 4) if building else 0.0,
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]], skipped: list[dict[str, str]] | None = None,
             header: str = "") -> str:
    """The table and the counts as Markdown."""
    c = counts(rows)
    lines = [header] if header else []
    lines += [
        "`kept`: the share of the model's parameters each rank holds after the TP=2 "
        "schedule (0.5 when everything is split); `sp`: whether sequence parallelism ran "
        "(the error that refused it is in the JSON, `sp_refused`).",
        "",
        f"{c['passed']} of {c['building']} families that build from a tiny config pass "
        f"({100 * c['pass_rate']:.0f}%; {c['with_sp']} of them with sequence parallelism, "
        f"{c['passed_unsplit']} with nothing split); "
        f"{c['failed']} fail ({', '.join(f'{k}: {v}' for k, v in sorted(c['failed_by_stage'].items())) or 'none'}); "
        f"{c['not_building']} do not build or run from a tiny config.",
        "",
        "| family | model class | plan in | result | sp | kept | failed at | style / module "
        "| error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(rows, key=lambda r: (r.get("stage") in NOT_BUILDING,
                                        r["status"] != "passed", r["family"]))
    for r in order:
        result = "passed" if r["status"] == "passed" else (
            "does not build" if r.get("stage") in NOT_BUILDING else "failed")
        sp = {True: "yes", False: "no", None: "-"}[r.get("sp")]
        lines.append("| " + " | ".join(_cell(x) for x in (
            r["family"], r.get("model_class", ""), r.get("plan_in", ""), result, sp,
            f"{r['local_share']:.2f}" if "local_share" in r else "",
            r.get("stage", "") if r["status"] != "passed" else "",
            r.get("culprit", ""), r.get("error", ""))) + " |")
    if skipped:
        lines += ["", f"Not run ({len(skipped)}): " + "; ".join(
            f"{s['family']} ({s['reason']})" for s in skipped)]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--families", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help="comma-separated config keys (model_type), e.g. llama,qwen2,mixtral")
    p.add_argument("--ci", action="store_true",
                   help=f"the fixed CI subset: {','.join(CI_FAMILIES)} (with --layouts: "
                   f"{','.join(LOAD_CI_FAMILIES)})")
    p.add_argument("--layouts", type=_layouts, metavar="tp,fsdp,pp",
                   help="instead of training at TP=2: load each family's save_pretrained "
                   "folder into a meta model with build(weights=) under these layouts and "
                   "compare the first loss with from_pretrained in one process; 'ep' "
                   "(alone): the expert-parallel sweep over every mixture-of-experts family "
                   "(benchmarks/ep_sweep.py)")
    p.add_argument("--limit", type=int, help="only the first N families")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one family may take (and the collective timeout)")
    p.add_argument("--schedule", choices=("auto", "hf_plan"), default="auto",
                   help="auto: torchloom.schedules.apply_schedule (the hand-written schedule "
                   "where one exists); hf_plan: schedules.hf_plan.from_hf_plan for every family")
    p.add_argument("--no-sp", action="store_true", help="never try sequence parallelism")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows and counts as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table to a file")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    return p.parse_args(argv)


def _layouts(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in (*LAYOUTS, "ep")]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown layout(s) {', '.join(unknown) or repr(text)}; known: {','.join(LAYOUTS)}"
            ", or ep alone")
    if "ep" in names and len(set(names)) > 1:
        raise argparse.ArgumentTypeError(
            "ep runs alone: --layouts ep is the expert-parallel sweep (benchmarks/ep_sweep.py)")
    return list(dict.fromkeys(names))


def select(args: argparse.Namespace) -> tuple[list[Family], list[dict[str, str]]]:
    """The families the arguments ask for (unknown names are an error)."""
    families, skipped = discover()
    if args.ci and not args.families:
        args.families = list(LOAD_CI_FAMILIES if args.layouts else CI_FAMILIES)
    if args.families:
        known = {f.name: f for f in families}
        unknown = [n for n in args.families if n not in known]
        if unknown:
            raise SystemExit(f"error: not a family with a tensor-parallel plan: "
                             f"{', '.join(unknown)} (see --list)")
        families = [known[n] for n in args.families]
        skipped = []
    if args.limit is not None:
        families = families[:args.limit]
    return families, skipped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep, print the table, return ``{"rows", "counts", ...}``."""
    import transformers

    args = parse_args(argv)
    if args.layouts == ["ep"]:  # the expert-parallel sweep, over its own families
        import ep_sweep

        return ep_sweep.main(argv)
    families, skipped = select(args)
    if args.list:
        for f in families:
            print(f"{f.name:32} {f.model_class:44} plan in {f.plan_in}")
        return {"families": [dataclasses.asdict(f) for f in families]}
    if args.layouts:
        return main_load(args, families, skipped, argv)
    start = time.perf_counter()
    rows = sweep(families, args, log=lambda s: print(s, file=sys.stderr, flush=True))
    elapsed = time.perf_counter() - start
    command = "python benchmarks/zoo_sweep.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    header = (f"torchloom zoo sweep, TP={WORLD} on gloo (CPU), checkpoint ratio 0.5, "
              f"schedule={args.schedule}: {len(families)} families in {elapsed / 60:.1f} min "
              f"on {os.cpu_count()} CPUs, {args.threads} thread(s) per rank; torch "
              f"{torch.__version__}, transformers {transformers.__version__}, Python "
              f"{platform.python_version()}; `{command.strip()}`\n")
    text = markdown(rows, skipped, header)
    print(text)
    result = {"rows": rows, "counts": counts(rows), "skipped": skipped,
              "seconds": round(elapsed, 1), "command": command.strip(),
              "machine": _machine(args),
              "launches": max((r.get("launches", 1) for r in rows), default=0)}
    _write_results(args, result, text)
    return result


def _machine(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    return {"cpus": os.cpu_count(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": args.threads}


def _write_results(args: argparse.Namespace, result: dict[str, Any], text: str) -> None:
    """``--json`` and ``--markdown`` outputs of a sweep."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


def main_load(args: argparse.Namespace, families: list[Family],
              skipped: list[dict[str, str]], argv: list[str] | None) -> dict[str, Any]:
    """``--layouts``: the loading sweep (see :func:`run_load`); ``{"rows", "counts",
    "not_building", ...}``."""
    import tempfile

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the ranks inherit it
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _quiet()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo_load_") as root:
        jobs, not_building = load_jobs(families, args.layouts, root, args.seed, log)
        prepared = time.perf_counter() - start
        log(f"prepared {len(families)} families in {prepared:.0f} s "
            f"({len(not_building)} do not build); {len(jobs)} jobs on {WORLD} ranks")
        rows = sweep(jobs, args, log=log) if jobs else []
    elapsed = time.perf_counter() - start
    command = "python benchmarks/zoo_sweep.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    m = _machine(args)
    header = (f"torchloom zoo loading sweep, {', '.join(LAYOUT_NAMES[k] for k in args.layouts)} "
              f"on gloo (CPU), TP schedule={args.schedule}: {len(families)} families in "
              f"{elapsed / 60:.1f} min ({prepared / 60:.1f} min of it preparing the folders "
              f"and references in one process) on {m['cpus']} CPUs, {args.threads} "
              f"thread(s) per rank; torch {m['torch']}, transformers {m['transformers']}, "
              f"Python {m['python']}; `{command.strip()}`\n")
    text = load_markdown(rows, not_building, args.layouts, header)
    if skipped:
        text += "\n\n" + f"Not run ({len(skipped)}): " + "; ".join(
            f"{s['family']} ({s['reason']})" for s in skipped)
    print(text)
    result = {"rows": rows, "not_building": not_building,
              "counts": load_counts(rows, not_building, args.layouts),
              "layouts": args.layouts, "skipped": skipped, "seconds": round(elapsed, 1),
              "prepare_seconds": round(prepared, 1), "command": command.strip(),
              "machine": m,
              "launches": max((r.get("launches", 1) for r in rows), default=0)}
    _write_results(args, result, text)
    return result


if __name__ == "__main__":
    main()
