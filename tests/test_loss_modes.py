"""The three losses of :mod:`torchloom.ops.loss` in one process: values and gradients
of the chunked cross-entropy against ``F.cross_entropy``, its memory by allocator counts
against transformers' ``ForCausalLMLoss``, the drop-in ``CausalLMLoss`` on a tiny Llama,
and the refusals. (Vocabulary-sharded logits over two ranks: test_loss_parallel_dist.py.)
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.loss.loss_utils import ForCausalLMLoss

from tests import tiny
from torchloom.core.errors import LossError, ScheduleError
from torchloom.ops.loss import (
    CHUNK_BYTES,
    LOSSES,
    CausalLMLoss,
    cross_entropy,
    default_chunk_rows,
    next_token_loss,
    set_loss,
)
from torchloom.runtime.memory import LiveBytes

#: fp32 rounding: the sums of exponentials are added in another order than ATen's
FP32 = dict(rtol=1e-6, atol=1e-7)
GRAD32 = dict(rtol=1e-6, atol=1e-9)
#: bf16 gradients: one rounding of the fp32 gradient (ours) against one (the reference's)
GRAD16 = dict(rtol=1e-2, atol=1e-7)


def _case(rows: int = 37, vocab: int = 53, dtype: torch.dtype = torch.float32,
          ignored: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[torch.randperm(rows, generator=g)[:ignored]] = -100
    return logits, target


def _value_and_grad(fn, logits: torch.Tensor, target: torch.Tensor, **kw):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    loss.backward()
    return loss.detach(), x.grad


def _reference(logits, target, reduction="mean", ignore_index=-100):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


def test_losses_are_the_layouts():
    assert LOSSES == ("full", "parallel", "chunked")


@pytest.mark.parametrize("chunk_rows", [1, 5, 8, 36, 37, 1000, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_equals_cross_entropy_fp32(chunk_rows, reduction):
    logits, target = _case()
    loss, grad = _value_and_grad(cross_entropy, logits, target, reduction=reduction,
                                 chunk_rows=chunk_rows)
    ref, ref_grad = _value_and_grad(_reference, logits, target, reduction=reduction)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(grad, ref_grad, **GRAD32)
    assert grad[target == -100].abs().sum() == 0


@pytest.mark.parametrize("chunk_rows", [3, 7, 64])
def test_chunked_equals_cross_entropy_bf16_and_3d(chunk_rows):
    logits, target = _case(rows=40, vocab=61, dtype=torch.bfloat16)
    logits, target = logits.reshape(2, 20, 61), target.reshape(2, 20)
    loss, grad = _value_and_grad(cross_entropy, logits, target, chunk_rows=chunk_rows)
    ref, ref_grad = _value_and_grad(_reference, logits, target)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert grad.shape == logits.shape
    torch.testing.assert_close(loss, ref, **FP32)
    torch.testing.assert_close(grad, ref_grad, **GRAD16)


def test_another_ignore_index_and_a_scaled_backward():
    logits, target = _case(ignored=0)
    target[:4] = 7
    for reduction in ("mean", "sum"):
        x = logits.clone().requires_grad_(True)
        (cross_entropy(x, target, ignore_index=7, reduction=reduction, chunk_rows=6) * 3).backward()
        y = logits.clone().requires_grad_(True)
        (_reference(y, target, reduction, ignore_index=7) * 3).backward()
        torch.testing.assert_close(x.grad, y.grad, **GRAD32)
        assert x.grad[:4].abs().sum() == 0


def test_every_target_ignored_gives_nan_mean_and_zero_grad():
    logits = torch.randn(4, 9, requires_grad=True)
    loss = cross_entropy(logits, torch.full((4,), -100))
    assert torch.isnan(loss) and torch.isnan(_reference(logits, torch.full((4,), -100)))
    loss.backward()
    assert logits.grad.abs().sum() == 0


def test_without_gradients_only_chunks_are_made():
    logits, target = _case(rows=64, vocab=1000, ignored=3)
    live = LiveBytes()
    with torch.no_grad(), live:
        live.track(logits)  # counted once, so that views of it add nothing
        loss = cross_entropy(logits, target, chunk_rows=8)
    torch.testing.assert_close(loss, _reference(logits, target), **FP32)
    assert live.peak - logits.nbytes < 8 * 1000 * 4 + 2**14  # one fp32 chunk, per-row numbers


def test_works_on_fake_tensors():
    with FakeTensorMode():
        logits = torch.randn(2, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
        loss = cross_entropy(logits, torch.randint(0, 1000, (2, 64)), chunk_rows=50)
        loss.backward()
        assert loss.shape == () and logits.grad.shape == logits.shape


def test_retained_graph_is_refused():
    logits = torch.randn(3, 5, requires_grad=True)
    loss = cross_entropy(logits, torch.tensor([0, 1, 2]))
    loss.backward(retain_graph=True)
    with pytest.raises(LossError, match="backward ran twice"):
        loss.backward()


def test_bad_arguments_are_refused():
    logits = torch.randn(3, 5)
    with pytest.raises(LossError, match="unknown reduction"):
        cross_entropy(logits, torch.tensor([0, 1, 2]), reduction="none")
    with pytest.raises(LossError, match="shape of the logits"):
        cross_entropy(logits, torch.tensor([0, 1]))
    with pytest.raises(LossError, match="integer class ids"):
        cross_entropy(logits, torch.zeros(3))
    with pytest.raises(LossError, match="positive integer"):
        cross_entropy(logits, torch.tensor([0, 1, 2]), chunk_rows=0)
    with pytest.raises(LossError, match="unknown loss mode"):
        CausalLMLoss("fused")
    assert issubclass(LossError, ScheduleError)


def test_default_chunk_fits_the_budget():
    rows = default_chunk_rows(32000)
    assert rows * 32000 * 4 <= CHUNK_BYTES < (rows + 1) * 32000 * 4
    assert default_chunk_rows(CHUNK_BYTES) == 1


# ------------------------------------------------------------------ memory (allocator counts)

BATCH, SEQ, VOCAB = 2, 512, 32000
LOGITS_BYTES = BATCH * SEQ * VOCAB * 2  # bf16


def _peak_above_logits(loss_fn) -> int:
    """Live bytes at the worst moment of forward + backward, beyond the logits (made
    before counting): the loss's temporaries, what it saves, and the logits' gradient."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    live = LiveBytes()
    with live:
        live.track(logits)  # counted once, so that views of it add nothing
        loss = loss_fn(logits, labels)
        loss.backward()
        del loss
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    return live.peak - LOGITS_BYTES


