"""Bad-input rows for ``tl.save_pretrained``: paths it must not replace, sizes it cannot
read, models it cannot write."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import torchloom as tl
from torchloom.core.errors import PretrainedError
from torchloom.core.meta import ShardSpec, get_meta


def _linear() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4))


def pretrained_folder_with_user_files(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    tl.save_pretrained(_linear(), out)


def pretrained_path_is_a_file(tmp_path: Path):
    (tmp_path / "weights").write_text("mine")
    tl.save_pretrained(_linear(), tmp_path / "weights")


def pretrained_path_is_a_symlink(tmp_path: Path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    tl.save_pretrained(_linear(), tmp_path / "link")


def pretrained_path_is_the_current_directory(tmp_path: Path):
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        tl.save_pretrained(_linear(), ".")
    finally:
        os.chdir(here)


def pretrained_bad_max_shard_size(tmp_path: Path):
    tl.save_pretrained(_linear(), tmp_path / "out", max_shard_size="5 gigs")


def pretrained_zero_max_shard_size(tmp_path: Path):
    tl.save_pretrained(_linear(), tmp_path / "out", max_shard_size=0)


def pretrained_meta_model(tmp_path: Path):
    with tl.init_empty_weights():
        model = _linear()
    tl.save_pretrained(model, tmp_path / "out")


def pretrained_sharded_for_another_group(tmp_path: Path):
    model = _linear()
    get_meta(model[0].weight).shard = ShardSpec(axis=0, full_shape=(8, 4), world_size=2, rank=0)
    tl.save_pretrained(model, tmp_path / "out")


class _HookedFused(nn.Module):
    """A sharded fused tensor that a state_dict hook splits into new tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Parameter(torch.zeros(4, 2))
        get_meta(self.qk).shard = ShardSpec(axis=0, full_shape=(8, 2), world_size=2, rank=0)

        def split(module, state, prefix, local_metadata):
            fused = state.pop(prefix + "qk")
            state[prefix + "q"], state[prefix + "k"] = fused.chunk(2)

        self.register_state_dict_post_hook(split)


def pretrained_sharded_tensor_behind_a_hook(tmp_path: Path):
    tl.save_pretrained(_HookedFused(), tmp_path / "out")


class _ExtraState(nn.Linear):
    def get_extra_state(self):
        return {"step": 3}

    def set_extra_state(self, state):
        pass


def pretrained_non_tensor_state(tmp_path: Path):
    tl.save_pretrained(_ExtraState(2, 2), tmp_path / "out")


def pretrained_given_the_schedule(tmp_path: Path):
    tl.save_pretrained(tl.create_schedule(_linear()), tmp_path / "out")


CASES = [
    (pretrained_given_the_schedule, PretrainedError,
     r"takes the built model, not a Schedule.*tl\.build\(sch\)"),
    (pretrained_folder_with_user_files, PretrainedError,
     r"holds files save_pretrained does not write.*other_files=\['tokenizer.json'\]"),
    (pretrained_path_is_a_file, PretrainedError, r"the path is a file, not a folder"),
    (pretrained_path_is_a_symlink, PretrainedError, r"is a symbolic link.*link_to="),
    (pretrained_path_is_the_current_directory, PretrainedError,
     r"refusing to replace the current directory"),
    (pretrained_bad_max_shard_size, PretrainedError,
     r"max_shard_size must be .*'5 gigs'.*max_shard_size=\"5GB\""),
    (pretrained_zero_max_shard_size, PretrainedError, r"max_shard_size must be .* not 0"),
    (pretrained_meta_model, PretrainedError,
     r"'0\.weight' is on the meta device.*tl\.build\(sch\)"),
    (pretrained_sharded_for_another_group, tl.CheckpointMismatchError,
     r"save_pretrained\(\.\.\.\): '0\.weight' was sharded for rank 0 of 2, but this is rank 0 "
     r"of a group of 1.*group=sch\.group"),
    (pretrained_sharded_tensor_behind_a_hook, PretrainedError,
     r"sharded parameter 'qk' reaches the state dict only through a state_dict hook"
     r".*torchloom_checkpoint_parts"),
    (pretrained_non_tensor_state, PretrainedError,
     r"holds a dict under '_extra_state'.*tensors only"),
]
