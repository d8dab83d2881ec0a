"""The README's pipeline block on a GPT-2 with transformers' DEFAULT config (sizes only;
``use_cache`` True), on two gloo ranks in one launch: trace_until, a cut, build(target=
"pipeline") and a step equal the single-process model; and the same model built under
``init_empty_weights``, traced and cut before any weight exists, then materialised by
``build`` from a seed, trains equal to the same meta model built without a pipeline.

The models run in eval mode (dropout off without touching the config): a pipeline draws
its dropout masks per micro-batch, the single-process model per batch.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers

import torchloom as tl
from tests.dist import spawn

TOL = dict(rtol=1e-5, atol=1e-6)


def _gpt2() -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=128,
                                  n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1))


def _pipeline_step(model, reference, ids) -> None:
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": ids[:2]})
    sch["transformer.h.1"].cut_pipeline_stage()
    pipe, _ = tl.build(sch, target="pipeline", schedule="1F1B", n_microbatches=4,
                       loss_fn=next_token_loss, example_inputs=(ids[:2],))
    loss = pipe.step(ids, target=ids)
    reference.eval()
    ref_loss = next_token_loss(reference(ids).logits, ids)
    ref_loss.backward()
    if pipe.is_last:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    local = [(n, p) for m in pipe.stage_modules for n, p in m.named_parameters()]
    assert local
    for name, param in local:
        torch.testing.assert_close(param.grad, ref[name].grad, **TOL, msg=name)


def check_default_gpt2_pipeline(rank: int) -> None:
    torch.manual_seed(0)
    model = _gpt2().eval()
    assert model.config.use_cache is True
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(4))
    _pipeline_step(model, copy.deepcopy(model), ids)


def check_meta_gpt2_cut_before_its_weights_exist(rank: int) -> None:
    with tl.init_empty_weights():
        model = _gpt2().eval()
        reference = _gpt2().eval()
    torch.manual_seed(1)
    tl.build(tl.create_schedule(reference))  # the same init walk, from the same seed
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    _pipeline_step(model, reference, ids)


def test_default_and_meta_gpt2_pipelines_on_two_ranks():
    spawn(check_default_gpt2_pipeline, check_meta_gpt2_cut_before_its_weights_exist,
          timeout_s=60)


_DIR = "TORCHLOOM_TEST_DEFAULTS_DIR"


def check_meta_gpt2_pipeline_from_weights(rank: int) -> None:
    """Done-when (c): a default-config GPT-2 on meta, traced without example inputs and cut
    into 2 stages, built with weights= (each rank reads only its stage), trains one step
    equal to one process, and its save_pretrained folder loads with from_pretrained."""
    import os

    import torch.distributed as dist

    root = os.environ[_DIR]
    folder = os.path.join(root, "pretrained")
    if rank == 0:
        torch.manual_seed(7)
        _gpt2().save_pretrained(folder)
    dist.barrier()
    cfg = transformers.AutoConfig.from_pretrained(folder)
    assert cfg.use_cache is True
    with tl.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.eval()
    sch = tl.create_schedule(model)
    sch.trace_until("transformer.h.*")  # no example inputs: dummy inputs from the config
    sch["transformer.h.1"].cut_pipeline_stage()
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(6))
    pipe, opt = tl.build(sch, target="pipeline", schedule="1F1B", n_microbatches=4,
                         loss_fn=next_token_loss, example_inputs=(ids[:2],), weights=folder,
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    mine = {id(p) for p in pipe.parameters()}
    # only this rank's stage was read: the other stage's tensors are still on meta
    for name, param in model.named_parameters(remove_duplicate=False):
        assert param.is_meta == (id(param) not in mine), name
    other = "transformer.h.3.mlp.c_fc.weight" if rank == 0 else "transformer.h.0.mlp.c_fc.weight"
    assert model.get_parameter(other).is_meta
    assert not model.get_parameter("lm_head.weight" if rank else "transformer.wte.weight").is_meta

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss = pipe.step(ids, target=ids)
    ref_loss = next_token_loss(reference(ids).logits, ids)
    ref_loss.backward()
    if pipe.is_last:
        torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(param.grad, ref[name].grad, **TOL, msg=name)
    opt.step()
    ref_opt.step()

    out = os.path.join(root, "trained")
    tl.save_pretrained(pipe, out)
    dist.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], **TOL, msg=name)
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)


def test_meta_gpt2_pipeline_from_weights_on_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv(_DIR, str(tmp_path))
    spawn(check_meta_gpt2_pipeline_from_weights, timeout_s=60)
