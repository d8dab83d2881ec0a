"""A model's config and size, checked before anything is allocated.

Used by :func:`torchloom.build`, :class:`torchloom.Verify` and ``torchloom train`` (never by
the planner, whose job is models larger than this machine):

* :func:`check_config_sizes`: every size field of a transformers config (``vocab_size``,
  ``hidden_size`` / ``n_embd``, layers, heads, ...; nested sub-configs too) is a positive
  integer, else a :class:`ModelConfigError` naming the field and its value (a zero
  ``n_embd`` used to end in a ``ZeroDivisionError``, ``n_layer`` -1 in a model without
  layers that trained);
* :func:`meta_bytes` counts what materialising a model's ``meta`` tensors allocates on this
  rank (their local, i.e. sharded, shapes; tied tensors once) without allocating it, and
  :func:`check_fits` compares a need with the memory available on the device
  (``MemAvailable`` of ``/proc/meminfo`` for the CPU, the free memory of a CUDA device):
  a need beyond it is a :class:`ModelConfigError` with the estimate and the fix, raised
  before the allocation that would otherwise fail (or swap) after minutes.

The estimates are lower bounds (no activations, no allocator slack): a refusal means the
allocation cannot succeed. ``TORCHLOOM_NO_MEMORY_CHECK=1`` skips the memory comparison
(the size checks stay).

>>> import transformers
>>> check_config_sizes(transformers.GPT2Config(n_embd=0), source="config.json")
Traceback (most recent call last):
...
torchloom.core.errors.ModelConfigError: build(...): the model config's n_embd is 0; a size must be a positive integer
    values: n_embd=0, config='config.json'
    fix: set n_embd in config.json to a positive integer (the value of the model the weights were saved from)
>>> import torch
>>> meta_bytes(torch.nn.Linear(4, 4, device="meta"))
80
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..core.errors import ModelConfigError
from ..core.meta import shard_spec

__all__ = ["ModelConfigError", "SIZE_FIELDS", "available_memory", "check_before_build",
           "check_config_sizes", "check_fits", "check_model_sizes", "format_bytes",
           "meta_bytes"]

SIZE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim",
    "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "n_ctx",
    "d_model", "d_ff", "d_kv", "num_layers", "num_heads", "num_decoder_layers",
    "ffn_dim", "word_embed_proj_dim", "embed_dim",
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_ffn_dim", "decoder_ffn_dim",
)
"""Config fields that are sizes (as stored: GPT-2's ``n_embd``, not the alias
``hidden_size``); ``None`` (an optional size such as ``n_inner``) is allowed."""

NO_CHECK_ENV = "TORCHLOOM_NO_MEMORY_CHECK"


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style text.

    >>> format_bytes(3 << 30), format_bytes(512)
    ('3.0 GiB', '512 B')
    """
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _fields(config: Any) -> dict[str, Any]:
    try:
        return dict(vars(config))
    except TypeError:
        return {}


def check_config_sizes(config: Any, *, source: str | None = None,
                       primitive: str = "build", _prefix: str = "") -> None:
    """Every :data:`SIZE_FIELDS` entry of ``config`` (a transformers config, or anything
    with those attributes; sub-configs such as ``text_config`` too) is a positive integer
    (``head_dim`` may be 0: some families derive it), a non-empty list of them (one per
    layer) or None; else a :class:`ModelConfigError` naming the field, its value and ``source``
    (the file or class it came from)."""
    if config is None:
        return
    where = source or type(config).__name__
    fields = _fields(config)
    for name in SIZE_FIELDS:
        if name not in fields:
            continue
        value = fields[name]
        if value is None:
            continue
        items = value if isinstance(value, (list, tuple)) and value else [value]
        # head_dim 0: "derived elsewhere" in some families (GLM-5-Next's latent attention
        # sizes its heads by qk_head_dim); a zero size allocates nothing
        least = 0 if name == "head_dim" else 1
        good = all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                   for v in items)
        if not good:  # (a list: one size per layer, as Gemma 3n's intermediate_size)
            field = _prefix + name
            raise ModelConfigError(
                f"the model config's {field} is {value!r}; a size must be a positive integer",
                primitive=primitive, values={field: value, "config": where},
                fix=f"set {field} in {where} to a positive integer (the value of the model "
                "the weights were saved from)")
    for key, value in fields.items():  # text_config, vision_config, ...
        if key.endswith("_config") and value is not None and hasattr(value, "to_dict"):
            check_config_sizes(value, source=source, primitive=primitive,
                               _prefix=f"{_prefix}{key}.")


