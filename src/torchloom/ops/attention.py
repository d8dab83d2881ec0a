"""Attention on ``F.scaled_dot_product_attention`` (SDPA), with an explicit ``is_causal``.

* :func:`sdpa_attention` is the core: ``softmax(q k^T * scale + mask) v`` with dropout on
  the probabilities. Causality is never guessed from the module or the mask: the caller
  says ``is_causal``. Masks are honoured whatever their form:

  - boolean: ``True`` where a query may attend to a key (the SDPA convention, and what
    transformers builds for ``attn_implementation="sdpa"``);
  - floating point: added to the scores (``0`` to keep, a large negative value such as
    ``torch.finfo(dtype).min`` to drop; what transformers builds for ``"eager"``);
  - integer: a transformers padding mask, ``1`` to keep and ``0`` for padding.

  A mask of two dimensions is a padding mask ``(batch, kv_len)``, three dimensions are
  ``(batch, q_len, kv_len)``, four are ``(batch, heads or 1, q_len, kv_len)``. With
  ``is_causal=True`` and a mask (or fewer queries than keys, as when decoding with a
  cache) the causal mask is aligned to the *end* of the keys (query ``i`` sees keys up to
  ``kv_len - q_len + i``) and combined with the given mask.

* :class:`SDPAGPT2Attention` / :func:`make_sdpa_gpt2_attention` and
  :class:`SDPABertSelfAttention` / :func:`make_sdpa_bert_self_attention` replace the
  transformers modules of the same role (``sch[path].replace(make_sdpa_gpt2_attention)``).
  They reuse the original submodules (the same Parameter objects, so ``state_dict`` keys
  and pretrained checkpoints are unchanged), take the same arguments and return the same
  ``(attn_output, attn_weights)`` pair (the weights are ``None``: SDPA does not form
  them). Dropout on the attention probabilities follows the original dropout module's
  ``p`` and the module's ``training`` flag, both read at call time.

>>> import torch
>>> q = k = v = torch.randn(1, 2, 4, 8)
>>> out = sdpa_attention(q, k, v, is_causal=True)
>>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> torch.allclose(out, ref)
True
>>> pad = torch.tensor([[1, 1, 0, 0]])            # the last two keys are padding
>>> out = sdpa_attention(q, k, v, pad, is_causal=False)
>>> torch.allclose(out, sdpa_attention(q, k[:, :, :2], v[:, :, :2], is_causal=False))
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import OpsError, ReplaceError
from ..core.refs import schedule_safe

__all__ = [
    "OpsError",
    "SDPAAttention",
    "SDPABertSelfAttention",
    "SDPAGPT2Attention",
    "make_sdpa_bert_self_attention",
    "make_sdpa_gpt2_attention",
    "sdpa_attention",
]


def _causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``(q_len, kv_len)`` boolean mask, True where query ``i`` may see key ``j``; aligned to
    the end of the keys (the queries are the last ``q_len`` positions)."""
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device)[:, None] + offset
    return rows >= torch.arange(kv_len, device=device)[None, :]


