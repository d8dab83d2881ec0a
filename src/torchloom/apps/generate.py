"""See what a (fine-tuned) model answers: load a model folder or a peft LoRA adapter folder
offline, turn a prompt into token ids, and decode greedily or by seeded sampling.

The decoding loop, :func:`generate_ids`, keeps no KV cache: each step runs ``logits_fn``
on the whole sequence so far and picks the next token from the last position's logits.
That is slower than transformers' ``generate`` (quadratic in the length) but needs nothing
of the model except "ids in, logits out", so it also drives a scheduled, tensor-parallel or
pipelined model: every rank calls ``logits_fn`` together, a rank that holds no logits
returns ``None``, and ``share`` hands every rank the token the holding rank chose.

Without a tokenizer a token is a byte (vocabulary 256), as ``torchloom train`` reads text
without one:

>>> import torch
>>> def next_byte(ids):            # a "model" whose logits favour the byte after the last
...     return torch.nn.functional.one_hot((ids + 1) % 256, 256).float()
>>> prompt = render_prompt(None, "a")
>>> prompt.tolist()
[[97]]
>>> decode(None, generate_ids(next_byte, prompt, max_new_tokens=3))
'bcd'
>>> generate_ids(next_byte, prompt, max_new_tokens=5, eos_id=ord("c")).tolist()  # eos kept
[[98, 99]]
>>> a = generate_ids(next_byte, prompt, max_new_tokens=4, temperature=50.0, seed=1)
>>> bool((a == generate_ids(next_byte, prompt, max_new_tokens=4, temperature=50.0,
...                          seed=1)).all())                       # sampling: seeded
True

:func:`load_for_generation` reads either a transformers model folder (``config.json`` and
weights, ``save_pretrained`` output) or a peft adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``, ``PeftModel.save_pretrained`` output) whose base model is a
local folder; nothing is ever downloaded and no code from the folders is run.
:func:`answer` renders a prompt (the tokenizer's chat template where it has one), generates
and decodes; ``torchloom generate FOLDER --prompt ...`` is its command line.

Problems are :class:`~torchloom.core.errors.CliOptionError` s naming what was wrong, the
values and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import CliOptionError, DataError
from .data import has_tokenizer, load_tokenizer

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "BYTE_VOCAB", "GenerationSource", "answer",
           "decode", "generate_ids", "load_for_generation", "render_prompt",
           "resolve_folder"]

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a folder a peft adapter folder."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The adapter weights read (peft's pickle ``adapter_model.bin`` is refused)."""
BYTE_VOCAB = 256
"""Vocabulary of the byte tokens used without a tokenizer."""
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
"""A larger ``adapter_config.json`` is refused unread."""

_FOLDER_FIX = ("pass a folder written by save_pretrained (config.json + weights) or a peft "
               f"adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")


def _base_fix(adapter: str) -> str:
    return (f"pass the base model's local folder: torchloom generate {adapter} --base FOLDER "
            f"(or load_for_generation({adapter!r}, base=FOLDER))")


# --------------------------------------------------------------------------- folders


@dataclass(frozen=True)
class GenerationSource:
    """What :func:`load_for_generation` loads from a folder.

    Attributes:
        model_folder: the transformers model folder (the base model of an adapter).
        adapter_folder: the peft adapter folder, or None for a plain model folder.
        tokenizer_folder: the folder whose tokenizer is used (the adapter's own, else the
            model folder's), or None: bytes.
    """

    model_folder: str
    adapter_folder: str | None
    tokenizer_folder: str | None


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _check_model_folder(path: str, *, role: str, given: dict[str, Any], fix: str) -> None:
    """``path`` is a directory holding ``config.json`` and no adapter (which transformers
    would otherwise load, and whose base it would look up, by itself)."""
    if not os.path.isdir(path):
        raise CliOptionError(f"the {role} is not a folder", primitive="load_for_generation",
                             values=given, fix=fix)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CliOptionError(f"the {role} has no config.json (not a transformers model "
                             "folder)", primitive="load_for_generation",
                             values={**given, "files": sorted(os.listdir(path))[:10]},
                             fix=fix)
    if os.path.exists(os.path.join(path, ADAPTER_CONFIG)):
        raise CliOptionError(f"the {role} holds a peft adapter ({ADAPTER_CONFIG}) itself",
                             primitive="load_for_generation", values=given,
                             fix="give the base model's own folder (config.json + weights, "
                             "no adapter_config.json)")


