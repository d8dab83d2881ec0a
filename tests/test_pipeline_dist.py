"""Pipelines on two gloo ranks: build(target="pipeline") with every schedule of
torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble and
ZBVZeroBubble, whose V puts the first and the last stage on rank 0) against the
single-process model.

4-layer GPT-2 and Llama cut into stages, 4 micro-batches of a batch of 8: the mean loss
equals the single-process loss of the whole batch, every local parameter's gradient equals
the full-batch gradient (the tied GPT-2 embedding / head included, on both ranks that hold
it), and after an optimizer step the tied copies are still equal.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import torchloom as tl
from tests import pipeline_models, tiny
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
    if layers == "transformer.h" and schedule != "ZBVZeroBubble":
        # the tied embedding and head still agree (in ZBV's V both are on rank 0)
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
    _run(rank, make, "transformer.h", "InterleavedZeroBubble", [0, 1, 2])
    _run(rank, make, "transformer.h", "ZBVZeroBubble", [0, 1, 2])


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


def _meta_pipeline(folder: str, ids: torch.Tensor, layers: str, cut: int, **build_kw):
    config = transformers.AutoConfig.from_pretrained(folder)
    with tl.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = tl.create_schedule(model)
    sch.trace_until(f"{layers}.*", example_inputs={"input_ids": ids[:2]})
    sch[f"{layers}.{cut}"].cut_pipeline_stage()
    return tl.build(sch, target="pipeline", schedule="1F1B", n_microbatches=4,
                    loss_fn=next_token_loss, example_inputs=(ids[:2],), weights=folder,
                    **build_kw)[0]


def _neox_folder_loads_every_tensor(rank: int, folder: str) -> None:
    # save_pretrained stores GPT-NeoX's head as embed_out.weight: each stage reads it
    # under transformers' rename (the first loss equals one process's), no warning
    ids = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = _meta_pipeline(folder, ids, "gpt_neox.layers", 1)
    loss = pipe.step(ids, target=ids)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if pipe.is_last:
        head = dict(p for m in pipe.stage_modules for p in m.named_parameters())
        assert torch.equal(head["lm_head.weight"], reference.lm_head.weight)
        torch.testing.assert_close(loss, next_token_loss(reference(ids).logits, ids), **TOL)


def _neox_folder_without_its_head_is_refused(rank: int, folder: str) -> None:
    # every rank refuses (the first stage too, which does not hold the head)
    ids = _batch()
    try:
        _meta_pipeline(folder, ids, "gpt_neox.layers", 1)
    except tl.CheckpointMismatchError as err:
        assert str(err).startswith(
            "build(...): 1 tensor(s) of the model are not in the checkpoint: "
            "['lm_head.weight'] (strict=True, the default)"), str(err)
        assert "file='model.safetensors'" in str(err), str(err)
    else:
        raise AssertionError("a folder without the head was accepted")
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) are not in .*\['lm_head\.weight'\]"):
        pipe = _meta_pipeline(folder, ids, "gpt_neox.layers", 1, strict=False)
    assert pipe.step(ids, target=ids) is None or pipe.is_last


def nano_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _trains_like_one_process(rank: int, make, levels: str, cut: str, nano: bool = False,
                             steps: int = 3) -> None:
    """Cut into 2 stages, trained ``steps`` SGD steps: every loss equals one process's."""
    model = make()
    reference = copy.deepcopy(model)
    ids = _batch()
    loss_fn = nano_loss if nano else next_token_loss
    inputs, example = ((ids, ids), (ids[:2], ids[:2])) if nano else ((ids,), (ids[:2],))
    sch = tl.create_schedule(model)
    sch.trace_until(levels, example_inputs=example)
    sch[cut].cut_pipeline_stage()
    pipe, opt = tl.build(sch, target="pipeline", schedule="1F1B", n_microbatches=4,
                         loss_fn=loss_fn, example_inputs=example,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        loss = pipe.step(*inputs, target=ids)
        out = reference(*inputs)
        ref_loss = loss_fn(out[0] if nano else getattr(out, "logits", out), ids)
        ref_loss.backward()
        if pipe.is_last:
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL,
                                       msg=f"{type(model).__name__} step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()


def _models_that_are_not_transformers(rank: int) -> None:
    # nanoGPT: the integer targets cross the cut (they arrive intact); transposed: the
    # activation crossing the cut is a non-contiguous view
    _trains_like_one_process(rank, pipeline_models.nano_gpt, "transformer.h.*",
                             "transformer.h.1", nano=True)
    _trains_like_one_process(rank, lambda: pipeline_models.nano_gpt(transposed=True),
                             "transformer.h.*", "transformer.h.1", nano=True)
    # torch's own nn.TransformerEncoder, cut between its layers and after an attention
    _trains_like_one_process(rank, pipeline_models.encoder_lm, "encoder.layers.*",
                             "encoder.layers.1")
    _trains_like_one_process(rank, pipeline_models.encoder_lm, "encoder.layers.1.self_attn",
                             "encoder.layers.1.self_attn")


def _gpt_neo_blocks_return_tuples(rank: int) -> None:
    _trains_like_one_process(rank, pipeline_models.gpt_neo, "transformer.h.*",
                             "transformer.h.1")


def test_pipelines_on_two_ranks(tmp_path):
    whole, headless = str(tmp_path / "neox"), str(tmp_path / "neox-headless")
    tiny.gpt_neox().save_pretrained(whole)
    tiny.gpt_neox().save_pretrained(headless)
    tensors = load_file(os.path.join(headless, "model.safetensors"))
    assert "embed_out.weight" in tensors and "lm_head.weight" not in tensors
    del tensors["embed_out.weight"]
    save_file(tensors, os.path.join(headless, "model.safetensors"), metadata={"format": "pt"})
    spawn(_gpt2_schedules, _llama_schedules, _stage_count_error,
          functools.partial(_neox_folder_loads_every_tensor, folder=whole),
          functools.partial(_neox_folder_without_its_head_is_refused, folder=headless),
          _models_that_are_not_transformers, _gpt_neo_blocks_return_tuples)