def _normalise_mask(mask: torch.Tensor, query: torch.Tensor, primitive: str) -> torch.Tensor:
    """A 4-d boolean (keep) or floating (additive, in the query's dtype) mask."""
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    elif mask.dim() == 3:
        mask = mask[:, None, :, :]
    elif mask.dim() != 4:
        raise OpsError(
            f"an attention mask has 2, 3 or 4 dimensions, not {mask.dim()}",
            primitive=primitive,
            values={"mask_shape": tuple(mask.shape), "query_shape": tuple(query.shape)},
            fix="pass (batch, kv_len) padding, (batch, q_len, kv_len) or "
            "(batch, heads, q_len, kv_len)",
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask.to(query.dtype)
    if mask.dtype.is_complex:
        raise OpsError(
            "an attention mask is boolean, floating point or integer, not complex",
            primitive=primitive, values={"dtype": str(mask.dtype)},
            fix="pass a boolean mask, True where a query may attend",
        )
    return mask != 0  # integer: a transformers padding mask, 1 keeps


@schedule_safe
def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention over ``(batch, heads, seq, head_dim)`` tensors.

    Args:
        query: ``(batch, heads, q_len, head_dim)``.
        key, value: ``(batch, heads, kv_len, head_dim)``.
        attn_mask: None, or a boolean / floating / integer mask (see the module docstring).
        is_causal: whether query ``i`` only sees keys up to its own position. Required.
        dropout_p: dropout probability on the attention probabilities (pass 0.0 in eval).
        scale: the factor applied to ``q k^T``; default ``head_dim ** -0.5``.

    Returns:
        ``(batch, heads, q_len, head_dim)``.

    Raises:
        OpsError: ``is_causal`` not a bool, ``dropout_p`` outside ``[0, 1)``, a mask of the
            wrong rank or dtype, or query/key of different ranks.
    """
    primitive = "sdpa_attention"
    if not isinstance(is_causal, bool):
        raise OpsError(
            "is_causal must be True or False",
            primitive=primitive, values={"is_causal": repr(is_causal)},
            fix="sdpa_attention(q, k, v, mask, is_causal=True) for a decoder, False for an "
            "encoder",
        )
    if not 0.0 <= float(dropout_p) < 1.0:
        raise OpsError(
            "dropout_p must be in [0, 1)",
            primitive=primitive, values={"dropout_p": dropout_p},
            fix="pass the dropout probability in training and 0.0 in eval",
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise OpsError(
            "query, key and value are (batch, heads, seq, head_dim) tensors",
            primitive=primitive,
            values={"query": tuple(query.shape), "key": tuple(key.shape),
                    "value": tuple(value.shape)},
            fix="x.view(batch, seq, heads, head_dim).transpose(1, 2)",
        )
    q_len, kv_len = query.shape[-2], key.shape[-2]
    mask = None if attn_mask is None else _normalise_mask(attn_mask, query, primitive)
    causal_flag = False
    if is_causal:
        if mask is None and q_len == kv_len:
            causal_flag = True  # SDPA's own causal path (fastest kernels)
        else:
            keep = _causal_keep(q_len, kv_len, query.device)
            if mask is None:
                mask = keep
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.masked_fill(~keep, torch.finfo(mask.dtype).min)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=float(dropout_p),
        is_causal=causal_flag, scale=scale)


class SDPAAttention(nn.Module):
    """The attention core as a module: ``forward(q, k, v, attn_mask=None)``.

    ``is_causal`` is fixed at construction (and may be overridden per call); the dropout is
    applied only in training mode, read at call time.

    >>> core = SDPAAttention(is_causal=True, dropout=0.5).eval()
    >>> q = torch.randn(1, 1, 3, 4)
    >>> torch.equal(core(q, q, q), core(q, q, q))        # eval: deterministic
    True
    >>> core
    SDPAAttention(is_causal=True, dropout=0.5)
    """

    def __init__(self, *, is_causal: bool, dropout: float = 0.0,
                 scale: float | None = None) -> None:
        super().__init__()
        if not isinstance(is_causal, bool):
            raise OpsError(
                "is_causal must be True or False",
                primitive="SDPAAttention", values={"is_causal": repr(is_causal)},
                fix="SDPAAttention(is_causal=True) for a decoder, False for an encoder",
            )
        self.is_causal = is_causal
        self.dropout = float(dropout)
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, *,
                is_causal: bool | None = None) -> torch.Tensor:
        return sdpa_attention(
            query, key, value, attn_mask,
            is_causal=self.is_causal if is_causal is None else is_causal,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale)

    def extra_repr(self) -> str:
        text = f"is_causal={self.is_causal}, dropout={self.dropout}"
        return text + (f", scale={self.scale}" if self.scale is not None else "")


def _refuse_weights(kwargs: dict[str, Any], output_attentions: bool | None,
                    primitive: str) -> None:
    if output_attentions or kwargs.get("output_attentions"):
        raise OpsError(
            "SDPA attention does not form the attention probabilities, so it cannot "
            "return them",
            primitive=primitive, values={"output_attentions": True},
            fix="call the model without output_attentions, or keep the original attention "
            "module for this layer",
        )


def _update_cache(cache: Any, key: torch.Tensor, value: torch.Tensor, layer_idx: int | None,
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    current = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache
    return current.update(key, value, layer_idx, kwargs=kwargs)


class SDPAGPT2Attention(nn.Module):
    """GPT-2 self-attention (``GPT2Attention``) on :func:`sdpa_attention`.

    Holds the original ``c_attn``, ``c_proj``, ``attn_dropout`` and ``resid_dropout``
    modules; ``split_size``, ``num_heads``, ``head_dim``, ``scaling`` (with
    ``scale_attn_by_inverse_layer_idx``) and ``layer_idx`` are copied. ``is_causal`` is
    True (the causal mask of a GPT-2 model is also in ``attention_mask`` when transformers
    passes one; combining both is idempotent).

    ``forward`` takes the arguments of ``GPT2Attention.forward`` and returns
    ``(attn_output, None)``. Cross-attention is not supported (the factory refuses it).
    """

    def __init__(self, c_attn: nn.Module, c_proj: nn.Module, attn_dropout: nn.Dropout,
                 resid_dropout: nn.Dropout, *, num_heads: int, head_dim: int,
                 split_size: int, scaling: float, layer_idx: int | None = None,
                 is_causal: bool = True) -> None:
        super().__init__()
        self.c_attn = c_attn
        self.c_proj = c_proj
        self.attn_dropout = attn_dropout
        self.resid_dropout = resid_dropout
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.embed_dim = num_heads * head_dim
        self.split_size = split_size
        self.scaling = scaling
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.is_cross_attention = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        primitive = "SDPAGPT2Attention"
        if encoder_hidden_states is not None:
            raise OpsError(
                "this attention was built for self-attention; cross-attention inputs were "
                "passed",
                primitive=primitive, values={"layer_idx": self.layer_idx},
                fix="keep the original module for cross-attention layers",
            )
        _refuse_weights(kwargs, output_attentions, primitive)
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        kwargs.pop("use_cache", None)
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = query.view(shape).transpose(1, 2)
        key = key.view(shape).transpose(1, 2)
        value = value.view(shape).transpose(1, 2)
        if cache is not None:
            key, value = _update_cache(cache, key, value, self.layer_idx, kwargs)
        out = sdpa_attention(
            query, key, value, attention_mask, is_causal=self.is_causal,
            dropout_p=self.attn_dropout.p if self.training else 0.0, scale=self.scaling)
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        out = self.resid_dropout(self.c_proj(out))
        return out, None

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, is_causal={self.is_causal}"


class SDPABertSelfAttention(nn.Module):
    """BERT self-attention (``BertSelfAttention``, and the look-alikes of RoBERTa etc.) on
    :func:`sdpa_attention`.

    Holds the original ``query``, ``key``, ``value`` and ``dropout`` modules;
    ``is_causal`` is the original's (False for an encoder). ``forward`` takes the arguments
    of ``BertSelfAttention.forward`` and returns ``(context, None)``.
    """

    def __init__(self, query: nn.Module, key: nn.Module, value: nn.Module,
                 dropout: nn.Dropout, *, num_attention_heads: int, attention_head_size: int,
                 scaling: float, is_causal: bool = False,
                 layer_idx: int | None = None) -> None:
        super().__init__()
        self.query = query
        self.key = key
        self.value = value
        self._set_attention(dropout, num_attention_heads, attention_head_size, scaling,
                            is_causal, layer_idx)

    def _set_attention(self, dropout: nn.Dropout, num_attention_heads: int,
                       attention_head_size: int, scaling: float, is_causal: bool,
                       layer_idx: int | None) -> None:
        """The attributes every BERT-style SDPA attention holds besides its projections."""
        self.dropout = dropout
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = attention_head_size
        self.all_head_size = num_attention_heads * attention_head_size
        self.scaling = scaling
        self.is_causal = is_causal
        self.layer_idx = layer_idx

    def _project(self, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        query, key, value = (proj(hidden_states).view(shape).transpose(1, 2)
                             for proj in (self.query, self.key, self.value))
        return query, key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        encoder_hidden_states: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        primitive = type(self).__name__
        if encoder_hidden_states is not None:
            raise OpsError(
                "this attention was built for self-attention; cross-attention inputs were "
                "passed",
                primitive=primitive, values={"layer_idx": self.layer_idx},
                fix="keep the original module for cross-attention layers",
            )
        _refuse_weights(kwargs, output_attentions, primitive)
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        kwargs.pop("use_cache", None)
        query, key, value = self._project(hidden_states)
        if cache is not None:
            key, value = _update_cache(cache, key, value, self.layer_idx, kwargs)
        out = sdpa_attention(
            query, key, value, attention_mask, is_causal=self.is_causal,
            dropout_p=self.dropout.p if self.training else 0.0, scale=self.scaling)
        out = out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return out, None

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, "
                f"attention_head_size={self.attention_head_size}, is_causal={self.is_causal}")


def _require(old: nn.Module, attrs: tuple[str, ...], factory: str, expected: str,
             example: str) -> None:
    missing = [a for a in attrs if not hasattr(old, a)]
    if missing:
        raise ReplaceError(
            f"{factory} replaces a transformers {expected}, not a {type(old).__name__} "
            f"(it has no {', '.join(missing)})",
            primitive="replace",
            values={"module": type(old).__name__, "missing": missing},
            fix=f"apply it to the {expected} modules, e.g. sch[{example!r}].replace({factory})",
        )


@schedule_safe
def make_sdpa_gpt2_attention(old: nn.Module) -> SDPAGPT2Attention:
    """Factory for ``sch[path].replace``: a transformers ``GPT2Attention`` (self-attention)
    to :class:`SDPAGPT2Attention`, reusing its submodules.

    Raises:
        ReplaceError: ``old`` is not a GPT-2 attention, or is a cross-attention.
    """
    _require(old, ("c_attn", "c_proj", "attn_dropout", "resid_dropout", "num_heads",
                   "head_dim", "split_size", "scaling"), "make_sdpa_gpt2_attention",
             "GPT2Attention", "transformer.h.0.attn")
    if getattr(old, "is_cross_attention", False):
        raise ReplaceError(
            "make_sdpa_gpt2_attention replaces self-attention; this is a cross-attention",
            primitive="replace",
            values={"module": type(old).__name__, "layer_idx": getattr(old, "layer_idx", None)},
            fix="replace only the blocks' 'attn', not 'crossattention'",
        )
    attn: Any = old  # a GPT2Attention (checked above): attributes untyped by nn.Module
    return SDPAGPT2Attention(
        attn.c_attn, attn.c_proj, attn.attn_dropout, attn.resid_dropout,
        num_heads=attn.num_heads, head_dim=attn.head_dim, split_size=attn.split_size,
        scaling=float(attn.scaling), layer_idx=getattr(old, "layer_idx", None),
        is_causal=bool(getattr(old, "is_causal", True)))


@schedule_safe
def make_sdpa_bert_self_attention(old: nn.Module) -> SDPABertSelfAttention:
    """Factory for ``sch[path].replace``: a transformers ``BertSelfAttention`` to
    :class:`SDPABertSelfAttention`, reusing its submodules.

    Raises:
        ReplaceError: ``old`` is not a BERT self-attention (e.g. a ``BertCrossAttention``,
            or uses relative position embeddings).
    """
    _require(old, ("query", "key", "value", "dropout", "num_attention_heads",
                   "attention_head_size"), "make_sdpa_bert_self_attention",
             "BertSelfAttention", "bert.encoder.layer.0.attention.self")
    if "Cross" in type(old).__name__:
        raise ReplaceError(
            "make_sdpa_bert_self_attention replaces self-attention; this is a "
            "cross-attention",
            primitive="replace", values={"module": type(old).__name__},
            fix="replace only 'attention.self', not 'crossattention.self'",
        )
    kind = getattr(old, "position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise ReplaceError(
            "relative position embeddings inside the attention are not supported",
            primitive="replace",
            values={"module": type(old).__name__, "position_embedding_type": kind},
            fix="keep the original attention for this model",
        )
    attn: Any = old  # a BertSelfAttention (checked above): attributes untyped by nn.Module
    scaling = getattr(old, "scaling", attn.attention_head_size ** -0.5)
    return SDPABertSelfAttention(
        attn.query, attn.key, attn.value, attn.dropout,
        num_attention_heads=attn.num_attention_heads,
        attention_head_size=attn.attention_head_size, scaling=float(scaling),
        is_causal=bool(getattr(old, "is_causal", False)),
        layer_idx=getattr(old, "layer_idx", None))
