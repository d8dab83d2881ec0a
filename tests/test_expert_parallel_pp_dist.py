"""Expert parallelism inside a pipeline (issue 28), on four gloo ranks in one launch:
``pp 2 x dp 2 x ep 2``, each pipeline stage's experts split over the stage's two
data-parallel ranks, trained by ``torchloom train`` under DDP and FSDP2 and compared with
the same pipeline without expert parallelism (fp32: the dispatch adds each token's
experts in the single-process order, so the losses agree within 1e-5 relative, with the
gradient norm clipped); the checkpoint of the expert-parallel run resumes at ep 1. In the
same launch, ``--dp 4 --dp-mode fsdp --ep 2`` (the experts FSDP2-sharded over the ranks
that share them) equals ``--dp 4 --dp-mode fsdp``, and ``--dp 2 --cp 2 --ep 2`` equals
``--dp 2 --cp 2``.
"""

from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.distributed as dist
import transformers as T

from tests.dist import spawn
from torchloom.parallel import Layout, create_schedule, init_mesh, parallelize
from torchloom.runtime.collectives import count_collectives

SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=256, max_position_embeddings=128)


def _stages_hold_half_of_their_experts(rank: int) -> None:
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(**SIZES, num_local_experts=4,
                                                 num_experts_per_tok=2))
    reference = copy.deepcopy(model)
    layout = Layout(pp=2, dp_replicate=2, ep=2, n_microbatches=2, seq_len=16)
    mesh = init_mesh(layout, device_type="cpu")
    ids = torch.randint(0, 256, (1, 16))
    done = parallelize(create_schedule(model, mesh), layout, mesh=mesh,
                       example_inputs={"input_ids": ids})
    experts = done.expert_parameters()
    # this stage's two layers, each gate_up_proj and down_proj: 2 of the 4 experts
    assert len(experts) == 4, len(experts)
    ep_rank = mesh.local_rank("ep")
    full = dict(reference.named_parameters())
    stage = mesh.local_rank("pp")
    for p in experts:
        assert p.shape[0] == 2
        # the expert slice of the stage's layer, from the single-process weights
        matches = [n for n, t in full.items() if t.shape[1:] == p.shape[1:] and
                   torch.equal(t[2 * ep_rank: 2 * ep_rank + 2], p.detach())]
        assert len(matches) == 1, matches
        layer = int(matches[0].split(".")[2])
        assert layer // 2 == stage, (matches, stage)


def _train(root: str, rank: int) -> None:
    from torchloom.apps.train import TrainConfig, train_rank

    folder = os.path.join(root, "mixtral")
    if rank == 0:
        torch.manual_seed(0)
        T.MixtralForCausalLM(T.MixtralConfig(**SIZES, num_local_experts=4,
                                             num_experts_per_tok=2)).save_pretrained(folder)
    dist.barrier()
    common = dict(model=folder, steps=4, batch_size=8, seq_len=16, progress=False, pp=2, dp=2,
                  n_microbatches=2, clip_grad=0.05, save_every=2)
    losses = {}
    for mode in ("ddp", "fsdp"):
        with count_collectives() as counts:
            ep = train_rank(rank, TrainConfig(ep=2, dp_mode=mode, **common,
                                              save_dir=os.path.join(root, f"ep-{mode}")))
        assert counts["all_to_all"] > 0, dict(counts)
        with count_collectives() as counts:
            plain = train_rank(rank, TrainConfig(dp_mode=mode, **common,
                                                 save_dir=os.path.join(root, f"plain-{mode}")))
        assert counts["all_to_all"] == 0, dict(counts)
        torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-5, atol=0, msg=lambda m, mode=mode: f"{mode}: {m}")
        losses[mode] = ep["losses"]
    # the ep run's checkpoint at step 2, resumed without expert parallelism (DDP)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(root, "ep-ddp", "step-4"))
    dist.barrier()
    resumed = train_rank(rank, TrainConfig(dp_mode="ddp", resume=True, **common,
                                           save_dir=os.path.join(root, "ep-ddp")))
    assert resumed["first_step"] == 3
    torch.testing.assert_close(torch.tensor(resumed["losses"]),
                               torch.tensor(losses["ddp"][2:]), rtol=1e-5, atol=0)


def _train_fsdp4(root: str, rank: int) -> None:
    """No pipeline: ``--dp 4 --dp-mode fsdp --ep 2``, where FSDP2 shards each rank's
    experts again over the two ranks holding them, equals ``--dp 4 --dp-mode fsdp`` with
    the gradient norm clipped (the experts' shards summed over their replicas, then over
    the ep group)."""
    from torchloom.apps.train import TrainConfig, train_rank

    common = dict(model=os.path.join(root, "mixtral"), steps=3, batch_size=8, seq_len=16,
                  progress=False, dp=4, dp_mode="fsdp", clip_grad=0.05)
    ep = train_rank(rank, TrainConfig(ep=2, save_dir=os.path.join(root, "f-ep"), **common))
    plain = train_rank(rank, TrainConfig(save_dir=os.path.join(root, "f-plain"), **common))
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(plain["losses"]),
                               rtol=1e-5, atol=0)


def _train_with_cp(root: str, rank: int) -> None:
    """``--dp 2 --cp 2 --ep 2``: each context-parallel position's two data-parallel ranks
    split the experts (every rank routes its own positions of its sequences); it trains as
    ``--dp 2 --cp 2`` (the experts' gradients averaged over the data-parallel and
    context-parallel ranks that hold them, the gradient norm clipped)."""
    from torchloom.apps.train import TrainConfig, train_rank

    common = dict(model=os.path.join(root, "mixtral"), steps=3, batch_size=4, seq_len=16,
                  progress=False, dp=2, cp=2, clip_grad=0.05)
    with count_collectives() as counts:
        ep = train_rank(rank, TrainConfig(ep=2, save_dir=os.path.join(root, "c-ep"), **common))
    assert counts["all_to_all"] > 0, dict(counts)
    plain = train_rank(rank, TrainConfig(save_dir=os.path.join(root, "c-plain"), **common))
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(plain["losses"]),
                               rtol=1e-5, atol=0)


def test_expert_parallel_inside_a_pipeline(tmp_path) -> None:
    import functools

    spawn(_stages_hold_half_of_their_experts, functools.partial(_train, str(tmp_path)),
          functools.partial(_train_fsdp4, str(tmp_path)),
          functools.partial(_train_with_cp, str(tmp_path)), world=4, timeout_s=300)
