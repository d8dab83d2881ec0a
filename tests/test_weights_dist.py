"""Pretrained weights into a tensor-parallel model and out again, on two gloo ranks
(issue 14, Done-when (b)).

A Llama and a GPT-2 (transformers' default configs, sizes shrunk, ``use_cache`` left on)
are saved with ``save_pretrained`` (GPT-2 sharded into several safetensors files); on each
rank a model is built from the folder's config under ``init_empty_weights``, scheduled
with the built-in TP schedule (and with sequence parallelism), and built with
``weights=folder``. Against ``from_pretrained`` of the same folder in one process:

* every parameter is the matching slice of the pretrained one (nothing else was read);
* the logits are equal within 1e-5;
* one training step (SGD, in eval mode so that no dropout draws) gives the same loss,
  gradients (sharded ones as slices) and, after the step, the same next loss;
* ``tl.save_pretrained`` of the trained model writes a folder that ``from_pretrained``
  loads with the keys and values (bit-equal) of ``tl.full_state_dict`` of the model.

One process-group launch runs it all.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom import schedules

WORLD = 2
TOL = dict(rtol=1e-5, atol=1e-5)


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                   n_positions=64, bos_token_id=0, eos_token_id=0)


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=128, max_position_embeddings=64)


def _batch() -> dict:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _check_case(rank: int, folder: str, sp: bool) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(folder)
    with tl.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = tl.create_schedule(model)
    schedules.apply_schedule(sch, tp=True, sequence_parallel=sp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the folder holds every tensor: no warning
        tl.build(sch, weights=folder)
    model.eval()
    reference.eval()
    name = f"{type(model).__name__}{' SP' if sp else ''}"

    ref_params = dict(reference.named_parameters())
    sharded = 0
    for pname, p in model.named_parameters():
        spec = tl.shard_spec(p)
        want = ref_params[pname].detach()
        if spec is not None and spec.world_size > 1:
            assert (spec.rank, spec.world_size) == (rank, WORLD)
            want = spec.slice(want)
            sharded += 1
        assert torch.equal(p, want), f"{name}: {pname}"
    assert sharded >= 8

    batch = _batch()
    out = model(**batch)
    ref_out = reference(**batch)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL, msg=f"{name}: logits")
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL, msg=f"{name}: loss")
    out.loss.backward()
    ref_out.loss.backward()
    for pname, p in model.named_parameters():
        spec = tl.shard_spec(p)
        want = ref_params[pname].grad
        if spec is not None and spec.world_size > 1:
            want = spec.slice(want)
        torch.testing.assert_close(p.grad, want, **TOL, msg=f"{name}: grad of {pname}")
    for opt in (torch.optim.SGD(model.parameters(), lr=0.5),
                torch.optim.SGD(reference.parameters(), lr=0.5)):
        opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, reference(**batch).loss, **TOL,
                                   msg=f"{name}: loss after a step")

    # and out again: the trained model's folder loads bit-equal to its gathered weights
    gathered = tl.full_state_dict(model)
    out = f"{folder}-trained{'-sp' if sp else ''}"
    tl.save_pretrained(model, out, max_shard_size="16KB")
    torch.distributed.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = loaded.state_dict()
    assert set(state) == set(gathered), f"{name}: keys of the saved folder"
    for key, value in state.items():
        assert torch.equal(value, gathered[key]), f"{name}: saved {key}"


def _write(folder: str, make: type[nn.Module], config: transformers.PretrainedConfig,
           **save_kw: str) -> str:
    torch.manual_seed(0)
    make(config).save_pretrained(folder, **save_kw)
    return folder


@pytest.mark.slow  # about 25 s: two spawned ranks importing transformers, one launch
def test_pretrained_llama_and_gpt2_load_into_tp_and_sp_models(tmp_path):
    llama = _write(str(tmp_path / "llama"), transformers.LlamaForCausalLM, llama_config())
    gpt2 = _write(str(tmp_path / "gpt2"), transformers.GPT2LMHeadModel, gpt2_config(),
                  max_shard_size="16KB")
    checks = [functools.partial(_check_case, folder=folder, sp=sp)
              for folder in (llama, gpt2) for sp in (False, True)]
    spawn(*checks, world=WORLD)
