"""Context parallelism (issue 28) built by ``torchloom.parallelize``, on gloo: two ranks in
one launch (cp 2 alone, and with FSDP2 over the cp ranks alone), four in another (cp 2
with tp 2, with and without sequence parallelism, with FSDP2 over dp_shard x cp, and in a
pipeline).

Each layout is compared with one process on the same batch (64 tokens, a padded row and
ignored labels): the loss on every rank, the logits gathered back into token order, and
every gradient after the layout's reduction (DDP over the context-parallel ranks, or
FSDP2's reduce-scatter over ``dp_shard x cp``), fp32 within 1e-5 relative. Llama (causal)
and Mistral (a sliding window of 24 tokens, shorter than the sequence: the gathered keys
are masked by distance too) from their default configs with the sizes changed.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import transformers as T
from torch import nn

import torchloom as tl
from tests.dist import spawn
from tests.helpers import assert_grads_match
from torchloom.core.errors import ContextParallelError
from torchloom.core.marks import CONTEXT_PARALLEL, get_mark
from torchloom.ops.context_parallel import gather_sequence
from torchloom.parallel import Layout, create_schedule, init_mesh, parallelize
from torchloom.plan.tracking import Tracker
from torchloom.runtime.collectives import count_collectives

LAYERS = 2
SEQ = 64
SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=LAYERS, vocab_size=96, max_position_embeddings=128)
TOL = {"rtol": 1e-5, "atol": 2e-6}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**SIZES)).train()


def _mistral() -> nn.Module:
    torch.manual_seed(0)
    return T.MistralForCausalLM(T.MistralConfig(**SIZES, sliding_window=24)).train()


def _batch(padded: bool, vocab: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    batch = {"input_ids": ids, "labels": labels}
    if padded:
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[1, 50:] = 0
        labels[1, 50:] = -100
        batch["attention_mask"] = mask
    return batch


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _compare(done, reference: nn.Module, padded: bool) -> dict[str, int]:
    """Forward and backward of the built model and of ``reference``; returns the forward's
    collective counts."""
    batch = _batch(padded)
    with count_collectives() as forward:
        out = done.model(**batch)
    out.loss.backward()
    ref = reference(**batch)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=1e-7)
    state = get_mark(done.module, CONTEXT_PARALLEL)
    logits = gather_sequence(out.logits.detach(), state)
    if done.vocab_sharded:  # the head's columns: compare this rank's slice
        ref_logits = ref.logits.chunk(done.layout.tp, dim=-1)[dist.get_rank(done.loss_group)]
    else:
        ref_logits = ref.logits
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    torch.testing.assert_close(logits[keep], ref_logits.detach()[keep], **TOL)
    assert_grads_match(done.module, reference, **TOL)
    return dict(forward)


def _sgd_step_matches(done, reference: nn.Module) -> None:
    """One SGD step on the built model's (sharded) parameters equals one on ``reference``,
    both holding the gradients of the same step."""
    opt = torch.optim.SGD(done.model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt.step()
    ref_opt.step()
    ref_params = dict(reference.named_parameters())
    for name, param in done.module.named_parameters():
        torch.testing.assert_close(_full(param.detach()), ref_params[name].detach(), **TOL)


def _build(reference: nn.Module, layout: Layout):
    model = copy.deepcopy(reference)
    mesh = init_mesh(layout, device_type="cpu")
    return parallelize(create_schedule(model, mesh), layout, mesh=mesh)


def _check_cp_alone(rank: int) -> None:
    for make in (_llama, _mistral):
        for padded in (False, True):
            reference = make()
            done = _build(reference, Layout(cp=2, seq_len=SEQ))
            assert done.groups["context"] == "cp"
            assert isinstance(done.model, nn.parallel.DistributedDataParallel)
            forward = _compare(done, reference, padded)
            # keys and values gathered once per layer; the loss summed once
            assert forward == {"all_gather": 2 * LAYERS, "all_reduce": 1}, forward
            assert done.module.config._attn_implementation == "torchloom_context_parallel"


FAMILIES = ("llama", "qwen2", "qwen2_mqa", "mistral", "gemma", "phi3", "qwen3", "olmo2",
            "starcoder2", "mixtral", "qwen2_moe", "minicpm3")


def _check_families(rank: int) -> None:
    """Every causal-LM family of the transformers-plan tests, from its default config with
    the sizes changed: cp 2 equals one process (loss, logits, gradients)."""
    from tests import hf_plan_models as H

    for name in FAMILIES:
        torch.manual_seed(0)
        reference = getattr(H, name)().train()
        done = _build(reference, Layout(cp=2, seq_len=SEQ))
        try:
            _compare(done, reference, padded=False)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _check_verify(rank: int) -> None:
    """Verify compares a context-parallel model module by module with the original: each
    rank's positions of every activation, the gradients, and names the first module that
    differs when the schedule is wrong."""
    from torchloom.ops.context_parallel import CPState

    layout = Layout(cp=2, seq_len=SEQ)
    mesh = init_mesh(layout, device_type="cpu")
    batch = _batch(padded=True)
    model = _mistral()
    sch = create_schedule(model, mesh)
    with tl.Verify(sch, batch) as verify:
        sch.context_parallel(mesh.group("cp"))
    assert verify.stats["forward output"] >= 20, verify.stats
    assert verify.stats["parameter gradient"] == len(list(model.parameters()))
    assert verify.stats["input gradient"] >= 10, verify.stats
    model = _mistral()
    sch = create_schedule(model, mesh)
    with pytest.raises(tl.VerificationError, match=r"sch\['model.layers.0.self_attn.o_proj'\]"
                       r"(.|\n)*the forward output differs"):
        with tl.Verify(sch, batch):
            sch.context_parallel(mesh.group("cp"))
            # a bug: the first layer's attention takes the other rank's positions
            attn = model.model.layers[0].self_attn
            state = get_mark(attn, CONTEXT_PARALLEL)
            wrong = CPState(state.group, state.size, 1 - state.rank, state.path)
            tl.core.marks.set_mark(attn, CONTEXT_PARALLEL, wrong)


def _check_cp_refusals(rank: int) -> None:
    done = _build(_llama(), Layout(cp=2, seq_len=SEQ))
    with pytest.raises(ContextParallelError, match=r"a sequence of 30 tokens does not split "
                       r"into 2 x 2 equal chunks"):
        done.model(input_ids=torch.zeros(1, 30, dtype=torch.long))
    with pytest.raises(ContextParallelError, match=r"takes a \(batch, seq\) padding mask"):
        done.model(input_ids=torch.zeros(1, 8, dtype=torch.long),
                   attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))


def _check_train(rank: int) -> None:
    from torchloom.apps.train import TrainConfig, train_rank

    common = dict(model="llama", steps=2, batch_size=2, seq_len=32, progress=False)
    cp = train_rank(rank, TrainConfig(cp=2, **common))
    dp = train_rank(rank, TrainConfig(dp=2, **common))
    # cp 2 splits each sequence; dp 2 splits the batch: one step, the same gradients
    torch.testing.assert_close(torch.tensor(cp["losses"]), torch.tensor(dp["losses"]),
                               rtol=1e-5, atol=0)


def _check_resume(root: str, rank: int) -> None:
    """A cp 2 run's checkpoint resumes at dp 2 (another layout) where the cp run went on."""
    from torchloom.apps.train import TrainConfig, train_rank

    common = dict(model="llama", steps=4, batch_size=2, seq_len=32, progress=False,
                  save_every=2, save_dir=root)
    whole = train_rank(rank, TrainConfig(cp=2, **common))
    dist.barrier()
    if rank == 0:  # as if the run had stopped after step 2
        shutil.rmtree(os.path.join(root, "step-4"))
    dist.barrier()
    resumed = train_rank(rank, TrainConfig(dp=2, resume=True, **common))
    assert resumed["first_step"] == 3, resumed["first_step"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][2:]),
                               rtol=1e-5, atol=0)