def _read_adapter_config(folder: str) -> dict[str, Any]:
    """``adapter_config.json`` of ``folder``, read as untrusted JSON and checked."""
    path = os.path.join(folder, ADAPTER_CONFIG)
    fix = f"write the adapter again with PeftModel.save_pretrained({folder!r})"
    try:
        size = os.path.getsize(path)
        if size > MAX_ADAPTER_CONFIG_BYTES:
            raise CliOptionError(f"{ADAPTER_CONFIG} is too large to be an adapter config",
                                 primitive="load_for_generation",
                                 values={"file": path, "bytes": size,
                                         "limit": MAX_ADAPTER_CONFIG_BYTES}, fix=fix)
        with open(path, "rb") as f:
            config = json.loads(f.read(MAX_ADAPTER_CONFIG_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise CliOptionError(f"{ADAPTER_CONFIG} is not readable JSON: {_first_line(exc)}",
                             primitive="load_for_generation", values={"file": path},
                             fix=fix) from None
    if not isinstance(config, dict):
        raise CliOptionError(f"{ADAPTER_CONFIG} is not a JSON object",
                             primitive="load_for_generation",
                             values={"file": path, "type": type(config).__name__}, fix=fix)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise CliOptionError(f"{ADAPTER_CONFIG} is not a LoRA adapter's config",
                             primitive="load_for_generation",
                             values={"file": path, "peft_type": peft_type},
                             fix="pass a LoRA adapter folder (peft_type \"LORA\")")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise CliOptionError("the adapter is not one of a causal language model",
                             primitive="load_for_generation",
                             values={"file": path, "task_type": config.get("task_type")},
                             fix="pass an adapter trained on a causal LM (task_type "
                             "\"CAUSAL_LM\" or null)")
    if config.get("megatron_config") is not None:  # peft would import a module it names
        raise CliOptionError("Megatron LoRA adapters are not supported",
                             primitive="load_for_generation",
                             values={"file": path, "megatron_core": config.get("megatron_core")},
                             fix="save the adapter from a transformers model")
    name = config.get("base_model_name_or_path")
    if name is not None and not isinstance(name, str):
        raise CliOptionError(f"{ADAPTER_CONFIG}: base_model_name_or_path is not a string",
                             primitive="load_for_generation",
                             values={"file": path, "base_model_name_or_path": name},
                             fix=_base_fix(folder))
    return config


def _adapter_base(folder: str, config: dict[str, Any]) -> str:
    """The local base-model folder an adapter's config names: absolute, or relative to the
    adapter folder, else to the working directory. A hub id is refused (never downloaded)."""
    name = config.get("base_model_name_or_path")
    if not name:
        raise CliOptionError(f"{ADAPTER_CONFIG} names no base model (base_model_name_or_path "
                             "is empty)", primitive="load_for_generation",
                             values={"adapter": folder, "base_model_name_or_path": name},
                             fix=_base_fix(folder))
    candidates = [name] if os.path.isabs(name) else [os.path.join(folder, name), name]
    for candidate in candidates:
        if os.path.isdir(candidate):
            return candidate
    raise CliOptionError(
        f"the adapter's base model {name!r} is not a local folder (torchloom generate never "
        "downloads a model)", primitive="load_for_generation",
        values={"adapter": folder, "base_model_name_or_path": name,
                "tried": [os.path.abspath(c) for c in candidates]},
        fix=_base_fix(folder))


def resolve_folder(folder: str, *, base: str | None = None) -> GenerationSource:
    """Which model, adapter and tokenizer folders :func:`load_for_generation` reads for
    ``folder`` (checked; nothing is loaded).

    Raises:
        CliOptionError: ``folder`` is missing or neither kind of folder, an adapter's
            config is not valid JSON or names no local base folder, or ``base`` is given
            for a plain model folder or is not a model folder.
    """
    given = {"folder": folder}
    if not os.path.exists(folder):
        raise CliOptionError("the folder does not exist", primitive="load_for_generation",
                             values=given, fix=_FOLDER_FIX)
    if not os.path.isdir(folder):
        raise CliOptionError("the path is not a folder", primitive="load_for_generation",
                             values=given, fix=_FOLDER_FIX)
    if not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
        if base is not None:
            raise CliOptionError("--base applies to a peft adapter folder only, and the "
                                 f"folder has no {ADAPTER_CONFIG}",
                                 primitive="load_for_generation",
                                 values={"folder": folder, "base": base},
                                 fix="leave out --base to load the model folder itself")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise CliOptionError(f"the folder is neither a model folder (config.json) nor a "
                                 f"peft adapter folder ({ADAPTER_CONFIG})",
                                 primitive="load_for_generation",
                                 values={"folder": folder,
                                         "files": sorted(os.listdir(folder))[:10]},
                                 fix=_FOLDER_FIX)
        return GenerationSource(folder, None, folder if has_tokenizer(folder) else None)
    config = _read_adapter_config(folder)
    if not os.path.isfile(os.path.join(folder, ADAPTER_WEIGHTS)):
        pickled = os.path.isfile(os.path.join(folder, "adapter_model.bin"))
        raise CliOptionError(
            f"the adapter folder has no {ADAPTER_WEIGHTS}"
            + (" (only adapter_model.bin, a pickle, which is not loaded)" if pickled else ""),
            primitive="load_for_generation", values={"folder": folder},
            fix="save the adapter with PeftModel.save_pretrained(folder) (safetensors, "
            "the default)")
    if base is not None:
        model_folder = base
        _check_model_folder(base, role="--base folder", given={"base": base},
                            fix="pass the base model's folder (config.json + weights)")
    else:
        model_folder = _adapter_base(folder, config)
        _check_model_folder(model_folder, role="adapter's base model folder",
                            given={"adapter": folder, "base": model_folder},
                            fix=_base_fix(folder))
    tokens = folder if has_tokenizer(folder) else (
        model_folder if has_tokenizer(model_folder) else None)
    return GenerationSource(model_folder, folder, tokens)


def _device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise CliOptionError("not a torch device", primitive="load_for_generation",
                             values={"device": device}, fix="--device cpu, or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliOptionError("CUDA is not available on this machine",
                             primitive="load_for_generation", values={"device": device},
                             fix="--device cpu")
    return dev


def _load_base(folder: str, dtype: torch.dtype | None) -> nn.Module:
    import transformers

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a user's files
        raise CliOptionError(f"the model folder does not load: {_first_line(exc)}",
                             primitive="load_for_generation", values={"folder": folder},
                             fix="pass a causal LM folder written by save_pretrained "
                             "(config.json + safetensors weights)") from None
    return model


def _load_adapter(base: nn.Module, folder: str, device: torch.device) -> nn.Module:
    import warnings

    try:
        import peft
    except ImportError:
        raise CliOptionError("loading a LoRA adapter needs peft, which is not installed",
                             primitive="load_for_generation", values={"adapter": folder},
                             fix='pip install "torchloom[peft]"') from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = peft.PeftModel.from_pretrained(base, folder, is_trainable=False,
                                                   torch_device=str(device))
        except Exception as exc:  # noqa: BLE001 - a user's files
            raise CliOptionError(f"the adapter does not load on its base model: "
                                 f"{_first_line(exc)}", primitive="load_for_generation",
                                 values={"adapter": folder},
                                 fix="check that the adapter was trained on this base model "
                                 "(--base FOLDER)") from None
    for warning in caught:
        text = str(warning.message)
        if "missing adapter keys" in text:
            raise CliOptionError("the adapter's weights file lacks tensors of its own "
                                 "config", primitive="load_for_generation",
                                 values={"adapter": folder, "peft": text[:300]},
                                 fix="save the adapter again with PeftModel.save_pretrained")
        if not issubclass(warning.category, (FutureWarning, DeprecationWarning)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno)
    return model


def load_for_generation(folder: str, *, device: str = "cpu", dtype: torch.dtype | None = None,
                        base: str | None = None) -> tuple[nn.Module, Any | None]:
    """The model of ``folder`` in eval mode on ``device``, and its tokenizer (None: bytes).

    ``folder`` is either a transformers model folder (``config.json`` + weights), loaded
    with ``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
    trust_remote_code=False)``, or a peft LoRA adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``): its base model, the local folder that
    ``base_model_name_or_path`` names (absolute, or relative to the adapter folder, else to
    the working directory) or ``base`` when given, is loaded as above and the adapter is
    applied with ``peft.PeftModel.from_pretrained``. A base named by a hub id is refused,
    never downloaded. ``dtype`` (e.g. ``torch.bfloat16``) is passed to ``from_pretrained``;
    None keeps transformers' default.

    The tokenizer is the folder's own if it has one, else the base folder's, else None.

    Raises:
        CliOptionError: see :func:`resolve_folder`; also a folder that does not load, an
            adapter that does not fit its base, peft not installed, a bad ``device``.
    """
    source = resolve_folder(folder, base=base)
    dev = _device(device)
    tokenizer = None
    if source.tokenizer_folder is not None:
        try:
            tokenizer = load_tokenizer(source.tokenizer_folder)
        except DataError as exc:
            raise CliOptionError(exc.problem, primitive="load_for_generation",
                                 values={"folder": source.tokenizer_folder},
                                 fix="fix or remove the tokenizer files (then prompts and "
                                 "answers are bytes)") from None
    model = _load_base(source.model_folder, dtype).to(dev)
    if source.adapter_folder is not None:
        model = _load_adapter(model, source.adapter_folder, dev).to(dev)
    return model.eval(), tokenizer


# --------------------------------------------------------------------------- tokens


def _flat_ids(value: Any) -> list[int]:
    """Token ids out of what a tokenizer returns (a list, a nested list, a tensor or a
    ``BatchEncoding``)."""
    if hasattr(value, "keys") and "input_ids" in value:
        value = value["input_ids"]
    if isinstance(value, torch.Tensor):
        return [int(i) for i in value.reshape(-1).tolist()]
    ids = list(value)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise CliOptionError("the tokenizer returned several sequences for one prompt",
                                 primitive="render_prompt", values={"sequences": len(ids)},
                                 fix="use a tokenizer that encodes one text to one sequence")
        ids = list(ids[0])
    return [int(i) for i in ids]


def render_prompt(tokenizer: Any | None, prompt: str, *, chat: bool = True) -> torch.Tensor:
    """The token ids of ``prompt``: ``int64``, shape ``(1, n)``.

    With a tokenizer that has a chat template and ``chat=True``: the template applied to
    one user message, with the generation prompt (the assistant's turn opened); else the
    tokenizer's ids of the text; without a tokenizer: the UTF-8 bytes.

    Raises:
        CliOptionError: the prompt has no tokens.
    """
    if tokenizer is None:
        ids = list(prompt.encode("utf-8"))
    elif chat and getattr(tokenizer, "chat_template", None):
        ids = _flat_ids(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    else:
        ids = _flat_ids(tokenizer(prompt))
    if not ids:
        raise CliOptionError("the prompt has no tokens", primitive="render_prompt",
                             values={"prompt": prompt}, fix="give a non-empty prompt")
    return torch.tensor([ids], dtype=torch.int64)


def decode(tokenizer: Any | None, ids: torch.Tensor) -> str:
    """The text of ``ids`` (any shape): ``tokenizer.decode(..., skip_special_tokens=True)``,
    or without a tokenizer the bytes decoded as UTF-8 (invalid bytes, and ids past 255,
    replaced by U+FFFD)."""
    flat = [int(i) for i in ids.reshape(-1).tolist()]
    if tokenizer is None:  # an id past the bytes (a larger vocabulary) reads as U+FFFD
        data = b"".join(bytes([i]) if 0 <= i < BYTE_VOCAB else "\ufffd".encode()
                        for i in flat)
        return data.decode("utf-8", errors="replace")
    return str(tokenizer.decode(flat, skip_special_tokens=True))


# --------------------------------------------------------------------------- decoding


def _check_decoding(prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float,
                    top_k: int | None, primitive: str) -> None:
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or \
            prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1 or \
            prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex:
        raise CliOptionError("prompt_ids must be an integer tensor of shape (1, n), n >= 1",
                             primitive=primitive,
                             values={"shape": tuple(getattr(prompt_ids, "shape", ())),
                                     "dtype": getattr(prompt_ids, "dtype", None)},
                             fix="render_prompt(tokenizer, text)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise CliOptionError("max_new_tokens must be an integer >= 1", primitive=primitive,
                             values={"max_new_tokens": max_new_tokens},
                             fix="--max-new-tokens 64")
    if not isinstance(temperature, (int, float)) or not temperature >= 0 or \
            temperature == float("inf"):
        raise CliOptionError("temperature must be a finite number >= 0 (0: greedy)",
                             primitive=primitive, values={"temperature": temperature},
                             fix="--temperature 0 (greedy) or --temperature 0.8 (sampling)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise CliOptionError("top_k must be an integer >= 1 (or not given: all tokens)",
                             primitive=primitive, values={"top_k": top_k},
                             fix="--top-k 50, or leave it out")


def _choose(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> int:
    """The next token from the last position's logits (a 1-D tensor)."""
    if temperature == 0 or generator is None:
        return int(torch.argmax(logits))
    scores = logits.detach().float().cpu() / temperature
    if top_k is not None and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(logits_fn: Callable[[torch.Tensor], torch.Tensor | None],
                 prompt_ids: torch.Tensor, *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0,
                 eos_id: int | Collection[int] | None = None,
                 share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """New token ids after ``prompt_ids`` (``(1, n)``), shape ``(1, k)``, ``k <=
    max_new_tokens``, on the prompt's device.

    A plain loop without a KV cache: each step calls ``logits_fn`` on the whole sequence so
    far (``(1, n + i)`` ids) and takes the next token from the last position of the
    ``(1, n + i, vocab)`` logits it returns: the most likely one at ``temperature`` 0
    (greedy), else one sampled from ``softmax(logits / temperature)`` (restricted to the
    ``top_k`` most likely when given) by a ``torch.Generator`` seeded with ``seed``, so a
    seed gives the same tokens every time. The loop ends after ``max_new_tokens`` tokens or
    at ``eos_id`` (an id or several), which is kept as the last new token.

    ``share`` runs one generation on several ranks (tensor-parallel or pipelined models):
    all ranks call ``logits_fn`` at every step; a rank that holds no logits returns None
    from it. ``share`` is then called on every rank with the token chosen (an ``int64``
    tensor of shape ``(1,)``; on a rank without logits a placeholder of that shape, 0) and
    returns the token all ranks use, e.g. a broadcast from the last pipeline stage.

    Raises:
        CliOptionError: bad arguments, logits of the wrong shape, or ``logits_fn`` returned
            None without ``share``.
    """
    _check_decoding(prompt_ids, max_new_tokens, temperature, top_k, "generate_ids")
    stops = ({eos_id} if isinstance(eos_id, int) else set(eos_id)) if eos_id is not None \
        else set()
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    device = prompt_ids.device
    ids = prompt_ids.to(torch.int64)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = logits_fn(ids)
        if logits is None:
            if share is None:
                raise CliOptionError("logits_fn returned None, and no share callback gives "
                                     "this rank the next token", primitive="generate_ids",
                                     values={"step": len(new)},
                                     fix="return the (1, n, vocab) logits, or pass share= "
                                     "(e.g. a broadcast from the rank that holds them)")
            chosen = torch.zeros(1, dtype=torch.int64, device=device)
        else:
            if logits.dim() != 3 or logits.shape[0] != 1 or logits.shape[-1] < 1:
                raise CliOptionError("logits_fn must return logits of shape (1, n, vocab)",
                                     primitive="generate_ids",
                                     values={"shape": tuple(logits.shape),
                                             "ids_shape": tuple(ids.shape)},
                                     fix="return model(input_ids=ids).logits")
            token = _choose(logits[0, -1], temperature, top_k, generator)
            chosen = torch.tensor([token], dtype=torch.int64, device=device)
        if share is not None:
            chosen = share(chosen)
            if not isinstance(chosen, torch.Tensor) or chosen.numel() != 1:
                raise CliOptionError("share must return the token as a tensor of one element",
                                     primitive="generate_ids",
                                     values={"returned": getattr(chosen, "shape", chosen)},
                                     fix="return the (1,) int64 tensor every rank uses")
        token = int(chosen.reshape(()).item())
        new.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], dtype=torch.int64, device=device)], 1)
        if token in stops:
            break
    return torch.tensor([new], dtype=torch.int64, device=device)


def _eos_ids(model: nn.Module, tokenizer: Any | None) -> set[int]:
    """The ids that end an answer: the model's generation config's ``eos_token_id`` (as
    transformers' ``generate`` stops), else the tokenizer's; none without a tokenizer."""
    if tokenizer is None:
        return set()
    config = getattr(model, "generation_config", None)
    value = getattr(config, "eos_token_id", None)
    if value is None:
        value = getattr(tokenizer, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple, set)) else [value])}


