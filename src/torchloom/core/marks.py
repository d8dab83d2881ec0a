"""What primitives leave on modules and tensors, read and written in one place.

A primitive that changes how a module runs (a sync's hooks, a checkpoint or RNG wrapper,
a pipeline cut, a compiled forward) marks the module, so that later primitives, ``build``,
``check`` and ``Verify`` can see what was done. Every mark is an attribute named
``_torchloom_<name>``; this module is the only place that spells those names.

>>> from torch import nn
>>> layer = nn.Linear(2, 2)
>>> has_mark(layer, PIPELINE_CUT)
False
>>> set_mark(layer, PIPELINE_CUT, True)
>>> get_mark(layer, PIPELINE_CUT)
True
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CHECKPOINTED", "COMPILED", "CONTEXT_PARALLEL", "EXPERT_PARALLEL", "FOREIGN_IDS", "FORK_RNG", "KEY_ORDER", "LEAF", "LORA", "META",
           "PIPELINE_CUT", "PRETRAINED_INFO", "SYNCS", "TIED_KEYS", "WEIGHT_SPEC", "get_mark",
           "has_mark", "mark_attr", "marks_of", "pop_mark", "set_mark", "transfer_hooks"]

#: A module's list of :class:`~torchloom.primitives.sync.SyncSpec` (``sync``).
SYNCS = "syncs"
#: The module's forward recomputes in backward (``checkpoint``).
CHECKPOINTED = "checkpointed"
#: The module draws from the tensor-parallel RNG state (``fork_rng``).
FORK_RNG = "fork_rng"
#: The module's forward runs under ``torch.compile`` (``compile``).
COMPILED = "compiled"
#: The model's (and each of its attention modules') context-parallel state
#: (:class:`~torchloom.ops.context_parallel.CPState`, ``context_parallel``).
CONTEXT_PARALLEL = "context_parallel"
#: An experts module's expert-parallel state
#: (:class:`~torchloom.runtime.expert_dispatch.EPState`, ``expert_parallel``).
EXPERT_PARALLEL = "expert_parallel"
#: The module below which ``lora`` added adapters
#: (:class:`~torchloom.primitives.lora.LoraState`).
LORA = "lora"
#: The module ends a pipeline stage (``cut_pipeline_stage``).
PIPELINE_CUT = "pipeline_cut"
#: A class attribute: torchloom wrappers that the tracer keeps as leaves.
LEAF = "leaf"
#: A tensor's :class:`~torchloom.core.meta.TensorMeta` (shard spec and tags).
META = "meta"
#: The state-dict key order, tied keys and model description a pipeline model keeps for
#: ``save_pretrained``.
KEY_ORDER = "key_order"
TIED_KEYS = "tied_keys"
PRETRAINED_INFO = "pretrained_info"
#: Ids of tensors a derived schedule's module holds that are not its own.
FOREIGN_IDS = "foreign_ids"
#: The shard spec of a module's weight, kept on the module for hooks that run while FSDP2
#: has swapped the weight for its gathered (spec-less) copy.
WEIGHT_SPEC = "weight_spec"

_PREFIX = "_torchloom_"


def mark_attr(name: str) -> str:
    """The attribute that holds the mark ``name`` (for ``setattr`` on a class body)."""
    return _PREFIX + name


def get_mark(obj: Any, name: str, default: Any = None) -> Any:
    """The mark ``name`` on a module or tensor, or ``default``."""
    return getattr(obj, mark_attr(name), default)


def has_mark(obj: Any, name: str) -> bool:
    """Whether ``obj`` carries a true mark ``name``."""
    return bool(getattr(obj, mark_attr(name), False))


def set_mark(obj: Any, name: str, value: Any) -> None:
    """Leave the mark ``name`` on a module or tensor."""
    setattr(obj, mark_attr(name), value)


def pop_mark(obj: Any, name: str, default: Any = None) -> Any:
    """Remove the mark ``name`` from the instance and return it (``default`` if absent)."""
    return vars(obj).pop(mark_attr(name), default)


def marks_of(obj: Any) -> dict[str, Any]:
    """The marks on the instance ``obj``, by name."""
    return {k.removeprefix(_PREFIX): v for k, v in vars(obj).items() if k.startswith(_PREFIX)}


# Hook dictionaries of nn.Module (torch 2.13). Each maps a hook id to a callable; the
# handles returned by register_*_hook refer to these dict objects by weak reference.
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def transfer_hooks(old: nn.Module, new: nn.Module) -> None:
    """Move every hook of ``old`` onto ``new`` (hooks already on ``new`` run after them)."""
    for attr in _HOOK_DICTS:
        old_hooks = getattr(old, attr, None)
        if old_hooks is None or not old_hooks:
            continue
        new_hooks = getattr(new, attr, None)
        if new_hooks:
            # Keep the old dict object so the user's handles still remove their hooks.
            for key, value in new_hooks.items():
                old_hooks[key] = value
        setattr(new, attr, old_hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
