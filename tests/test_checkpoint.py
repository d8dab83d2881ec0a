"""Tests of the ``checkpoint`` primitive: exactness with dropout on (RNG replay in the
recompute), real recompute (flops), lower saved-activation memory, the ``ratio`` form,
and every error path."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import torchloom as tl
from torchloom.core.errors import CheckpointError, ScheduleError
from torchloom.core.marks import CHECKPOINTED, has_mark
from torchloom.primitives import checkpoint as ckpt_mod

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB = 128


# --------------------------------------------------------------------------- helpers


def tiny_gpt2(n_layer: int = 2) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def tiny_bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2, num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def inputs(batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 4:] = 0  # padding, so the mask matters
    return {"input_ids": ids, "attention_mask": mask}


def step(model: nn.Module, seed: int, **kwargs: torch.Tensor):
    """Seeded forward + backward; the loss, the logits and every gradient by name."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def assert_exact(a, b) -> None:
    loss_a, logits_a, grads_a = a
    loss_b, logits_b, grads_b = b
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(logits_a, logits_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def count_calls(module: nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda m, i, o: calls.append(1))
    return calls


# --------------------------------------------------------------------------- exactness


def test_gpt2_every_block_exact_with_dropout():
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    text = str(model)
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].checkpoint()
    assert len(sch.recipe) == 2
    assert all(has_mark(b, CHECKPOINTED) for b in model.transformer.h)
    # the module tree and the keys are untouched: no wrapper module
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert str(model) == text

    # the recompute really runs: the attention of block 0 is called twice per step
    attn_calls = count_calls(model.transformer.h[0].attn)
    block_calls = count_calls(model.transformer.h[0])
    batch = inputs()
    got = step(model, 7, labels=batch["input_ids"], **batch)  # attention_mask by keyword
    assert len(attn_calls) == 2 and len(block_calls) == 1  # the block's hook is outside
    assert_exact(got, step(ref, 7, labels=batch["input_ids"], **batch))
    # dropout is really on: another seed changes the loss
    assert not torch.equal(step(ref, 8, labels=batch["input_ids"], **batch)[0], got[0])


def test_bert_every_layer_exact_with_dropout():
    ref = tiny_bert()
    model = copy.deepcopy(ref)
    keys = list(model.state_dict())
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.*"].checkpoint()
    assert list(model.state_dict()) == keys
    calls = count_calls(model.bert.encoder.layer[1].attention.self)
    batch = inputs()
    labels = torch.tensor([0, 2])
    got = step(model, 3, labels=labels, **batch)
    assert len(calls) == 2
    assert_exact(got, step(ref, 3, labels=labels, **batch))


