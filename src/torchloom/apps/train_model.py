"""The model and the data of a ``torchloom train`` run: the tokens (:func:`load_data`),
the model made from ``--model`` on ``meta`` or for real (:func:`meta_model`,
:func:`make_model`), where its weights come from, and how the run's banner describes the
model, its schedule and its layout.

>>> from torchloom.apps.jobconfig import TrainConfig
>>> layout_text(TrainConfig(tp=2, dp=2, batch_size=8, grad_accum=2))
'tp2 x dp2 (ddp), 8 sequences a step = 2 ranks x 2 micro-steps x 2'
"""


from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import schedules
from ..core.errors import ScheduleError
from ..core.rules import layer_stacks
from ..runtime.materialise import init_empty_weights
from ..runtime.model_check import check_config_sizes
from ..schedules import zoo
from ..tools import usercode
from . import chat_data, data
from .jobconfig import TrainConfig, TrainOptionError

__all__ = ["Corpus", "count_parameters", "layer_lists", "layout_text", "load_data", "make_model",
           "meta_model", "schedule_source", "weights_folder", "weights_source"]

_PRIMITIVE = "torchloom train"


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Corpus:
    """The tokens of a run: ``train`` and (with evaluation) ``held_out``."""

    train: torch.Tensor
    held_out: torch.Tensor | None
    tokenizer: str | None
    """The folder whose tokenizer made the tokens (None: bytes)."""
    description: str
    largest: int | None = None
    """The largest token id, when known without reading the tokens again (``--data``)."""
    examples: Any = None
    """Instruction or chat examples (``--data`` of ``.jsonl`` files:
    :class:`~torchloom.apps.chat_data.ExampleCorpus`); ``train`` is then empty."""
    held_out_examples: Any = None
    """With examples and evaluation: the held-out rows (the last ``eval_fraction``)."""


def load_data(cfg: TrainConfig) -> Corpus:
    """The run's tokens (cached per process; see :mod:`torchloom.apps.data`)."""
    folder = cfg.model if cfg.model_kind == "folder" and data.has_tokenizer(cfg.model) else None
    largest = None
    if cfg.data and chat_data.is_example_data(cfg.data):
        examples = _examples(tuple(cfg.data), folder, cfg.seq_len, cfg.pack)
        held = None
        text = examples.description
        if cfg.eval_every:
            examples, held = chat_data.split_rows(examples, cfg.eval_fraction)
            text += f"; {len(held.rows):,} rows held out for evaluation"
        return Corpus(torch.empty(0, dtype=torch.int64), None, folder, text,
                      examples.largest, examples, held)
    if cfg.pack:
        raise data.DataError(
            "--pack packs instruction or chat examples, and --data is not .jsonl examples",
            primitive=_PRIMITIVE, values={"data": list(cfg.data), "pack": True},
            fix="--data train.jsonl --pack (one JSON example a line), or leave --pack out")
    if cfg.data:
        info = data.token_info(tuple(cfg.data), folder)
        tokens, largest, files = info.tokens, info.largest, info.files
        what = f"{files} file{'s' if files != 1 else ''}"
    else:
        folder = None
        tokens = data.load_corpus()
        what = "Python's standard-library source"
    unit = "tokens (the model folder's tokenizer)" if folder else "tokens (bytes)"
    if cfg.eval_every:
        train, held_out = data.split(tokens, cfg.eval_fraction)
        text = (f"{what}: {tokens.numel():,} {unit}, {held_out.numel():,} held out "
                f"for evaluation")
    else:
        train, held_out = tokens, None
        text = f"{what}: {tokens.numel():,} {unit}"
    return Corpus(train, held_out, folder, text, largest)


@functools.lru_cache(maxsize=2)
def _examples(paths: tuple[str, ...], folder: str | None, seq_len: int, pack: bool) -> Any:
    """The examples of ``paths`` (cached per process: the checks and the run share them)."""
    return chat_data.load_examples(paths, folder, seq_len, pack=pack)


