"""The primitive registry: one declaration per primitive gives ``Schedule`` and
``ScheduleGroup`` the same methods, records every call in one canonical form, and the
marks primitives leave are spelled in one module only."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import torchloom as tl
from torchloom.core.registry import PRIMITIVES
from torchloom.schedules import ScheduleConfig, apply_schedule
from torchloom.schedules.zoo import make_model


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def test_schedule_and_group_have_every_primitive_with_one_signature() -> None:
    # not in recipes: the finders (they change nothing), context_parallel and
    # expert_parallel (they take a process group; parallelize applies them from the layout)
    assert set(PRIMITIVES) == set(tl.list_primitives()) | {"find", "find_node", "find_subgraph",
                                                            "context_parallel",
                                                            "expert_parallel"}
    for name, prim in PRIMITIVES.items():
        node_sig = inspect.signature(getattr(tl.Schedule, name))
        group_sig = inspect.signature(getattr(tl.ScheduleGroup, name))
        assert node_sig == group_sig, name
        assert list(node_sig.parameters)[1:] == list(prim.signature.parameters), name
        assert getattr(tl.Schedule, name).__doc__, name


@pytest.mark.parametrize("call", [
    lambda n: n.shard("weight", 0),
    lambda n: n.shard("weight", axis=0),
    lambda n: n.shard(param_name="weight", axis=0, chunks=1),
    lambda n: n.shard("weight", 0, 1, tied=False),
])
def test_a_call_is_recorded_in_one_form_however_it_is_written(call) -> None:
    sch = tl.create_schedule(_mlp())
    call(sch["0"])
    assert [e.call_text() for e in sch.recipe] == ["sch['0'].shard('weight', 0)"]


def test_optional_arguments_are_recorded_by_keyword_when_not_default() -> None:
    sch = tl.create_schedule(_mlp())
    sch["0"].shard("weight", 0, 2)
    sch["2"].annotate("weight", "tag", 1, overwrite=False)
    sch["*"].checkpoint(None)
    assert [e.call_text() for e in sch.recipe] == [
        "sch['0'].shard('weight', 0, chunks=2)",
        "sch['2'].annotate('weight', 'tag', 1)",
        "sch['0'].checkpoint()", "sch['1'].checkpoint()", "sch['2'].checkpoint()"]


def test_a_group_has_the_primitives_the_hand_written_group_lacked() -> None:
    blocks = nn.ModuleList(_mlp() for _ in range(2))
    sch = tl.create_schedule(nn.Sequential(blocks))
    group = sch["0.*"]
    group.trace(tracer="fx")
    matches = group.find(r"^0$")
    assert [m.path for m in matches] == ["0.0", "0.1"]
    assert all(hasattr(group, name) for name in ("fuse", "trace_until", "cut_pipeline_stage"))
    assert "subgraph" in inspect.signature(group.checkpoint).parameters


def test_arguments_that_do_not_fit_are_a_schedule_error_naming_the_signature() -> None:
    sch = tl.create_schedule(_mlp())
    with pytest.raises(tl.ScheduleError, match=re.escape(
            "sch['0'].shard(...): the arguments do not fit shard(param_name, axis, chunks=1, *, "
            "tied=False): missing a required argument: 'axis'")):
        sch["0"].shard("weight")
    with pytest.raises(TypeError, match=r"(?s)missing a required argument: 'axis'.*"
                       r"kwargs=\['axes'\]"):
        sch["0"].shard("weight", axes=0)  # still a TypeError, as a plain call would be
    assert len(sch.recipe) == 0


def test_a_misspelt_primitive_names_the_nearest_one() -> None:
    sch = tl.create_schedule(_mlp())
    with pytest.raises(AttributeError, match=r"(?s)sch\['0'\]\.shrad\(\.\.\.\): a schedule has no "
                       r"primitive or attribute 'shrad'.*fix: did you mean sch\[\.\.\.\]\.shard"):
        sch["0"].shrad("weight", 0)
    with pytest.raises(tl.ScheduleError, match=r"(?s)no primitive or attribute 'chekpoint'.*"
                       r"did you mean sch\[\.\.\.\]\.checkpoint"):
        sch["*"].chekpoint()
    assert not hasattr(sch, "_private_name")


def test_a_built_schedule_refuses_every_primitive() -> None:
    sch = tl.create_schedule(_mlp())
    tl.build(sch)
    with pytest.raises(tl.ScheduleError, match=r"this schedule was already built; checkpoint "
                       r"after build would not reach the model build returned"):
        sch["0"].checkpoint()


def test_no_mark_is_spelt_outside_the_marks_module() -> None:
    package = Path(tl.__file__).parent
    spelt = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py")
             if p.name != "marks.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"(?<![A-Za-z0-9])_torchloom_", line)]
    assert spelt == []


def test_schedule_config_checks_itself_when_made() -> None:
    with pytest.raises(tl.ScheduleError, match=r"(?s)ckpt_ratio must be a number from 0 to 1, not "
                       r"-0\.5.*fix: apply_schedule\(sch, ckpt_ratio=0\.5\)"):
        ScheduleConfig(ckpt_ratio=-0.5)
    with pytest.raises(tl.ScheduleError, match=r"tp must be a positive int \(the degree\), "
                       r"not True"):
        ScheduleConfig(tp=True)
    with pytest.raises(tl.ScheduleError, match=r"it needs tp=True \(a degree above 1\)"):
        ScheduleConfig(sequence_parallel=True)
    assert ScheduleConfig(tp=2, ckpt_ratio=0.25).changed() == {"tp": 2, "ckpt_ratio": 0.25}


def test_a_config_and_keyword_knobs_record_the_same_schedule() -> None:
    one, two = tl.create_schedule(make_model("gpt2")), tl.create_schedule(make_model("gpt2"))
    apply_schedule(one, tp=True, ckpt_ratio=0.5)       # a world of one: tp=True means 2
    apply_schedule(two, ScheduleConfig(tp=2, ckpt_ratio=0.5))
    assert str(one.recipe) == str(two.recipe)
    assert "shard('weight', 1, chunks=3)" in str(one.recipe)


def test_a_degree_other_than_the_groups_is_refused() -> None:
    sch = tl.create_schedule(make_model("gpt2"))
    sch.world_size = 4  # as on a tensor-parallel group of four
    with pytest.raises(tl.ScheduleError, match=r"(?s)tp=2, and the schedule's tensor-parallel "
                       r"group has 4 ranks.*fix: apply_schedule\(sch, tp=4\)"):
        apply_schedule(sch, ScheduleConfig(tp=2))
    with pytest.raises(tl.ScheduleError, match=r"give the knobs either as a ScheduleConfig "
                       r"or as keywords, not both"):
        apply_schedule(sch, ScheduleConfig(), ckpt_ratio=0.5)
    assert len(sch.recipe) == 0


def test_recording_is_outermost_only() -> None:
    """A primitive that calls another (replace carries checkpoint over) records itself only."""
    sch = tl.create_schedule(_mlp())
    sch["0"].checkpoint()
    sch["0"].replace(nn.Linear(4, 8))
    assert [e.primitive for e in sch.recipe] == ["checkpoint", "replace"]
    out = sch.mod(torch.randn(2, 4))
    assert out.shape == (2, 4)


def test_shard_fails_in_several_ways_each_with_its_class() -> None:
    from torchloom.core import errors

    sch = tl.create_schedule(_mlp())
    with pytest.raises(errors.ShardAxisError, match=r"axis 5 is out of range for 'weight'"):
        sch["0"].shard("weight", 5)
    sch["0"].shard("weight", 0)
    with pytest.raises(errors.ShardTwiceError, match=r"'weight' is already sharded"):
        sch["0"].shard("weight", 1)
    with pytest.raises(errors.ShardArgumentError, match=r"chunks must be a positive integer"):
        sch["2"].shard("weight", 0, 0)
    assert all(issubclass(e, tl.ShardError) for e in PRIMITIVES["shard"].errors)


def test_the_typed_declarations_match_the_registered_primitives() -> None:
    """Each primitive is a typed method of the schedule (for mypy and editors) whose
    parameters are exactly its registered signature's: names, kinds, defaults, types."""
    import inspect

    from torchloom.core.primitive_methods import PrimitiveMethods
    from torchloom.core.registry import PRIMITIVES

    declared = {n for n, v in vars(PrimitiveMethods).items()
                if callable(v) and not n.startswith("_")}
    assert declared == set(PRIMITIVES), declared ^ set(PRIMITIVES)
    for name, prim in PRIMITIVES.items():
        stub = list(inspect.signature(getattr(PrimitiveMethods, name)).parameters.values())[1:]
        real = list(prim.signature.parameters.values())
        assert [(p.name, p.kind, p.default) for p in stub] == \
            [(p.name, p.kind, p.default) for p in real], name
        for s, r in zip(stub, real):  # the same type, or Any where core cannot name it
            assert s.annotation in (r.annotation, "Any", "Callable[..., Any]"), \
                (name, s.name, s.annotation, r.annotation)
