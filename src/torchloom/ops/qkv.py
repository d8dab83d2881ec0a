"""Fused query/key/value projection for BERT-style self-attention.

:class:`FusedQKVBertSelfAttention` computes q, k and v with one ``nn.Linear`` of three
times the output features (``qkv``) instead of three, then runs
:func:`~torchloom.ops.attention.sdpa_attention`. The fused weight is the concatenation
``[W_q; W_k; W_v]`` (and the bias ``[b_q; b_k; b_v]``), so the outputs equal the original's.

Checkpoints keep the original layout in both directions:

* ``state_dict()`` of the fused module has ``query.weight``, ``query.bias``,
  ``key.weight``, ... (views of the fused tensors), not ``qkv.weight``;
* ``load_state_dict`` accepts those keys (e.g. a checkpoint of the original model) and
  concatenates them into ``qkv``; a state dict with ``qkv.weight`` / ``qkv.bias`` is
  accepted as well.

Use :func:`make_fused_qkv_bert_self_attention` with ``sch[path].replace``.

>>> import torch
>>> from torch import nn
>>> q, k, v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
>>> fused = FusedQKVBertSelfAttention.from_linears(q, k, v, nn.Dropout(0.0),
...                                               num_attention_heads=2)
>>> sorted(fused.state_dict())
['key.bias', 'key.weight', 'query.bias', 'query.weight', 'value.bias', 'value.weight']
>>> torch.equal(fused.state_dict()["key.weight"], k.weight)
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.errors import ReplaceError
from ..core.meta import ShardSpec, copy_meta, get_meta, shard_spec
from ..core.refs import schedule_safe
from .attention import OpsError, SDPABertSelfAttention

__all__ = ["FusedQKVBertSelfAttention", "make_fused_qkv_bert_self_attention"]

_NAMES = ("query", "key", "value")


def _fused_shard(parts: list[torch.Tensor], fused: torch.Tensor, primitive: str) -> None:
    """Give ``fused`` the shard spec that its three sharded parts imply (``chunks=3``)."""
    specs = [shard_spec(p) for p in parts]
    if all(s is None for s in specs):
        return
    first = specs[0]
    if (first is None or any(s is None for s in specs) or any(s != first for s in specs[1:])
            or first.axis != 0 or first.chunks != 1):
        raise ReplaceError(
            "query, key and value must be sharded alike along their output features "
            "(axis 0) to be fused",
            primitive=primitive,
            values={"specs": [None if s is None else (s.axis, s.world_size, s.chunks)
                              for s in specs]},
            fix="fuse before sharding, then shard 'qkv.weight' with axis=0, chunks=3",
        )
    full = (3 * first.full_shape[0], *first.full_shape[1:])
    get_meta(fused).shard = ShardSpec(axis=0, full_shape=full, world_size=first.world_size,
                                      rank=first.rank, chunks=3)


class FusedQKVBertSelfAttention(SDPABertSelfAttention):
    """BERT self-attention with one fused ``qkv`` projection (see the module docstring).

    Attributes:
        qkv: ``nn.Linear(hidden, 3 * all_head_size)``.
        dropout: the original dropout module on the attention probabilities.
    """

    def __init__(self, qkv: nn.Linear, dropout: nn.Dropout, *, num_attention_heads: int,
                 attention_head_size: int, scaling: float, is_causal: bool = False,
                 layer_idx: int | None = None) -> None:
        if qkv.out_features % 3 != 0:
            raise OpsError(
                "the fused projection has 3 * all_head_size output features",
                primitive="FusedQKVBertSelfAttention",
                values={"out_features": qkv.out_features},
                fix="nn.Linear(hidden, 3 * num_attention_heads * attention_head_size)",
            )
        nn.Module.__init__(self)
        self.qkv = qkv
        self._set_attention(dropout, num_attention_heads, attention_head_size, scaling,
                            is_causal, layer_idx)
        self.register_state_dict_post_hook(_split_state_dict)
        self.register_load_state_dict_pre_hook(_merge_state_dict)

    @classmethod
    def from_linears(cls, query: nn.Module, key: nn.Module, value: nn.Module,
                     dropout: nn.Dropout, *, num_attention_heads: int,
                     scaling: float | None = None, is_causal: bool = False,
                     layer_idx: int | None = None) -> FusedQKVBertSelfAttention:
        """Fuse three ``nn.Linear`` of the same shape (their values are copied into the
        new ``qkv`` parameters; metadata and shard specs carry over). Other modules are
        refused with a :class:`~torchloom.core.errors.ReplaceError`."""
        primitive = "FusedQKVBertSelfAttention.from_linears"
        if not (isinstance(query, nn.Linear) and isinstance(key, nn.Linear)
                and isinstance(value, nn.Linear)):
            raise ReplaceError(
                "query, key and value must be nn.Linear to be fused",
                primitive=primitive,
                values={"types": [type(m).__name__ for m in (query, key, value)]},
                fix="keep the unfused attention (make_sdpa_bert_self_attention)",
            )
        linears = (query, key, value)
        shapes = {tuple(m.weight.shape) for m in linears}
        biases = {m.bias is not None for m in linears}
        if len(shapes) != 1 or len(biases) != 1:
            raise ReplaceError(
                "query, key and value must have the same shape and all (or none) a bias",
                primitive=primitive,
                values={"shapes": [tuple(m.weight.shape) for m in linears],
                        "bias": [m.bias is not None for m in linears]},
                fix="keep the unfused attention (make_sdpa_bert_self_attention)",
            )
        out_features, in_features = query.weight.shape
        if out_features % num_attention_heads != 0:
            raise ReplaceError(
                "the projection's output features do not split into the heads",
                primitive=primitive,
                values={"out_features": out_features, "num_attention_heads": num_attention_heads},
                fix="pass the module's num_attention_heads",
            )
        head = out_features // num_attention_heads
        w = query.weight
        qkv = nn.Linear(in_features, 3 * out_features, bias=query.bias is not None,
                        device=w.device, dtype=w.dtype)
        names = ["weight"] + (["bias"] if query.bias is not None else [])
        for name in names:
            parts = [getattr(m, name) for m in linears]
            fused = nn.Parameter(torch.cat([p.detach() for p in parts], dim=0),
                                 requires_grad=parts[0].requires_grad)
            copy_meta(parts[0], fused)
            if get_meta(fused).shard is not None:
                get_meta(fused).shard = None
            _fused_shard(parts, fused, primitive)
            setattr(qkv, name, fused)
        return cls(qkv, dropout, num_attention_heads=num_attention_heads,
                   attention_head_size=head,
                   scaling=head ** -0.5 if scaling is None else scaling,
                   is_causal=is_causal, layer_idx=layer_idx)

    def torchloom_checkpoint_parts(self) -> dict[str, tuple[list[str], int]]:
        """Where a checkpoint of the original model keeps each fused tensor: ``qkv.weight``
        is ``query.weight``, ``key.weight`` and ``value.weight`` concatenated along axis 0
        (the same for the bias). ``build(weights=...)`` reads those keys.

        >>> q, k, v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        >>> fused = FusedQKVBertSelfAttention.from_linears(q, k, v, nn.Dropout(0.0),
        ...                                               num_attention_heads=2)
        >>> fused.torchloom_checkpoint_parts()["qkv.bias"]
        (['query.bias', 'key.bias', 'value.bias'], 0)
        """
        return {f"qkv.{name}": ([f"{part}.{name}" for part in _NAMES], 0)
                for name in ("weight", "bias") if getattr(self.qkv, name, None) is not None}

    def _project(self, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (*hidden_states.shape[:-1], 3, -1, self.attention_head_size)
        # (batch, seq, 3, heads, head) -> 3 x (batch, heads, seq, head)
        qkv = self.qkv(hidden_states).view(shape)
        query, key, value = (qkv.select(-3, i).transpose(1, 2) for i in range(3))
        return query, key, value

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused_qkv=True"


def _split_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any) -> None:
    """state_dict hook: ``qkv.weight`` -> ``query.weight``, ``key.weight``, ``value.weight``."""
    for name in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{name}", None)
        if fused is None:
            continue
        for part_name, part in zip(_NAMES, fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{part_name}.{name}"] = part


def _merge_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any, strict: bool, missing_keys: list[str],
                      unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """load_state_dict pre-hook: ``query.weight`` + ``key.weight`` + ``value.weight`` ->
    ``qkv.weight`` (a state dict that already has ``qkv.weight`` is left alone)."""
    for name in ("weight", "bias"):
        keys = [f"{prefix}{part}.{name}" for part in _NAMES]
        present = [k for k in keys if k in state_dict]
        if not present:
            continue
        if len(present) != 3:
            error_msgs.append(
                f"fused q/k/v at {prefix or '<root>'}: the state dict has {present} but not "
                f"{sorted(set(keys) - set(present))}; all three are needed to build "
                f"{prefix}qkv.{name}")
            continue
        if f"{prefix}qkv.{name}" in state_dict:
            error_msgs.append(
                f"fused q/k/v at {prefix or '<root>'}: the state dict has both "
                f"{prefix}qkv.{name} and {keys}; keep one layout")
            continue
        state_dict[f"{prefix}qkv.{name}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


@schedule_safe
def make_fused_qkv_bert_self_attention(old: nn.Module) -> FusedQKVBertSelfAttention:
    """Factory for ``sch[path].replace``: a transformers ``BertSelfAttention`` to
    :class:`FusedQKVBertSelfAttention` (one ``qkv`` Linear; the original values are
    copied into it, the dropout module is reused).

    Raises:
        ReplaceError: ``old`` is not a BERT self-attention, or q/k/v cannot be fused.
    """
    from .attention import make_sdpa_bert_self_attention

    plain = make_sdpa_bert_self_attention(old)  # validates the module
    return FusedQKVBertSelfAttention.from_linears(
        plain.query, plain.key, plain.value, plain.dropout,
        num_attention_heads=plain.num_attention_heads, scaling=plain.scaling,
        is_causal=plain.is_causal, layer_idx=plain.layer_idx)
