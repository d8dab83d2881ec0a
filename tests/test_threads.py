"""Two threads scheduling two models at once get correct results.

torch.fx patches ``nn.Module.__call__`` process-wide while it traces (and torchloom's
tracer patches a few ``torch`` factory functions); before traces were serialised and the
patches made thread-aware, two threads tracing two models failed 9 times in 12 with
misleading errors. Each thread here builds a model from a default transformers config
(sizes only), keeps an untraced copy, traces it down to its layers (the example inputs are
captured by running the model, so model runs and traces of both threads interleave),
checkpoints half of its layers, and compares the outputs with the copy, 20 times.
"""

from __future__ import annotations

import copy
import threading

import torch
import transformers

import torchloom as tl

ROUNDS = 20


def _gpt2() -> transformers.PreTrainedModel:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32))


def _bert() -> transformers.PreTrainedModel:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=64, max_position_embeddings=32))


def _schedule_and_compare(make, layers: str, results: list) -> None:
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(ROUNDS):
        try:
            model = make().eval()
            reference = copy.deepcopy(model)
            sch = tl.create_schedule(model)
            sch.trace_until(f"{layers}.*")
            sch[layers].checkpoint(ratio=0.5)
            with torch.no_grad():
                got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
            results.append(bool(torch.equal(got, want)) and tl.tracing.is_traced(model))
        except Exception as exc:  # noqa: BLE001 - recorded and reported by the test
            results.append(f"{type(exc).__name__}: {exc}")


def test_two_threads_trace_two_models_correctly_every_time():
    results: dict[str, list] = {"gpt2": [], "bert": []}
    threads = [
        threading.Thread(target=_schedule_and_compare,
                         args=(_gpt2, "transformer.h", results["gpt2"])),
        threading.Thread(target=_schedule_and_compare,
                         args=(_bert, "bert.encoder.layer", results["bert"])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for name, outcome in results.items():
        assert outcome == [True] * ROUNDS, (name, [r for r in outcome if r is not True][:3])