def test_chunked_memory_is_one_gradient_buffer_and_a_chunk():
    chunked = _peak_above_logits(
        lambda logits, labels: CausalLMLoss("chunked")(logits, labels, vocab_size=VOCAB))
    full = _peak_above_logits(
        lambda logits, labels: ForCausalLMLoss(logits, labels, vocab_size=VOCAB))
    chunk = default_chunk_rows(VOCAB) * VOCAB * 4
    # the gradient buffer (bf16, logits-sized), one fp32 chunk, and per-row vectors
    assert LOGITS_BYTES + chunk <= chunked <= LOGITS_BYTES + chunk + 2**20, (chunked, full)
    # transformers: an fp32 copy and its fp32 log-softmax, then two fp32 gradients
    assert full >= 3 * 2 * LOGITS_BYTES, (chunked, full)
    assert chunked < 0.4 * full, (chunked, full)
    print(f"peak above the bf16 logits ({LOGITS_BYTES / 2**20:.1f} MiB): chunked "
          f"{chunked / 2**20:.1f} MiB, transformers' ForCausalLMLoss {full / 2**20:.1f} MiB")


# ------------------------------------------------------------------ the drop-in on a model


def _llama() -> transformers.LlamaForCausalLM:
    return tiny.llama(n_layer=2)


def test_causal_lm_loss_equals_the_models_own():
    model = _llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_sum = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5)).loss
    for mode in ("chunked", "parallel", "full"):
        model.zero_grad()
        set_loss(model, mode)
        assert isinstance(model.loss_function, CausalLMLoss) == (mode != "full")
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.loss, ref.loss, **FP32)
        out.loss.backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
        with torch.no_grad():
            summed = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5)).loss
        torch.testing.assert_close(summed, ref_sum, **FP32)


def test_causal_lm_loss_shift_labels_and_copies():
    logits = torch.randn(2, 6, 10)
    shift = torch.randint(0, 10, (2, 6))
    ref = ForCausalLMLoss(logits, None, vocab_size=10, shift_labels=shift)
    loss = CausalLMLoss("chunked", chunk_rows=5)(logits, None, vocab_size=10, shift_labels=shift)
    torch.testing.assert_close(loss, ref, **FP32)
    fn = CausalLMLoss("chunked")
    assert pickle.loads(pickle.dumps(fn)) == fn and copy.deepcopy(fn) == fn
    with pytest.raises(LossError, match="times the group's size is not the vocabulary"):
        fn(logits, shift, vocab_size=20)


def test_next_token_loss_modes_agree_with_train():
    from torchloom.apps.train import next_token_loss as train_loss

    logits, ids = torch.randn(3, 9, 17), torch.randint(0, 17, (3, 9))
    ref = train_loss(logits, ids)
    assert torch.equal(next_token_loss("full")(logits, ids), ref)
    for mode in ("chunked", "parallel"):
        fn = next_token_loss(mode)
        torch.testing.assert_close(fn(logits, ids), ref, **FP32)
        assert pickle.loads(pickle.dumps(fn)) == fn


def test_set_loss_refuses_a_model_without_loss_function():
    with pytest.raises(LossError) as err:
        set_loss(nn.Linear(2, 2), "chunked")
    assert str(err.value) == (
        "set_loss(...): the model has no causal-LM loss_function to replace: Linear computes "
        "no transformers next-token loss\n"
        "    values: model='Linear', mode='chunked', loss_type=None\n"
        "    fix: set_loss(model, 'full') (keep the model's loss), or compute the loss from the "
        "logits: torchloom.ops.loss.cross_entropy(logits, target)")
    set_loss(nn.Linear(2, 2), "full")  # nothing to change: allowed
    with pytest.raises(LossError, match="no causal-LM loss_function"):
        set_loss(tiny.bert(), "parallel")  # a masked LM: its loss shifts nothing