def test_bert_layer_called_with_keyword_mask():
    ref = tiny_bert()
    model = copy.deepcopy(ref)
    tl.create_schedule(model)["bert.encoder.layer.0"].checkpoint()
    hidden = torch.randn(2, 8, 32, requires_grad=True)
    mask = torch.zeros(2, 1, 1, 8)
    mask[1, ..., 6:] = torch.finfo(torch.float32).min
    outs = []
    for m in (model, ref):
        h = hidden.detach().clone().requires_grad_()
        torch.manual_seed(5)
        out = m.bert.encoder.layer[0](hidden_states=h, attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out
        out.pow(2).sum().backward()
        outs.append((out.detach(), h.grad, m.bert.encoder.layer[0].output.dense.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


class KwargModule(nn.Module):
    """A forward whose keyword names clash with torch.utils.checkpoint's own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, function, debug=None, context_fn=None, scale=1.0):
        y = self.drop(self.lin(x)) * scale * function
        return y if debug is None else y + debug


def test_keyword_arguments_even_with_clashing_names():
    ref = KwargModule()
    model = copy.deepcopy(ref)
    tl.create_schedule(model).checkpoint()  # the root may be checkpointed
    x = torch.randn(3, 4)
    bias = torch.randn(4, requires_grad=True)
    results = []
    for m in (model, ref):
        b = bias.detach().clone().requires_grad_()
        torch.manual_seed(0)
        out = m(x, function=2.0, debug=b, context_fn="not the checkpoint's", scale=3.0)
        out.sum().backward()
        results.append((out.detach(), b.grad, m.lin.weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_hooks_run_once_and_eval_or_no_grad_skip_recompute():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    inner = count_calls(model[0][0])
    pre: list[int] = []
    model[0].register_forward_pre_hook(lambda m, a: pre.append(1))
    tl.create_schedule(model)["0"].checkpoint()
    x = torch.randn(2, 4)
    model(x).sum().backward()
    assert (len(inner), len(pre)) == (2, 1)  # recompute reran the inside, not the hooks

    inner.clear()
    with torch.no_grad():
        model(x)
    assert len(inner) == 1
    inner.clear()
    model.eval()
    model(x).sum().backward()
    assert len(inner) == 1  # eval mode: no checkpoint, no recompute


def test_deepcopy_of_a_checkpointed_model_points_at_the_copy():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 1))
    tl.create_schedule(model)["0"].checkpoint()
    clone = copy.deepcopy(model)
    assert clone[0].forward.module is clone[0]
    assert has_mark(clone[0], CHECKPOINTED)
    x = torch.randn(5, 4)
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(1)
    b = clone(x)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- cost


B, D, H, L = 8, 16, 64, 4


def mlp_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Dropout(0.1), nn.Linear(H, D))
        for _ in range(L)
    ])


def train_flops(model: nn.Module) -> int:
    x = torch.randn(B, D)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("ratio", [0, 0.25, 0.5, 1])
def test_recompute_costs_the_extra_forward(ratio):
    base = train_flops(mlp_stack())
    model = mlp_stack()
    tl.create_schedule(model).checkpoint(ratio=ratio)
    extra = train_flops(model) - base
    # The recompute re-runs each checkpointed block's forward up to the last tensor
    # backward needs. The second Linear's addmm saves its *inputs* before it computes, so
    # non-reentrant checkpoint's early stop skips that one matmul; the first Linear
    # (2*B*D*H flops) is recomputed. So the difference is exact:
    per_block = 2 * B * D * H
    assert base == 3 * (2 * 2 * B * D * H) * L - 2 * B * D * H  # fwd + 2x bwd, no dx for x
    assert extra == int(ratio * L) * per_block


def saved_activation_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages autograd saves during forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    batch = inputs(batch=4, seq=32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(labels=batch["input_ids"], **batch)
    out.loss.backward()
    return sum(seen.values())


def test_saved_activation_memory_falls():
    base = tiny_gpt2(n_layer=4)
    sizes = {}
    for ratio in (None, 0.5, 1.0):
        model = copy.deepcopy(base)
        if ratio is not None:
            tl.create_schedule(model)["transformer.h"].checkpoint(ratio=ratio)
        sizes[ratio] = saved_activation_bytes(model)
    # measured on torch 2.13 CPU: 2485508, 1334532 and 183556 bytes
    assert sizes[1.0] < 0.15 * sizes[None]
    assert sizes[1.0] < sizes[0.5] < sizes[None]
    assert abs(sizes[0.5] - (sizes[None] + sizes[1.0]) / 2) < 0.1 * sizes[None]


# --------------------------------------------------------------------------- ratio


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7])
@pytest.mark.parametrize("ratio", [0, 0.25, 0.5, 0.9, 1, 1.0])
def test_ratio_checkpoints_the_first_items(container, n, ratio):
    layers = container(*[nn.Linear(2, 2) for _ in range(n)]) if container is nn.Sequential \
        else container([nn.Linear(2, 2) for _ in range(n)])
    model = nn.Sequential(nn.Linear(2, 2), layers)
    sch = tl.create_schedule(model)
    sch["1"].checkpoint(ratio=ratio)
    marked = [has_mark(m, CHECKPOINTED) for m in layers]
    assert marked == [i < int(ratio * n) for i in range(n)]
    assert not has_mark(layers, CHECKPOINTED)
    assert len(sch.recipe) == 1
    assert sch.recipe[0].call_text() == f"sch['1'].checkpoint(ratio={ratio!r})"


def test_ratio_guards_against_float_error():
    layers = nn.ModuleList(nn.Identity() for _ in range(100))
    tl.create_schedule(layers).checkpoint(ratio=0.29)  # 0.29 * 100 == 28.999999999999996
    assert sum(has_mark(m, CHECKPOINTED) for m in layers) == 29 == math.floor(29.0)


def test_ratio_on_gpt2_and_replay():
    model = tiny_gpt2(n_layer=4)
    sch = tl.create_schedule(model)
    sch["transformer.h"].checkpoint(ratio=0.5)
    assert [has_mark(b, CHECKPOINTED) for b in model.transformer.h] == \
        [True, True, False, False]
    replayed = tl.apply_recipe(tiny_gpt2(n_layer=4), tl.Recipe.from_json(sch.recipe.to_json()))
    assert [has_mark(b, CHECKPOINTED) for b in replayed.mod.transformer.h] == \
        [True, True, False, False]


def test_same_layer_in_two_slots_is_checkpointed_once():
    shared = nn.Linear(2, 2)
    layers = nn.ModuleList([shared, shared, nn.Linear(2, 2)])
    tl.create_schedule(layers).checkpoint(ratio=1)
    assert shared.forward.inner is None  # wrapped once, not twice


def test_nested_checkpoints_are_exact():
    ref = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4)),
                        nn.Dropout(0.5))
    model = copy.deepcopy(ref)
    sch = tl.create_schedule(model)
    sch.checkpoint()
    sch["0"].checkpoint(ratio=1.0)
    x = torch.randn(3, 4)
    grads = []
    for m in (model, ref):
        torch.manual_seed(0)
        m(x).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- errors


def test_checkpoint_twice():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    sch["0"].checkpoint()
    with pytest.raises(
        CheckpointError,
        match=r"^sch\['0'\]\.checkpoint\(\.\.\.\): this module is already checkpointed\n"
        r"    values: module='Linear', checkpointed_path='0'\n"
        r"    fix: checkpoint each module once: remove the second sch\['0'\]\.checkpoint\(\)$",
    ):
        sch["0"].checkpoint()
    assert len(sch.recipe) == 1


def test_ratio_on_a_module_that_is_not_a_list():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(
        CheckpointError,
        match=r"^sch\['0'\]\.checkpoint\(\.\.\.\): ratio needs an nn\.ModuleList or "
        r"nn\.Sequential of layers to choose from\n"
        r"    values: module='Linear', ratio=0\.5\n"
        r"    fix: checkpoint the whole module: sch\['0'\]\.checkpoint\(\), or point ratio",
    ):
        sch["0"].checkpoint(ratio=0.5)
    assert len(sch.recipe) == 0


@pytest.mark.parametrize("ratio", [-0.1, 1.5, "half", True, float("nan")])
def test_ratio_out_of_range(ratio):
    sch = tl.create_schedule(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(
        CheckpointError,
        match=r"^sch\[''\]\.checkpoint\(\.\.\.\): ratio must be a number between 0 and 1 "
        r"\(the share of items to checkpoint\)\n    values: ratio=.*\n"
        r"    fix: e\.g\. sch\[''\]\.checkpoint\(ratio=0\.5\) checkpoints the first half$",
    ):
        sch.checkpoint(ratio=ratio)


def test_module_list_without_ratio():
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)] * 2))
    sch = tl.create_schedule(model)
    with pytest.raises(
        CheckpointError,
        match=r"^sch\['0'\]\.checkpoint\(\.\.\.\): a ModuleList has no forward of its own to "
        r"checkpoint\n    values: module='ModuleList', items=2\n"
        r"    fix: checkpoint its items: sch\['0'\]\.checkpoint\(ratio=1\.0\) or "
        r"sch\['0\.\*'\]\.checkpoint\(\)$",
    ):
        sch["0"].checkpoint()


def test_ratio_hits_an_item_without_forward():
    layers = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)]), nn.Linear(2, 2)])
    with pytest.raises(
        CheckpointError,
        match=r"^sch\[''\]\.checkpoint\(\.\.\.\): item 0 is a ModuleList, which has no forward"
        r" of its own to checkpoint\n    values: item='0', ratio=1\n"
        r"    fix: checkpoint the layers inside it, e\.g\. sch\['0\.\*'\]\.checkpoint\(\)$",
    ):
        tl.create_schedule(layers).checkpoint(ratio=1)


def test_ratio_over_an_item_checkpointed_already_changes_nothing():
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    sch = tl.create_schedule(layers)
    sch["2"].checkpoint()
    with pytest.raises(
        CheckpointError,
        match=r"^sch\[''\]\.checkpoint\(\.\.\.\): this module is already checkpointed\n"
        r"    values: module='Linear', checkpointed_path='2'\n"
        r"    fix: item 2 is checkpointed already: lower the ratio or remove the earlier "
        r"sch\['2'\]\.checkpoint\(\)$",
    ):
        sch.checkpoint(ratio=1)
    assert [has_mark(m, CHECKPOINTED) for m in layers] == [False, False, True, False]
    assert len(sch.recipe) == 1
    sch.checkpoint(ratio=0.5)  # the items before it are still free
    assert [has_mark(m, CHECKPOINTED) for m in layers] == [True, True, True, False]


def test_kv_cache_in_training_is_turned_off_with_one_warning():
    # (was refused with a CheckpointError; a default transformers config makes a cache in
    # training, so the layer now runs without it, as transformers' gradient checkpointing
    # does; tests/test_defaults.py covers default configs and prefilled caches)
    from torchloom.graph import guards

    guards._WARNED.clear()
    model = tiny_gpt2()
    tl.create_schedule(model)["transformer.h.*"].checkpoint()
    ids = inputs()["input_ids"]
    with pytest.warns(UserWarning, match=r"caching is incompatible with activation "
                      r"checkpointing in GPT2Block .*running them in training with "
                      r"cache=None, use_cache=False"):
        torch.manual_seed(0)
        with_cache = model(ids, labels=ids, use_cache=True).loss
    torch.manual_seed(0)
    assert torch.equal(with_cache, model(ids, labels=ids, use_cache=False).loss)
    with torch.no_grad():  # no checkpoint without grad: generation-style calls keep working
        model(ids, use_cache=True)


def test_errors_are_schedule_errors():
    assert issubclass(CheckpointError, ScheduleError)
    assert ckpt_mod.NAME == "checkpoint"


# --------------------------------------------------------------------------- op-level policy


def test_op_policy_recomputes_no_matmul_and_keeps_the_gradients():
    """``policy="op"`` (torchtitan's op-level selective checkpointing) keeps the output of
    each block's first matrix product (the odd ones are saved): the backward recomputes
    no matmul (0 extra FLOPs, where a full recompute re-runs one matmul per block; the
    second product's output is not needed by any backward), only the cheap ops (ReLU,
    dropout, with the same random mask), and the gradients equal the unscheduled
    model's bit for bit."""
    base, full, op = mlp_stack(), mlp_stack(), mlp_stack()
    tl.create_schedule(full).checkpoint(ratio=1)
    tl.create_schedule(op).checkpoint(ratio=1, policy="op")
    assert train_flops(op) == train_flops(base)
    assert train_flops(full) == train_flops(base) + L * 2 * B * D * H
    x = torch.randn(B, D)
    grads = []
    for model in (base, op):
        model.zero_grad()
        torch.manual_seed(3)  # the dropout masks
        model(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)


def test_op_policy_recomputes_every_other_linear_product():
    """Four products per block, each followed by a ReLU whose backward needs it: the
    first and third outputs are kept, the second recomputed (one matmul of the block's
    forward FLOPs again), the fourth's output is needed by its ReLU too: recomputed.
    Two of four products recomputed, against all four under full checkpointing."""
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(H, H), nn.ReLU())])

    base = nn.Sequential(*[block() for _ in range(L)])
    full, op = copy.deepcopy(base), copy.deepcopy(base)
    tl.create_schedule(full).checkpoint(ratio=1)
    tl.create_schedule(op).checkpoint(ratio=1, policy="op")
    one = 2 * B * H * H  # one product's forward FLOPs
    x = torch.randn(B, H)

    def flops(model: nn.Module) -> int:
        with FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        return counter.get_total_flops()

    assert flops(full) == flops(base) + L * 4 * one
    assert flops(op) == flops(base) + L * 2 * one
    grads = []
    for model in (base, op):
        model.zero_grad()
        model(x).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)


def test_op_policy_on_a_transformers_llama_equals_no_checkpointing():
    """Per-op selective checkpointing of every layer of a default-config Llama (sizes
    shrunk) changes no number: the loss and every gradient equal the plain model's bit
    for bit."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).train()
    op = copy.deepcopy(base)
    tl.create_schedule(op)["model.layers"].checkpoint(ratio=1, policy="op")
    ids = torch.randint(0, 128, (2, 16))
    losses, grads = [], []
    for model in (base, op):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(losses[0], losses[1])
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.equal(got, want)


def test_an_unknown_policy_is_refused():
    sch = tl.create_schedule(mlp_stack())
    with pytest.raises(CheckpointError) as info:
        sch["0"].checkpoint(policy="selective")
    assert str(info.value) == (
        "sch['0'].checkpoint(...): unknown checkpoint policy 'selective'\n"
        "    values: policy='selective', policies=['op']\n"
        "    fix: sch['0'].checkpoint(policy='op'), or no policy (recompute all)")
