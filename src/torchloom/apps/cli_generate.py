"""``torchloom generate FOLDER --prompt "..."``: the command line of
:mod:`torchloom.apps.generate` (what a model folder or a peft LoRA adapter folder answers).

Each prompt is printed after ``> `` and followed by the answer; a line on standard error
says what was loaded and how it decodes. The options are checked before the model loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import typer

from ..core.errors import CliOptionError
from .cli_common import default_threads

__all__ = ["check_options", "generate"]

_PRIMITIVE = "torchloom generate"


def check_options(prompts: list[str], max_new_tokens: int, temperature: float,
                  top_k: int | None, threads: int | None) -> None:
    """The options of ``torchloom generate`` have usable values.

    >>> check_options(["hi"], 8, 0.0, None, None)
    >>> check_options(["hi"], 0, 0.0, None, None)
    Traceback (most recent call last):
    ...
    torchloom.core.errors.CliOptionError: torchloom generate(...): --max-new-tokens must be at least 1
        values: max_new_tokens=0
        fix: --max-new-tokens 64
    """
    if not prompts:
        raise CliOptionError("no prompt given", primitive=_PRIMITIVE, values={"prompt": []},
                             fix='torchloom generate FOLDER --prompt "Hello" (repeat '
                             "--prompt for more)")
    if max_new_tokens < 1:
        raise CliOptionError("--max-new-tokens must be at least 1", primitive=_PRIMITIVE,
                             values={"max_new_tokens": max_new_tokens},
                             fix="--max-new-tokens 64")
    if not temperature >= 0 or temperature == float("inf"):
        raise CliOptionError("--temperature must be a finite number >= 0 (0: greedy)",
                             primitive=_PRIMITIVE, values={"temperature": temperature},
                             fix="--temperature 0 (greedy) or --temperature 0.8 (sampling)")
    if top_k is not None and top_k < 1:
        raise CliOptionError("--top-k must be at least 1", primitive=_PRIMITIVE,
                             values={"top_k": top_k}, fix="--top-k 50, or leave it out")
    if threads is not None and threads < 1:
        raise CliOptionError("--threads must be at least 1", primitive=_PRIMITIVE,
                             values={"threads": threads},
                             fix="--threads 4, or leave it out (one per idle core)")


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' progress bars off while the model loads (restored after)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def generate(
    folder: str = typer.Argument(..., help="A transformers model folder (config.json + "
                                 "weights, e.g. save_pretrained output) or a peft LoRA "
                                 "adapter folder (adapter_config.json + "
                                 "adapter_model.safetensors) whose base model is a local "
                                 "folder. Nothing is downloaded."),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="A prompt; repeat for "
                                     "more (answered one after the other)."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated at most per answer (it "
                                       "ends earlier at the end-of-sequence token)."),
    temperature: float = typer.Option(0.0, help="0: greedy (the most likely token); > 0: "
                                      "sample from softmax(logits / temperature)."),
    top_k: int = typer.Option(None, help="With --temperature > 0: sample among the K most "
                              "likely tokens only."),
    seed: int = typer.Option(0, help="Seed of the sampling (the same seed, the same text)."),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Give the prompt "
                                          "as plain text even if the tokenizer has a chat "
                                          "template."),
    base: str = typer.Option(None, help="The base model's local folder for an adapter "
                             "folder (default: the adapter's base_model_name_or_path, "
                             "which must be a local folder)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    threads: int = typer.Option(None, help="torch threads (default: one per idle core)."),
) -> None:
    """Print what a model folder or a LoRA adapter folder answers to each --prompt
    (greedy by default; no KV cache: for checking a fine-tune, not for serving)."""
    from .generate import answer, load_for_generation, resolve_folder

    prompts = list(prompt or [])
    check_options(prompts, max_new_tokens, temperature, top_k, threads)
    source = resolve_folder(folder, base=base)  # the folder errors before any loading
    num_threads = threads if threads is not None else default_threads()[0]
    torch.set_num_threads(num_threads)
    with _quiet_loading():
        model, tokenizer = load_for_generation(folder, device=device, base=base)
    what = (f"LoRA adapter {source.adapter_folder} on {source.model_folder}"
            if source.adapter_folder is not None else source.model_folder)
    tokens = "bytes (no tokenizer)" if tokenizer is None else (
        "tokenizer, chat template" if getattr(tokenizer, "chat_template", None)
        and not no_chat_template else "tokenizer")
    decoding = "greedy" if temperature == 0 else (
        f"sampling, temperature {temperature:g}"
        + (f", top-k {top_k}" if top_k is not None else "") + f", seed {seed}")
    typer.echo(f"torchloom generate: {what}; {tokens}; {decoding}; "
               f"{num_threads} thread{'s' if num_threads != 1 else ''}", err=True)
    for text in prompts:
        reply = answer(model, tokenizer, text, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, seed=seed,
                       chat=not no_chat_template)
        typer.echo(f"> {text}\n{reply}\n")