def check_model_sizes(model: nn.Module, *, primitive: str = "build") -> None:
    """:func:`check_config_sizes` of ``model.config`` (when the model has one)."""
    config = getattr(model, "config", None)
    if config is not None and not isinstance(config, nn.Module):
        check_config_sizes(config, primitive=primitive)


def meta_bytes(model: nn.Module, keep: set[int] | None = None) -> int:
    """Bytes that materialising the ``meta`` parameters and buffers of ``model`` allocates
    on this rank: each at its local (sharded) shape, tied tensors once, plus the largest
    full-size temporary of a sharded one (initialised whole, then sliced). ``keep``: only
    tensors with these ids (a pipeline rank's stages)."""
    seen: set[int] = set()
    total, largest_extra = 0, 0
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None or not tensor.is_meta or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if keep is not None and id(tensor) not in keep:
                continue
            item = tensor.element_size()
            local = tensor.numel() * item
            total += local
            spec = shard_spec(tensor)
            if spec is not None:
                full = item
                for n in spec.full_shape:
                    full *= int(n)
                largest_extra = max(largest_extra, full - local)
    return total + largest_extra


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: str | torch.device = "cpu") -> tuple[int, str] | None:
    """``(bytes, where)``: the memory an allocation on ``device`` can take now, and where
    the figure comes from; None when it is not known (no check is made then)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        found = _meminfo_available()
        return None if found is None else (found, "MemAvailable in /proc/meminfo")
    if dev.type == "cuda" and torch.cuda.is_available():
        try:
            free, _ = torch.cuda.mem_get_info(dev)
        except (RuntimeError, AssertionError, ValueError):
            return None
        return int(free), f"free memory of {dev} (torch.cuda.mem_get_info)"
    return None


def check_fits(need: int, device: str | torch.device, *, primitive: str, what: str,
               values: dict[str, Any], fix: str, path: str | None = None) -> None:
    """Refuse ``need`` bytes that ``device`` does not have available: a
    :class:`ModelConfigError` saying ``what`` needs them, with ``values`` and ``fix``
    (``TORCHLOOM_NO_MEMORY_CHECK=1`` skips this)."""
    if need <= 0 or os.environ.get(NO_CHECK_ENV, "") not in ("", "0"):
        return
    found = available_memory(device)
    if found is None:
        return
    available, where = found
    if need <= available:
        return
    raise ModelConfigError(
        f"{what} needs at least {format_bytes(need)} on {torch.device(device)}, more than "
        f"the {format_bytes(available)} available ({where})",
        path=path, primitive=primitive,
        values={**values, "estimate_bytes": need, "available_bytes": available},
        fix=f"{fix}; or set {NO_CHECK_ENV}=1 to try anyway")


def check_before_build(model: nn.Module, device: str | torch.device,
                       keep: set[int] | None = None, *, primitive: str = "build") -> None:
    """What ``build`` checks before materialising: the config's sizes, and that this
    rank's ``meta`` tensors (``keep``: a pipeline rank's) fit the device's memory."""
    check_model_sizes(model, primitive=primitive)
    need = meta_bytes(model, keep)
    check_fits(need, device, primitive=primitive,
               what="materialising this rank's meta parameters and buffers",
               values={"model": type(model).__name__},
               fix="shard the large tensors over more ranks (a larger tp, or pipeline "
               "stages), use a smaller dtype (model.to(torch.bfloat16) before build), or a "
               "smaller config")
