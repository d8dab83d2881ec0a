"""The checkpoints of ``torchloom train``: where a run saves, what it records, what
``--resume`` accepts.

A run saves into one directory (``--save-dir``), whatever its layout: one checkpoint of the
whole model and optimizer per saved step (``step-N``), written by the ranks
:func:`torchloom.parallel.checkpoint_group` names (without FSDP2, the ranks of
data-parallel replica 0 with their pipeline x tensor-parallel group; with FSDP2 or HSDP,
every rank). A checkpoint holds full tensor names and shapes, so any layout loads it:
``--resume`` into another layout reshards on load.

Each checkpoint records the run's configuration (:func:`run_config`: the
:data:`~torchloom.apps.jobconfig.RUN_FIELDS` and the schedule's recipe). ``--resume``
compares it with the run's own (:func:`compare`): a difference in what a step computes
(the learning rate, the data, the dtype, the recipe of an unchanged layout) is refused
unless ``--allow-config-change``; a difference in the layout only
(:data:`~torchloom.apps.jobconfig.LAYOUT_FIELDS`: degrees, micro-batches, checkpointing)
is accepted and reported, since the same global batch is then computed on other ranks.

>>> from torchloom.apps.jobconfig import TrainConfig
>>> saved = run_config(TrainConfig(tp=2, dp=2), "sch['h'].shard('w')")
>>> compare(saved, run_config(TrainConfig(), ""), "step-2", "runs/x")
['dp: 2 -> 1', 'tp: 2 -> 1']
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..runtime.state import (
    CheckpointIOError,
    CheckpointMismatchError,
    check_save_dir,
    check_writable,
    describe_dir,
    list_checkpoints,
)
from .jobconfig import FLAGS, LAYOUT_FIELDS, PRIMITIVE, TrainConfig

__all__ = ["check_run_dir", "compare", "run_config"]

_DEFAULTS = TrainConfig().run_fields()
#: what an older torchloom computed for a field it did not record (not today's default):
#: the model's own loss, before ``--loss``
_LEGACY = {"loss": "full"}


def run_config(cfg: TrainConfig, recipe: str) -> dict[str, Any]:
    """What a checkpoint of this run records: :data:`RUN_FIELDS` and the recipe text."""
    return {**cfg.run_fields(), "recipe": recipe}


def check_run_dir(cfg: TrainConfig) -> None:
    """Before any rank starts: ``--save-dir`` may be written; with ``--resume`` it holds a
    checkpoint whose configuration this run may continue (the recipe is compared later,
    once the ranks made the schedule); without it, no other run's checkpoints."""
    assert cfg.save_dir
    old = sorted(e for e in os.listdir(cfg.save_dir) if re.fullmatch(r"stage-\d+", e)
                 and os.path.isdir(os.path.join(cfg.save_dir, e))) \
        if os.path.isdir(cfg.save_dir) else []
    if old:
        raise CheckpointIOError(
            f"the save directory holds {', '.join(old)}: the per-stage checkpoints of a "
            "pipeline run of an older torchloom, which saved each stage apart; this version "
            "saves one checkpoint for every layout and does not read them",
            primitive=PRIMITIVE, values={"save_dir": cfg.save_dir, "folders": old},
            fix=f"start anew in another directory: --save-dir {cfg.save_dir}-2; or finish "
            "that run with the torchloom version that wrote it")
    check_save_dir(cfg.save_dir, PRIMITIVE)
    check_writable(cfg.save_dir, PRIMITIVE)  # a read-only disk fails now, not at a save
    found = list_checkpoints(cfg.save_dir)
    if cfg.resume and not found:
        raise CheckpointIOError(
            "--resume: the save directory holds no complete checkpoint to resume from",
            primitive=PRIMITIVE,
            values={"save_dir": cfg.save_dir, "contents": describe_dir(cfg.save_dir)},
            fix=f"check the directory name, or start the run without --resume: torchloom "
            f"train --model {cfg.model} --save-dir {cfg.save_dir}")
    if not cfg.resume and found:
        raise CheckpointIOError(
            f"the save directory already holds checkpoints of a run (newest: step "
            f"{found[0].step}); a new run would replace them",
            primitive=PRIMITIVE,
            values={"save_dir": cfg.save_dir, "checkpoints": [c.name for c in found]},
            fix=f"continue that run: torchloom train --save-dir {cfg.save_dir} --resume; or "
            f"start anew in another directory: --save-dir {cfg.save_dir}-2")
    if cfg.resume and not cfg.allow_config_change:
        compare(found[0].config, cfg.run_fields(), found[0].name, cfg.save_dir, recipe=False)


def _flag_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return FLAGS[key] if value else ""
    if value is None:
        return ""
    if isinstance(value, list) and key == "stage_cuts":
        return f"{FLAGS[key]} {','.join(map(str, value))}"
    if isinstance(value, list):
        return " ".join(f"{FLAGS[key]} {v}" for v in value)
    return f"{FLAGS[key]} {value}"


def compare(saved: dict[str, Any] | None, now: dict[str, Any], name: str, save_dir: str,
            recipe: bool = True) -> list[str]:
    """Refuse to resume a checkpoint saved by a run of another configuration; return the
    layout changes it accepts (``"tp: 2 -> 1"``). A field the checkpoint lacks (saved by
    an older torchloom) counts as its default, or as what that torchloom computed
    (``loss``: ``"full"``, the model's own). When the layout changed, the recipe is not
    compared: it changes with the layout (a tensor-parallel degree adds shards)."""
    if saved is None:
        raise CheckpointMismatchError(
            f"checkpoint {name!r} holds no run configuration (it was not written by "
            "torchloom train)", primitive=PRIMITIVE, values={"save_dir": save_dir},
            fix="resume it anyway: add --allow-config-change")
    saved = {**{k: _LEGACY.get(k, v) for k, v in _DEFAULTS.items() if k in now}, **saved}
    keys = [k for k in now if recipe or k != "recipe"]
    if recipe:
        keys += [k for k in saved if k not in now]
    differ = [k for k in keys if saved.get(k) != now.get(k)]
    layout = sorted(k for k in differ if k in LAYOUT_FIELDS)
    if layout:
        differ = [k for k in differ if k not in LAYOUT_FIELDS and k != "recipe"]
    if not differ:
        return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in layout]
    lines = []
    for k in differ:
        if k == "recipe":
            lines.append("recipe: the schedule differs")
        else:
            lines.append(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now")
    flags = " ".join(t for k in differ if k in FLAGS and k in saved
                     and (t := _flag_text(k, saved[k])))
    again = (f"resume with the checkpoint's values: torchloom train --save-dir {save_dir} "
             f"--resume {flags}".rstrip() + "; or ") if flags else ""
    raise CheckpointMismatchError(
        f"checkpoint {name!r} was saved by a run with another configuration: "
        f"{', '.join(differ)}", primitive=PRIMITIVE,
        values={"save_dir": save_dir, "differences": lines},
        fix=f"{again}continue with the new values: add --allow-config-change")
