"""Pipelines on two gloo ranks: build(target="pipeline") with GPipe, 1F1B and
Interleaved1F1B against the single-process model.

4-layer GPT-2 and Llama cut into stages, 4 micro-batches of a batch of 8: the mean loss
equals the single-process loss of the whole batch, every local parameter's gradient equals
the full-batch gradient (the tied GPT-2 embedding / head included, on both ranks that hold
it), and after an optimizer step the tied copies are still equal.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchloom as tl
from tests import tiny
from tests.dist import spawn
from tests.tiny import llama

TOL = dict(rtol=1e-5, atol=1e-6)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1))


def _batch() -> torch.Tensor:
    return torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(4))


def _run(rank: int, make, layers: str, schedule: str, cuts: list[int]) -> None:
    model = make()
    reference = copy.deepcopy(model)
    ids = _batch()
    sch = tl.create_schedule(model)
    sch.trace_until(f"{layers}.*", example_inputs={"input_ids": ids[:2]})
    for i in cuts:
        sch[f"{layers}.{i}"].cut_pipeline_stage()
    pipe, opt = tl.build(sch, target="pipeline", schedule=schedule, n_microbatches=4,
                         loss_fn=next_token_loss, example_inputs=(ids[:2],),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert pipe.simulated_steps > 0
    loss = pipe.step(ids, target=ids)
    ref_loss = next_token_loss(reference(ids).logits, ids)
    ref_loss.backward()
    what = f"{type(model).__name__} {schedule}"
    if pipe.is_last:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL, msg=what)
    else:
        assert loss is None
    ref = dict(reference.named_parameters(remove_duplicate=False))
    local = [(n, p) for m in pipe.stage_modules for n, p in m.named_parameters()]
    assert local
    for name, param in local:
        torch.testing.assert_close(param.grad, ref[name].grad, **TOL, msg=f"{what}: {name}")
    opt.step()
    if layers == "transformer.h":  # the tied embedding and head still agree
        holder = {n: p for n, p in local}
        mine = holder.get("transformer.wte.weight", holder.get("lm_head.weight"))
        theirs = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(theirs, mine.detach())
        assert torch.equal(theirs[0], theirs[1])


def _gpt2_schedules(rank: int) -> None:
    make = lambda: tiny.gpt2(n_layer=4)  # noqa: E731
    _run(rank, make, "transformer.h", "GPipe", [1])
    _run(rank, make, "transformer.h", "1F1B", [1])
    _run(rank, make, "transformer.h", "Interleaved1F1B", [0, 1, 2])


def _llama_schedules(rank: int) -> None:
    _run(rank, llama, "model.layers", "GPipe", [1])
    _run(rank, llama, "model.layers", "1F1B", [1])


def _stage_count_error(rank: int) -> None:
    model = tiny.gpt2(n_layer=4)
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": _batch()[:2]})
    sch["transformer.h.0"].cut_pipeline_stage()
    sch["transformer.h.2"].cut_pipeline_stage()
    try:
        tl.build(sch, target="pipeline", schedule="1F1B", loss_fn=next_token_loss,
                 example_inputs=(_batch()[:2],))
    except tl.BuildError as err:
        assert "3 stages for 2 pipeline ranks: 1F1B needs 1 stage per rank" in str(err)
        assert "cut the model into 2 stages (1 cut_pipeline_stage() calls)" in str(err)
    else:
        raise AssertionError("three stages on two ranks were accepted")


def test_pipelines_on_two_ranks():
    spawn(_gpt2_schedules, _llama_schedules, _stage_count_error)
