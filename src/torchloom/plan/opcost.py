"""Pricing the operators of a measured step: :class:`OpCost` (a
:class:`~torchloom.plan.tracking.Tracker` that also records every operator's FLOPs and the
bytes it moves, matrix products one by one with their kind) and :func:`flop_counter`
(FlopCounterMode with the CPU attention kernels' formulas). Used by
:mod:`torchloom.plan.units`.

>>> import torch
>>> cost = OpCost()
>>> with cost:
...     _ = torch.ones(4, 8) @ torch.ones(8, 2)
>>> cost.flops, [(f, d, k) for f, _, d, k in cost.matmuls]
(128, [(128, 'fp32', 'linear')])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..graph.fake import grouped_mm_on_fake
from .spec import DTYPES
from .tracking import Tracker

__all__ = ["OpCost", "flop_counter", "grouped_mm_on_fake", "VIEWS"]

VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "as_strided",
    "slice", "select", "detach", "alias", "unsqueeze", "squeeze", "split", "split_with_sizes",
    "chunk", "unbind", "narrow", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "_to_copy_meta", "view_as", "unfold", "diagonal",
    "_reshape_alias", "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type",
    # metadata queries (they take a tensor and move nothing)
    "device", "dim", "size", "stride", "numel", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_contiguous", "is_strides_like_format",
    "is_non_overlapping_and_dense",
})
_MATMULS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_grouped_mm",
})
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}



class OpCost(Tracker):
    """A :class:`~torchloom.plan.tracking.Tracker` that also prices every operator: its
    FLOPs (FlopCounterMode's formulas, :data:`torch.utils.flop_counter.flop_registry`) and
    the bytes it reads and writes, for a roofline time. Matmul-like operators are listed
    one by one; the others only add bytes. One dispatch mode does both (each mode on the
    stack costs time per operator)."""

    def __init__(self, groups: dict[str, str] | None = None, causal: bool = False) -> None:
        super().__init__(groups)
        self.causal = causal
        from torch.utils.flop_counter import flop_registry

        self.registry: dict[Any, Callable[..., int]] = {
            **flop_registry, **_extra_mapping()}
        self.flops = 0
        self.matmuls: list[tuple[int, int, str, str]] = []
        self.other_bytes = 0
        self.ops = 0

    def take_ops(self) -> int:
        """Operators dispatched since the last call, and start anew."""
        out, self.ops = self.ops, 0
        return out

    def take(self) -> tuple[list[tuple[int, int, str, str]], int]:
        """What was recorded since the last call, and start anew."""
        out = (self.matmuls, self.other_bytes)
        self.matmuls, self.other_bytes = [], 0
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        namespace = getattr(func, "namespace", "")
        name = func._schema.name.split("::")[-1]
        if namespace in ("c10d", "_c10d_functional") or name in VIEWS:
            return out
        self.ops += 1
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in (*tensors, *outs))
        fn = self.registry.get(func._overloadpacket)
        if fn is not None:
            flops = int(fn(*args, **kwargs, out_val=out))
            self.flops += flops
            floats = [t for t in tensors if t.is_floating_point()]
            dtype = _DTYPE_NAMES.get(floats[0].dtype, "fp32") if floats else "fp32"
            self.matmuls.append((flops, moved, dtype, _kind(name, self.causal)))
        else:
            self.other_bytes += moved
        return out


_LINEAR = frozenset({"mm", "addmm"})


def _kind(name: str, causal: bool) -> str:
    """The kind of a matrix-product operator (see :attr:`SegmentCost.matmuls`): a causal
    LM's attention is ``causal`` whether transformers passed ``is_causal`` or its causal
    mask (on fake tensors it builds the mask: it cannot look at the values)."""
    if name in _LINEAR:
        return "linear"
    if "attention" in name:
        return "causal" if causal else "attention"
    return "other"


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None,
                     **kwargs: Any) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)`` (a mixture of experts' product, which
    FlopCounterMode lacks): tokens x hidden against every expert's matrix (2-D x 3-D: each
    row meets one group's matrix), a weight gradient (2-D x 2-D with offsets: each group
    reduces over its own rows), or a batch of products (3-D x 3-D).

    >>> grouped_mm_flops((32, 16), (4, 16, 8))      # 32 rows, each against one 16 x 8 matrix
    8192
    >>> grouped_mm_flops((16, 32), (32, 8))         # the weight gradient: the same products
    8192
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    rows = a_shape[-2] * (a_shape[0] if len(a_shape) == 3 else 1)
    return 2 * rows * a_shape[-1] * b_shape[-1]


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas FlopCounterMode lacks, on shapes: the CPU flash-attention kernels
    (the CUDA kernels' formulas apply: the same products) and the grouped product of
    mixtures of experts."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    out: dict[Any, Callable[..., int]] = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        out[fwd] = lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v)
    if bwd is not None:
        out[bwd] = (lambda grad, q, k, v, *a, out_shape=None, **kw:
                    fc.sdpa_backward_flop_count(grad, q, k, v))
    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None:
        out[grouped] = grouped_mm_flops
    return out


def _extra_mapping() -> dict[Any, Callable[..., int]]:
    """:func:`_extra_formulas` wrapped as FlopCounterMode wraps its own (tensors ->
    shapes)."""
    from torch.utils.flop_counter import shape_wrapper

    return {k: shape_wrapper(v) for k, v in _extra_formulas().items()}


def flop_counter() -> Any:
    """A FlopCounterMode that also knows the CPU attention kernels and the grouped
    product of mixtures of experts."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=_extra_formulas())
