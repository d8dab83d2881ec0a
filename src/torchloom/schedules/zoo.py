"""Small, randomly initialised transformers models, built from configs written here.

Nothing is downloaded: each model is a Hugging Face transformers class constructed from a
config in code, so tests, examples and the demo run offline. Every model has two sizes:

* ``"tiny"``: 2 layers, hidden size 32; for tests (builds in milliseconds);
* ``"small"``: 4 layers, hidden size 128; the size of the ``torchloom demo`` GPT-2;

and gpt2, bert and llama those of ``torchloom bench``: ``"bench-tiny"`` (its tests),
``"bench"`` (about 13M parameters) and, but for bert, ``"gpu"`` (about 300M).

Text models use a byte-level vocabulary of 256 tokens, matching :mod:`torchloom.apps.data`.

>>> import math
>>> from torchloom.schedules import zoo
>>> zoo.list_models()
['bert', 'gpt2', 'llama', 'opt', 't5', 'vit']
>>> model = zoo.make_model("gpt2", seed=0)
>>> type(model).__name__, model.config.n_layer, model.config.vocab_size
('GPT2LMHeadModel', 2, 256)
>>> inputs = zoo.example_inputs("gpt2", model, batch_size=2, seq_len=8)
>>> sorted(inputs), tuple(inputs["input_ids"].shape)
(['input_ids', 'labels'], (2, 8))
>>> loss = model(**inputs).loss            # about ln(256) = 5.55 at random init
>>> abs(loss.item() - math.log(256)) < 0.5
True
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import UnknownModelError

__all__ = ["SIZES", "example_inputs", "layer_paths", "list_models", "make_model",
           "max_positions"]

SIZES = ("tiny", "small")  # the sizes every model has

# Config keys that a transformers config accepts without holding them as plain attributes.
_EXTRA_KEYS = frozenset({"attn_implementation"})


@dataclass(frozen=True)
class _Entry:
    """How to build one zoo model."""

    config_class: str
    model_class: str
    common: dict[str, Any]
    sizes: dict[str, dict[str, Any]]
    kind: str  # "causal", "masked", "seq2seq" or "image"
    layers: tuple[str, ...]  # schedule paths of the ModuleLists of transformer layers


_ZOO: dict[str, _Entry] = {
    "gpt2": _Entry(
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False},
        {
            "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 128},
            "small": {"n_layer": 4, "n_embd": 128, "n_head": 4, "n_positions": 256},
            "bench-tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64},
            "bench": {"n_layer": 4, "n_embd": 512, "n_head": 8, "n_positions": 256},
            "gpu": {"n_layer": 4, "n_embd": 2048, "n_head": 16, "n_positions": 1024,
                    "vocab_size": 50257},
        },
        "causal",
        ("transformer.h",),
    ),
    "bert": _Entry(
        "BertConfig",
        "BertForMaskedLM",
        {"vocab_size": 256, "pad_token_id": 0, "type_vocab_size": 2},
        {
            "tiny": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                     "intermediate_size": 64, "max_position_embeddings": 128},
            "small": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                      "intermediate_size": 512, "max_position_embeddings": 256},
            "bench-tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
                           "intermediate_size": 256, "max_position_embeddings": 64},
            "bench": {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                      "intermediate_size": 2048, "max_position_embeddings": 256},
        },
        "masked",
        ("bert.encoder.layer",),
    ),
    "llama": _Entry(
        "LlamaConfig",
        "LlamaForCausalLM",
        {"vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
         "use_cache": False},
        {
            "tiny": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "intermediate_size": 64,
                     "max_position_embeddings": 128},
            "small": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                      "num_key_value_heads": 4, "intermediate_size": 384,
                      "max_position_embeddings": 256},
            "bench-tiny": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
                           "num_key_value_heads": 2, "intermediate_size": 172,
                           "max_position_embeddings": 64},
            "bench": {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                      "num_key_value_heads": 8, "intermediate_size": 1376,
                      "max_position_embeddings": 256},
            "gpu": {"num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "intermediate_size": 5504,
                    "max_position_embeddings": 1024, "vocab_size": 32000},
        },
        "causal",
        ("model.layers",),
    ),
    "t5": _Entry(
        "T5Config",
        "T5ForConditionalGeneration",
        {"vocab_size": 256, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
         "use_cache": False},
        {
            "tiny": {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_kv": 16,
                     "d_ff": 64, "num_heads": 2},
            "small": {"num_layers": 4, "num_decoder_layers": 4, "d_model": 128, "d_kv": 32,
                      "d_ff": 512, "num_heads": 4},
        },
        "seq2seq",
        ("encoder.block", "decoder.block"),
    ),
    "opt": _Entry(
        "OPTConfig",
        "OPTForCausalLM",
        {"vocab_size": 256, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
         "use_cache": False},
        {
            "tiny": {"num_hidden_layers": 2, "hidden_size": 32, "word_embed_proj_dim": 32,
                     "num_attention_heads": 2, "ffn_dim": 64, "max_position_embeddings": 128},
            "small": {"num_hidden_layers": 4, "hidden_size": 128, "word_embed_proj_dim": 128,
                      "num_attention_heads": 4, "ffn_dim": 512, "max_position_embeddings": 256},
        },
        "causal",
        ("model.decoder.layers",),
    ),
    "vit": _Entry(
        "ViTConfig",
        "ViTForImageClassification",
        {"num_channels": 3, "num_labels": 10},
        {
            "tiny": {"image_size": 32, "patch_size": 8, "num_hidden_layers": 2,
                     "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
            "small": {"image_size": 32, "patch_size": 4, "num_hidden_layers": 4,
                      "hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512},
        },
        "image",
        ("vit.layers",),
    ),
}


def list_models(size: str | None = None, *, text: bool = False) -> list[str]:
    """The names :func:`make_model` knows (at ``size``, when given; with ``text`` only
    those that take tokens, not images), sorted.

    >>> list_models("gpu"), "vit" in list_models(text=True)
    (['gpt2', 'llama'], False)
    """
    return sorted(name for name, entry in _ZOO.items()
                  if (size is None or size in entry.sizes) and not (text and entry.kind == "image"))


def layer_paths(name: str) -> list[str]:
    """The schedule paths of the model's ``ModuleList`` s of transformer layers.

    >>> layer_paths("t5")
    ['encoder.block', 'decoder.block']
    """
    return list(_entry(name, "layer_paths").layers)


def _entry(name: str, primitive: str) -> _Entry:
    if name not in _ZOO:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(list_models())}",
            primitive=primitive,
            values={"name": name},
            fix=f"pick one of: {', '.join(list_models())}",
        )
    return _ZOO[name]


def _transformers_class(name: str) -> Any:
    return getattr(importlib.import_module("transformers"), name)


def make_model(name: str, size: str = "tiny", *, seed: int | None = None,
               **overrides: Any) -> nn.Module:
    """Build a randomly initialised transformers model of the zoo.

    Args:
        name: one of :func:`list_models`.
        size: ``"tiny"`` (tests), ``"small"`` (the demo) or a bench size (module docstring).
        seed: when given, initialise the weights from this seed without touching the global
            random state; otherwise the global torch generator is used.
        **overrides: config fields that replace the zoo's values, e.g. ``n_layer=1`` or
            ``attn_implementation="eager"``. An unknown field is an error.

    Returns:
        The model, in training mode.

    Raises:
        ScheduleError: unknown name, size or config field.
    """
    entry = _entry(name, "make_model")
    if size not in entry.sizes:
        raise UnknownModelError(
            f"unknown size {size!r}; sizes: {', '.join(entry.sizes)}",
            primitive="make_model",
            values={"name": name, "size": size},
            fix=f"make_model({name!r}, size='tiny')",
        )
    config_class = _transformers_class(entry.config_class)
    defaults = config_class()
    unknown = sorted(k for k in overrides if k not in _EXTRA_KEYS and not hasattr(defaults, k))
    if unknown:
        raise UnknownModelError(
            f"{entry.config_class} has no field {unknown[0]!r}",
            primitive="make_model",
            values={"name": name, "unknown": unknown},
            fix=f"use a field of transformers.{entry.config_class}, "
            f"e.g. make_model({name!r}, **{entry.sizes[size]!r})",
        )
    config = config_class(**{**entry.common, **entry.sizes[size], **overrides})
    model_class = _transformers_class(entry.model_class)
    if seed is None:
        model = model_class(config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config)
    if entry.kind == "causal" and getattr(model, "loss_type", None) is None:
        # GPT2LMHeadModel's class name does not tell transformers which loss it uses; say it
        # (the loss is the same, this only silences a warning on the first forward).
        model.loss_type = "ForCausalLM"
    return model.train()


def max_positions(name: str, size: str = "tiny") -> tuple[str, int] | None:
    """The config field that bounds a zoo model's sequence length, and its value; None
    for models without one (T5's positions are relative; ViT takes images).

    >>> max_positions("opt"), max_positions("gpt2", "small"), max_positions("t5")
    (('max_position_embeddings', 128), ('n_positions', 256), None)
    """
    entry = _entry(name, "max_positions")
    values = {**entry.common, **entry.sizes.get(size, {})}
    for key in ("n_positions", "max_position_embeddings"):
        if key in values and entry.kind != "image":
            return key, int(values[key])
    return None


def example_inputs(name: str, model: nn.Module, batch_size: int = 2, seq_len: int = 16,
                   seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword arguments for one training forward of a zoo model, loss included.

    Text models get random token ids in ``input_ids`` and ``labels`` equal to them
    (transformers causal LMs shift the labels themselves); T5 gets ``labels`` from which
    it derives its decoder inputs; ViT gets ``pixel_values`` of the configured image size
    (``seq_len`` is ignored) and class ``labels``.

    Args:
        name: the zoo name ``model`` was made with.
        model: the model (its config gives the vocabulary and image sizes).
        batch_size, seq_len: the input shape.
        seed: the inputs are drawn from a generator seeded with this.
    """
    entry = _entry(name, "example_inputs")
    config: Any = model.config  # a transformers config (typed Tensor | Module by nn.Module)
    generator = torch.Generator().manual_seed(seed)
    if entry.kind == "image":
        pixels = torch.randn(batch_size, config.num_channels, config.image_size,
                             config.image_size, generator=generator)
        labels = torch.randint(0, config.num_labels, (batch_size,), generator=generator)
        return {"pixel_values": pixels, "labels": labels}
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    if entry.kind == "seq2seq":
        labels = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
        return {"input_ids": ids, "labels": labels}
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if entry.kind == "masked":
        inputs["attention_mask"] = torch.ones_like(ids)
    return inputs
