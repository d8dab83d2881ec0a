"""The built-in schedule of transformers Llama (``LlamaForCausalLM``, ``LlamaModel``).

This hand-written schedule stays next to the one derived from transformers' plan
(:mod:`torchloom.schedules.hf_plan`) because it keeps the embedding and the head whole
(fewer collectives; the ``loss_parallel`` knob splits an untied head along the
vocabulary, for a loss over split logits), and puts the input-gradient all-reduce of the attention block (the
MLP) on the block, once. The derived schedule sums it once too, with
``sync("bwd_post", "all_reduce", shared=True)`` on q/k/v (gate/up), and adds the
vocabulary-parallel embedding's and head's collectives: at TP=2 with 2 layers, 4 / 4
all-reduces per forward / backward here against the derived 5 (+1 all-gather) / 5
(``tests/test_hf_plan_dist.py`` counts them).

Tensor parallelism gives each rank whole query heads: rank r of ``tp`` keeps query heads
``[r * h / tp, (r + 1) * h / tp)`` of ``h = num_attention_heads``. Grouped-query attention
(``num_key_value_heads = kv < h``) is handled in both of its cases:

* ``kv >= tp`` (``kv % tp == 0``): k_proj and v_proj are column parallel like q_proj;
  rank r keeps the KV heads its query heads use, and nothing else changes.
* ``kv < tp`` (``tp % kv == 0``, multi-query attention ``kv = 1`` included): there are
  fewer KV heads than ranks, so each KV head is *replicated* on the ``tp / kv`` ranks whose
  query heads use it. :func:`replicate_kv_heads` gives rank r KV head ``r * kv // tp`` as a
  :class:`ReplicatedKVProjection`, whose weight records a
  :class:`~torchloom.core.meta.ShardSpec` with ``replicas = tp / kv`` (so ``full_state_dict``,
  ``save`` / ``load`` and ``build`` see the original ``(kv * head_dim, hidden)`` tensor),
  and sets the attention's ``num_key_value_groups`` to the rank's query heads.

  Gradients. Every rank sees the same input, and the full model's gradient of KV head g's
  weight is the sum of the contributions of all query heads using it, which sit on the
  ``tp / kv`` ranks sharing g; each rank computes only its own. So the weight's gradient
  is summed over those ranks and no others: the projection puts its weight into its slot
  of a zero tensor of the full ``(kv * head_dim, hidden)`` shape before use, and its
  ``grad_sum`` child (an identity) carries ``sync("bwd_post", "all_reduce")`` over the
  schedule's group. Slot g of the reduced gradient is then the sum over the ranks holding
  head g (the others add zeros there), and the other slots are dropped. Cost per KV
  projection and backward: one all-reduce of the full k_proj (v_proj) weight, ``kv`` times
  a rank's slice; for ``kv = 1`` no padding is needed. The input's gradient needs nothing
  new: the attention block's ``bwd_post`` all-reduce sums each rank's
  ``dK_r @ W_{g(r)}`` over all ranks, which is the full model's ``sum_g dK_g @ W_g``.

Every size the schedule needs to divide (heads, KV heads, ``intermediate_size``) is
checked before any primitive is applied.

>>> import torch, torchloom as tl, transformers
>>> config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
...     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=64)
>>> sch = tl.create_schedule(transformers.LlamaForCausalLM(config))
>>> schedule_llama(sch, ScheduleConfig(tp=2))  # a world of one: the primitives are recorded
>>> sch.recipe[1].call_text()
"sch['model.layers.0.self_attn.k_proj'].shard('weight', 0)"
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import ModelSizeError, ReplaceError
from ..core.marks import transfer_hooks
from ..core.meta import ShardSpec, copy_meta, get_meta, shard_spec
from ..core.refs import schedule_safe
from ..core.schedule import Schedule
from ._common import (
    SEQ_AXIS,
    check_tp_sizes,
    column,
    finish_layers,
    install_sharded_loss,
    loss_parallel_head,
    node_at,
    region,
    region_syncs,
    row,
    sp_final_norm,
    sp_norms,
    takes,
    tp_divisors,
)
from .config import ScheduleConfig

__all__ = ["schedule_llama", "replicate_kv_heads", "ReplicatedKVProjection", "GradSum",
           "kv_replicas"]


class GradSum(nn.Module):
    """The identity. A schedule puts ``sync("bwd_post", "all_reduce")`` on it, so the
    gradient of what passes through is summed over the schedule's group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _sliced(tensor: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
    """This rank's piece of ``tensor`` (real or meta) as a new Parameter carrying ``spec``
    and the old tensor's tags."""
    with torch.no_grad():
        piece = spec.slice(tensor.detach()).clone()
    new = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    copy_meta(tensor, new)
    get_meta(new).shard = spec
    return new