def _check_cp_with_tp(rank: int) -> None:
    for make in (_llama, _mistral):
        for sp in (False, True):
            reference = make()
            done = _build(reference, Layout(cp=2, tp=2, sp=sp, seq_len=SEQ))
            _compare(done, reference, padded=sp)


def _check_cp_with_fsdp(rank: int) -> None:
    reference = _llama()
    layout = Layout(cp=2, dp_shard=2, seq_len=SEQ)
    done = _build(reference, layout)
    assert done.mesh.fsdp_mesh.mesh_dim_names == ("dp_shard_cp",)
    # FSDP2's batch: this rank's data-parallel share; the reference runs the same rows
    # and the shards average over dp_shard x cp, so compare with the rows' own gradient
    # averaged over the two data-parallel ranks: give both the same rows here
    _compare(done, reference, padded=True)
    _sgd_step_matches(done, reference)  # on the shards, as on the whole model


def _check_cp_sharded(root: str, rank: int) -> None:
    """FSDP2 over the context-parallel ranks alone (``shard_cp``, dp_shard 1: torchtitan's
    layout): each rank holds half of every weight, the step equals one process, and an
    optimizer step on the shards equals one on the whole model; ``torchloom train --cp 2
    --dp-mode fsdp`` trains as DDP over the cp ranks does, and its checkpoint resumes
    there."""
    from torch.distributed.tensor import DTensor

    from torchloom.apps.train import TrainConfig, train_rank

    reference = _llama()
    layout = Layout(cp=2, shard_cp=True, seq_len=SEQ)
    done = _build(reference, layout)
    assert done.fsdp and done.layout.dp_mode == "fsdp"
    assert done.mesh.fsdp_mesh.mesh_dim_names == ("dp_shard_cp",)
    # FSDP2's group is not the cp exchange's (here both are the whole world)
    assert done.mesh.shard_group() is not done.mesh.group("cp")
    params = list(done.module.parameters())
    assert params and all(isinstance(p, DTensor) for p in params)
    whole = sum(p.numel() for p in reference.parameters())
    assert sum(p.to_local().numel() for p in params) <= whole // 2 + 64
    batch = _batch(padded=True)
    tracker = Tracker({done.mesh.group("cp").group_name: "cp",
                       done.mesh.shard_group().group_name: "fsdp"})
    with tracker:
        out = done.model(**batch)
        out.loss.backward()
    kinds = Counter((c.kind, c.group) for c in tracker.collectives)
    # the keys and values over the cp group (gathered in forward, their gradients
    # reduce-scattered), the weights' all-gathers and the gradients' reduce-scatters over
    # FSDP2's: the layers and the root in forward, the layers again for backward (the root
    # stays gathered)
    units = LAYERS + 1
    assert kinds[("all_gather", "cp")] == kinds[("reduce_scatter", "cp")] == 2 * LAYERS, kinds
    assert kinds[("all_gather", "fsdp")] == units + LAYERS, kinds
    assert kinds[("reduce_scatter", "fsdp")] == units, kinds
    ref = reference(**batch)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-6, atol=1e-7)
    assert_grads_match(done.module, reference, **TOL)
    _sgd_step_matches(done, reference)
    common = dict(model="llama", steps=4, batch_size=2, seq_len=32, progress=False)
    sharded = train_rank(rank, TrainConfig(cp=2, dp_mode="fsdp", save_every=2, save_dir=root,
                                           **common))
    replicas = train_rank(rank, TrainConfig(cp=2, **common))
    torch.testing.assert_close(torch.tensor(sharded["losses"]),
                               torch.tensor(replicas["losses"]), rtol=1e-5, atol=0)
    # every rank wrote its shards; the checkpoint resumes as DDP over the cp ranks
    dist.barrier()
    if rank == 0:  # as if the run had stopped after step 2
        shutil.rmtree(os.path.join(root, "step-4"))
    dist.barrier()
    resumed = train_rank(rank, TrainConfig(cp=2, resume=True, save_dir=root, **common))
    assert resumed["first_step"] == 3
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(sharded["losses"][2:]), rtol=1e-5, atol=0)


