"""Whether a model's attention keeps packed examples apart (``torchloom train --pack``):
:func:`check_packing` reads the model's code and config, never runs it.

transformers builds a block-diagonal causal mask from ``position_ids`` that restart at 0
(packed examples in one row) when its mask creators (``transformers.masking_utils``) are
given them; a model whose forward does not pass them, or an attention implementation
without such masks, would let the examples attend to each other.

>>> import transformers
>>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
...     num_attention_heads=2, num_hidden_layers=1, vocab_size=32)
>>> check_packing(transformers.LlamaForCausalLM(config))   # accepted: nothing happens
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from typing import Any

import torch

from ..core.errors import DataError

__all__ = ["check_packing"]

PRIMITIVE = "torchloom train"


def check_packing(model: torch.nn.Module) -> None:
    """Refuse (:class:`DataError`) a model whose attention would mix packed examples.

    A model keeps the examples of a row apart when all of these hold (read from the model
    and its modeling code, not from a list of model classes):

    1. it is, or holds (a LoRA or data-parallel wrapper), a transformers
       ``PreTrainedModel``, and the forward called (the wrapper's, and the transformers
       model's by name) takes ``position_ids``;
    2. the forwards of its modules' classes (``LlamaModel``, ``OPTDecoder``: where
       transformers models build their masks) call a ``transformers.masking_utils`` causal
       mask creator that takes ``position_ids`` (``create_causal_mask``,
       ``create_sliding_window_causal_mask``, ...), and pass ``position_ids`` to every such
       call (as a keyword, a positional argument, or a key of a ``**dict`` literal): that
       is where transformers finds packed examples. The forwards' source is read with
       :mod:`ast`;
    3. its attention implementation (``config._attn_implementation``) is one that
       ``masking_utils`` builds masks for (``eager``, ``sdpa``, ``flash_attention_*``,
       ``flex_attention``); others get no mask from it.

    Models without position ids (ALiBi models such as Bloom and MPT) or that build their
    mask from ``attention_mask`` alone (OPT) fail 1 or 2. The check needs the model to
    run without a KV cache (``use_cache=False``): see the module docstring.
    """
    reasons: list[str] = []
    inner = getattr(model, "module", model)  # DistributedDataParallel
    hf = _transformers_model(inner)
    if hf is None:
        reasons.append(f"{type(inner).__name__} is not a transformers model (no "
                       "PreTrainedModel inside): whether its attention keeps packed "
                       "examples apart cannot be told")
    else:
        if hf is not inner and not _takes(inner.forward, "position_ids", via_kwargs=True):
            reasons.append(f"{type(inner).__name__}.forward takes no position_ids")
        if not _takes(hf.forward, "position_ids", via_kwargs=False):
            reasons.append(f"{type(hf).__name__}.forward takes no position_ids (it has no "
                           "position ids to restart for each example)")
        if not reasons:
            problem = _mask_problem(hf)
            if problem:
                reasons.append(problem)
        implementation = getattr(hf.config, "_attn_implementation", None)
        known = _mask_implementations()
        if implementation not in known:
            reasons.append(f"its attention implementation {implementation!r} is not one "
                           f"transformers builds masks for ({', '.join(sorted(known))})")
    if reasons:
        raise DataError(
            "--pack needs a model whose attention keeps the examples of a row apart; "
            + "; ".join(reasons), primitive=PRIMITIVE,
            values={"model": type(inner).__name__,
                    "attn_implementation": getattr(getattr(hf, "config", None),
                                                   "_attn_implementation", None)},
            fix="train without --pack (one example a row), or use a model whose attention "
            "reads packed examples from position_ids (Llama, Qwen2, Mistral, GPT-2, ...) "
            "with attn_implementation sdpa, eager or flash_attention_2")


# --------------------------------------------------------------------------- reading


def _transformers_model(model: torch.nn.Module) -> Any:
    """The first transformers ``PreTrainedModel`` in ``model`` (itself first), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def _takes(function: Any, name: str, via_kwargs: bool) -> bool:
    """Whether ``function`` takes the keyword ``name`` (or any keyword, with ``via_kwargs``)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    if name in params:
        return True
    return via_kwargs and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _mask_implementations() -> frozenset[str]:
    """The attention implementations ``masking_utils`` builds masks for."""
    from transformers import masking_utils

    interface: Any = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    mapping = getattr(interface, "_global_mapping", None)
    return frozenset(mapping if mapping is not None else interface.valid_keys())


def _mask_creators(module_name: str) -> dict[str, Any]:
    """The ``transformers.masking_utils`` causal-mask creators that take ``position_ids``,
    by the names the module ``module_name`` imported them as."""
    module = sys.modules.get(module_name)
    if module is None:
        return {}
    return {name: value for name, value in vars(module).items()
            if callable(value)
            and getattr(value, "__module__", None) == "transformers.masking_utils"
            and name.startswith("create_") and "causal" in name
            and _takes(value, "position_ids", via_kwargs=False)}


def _mask_calls(owner: type, creators: dict[str, Any]) -> list[tuple[ast.Call, bool]] | None:
    """The calls of a mask creator in ``owner.forward``, each with whether it is given
    ``position_ids``; None: the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(vars(owner)["forward"])))
    except (OSError, TypeError, SyntaxError):
        return None
    aliases = set(creators)      # mask_function = create_causal_mask if ... else ...
    dicts: set[str] = set()      # mask_kwargs = {..., "position_ids": position_ids}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = node.value
        if value is None:
            continue
        if isinstance(value, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == "position_ids" for k in value.keys):
            dicts |= names
        elif not isinstance(value, ast.Call) and any(
                isinstance(n, ast.Name) and n.id in creators for n in ast.walk(value)):
            aliases |= names

    def passes(call: ast.Call) -> bool:
        for keyword in call.keywords:
            if keyword.arg == "position_ids":
                return True
            if (keyword.arg is None and isinstance(keyword.value, ast.Name)
                    and keyword.value.id in dicts):
                return True
        creator = creators.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if creator is not None:
            order = list(inspect.signature(creator).parameters)
            return len(call.args) > order.index("position_ids")
        return False

    return [(node, passes(node)) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id in aliases]


def _mask_problem(model: torch.nn.Module) -> str | None:
    """Why the modules of the transformers model ``model`` do not hand ``position_ids`` to
    every ``masking_utils`` causal-mask creator they call, or call none (None: they do)."""
    found = 0
    seen: set[type] = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        owner = next((c for c in cls.__mro__ if "forward" in vars(c)), None)
        if owner is None:
            continue
        creators = _mask_creators(owner.__module__)
        if not creators:
            continue
        calls = _mask_calls(owner, creators)
        if calls is None:
            return f"the source of {owner.__name__}.forward cannot be read"
        for call, passes in calls:
            if not passes:
                return (f"{owner.__name__}.forward builds its causal mask without "
                        f"position_ids (line {call.lineno} of the forward), so the examples "
                        "of a row would attend to each other")
            found += 1
    if not found:
        return (f"{type(model).__name__} does not build its causal mask with "
                "transformers.masking_utils from position_ids")
    return None
