"""Expert parallelism (issue 28) built by ``torchloom.parallelize``, on gloo: two ranks in
one launch (ep 2 over DDP and over FSDP2, Mixtral and Qwen3-MoE, Ergo's per-expert scale in
a submodule of its experts module, a training step, save and resume at another degree,
``save_pretrained`` and ``build(weights=)``, the refusals), four
in another (ep 2 with tp 2; ep 2 inside FSDP2 over 4 ranks, where two ranks hold each
expert and average its gradient).

Each rank trains on its own batch (expert-parallel ranks are data-parallel ranks). The
reference is one process on the same weights: its loss on each rank's batch, and the
gradient of the mean of the ranks' losses (what data parallelism averages). fp32 within
1e-5 relative on logits, loss and every gradient; routing ties do not occur on these
random inputs (top-2 of 4 softmax scores).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import transformers as T
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom.core.errors import ExpertParallelError, LayoutError
from torchloom.parallel import Layout, create_schedule, init_mesh, parallelize
from torchloom.runtime.collectives import count_collectives

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=96, max_position_embeddings=128)
SEQ = 16
TOL = {"rtol": 1e-5, "atol": 2e-6}


def _mixtral(experts: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = T.MixtralConfig(**SIZES, num_local_experts=experts, num_experts_per_tok=2)
    return T.MixtralForCausalLM(cfg).train()


def _qwen3_moe() -> nn.Module:
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    return T.Qwen3MoeForCausalLM(cfg).train()


def _batch(rank: int, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(10 + rank))


def _dp_rank(mesh) -> int:
    return mesh.local_rank("dp") if mesh is not None else 0


def _reference(reference: nn.Module, dp: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The reference's loss on each data-parallel rank's batch, and the gradients of their
    mean."""
    reference.zero_grad()
    losses = [reference(input_ids=_batch(r), labels=_batch(r)).loss for r in range(dp)]
    (sum(losses) / dp).backward()
    return [x.detach() for x in losses], {n: p.grad.clone() for n, p in reference.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _expected(name: str, param: torch.Tensor, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    spec = tl.shard_spec(param)
    ref = grads[name]
    return spec.slice(ref) if spec is not None and tuple(spec.full_shape) == tuple(ref.shape) \
        else ref


def _build(make, layout: Layout):
    reference = make()
    model = copy.deepcopy(reference)
    mesh = init_mesh(layout, device_type="cpu")
    done = parallelize(create_schedule(model, mesh), layout, mesh=mesh)
    return done, reference, mesh


def _step_and_compare(done, reference: nn.Module, mesh, *, optimizer_step: bool = True) -> None:
    layout = done.layout
    dp = _dp_rank(mesh)
    ids = _batch(dp)
    with count_collectives() as counts:
        out = done.model(input_ids=ids, labels=ids)
    out.loss.backward()
    done.reduce_gradients()
    losses, grads = _reference(reference, layout.dp)
    torch.testing.assert_close(out.loss.detach(), losses[dp], rtol=1e-5, atol=1e-6)
    layers = reference.config.num_hidden_layers
    assert counts["all_to_all"] == 2 * layers, dict(counts)  # tokens there and back per layer
    for name, p in done.module.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(_full(p.grad), _expected(name, p, grads), **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if not optimizer_step:
        return
    # one SGD step on both: the weights stay equal (Adam's first step divides each
    # gradient by its own magnitude, so a gradient of 1e-10 rounding noise becomes a step
    # of lr: not a comparison of the gradients)
    opt = torch.optim.SGD(done.module.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt.step()
    ref_opt.step()
    after = dict(reference.named_parameters())
    for name, p in done.module.named_parameters():
        torch.testing.assert_close(_full(p.detach()), _expected(name, p, {
            n: t.detach() for n, t in after.items()}), **TOL,
            msg=lambda m, name=name: f"after the step, {name}: {m}")


def _check_ep_alone(rank: int) -> None:
    """ep 2 over two DDP replicas and over two FSDP2 shards, Mixtral and Qwen3-MoE: each
    rank keeps 2 of the 4 experts; loss, every gradient and one SGD step equal one
    process."""
    for make in (_mixtral, _qwen3_moe):
        for layout in (Layout(dp_replicate=2, ep=2, seq_len=SEQ),
                       Layout(dp_shard=2, ep=2, seq_len=SEQ)):
            done, reference, mesh = _build(make, layout)
            experts = done.module.model.layers[0].mlp.experts
            assert experts.gate_up_proj.shape[0] == 2 and experts.num_experts == 2
            assert done.experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
            assert done.groups["experts"] == "ep"
            _step_and_compare(done, reference, mesh)


def _ergo() -> nn.Module:
    torch.manual_seed(0)
    cfg = T.ErgoConfig(**{k: v for k, v in SIZES.items() if k != "intermediate_size"},
                       first_dense_intermediate_size=64, moe_intermediate_size=48,
                       shared_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                       sliding_window=8)
    model = T.ErgoForCausalLM(cfg).train()
    with torch.no_grad():  # one RMSNorm scale per expert, each different (not the ones)
        for layer in model.model.layers:
            norm = getattr(getattr(layer.mlp, "experts", None), "post_expert_norm", None)
            if norm is not None:
                norm.weight.copy_(torch.rand(norm.weight.shape) + 0.5)
    return model


def _check_expert_tensor_in_a_submodule(rank: int) -> None:
    """Ergo's experts module applies a per-expert RMSNorm scale through a submodule of its
    own (``post_expert_norm.weight``, one row per expert, indexed by the local expert ids
    the dispatch hands it): each rank keeps its experts' rows, so the loss and every
    gradient equal one process (before, the scale stayed whole and rank 1's experts used
    experts 0 and 1's rows)."""
    if not hasattr(T, "ErgoForCausalLM"):
        return
    done, reference, mesh = _build(_ergo, Layout(dp_replicate=2, ep=2, seq_len=SEQ))
    experts = done.module.model.layers[1].mlp.experts
    spec = tl.shard_spec(experts.post_expert_norm.weight)
    assert experts.post_expert_norm.weight.shape[0] == 2 and spec.full_shape[0] == 4
    assert "model.layers.1.mlp.experts.post_expert_norm.weight" in {
        n for n, p in done.module.named_parameters() if p in set(done.expert_parameters())}
    dp = _dp_rank(mesh)
    out = done.model(input_ids=_batch(dp), labels=_batch(dp))
    out.loss.backward()
    done.reduce_gradients()
    losses, grads = _reference(reference, 2)
    torch.testing.assert_close(out.loss.detach(), losses[dp], rtol=1e-5, atol=1e-6)
    for name, p in done.module.named_parameters():
        torch.testing.assert_close(_full(p.grad), _expected(name, p, grads), **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _check_gather_and_save(root: str, rank: int) -> None:
    """full_state_dict / save_pretrained write the single-process keys and full shapes; tl.save at
    ep 2 resumes at ep 1 (DDP) with the same tensors; build(weights=) at ep 2 reads each
    rank's experts of a save_pretrained folder."""
    done, reference, mesh = _build(_mixtral, Layout(dp_replicate=2, ep=2, seq_len=SEQ))
    full = tl.full_state_dict(done.module)
    expected = reference.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)
    folder = os.path.join(root, "pretrained")
    tl.save_pretrained(done.module, folder)
    dist.barrier()
    loaded = T.MixtralForCausalLM.from_pretrained(folder)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    # a checkpoint at ep 2, after one step, resumed at ep 1
    ids = _batch(_dp_rank(mesh))
    opt = torch.optim.AdamW(done.module.parameters(), lr=1e-2)
    done.model(input_ids=ids, labels=ids).loss.backward()
    done.reduce_gradients()
    opt.step()
    ckpt = os.path.join(root, "ckpt")
    tl.save(done.module, opt, ckpt, step=1)
    trained = tl.full_state_dict(done.module)
    other, _, _ = _build(_mixtral, Layout(dp_replicate=2, ep=1, seq_len=SEQ))
    opt2 = torch.optim.AdamW(other.module.parameters(), lr=1e-2)
    tl.load(other.module, opt2, ckpt)
    for key, value in tl.full_state_dict(other.module).items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
    # build(weights=) of the folder at ep 2: each rank's experts, read from the files
    layout = Layout(dp_replicate=2, ep=2, seq_len=SEQ)
    mesh = init_mesh(layout, device_type="cpu")
    with tl.init_empty_weights():
        empty = T.MixtralForCausalLM(loaded.config)
    built = parallelize(create_schedule(empty, mesh), layout, mesh=mesh, weights=folder)
    mine = built.module.model.layers[1].mlp.experts.down_proj
    spec = tl.shard_spec(mine)
    assert spec.world_size == 2 and spec.rank == mesh.local_rank("ep")
    torch.testing.assert_close(mine.detach(), spec.slice(expected["model.layers.1.mlp.experts.down_proj"]),
                               rtol=0, atol=0)


def _check_train(root: str, rank: int) -> None:
    """``torchloom train --dp 2 --ep 2`` on a Mixtral folder trains as ``--dp 2``: the
    same losses, with the global gradient norm clipped (the experts' part summed over
    the ep group), and a checkpoint of the ep run resumes at ep 1."""
    from torchloom.apps.train import TrainConfig, train_rank

    folder = os.path.join(root, "mixtral")
    if rank == 0:
        torch.manual_seed(0)
        cfg = T.MixtralConfig(**{**SIZES, "vocab_size": 256}, num_local_experts=4,
                              num_experts_per_tok=2)
        T.MixtralForCausalLM(cfg).save_pretrained(folder)
    dist.barrier()
    common = dict(model=folder, steps=4, batch_size=4, seq_len=32, progress=False,
                  clip_grad=0.05, save_every=2, save_dir=os.path.join(root, "runs"))
    ep = train_rank(rank, TrainConfig(dp=2, ep=2, **common))
    dp = train_rank(rank, TrainConfig(dp=2, **{**common, "save_dir": os.path.join(root, "dp")}))
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(dp["losses"]),
                               rtol=1e-5, atol=0)
    dist.barrier()
    if rank == 0:  # as if the ep run had stopped after step 2
        shutil.rmtree(os.path.join(root, "runs", "step-4"))
    dist.barrier()
    resumed = train_rank(rank, TrainConfig(dp=2, resume=True, **common))
    assert resumed["first_step"] == 3, resumed["first_step"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(ep["losses"][2:]),
                               rtol=1e-5, atol=0)


def _check_verify(rank: int) -> None:
    """Verify compares an expert-parallel model module by module with the original (the
    ranks route the same tokens; each expert's gradient is its ranks' sum over them), and
    names the experts module of a wrong schedule."""
    layout = Layout(dp_replicate=2, ep=2, seq_len=SEQ)
    mesh = init_mesh(layout, device_type="cpu")
    ids = _batch(rank)  # different on each rank: Verify makes them the same
    batch = {"input_ids": ids, "labels": ids}
    model = _qwen3_moe()
    sch = create_schedule(model, mesh)
    with tl.Verify(sch, batch) as verify:
        sch.expert_parallel(mesh.group("ep"))
    assert verify.stats["parameter gradient"] == len(list(model.parameters()))
    assert verify.stats["forward output"] >= 20, verify.stats
    model = _mixtral()
    sch = create_schedule(model, mesh)
    with pytest.raises(tl.VerificationError, match=r"model\.layers\.1\.mlp\.experts"):
        with tl.Verify(sch, batch):
            sch.expert_parallel(mesh.group("ep"))
            # a wrong schedule: the experts of layer 1 use another activation
            sch["model.layers.1.mlp.experts.act_fn"].replace(nn.ReLU())


def _check_refusals(rank: int) -> None:
    """A degree that does not divide the experts, a model without experts, and a layout
    whose ep does not divide the data-parallel ranks are refused, naming the fix."""
    layout = Layout(dp_replicate=2, ep=2, seq_len=SEQ)
    with pytest.raises(ExpertParallelError, match=r"3 experts of 'model.layers.0.mlp.experts' "
                       r"do not split evenly over 2 expert-parallel ranks") as err:
        _build(functools.partial(_mixtral, 3), layout)
    assert "an expert-parallel degree that divides 3" in str(err.value)
    torch.manual_seed(0)
    with pytest.raises(ExpertParallelError, match="no mixture-of-experts module under "
                       "LlamaForCausalLM") as err:
        _build(lambda: T.LlamaForCausalLM(T.LlamaConfig(**SIZES)), layout)
    assert "train without expert parallelism (ep=1)" in str(err.value)
    with pytest.raises(LayoutError, match="do not divide them"):
        Layout(dp_shard=2, ep=4)


def _check_ep_with_tp(rank: int) -> None:
    """ep 2 x tp 2 (4 ranks; the experts replicated over the tensor-parallel ranks, split
    over the expert-parallel ones): Mixtral equals one process."""
    done, reference, mesh = _build(_mixtral, Layout(dp_replicate=2, tp=2, ep=2, seq_len=SEQ))
    assert done.module.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2
    _step_and_compare(done, reference, mesh, optimizer_step=False)


def _check_ep_in_fsdp4(root: str, rank: int) -> None:
    """ep 2 inside FSDP2 over 4 ranks: two ep groups, each expert held by two ranks and
    FSDP2-sharded between them (its gradient averaged over them); Qwen3-MoE equals one
    process after a step, gathers to the single-process state and resumes at ep 1."""
    done, reference, mesh = _build(_qwen3_moe, Layout(dp_shard=4, ep=2, seq_len=SEQ))
    assert mesh.size("ep_replicas") == 2
    # FSDP2 shards each rank's 2 experts again over the 2 ranks holding them
    gate_up = done.module.model.layers[0].mlp.experts.gate_up_proj
    assert type(gate_up).__name__ == "DTensor" and gate_up.to_local().shape[0] == 1
    assert gate_up.full_tensor().shape[0] == 2
    _step_and_compare(done, reference, mesh)
    # gathered, and saved then loaded at ep 1: the single-process tensors
    full = tl.full_state_dict(done.module)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=2e-6, msg=key)
    ckpt = os.path.join(root, "ep-fsdp4")
    opt = torch.optim.SGD(done.module.parameters(), lr=0.1)
    tl.save(done.module, opt, ckpt, step=1)
    other, _, _ = _build(_qwen3_moe, Layout(dp_shard=4, seq_len=SEQ))
    tl.load(other.module, torch.optim.SGD(other.module.parameters(), lr=0.1), ckpt)
    for key, value in tl.full_state_dict(other.module).items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)


def test_expert_parallel_on_two_ranks(tmp_path):
    spawn(_check_ep_alone, _check_expert_tensor_in_a_submodule,
          functools.partial(_check_gather_and_save, str(tmp_path)),
          functools.partial(_check_train, str(tmp_path)), _check_verify, _check_refusals,
          timeout_s=300)


def test_expert_parallel_on_four_ranks(tmp_path):
    spawn(_check_ep_with_tp, functools.partial(_check_ep_in_fsdp4, str(tmp_path)), world=4,
          timeout_s=300)
