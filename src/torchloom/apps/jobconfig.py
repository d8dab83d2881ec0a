"""The options of ``torchloom train``: one frozen dataclass that checks itself when it is
made, and a TOML loader whose values the command-line flags override.

Preconditions: none (no file is written; a model folder, a data path and a TOML file are
only looked at). Every bad value raises a :class:`TrainOptionError` (a
:class:`~torchloom.core.errors.ScheduleError`) that names the option as its flag, the value and
a fix, before any model is made, any rank started or any file written. What needs the
model or the data (a sequence longer than the model's positions, a tokenizer larger than
the vocabulary, a save directory of another run) is checked next, still before any rank
starts, by :func:`torchloom.apps.train.check_config`.

``--model`` is one of four kinds (:attr:`TrainConfig.model_kind`): a zoo name
(``"zoo"``), a folder with a ``config.json`` (``"folder"``: transformers ``save_pretrained``
output; its weights are loaded and its tokenizer, if any, tokenises ``--data``), a
``.json`` config file (``"config"``: random initialisation), or a user's own model made by
a function in a Python file, ``path/to/file.py:factory`` (``"code"``:
:mod:`torchloom.tools.usercode`). Code runs only when named on the command line: a TOML file
naming it is refused (:func:`load_toml`).

>>> cfg = TrainConfig(model="llama", steps=10, warmup_steps=2, lr_decay="linear")
>>> cfg.model_kind, cfg.warmup(), cfg.micro_batch()
('zoo', 2, 8)
>>> TrainConfig(lr=-1.0)
Traceback (most recent call last):
...
torchloom.core.errors.TrainOptionError: torchloom train(...): --lr -1.0: the peak learning rate must be a positive number
    values: lr=-1.0
    fix: --lr 0.001 (in a TOML file: lr = 0.001)
>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "run.toml")
>>> _ = open(path, "w").write('steps = 4\\nbatch-size = 2\\nlr-decay = "linear"\\n')
>>> load_toml(path)
{'steps': 4, 'batch_size': 2, 'lr_decay': 'linear'}
>>> cfg = options(toml=path, flags={"steps": 6})   # flags win over the file
>>> cfg.steps, cfg.batch_size, cfg.lr_decay
(6, 2, 'linear')
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..core.errors import TrainOptionError
from ..parallel.layout import AC_MODES, DP_MODES, LOSSES

__all__ = ["AC_MODES", "DECAYS", "DEVICES", "DP_MODES", "DTYPES", "FLAGS", "LAYOUT_FIELDS",
           "RUN_FIELDS", "TrainConfig",
           "TrainOptionError", "load_toml", "model_kind", "options"]

PRIMITIVE = "torchloom train"
DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")
DECAYS = ("cosine", "linear", "constant")

RUN_FIELDS = ("model", "size", "data", "eval_fraction", "eval_every", "eval_batches", "steps",
              "batch_size", "grad_accum", "seq_len", "lr", "warmup_steps", "lr_decay",
              "min_lr_ratio", "weight_decay", "clip_grad", "seed", "dtype", "tp", "cp", "ep", "dp",
              "dp_mode", "dp_replicate", "pp", "pipeline_schedule", "stages_per_rank",
              "stage_cuts", "n_microbatches", "sequence_parallel", "ckpt_ratio", "ac", "deterministic",
              "loss", "float8", "lora", "lora_base_dtype", "pack")
"""The fields a checkpoint records and ``--resume`` compares (with the schedule's recipe):
everything that changes what a step computes. Not compared: the device, where and how often
to save, ``stop_after``, outputs (metrics, ``save_pretrained``), threads and the timeout."""

LAYOUT_FIELDS = ("tp", "cp", "ep", "dp", "dp_mode", "dp_replicate", "pp", "pipeline_schedule",
                 "stages_per_rank", "stage_cuts", "n_microbatches", "grad_accum",
                 "sequence_parallel",
                 "ckpt_ratio", "ac", "loss")
"""The :data:`RUN_FIELDS` that only spread a step over the ranks (the same global batch,
the same arithmetic up to reduction order): ``--resume`` into another layout reshards the
checkpoint on load and says what changed, without ``--allow-config-change``. The loss is
one of them: its three ways compute the same cross-entropy up to rounding."""


def model_kind(model: str) -> str | None:
    """``"zoo"``, ``"folder"`` (a directory with ``config.json``), ``"config"`` (an existing
    ``.json`` file), ``"code"`` (``FILE.py:NAME`` of an existing file; nothing imported) or
    None (none of these).

    >>> model_kind("gpt2"), model_kind("no/such/folder"), model_kind("no/such/file.py:make")
    ('zoo', None, None)
    """
    from ..schedules import zoo
    from ..tools.usercode import is_code_spec

    if is_code_spec(model):
        return "code"
    if model in zoo.list_models():
        return "zoo"
    if os.path.isdir(model):
        return "folder" if os.path.isfile(os.path.join(model, "config.json")) else None
    if os.path.isfile(model) and model.endswith(".json"):
        return "config"
    return None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run; every field is an option of ``torchloom train`` (the flag is the
    name with dashes, the TOML key the name). Made only with valid values."""

    model: str = "gpt2"
    """A zoo name, a transformers model folder (config.json + weights), a config.json, or
    ``path/to/file.py:factory`` (a user's model; on the command line only)."""
    size: str = "tiny"
    """Zoo size (zoo models only)."""
    data: tuple[str, ...] = ()
    """Text files or folders (every non-hidden file below); empty: the bytes of Python's
    standard-library source."""
    eval_fraction: float = 0.1
    """With ``eval_every``: the share of the tokens (their tail) held out for evaluation."""
    eval_every: int = 0
    """Evaluate the held-out loss every N steps and at the last step (0: never)."""
    eval_batches: int = 4
    """Batches of ``batch_size`` held-out windows per evaluation (fewer if they do not fit)."""
    steps: int = 20
    batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    grad_accum: int = 1
    """Micro-steps (forward + backward) per optimizer step; the batch is split over them."""
    seq_len: int = 64
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int | None = None
    """Linear warm-up steps (None: 10% of ``steps``, at least 1)."""
    lr_decay: str = "cosine"
    """After warm-up: ``cosine`` or ``linear`` down to ``min_lr_ratio * lr``, or ``constant``."""
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip_grad: float = 0.0
    """Clip the global gradient norm (over every shard and stage) to this; 0: no clipping."""
    seed: int = 0
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL; one device per local rank, ``LOCAL_RANK``)."""
    dtype: str = "fp32"
    """``fp32``, or ``bf16``: bf16 autocast (weights and optimizer in fp32); with
    ``dp_mode="fsdp"`` FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduction)."""
    tp: int = 1
    cp: int = 1
    """Context-parallel ranks: each sequence is split between them (``seq_len`` a
    multiple of ``2 x cp``); they average gradients with the data-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks, of the data-parallel ones (``ep`` divides ``dp``): each holds
    ``1 / ep`` of every mixture-of-experts module's experts and the tokens are routed to
    them (:mod:`torchloom.primitives.expert_parallel`)."""
    dp: int = 1
    dp_mode: str = "ddp"
    """How the data-parallel ranks share the model: ``ddp`` (replicas), ``fsdp`` (FSDP2
    shards) or ``hsdp`` (``dp_replicate`` replica groups of ``dp / dp_replicate`` FSDP2
    shards)."""
    dp_replicate: int = 1
    """With ``dp_mode="hsdp"``: the replica groups (2 or more, dividing ``dp``)."""
    pp: int = 1
    """Pipeline ranks (the layers split evenly into ``pp x stages_per_rank`` stages)."""
    pipeline_schedule: str = "1F1B"
    """GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble."""
    stages_per_rank: int | None = None
    """Stages per pipeline rank (default 2 for the interleaved and zero-bubble schedules)."""
    stage_cuts: tuple[int, ...] | None = None
    """The layers (0-based, of the stack) after which a pipeline stage ends (None: an even
    split); ``--stage-cuts 7,15,23``, or a list in TOML."""
    n_microbatches: int = 4
    sequence_parallel: bool = False
    ckpt_ratio: float = 0.0
    ac: str | None = None
    """Activation checkpointing of every layer: ``full`` (recompute all) or ``op`` (op-level
    selective: matrix products and attention kept); None: ``ckpt_ratio`` decides."""
    loss: str = "chunked"
    """How the cross-entropy is computed (:mod:`torchloom.ops.loss`): ``chunked`` (a
    chunk of rows at a time, the logits split along the vocabulary under ``--tp`` where
    the head allows it), ``parallel`` (split logits, fp32; needs ``--tp``) or ``full``
    (the model's own, whole logits)."""
    compile: bool = False
    """``torch.compile`` each layer of the stacks (inductor), inside its checkpoint."""
    float8: bool = False
    """Float8 matmuls in the layers' linear layers (torchao; a CUDA GPU of compute
    capability 8.9 or more)."""
    async_tp: bool = False
    """Asynchronous tensor parallelism: planner only for now (refused)."""
    save_dir: str | None = None
    save_every: int = 0
    """Save after every ``save_every`` steps (0: only at the end, if ``save_dir``)."""
    resume: bool = False
    allow_config_change: bool = False
    """Resume even if the checkpoint was saved by a run with another configuration."""
    allow_missing: bool = False
    """A folder model: initialise at random the tensors the folder's weight files lack
    (by default they are an error naming the key and the file)."""
    lora: str | None = None
    """LoRA fine-tuning (peft): ``"r=16,alpha=32,targets=q_proj,v_proj"`` (optionally
    ``,dropout=0.05``; in TOML also a table ``lora = {r = 16, alpha = 32, targets =
    ["q_proj", "v_proj"]}``): adapters on those linear layers, the rest frozen
    (:mod:`torchloom.parallel.lora`); ``save_pretrained`` then writes the adapter folder."""
    lora_base_dtype: str = "fp32"
    """With ``lora``: the frozen base's dtype, ``fp32`` or ``bf16`` (adapters train in fp32)."""
    merge: bool = False
    """With ``lora`` and ``save_pretrained``: also write the merged model (``FOLDER/merged``)."""
    pack: bool = False
    """With example data (``.jsonl``): pack examples into full sequences (position ids
    restart per example, no attention across examples)."""
    sample_every: int = 0
    """Print the model's answer to ``sample_prompt`` every N steps and at the end (rank 0;
    0: never)."""
    sample_prompt: str = "Hello"
    sample_tokens: int = 32
    """Tokens generated per sample (greedy)."""
    stop_after: int | None = None
    """Stop after this step (and save), keeping the learning-rate schedule of ``steps``:
    for jobs that run in slices of a time limit."""
    save_pretrained: str | None = None
    """At the end of the run, write the trained model here (transformers folder)."""
    metrics: str | None = None
    """Append one JSON object per step (and per evaluation) to this file."""
    tensorboard: str | None = None
    """Also write the metrics as TensorBoard events into this folder (needs tensorboard)."""
    deterministic: bool = True
    threads: int = 0
    """torch threads per rank; 0: the cores divided by the ranks."""
    timeout: float = 120.0
    """Seconds a collective waits for the other ranks."""
    progress: bool = True
    """A live progress bar on a terminal (rank 0)."""
    _kind: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.data, (str, os.PathLike)):
            object.__setattr__(self, "data", (os.fspath(self.data),))
        elif isinstance(self.data, list):
            object.__setattr__(self, "data", tuple(self.data))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", _lora_text(self.lora))
        if isinstance(self.stage_cuts, str):
            object.__setattr__(self, "stage_cuts", _cuts_of(self.stage_cuts))
        elif isinstance(self.stage_cuts, list):
            object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))
        _validate(self)
        object.__setattr__(self, "_kind", model_kind(self.model) or "")

    @property
    def model_kind(self) -> str:
        """``"zoo"``, ``"folder"``, ``"config"`` or ``"code"`` (see :func:`model_kind`)."""
        return self._kind

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the model (``dp_mode`` fsdp or hsdp, over 2 or more
        ranks of ``dp x cp``: with ``--cp``, FSDP2 shards over the context-parallel ranks
        too, also with ``--dp 1``)."""
        return self.dp * self.cp > 1 and self.dp_mode in ("fsdp", "hsdp")

    def warmup(self) -> int:
        """The warm-up steps in effect."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    def micro_batch(self) -> int:
        """Sequences per forward on one data-parallel rank."""
        return self.batch_size // (self.dp * self.grad_accum)

    def layout(self) -> Any:
        """The run's :class:`torchloom.Layout`: the degrees, the pipeline schedule, the
        micro-batches, the checkpointing and the precision (``dtype="bf16"``: fp32
        weights, bf16 compute, fp32 gradient reduction)."""
        from ..parallel.layout import Layout, shards_cp

        replicate = self.dp_replicate if self.dp_mode == "hsdp" else (
            self.dp if self.dp_mode == "ddp" else 1)
        micro = self.micro_batch() // self.n_microbatches if self.pp > 1 else self.micro_batch()
        return Layout(
            dp_replicate=replicate, dp_shard=self.dp // replicate, tp=self.tp, cp=self.cp,
            shard_cp=shards_cp(self.dp_mode, self.cp),
            ep=self.ep, sp=self.sequence_parallel, pp=self.pp, pipeline_schedule=self.pipeline_schedule,
            stages_per_rank=self.stages_per_rank, stage_cuts=self.stage_cuts,
            n_microbatches=self.n_microbatches if self.pp > 1 else 1,
            grad_accum=self.grad_accum, micro_batch=max(1, micro), seq_len=self.seq_len,
            ckpt_ratio=self.ckpt_ratio if self.ac is None else 0.0, ac=self.ac,
            loss=self.loss, float8=self.float8, compile=self.compile,
            mixed_precision="bf16" if self.dtype == "bf16" else None,
            reduce_dtype="fp32" if self.dtype == "bf16" else None)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("_kind")
        return out

    def run_fields(self) -> dict[str, Any]:
        """The :data:`RUN_FIELDS` as JSON data (lists, not tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in ((k, getattr(self, k)) for k in RUN_FIELDS)}


FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(TrainConfig) if f.init}
FLAGS["sequence_parallel"] = "--sp"
_DEFAULTS = TrainConfig.__dataclass_fields__


def _fail(name: str, value: Any, problem: str, example: Any,
          values: dict[str, Any] | None = None) -> TrainOptionError:
    flag = FLAGS[name]
    shown = f"{flag} {value!r}" if not isinstance(value, bool) else f"{flag}={value!r}"
    toml = repr(example) if isinstance(example, str) else (
        str(example).lower() if isinstance(example, bool) else str(example))
    cli = example if not isinstance(example, (list, tuple)) else " ".join(example)
    fix = f"{flag} {cli}" if not isinstance(example, bool) else (
        flag if example else f"leave {flag} out")
    return TrainOptionError(f"{shown}: {problem}", primitive=PRIMITIVE,
                            values=values or {name: value},
                            fix=f"{fix} (in a TOML file: {name} = {toml})")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


_INTS = {  # name: (lowest allowed, what it is, example)
    "steps": (1, "the number of training steps", 200),
    "batch_size": (1, "the batch size", 8),
    "grad_accum": (1, "the number of accumulation micro-steps", 2),
    "seq_len": (2, "the sequence length (tokens per window)", 128),
    "eval_every": (0, "the evaluation interval (0: never)", 50),
    "eval_batches": (1, "the number of evaluation batches", 4),
    "save_every": (0, "the checkpoint interval (0: at the end)", 20),
    "tp": (1, "the tensor-parallel degree", 2),
    "cp": (1, "the context-parallel degree", 2),
    "ep": (1, "the expert-parallel degree", 2),
    "dp": (1, "the data-parallel degree", 2),
    "dp_replicate": (1, "the HSDP replica groups", 2),
    "pp": (1, "the number of pipeline stages", 2),
    "n_microbatches": (1, "the number of pipeline micro-batches", 4),
    "threads": (0, "the number of torch threads (0: automatic)", 2),
    "sample_every": (0, "the sampling interval (0: never)", 50),
    "sample_tokens": (1, "the number of tokens a sample generates", 32),
}
_CHOICES = {"device": DEVICES, "dtype": DTYPES, "lr_decay": DECAYS, "dp_mode": DP_MODES,
            "loss": LOSSES}
_OPTIONAL_CHOICES = {"ac": AC_MODES}
_PATHS = ("save_dir", "save_pretrained", "metrics", "tensorboard")
_BOOLS = ("sequence_parallel", "resume", "allow_config_change", "allow_missing",
          "deterministic", "progress", "float8", "async_tp", "compile", "merge", "pack")


def _validate(c: TrainConfig) -> None:
    """Types, ranges, choices and combinations; the model and data paths must exist."""
    from ..schedules import zoo

    for name in ("model", "size"):
        value = getattr(c, name)
        if not isinstance(value, str) or not value:
            raise _fail(name, value, "must be a non-empty string", _DEFAULTS[name].default)
    for name in _BOOLS:
        if not isinstance(getattr(c, name), bool):
            raise _fail(name, getattr(c, name), "must be true or false", True)
    for name, (low, what, example) in _INTS.items():
        value = getattr(c, name)
        if not _is_int(value) or value < low:
            need = "a positive integer" if low == 1 else (
                "a non-negative integer" if low == 0 else f"an integer of at least {low}")
            raise _fail(name, value, f"{what} must be {need}", example)
    for name, example in (("warmup_steps", 100), ("stop_after", 10)):
        value = getattr(c, name)
        if value is not None and (not _is_int(value) or value < (0 if name == "warmup_steps" else 1)):
            raise _fail(name, value, "must be a " + (
                "non-negative" if name == "warmup_steps" else "positive") + " integer", example)
    if not _is_int(c.seed):
        raise _fail("seed", c.seed, "the seed must be an integer", 0)
    if not _is_number(c.lr) or c.lr <= 0:
        raise _fail("lr", c.lr, "the peak learning rate must be a positive number", 1e-3)
    for name, least, most, fraction in (("min_lr_ratio", 0.0, 1.0, 0.1),
                                        ("ckpt_ratio", 0.0, 1.0, 0.5)):
        ratio = getattr(c, name)
        if not _is_number(ratio) or not least <= ratio <= most:
            raise _fail(name, ratio, f"must be a number from {least:g} to {most:g}", fraction)
    if not _is_number(c.eval_fraction) or not 0 < c.eval_fraction < 1:
        raise _fail("eval_fraction", c.eval_fraction,
                    "the held-out share must be a number between 0 and 1 (exclusive)", 0.1)
    for name, number in (("weight_decay", 0.01), ("clip_grad", 1.0)):
        ratio = getattr(c, name)
        if not _is_number(ratio) or ratio < 0:
            raise _fail(name, ratio, "must be a non-negative number (0: off)", number)
    if not _is_number(c.timeout) or c.timeout <= 0:
        raise _fail("timeout", c.timeout, "the collective timeout must be a positive number of "
                    "seconds", 120)
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        if value not in choices:
            raise _fail(name, value, f"must be one of {', '.join(choices)}", choices[0],
                        {name: value, "choices": list(choices)})
    for name, choices in _OPTIONAL_CHOICES.items():
        value = getattr(c, name)
        if value is not None and value not in choices:
            raise _fail(name, value, f"must be one of {', '.join(choices)}", choices[0],
                        {name: value, "choices": list(choices)})
    from ..parallel.layout import PIPELINE_SCHEDULES

    if c.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise _fail("pipeline_schedule", c.pipeline_schedule,
                    f"must be one of {', '.join(PIPELINE_SCHEDULES)}", "1F1B",
                    {"pipeline_schedule": c.pipeline_schedule,
                     "choices": list(PIPELINE_SCHEDULES)})
    if c.stage_cuts is not None and (not isinstance(c.stage_cuts, tuple) or not c.stage_cuts
                                     or not all(_is_int(k) and k >= 0 for k in c.stage_cuts)):
        raise _fail("stage_cuts", c.stage_cuts, "must list the layers (0-based) after which a "
                    "stage ends, comma-separated", "7,15,23")
    if c.stage_cuts is not None and c.pp == 1:
        raise _fail("stage_cuts", ",".join(map(str, c.stage_cuts)), "cuts pipeline stages: "
                    "it needs --pp 2 or more", "7,15,23", values={"pp": 1})
    if c.stages_per_rank is not None and (not _is_int(c.stages_per_rank) or
                                          c.stages_per_rank < 1):
        raise _fail("stages_per_rank", c.stages_per_rank, "must be a positive integer", 2)
    for name in _PATHS:
        value = getattr(c, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise _fail(name, value, "must be a path (a non-empty string)", f"runs/{name}")
    if not all(isinstance(p, str) and p for p in c.data):
        raise _fail("data", list(c.data), "must be paths of text files or folders",
                    ["corpus/"])
    _check_model(c, zoo)
    _check_combinations(c)
    for path in c.data:
        if not os.path.exists(path):
            raise _fail("data", path, "no such file or folder", ["corpus/"],
                        {"data": path, "cwd": os.getcwd()})


def _check_model(c: TrainConfig, zoo: Any) -> None:
    if c.size not in zoo.SIZES:
        raise _fail("size", c.size, f"unknown zoo size; sizes: {', '.join(zoo.SIZES)}", "tiny")
    if model_kind(c.model) is not None:
        return
    from ..tools.usercode import CodeSpec, looks_like_code

    if looks_like_code(c.model):
        CodeSpec.parse(c.model)  # raises: what is wrong with FILE.py:NAME
    if os.path.isdir(c.model):
        raise _fail("model", c.model, "the folder has no config.json (a transformers model "
                    "folder, as save_pretrained writes it, has one)", "path/to/model-folder",
                    {"model": c.model, "contents": sorted(os.listdir(c.model))[:8]})
    near = difflib.get_close_matches(c.model, zoo.list_models(), n=1)
    hint = f"--model {near[0]}" if near else "--model gpt2"
    raise TrainOptionError(
        f"--model {c.model!r}: not a zoo model, a model folder (with config.json) or a "
        "config .json file", primitive=PRIMITIVE,
        values={"model": c.model, "zoo": zoo.list_models()},
        fix=f"{hint}, or --model path/to/folder (in a TOML file: model = "
        f"{near[0] if near else 'gpt2'!r}), or your own model: --model "
        "path/to/model.py:make_model (on the command line only)")


def _lora_text(table: dict[str, Any]) -> str:
    """A TOML ``lora`` table as the ``--lora`` text (checked by :func:`_check_lora`)."""
    parts = []
    for key, value in table.items():
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        parts.append(f"{key}={value}")
    return ",".join(parts)


def _check_lora(c: TrainConfig) -> None:
    from ..core.errors import LoraError
    from ..parallel.lora import BASE_DTYPES, parse_lora

    example = "r=16,alpha=32,targets=q_proj,v_proj"
    if c.lora is not None:
        if not isinstance(c.lora, str):
            raise _fail("lora", c.lora, "must be a text like " + example, example)
        try:
            parse_lora(c.lora)
        except LoraError as exc:
            raise _fail("lora", c.lora, exc.problem, example) from None
    if c.lora_base_dtype not in BASE_DTYPES:
        raise _fail("lora_base_dtype", c.lora_base_dtype,
                    f"must be one of {', '.join(BASE_DTYPES)}", "bf16")
    if c.lora is None and c.lora_base_dtype != "fp32":
        raise _fail("lora_base_dtype", c.lora_base_dtype, "keeps a frozen base in bf16: it "
                    "needs --lora", "fp32", {"lora_base_dtype": c.lora_base_dtype, "lora": None})
    if c.merge and (c.lora is None or c.save_pretrained is None):
        raise _fail("merge", True, "writes the merged model of a LoRA run: it needs --lora "
                    "and --save-pretrained", False,
                    {"merge": True, "lora": c.lora, "save_pretrained": c.save_pretrained})
    if not isinstance(c.sample_prompt, str) or not c.sample_prompt:
        raise _fail("sample_prompt", c.sample_prompt, "must be a non-empty text", "Hello")
    if c.sample_every and (c.pp > 1 or c.cp > 1 or c.sequence_parallel):
        raise _fail("sample_every", c.sample_every, "samples from a pipelined, context-"
                    "parallel or sequence-parallel model are not supported yet (a prompt's "
                    "length need not split over the ranks)", 0,
                    {"sample_every": c.sample_every, "pp": c.pp, "cp": c.cp,
                     "sequence_parallel": c.sequence_parallel})


def _check_combinations(c: TrainConfig) -> None:
    _check_lora(c)
    per_rank = c.dp * c.grad_accum
    if c.batch_size % per_rank:
        raise TrainOptionError(
            f"--batch-size {c.batch_size} does not split into --dp {c.dp} x --grad-accum "
            f"{c.grad_accum} = {per_rank} equal micro-batches", primitive=PRIMITIVE,
            values={"batch_size": c.batch_size, "dp": c.dp, "grad_accum": c.grad_accum},
            fix=f"--batch-size {max(per_rank, c.batch_size // per_rank * per_rank)} (a "
            f"multiple of {per_rank}; in a TOML file: batch_size = ...)")
    if c.pp > 1 and c.micro_batch() % c.n_microbatches:
        whole = c.dp * c.grad_accum * c.n_microbatches  # the smallest batch that splits
        raise TrainOptionError(
            f"the {c.micro_batch()} sequences of a pipeline's step (--batch-size "
            f"{c.batch_size} / --dp {c.dp} / --grad-accum {c.grad_accum}) do not split into "
            f"--n-microbatches {c.n_microbatches}", primitive=PRIMITIVE,
            values={"batch_size": c.batch_size, "dp": c.dp, "grad_accum": c.grad_accum,
                    "n_microbatches": c.n_microbatches},
            fix=f"--batch-size {whole * max(1, -(-c.batch_size // whole))} (a multiple of "
            f"{whole}), or --n-microbatches dividing {c.micro_batch()}")
    if c.sequence_parallel and c.tp < 2:
        raise TrainOptionError(
            "--sp: sequence parallelism needs --tp 2 or more", primitive=PRIMITIVE,
            values={"sequence_parallel": True, "tp": c.tp},
            fix="--tp 2 --sp, or leave --sp out (in a TOML file: sequence_parallel = false)")
    if c.loss == "parallel" and c.tp < 2:
        raise TrainOptionError(
            "--loss parallel splits the logits between the tensor-parallel ranks: it needs "
            "--tp 2 or more", primitive=PRIMITIVE, values={"loss": "parallel", "tp": c.tp},
            fix="--tp 2 --loss parallel, or --loss chunked (the default; in a TOML file: "
            "loss = 'chunked')")
    if c.async_tp:
        raise TrainOptionError(
            "--async-tp: asynchronous tensor parallelism overlaps the sequence-parallel "
            "collectives with the matmuls of compiled layers; torchloom train does not build "
            "it yet (the planner models it: torchloom.plan with Layout(async_tp=True))",
            primitive=PRIMITIVE, values={"async_tp": True, "device": c.device},
            fix="leave --async-tp out (in a TOML file: async_tp = false)")
    if c.float8 and c.device != "cuda":
        raise TrainOptionError(
            f"--float8: Float8 matmuls run on a CUDA GPU (compute capability 8.9 or more) "
            f"with torchao, and the device is {c.device}", primitive=PRIMITIVE,
            values={"float8": True, "device": c.device},
            fix="--device cuda --float8 (pip install 'torchloom[float8]'), or leave --float8 "
            "out (in a TOML file: float8 = false)")
    if c.dp_mode == "hsdp" and (c.dp_replicate < 2 or c.dp % c.dp_replicate or
                                c.dp // c.dp_replicate < 2):
        raise TrainOptionError(
            f"--dp-mode hsdp: --dp {c.dp} ranks are --dp-replicate {c.dp_replicate} replica "
            "groups of FSDP2 shards, and HSDP needs at least 2 of each",
            primitive=PRIMITIVE, values={"dp": c.dp, "dp_replicate": c.dp_replicate},
            fix="--dp 4 --dp-mode hsdp --dp-replicate 2 (2 replicas of 2 shards)")
    if c.dp_mode != "hsdp" and c.dp_replicate != 1:
        raise TrainOptionError(
            f"--dp-replicate {c.dp_replicate} is for --dp-mode hsdp", primitive=PRIMITIVE,
            values={"dp_mode": c.dp_mode, "dp_replicate": c.dp_replicate},
            fix=f"--dp-mode hsdp --dp-replicate {c.dp_replicate}, or leave --dp-replicate out")
    if c.ac is not None and c.ckpt_ratio:
        raise TrainOptionError(
            f"--ac {c.ac} checkpoints every layer and --ckpt-ratio {c.ckpt_ratio} a share of "
            "them", primitive=PRIMITIVE, values={"ac": c.ac, "ckpt_ratio": c.ckpt_ratio},
            fix=f"--ac {c.ac} alone, or --ckpt-ratio {c.ckpt_ratio} alone")
    if c.pp > 1:
        _check_pipeline(c)
    if c.pp > 1 and c.pipeline_schedule == "ZBVZeroBubble" and c.eval_every:
        # torch 2.13's ZBVZeroBubble runs its backward actions in eval() too, and fails
        raise TrainOptionError(
            f"--pipeline-schedule ZBVZeroBubble with --eval-every {c.eval_every}: torch's "
            "ZBVZeroBubble cannot run a forward-only (evaluation) pass", primitive=PRIMITIVE,
            values={"pipeline_schedule": c.pipeline_schedule, "eval_every": c.eval_every},
            fix="--pipeline-schedule InterleavedZeroBubble (zero bubble, evaluates), or "
            "leave --eval-every out")
    if c.resume and not c.save_dir:
        raise TrainOptionError(
            "--resume needs the checkpoint directory", primitive=PRIMITIVE,
            values={"resume": True, "save_dir": None},
            fix="torchloom train --save-dir runs/gpt2 --resume")
    if c.warmup_steps is not None and c.warmup_steps > c.steps:
        raise _fail("warmup_steps", c.warmup_steps, f"more warm-up steps than --steps "
                    f"{c.steps}", max(1, c.steps // 10),
                    {"warmup_steps": c.warmup_steps, "steps": c.steps})
    if c.tensorboard is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise _fail("tensorboard", c.tensorboard, "TensorBoard is not installed",
                        c.tensorboard, {"tensorboard": c.tensorboard}) from None


def _as_flags(text: str) -> str:
    """A Layout's fix in flags: ``Layout(pp=2, n_microbatches=2)`` -> ``--pp 2
    --n-microbatches 2``."""
    def flags(match: re.Match[str]) -> str:
        pairs = re.findall(r"(\w+)=('[^']*'|[^,)]+)", match.group(1))
        return " ".join(f"{FLAGS.get(k, '--' + k.replace('_', '-'))} {v.strip().strip(chr(39))}"
                        for k, v in pairs)
    return re.sub(r"Layout\(([^)]*)\)", flags, text)


def _check_pipeline(c: TrainConfig) -> None:
    """The pipeline's options against each other, through the run's Layout (its message,
    with the flags named).

    >>> _as_flags("Layout(pipeline_schedule='Interleaved1F1B', stages_per_rank=2)")
    '--pipeline-schedule Interleaved1F1B --stages-per-rank 2'
    """
    from ..core.errors import LayoutError

    try:
        c.layout()
    except LayoutError as exc:
        raise TrainOptionError(
            f"--pp {c.pp} --pipeline-schedule {c.pipeline_schedule}: {exc.problem}",
            primitive=PRIMITIVE,
            values={"pp": c.pp, "pipeline_schedule": c.pipeline_schedule,
                    "stages_per_rank": c.stages_per_rank,
                    "n_microbatches": c.n_microbatches, "grad_accum": c.grad_accum},
            fix=_as_flags(exc.fix or "")) from None


def _cuts_of(text: str) -> tuple[int, ...] | Any:
    """``"7,15,23"`` -> ``(7, 15, 23)``; text that is not comma-separated integers is kept
    for the check to refuse.

    >>> _cuts_of("7, 15,23")
    (7, 15, 23)
    """
    parts = [p.strip() for p in text.split(",")]
    if all(p.lstrip("-").isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    return text


def _key(name: str) -> str:
    return name.replace("-", "_")


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The options in a TOML file: top-level keys named as the flags (``batch-size``) or
    the fields (``batch_size``); an unknown key, or a file that is not TOML, is a
    :class:`TrainOptionError`. Values are checked by :class:`TrainConfig`. A ``model`` naming
    Python code (``file.py:factory``, or a ``.py`` file) is refused: code runs only when the
    user names it on the command line."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise TrainOptionError(
            f"--config {path!r}: cannot read the file: {exc.strerror}", primitive=PRIMITIVE,
            values={"config": path}, fix="--config run.toml (a TOML file of options)") from None
    except tomllib.TOMLDecodeError as exc:
        raise TrainOptionError(
            f"--config {path!r}: not a TOML file: {exc}", primitive=PRIMITIVE,
            values={"config": path},
            fix='write options as key = value lines, e.g. steps = 200 and model = "gpt2"'
        ) from None
    from ..tools.usercode import looks_like_code

    known = [n for n in FLAGS]
    out: dict[str, Any] = {}
    for name, value in raw.items():
        key = _key(name)
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            raise TrainOptionError(
                f"--config {path!r}: unknown option {name!r}", primitive=PRIMITIVE,
                values={"config": path, "option": name},
                fix=(f"did you mean {near[0]!r}? " if near else "") +
                f"options: {', '.join(known)}")
        if key == "model" and looks_like_code(value):
            raise TrainOptionError(
                f"--config {path!r}: model = {value!r}: a TOML config cannot name Python code "
                "to run", primitive=PRIMITIVE, values={"config": path, "model": value},
                fix=f"pass it on the command line: --model {value if ':' in value else value + ':factory'}"
                " (a zoo name, a model folder or a config.json may stay in the file)")
        out[key] = value
    return out


def options(toml: str | os.PathLike[str] | None = None,
            flags: dict[str, Any] | None = None) -> TrainConfig:
    """The run's options: the TOML file's, then ``flags`` (the ones given on the command
    line) on top, then the defaults; checked (:class:`TrainOptionError`)."""
    return TrainConfig(**{**(load_toml(toml) if toml is not None else {}), **(flags or {})})
