"""Bad-input rows for checkpoints (``tl.save`` / ``tl.load``) and ``torchloom train``'s
checks of its run: where a save may write, damaged and foreign checkpoints, what a resume
must match, models and lengths the command line cannot train."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

import torchloom as tl
from torchloom.apps.train import TrainConfig, check_config
from torchloom.core.errors import ScheduleError
from torchloom.runtime import state as S


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4))


def _saved(path: Path, step: int = 1, config: dict | None = None) -> Path:
    tl.save(_model(), None, path, step, config=config)
    return path


def ckpt_save_into_a_directory_of_user_files(tmp_path: Path):
    (tmp_path / "thesis.tex").write_text("years of work")
    tl.save(_model(), None, tmp_path, step=1)


def ckpt_save_over_a_regular_file(tmp_path: Path):
    (tmp_path / "model.bin").write_bytes(b"weights")
    tl.save(_model(), None, tmp_path / "model.bin", step=1)


def ckpt_save_into_a_symlink(tmp_path: Path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    tl.save(_model(), None, tmp_path / "link", step=1)


def ckpt_save_into_the_current_directory():
    tl.save(_model(), None, ".", step=1)


def ckpt_save_keep_zero(tmp_path: Path):
    tl.save(_model(), None, tmp_path / "run", step=1, keep=0)


def ckpt_save_config_not_data(tmp_path: Path):
    tl.save(_model(), None, tmp_path / "run", step=1, config={"optimizer": torch.optim.AdamW})


def ckpt_load_a_flipped_byte(tmp_path: Path):
    run = _saved(tmp_path / "run")
    shard = run / "step-1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40
    shard.write_bytes(bytes(data))
    tl.load(_model(), None, run)


def ckpt_load_an_old_format(tmp_path: Path):
    (tmp_path / "torchloom.pt").write_bytes(b"old")
    tl.load(_model(), None, tmp_path)


def ckpt_load_a_step_not_saved(tmp_path: Path):
    tl.load(_model(), None, _saved(tmp_path / "run", step=4), step=3)


def ckpt_load_a_directory_of_other_files(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("x")
    tl.load(_model(), None, tmp_path)


def ckpt_load_a_forged_marker(tmp_path: Path):
    run = _saved(tmp_path / "run")
    marker = run / "step-1" / S.STEP_MARKER
    marker.write_text(marker.read_text().replace('"__0_0.distcp"', '"../../etc/passwd"'))
    tl.load(_model(), None, run / "step-1")


def ckpt_load_a_forged_optimizer_state_size(tmp_path: Path):
    import hashlib
    import json
    import pickle

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    step = Path(tl.save(model, opt, tmp_path / "run", 1))
    with open(step / ".metadata", "rb") as f:
        metadata = S._MetadataUnpickler(f).load()
    md = metadata.state_dict_metadata["optim.state.0.weight.exp_avg"]
    md.size = torch.Size([100000, 100000])
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=md.size)]
    data = pickle.dumps(metadata)
    (step / ".metadata").write_bytes(data)
    marker = json.loads((step / S.STEP_MARKER).read_text())
    marker["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                    "bytes": len(data)}
    (step / S.STEP_MARKER).write_text(json.dumps(marker))
    tl.load(model, opt, step)


def ckpt_load_a_huge_marker(tmp_path: Path):
    run = _saved(tmp_path / "run")
    with open(run / "step-1" / S.STEP_MARKER, "r+b") as f:
        f.truncate(200 * 2**20)  # sparse: 200 MiB, never read
    tl.load(_model(), None, run / "step-1")


def train_save_dir_under_a_file(tmp_path: Path):
    (tmp_path / "model.bin").write_bytes(b"weights")
    check_config(TrainConfig(save_dir=str(tmp_path / "model.bin" / "run")))


def train_save_pretrained_under_a_file(tmp_path: Path):
    (tmp_path / "model.bin").write_bytes(b"weights")
    check_config(TrainConfig(save_pretrained=str(tmp_path / "model.bin" / "exported")))


def train_resume_nothing_there(tmp_path: Path):
    check_config(TrainConfig(save_dir=str(tmp_path / "runs-typo"), resume=True))


def train_resume_another_configuration(tmp_path: Path):
    config = {**TrainConfig().to_dict(), "recipe": ""}
    run = _saved(tmp_path / "run", config={k: config[k] for k in (
        "model", "size", "steps", "batch_size", "seq_len", "lr", "seed", "tp", "dp", "pp",
        "n_microbatches", "sequence_parallel", "ckpt_ratio", "deterministic", "recipe")})
    check_config(TrainConfig(save_dir=str(run), resume=True, batch_size=16, seq_len=128))


def train_resume_a_checkpoint_without_configuration(tmp_path: Path):
    check_config(TrainConfig(save_dir=str(_saved(tmp_path / "run")), resume=True))


def train_new_run_over_another_run(tmp_path: Path):
    check_config(TrainConfig(save_dir=str(_saved(tmp_path / "run"))))


def train_save_dir_with_user_files(tmp_path: Path):
    (tmp_path / "data.csv").write_text("a,b")
    check_config(TrainConfig(save_dir=str(tmp_path)))


def train_an_image_model():
    check_config(TrainConfig(model="vit"))


def train_longer_than_the_positions():
    check_config(TrainConfig(model="opt", seq_len=300))


CASES: list[tuple[Callable, type, str]] = [
    (ckpt_save_into_a_directory_of_user_files, S.CheckpointIOError,
     r"save\(\.\.\.\): the directory holds files torchloom did not write.*"
     r"contents=\['thesis\.tex'\].*fix: save into a new directory"),
    (ckpt_save_over_a_regular_file, S.CheckpointIOError,
     r"the save path is a file, not a directory; torchloom does not replace it"),
    (ckpt_save_into_a_symlink, S.CheckpointIOError,
     r"the save directory is a symbolic link.*link_to=.*fix: pass the directory itself"),
    (ckpt_save_into_the_current_directory, S.CheckpointIOError,
     r"refusing to save into the current directory \(or its parent\)"),
    (ckpt_save_keep_zero, S.CheckpointIOError, r"keep must be a positive int, not 0"),
    (ckpt_save_config_not_data, S.CheckpointIOError,
     r"config\.optimizer is not JSON data.*fix: pass config as a dict of numbers"),
    (ckpt_load_a_flipped_byte, S.CheckpointIOError,
     r"checkpoint 'step-1' \(step 1\) is damaged: file '__0_0\.distcp' does not match the "
     r"SHA-256 checksum its marker records"),
    (ckpt_load_an_old_format, S.CheckpointIOError,
     r"a checkpoint of torchloom's format 1 \('torchloom\.pt'\); this torchloom reads format 2"
     r".*fix: load it with the torchloom version that wrote it"),
    (ckpt_load_a_step_not_saved, S.CheckpointIOError,
     r"no complete checkpoint of step 3 in this directory.*steps=\[4\].*step=4\)"),
    (ckpt_load_a_directory_of_other_files, S.CheckpointIOError,
     r"the directory holds no torchloom checkpoint.*contents=\['notes\.txt'\]"),
    (ckpt_load_a_forged_marker, S.CheckpointIOError,
     r"the marker 'torchloom\.json' of checkpoint 'step-1' is not valid: it lists a file that "
     r"is not a checkpoint file: '\.\./\.\./etc/passwd'"),
    (ckpt_load_a_forged_optimizer_state_size, S.CheckpointMismatchError,
     r"load\(\.\.\.\): optimizer state 'optim\.state\.0\.weight\.exp_avg' does not fit its "
     r"parameter: it claims 10000000000 elements, more than its parameter '0\.weight' has "
     r"\(16\).*key='optim\.state\.0\.weight\.exp_avg', checkpoint_shape=\(100000, 100000\), "
     r"parameter_shape=\(4, 4\).*fix: the checkpoint's '\.metadata' is damaged or forged"),
    (ckpt_load_a_huge_marker, S.CheckpointIOError,
     r"cannot read the marker 'torchloom\.json' of checkpoint 'step-1': it has 209715200 "
     r"bytes, more than such a file can have \(16777216\)"),
    (train_save_dir_under_a_file, S.CheckpointIOError,
     r"torchloom train\(\.\.\.\): the save directory cannot be written: '.*model\.bin' is a "
     r"file, not a folder: nothing can be created under it.*fix: pass a directory on a "
     r"writable file system"),
    (train_save_pretrained_under_a_file, ScheduleError,
     r"--save-pretrained '.*exported' cannot be written: '.*model\.bin' is a file, not a "
     r"folder.*fix: --save-pretrained /scratch/exported"),
    (train_resume_nothing_there, S.CheckpointIOError,
     r"torchloom train\(\.\.\.\): --resume: the save directory holds no complete checkpoint "
     r"to resume from.*contents=\['\(missing\)'\].*fix: check the directory name"),
    (train_resume_another_configuration, S.CheckpointMismatchError,
     r"checkpoint 'step-1' was saved by a run with another configuration: batch_size, "
     r"seq_len.*'batch_size: 8 in the checkpoint, 16 now'.*--batch-size 8 --seq-len 64"),
    (train_resume_a_checkpoint_without_configuration, S.CheckpointMismatchError,
     r"checkpoint 'step-1' holds no run configuration.*fix: resume it anyway: add "
     r"--allow-config-change"),
    (train_new_run_over_another_run, S.CheckpointIOError,
     r"already holds checkpoints of a run \(newest: step 1\); a new run would replace them"),
    (train_save_dir_with_user_files, S.CheckpointIOError,
     r"torchloom train\(\.\.\.\): the directory holds files torchloom did not write.*"
     r"fix: pass a new or empty directory: --save-dir runs/run1"),
    (train_an_image_model, ScheduleError,
     r"torchloom train feeds token windows of text, and vit takes images.*"
     r"supported=\['bert', 'gpt2', 'llama', 'opt', 't5'\]"),
    (train_longer_than_the_positions, ScheduleError,
     r"--seq-len 300 is longer than the 128 positions of opt \(tiny\): config field "
     r"max_position_embeddings = 128.*fix: torchloom train --model opt --size tiny "
     r"--seq-len 128"),
]
