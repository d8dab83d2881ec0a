"""The ``expert_parallel`` primitive in one process (issue 28): which modules it finds (from
transformers' ``base_model_ep_plan`` or from the module structure), the dispatch with a
group of one (every experts implementation transformers offers, a user's own experts
module, "zero" experts outside the range), the must-fail cases with their messages
pinned, and the Layout's expert-parallel rules. The multi-rank behaviour is in
tests/test_expert_parallel_dist.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import torchloom as tl
from torchloom.core.errors import ExpertParallelError, LayoutError
from torchloom.core.meta import ShardSpec, get_meta
from torchloom.parallel import Layout
from torchloom.primitives.expert_parallel import experts_modules, num_experts_of
from torchloom.runtime.collectives import count_collectives
from torchloom.runtime.expert_dispatch import EPState, dispatch, expert_params

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=96)


def _mixtral(impl: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(**SIZES, num_local_experts=4,
                                                 num_experts_per_tok=2)).train()
    model.config._experts_implementation = impl
    return model


def _qwen3_moe(impl: str = "eager") -> nn.Module:
    torch.manual_seed(0)
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=48)).train()
    model.config._experts_implementation = impl
    return model


class OwnExperts(nn.Module):
    """A user's experts module: no transformers plan, the routing signature, weights
    stacked per expert, and a shared (not per-expert) scale."""

    def __init__(self, experts: int = 4, hidden: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.w = nn.Parameter(torch.randn(experts, hidden, hidden))
        self.bias = nn.Parameter(torch.randn(experts, hidden))
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            ids = top_k_index[:, slot]
            keep = ids < self.num_experts  # ids past the range: "zero" experts
            safe = ids.clamp(max=self.num_experts - 1)
            y = torch.einsum("nh,noh->no", hidden_states, self.w[safe]) + self.bias[safe]
            out = out + (y * self.scale) * (top_k_weights[:, slot] * keep)[:, None]
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 4)
        self.experts = OwnExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        weights, index = probs.topk(2, dim=-1)
        return self.experts(x, index, weights)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [_mixtral, _qwen3_moe])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_one_rank_equals_the_model(make, impl):
    """With a group of one the dispatch runs (sort, the module's own forward with local ids
    and unit weights, the weighted sum in expert order) and equals the model exactly
    enough: logits, loss and every gradient within 1e-5 relative."""
    reference = make(impl)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch.expert_parallel()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    with count_collectives() as counts:
        out = model(input_ids=ids, labels=ids)
    ref = reference(input_ids=ids, labels=ids)
    assert not counts  # a group of one exchanges nothing
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    ref.loss.backward()
    mine, theirs = _grads(model), _grads(reference)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)


def test_finds_the_plan_modules_and_a_users_own():
    """Mixtral's experts come from its base_model_ep_plan; a model without a plan is
    searched by structure (the routing signature and a per-expert weight); the split
    tensors are those with one entry per expert (not the shared scale)."""
    model = _mixtral()
    assert [name for name, _ in experts_modules(model)] == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert expert_params(model.model.layers[0].mlp.experts, 4) == ["gate_up_proj", "down_proj"]
    block = Block()
    assert [name for name, _ in experts_modules(block)] == ["experts"]
    assert expert_params(block.experts, 4) == ["w", "bias"]
    assert num_experts_of(block.experts) == 4


class ScaledExperts(OwnExperts):
    """Experts with one output scale per expert held by a submodule (as Ergo's
    ``post_expert_norm``), indexed by the expert ids the module is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.rand(4, 6) + 0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            ids = top_k_index[:, slot]
            y = torch.einsum("nh,noh->no", hidden_states, self.w[ids]) * self.norm.weight[ids]
            out = out + y * top_k_weights[:, slot, None]
        return out


def test_a_per_expert_tensor_of_a_submodule_is_split():
    """A tensor with one entry per expert in a submodule of the experts module is split
    with the experts (each rank's rows: the module indexes it with local expert ids)."""
    torch.manual_seed(0)
    block = Block()
    block.experts = ScaledExperts()
    assert expert_params(block.experts, 4) == ["w", "bias", "norm.weight"]
    reference = copy.deepcopy(block)
    tl.create_schedule(block)["experts"].expert_parallel()
    spec = tl.shard_spec(block.experts.norm.weight)
    assert spec is not None and spec.full_shape == (4, 6)
    assert tl.shard_spec(block.experts.scale) is None  # shared: stays whole
    x = torch.randn(5, 6)
    torch.testing.assert_close(block(x), reference(x), rtol=1e-6, atol=1e-6)


def test_a_users_experts_and_zero_experts():
    """A user's own experts module at the path: its output and gradients are kept, and a
    token routed past the last expert (a "zero" expert) contributes nothing, as in the
    module's own forward."""
    torch.manual_seed(0)
    reference = Block()
    model = copy.deepcopy(reference)
    tl.create_schedule(model)["experts"].expert_parallel()
    assert tl.shard_spec(model.experts.w).full_shape == (4, 6, 6)
    assert tl.shard_spec(model.experts.scale) is None
    x = torch.randn(5, 6)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)
    index = torch.tensor([[0, 4], [3, 1], [4, 4], [2, 0], [1, 3]])  # 4: a zero expert
    weights = torch.rand(5, 2)
    state = EPState(group=None, size=1, rank=0, num_experts=4)
    out = dispatch(OwnExperts.forward, model.experts, x, index, weights, state)
    torch.testing.assert_close(out, reference.experts(x, index, weights), rtol=1e-6, atol=1e-6)
    assert out[2].abs().max() == 0


