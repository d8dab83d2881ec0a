"""The bad-input catalogue: every misuse gets a ScheduleError that names where, what, the
offending values and the fix. One case per row, the message pinned.

Each case is a function that performs the misuse; the table gives the error class and a
regular expression the full message must match (searched, DOTALL). Every message must
also carry a ``fix:`` line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import torchloom as tl
from tests import tiny
from tests.bad_input_cases import collect
from torchloom.core.errors import BuildError, RecipeError
from torchloom.runtime.gather import CheckpointMismatchError
from torchloom.runtime.state import CheckpointIOError


def _gpt2() -> tl.Schedule:
    return tl.create_schedule(tiny.gpt2())


def _mlp() -> tl.Schedule:
    return tl.create_schedule(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)))


def _faked(node: tl.Schedule, world: int) -> tl.Schedule:
    node.world_size, node.rank = world, 0
    return node


def _saved_gpt2(path: Path) -> None:
    model = tiny.gpt2()
    tl.save(model, None, str(path), step=3)


# ---- wrong paths -------------------------------------------------------------------------

def path_typo():
    _gpt2()["transformer.h.0.atn"]


def path_index_out_of_range():
    _gpt2()["transformer.h.5"]


def path_wildcard_matches_nothing():
    _gpt2()["transformer.h.*.mpl"]


def path_not_a_string():
    _gpt2()[0]


def get_module_typo():
    _gpt2()["transformer"].get_module("h.0.atn")


def param_name_typo():
    _gpt2()["transformer.h.0.mlp.c_fc"].shard("wieght", 1)


def param_on_a_module_without_params():
    _gpt2()["transformer.h.0.mlp.act"].annotate("weight", "tag", 1)


# ---- wrong axes and indivisible shapes ---------------------------------------------------

def shard_axis_out_of_range():
    _mlp()["0"].shard("weight", 2)


def shard_axis_not_an_int():
    _mlp()["0"].shard("weight", "0")


def shard_not_divisible():
    _faked(_mlp()["0"], 4).shard("weight", 0)


def shard_chunks_not_divisible():
    _faked(_mlp()["0"], 2).shard("weight", 0, chunks=4)


def shard_chunks_not_positive():
    _mlp()["0"].shard("weight", 0, chunks=0)


def sync_gather_without_axis():
    _mlp()["0"].sync("fwd_post", "all_gather")


def sync_all_reduce_with_axis():
    _mlp()["0"].sync("fwd_post", "all_reduce", axis=1)


def sync_gather_on_the_wrong_axis():
    sch = _mlp()
    sch["0"].shard("weight", 0)
    sch["0"].sync("fwd_post", "all_gather", axis=-2)


def sync_unknown_mode():
    _mlp()["0"].sync("forward", "all_reduce")


def sync_unknown_op():
    _mlp()["0"].sync("fwd_post", "allreduce")


def sync_unknown_keyword():
    _mlp()["0"].sync("fwd_post", "all_gather", dim=1)


def sync_input_name_unknown():
    _mlp()["0"].sync("fwd_pre", "all_reduce", input_name="hidden")


def sync_all_reduce_of_sharded_output():
    sch = _mlp()
    sch["0"].shard("weight", 0)
    sch["0"].sync("fwd_post", "all_reduce")


def sync_all_gather_of_partial_output():
    sch = _mlp()
    sch["2"].shard("weight", 1)
    sch["2"].sync("fwd_post", "all_gather", axis=-1)


def checkpoint_ratio_out_of_range():
    _gpt2()["transformer.h"].checkpoint(ratio=1.5)


def checkpoint_ratio_on_a_leaf():
    _gpt2()["transformer.h.0.mlp"].checkpoint(ratio=0.5)


# ---- primitives in an illegal order ------------------------------------------------------

def shard_twice():
    sch = _mlp()
    sch["0"].shard("weight", 0)
    sch["0"].shard("weight", 1)


def checkpoint_twice():
    sch = _gpt2()
    sch["transformer.h.0"].checkpoint()
    sch["transformer.h.*"].checkpoint()


def fork_rng_twice():
    sch = _gpt2()
    sch["transformer.h.0.attn"].fork_rng()
    sch["transformer.h.0.attn"].fork_rng()


def row_parallel_sync_after_checkpoint():
    sch = _mlp()
    sch["2"].shard("weight", 1)
    sch["2"].checkpoint()
    _faked(sch["2"], 1)
    # a world of one: the bias path still needs its own forward; fake the spec's world
    weight = sch.mod[2].weight
    spec = tl.shard_spec(weight)
    tl.get_meta(weight).shard = type(spec)(spec.axis, spec.full_shape, 2, 0)
    sch["2"].sync("fwd_post", "all_reduce")


def replace_group_with_one_instance():
    _gpt2()["transformer.h.*.mlp.act"].replace(nn.ReLU())


def replace_with_a_non_module():
    _mlp()["1"].replace("relu")


def replace_all_no_match():
    _mlp().replace_all(nn.LayerNorm, lambda path, old: old)


def annotate_reserved_key():
    _mlp()["0"].annotate("weight", "shape", 1)


def sequence_parallel_without_tp():
    from torchloom import schedules

    schedules.apply_schedule(_gpt2(), sequence_parallel=True)


def no_builtin_schedule():
    from torchloom import schedules

    schedules.apply_schedule(_mlp(), tp=True)


# ---- build -------------------------------------------------------------------------------

def build_a_child():
    tl.build(_gpt2()["transformer"])


def build_unknown_target():
    tl.build(_mlp(), target="megatron")


def build_optimizer_instance():
    sch = _mlp()
    tl.build(sch, optimizer=torch.optim.SGD(sch.mod.parameters(), lr=0.1))


# ---- recipes -----------------------------------------------------------------------------

def recipe_for_another_model():
    sch = _gpt2()
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    tl.apply_recipe(tiny.bert(), sch.recipe)


def recipe_that_is_not_data():
    sch = _mlp()
    sch["1"].replace(nn.ReLU())
    sch.recipe.to_json()


def recipe_text_that_is_not_a_recipe():
    tl.Recipe.from_json('{"entries": []}')


# ---- checkpoints -------------------------------------------------------------------------

def checkpoint_missing(tmp_path: Path):
    tl.load(tiny.gpt2(), None, str(tmp_path / "nothing-here"))


def checkpoint_of_another_model(tmp_path: Path):
    _saved_gpt2(tmp_path / "ckpt")
    tl.load(tiny.bert(), None, str(tmp_path / "ckpt"))


def checkpoint_of_another_size(tmp_path: Path):
    _saved_gpt2(tmp_path / "ckpt")
    tl.load(tiny.gpt2(n_layer=3), None, str(tmp_path / "ckpt"))


CASES: list[tuple[Callable, type, str]] = [
    (path_typo, tl.PathError, r"sch\['transformer\.h\.0\.atn'\]: no module matches this path.*"
     r"nearest=\['transformer\.h\.0\.attn'"),
    (path_index_out_of_range, tl.PathError, r"nothing at 'transformer\.h\.5'.*nearest="),
    (path_wildcard_matches_nothing, tl.PathError, r"nothing at 'transformer\.h\.\*\.mpl'"),
    (path_not_a_string, tl.PathError, r"a schedule path is a dotted string, not a int"),
    (get_module_typo, tl.PathError, r"module GPT2Model has no sub-module 'h\.0\.atn'"),
    (param_name_typo, tl.PathError, r"Conv1D has no parameter or buffer 'wieght'.*fix: use one "
     r"of: 'weight'"),
    (param_on_a_module_without_params, tl.PathError,
     r"NewGELUActivation has no parameter or buffer 'weight'"),
    (shard_axis_out_of_range, tl.ShardError, r"axis 2 is out of range for 'weight' of shape "
     r"\(6, 4\).*fix: use an axis in \[0, 2\)"),
    (shard_axis_not_an_int, tl.ShardError, r"axis '0' is out of range"),
    (shard_not_divisible, tl.ShardError, r"size 6 of axis 0 of 'weight' is not divisible by the "
     r"world size 4.*pad the tensor"),
    (shard_chunks_not_divisible, tl.ShardError, r"does not split into 4 blocks of a multiple of "
     r"the world size 2"),
    (shard_chunks_not_positive, tl.ShardError, r"chunks must be a positive integer, not 0"),
    (sync_gather_without_axis, tl.SyncError, r"'all_gather' needs the activation axis.*fix: "
     r"sch\['0'\]\.sync\('fwd_post', 'all_gather', axis=-1\)"),
    (sync_all_reduce_with_axis, tl.SyncError, r"'all_reduce' takes no axis"),
    (sync_gather_on_the_wrong_axis, tl.SyncError, r"the output is sharded along axis -1, not -2"),
    (sync_unknown_mode, tl.SyncError, r"unknown sync mode 'forward'.*fwd_pre, fwd_post, "
     r"bwd_post, param_grad"),
    (sync_unknown_op, tl.SyncError, r"unknown sync operation 'allreduce'"),
    (sync_unknown_keyword, tl.SyncError, r"unknown keyword argument\(s\) dim"),
    (sync_input_name_unknown, tl.SyncError, r"Linear\.forward has no input named 'hidden'.*"
     r"fix: use one of 'input'"),
    (sync_all_reduce_of_sharded_output, tl.SyncError, r"cannot all_reduce a sharded output"),
    (sync_all_gather_of_partial_output, tl.SyncError, r"cannot all_gather a partial output"),
    (checkpoint_ratio_out_of_range, tl.CheckpointError, r"ratio must be a number between 0 and "
     r"1.*ratio=1\.5"),
    (checkpoint_ratio_on_a_leaf, tl.CheckpointError, r"sch\['transformer\.h\.0\.mlp'\]\.checkpoint"
     r"\(\.\.\.\): ratio needs an nn\.ModuleList or nn\.Sequential of layers to choose from"),
    (shard_twice, tl.ShardError, r"'weight' is already sharded \(along axis 0\)"),
    (checkpoint_twice, tl.CheckpointError, r"sch\['transformer\.h\.0'\]\.checkpoint\(\.\.\.\): this "
     r"module is already checkpointed.*fix: checkpoint each module once"),
    (fork_rng_twice, tl.RngError, r"fork_rng was already applied to this module"),
    (row_parallel_sync_after_checkpoint, tl.SyncError, r"must reduce before adding its bias.*"
     r"fix: apply shard and sync first, then checkpoint / fork_rng"),
    (replace_group_with_one_instance, tl.ScheduleError, r"a group replace needs a factory"),
    (replace_with_a_non_module, tl.ReplaceError, r"replace needs an nn\.Module or a factory, "
     r"not a str"),
    (replace_all_no_match, tl.ReplaceError, r"no module below this node is a LayerNorm"),
    (annotate_reserved_key, tl.AnnotateError, r"tag key 'shape' would hide torch\.Tensor\.shape"),
    (sequence_parallel_without_tp, tl.ScheduleError, r"it needs tp=True.*fix: "
     r"apply_schedule\(sch, tp=True, sequence_parallel=True\)"),
    (no_builtin_schedule, tl.ScheduleError, r"there is no built-in schedule for Sequential"),
    (build_a_child, BuildError, r"build takes the root schedule, not a child node"),
    (build_unknown_target, BuildError, r"unknown build target 'megatron'"),
    (build_optimizer_instance, BuildError, r"optimizer must be a factory params -> Optimizer"),
    (recipe_for_another_model, RecipeError, r"1 of 1 recipe lines failed on this model.*"
     r"line 1: sch\['transformer\.h\.0\.mlp\.c_fc'\]\.shard\('weight', 1\)"),
    (recipe_that_is_not_data, RecipeError, r"recipe line 1 \(replace at '1'\) has an argument "
     r"that is not data: a ReLU"),
    (recipe_text_that_is_not_a_recipe, RecipeError, r"not a torchloom recipe"),
    (checkpoint_missing, CheckpointIOError, r"load\(\.\.\.\): no checkpoint at this path.*"
     r"nothing-here"),
    (checkpoint_of_another_model, CheckpointMismatchError, r"the checkpoint holds another model: "
     r"its keys differ from the model's.*missing_keys=\['bert\.embeddings"),
    (checkpoint_of_another_size, CheckpointMismatchError, r"its keys differ from the model's.*"
     r"missing_keys=\['transformer\.h\.2\.ln_1\.weight'"),
]


CASES += collect()


def test_the_catalogue_is_large():
    assert len(CASES) >= 70
    assert len({case.__name__ for case, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("case", "error", "pattern"), CASES, ids=[c.__name__ for c, _, _ in CASES])
def test_bad_input(case: Callable, error: type, pattern: str, tmp_path: Path) -> None:
    with pytest.raises(error, match=re.compile(pattern, re.DOTALL)) as info:
        case(tmp_path) if case.__code__.co_argcount else case()
    message = str(info.value)
    assert re.search(pattern, message, re.DOTALL), message
    assert "\n    fix: " in message, message
    assert isinstance(info.value, tl.ScheduleError)