class ReplicatedKVProjection(nn.Linear):
    """A k_proj / v_proj holding one KV head (``head_dim`` rows) that ``replicas`` ranks
    share: rank r holds head ``r // replicas`` of ``pieces``. Its forward is ``Linear``'s
    on that head; the weight (and bias) pass through :meth:`shared` so that their gradients
    are summed over the sharing ranks (see the module docstring)."""

    pieces: int
    piece: int
    grad_sum: GradSum

    @classmethod
    def from_linear(cls, old: nn.Linear, world_size: int, rank: int,
                    replicas: int) -> ReplicatedKVProjection:
        """The replicated projection of ``old`` (a whole, unsharded ``nn.Linear``) for
        ``rank`` of ``world_size``; allocates only the slice (nothing on meta)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        spec = ShardSpec(axis=0, full_shape=tuple(old.weight.shape), world_size=world_size,
                         rank=rank, replicas=replicas)
        new.in_features = old.in_features
        new.out_features = spec.local_shape()[0]
        new.pieces, new.piece = spec.pieces, spec.piece
        new.weight = _sliced(old.weight, spec)
        if old.bias is not None:
            new.bias = _sliced(old.bias, ShardSpec(
                axis=0, full_shape=tuple(old.bias.shape), world_size=world_size, rank=rank,
                replicas=replicas))
        else:
            new.register_parameter("bias", None)
        new.grad_sum = GradSum()
        new.train(old.training)
        transfer_hooks(old, new)
        return new

    def shared(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this rank's weight or bias), its gradient summed over the ranks
        holding the same KV head: placed in its slot of a zero full-size tensor, passed
        through ``grad_sum`` (all-reduced over the group in backward), sliced back."""
        if self.pieces == 1:  # every rank shares the one KV head (multi-query attention)
            return self.grad_sum(tensor)
        n = tensor.shape[0]
        pad = [0, 0] * (tensor.dim() - 1) + [self.piece * n, (self.pieces - 1 - self.piece) * n]
        summed = self.grad_sum(F.pad(tensor, pad))
        # a copy, so that backward keeps the slice alive rather than the padded tensor
        return summed.narrow(0, self.piece * n, n).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.shared(self.bias) if self.bias is not None else None
        return F.linear(x, self.shared(self.weight), bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kv_head={self.piece} of {self.pieces}"


@schedule_safe
def replicate_kv_heads(old: nn.Module) -> nn.Module:
    """A ``replace`` factory for a Llama attention whose q_proj is already column
    parallel over ``tp`` ranks and which has ``kv < tp`` KV heads (``tp % kv == 0``): a
    copy of the attention whose k_proj and v_proj are :class:`ReplicatedKVProjection` of
    KV head ``rank * kv // tp``, and whose ``num_key_value_groups`` is the rank's number
    of query heads (they all use that one KV head). The rank and ``tp`` come from
    q_proj's shard spec, so the recipe line is the same on every rank."""
    attn: Any = old  # a LlamaAttention: attributes untyped by nn.Module
    path = f"{type(old).__name__} (self_attn)"
    q = shard_spec(attn.q_proj.weight)
    if q is None or q.axis != 0 or q.chunks != 1 or q.replicas != 1:
        raise ReplaceError(
            "replicate_kv_heads takes the rank's query heads from q_proj's shard, but "
            "q_proj is not sharded along its output features",
            path=None, primitive="schedules.llama.replicate_kv_heads",
            values={"module": path, "q_proj_spec": repr(q)},
            fix="shard q_proj first: sch['...self_attn.q_proj'].shard('weight', 0); or let "
            "the built-in schedule do it: schedules.apply_schedule(sch, tp=True)",
        )
    for name in ("k_proj", "v_proj"):
        if shard_spec(getattr(attn, name).weight) is not None:
            raise ReplaceError(
                f"{name} is already sharded; replicate_kv_heads slices the whole projection",
                path=None, primitive="schedules.llama.replicate_kv_heads",
                values={"module": path, name: repr(shard_spec(getattr(attn, name).weight))},
                fix="apply replicate_kv_heads to the attention instead of shard on "
                f"{name} (the built-in schedule does: schedules.apply_schedule(sch, tp=True))",
            )
    tp, rank, head_dim = q.world_size, q.rank, attn.head_dim
    heads, kv = q.full_shape[0] // head_dim, attn.k_proj.out_features // head_dim
    if not (kv < tp and tp % kv == 0):
        raise ReplaceError(
            f"replicate_kv_heads is for fewer KV heads than ranks, shared evenly: {kv} KV "
            f"head(s) at a tensor-parallel degree of {tp}",
            path=None, primitive="schedules.llama.replicate_kv_heads",
            values={"num_key_value_heads": kv, "tp_degree": tp},
            fix="for num_key_value_heads divisible by the degree, shard k_proj and v_proj "
            "like q_proj; schedules.apply_schedule(sch, tp=True) picks the right one",
        )
    new: Any = copy.copy(old)  # a new object, so that replace rebuilds the schedule's children
    new._modules, new._parameters, new._buffers = (
        dict(old._modules), dict(old._parameters), dict(old._buffers))
    replicas = tp // kv
    new.k_proj = ReplicatedKVProjection.from_linear(attn.k_proj, tp, rank, replicas)
    new.v_proj = ReplicatedKVProjection.from_linear(attn.v_proj, tp, rank, replicas)
    new.num_key_value_groups = heads // tp
    return new


def kv_replicas(sch: Schedule) -> int:
    """Check the sizes the Llama TP schedule must split (before any primitive) and return
    how many ranks share each KV head (1: KV heads are sharded like query heads)."""
    config: Any = sch.mod.config  # a LlamaConfig (typed Tensor | Module by nn.Module)
    base = "model." if "model" in sch.child else ""
    attn = f"{base}layers.*.self_attn"
    world = sch.world_size
    heads: int = config.num_attention_heads
    kv: int = getattr(config, "num_key_value_heads", None) or heads
    check_tp_sizes(sch, "llama", [("num_attention_heads", heads, attn, "whole query heads")])
    if kv < world and world % kv == 0:
        replicas = world // kv
    elif kv % world == 0:
        replicas = 1
    else:
        multiples = [m for m in range(2 * kv, heads + 1, kv) if heads % m == 0]
        raise ModelSizeError(
            f"tensor parallelism gives each of the {world} ranks whole KV heads (or, with "
            "fewer KV heads than ranks, one KV head shared by an equal number of ranks), "
            f"and num_key_value_heads={kv} is neither a multiple nor a divisor of {world}",
            path=attn, primitive="schedules.schedule_llama",
            values={"num_key_value_heads": kv, "num_attention_heads": heads,
                    "tp_degree": world},
            fix=f"use a tensor-parallel degree that divides num_key_value_heads "
            f"({tp_divisors(kv)}) or is a multiple of it dividing num_attention_heads "
            f"({multiples}); or a config whose num_key_value_heads is a multiple or a "
            f"divisor of {world}",
        )
    check_tp_sizes(sch, "llama", [("intermediate_size", config.intermediate_size,
                                   f"{base}layers.*.mlp", "an equal share of the MLP's "
                                   "features")])
    return replicas


@takes("tp", "sequence_parallel", "ckpt_ratio", "compile", "loss_parallel")
def schedule_llama(sch: Schedule, config: ScheduleConfig = ScheduleConfig()) -> None:
    """Megatron TP (and SP) over attention (q/k/v -> o) and the gated MLP
    (gate/up -> down), KV heads replicated where there are fewer than ranks, then
    checkpoint the first ``ckpt_ratio`` of the layers.

    The embedding and the head stay whole, or with ``loss_parallel`` the (untied) head is
    column parallel along the vocabulary and its logits stay split: its input gradient is
    all-reduced (``bwd_post``), or under sequence parallelism reduce-scattered by the
    final norm's gather, and the model's loss becomes the vocabulary-parallel chunked one
    (:func:`~torchloom.schedules._common.install_sharded_loss`)."""
    tp, sequence_parallel = config.tp_over(sch), config.sequence_parallel
    base = "model." if "model" in sch.child else ""
    head = None
    if tp:
        replicas = kv_replicas(sch)  # before any primitive: a refusal changes nothing
        if config.loss_parallel:
            head = loss_parallel_head(sch, "schedules.schedule_llama")
        for layer in sch[f"{base}layers.*"]:
            attn = node_at(layer, "self_attn")
            if replicas == 1:
                region(attn, ["q_proj", "k_proj", "v_proj"], "o_proj", sequence_parallel,
                       input_name="hidden_states")
            else:
                column(node_at(attn, "q_proj"))
                row(node_at(attn, "o_proj"))
                attn.replace(replicate_kv_heads)
                for name in ("k_proj", "v_proj"):
                    attn[f"{name}.grad_sum"].sync("bwd_post", "all_reduce")
                region_syncs(attn, "o_proj", sequence_parallel, input_name="hidden_states")
            region(node_at(layer, "mlp"), ["gate_proj", "up_proj"], "down_proj", sequence_parallel)
            if sequence_parallel:
                sp_norms([layer["input_layernorm"], layer["post_attention_layernorm"]])
        if sequence_parallel:
            # Scatter at the first layer, not the embedding: LlamaModel derives positions
            # and the causal mask from the embedding output's sequence length.
            sch[f"{base}layers.0"].sync("fwd_pre", "scatter", axis=SEQ_AXIS,
                                        input_name="hidden_states")
            sp_final_norm(sch[f"{base}norm"], split_head=head is not None)
        if head is not None:
            column(node_at(sch, head))
            if not sequence_parallel:
                sch[head].sync("bwd_post", "all_reduce")
    finish_layers(sch[f"{base}layers"], config)
    if head is not None:
        install_sharded_loss(sch)
