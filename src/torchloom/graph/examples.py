"""Example inputs: :func:`dummy_inputs` made from a transformers config, and
:func:`example_inputs_for`, the inputs one module receives when the model runs on them."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..core.errors import TraceError
from .binding import _signature
from .fake import _tensors_on_meta, _TraceExit, meta_values, on_meta, value_mode
from .guards import CACHE_FLAG
from .tracer import _modes, _restore_modes


def example_inputs_for(root: nn.Module, module: nn.Module, path: str
                       ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The inputs ``module`` receives when ``root`` runs on its example inputs.

    The root's example inputs are :func:`dummy_inputs` (made from a transformers model's
    config); other roots have none (returns None). The root runs in eval mode without
    gradients and without a KV cache (``use_cache=False`` when its forward has the flag),
    the random state is restored, and the run stops as soon as ``module`` is called. On a
    model with ``meta`` weights it runs on fake tensors (:func:`value_mode`), and the
    captured inputs are fake tensors.
    """
    root_inputs = dummy_inputs(root)
    if root_inputs is None:
        return None
    if CACHE_FLAG in _signature(root).parameters and CACHE_FLAG not in root_inputs:
        root_inputs[CACHE_FLAG] = False
    mode = value_mode(root, root_inputs)
    if mode is not None:
        root_inputs = meta_values(root_inputs)
    if module is root:
        return (), dict(root_inputs)
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, dict(kwargs)))
        raise _TraceExit

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    modes = _modes(root)
    root.eval()

    def run(inputs: dict[str, Any]) -> None:
        try:
            root(**inputs)
        except _TraceExit:
            pass

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                _tensors_on_meta(root, mode is not None):
            if mode is None:
                run(root_inputs)
            else:
                on_meta(mode, run, root_inputs)
    except _TraceExit:
        pass
    except Exception as exc:  # noqa: BLE001
        raise TraceError(
            f"running the model on its dummy inputs to find this module's inputs failed: "
            f"{type(exc).__name__}: {exc}",
            path=path, primitive="trace", values={"root": type(root).__name__},
            fix=f"pass the module's inputs: sch[{path!r}].trace(example_inputs=(...))",
        ) from exc
    finally:
        handle.remove()
        _restore_modes(modes)
    if not captured:
        raise TraceError(
            "the model never called this module when run on its dummy inputs",
            path=path, primitive="trace", values={"root": type(root).__name__},
            fix=f"pass the module's inputs: sch[{path!r}].trace(example_inputs=(...))",
        )
    return captured[-1] if mode is None else meta_values(captured[-1])


#: the batch and (at most) the sequence length of :func:`dummy_inputs`
DUMMY_BATCH, DUMMY_LENGTH = 2, 16
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


def dummy_inputs(model: nn.Module, batch: int = DUMMY_BATCH,
                 length: int = DUMMY_LENGTH) -> dict[str, Any] | None:
    """Example inputs for a transformers model, made from its config (None for a model
    without a config).

    * an image model (``pixel_values`` in its forward, ``image_size`` in its config):
      ``pixel_values`` of shape ``(batch, num_channels, image_size, image_size)``;
    * a text model: ``input_ids`` of shape ``(batch, min(length, positions))`` drawn from
      the vocabulary without the padding token, plus ``decoder_input_ids`` for an
      encoder-decoder model.

    The values come from a fixed generator (the global random state is not touched). They
    are CPU tensors (or on the device of the model's first real parameter); tracing a
    model with ``meta`` weights turns them into fake tensors.

    >>> import transformers
    >>> cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50)
    >>> {k: tuple(v.shape) for k, v in dummy_inputs(transformers.GPT2LMHeadModel(cfg)).items()}
    {'input_ids': (2, 16)}
    """
    config = getattr(model, "config", None)
    if config is None or getattr(type(model), "dummy_inputs", None) is None:
        return None
    params = _signature(model).parameters
    device = next((t.device for t in model.parameters() if not t.is_meta),
                  torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    image_size = getattr(config, "image_size", None)
    if "pixel_values" in params and image_size is not None:
        side = tuple(image_size) if isinstance(image_size, (tuple, list)) else \
            (image_size, image_size)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        pixels = torch.randn(batch, getattr(config, "num_channels", 3), *side,
                             generator=generator)
        return {"pixel_values": pixels.to(device=device, dtype=dtype)}
    vocab = getattr(config, "vocab_size", None)
    if "input_ids" in params and isinstance(vocab, int) and vocab > 1:
        limits = [getattr(config, k) for k in _POSITION_LIMITS
                  if isinstance(getattr(config, k, None), int)]
        seq = max(2, min([length, *limits]))
        pad = getattr(config, "pad_token_id", None)

        def ids() -> torch.Tensor:
            drawn = torch.randint(0, vocab, (batch, seq), generator=generator)
            if isinstance(pad, int):
                drawn[drawn == pad] = (pad + 1) % vocab
            return drawn.to(device)

        inputs = {"input_ids": ids()}
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            inputs["decoder_input_ids"] = ids()
        return inputs
    try:
        inputs = dict(cast("dict[str, Any]", model.dummy_inputs))  # transformers' property
    except Exception:  # noqa: BLE001 - a model without usable dummy inputs
        return None
    token_ids = {k: v for k, v in inputs.items() if k.endswith("input_ids")}
    inputs = token_ids or inputs  # token ids only: the plain call, without masks
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
