"""Tests of the rng tracker, ``set_random_seed`` and the ``fork_rng`` primitive, alone and
composed with ``checkpoint``."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom.core.errors import RngError, ScheduleError
from torchloom.core.marks import FORK_RNG, get_mark
from torchloom.primitives import checkpoint as ckpt_mod
from torchloom.primitives.fork_rng import _device_of
from torchloom.runtime.rng import RngStatesTracker, get_rng_tracker, set_random_seed

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

MP = "model-parallel"


@pytest.fixture(autouse=True)
def clean_tracker():
    get_rng_tracker().reset()
    yield
    get_rng_tracker().reset()


# --------------------------------------------------------------------------- seeding


def test_set_random_seed_seeds_every_generator_and_the_tp_state():
    assert set_random_seed(5, tp_rank=2, dp_rank=1, pp_rank=3) == 5 + 300 + 10
    assert get_rng_tracker().seeds() == {MP: 315 + 2718 + 2}
    drawn = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(315)
    np.random.seed(315)
    torch.manual_seed(315)
    assert drawn[:2] == (random.random(), np.random.rand())
    assert torch.equal(drawn[2], torch.rand(1))
    # seeding again replaces the state (no duplicate-name error)
    assert set_random_seed(5, tp_rank=1) == 5
    assert get_rng_tracker().seeds() == {MP: 5 + 2718 + 1}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "7"])
def test_set_random_seed_rejects_bad_seeds(bad):
    with pytest.raises(
        RngError,
        match=r"^set_random_seed\(\.\.\.\): seed must be a non-negative integer\n"
        r"    values: seed=.*\n"
        r"    fix: torchloom\.set_random_seed\(1234, tp_rank=0, dp_rank=0, pp_rank=0\)$",
    ):
        set_random_seed(bad)


def test_set_random_seed_rejects_bad_ranks_and_huge_seeds():
    with pytest.raises(RngError, match=r"tp_rank must be a non-negative integer\n"
                       r"    values: tp_rank=-1\n"):
        set_random_seed(1, tp_rank=-1)
    with pytest.raises(RngError, match=r"^set_random_seed\(\.\.\.\): the seed is too large for "
                       r"numpy \(seeds must stay below 2\*\*32\)\n"):
        set_random_seed(2**32 - 1)


# --------------------------------------------------------------------------- tracker


def test_tracker_add_errors():
    t = RngStatesTracker()
    t.add("a", 1)
    with pytest.raises(
        RngError,
        match=r"^rng_tracker\.add\(\.\.\.\): a state called 'a' is already registered\n"
        r"    values: name='a', seed=2, registered_seed=1\n"
        r"    fix: call rng_tracker\.reset\(\) first, or pick another name$",
    ):
        t.add("a", 2)
    with pytest.raises(
        RngError,
        match=r"^rng_tracker\.add\(\.\.\.\): seed 1 is already used by state 'a'\n"
        r"    values: name='b', seed=1\n"
        r"    fix: give each state its own seed, e.g\. rng_tracker\.add\('b', 2\)$",
    ):
        t.add("b", 1)
    with pytest.raises(RngError, match=r"a state name is a non-empty string"):
        t.add("", 3)
    assert t.is_seeded("a") and not t.is_seeded(MP)
    t.reset()
    assert not t.is_seeded("a") and t.seeds() == {}
    t.add("a", 1)  # free again after reset


def test_get_and_set_states_are_copies():
    t = RngStatesTracker()
    t.add(MP, 10)
    with t.fork():
        torch.rand(1)
    states = t.get_states()
    assert list(states) == [MP] and list(states[MP]) == ["cpu"]
    original = states[MP]["cpu"].clone()
    states[MP]["cpu"].zero_()  # changing the copy leaves the tracker alone
    assert torch.equal(t.get_states()[MP]["cpu"], original)
    mine = {MP: {"cpu": original.clone()}}
    t.set_states(mine)
    mine[MP]["cpu"].zero_()  # changing what was installed leaves the tracker alone
    assert torch.equal(t.get_states()[MP]["cpu"], original)
    with pytest.raises(
        RngError,
        match=r"^rng_tracker\.set_states\(\.\.\.\): set_states takes the dict that get_states "
        r"returned\n    values: states='list'\n",
    ):
        t.set_states([1, 2])


def test_set_states_keeps_seeds_for_lazy_device_states():
    t = RngStatesTracker()
    t.add(MP, 10)
    t.set_states({})
    assert not t.is_seeded(MP)
    t.set_states({MP: {}})
    assert t.seeds() == {MP: 10}
    with t.fork():  # the cpu state is created lazily from the kept seed
        a = torch.rand(3)
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(10)))
    t.set_states({"other": {}})
    with pytest.raises(RngError, match=r"state 'other' has no cpu state and no seed to create"):
        with t.fork("other"):
            pass


def test_fork_swaps_saves_back_and_restores():
    t = RngStatesTracker()
    t.add(MP, 42)
    torch.manual_seed(0)
    default = torch.get_rng_state()
    with t.fork(device=torch.device("cpu")):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(42)))
    with t.fork(device="cpu"):
        second = torch.rand(4)
    gen = torch.Generator().manual_seed(42)
    torch.rand(4, generator=gen)
    assert torch.equal(second, torch.rand(4, generator=gen))  # the stream went on
    assert torch.equal(torch.get_rng_state(), default)


def test_fork_restores_the_default_state_on_exception():
    t = RngStatesTracker()
    t.add(MP, 42)
    default = torch.get_rng_state()
    with pytest.raises(ValueError, match="boom"):
        with t.fork():
            torch.rand(4)
            raise ValueError("boom")
    assert torch.equal(torch.get_rng_state(), default)
    # the numbers drawn before the exception are spent: the stream does not repeat them
    with t.fork():
        after = torch.rand(4)
    assert not torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(42)))


def test_nested_fork_of_the_same_state_continues_the_stream():
    t = RngStatesTracker()
    t.add(MP, 42)
    with t.fork():
        a = torch.rand(2)
        with t.fork():
            b = torch.rand(2)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(42))
    assert torch.equal(torch.cat([a, b]), expected)


def test_fork_on_meta_does_nothing_and_bad_device_raises():
    t = RngStatesTracker()
    t.add(MP, 42)
    default = torch.get_rng_state()
    with t.fork(device="meta"):
        torch.nn.functional.dropout(torch.empty(3, device="meta"), 0.5)
    assert t.get_states() == {MP: {}}
    assert torch.equal(torch.get_rng_state(), default)
    with pytest.raises(RngError, match=r"^rng_tracker\.fork\(\.\.\.\): 'nodevice' is not a device"):
        with t.fork(device="nodevice"):
            pass


def test_fork_of_an_unknown_state():
    with pytest.raises(
        RngError,
        match=r"^rng_tracker\.fork\(\.\.\.\): no random state called 'model-parallel' is "
        r"registered\n    values: name='model-parallel', registered=\[\]\n"
        r"    fix: seed it first: torchloom\.set_random_seed\(seed, tp_rank=tp_rank\)$",
    ):
        with get_rng_tracker().fork():
            pass
    with pytest.raises(RngError,
                       match=r"fix: register it first: get_rng_tracker\(\)\.add\('x', seed\)"):
        with get_rng_tracker().fork("x"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fork_on_cuda_keeps_its_own_state():
    set_random_seed(3, tp_rank=1)
    t = get_rng_tracker()
    cpu_default, cuda_default = torch.get_rng_state(), torch.cuda.get_rng_state()
    with t.fork(device="cuda"):
        a = torch.rand(4, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(), cuda_default)
    assert torch.equal(torch.get_rng_state(), cpu_default)
    gen = torch.Generator(device="cuda").manual_seed(3 + 2718 + 1)
    assert torch.equal(a, torch.rand(4, device="cuda", generator=gen))
    assert sorted(t.get_states()[MP]) == ["cuda"]


# --------------------------------------------------------------------------- fork_rng


class TwoDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tp_drop = nn.Dropout(0.5)  # inside a (pretend) tensor-parallel region
        self.drop = nn.Dropout(0.5)     # on replicated activations

    def forward(self, x):
        return self.tp_drop(x) != 0, self.drop(x) != 0


def masks_for(tp_rank: int):
    model = TwoDropouts()
    tl.create_schedule(model)["tp_drop"].fork_rng()
    set_random_seed(0, tp_rank=tp_rank)
    return model(torch.ones(64, 64))


def test_tp_ranks_get_different_masks_inside_and_equal_masks_outside():
    tp0, drop0 = masks_for(0)
    tp1, drop1 = masks_for(1)
    assert not torch.equal(tp0, tp1)
    assert torch.equal(drop0, drop1)
    assert torch.equal(masks_for(0)[0], tp0)  # and everything is reproducible


def test_fork_rng_leaves_the_default_stream_alone():
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5))
    tl.create_schedule(model)["0"].fork_rng()
    set_random_seed(0)
    model(torch.ones(8))
    after_forked_model = torch.rand(3)
    set_random_seed(0)
    model[1](torch.ones(8))  # only the unforked dropout used the default stream
    assert torch.equal(torch.rand(3), after_forked_model)


def test_fork_rng_keeps_the_module_tree_and_marks_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    keys, text = list(model.state_dict()), str(model)
    sch = tl.create_schedule(model)
    sch["0"].fork_rng()
    assert get_mark(model[0], FORK_RNG) is True
    assert list(model.state_dict()) == keys and str(model) == text
    assert sch.recipe[0].call_text() == "sch['0'].fork_rng()"


def test_forward_without_seed_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    tl.create_schedule(model)["1"].fork_rng()
    with pytest.raises(
        RngError,
        match=r"^sch\['1'\]\.fork_rng\(\.\.\.\): the module \(Dropout\) draws from the "
        r"'model-parallel' random state, which is not seeded\n"
        r"    values: registered_states=\[\]\n"
        r"    fix: call torchloom\.set_random_seed\(seed, tp_rank=tp_rank\) before running the "
        r"model$",
    ):
        model(torch.ones(2, 4))
    model.eval()  # no dropout masks to draw in eval mode: inference runs unseeded
    assert model(torch.ones(2, 4)).shape == (2, 4)


def test_fork_rng_twice_raises():
    sch = tl.create_schedule(nn.Sequential(nn.Dropout(0.1)))
    sch["0"].fork_rng()
    with pytest.raises(
        RngError,
        match=r"^sch\['0'\]\.fork_rng\(\.\.\.\): fork_rng was already applied to this module\n"
        r"    values: module='Dropout'\n"
        r"    fix: apply it once: remove the second sch\['0'\]\.fork_rng\(\)$",
    ) as info:
        sch["0"].fork_rng()
    assert isinstance(info.value, ScheduleError)
    assert len(sch.recipe) == 1


def test_fork_rng_on_a_module_list_raises():
    sch = tl.create_schedule(nn.Sequential(nn.ModuleList([nn.Dropout(0.1)])))
    with pytest.raises(
        RngError,
        match=r"^sch\['0'\]\.fork_rng\(\.\.\.\): a ModuleList has no forward of its own; its "
        r"items are called one by one\n    values: module='ModuleList'\n"
        r"    fix: apply it to the items: sch\['0\.\*'\]\.fork_rng\(\)$",
    ):
        sch["0"].fork_rng()


def test_device_choice():
    lin = nn.Linear(2, 2, device="meta")
    assert _device_of(lin, (torch.ones(1),), {}) == torch.device("cpu")
    assert _device_of(lin, (1,), {"x": torch.empty(1, device="meta")}) == torch.device("meta")
    assert _device_of(lin, (), {}) == torch.device("meta")
    assert _device_of(nn.ReLU(), ("not a tensor",), {}) == torch.device("cpu")
    # a meta forward runs without touching any generator
    tl.create_schedule(nn.Sequential(lin))["0"].fork_rng()
    set_random_seed(0)
    assert lin(torch.empty(3, 2, device="meta")).device.type == "meta"
    assert get_rng_tracker().get_states() == {MP: {}}


# --------------------------------------------------------------------------- with checkpoint


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.tp_drop = nn.Dropout(0.4)
        self.fc2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.4)

    def forward(self, x, *, scale=1.0):
        return self.drop(self.fc2(self.tp_drop(torch.relu(self.fc1(x))))) * scale + x


def make_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), Block())


def only_fork(sch):
    sch["*.tp_drop"].fork_rng()


def only_fork_blocks(sch):
    sch["*"].fork_rng()


def fork_inside_checkpoint(sch):
    sch["*.tp_drop"].fork_rng()
    sch["*"].checkpoint()


def checkpoint_then_fork_same_module(sch):
    sch["*.tp_drop"].checkpoint()
    sch["*.tp_drop"].fork_rng()


def fork_then_checkpoint_same_module(sch):
    sch["*"].fork_rng()
    sch["*"].checkpoint()


def checkpoint_inside_fork(sch):
    sch["*"].fork_rng()
    sch["*.tp_drop"].checkpoint()
    sch["1"].checkpoint()


def run(schedule_fn):
    model = make_stack()
    schedule_fn(tl.create_schedule(model))
    set_random_seed(11, tp_rank=1)
    x = torch.randn(5, 8, requires_grad=True)
    out = x
    for block in model:
        out = block(out, scale=2.0)  # keyword argument through every wrapper
    states_after_forward = get_rng_tracker().get_states()
    out.pow(2).sum().backward()
    states_after_backward = get_rng_tracker().get_states()
    for name in states_after_forward:  # the recompute put the tracker back
        for dtype, state in states_after_forward[name].items():
            assert torch.equal(state, states_after_backward[name][dtype])
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("reference_fn, schedule_fn", [
    (only_fork, fork_inside_checkpoint),
    (only_fork, checkpoint_then_fork_same_module),
    (only_fork_blocks, fork_then_checkpoint_same_module),
    (only_fork_blocks, checkpoint_inside_fork),
])
def test_checkpoint_and_fork_rng_compose_exactly(reference_fn, schedule_fn):
    reference = run(reference_fn)
    got = run(schedule_fn)
    for a, b in zip(reference, got, strict=True):
        assert torch.equal(a, b)


def test_without_the_tracker_snapshot_the_recompute_would_differ(monkeypatch):
    """Negative control: the tracker part of the checkpoint context is what makes the
    forked dropout replay its mask."""
    from torch.utils.checkpoint import noop_context_fn

    reference = run(only_fork)
    monkeypatch.setattr(ckpt_mod, "tracker_context_fn", noop_context_fn)
    model = make_stack()
    fork_inside_checkpoint(tl.create_schedule(model))
    set_random_seed(11, tp_rank=1)
    x = torch.randn(5, 8, requires_grad=True)
    out = x
    for block in model:
        out = block(out, scale=2.0)
    out.pow(2).sum().backward()
    assert torch.equal(out.detach(), reference[0])  # the forward is the same ...
    assert not torch.equal(x.grad, reference[1])    # ... the recomputed masks are not


def tiny_gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def test_gpt2_forked_attention_inside_checkpointed_blocks_is_exact():
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    tl.create_schedule(ref)["transformer.h.*.attn"].fork_rng()
    sch = tl.create_schedule(model)
    sch["transformer.h.*"].checkpoint()
    sch["transformer.h.*.attn"].fork_rng()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (ref, model):
        set_random_seed(4, tp_rank=1)
        out = m(ids, labels=ids, attention_mask=torch.ones_like(ids))
        out.loss.backward()
        results.append([out.loss.detach()] + [p.grad for p in m.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    # and the TP rank matters inside the forked attention
    set_random_seed(4, tp_rank=0)
    other = ref(ids, labels=ids).loss
    assert not torch.equal(other.detach(), results[0][0])


def test_the_references_differ_so_the_comparisons_mean_something():
    plain = run(lambda sch: None)[0]
    forked_dropout = run(only_fork)[0]
    forked_blocks = run(only_fork_blocks)[0]
    assert not torch.equal(plain, forked_dropout)
    assert not torch.equal(forked_dropout, forked_blocks)
