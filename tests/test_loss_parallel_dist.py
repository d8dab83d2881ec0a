"""Loss parallelism in the built layout (issue 27), on two gloo ranks in one launch.

``torchloom.parallelize`` at tp=2 splits an untied head along the vocabulary for
``loss="parallel"`` and for the default ``loss="chunked"``: no rank's logits hold the
whole vocabulary, the model's loss (:class:`torchloom.ops.loss.CausalLMLoss`) equals
the unsharded model's own, and every gradient equals the unsharded one (a sharded
parameter's: its slice). The collectives are counted (``count_collectives``): with
sequence parallelism the activations move by reduce-scatter and all-gather only, and an
all-reduce is left for the norms' parameter gradients and the loss's per-row numbers.
A head the degree cannot split (a vocabulary of 127) is refused for ``"parallel"`` and
kept whole for ``"chunked"``; the derived (transformers-plan) schedule of Qwen2 splits its
head too; ``torchloom train`` trains the same losses whole and split.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

from tests.dist import spawn
from tests.helpers import assert_grads_match
from torchloom.core.errors import LayoutError, ModelSizeError
from torchloom.ops.loss import CausalLMLoss
from torchloom.parallel import Layout, create_schedule, init_mesh, parallelize
from torchloom.runtime.collectives import count_collectives

LAYERS = 2
VOCAB = 128
SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=LAYERS, vocab_size=VOCAB, tie_word_embeddings=False,
             max_position_embeddings=64, use_cache=False)
TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_TOL = {"rtol": 2e-6, "atol": 1e-7}


def _llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**{**SIZES, **overrides})).train()


def _qwen2() -> nn.Module:
    torch.manual_seed(0)
    return T.Qwen2ForCausalLM(T.Qwen2Config(**SIZES)).train()


def _batch(vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def _build(reference: nn.Module, layout: Layout):
    model = copy.deepcopy(reference)
    mesh = init_mesh(layout, device_type="cpu")
    return parallelize(create_schedule(model, mesh), layout, mesh=mesh)


def _run(done, reference: nn.Module, vocab: int = VOCAB) -> tuple[dict, dict, torch.Tensor]:
    """Forward and backward of the built model and of the reference; checks the loss and
    every gradient; returns the collective counts and the logits."""
    batch = _batch(vocab)
    with count_collectives() as forward:
        out = done.model(**batch)
    with count_collectives() as backward:
        out.loss.backward()
    ref = reference(**batch)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **LOSS_TOL)
    assert_grads_match(done.module, reference, **TOL)
    return dict(forward), dict(backward), out.logits


# Per step at tp=2 with LAYERS layers, the loss in one chunk (two all-reduces of per-row
# numbers: the row maxima, then [sum of exponentials, target logit]).
# TP: the row modules' outputs all-reduced forward; backward the attention's and the MLP's
# input gradients and the head's (each rank's columns give a part of it).
# SP: the regions gather their input and reduce-scatter their output; the final norm's
# gather reduce-scatters the head's input gradient; all-reduces only for the norms'
# parameter gradients (2 per layer and the final norm) and the loss's rows.
TP_COUNTS = ({"all_reduce": 2 * LAYERS + 2}, {"all_reduce": 2 * LAYERS + 1})
SP_COUNTS = ({"all_gather": 2 * LAYERS + 1, "reduce_scatter": 2 * LAYERS, "all_reduce": 2},
             {"reduce_scatter": 2 * LAYERS + 1, "all_gather": 2 * LAYERS + 1,
              "all_reduce": 2 * LAYERS + 1})
# derived (Qwen2), no SP: + the vocabulary-parallel embedding's all-reduce forward
DERIVED_COUNTS = ({"all_reduce": 1 + 2 * LAYERS + 2}, {"all_reduce": 2 * LAYERS + 1})


def _check_llama_split_logits(rank: int) -> None:
    reference = _llama()
    for sp in (False, True):
        for loss in ("parallel", "chunked"):
            ref = copy.deepcopy(reference)
            done = _build(ref, Layout(tp=2, sp=sp, loss=loss, seq_len=16))
            assert (done.loss, done.vocab_sharded) == (loss, True)
            assert isinstance(done.module.loss_function, CausalLMLoss)
            assert done.module.loss_function.mode == loss
            forward, backward, logits = _run(done, ref)
            assert logits.shape == (2, 16, VOCAB // 2), (sp, loss, logits.shape)
            assert (forward, backward) == (SP_COUNTS if sp else TP_COUNTS), \
                (sp, loss, forward, backward)
            lines = [e.call_text() for e in done.schedule.recipe]
            assert "sch['lm_head'].shard('weight', 0)" in lines
            assert ("sch['lm_head'].sync('bwd_post', 'all_reduce')" in lines) != sp
            if sp:
                assert "sch['model.norm'].sync('fwd_post', 'all_gather', axis=1, " \
                       "tensor_parallel_output_grad=True)" in lines


def _check_derived_plan(rank: int) -> None:
    reference = _qwen2()
    for sp, loss in ((False, "parallel"), (True, "chunked")):
        ref = copy.deepcopy(reference)
        done = _build(ref, Layout(tp=2, sp=sp, loss=loss, seq_len=16))
        assert (done.loss, done.vocab_sharded) == (loss, True)
        forward, backward, logits = _run(done, ref)
        assert logits.shape == (2, 16, VOCAB // 2)
        if not sp:
            assert (forward, backward) == DERIVED_COUNTS, (forward, backward)
        lines = [e.call_text() for e in done.schedule.recipe]
        assert "sch['lm_head'].shard('weight', 0)" in lines
        assert not any(line.startswith("sch['lm_head'].sync('fwd_post'") for line in lines)


def _check_heads_that_stay_whole(rank: int) -> None:
    odd = _llama(vocab_size=VOCAB - 1)
    with pytest.raises(ModelSizeError, match=r"its 127 outputs do not divide by 2"):
        _build(odd, Layout(tp=2, loss="parallel", seq_len=16))
    for model in (_llama(vocab_size=VOCAB - 1), _llama(tie_word_embeddings=True)):
        vocab = model.config.vocab_size
        done = _build(model, Layout(tp=2, seq_len=16))  # chunked: whole logits
        assert (done.loss, done.vocab_sharded) == ("chunked", False)
        _, _, logits = _run(done, model, vocab)
        assert logits.shape[-1] == vocab
    with pytest.raises(LayoutError, match=r"keeps the head whole"):
        _build(T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)),
               Layout(tp=2, loss="parallel", seq_len=16))


def _check_train(rank: int) -> None:
    from torchloom.apps.train import TrainConfig, train_rank

    runs = {loss: train_rank(rank, TrainConfig(model="llama", tp=2, steps=2, batch_size=2,
                                               seq_len=16, loss=loss, progress=False))
            for loss in ("full", "parallel", "chunked")}
    for loss in ("parallel", "chunked"):
        torch.testing.assert_close(runs[loss]["losses"], runs["full"]["losses"], rtol=1e-5,
                                   atol=0)


def test_loss_parallel_on_two_ranks():
    spawn(_check_llama_split_logits, _check_derived_plan, _check_heads_that_stay_whole,
          _check_train, timeout_s=240)
