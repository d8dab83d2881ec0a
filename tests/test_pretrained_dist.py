"""tl.save_pretrained from every layout on two gloo ranks, in one launch.

GPT-2 (tied head) and Llama from transformers' DEFAULT configs, sizes shrunk, each
trained one SGD step under: tensor parallelism, TP + sequence parallelism (the built-in
schedules), DDP, FSDP2 and a 2-stage pipeline. For each, the folder that
``save_pretrained`` writes (sharded: a small ``max_shard_size``) loads with
``from_pretrained`` into the unmodified class with no missing / unexpected keys, its
tensors bit-equal to the gathered state of the scheduled model, and gives that model's
logits within 1e-5. The pipeline model's evaluation forward equals one process, its
``full_state_dict`` holds every original key (the tied head equal to the embedding), and
a ``tl.save`` checkpoint of it loads into a pipeline of the same layout and into the
unpipelined model.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom.runtime.parallel import init_mesh
from torchloom.schedules import apply_schedule

TOL = dict(rtol=1e-5, atol=1e-5)
_DIR = "TORCHLOOM_TEST_PRETRAINED_DIR"


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64))


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))


MODELS = {"gpt2": (gpt2, "transformer.h"), "llama": (llama, "model.layers")}


def _ids(rows: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (rows, 8), generator=torch.Generator().manual_seed(2))


def _folder(name: str) -> str:
    return os.path.join(os.environ[_DIR], name)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One SGD step in eval mode (no dropout), so the saved weights are not the init."""
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _verify(name: str, path: str, gathered: dict[str, torch.Tensor],
            logits: torch.Tensor, ids: torch.Tensor) -> None:
    cls = type(MODELS[name][0]())
    loaded, info = cls.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), (path, info)
    assert info["mismatched_keys"] == set() and not info["error_msgs"], (path, info)
    assert "model.safetensors.index.json" in os.listdir(path), path
    assert loaded.config.architectures == [cls.__name__], path
    state = loaded.state_dict()
    assert set(state) == set(gathered), path
    for key, value in gathered.items():
        assert torch.equal(state[key], value), (path, key)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, **TOL, msg=path)


def _tp(rank: int) -> None:
    for name, (make, _) in MODELS.items():
        for sp in (False, True):
            sch = tl.create_schedule(make())
            apply_schedule(sch, tp=True, sequence_parallel=sp)
            model, opt = tl.build(sch, optimizer=_sgd)
            ids = _ids()
            _step(model, opt, ids)
            assert any(tl.shard_spec(p) is not None for p in model.parameters())
            path = _folder(f"tp-{name}-sp{int(sp)}")
            tl.save_pretrained(model, path, max_shard_size="20KB")
            gathered = tl.full_state_dict(model)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            if rank == 0:
                _verify(name, path, gathered, logits, ids)


def _data_parallel(rank: int) -> None:
    for target in ("ddp", "fsdp"):
        for name, (make, _) in MODELS.items():
            sch = tl.create_schedule(make())
            model, opt = tl.build(sch, target=target, mesh=init_mesh(dp=2), optimizer=_sgd)
            ids = _ids()
            _step(model, opt, ids.chunk(2)[rank])
            path = _folder(f"{target}-{name}")
            tl.save_pretrained(model, path, max_shard_size="20KB")
            state = model.state_dict()
            if target == "fsdp":
                assert any(hasattr(v, "full_tensor") for v in state.values())
            gathered = {k.removeprefix("module."): v.full_tensor() if hasattr(v, "full_tensor")
                        else v for k, v in state.items()}
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            if rank == 0:
                _verify(name, path, gathered, logits, ids)


def _next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1))


def _pipe(make, layers: str, seed: int = 0):
    ids = _ids(8)
    sch = tl.create_schedule(make(seed))
    sch.trace_until(f"{layers}.*", example_inputs={"input_ids": ids[:2]})
    sch[f"{layers}.0"].cut_pipeline_stage()
    return tl.build(sch, target="pipeline", schedule="1F1B", n_microbatches=4,
                    loss_fn=_next_token_loss, example_inputs=(ids[:2],), optimizer=_sgd)


def _interleaved(rank: int) -> None:
    """Two stages per rank (4 stages): the rank's tree merges them; the whole state and
    the evaluation forward equal one process."""
    ids = _ids(8)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128,
                                     n_positions=64)
    reference = transformers.GPT2LMHeadModel(config).eval()
    sch = tl.create_schedule(transformers.GPT2LMHeadModel(config))
    sch.mod.load_state_dict(reference.state_dict())
    sch.trace_until("transformer.h.*", example_inputs={"input_ids": ids[:2]})
    for i in range(3):
        sch[f"transformer.h.{i}"].cut_pipeline_stage()
    pipe, _ = tl.build(sch, target="pipeline", schedule="Interleaved1F1B", n_microbatches=4,
                       loss_fn=_next_token_loss, example_inputs=(ids[:2],))
    assert len(pipe.stage_modules) == 2
    assert {k.split(".")[2] for k in pipe.state_dict() if ".h." in k} == {str(rank), str(rank + 2)}
    full = tl.full_state_dict(pipe)
    expected = reference.state_dict()
    assert list(full) == list(expected)
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    out = pipe.eval()(ids)
    if pipe.is_last:
        with torch.no_grad():
            torch.testing.assert_close(out, reference(ids).logits, **TOL)


def _pipeline(rank: int) -> None:
    ids = _ids(8)
    for name, (make, layers) in MODELS.items():
        pipe, opt = _pipe(make, layers)
        pipe.eval()
        pipe.step(ids, target=ids)
        opt.step()
        local = pipe.state_dict()
        original_keys = list(make().state_dict())
        assert local and set(local) < set(original_keys)  # this rank's stage, original keys
        full = tl.full_state_dict(pipe)
        assert list(full) == original_keys
        for key, value in local.items():
            assert torch.equal(full[key], value), key
        if name == "gpt2":
            assert torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])
        one = make(seed=3).eval()
        one.load_state_dict(full)
        out = pipe(ids)
        with torch.no_grad():
            expected = one(ids).logits
        if pipe.is_last:
            torch.testing.assert_close(out, expected, **TOL)
        else:
            assert out is None
        path = _folder(f"pipeline-{name}")
        tl.save_pretrained(pipe, path, max_shard_size="20KB")
        if pipe.is_last:
            _verify(name, path, full, out, ids)
        if name != "gpt2":
            continue
        # a torchloom checkpoint of the pipeline: same layout, and the unpipelined model
        ckpt = _folder("pipeline-ckpt")
        tl.save(pipe, None, ckpt, step=1)
        again, _ = _pipe(make, layers, seed=5)
        assert tl.load(again, None, ckpt) == 1
        for key, value in tl.full_state_dict(again).items():
            assert torch.equal(value, full[key]), key
        plain = make(seed=6)
        tl.load(plain, None, ckpt)
        for key, value in plain.state_dict().items():
            assert torch.equal(value, full[key]), key


@pytest.mark.slow
def test_save_pretrained_from_every_layout(tmp_path, monkeypatch):
    monkeypatch.setenv(_DIR, str(tmp_path))
    spawn(_tp, _data_parallel, _pipeline, _interleaved, timeout_s=90)
