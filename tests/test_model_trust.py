"""Model configs and weights are checked before anything is allocated (issue 24 item 4).

* a config size that is zero, negative or not an integer is a ModelConfigError naming
  the field and the value (``torchloom train``, ``build``, ``Verify``);
* a model beyond this machine's memory is refused with the estimate and the fix by
  ``torchloom train`` (counted on the meta device), ``build`` and ``Verify`` (this rank's
  meta tensors), before the allocation that would fail after minutes;
* weights read from a folder: NaN or infinity is an error naming the tensor and the file;
  integer data is never cast into a floating-point tensor (and the reverse).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

import torchloom as tl
from torchloom.apps import train as T
from torchloom.apps.cli import app
from torchloom.apps.jobconfig import TrainConfig
from torchloom.core.errors import ModelConfigError
from torchloom.runtime import model_check as MC
from torchloom.runtime.gather import CheckpointMismatchError
from torchloom.runtime.state import CheckpointIOError

_FIX = r"(.|\n)*fix: "


def _gpt2_config(**sizes) -> dict:
    base = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256,
                                   n_positions=64, bos_token_id=0, eos_token_id=0).to_dict()
    base.update(sizes)
    return base


def _config_file(tmp_path: Path, **sizes) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_gpt2_config(**sizes)))
    return str(path)


def _train(model: str) -> None:
    T.check_config(TrainConfig(model=model, steps=1, batch_size=2, seq_len=16))


# --------------------------------------------------------------------------- config sizes


def test_a_zero_hidden_size_in_a_model_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{
        k: v for k, v in _gpt2_config().items() if k in ("n_layer", "n_embd", "n_head",
                                                         "vocab_size", "n_positions")
    })).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_embd"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"torchloom train\(\.\.\.\): the model config's "
                       r"n_embd is 0; a size must be a positive integer(.|\n)*n_embd=0, "
                       r"config='.*model/config\.json'" + _FIX + r"set n_embd in "):
        _train(str(folder))


def test_a_negative_layer_count_is_refused_on_the_command_line(tmp_path):
    result = CliRunner().invoke(app, ["train", "--model", _config_file(tmp_path, n_layer=-1),
                                      "--steps", "1", "--batch-size", "2", "--seq-len", "16"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "the model config's n_layer is -1; a size must be a positive integer" in text
    assert "Traceback" not in result.output


@pytest.mark.parametrize("field, value", [("n_head", 0), ("vocab_size", -5), ("n_inner", 0)])
def test_bad_sizes_are_named(tmp_path, field, value):
    with pytest.raises(ModelConfigError, match=rf"the model config's {field} is "
                       rf"{value!r}; a size must be a positive integer"):
        _train(_config_file(tmp_path, **{field: value}))


@pytest.mark.parametrize("field, value", [("hidden_size", 1.5), ("num_hidden_layers", True),
                                          ("vocab_size", "256")])
def test_sizes_that_are_not_integers_are_named(field, value):
    from types import SimpleNamespace

    with pytest.raises(ModelConfigError, match=rf"build\(\.\.\.\): the model config's "
                       rf"{field} is {re.escape(repr(value))}; a size must be a positive "
                       rf"integer(.|\n)*config='mine\.json'"):
        MC.check_config_sizes(SimpleNamespace(**{field: value}), source="mine.json")


def test_nested_sub_configs_are_checked():
    config = transformers.GPT2Config(n_embd=32)
    config.text_config = transformers.LlamaConfig(hidden_size=16, num_attention_heads=4)
    config.text_config.num_hidden_layers = 0
    with pytest.raises(ModelConfigError, match=r"text_config\.num_hidden_layers is 0"):
        MC.check_config_sizes(config)


def test_build_and_verify_refuse_a_bad_config():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    model.config.n_layer = -1
    with pytest.raises(ModelConfigError, match=r"build\(\.\.\.\): the model config's n_layer "
                       r"is -1" + _FIX):
        tl.build(tl.create_schedule(model))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ModelConfigError, match=r"Verify\(\.\.\.\): the model config's n_layer"):
        with tl.Verify(tl.create_schedule(model), (ids,)):
            pass


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("sizes, params", [({"n_embd": 10**6}, "24000348000000"),
                                           ({"vocab_size": 10**12}, "32000000027520")])
def test_train_refuses_a_model_beyond_memory_with_the_estimate(tmp_path, sizes, params):
    with pytest.raises(ModelConfigError, match=r"torchloom train\(\.\.\.\): training .*config"
                       r"\.json \(.* TiB of parameters; weights, gradients and AdamW states: "
                       r".* TiB per rank, 1 rank on this device\) needs at least .* TiB on cpu, "
                       r"more than the .* available \(MemAvailable in /proc/meminfo\)"
                       rf"(.|\n)*parameters={params}(.|\n)*estimate_bytes=" + _FIX +
                       r"train a smaller config .* torchloom plan; or set "
                       r"TORCHLOOM_NO_MEMORY_CHECK=1"):
        _train(_config_file(tmp_path, **sizes))


def test_the_train_estimate_divides_by_the_sharding(tmp_path, monkeypatch):
    seen: list[int] = []
    from torchloom.apps import train_checks

    monkeypatch.setattr(train_checks, "check_fits", lambda need, *a, **k: seen.append(need))
    config = transformers.AutoConfig.from_pretrained(_config_file(tmp_path))
    for tp, dp, mode, replicas in ((1, 1, "ddp", 1), (2, 1, "ddp", 1), (1, 2, "fsdp", 1),
                                   (1, 4, "hsdp", 2)):
        cfg = TrainConfig(model=_config_file(tmp_path), tp=tp, dp=dp, dp_mode=mode,
                          dp_replicate=replicas, batch_size=4)
        with torch.device("meta"):
            T._check_memory(cfg, T._from_config(cfg, config))
    # one rank: 4 copies of the parameters; tp 2: half per rank, 2 ranks here; fsdp alike;
    # HSDP 2 x 2: half per rank (sharded within a replica), 4 ranks here
    assert seen[0] > 0 and seen[1] == seen[0] and seen[2] == seen[0] and seen[3] == 2 * seen[0]


def test_build_refuses_meta_tensors_beyond_memory():
    model = nn.Sequential(nn.Linear(10**6, 10**6, device="meta"))
    with pytest.raises(ModelConfigError, match=r"build\(\.\.\.\): materialising this rank's "
                       r"meta parameters and buffers needs at least 3\.6 TiB on cpu"
                       r"(.|\n)*estimate_bytes=4000004000000" + _FIX + r"shard the large "
                       r"tensors over more ranks"):
        tl.build(tl.create_schedule(model))


def test_verify_refuses_to_materialise_beyond_memory():
    model = nn.Sequential(nn.Linear(10**6, 10**6, device="meta"))
    with pytest.raises(ModelConfigError, match=r"Verify\(\.\.\.\): materialising the "
                       r"reference and the scheduled model needs at least 7\.3 TiB"):
        with tl.Verify(tl.create_schedule(model), (torch.randn(1, 10**6, device="meta"),)):
            pass


def test_meta_bytes_counts_tied_tensors_once_and_skips_real_ones():
    with tl.init_empty_weights():
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
    params = sum(p.numel() for p in model.parameters())  # tied lm_head once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.is_meta)
    assert MC.meta_bytes(model) == 4 * params + buffers
    assert MC.meta_bytes(nn.Linear(3, 3)) == 0


def test_the_memory_check_can_be_skipped(monkeypatch):
    monkeypatch.setenv(MC.NO_CHECK_ENV, "1")
    MC.check_fits(1 << 60, "cpu", primitive="build", what="x", values={}, fix="y")
    monkeypatch.setenv(MC.NO_CHECK_ENV, "0")
    with pytest.raises(ModelConfigError, match=r"build\(\.\.\.\): x needs at least "
                       r"1048576\.0 TiB on cpu, more than the .* available" + _FIX + r"y; or set"):
        MC.check_fits(1 << 60, "cpu", primitive="build", what="x", values={}, fix="y")


# --------------------------------------------------------------------------- weights


def _weights(tmp_path: Path, weight: torch.Tensor) -> str:
    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({"0.weight": weight, "0.bias": torch.zeros(6)},
              str(folder / "model.safetensors"))
    return str(folder)


def _meta_linear() -> tl.Schedule:
    with tl.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 6))
    return tl.create_schedule(model)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor_and_file(tmp_path, bad):
    weight = torch.randn(6, 4)
    weight[2, 3] = bad
    folder = _weights(tmp_path, weight)
    with pytest.raises(CheckpointIOError, match=r"the checkpoint's '0\.weight' holds NaN or "
                       r"infinite values(.|\n)*key='0\.weight'(.|\n)*file='model\.safetensors'"
                       + _FIX + r"the weights are damaged"):
        tl.build(_meta_linear(), weights=folder)


def test_non_finite_weights_are_refused_by_load_weights(tmp_path):
    weight = torch.randn(6, 4)
    weight[0, 0] = float("nan")
    folder = _weights(tmp_path, weight)
    with tl.init_empty_weights():
        model = nn.Linear(4, 6)
    with pytest.raises(CheckpointIOError, match=r"'0\.weight' holds NaN"):
        tl.runtime.weights.load_weights(model, folder, prefix="0")


def test_integer_data_is_never_cast_into_a_float_parameter(tmp_path):
    folder = _weights(tmp_path, torch.arange(24, dtype=torch.int32).reshape(6, 4))
    with pytest.raises(CheckpointMismatchError, match=r"the checkpoint's '0\.weight' holds "
                       r"int32 data and the model's '0\.weight' is float32: integer values are "
                       r"not cast into a floating-point tensor(.|\n)*file='model\.safetensors', "
                       r"checkpoint_dtype='torch\.int32', model_dtype='torch\.float32'"
                       + _FIX + r"the file does not hold this model's weights"):
        tl.build(_meta_linear(), weights=folder)


def test_finite_weights_of_another_float_dtype_still_load(tmp_path):
    weight = torch.randn(6, 4)
    folder = _weights(tmp_path, weight.to(torch.bfloat16))
    model, _ = tl.build(_meta_linear(), weights=folder)
    assert torch.equal(model[0].weight, weight.to(torch.bfloat16).float())


def test_per_layer_size_lists_are_accepted_and_checked_item_by_item() -> None:
    """Gemma 3n's intermediate_size is one size per layer: a list of positive sizes is a
    valid config (the zoo sweep found it refused), a zero inside it is not."""
    from torchloom.runtime.model_check import check_config_sizes

    config = transformers.Gemma3nTextConfig(hidden_size=64, num_hidden_layers=2,
                                            intermediate_size=[128, 128])
    check_config_sizes(config)
    config.intermediate_size = [128, 0]
    with pytest.raises(ModelConfigError, match=r"intermediate_size is \[128, 0\]; a size must "
                       r"be a positive integer"):
        check_config_sizes(config)


def test_a_zero_head_dim_means_derived_elsewhere():
    """GLM-5-Next's default config has head_dim 0 (its latent attention sizes heads by
    qk_head_dim): accepted; a negative one is not."""
    from types import SimpleNamespace

    from torchloom.runtime.model_check import check_config_sizes

    check_config_sizes(SimpleNamespace(hidden_size=64, head_dim=0))
    with pytest.raises(ModelConfigError, match=r"head_dim is -1; a size must be a positive "
                       r"integer"):
        check_config_sizes(SimpleNamespace(hidden_size=64, head_dim=-1))
