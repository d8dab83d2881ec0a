"""A scheduled transformers model computes what the original computes.

GPT-2 and BERT (tiny configs, dropout on, train mode) with ``checkpoint``, ``replace``
and ``annotate`` applied, built with ``build``: the loss and every parameter gradient
equal the unscheduled model's. Checkpointing and tagging change no arithmetic, so they
are compared exactly; where a replacement writes the same math in another order of
operations the tolerance is stated next to the assertion.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.helpers import make_explicit_mlp
from torchloom.tools.testing import verify_recipe_roundtrip


class SelfAttentionOutput(nn.Module):
    """BERT's attention output block re-written by a user: same parameters, same math."""

    def __init__(self, old: nn.Module) -> None:
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = old.dense, old.LayerNorm, old.dropout

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


def make_attention_output(old: nn.Module) -> nn.Module:
    return SelfAttentionOutput(old)


def _step(model: nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the same dropout masks for both models
    model.train()
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(model: nn.Module, reference: nn.Module, batch: dict, exact: bool) -> None:
    for seed in (0, 1):
        loss, grads = _step(model, batch, seed)
        ref_loss, ref_grads = _step(reference, batch, seed)
        assert grads.keys() == ref_grads.keys()
        if exact:
            assert torch.equal(loss, ref_loss)
            for name in grads:
                assert torch.equal(grads[name], ref_grads[name]), name
        else:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6)


def test_gpt2_checkpoint_and_annotate_are_exact():
    reference = tiny.gpt2(dropout=0.1)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].checkpoint()
    sch["transformer.h.*.mlp.c_fc"].annotate("weight", "colwise", True)
    built, _ = tl.build(sch)
    _assert_same(built, reference, tiny.token_batch(), exact=True)
    verify_recipe_roundtrip(sch, lambda: tiny.gpt2(dropout=0.1), (tiny.token_batch()["input_ids"],))


def test_gpt2_replace_checkpoint_annotate():
    reference = tiny.gpt2(dropout=0.1)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["transformer.h.*.mlp"].replace(make_explicit_mlp)
    sch["transformer.h"].checkpoint(ratio=0.5)
    sch["transformer.h.*.attn.c_attn"].annotate("weight", "fused_qkv", True)
    built, _ = tl.build(sch)
    # The explicit MLP uses `x @ W + b` where Conv1D uses addmm: round-off differs.
    _assert_same(built, reference, tiny.token_batch(), exact=False)


def test_bert_replace_checkpoint_annotate():
    reference = tiny.bert(dropout=0.1)
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.*.attention.output"].replace(make_attention_output)
    sch["bert.encoder.layer.*"].checkpoint()
    sch["bert.embeddings.word_embeddings"].annotate("weight", "vocab_parallel", False)
    built, _ = tl.build(sch)
    batch = tiny.token_batch()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][:, -3:] = 0
    # Same modules called in the same order: exact.
    _assert_same(built, reference, batch, exact=True)
    verify_recipe_roundtrip(sch, lambda: tiny.bert(dropout=0.1), (batch["input_ids"],))
