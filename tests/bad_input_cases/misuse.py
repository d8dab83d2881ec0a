"""Bad-input rows: silently accepted misuse (issue 13 item 7) that now raises.

A primitive on a built schedule, a second build, the same sync twice on one module, a
shard of a tied tensor, an optimizer factory that returns no optimizer, a replace_all
factory of the wrong signature, an annotate that overwrites a tag.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import torchloom as tl
from tests import tiny
from torchloom.core.errors import BuildError


def _mlp() -> tl.Schedule:
    return tl.create_schedule(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)))


def _built() -> tl.Schedule:
    sch = _mlp()
    tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return sch


def misuse_shard_after_build():
    _built()["0"].shard("weight", 0)


def misuse_checkpoint_after_build():
    _built()["2"].checkpoint()


def misuse_replace_on_a_group_after_build():
    _built()["*"].replace(lambda old: old)


def misuse_build_twice():
    sch = _built()
    tl.build(sch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def misuse_rebuild_not_a_bool():
    tl.build(_built(), rebuild="yes")


def misuse_same_sync_twice():
    sch = _mlp()
    sch["0"].sync("bwd_post", "all_reduce")
    sch["0"].sync("bwd_post", "all_reduce")


def misuse_same_sync_twice_on_a_group_of_linears():
    sch = _mlp()
    sch["[02]"].sync("param_grad", "all_reduce")
    sch["[02]"].sync("param_grad", "all_reduce")


def misuse_shard_a_tied_head():
    tl.create_schedule(tiny.gpt2())["lm_head"].shard("weight", 0)


def misuse_shard_a_tied_embedding():
    tl.create_schedule(tiny.gpt2())["transformer.wte"].shard("weight", 1)


def misuse_shard_tied_not_a_bool():
    tl.create_schedule(tiny.gpt2())["lm_head"].shard("weight", 0, tied="both")


def misuse_optimizer_factory_returns_a_number():
    tl.build(_mlp(), optimizer=lambda ps: 42)


def misuse_optimizer_factory_returns_the_parameters():
    tl.build(_mlp(), optimizer=lambda ps: list(ps))


def misuse_replace_all_factory_without_arguments():
    _mlp().replace_all(nn.GELU, lambda: nn.ReLU())


def misuse_replace_all_factory_of_three_arguments():
    _mlp().replace_all(nn.GELU, lambda path, old, extra: nn.ReLU())


def misuse_replace_all_module_instead_of_factory():
    _mlp().replace_all(nn.GELU, nn.ReLU())


def misuse_annotate_overwrites_a_tag():
    sch = _mlp()
    sch["0"].annotate("weight", "placement", "colwise")
    sch["0"].annotate("weight", "placement", "rowwise")


def misuse_annotate_overwrite_not_a_bool():
    _mlp()["0"].annotate("weight", "placement", "colwise", overwrite="yes")


_BUILT = r"this schedule was already built; {} after build would not reach the model"

CASES: list[tuple[Callable, type, str]] = [
    (misuse_shard_after_build, tl.ScheduleError,
     r"sch\['0'\]\.shard\(\.\.\.\): " + _BUILT.format("shard")
     + r".*fix: .*torchloom\.apply_recipe\(make_model\(\), old_sch\.recipe\)"),
    (misuse_checkpoint_after_build, tl.ScheduleError,
     r"sch\['2'\]\.checkpoint\(\.\.\.\): " + _BUILT.format("checkpoint")
     + r".*built_for_target=None"),
    (misuse_replace_on_a_group_after_build, tl.ScheduleError,
     r"sch\['0'\]\.replace\(\.\.\.\): " + _BUILT.format("replace")),
    (misuse_build_twice, BuildError,
     r"build\(\.\.\.\): this schedule was already built; a second build would make a second "
     r"optimizer.*fix: .*torchloom\.build\(sch, rebuild=True, \.\.\.\)"),
    (misuse_rebuild_not_a_bool, BuildError, r"rebuild must be True or False, not 'yes'"),
    (misuse_same_sync_twice, tl.SyncError,
     r"sch\['0'\]\.sync\(\.\.\.\): Linear already has this sync \(bwd_post all_reduce\); a "
     r"second one would run the collective twice.*fix: apply "
     r"sch\['0'\]\.sync\('bwd_post', 'all_reduce'\) once per module"),
    (misuse_same_sync_twice_on_a_group_of_linears, tl.SyncError,
     r"sch\['0'\]\.sync\(\.\.\.\): Linear already has this sync \(param_grad all_reduce\)"),
    (misuse_shard_a_tied_head, tl.ShardError,
     r"sch\['lm_head'\]\.shard\(\.\.\.\): 'weight' is tied to 'transformer\.wte\.weight'.*"
     r"tied_to=\['transformer\.wte\.weight'\].*"
     r"fix: .*sch\['lm_head'\]\.shard\('weight', 0, tied=True\)"),
    (misuse_shard_a_tied_embedding, tl.ShardError,
     r"sch\['transformer\.wte'\]\.shard\(\.\.\.\): 'weight' is tied to 'lm_head\.weight'.*"
     r"fix: .*shard\('weight', 1, tied=True\)"),
    (misuse_shard_tied_not_a_bool, tl.ShardError, r"tied must be True or False, not 'both'"),
    (misuse_optimizer_factory_returns_a_number, BuildError,
     r"build\(\.\.\.\): the optimizer factory returned a int, not a torch\.optim\.Optimizer"
     r".*returned='int'.*fix: .*optimizer=lambda params: torch\.optim\.AdamW"),
    (misuse_optimizer_factory_returns_the_parameters, BuildError,
     r"the optimizer factory returned a list, not a torch\.optim\.Optimizer"),
    (misuse_replace_all_factory_without_arguments, tl.ReplaceError,
     r"sch\[''\]\.replace_all\(\.\.\.\): make_mod_fn takes \(\), but it is called as "
     r"fn\(path, old_module\) or fn\(old_module\).*fix: def make\(path, old\)"),
    (misuse_replace_all_factory_of_three_arguments, tl.ReplaceError,
     r"make_mod_fn takes \(path, old, extra\)"),
    (misuse_replace_all_module_instead_of_factory, tl.ReplaceError,
     r"make_mod_fn must be a function \(path, old_module\) -> new_module, not a ReLU"),
    (misuse_annotate_overwrites_a_tag, tl.AnnotateError,
     r"sch\['0'\]\.annotate\(\.\.\.\): 'weight' already has the tag 'placement' with another "
     r"value.*old=\"'colwise'\", new=\"'rowwise'\".*fix: replace it on purpose: "
     r"sch\['0'\]\.annotate\('weight', 'placement', value, overwrite=True\)"),
    (misuse_annotate_overwrite_not_a_bool, tl.AnnotateError,
     r"overwrite must be True or False, not 'yes'"),
]