def test_set_loss_full_restores_the_models_own():
    model = _llama()
    set_loss(model, "chunked")
    set_loss(model, "full")
    assert "_loss_function" not in model.__dict__
    assert model.loss_function is ForCausalLMLoss


# ------------------------------------------------------------------ schedules, parallelize, train
# (a world of one: the schedules' primitives are recorded; two ranks:
# test_loss_parallel_dist.py)


def _untied_llama(tied: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=64, tie_word_embeddings=tied))


def test_the_llama_schedule_splits_the_head_and_installs_the_loss():
    import torchloom as tl
    from torchloom.schedules import apply_schedule

    for sp in (False, True):
        model = _untied_llama()
        sch = tl.create_schedule(model)
        apply_schedule(sch, tp=True, sequence_parallel=sp, loss_parallel=True)
        lines = [e.call_text() for e in sch.recipe]
        assert "sch['lm_head'].shard('weight', 0)" in lines
        assert ("sch['lm_head'].sync('bwd_post', 'all_reduce')" in lines) != sp
        gather = ("sch['model.norm'].sync('fwd_post', 'all_gather', axis=1, "
                  "tensor_parallel_output_grad=True)")
        assert (gather in lines) == sp
        assert model.loss_function == CausalLMLoss("chunked", None)


def test_loss_parallel_refusals():
    import torchloom as tl
    from torchloom.core.errors import ModelSizeError, ScheduleConfigError
    from torchloom.schedules import ScheduleConfig, apply_schedule

    with pytest.raises(ModelSizeError) as err:
        apply_schedule(tl.create_schedule(_untied_llama(tied=True)), tp=True, loss_parallel=True)
    assert str(err.value) == (
        "sch['lm_head'].schedules.schedule_llama(...): loss parallelism splits the head "
        "lm_head along the vocabulary, and its weight is tied to model.embed_tokens: only an "
        "untied head is split\n"
        "    values: head='lm_head', tied_to='model.embed_tokens'\n"
        "    fix: untie it (config.tie_word_embeddings = False before the model is made), or "
        "keep whole logits: drop loss_parallel (a Layout's loss='chunked' falls back to whole "
        "logits by itself)")
    with pytest.raises(ScheduleConfigError, match="it needs tp=True"):
        ScheduleConfig(loss_parallel=True)
    with pytest.raises(ScheduleConfigError, match="unknown knob 'loss_parallel'"):
        apply_schedule(tl.create_schedule(tiny.gpt2()), tp=True, loss_parallel=True)


def test_parallelize_installs_the_layouts_loss():
    from torchloom.core.errors import LayoutError
    from torchloom.parallel import Layout, create_schedule, parallelize
    from torchloom.parallel.parallelize import loss_plan

    batch = tiny.token_batch(vocab=64)
    reference = _untied_llama()
    ref = reference(**batch).loss
    for loss in ("full", "chunked"):  # ("parallel" needs tp > 1)
        model = _untied_llama()
        done = parallelize(create_schedule(model, None), Layout(loss=loss))
        assert (done.loss, done.vocab_sharded) == (loss, False)
        assert isinstance(model.loss_function, CausalLMLoss) == (loss != "full")
        torch.testing.assert_close(done.model(**batch).loss, ref, **FP32)
        assert done.next_token_loss == next_token_loss(loss)
    bert = tiny.bert()
    done = parallelize(create_schedule(bert, None), Layout())  # a masked LM keeps its loss
    assert (done.loss, "_loss_function" in bert.__dict__) == ("full", False)
    with pytest.raises(LayoutError, match=r"keeps the head whole \(it takes no loss_parallel"):
        loss_plan(create_schedule(tiny.gpt2(), None), Layout(tp=2, loss="parallel"))
    with pytest.raises(LayoutError, match=r"(?s)Float8 matmuls run on a CUDA GPU, and the device "
                       r"is cpu.*fix: run on a CUDA GPU of compute capability 8\.9"):
        parallelize(create_schedule(_untied_llama(), None), Layout(float8=True))
    with pytest.raises(LayoutError, match=r"modelled by the planner only for now"):
        parallelize(create_schedule(_untied_llama(), None),
                    Layout(tp=2, sp=True, compile=True, async_tp=True))


def test_resume_accepts_a_changed_loss_and_an_older_checkpoint():
    from torchloom.apps.jobconfig import LAYOUT_FIELDS, TrainConfig
    from torchloom.apps.train_checkpoints import compare, run_config

    assert "loss" in LAYOUT_FIELDS
    saved = run_config(TrainConfig(loss="full"), "recipe a")
    assert compare(saved, run_config(TrainConfig(), "recipe b"), "step-2", "runs/x") == [
        "loss: 'full' -> 'chunked'"]
    older = {k: v for k, v in saved.items() if k not in ("loss", "float8")}
    assert compare(older, run_config(TrainConfig(), "b"), "step-2", "runs/x") == [
        "loss: 'full' -> 'chunked'"]