def _check_fits(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
                tokenizer: Any | None) -> None:
    """The prompt's ids are in the model's vocabulary; the answer fits its positions."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    vocab = getattr(embeddings, "num_embeddings", None)
    largest = int(prompt_ids.max())
    if isinstance(vocab, int) and largest >= vocab:
        raise CliOptionError(
            f"the prompt has token id {largest}, but the model's vocabulary has {vocab} "
            f"entries (tokens: {'the tokenizer' if tokenizer is not None else 'bytes'})",
            primitive="answer", values={"largest_token": largest, "vocab_size": vocab},
            fix="put the tokenizer the model was trained with in its folder")
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or \
        getattr(config, "n_positions", None)
    total = prompt_ids.shape[1] + max_new_tokens
    if isinstance(limit, int) and total > limit:
        raise CliOptionError("the prompt and the answer exceed the model's positions",
                             primitive="answer",
                             values={"prompt_tokens": prompt_ids.shape[1],
                                     "max_new_tokens": max_new_tokens, "positions": limit},
                             fix=f"--max-new-tokens {max(1, limit - prompt_ids.shape[1])}"
                             " or a shorter prompt")


def answer(model: nn.Module, tokenizer: Any | None, prompt: str, *, max_new_tokens: int = 64,
           temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
           chat: bool = True) -> str:
    """What ``model`` answers to ``prompt``: :func:`render_prompt`, :func:`generate_ids`
    with ``model(input_ids=ids, use_cache=False).logits`` under ``torch.no_grad`` (stopping
    at the generation config's end-of-sequence ids), then :func:`decode`. The model is used
    as it is (call ``.eval()`` first; :func:`load_for_generation` does)."""
    prompt_ids = render_prompt(tokenizer, prompt, chat=chat)
    _check_decoding(prompt_ids, max_new_tokens, temperature, top_k, "answer")
    _check_fits(model, prompt_ids, max_new_tokens, tokenizer)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")

    def logits_fn(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        new = generate_ids(logits_fn, prompt_ids.to(device), max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, seed=seed,
                           eos_id=_eos_ids(model, tokenizer))
    return decode(tokenizer, new)