def test_refuses_a_model_without_experts():
    model = T.LlamaForCausalLM(T.LlamaConfig(**SIZES))
    with pytest.raises(ExpertParallelError) as err:
        tl.create_schedule(model).expert_parallel()
    assert str(err.value) == (
        "sch[''].expert_parallel(...): no mixture-of-experts module under LlamaForCausalLM: "
        "nothing is called as experts(hidden_states, top_k_index, top_k_weights) with weights "
        "stacked per expert\n"
        "    values: module='LlamaForCausalLM'\n"
        "    fix: apply it at a model with experts (Mixtral, Qwen3-MoE, ...), or train without "
        "expert parallelism (ep=1)")


def test_refuses_twice_and_split_experts():
    model = _mixtral()
    sch = tl.create_schedule(model)
    sch["model.layers.0"].expert_parallel()
    with pytest.raises(ExpertParallelError, match=r"the experts of 'model.layers.0.mlp.experts' "
                       r"are already spread over ranks") as err:
        sch.expert_parallel()
    assert "apply expert_parallel once" in str(err.value)
    # experts a tensor-parallel plan split (moe_tp_experts) cannot be split by expert too
    model = _mixtral()
    weight = model.model.layers[0].mlp.experts.down_proj
    get_meta(weight).shard = ShardSpec(axis=1, full_shape=tuple(weight.shape), world_size=2,
                                       rank=0)
    with pytest.raises(ExpertParallelError) as err:
        tl.create_schedule(model).expert_parallel()
    message = str(err.value)
    assert "model.layers.0.mlp.experts.down_proj is already split (tensor parallelism splits " \
           "each expert; FSDP2 shards it): expert parallelism needs the experts whole" in message
    assert "do not split the experts with the tensor-parallel plan" in message


def test_refuses_other_calls():
    model = Block()
    tl.create_schedule(model)["experts"].expert_parallel()
    x = torch.randn(3, 6)
    with pytest.raises(ExpertParallelError) as err:
        model.experts(x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), "extra")
    assert str(err.value) == (
        "sch['experts'].expert_parallel(...): the experts module was called with other "
        "arguments than the routing ones\n"
        "    values: positional=4, keywords=[], routing=['top_k_index', 'top_k_weights']\n"
        "    fix: expert parallelism dispatches (hidden_states, top_k_index, top_k_weights) "
        "only; train this model without it (ep=1)")
    # the routing arguments by name are the same call
    ids, w = torch.randint(0, 4, (3, 2)), torch.rand(3, 2)
    torch.testing.assert_close(model.experts(x, top_k_index=ids, top_k_weights=w),
                               model.experts(x, ids, w))
    with pytest.raises(ExpertParallelError, match="routing tensors of unexpected shapes") as err:
        model.experts(x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 1))
    assert "top_k_weights=(3, 1)" in str(err.value)


def test_layout_expert_parallel_rules():
    """ep folds into the data-parallel ranks: inside dp_shard (FSDP2, HSDP) or
    dp_replicate (DDP); not with context parallelism or a pipeline yet."""
    assert Layout(dp_replicate=2, ep=2).describe() == "tp1 ep2 dp2(ddp) mb1 ckpt0 fp32"
    assert Layout(dp_replicate=2, dp_shard=4, ep=4).world == 8
    with pytest.raises(LayoutError) as err:
        Layout(dp_shard=4, ep=3)
    assert str(err.value) == (
        "Layout(...): ep=3 expert-parallel ranks are data-parallel ranks (of dp_shard = 4), "
        "and they do not divide them\n"
        "    values: ep=3, dp_replicate=1, dp_shard=4\n"
        "    fix: Layout(dp_shard=4, ep=4), or dp_shard a multiple of 3")
    with pytest.raises(LayoutError, match=r"of dp_shard = 2, inside one HSDP replica"):
        Layout(dp_replicate=2, dp_shard=2, ep=4)
    # with context parallelism: ep groups of each context-parallel position
    assert Layout(dp_replicate=2, ep=2, cp=2, seq_len=16).describe() == \
        "tp1 cp2 ep2 dp2(ddp) mb1 ckpt0 fp32"
    # inside a pipeline: each stage's experts over the stage's data-parallel ranks
    assert Layout(dp_replicate=2, ep=2, pp=2, n_microbatches=2).describe() == \
        "tp1 ep2 pp2(1F1B x2) dp2(ddp) mb1 ckpt0 fp32"


def test_gpt_oss_routing_names():
    """gpt-oss calls its experts with (hidden_states, router_indices, routing_weights): the
    same (tokens, k) ids and weights under other names, found and dispatched alike."""
    from torchloom.primitives.expert_parallel import experts_modules

    torch.manual_seed(0)
    cfg = T.GptOssConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=64, num_local_experts=4, num_experts_per_tok=2)
    model = T.GptOssForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    before = model(ids).logits
    tl.create_schedule(model).expert_parallel()
    assert [n for n, _ in experts_modules(model)] == ["model.layers.0.mlp.experts",
                                                      "model.layers.1.mlp.experts"]
    torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-6)
    experts = model.model.layers[0].mlp.experts
    x, w = torch.randn(3, 32), torch.rand(3, 2)
    idx = torch.randint(0, 4, (3, 2))
    torch.testing.assert_close(experts(x, router_indices=idx, routing_weights=w),
                               experts(x, idx, w))
