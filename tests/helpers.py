"""Replacement modules and factories that several test modules share.

* :class:`TanhGelu`, :func:`make_tanh_gelu` and :func:`make_tanh_gelu_at`: GELU written
  out, with the factories ``replace`` (one argument) and ``replace_all`` (path and module)
  take.
* :class:`ExplicitMLP` and :func:`make_explicit_mlp`: GPT-2's MLP with the same parameters,
  written with matrix products (the same outputs up to fp32 round-off).
* :class:`UnseededCheckpoint`: a checkpoint wrapper with a planted bug (the recompute
  draws other dropout masks), for the checks that must catch it.
* :func:`assert_grads_match`: every gradient of a built module against the unsharded
  reference's (a tensor-parallel shard against its slice, an FSDP2 shard gathered).

The factories are module-level functions, so a recipe stores them by import path
(``tests.helpers:make_explicit_mlp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchloom as tl


def assert_grads_match(module: nn.Module, reference: nn.Module, **tol: float) -> None:
    """Each parameter gradient of ``module`` equals ``reference``'s at the same name: a
    parameter ``shard`` split is compared with its slice of the reference gradient, an
    FSDP2 (DTensor) gradient as the whole tensor it shards."""
    ref_params = dict(reference.named_parameters())
    for name, param in module.named_parameters():
        expected = ref_params[name].grad
        spec = tl.shard_spec(param)
        if spec is not None:
            expected = spec.slice(expected)
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        torch.testing.assert_close(grad, expected, **tol, msg=f"grad of {name}")


class TanhGelu(nn.Module):
    """GELU written out (tanh approximation), as a user kernel would be."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def make_tanh_gelu(old: nn.Module) -> nn.Module:
    return TanhGelu()


def make_tanh_gelu_at(path: str, old: nn.Module) -> nn.Module:
    return TanhGelu()


class ExplicitMLP(nn.Module):
    """GPT-2's MLP with the same parameters, written with F.linear."""

    def __init__(self, old: nn.Module) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = old.c_fc, old.c_proj, old.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(x @ self.c_fc.weight + self.c_fc.bias, approximate="tanh")
        return self.dropout(h @ self.c_proj.weight + self.c_proj.bias)


def make_explicit_mlp(old: nn.Module) -> nn.Module:
    return ExplicitMLP(old)


class UnseededCheckpoint(nn.Module):
    """A hand-made checkpoint wrapper that forgets to replay the RNG state (a planted bug:
    dropout in the recompute draws other masks than the forward did)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(
            self.inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
