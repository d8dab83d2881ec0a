"""Which model to plan: a zoo name, a transformers config file or folder, a model class
with its config, or a user's factory returning a transformers model
(:func:`code_spec`), always built on ``meta`` (nothing allocated) at any depth.

The planner measures a model shortened to a few layers and scales by the real layer count,
so a :class:`ModelSpec` keeps the config and can build the model with another number of
layers (:meth:`ModelSpec.build`). Supported: models with one stack of transformer layers
that take token ids (causal LMs such as GPT-2, Llama, OPT and every
``AutoModelForCausalLM`` config; BERT's masked LM).

>>> spec = model_spec("llama", seq_len=512)
>>> spec.name, spec.layers, spec.num_layers, spec.kind
('llama', 'model.layers', 2, 'causal')
>>> model = spec.build(depth=4)
>>> len(model.model.layers), next(model.parameters()).device.type
(4, 'meta')
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import PlanError
from ..runtime.materialise import init_empty_weights
from ..schedules import zoo

__all__ = ["ModelSpec", "code_spec", "model_spec", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_GROWN = frozenset({"gpt2", "bert", "llama"})  # zoo models whose positions grow (as train)
_PRIMITIVE = "plan"


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan.

    Attributes:
        name: how it was named (zoo name, path, or class name).
        config: its transformers config (full depth).
        model_class: the class built from the config.
        layers: the path of its ``nn.ModuleList`` of layers.
        kind: ``"causal"`` (labels are the inputs, shifted by the model) or ``"masked"``.
        command: the ``--model`` value that ``torchloom train`` takes, or None.
        size: the zoo size (zoo models), for the train command.
    """

    name: str
    config: Any
    model_class: type
    layers: str
    kind: str
    command: str | None = None
    size: str | None = None

    @property
    def num_layers(self) -> int:
        """The number of layers of the full model."""
        return int(self.config.num_hidden_layers)

    def attr(self, *names: str, default: Any = None) -> Any:
        """The first config field of ``names`` that is set."""
        for n in names:
            v = getattr(self.config, n, None)
            if v is not None:
                return v
        return default

    @property
    def heads(self) -> int:
        return int(self.attr("num_attention_heads", "n_head"))

    @property
    def kv_heads(self) -> int:
        return int(self.attr("num_key_value_heads", default=self.heads))

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def build(self, depth: int | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model on ``meta`` with ``depth`` layers (default: all), in ``dtype``,
        in training mode."""
        config = copy.deepcopy(self.config)
        if depth is not None:
            config.num_hidden_layers = depth
        with init_empty_weights(include_buffers=False):
            model = self.model_class(config)
        if getattr(model, "loss_type", None) is None and self.kind == "causal":
            model.loss_type = "ForCausalLM"
        if dtype != torch.float32:
            model = model.to(dtype)
        return model.train()

    def inputs(self, batch: int, seq_len: int, device: str = "meta",
               labels: bool = True) -> dict[str, torch.Tensor]:
        """Keyword inputs of one training forward (token ids; labels equal to them)."""
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        out = {"input_ids": ids}
        if labels:
            out["labels"] = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        if self.kind == "masked":
            out["attention_mask"] = torch.ones(batch, seq_len, dtype=torch.long, device=device)
        return out


def _layer_path(model: nn.Module, name: str) -> str:
    found: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and \
                not any(path.startswith(f + ".") for f in found):
            found.append(path)
    if len(found) != 1:
        raise PlanError(
            f"{name}: the planner needs one stack of transformer layers, and this model has "
            f"{len(found)} ({', '.join(found) or 'none'})", primitive=_PRIMITIVE,
            values={"model": name, "layer_lists": found},
            fix="plan a decoder-only or encoder-only model (gpt2, llama, opt, bert, or a "
            "causal LM config)")
    return found[0]


def _zoo_spec(name: str, size: str, seq_len: int | None) -> ModelSpec:
    entry = zoo._entry(name, _PRIMITIVE)
    if entry.kind not in ("causal", "masked"):
        raise PlanError(
            f"{name} is not a model the planner takes ({entry.kind}): it plans models that "
            "take token ids and have one stack of layers", primitive=_PRIMITIVE,
            values={"model": name, "kind": entry.kind},
            fix="plan gpt2, llama, opt or bert, or a causal LM config file")
    overrides: dict[str, Any] = {}
    found = zoo.max_positions(name, size)
    if found is not None and seq_len is not None:
        key, limit = found
        if name in _GROWN:
            overrides[key] = max(limit, seq_len)
        elif seq_len > limit:
            raise PlanError(
                f"a sequence of {seq_len} tokens is longer than the {limit} positions of "
                f"{name} ({size})", primitive=_PRIMITIVE,
                values={"model": name, "seq_len": seq_len, key: limit},
                fix=f"--seq-len {limit}")
    with init_empty_weights():
        model = zoo.make_model(name, size, **overrides)
    return ModelSpec(name, model.config, type(model), zoo.layer_paths(name)[0], entry.kind,
                     command=name, size=size)


def _check_positions(config: Any, name: str, seq_len: int | None) -> None:
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and seq_len is not None and seq_len > limit:
            raise PlanError(
                f"a sequence of {seq_len} tokens is longer than the {limit} positions of "
                f"{name}: config field {key} = {limit}", primitive=_PRIMITIVE,
                values={"model": name, "seq_len": seq_len, key: limit},
                fix=f"--seq-len {limit}")


def code_spec(text: str, seq_len: int | None = None) -> ModelSpec:
    """The :class:`ModelSpec` of a user's model named as ``path/to/file.py:factory`` (see
    :mod:`torchloom.tools.usercode`): the file is imported and the factory called under
    :func:`~torchloom.init_empty_weights` (this runs the file's code: name only files you
    trust). The planner rebuilds a model at other depths from its transformers config, so
    the factory must return a transformers causal LM; a plain ``nn.Module`` (which ``torchloom
    train`` and ``verify`` take) has no config to rebuild it from and is refused, naming
    what the planner needs."""
    from ..tools import usercode

    made = usercode.load(text, meta=True, seq_len=seq_len or 16, error=PlanError,
                         primitive=_PRIMITIVE, flag="MODEL")
    if isinstance(made, usercode.TokenLM):
        inner = usercode.inner_module(made)
        raise PlanError(
            f"{text}: the factory returned a {type(inner).__name__}, a module without a "
            "transformers config; the planner rebuilds a model at a few depths from its "
            "config (num_hidden_layers, the attention heads, the hidden size, vocab_size) "
            "and scales by the layer count, so it plans transformers models only",
            primitive=_PRIMITIVE, values={"model": text, "class": type(inner).__name__},
            fix="plan a transformers config of the same shape (e.g. GPT2Config(n_layer=..., "
            "n_embd=..., n_head=..., vocab_size=...) saved as config.json), or return that "
            "transformers model from the factory; torchloom train and verify take the "
            "module as it is")
    config: Any = made.config
    _check_positions(config, text, seq_len)
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise PlanError(
            f"{text}: {type(config).__name__} has no num_hidden_layers: the planner rebuilds "
            "the model at a few depths", primitive=_PRIMITIVE,
            values={"model": text, "config": type(config).__name__},
            fix="return a decoder-only causal LM (gpt2, llama, opt, qwen2, ...) from the "
            "factory")
    with init_empty_weights():
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = 1
        model = type(made)(shallow)
    return ModelSpec(text, config, type(made), _layer_path(model, text), "causal",
                     command=text)


def _config_spec(path: str, seq_len: int | None) -> ModelSpec:
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a user's file
        raise PlanError(
            f"the config at {path!r} does not load: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}", primitive=_PRIMITIVE,
            values={"model": path},
            fix="pass a zoo name (gpt2, llama, opt, bert), a folder written by "
            "save_pretrained, or a config.json of a transformers model") from None
    classes = transformers.AutoModelForCausalLM._model_mapping
    try:
        model_class: Any = classes[type(config)]
    except KeyError:
        raise PlanError(
            f"{type(config).__name__} is not a causal language model transformers can build",
            primitive=_PRIMITIVE, values={"model": path,
                                          "model_type": getattr(config, "model_type", None)},
            fix="plan a causal LM config (gpt2, llama, opt, qwen2, mistral, ...)") from None
    _check_positions(config, path, seq_len)
    with init_empty_weights():
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = 1
        model = model_class(shallow)
    return ModelSpec(path, config, model_class, _layer_path(model, path), "causal",
                     command=path)


def model_spec(model: Any, size: str = "tiny", seq_len: int | None = None,
               config: Any = None) -> ModelSpec:
    """The :class:`ModelSpec` of ``model``: a zoo name (with ``size``), a path to a
    ``config.json`` or a folder holding one, a transformers model class (with ``config``),
    or a :class:`ModelSpec` (returned as is). ``seq_len`` grows the position table of the
    zoo's gpt2, bert and llama (as ``torchloom train`` does) and is checked against the
    others'."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, type) and issubclass(model, nn.Module):
        if config is None:
            raise PlanError("a model class needs its config", primitive=_PRIMITIVE,
                            values={"model": model.__name__},
                            fix=f"plan({model.__name__}, config=...)")
        with init_empty_weights():
            shallow = copy.deepcopy(config)
            shallow.num_hidden_layers = 1
            built = model(shallow)
        kind = "masked" if "MaskedLM" in model.__name__ else "causal"
        return ModelSpec(model.__name__, config, model, _layer_path(built, model.__name__),
                         kind)
    if isinstance(model, str):
        from ..tools.usercode import looks_like_code

        if looks_like_code(model):
            raise PlanError(
                f"{model!r} names Python code: model_spec does not import files named by a "
                "string", primitive=_PRIMITIVE, values={"model": model},
                fix=f"torchloom plan {model} on the command line, or in Python: "
                f"model_spec(code_spec({model!r}))")
        if model in zoo.list_models():
            return _zoo_spec(model, size, seq_len)
        if os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".json")):
            return _config_spec(model, seq_len)
    raise PlanError(
        f"unknown model {model!r}: not a zoo name, a config.json or a folder with one",
        primitive=_PRIMITIVE, values={"model": repr(model), "zoo": zoo.list_models()},
        fix="plan gpt2 (a zoo name), path/to/config.json, or path/to/model_folder")