def _eval_count(cfg: TrainConfig, corpus: Corpus) -> int:
    """Evaluation batches that fit the held-out tokens (examples: that hold the held-out
    rows, the last one padded with empty rows)."""
    if corpus.held_out_examples is not None:
        rows = len(corpus.held_out_examples.rows)
        return min(cfg.eval_batches, -(-rows // cfg.batch_size))
    assert corpus.held_out is not None
    windows = corpus.held_out.numel() // cfg.seq_len
    return min(cfg.eval_batches, windows // cfg.batch_size)


def _check_data(cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
    if corpus.examples is not None and cfg.cp > 1:
        raise data.DataError(
            f"--cp {cfg.cp} splits token windows along the sequence; .jsonl examples (masked "
            "labels, a loss over the response tokens) are not split yet", primitive=_PRIMITIVE,
            values={"data": list(cfg.data), "cp": cfg.cp},
            fix="train examples with --tp / --dp / --pp")
    if corpus.examples is None and corpus.train.numel() <= cfg.seq_len:
        raise data.DataError(
            f"the training text holds {corpus.train.numel():,} tokens, not more than one "
            f"window of --seq-len {cfg.seq_len}", primitive=_PRIMITIVE,
            values={"data": list(cfg.data), "tokens": corpus.train.numel(),
                    "seq_len": cfg.seq_len},
            fix="add text, or use a shorter --seq-len")
    if corpus.examples is None and corpus.held_out is not None and \
            _eval_count(cfg, corpus) < 1:
        need = cfg.batch_size * cfg.seq_len
        raise data.DataError(
            f"the held-out split holds {corpus.held_out.numel():,} tokens, fewer than one "
            f"evaluation batch of --batch-size {cfg.batch_size} x --seq-len {cfg.seq_len} = "
            f"{need:,}", primitive=_PRIMITIVE,
            values={"eval_fraction": cfg.eval_fraction, "held_out": corpus.held_out.numel()},
            fix="raise --eval-fraction, add text, or lower --batch-size / --seq-len")
    if corpus.largest is not None:  # --data: recorded while the token file was written
        largest = max(corpus.largest, 0)
    else:
        largest = int(corpus.train.max()) if corpus.train.numel() else 0
        if corpus.held_out is not None and corpus.held_out.numel():
            largest = max(largest, int(corpus.held_out.max()))
    if largest >= vocab_size:
        source = "the model folder's tokenizer" if corpus.tokenizer else "bytes"
        raise data.DataError(
            f"the text has token id {largest}, but the model's vocabulary has {vocab_size} "
            f"entries (tokens: {source})", primitive=_PRIMITIVE,
            values={"model": cfg.model, "vocab_size": vocab_size, "largest_token": largest},
            fix="use the tokenizer the model was trained with (in its folder), or a model "
            f"with vocab_size > {largest}")


# --------------------------------------------------------------------------- the model


def _hf_config(cfg: TrainConfig) -> Any:
    """The transformers config of a folder or config-file model."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(cfg.model, local_files_only=True,
                                                         trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a user's file
        raise TrainOptionError(
            f"--model {cfg.model!r}: the config does not load: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}", primitive=_PRIMITIVE,
            values={"model": cfg.model},
            fix="pass a folder written by save_pretrained, or a config.json of a "
            "transformers model (model_type set)") from None
    source = os.path.join(cfg.model, "config.json") if cfg.model_kind == "folder" else cfg.model
    check_config_sizes(config, source=source, primitive=_PRIMITIVE)
    return config


def _from_config(cfg: TrainConfig, config: Any) -> nn.Module:
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise TrainOptionError(
            f"--model {cfg.model!r}: {type(config).__name__} is not a causal language "
            f"model transformers can build ({str(exc).splitlines()[0]})",
            primitive=_PRIMITIVE, values={"model": cfg.model,
                                          "model_type": getattr(config, "model_type", None)},
            fix="train a causal LM (gpt2, llama, opt, ...): AutoModelForCausalLM must know "
            "its config") from None
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model.train()


def meta_model(cfg: TrainConfig) -> nn.Module:
    """The run's model on ``meta`` (nothing allocated): for checks, sizes and FLOPs."""
    if cfg.model_kind == "code":
        return usercode.load(cfg.model, meta=True, check=False)
    with init_empty_weights():
        if cfg.model_kind == "zoo":
            return zoo.make_model(cfg.model, cfg.size, seed=cfg.seed,
                                  **_positions(cfg.model, cfg.size, cfg.seq_len))
        return _from_config(cfg, _hf_config(cfg))


def make_model(cfg: TrainConfig, device: torch.device) -> tuple[nn.Module, str | None]:
    """The model to schedule, and the weights folder ``build`` reads (None: initialise).

    A zoo model is real (initialised from ``seed``) and on ``device``; a folder or config
    model is on ``meta`` except its buffers, which are moved to ``device``. A folder with
    no weight files (a ``config.json`` only) is initialised at random, as a config file. A
    code model is what its factory makes after ``torch.manual_seed(seed)``, on ``device``
    (parameters it left on ``meta`` are initialised by ``build``)."""
    if cfg.model_kind == "code":
        torch.manual_seed(cfg.seed)
        model = usercode.load(cfg.model, check=False)
        return (model.to(device) if device.type != "cpu" and not any(
            p.is_meta for p in model.parameters()) else model), None
    if cfg.model_kind == "zoo":
        model = zoo.make_model(cfg.model, cfg.size, seed=cfg.seed,
                               **_positions(cfg.model, cfg.size, cfg.seq_len))
        return (model.to(device) if device.type != "cpu" else model), None
    model = meta_model(cfg)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)
    return model, weights_folder(cfg)


def weights_folder(cfg: TrainConfig) -> str | None:
    """The folder ``build`` reads the weights from: ``--model`` when it is a folder holding
    weight files, else None (random initialisation)."""
    from ..runtime.weights import weight_listing

    if cfg.model_kind == "folder" and weight_listing(cfg.model) is not None:
        return cfg.model
    return None


def weights_source(cfg: TrainConfig) -> str:
    """Where the run's weights come from, for the banner: ``"weights: FOLDER (N tensors)"``
    or ``"random init"`` (a zoo model, a config, a folder without weight files)."""
    if cfg.model_kind == "code":
        return f"made by {cfg.model}, seed {cfg.seed}"
    folder = weights_folder(cfg)
    if folder is None:
        return "random init"
    from ..runtime.weights import open_weights

    with open_weights(folder, _PRIMITIVE) as source:
        count = len(source.files)
    return f"weights: {folder} ({count} tensors)"


def layout_text(cfg: TrainConfig) -> str:
    """How the run spreads a step, for the banner: the degrees and the batch rule.

    >>> layout_text(TrainConfig(tp=2, sequence_parallel=True, dp=2, dp_mode="fsdp",
    ...                         batch_size=8, grad_accum=2))
    'tp2+sp x dp2 (fsdp), 8 sequences a step = 2 ranks x 2 micro-steps x 2'
    >>> layout_text(TrainConfig(pp=2, batch_size=8))
    'pp2 (1F1B, 4 micro-batches), 8 sequences a step'
    >>> layout_text(TrainConfig(tp=2, loss="parallel"))
    'tp2, 8 sequences a step, loss parallel'
    """
    parts = []
    if cfg.tp > 1:
        parts.append(f"tp{cfg.tp}{'+sp' if cfg.sequence_parallel else ''}")
    if cfg.cp > 1:
        parts.append(f"cp{cfg.cp}")
    if cfg.ep > 1:
        parts.append(f"ep{cfg.ep}")
    if cfg.pp > 1:
        accum = f" = {cfg.n_microbatches} x {cfg.grad_accum} accumulated" \
            if cfg.grad_accum > 1 else ""
        per_rank = cfg.layout().per_rank
        virtual = f", {per_rank} stages a rank" if per_rank > 1 else ""
        parts.append(f"pp{cfg.pp} ({cfg.pipeline_schedule}, {cfg.n_microbatches * cfg.grad_accum} "
                     f"micro-batches{accum}{virtual})")
    if cfg.dp > 1:
        mode = (f"hsdp: {cfg.dp_replicate} replicas x {cfg.dp // cfg.dp_replicate} shards"
                if cfg.dp_mode == "hsdp" else cfg.dp_mode)
        parts.append(f"dp{cfg.dp} ({mode})")
    text = " x ".join(parts) or "one rank"
    text += f", {cfg.batch_size} sequences a step"
    if cfg.pp == 1 and (cfg.dp > 1 or cfg.grad_accum > 1):
        text += (f" = {_plural_text(cfg.dp, 'rank')} x {_plural_text(cfg.grad_accum, 'micro-step')}"
                 f" x {cfg.micro_batch()}")
    if cfg.loss != "chunked":  # the default is not named
        text += f", loss {cfg.loss}"
    if cfg.float8:
        text += ", float8"
    return text


def _plural_text(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def schedule_source(model: nn.Module) -> str:
    """Where the run's schedule comes from, for the banner: a built-in schedule, one derived
    from transformers' tensor-parallel plan, or the automatic checkpoint/compile schedule of
    the model's stacks of layers."""
    model = usercode.inner_module(model)
    try:
        fn = schedules.schedule_for(model)
    except ScheduleError:
        return "no schedule (the model has no stack of layers)"
    if fn is schedules.schedule_hf_plan:
        return f"derived from transformers' tensor-parallel plan of {type(model).__name__}"
    if fn is schedules.schedule_layers:
        return "automatic (checkpoint and compile of the layer stacks)"
    return f"built-in {fn.__name__}"


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model`` (tied ones once; works on ``meta``)."""
    return sum(p.numel() for p in model.parameters())


def layer_lists(model: nn.Module, name: str | None = None) -> list[str]:
    """The paths of the model's stacks of layers: the zoo's for a zoo ``name``, else
    :func:`~torchloom.core.rules.layer_stacks`.

    >>> layer_lists(zoo.make_model("llama"))
    ['model.layers']
    """
    if name is not None and name in zoo.list_models():
        return zoo.layer_paths(name)
    return layer_stacks(model)


def _has_builtin_schedule(model: nn.Module, knob: str | None = None) -> bool:
    """Whether ``model`` has a schedule (built-in, derived or automatic) that takes
    ``knob`` (any schedule when None); for a user's module wrapped in a
    :class:`~torchloom.tools.usercode.TokenLM`, the schedule of the module itself."""
    try:
        fn = schedules.schedule_for(usercode.inner_module(model))
    except ScheduleError:
        return False
    return knob is None or knob in getattr(fn, "knobs", (knob,))


_GROWN = frozenset({"gpt2", "bert", "llama"})
"""Models whose position table ``torchloom train`` lengthens to ``--seq-len``."""


def _positions(model: str, size: str, seq_len: int) -> dict[str, int]:
    """Config overrides for sequences of ``seq_len`` tokens: the position table of gpt2,
    bert and llama grows to fit; other models refuse a sequence longer than theirs."""
    found = zoo.max_positions(model, size)
    if found is None:
        return {}
    key, limit = found
    if model in _GROWN:
        return {key: max(limit, seq_len)}
    if seq_len > limit:
        raise TrainOptionError(
            f"--seq-len {seq_len} is longer than the {limit} positions of {model} ({size}): "
            f"config field {key} = {limit}",
            primitive=_PRIMITIVE,
            values={"model": model, "size": size, "seq_len": seq_len, key: limit},
            fix=f"torchloom train --model {model} --size {size} --seq-len {limit}")
    return {}


def _hf_positions(cfg: TrainConfig, config: Any) -> None:
    for key in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and cfg.seq_len > limit:
            raise TrainOptionError(
                f"--seq-len {cfg.seq_len} is longer than the {limit} positions of "
                f"{cfg.model}: config field {key} = {limit}", primitive=_PRIMITIVE,
                values={"model": cfg.model, "seq_len": cfg.seq_len, key: limit},
                fix=f"--seq-len {limit}")


def _text_models() -> list[str]:
    return [m for m in zoo.list_models() if zoo._entry(m, _PRIMITIVE).kind != "image"]


