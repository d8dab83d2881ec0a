"""Bad-input rows: pretrained weights into build (issue 14 items 2 and 4): the init mode,
the ``weights`` and ``strict`` arguments, folders that are not weights folders, and
checkpoints that do not fit the model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors.torch import save_file

import torchloom as tl
from torchloom.core.errors import BuildError
from torchloom.runtime.gather import CheckpointMismatchError
from torchloom.runtime.state import CheckpointIOError


def _linear() -> tl.Schedule:
    return tl.create_schedule(torch.nn.Linear(2, 2))


def _meta_linear() -> tl.Schedule:
    with tl.init_empty_weights():
        return tl.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 6)))


def _folder(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def init_mode_unknown():
    tl.build(_linear(), init="fast")


def weights_not_a_path():
    tl.build(_linear(), weights={"0.weight": torch.zeros(2, 2)})


def strict_not_a_bool():
    tl.build(_linear(), weights="folder", strict=1)


def weights_folder_missing(tmp_path: Path):
    tl.build(_meta_linear(), weights=str(tmp_path / "nowhere"))


def weights_folder_without_weights(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    tl.build(_meta_linear(), weights=str(tmp_path))


def weights_of_another_shape(tmp_path: Path):
    folder = _folder(tmp_path / "m", {"0.weight": torch.zeros(6, 5), "0.bias": torch.zeros(6)})
    tl.build(_meta_linear(), weights=folder)


def weights_missing_under_strict(tmp_path: Path):
    folder = _folder(tmp_path / "m", {"0.weight": torch.zeros(6, 4)})
    tl.build(_meta_linear(), weights=folder)  # strict by default


def weights_index_with_a_file_outside(tmp_path: Path):
    folder = _folder(tmp_path / "m", {"0.weight": torch.zeros(6, 4), "0.bias": torch.zeros(6)})
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "a.safetensors"))
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"0.weight": "../../x.safetensors", "0.bias": "a.safetensors"}}')
    tl.build(_meta_linear(), weights=folder)


def weights_fused_part_missing(tmp_path: Path):
    from torchloom.ops.qkv import make_fused_qkv_bert_self_attention

    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                                     intermediate_size=16, vocab_size=32,
                                     max_position_embeddings=16)
    layer = transformers.BertModel(config).encoder.layer[0].attention.self
    state = {k: v.contiguous() for k, v in layer.state_dict().items() if k != "key.bias"}
    folder = _folder(tmp_path / "m", state)
    with tl.init_empty_weights():
        model = transformers.BertModel(config).encoder.layer[0].attention
    sch = tl.create_schedule(model)
    sch["self"].replace(make_fused_qkv_bert_self_attention)
    tl.load_weights(model.self, folder)


CASES: list[tuple[Callable, type, str]] = [
    (init_mode_unknown, BuildError,
     r"^sch\[''\]\.build\(\.\.\.\): unknown init mode 'fast'\n    values: init='fast', "
     r"modes=\['full', 'local'\]\n    fix: build\(sch, init='full'\)"),
    (weights_not_a_path, BuildError,
     r"^sch\[''\]\.build\(\.\.\.\): weights must be a folder path, not a dict.*fix: build\(sch, "
     r"weights='path/to/save_pretrained/folder'\)"),
    (strict_not_a_bool, BuildError,
     r"strict must be True or False, not 1.*fix: build\(sch, weights=path, strict=True\)"),
    (weights_folder_missing, CheckpointIOError,
     r"^build\(\.\.\.\): no weights folder at this path\n.*fix: pass the folder that "
     r"save_pretrained wrote"),
    (weights_folder_without_weights, CheckpointIOError,
     r"the folder holds no weights: no model\.safetensors.*files=\['config\.json'\].*fix: "),
    (weights_of_another_shape, CheckpointMismatchError,
     r"the checkpoint's '0\.weight' has another shape than the model's '0\.weight'\n"
     r"    values: key='0\.weight', file='model\.safetensors', checkpoint_shape=\(6, 5\), "
     r"model_shape=\(6, 4\)\n    fix: load a checkpoint with the model's configuration"),
    (weights_missing_under_strict, CheckpointMismatchError,
     r"1 tensor\(s\) of the model are not in the checkpoint: \['0\.bias'\] \(strict=True, "
     r"the default\)\n    values: missing_keys=\['0\.bias'\], path='.*', "
     r"file='model\.safetensors'\n    fix: .*strict=False"),
    (weights_index_with_a_file_outside, CheckpointIOError,
     r"model\.safetensors\.index\.json names a file outside the folder.*"
     r"file='\.\./\.\./x\.safetensors'.*fix: "),
    (weights_fused_part_missing, CheckpointMismatchError,
     r"^load_weights\(\.\.\.\): 'qkv\.bias' is read from 3 checkpoint tensors and some are "
     r"missing.*missing_keys=\['key\.bias'\].*fix: "),
]