def _check_cp_in_pipeline(root: str, rank: int) -> None:
    """pp 2 x cp 2: each stage's sequences split over its two context-parallel ranks (the
    first stage given this rank's positions and their position ids, the last computing
    the loss of the whole sequences' shifted targets, summed over the group). It trains
    as pp 2 x dp 2 on the same batch (losses, evaluation, the gradient norm clipped), and
    its checkpoint resumes at pp 2 x dp 2. With each stage FSDP2-sharded over its
    context-parallel ranks it trains the same."""
    from torchloom.apps.train import TrainConfig, train_rank

    common = dict(model="llama", steps=4, batch_size=4, seq_len=32, progress=False, pp=2,
                  n_microbatches=2, clip_grad=0.05, eval_every=2, save_every=2)
    cp = train_rank(rank, TrainConfig(cp=2, save_dir=os.path.join(root, "cp"), **common))
    dp = train_rank(rank, TrainConfig(dp=2, save_dir=os.path.join(root, "dp"), **common))
    torch.testing.assert_close(torch.tensor(cp["losses"]), torch.tensor(dp["losses"]),
                               rtol=1e-5, atol=0)
    # each stage FSDP2-sharded over its two context-parallel ranks (shard_cp)
    sharded = train_rank(rank, TrainConfig(cp=2, dp_mode="fsdp", **{**common, "steps": 2,
                                                                   "save_every": 0}))
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(dp["losses"][:2]),
                               rtol=1e-5, atol=0)
    assert cp["eval_losses"].keys() == dp["eval_losses"].keys() == {2, 4}
    for step, value in cp["eval_losses"].items():
        torch.testing.assert_close(torch.tensor(value), torch.tensor(dp["eval_losses"][step]),
                                   rtol=1e-5, atol=0)
    dist.barrier()
    if rank == 0:  # as if the cp run had stopped after step 2
        shutil.rmtree(os.path.join(root, "cp", "step-4"))
    dist.barrier()
    resumed = train_rank(rank, TrainConfig(dp=2, resume=True, save_dir=os.path.join(root, "cp"),
                                           **common))
    assert resumed["first_step"] == 3
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(cp["losses"][2:]),
                               rtol=1e-5, atol=0)


def test_context_parallel_on_two_ranks(tmp_path):
    spawn(_check_cp_alone, _check_families, _check_verify, _check_cp_refusals, _check_train,
          functools.partial(_check_resume, str(tmp_path / "dp")),
          functools.partial(_check_cp_sharded, str(tmp_path / "sharded")), timeout_s=300)


def test_context_parallel_on_four_ranks(tmp_path):
    spawn(_check_cp_with_tp, _check_cp_with_fsdp,
          functools.partial(_check_cp_in_pipeline, str(tmp_path)), world=4, timeout_s=300)
