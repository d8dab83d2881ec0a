"""Schedules for models that are not transformers' (issue 25, item 3), on two gloo ranks.

The README's "Schedules for any model" block runs here as it stands: a hand-written TP
schedule of a nanoGPT-shaped model (packed q/k/v split as three blocks, sizes held in
attributes divided per rank, the width read from the input fixed by a replacement), and
the same schedule written as a plan dict with ``colwise_fused(3)``. Each trains one step
equal to one process. One-process checks: the automatic schedule of any model with a
stack of layers, ``divide_attrs``'s refusals, and the static check that refuses a plain
split of a packed projection.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import pipeline_models
from tests.dist import spawn
from torchloom.schedules.hf_plan import from_hf_plan
from torchloom.tools.check import check

TOL = {"rtol": 1e-5, "atol": 1e-6}
PLAN = {"transformer.h.*.attn.c_attn": "colwise_fused(3)",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise"}


def readme_block() -> dict[str, Any]:
    """The README's nanoGPT schedule, run as written."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("## Schedules for any model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "readme_any_model"}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 128, (2, 16), generator=g)
    return idx, torch.randint(0, 128, (2, 16), generator=g)


def _equal_to_one_process(rank: int, schedule: Callable[[tl.Schedule], None]) -> None:
    reference = pipeline_models.nano_gpt()
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    schedule(sch)
    assert check(sch).ok, str(check(sch))
    model, _ = tl.build(sch)
    idx, targets = _batch()
    logits, loss = model(idx, targets)
    ref_logits, ref_loss = reference(idx, targets)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    sharded = 0
    for name, param in model.named_parameters():
        spec = tl.shard_spec(param)
        expected = ref_params[name].grad
        if spec is not None:
            sharded += 1
            expected = spec.slice(expected)
        torch.testing.assert_close(param.grad, expected, **TOL, msg=name)
    assert sharded == 4 * 6  # per layer: c_attn w/b, c_proj w, c_fc w/b, c_proj w
    assert model.transformer.h[0].attn.n_head == 1 and model.transformer.h[0].attn.n_embd == 16


def _check_readme_schedule(rank: int) -> None:
    _equal_to_one_process(rank, readme_block()["schedule_nanogpt"])


def _check_plan_dict_with_fused_style(rank: int) -> None:
    block = readme_block()

    def schedule(sch: tl.Schedule) -> None:
        sch["transformer.h.*.attn"].replace(block["local_width"])
        sch["transformer.h.*.attn"].divide_attrs(["n_head", "n_embd"])
        from_hf_plan(sch, plan=PLAN)
        shards = [e for e in sch.recipe if e.primitive == "shard"
                  and e.path.endswith("attn.c_attn")]
        assert shards and all(e.kwargs.get("chunks") == 3 for e in shards), shards

    _equal_to_one_process(rank, schedule)


def _check_divide_attrs_refuses_a_size_the_group_does_not_split(rank: int) -> None:
    sch = tl.create_schedule(pipeline_models.GPT(n_head=3, n_embd=33))
    with pytest.raises(tl.DivideAttrsError, match=re.escape(
            "divide_attrs(...): n_head=3 of CausalSelfAttention does not divide into 2 equal "
            "shares")):
        sch["transformer.h.0.attn"].divide_attrs(["n_head", "n_embd"])
    assert sch.mod.transformer.h[0].attn.n_embd == 33  # nothing changed


def test_schedules_for_a_model_that_is_not_transformers_on_two_ranks() -> None:
    spawn(_check_readme_schedule, _check_plan_dict_with_fused_style,
          _check_divide_attrs_refuses_a_size_the_group_does_not_split, timeout_s=120)


# --------------------------------------------------------------------------- one process


def test_the_automatic_schedule_checkpoints_any_stack_of_layers() -> None:
    for make, stack, inputs in (
        (pipeline_models.nano_gpt, "transformer.h", _batch()),
        (pipeline_models.encoder_lm, "encoder.layers", (_batch()[0],)),
    ):
        reference = make()
        model = copy.deepcopy(reference)
        sch = tl.create_schedule(model)
        assert tl.schedules.schedule_for(model) is tl.schedules.schedule_layers
        tl.schedules.apply_schedule(sch, ckpt_ratio=0.5)
        assert [e.call_text() for e in sch.recipe] == \
            [f"sch[{stack!r}].checkpoint(ratio=0.5)"]
        model, _ = tl.build(sch)
        out, ref = model(*inputs), reference(*inputs)
        out = out[1] if isinstance(out, tuple) else out.square().mean()
        ref = ref[1] if isinstance(ref, tuple) else ref.square().mean()
        torch.testing.assert_close(out, ref, **TOL)
        out.backward()
        ref.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
    with pytest.raises(tl.ScheduleConfigError, match=r"(?s)unknown knob 'tp' for the built-in "
                       r"schedule of GPT.*knobs=\['ckpt_ratio', 'compile'\]"):
        tl.schedules.apply_schedule(tl.create_schedule(pipeline_models.nano_gpt()), tp=2)
    with pytest.raises(tl.NoScheduleError, match=r"there is no built-in schedule for Linear"):
        tl.schedules.schedule_for(nn.Linear(2, 2))


def test_the_static_check_refuses_a_plain_split_of_a_packed_projection() -> None:
    sch = tl.create_schedule(pipeline_models.nano_gpt())
    attn = sch["transformer.h.0.attn"]
    attn.trace(example_inputs=(torch.randn(2, 8, 32),))
    attn["c_attn"].shard("weight", 0)                      # plain: rank 0 gets q and half k
    attn["c_attn"].sync("bwd_post", "all_reduce")
    attn["c_proj"].shard("weight", 1)
    attn["c_proj"].sync("fwd_post", "all_reduce")
    findings = [(f.path, f.rule) for f in check(sch).findings]
    assert findings == [("transformer.h.0.attn.c_attn", "packed projection split plainly")]
    assert ("fix: sch['transformer.h.0.attn.c_attn'].shard('weight', 0, chunks=3)"
            in str(check(sch).findings[0])), str(check(sch).findings[0])
    fixed = tl.create_schedule(pipeline_models.nano_gpt())
    attn = fixed["transformer.h.0.attn"]
    attn.trace(example_inputs=(torch.randn(2, 8, 32),))
    attn["c_attn"].shard("weight", 0, chunks=3)
    attn["c_attn"].sync("bwd_post", "all_reduce")
    attn["c_proj"].shard("weight", 1)
    attn["c_proj"].sync("fwd_post", "all_reduce")
    assert check(fixed).ok, str(check(fixed))
