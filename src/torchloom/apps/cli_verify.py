"""``torchloom verify MODEL --tp N``: the model's schedule under :class:`~torchloom.Verify`
on N local ranks, at the layout ``--tp`` x ``--sp`` x ``--ckpt-ratio`` that
:func:`torchloom.parallelize` builds; MODEL (a zoo name, a folder, a config file or
``path/to/file.py:factory``) is checked before any rank starts."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..core.errors import CliOptionError, ScheduleError
from ..schedules import zoo

__all__ = ["check_verify", "run_verify", "verify_model", "verify_rank"]

_VERIFY = "torchloom verify"
_SEQ_LEN = 16
"""The length of the sequences verified."""


def _verify_error(exc: ScheduleError) -> CliOptionError:
    """A train-side model error, told as ``torchloom verify``'s (MODEL, not --model)."""
    problem = exc.problem.replace("--model ", "MODEL ", 1)
    return CliOptionError(problem, primitive=_VERIFY, values=exc.values,
                          fix=(exc.fix or "").replace("--model ", "torchloom verify "))


def verify_model(model_name: str, seed: int = 0, *, meta: bool = False) -> torch.nn.Module:
    """The model ``torchloom verify`` schedules: a zoo model (tiny), a folder's or config
    file's transformers model (random initialisation from ``seed``: Verify compares the
    scheduled model with the unscheduled one, whatever the weights), or the model of
    ``FILE.py:factory`` (a plain module in its :class:`~torchloom.tools.usercode.TokenLM`);
    ``meta``: on the meta device (nothing allocated), for the checks up front."""
    from ..runtime.materialise import init_empty_weights
    from ..tools import usercode
    from .jobconfig import TrainConfig, model_kind
    from .train import _from_config, _hf_config

    kind = model_kind(model_name)
    if kind == "code":
        torch.manual_seed(seed)
        return usercode.load(model_name, meta=meta, check=False, error=CliOptionError,
                             primitive=_VERIFY, flag="MODEL")
    if kind in ("folder", "config"):
        cfg = TrainConfig(model=model_name, seq_len=_SEQ_LEN, seed=seed)
        try:
            config = _hf_config(cfg)
            torch.manual_seed(seed)
            with init_empty_weights() if meta else contextlib.nullcontext():
                return _from_config(cfg, config)
        except ScheduleError as exc:
            raise _verify_error(exc) from None
    if meta:
        with init_empty_weights():
            return zoo.make_model(model_name, "tiny", seed=seed)
    return zoo.make_model(model_name, "tiny", seed=seed)


def _verify_inputs(model_name: str, model: torch.nn.Module, seed: int) -> dict[str, Any]:
    if model_name in zoo.list_models():
        return zoo.example_inputs(model_name, model, batch_size=2, seq_len=_SEQ_LEN, seed=seed)
    from transformers import PreTrainedModel

    from ..core.outputs import no_cache_kwargs
    from ..tools.usercode import TokenLM

    # verify_model makes a transformers model, or a TokenLM around the user's module
    assert isinstance(model, (PreTrainedModel, TokenLM))
    embeddings = model.get_input_embeddings()
    if not isinstance(embeddings, torch.nn.Embedding):
        raise CliOptionError(
            f"the input embeddings of {type(model).__name__} are a "
            f"{type(embeddings).__name__}, not an nn.Embedding, so the vocabulary of the "
            "token ids to verify on is unknown", primitive=_VERIFY,
            values={"model": model_name, "embeddings": type(embeddings).__name__},
            fix="verify it in Python: with torchloom.Verify(sch, inputs): ... "
            "(README, 'Verify')")
    vocab = int(embeddings.num_embeddings)
    ids = torch.randint(0, vocab, (2, _SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), **no_cache_kwargs(model)}


def check_verify(model_name: str, tp: int, sp: bool) -> tuple[torch.nn.Module, str]:
    """What ``torchloom verify`` checks before any rank starts: MODEL is a zoo name, a model
    folder, a config file or ``FILE.py:factory`` whose contract holds; its model has a
    schedule, one taking tensor parallelism if ``tp > 1``; it fits this machine's memory
    on ``tp`` ranks. Returns the model on ``meta`` and where its schedule comes from."""
    from ..runtime.model_check import check_fits, format_bytes
    from ..tools import usercode
    from .jobconfig import model_kind
    from .train import _has_builtin_schedule, count_parameters, schedule_source

    if sp and tp < 2:
        raise CliOptionError("sequence parallelism needs at least two tensor-parallel ranks",
                             primitive=_VERIFY, values={"tp": tp, "sp": sp},
                             fix=f"torchloom verify {model_name} --tp 2 --sp")
    if sp and _SEQ_LEN % tp:
        raise CliOptionError(f"sequence parallelism splits the {_SEQ_LEN} positions verified "
                             f"between the {tp} tensor-parallel ranks, and they do not divide",
                             primitive=_VERIFY, values={"tp": tp, "sp": sp,
                                                        "seq_len": _SEQ_LEN},
                             fix=f"torchloom verify {model_name} --tp 2 --sp (or --tp 4)")
    kind = model_kind(model_name)
    if kind is None:
        if usercode.looks_like_code(model_name):
            usercode.CodeSpec.parse(model_name, error=CliOptionError, primitive=_VERIFY,
                                    flag="MODEL")
        if os.path.isdir(model_name):
            raise CliOptionError(
                "the folder has no config.json (a transformers model folder, as "
                "save_pretrained writes it, has one)", primitive=_VERIFY,
                values={"model": model_name, "contents": sorted(os.listdir(model_name))[:8]},
                fix="torchloom verify path/to/model-folder")
        import difflib

        near = difflib.get_close_matches(model_name, zoo.list_models(), n=1)
        raise CliOptionError(
            f"MODEL {model_name!r}: not a zoo model, a model folder (with config.json), a "
            "config .json file or FILE.py:factory", primitive=_VERIFY,
            values={"model": model_name, "zoo": zoo.list_models()},
            fix=f"torchloom verify {near[0] if near else 'gpt2'}, torchloom verify "
            "path/to/folder, or torchloom verify path/to/model.py:make_model")
    model = verify_model(model_name, meta=True)
    if kind == "code":
        usercode.check_contract(model, model_name, _SEQ_LEN, error=CliOptionError,
                                primitive=_VERIFY, flag="MODEL")
    inner = usercode.inner_module(model)
    if not _has_builtin_schedule(model):
        raise CliOptionError(
            f"{type(inner).__name__} has no schedule to verify: no built-in schedule, no "
            "transformers tensor-parallel plan and no stack of layers (a ModuleList or "
            "Sequential of two or more modules of one class)", primitive=_VERIFY,
            values={"model": model_name, "class": type(inner).__name__},
            fix="write its schedule with primitives and verify it in Python: with "
            "torchloom.Verify(sch, inputs): ... (README, 'Verify')")
    if tp > 1 and not _has_builtin_schedule(model, "tp"):
        raise CliOptionError(
            f"--tp {tp}: {type(inner).__name__} has only a schedule without tensor "
            f"parallelism, {schedule_source(model)}: no built-in schedule, and transformers "
            "declares no tensor-parallel plan for it", primitive=_VERIFY,
            values={"model": model_name, "class": type(inner).__name__, "tp": tp},
            fix=f"verify its automatic schedule on one rank: torchloom verify {model_name} "
            "--ckpt-ratio 0.5; or register a schedule taking tp: "
            "torchloom.schedules.register_schedule(name, fn)")
    if kind != "zoo":
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in
                                                            model.parameters()}.values())
        # per rank: the reference and the scheduled copy, with their gradients
        need = 4 * total * tp
        check_fits(need, "cpu", primitive=_VERIFY,
                   what=f"verifying {model_name} ({format_bytes(total)} of parameters; two "
                   f"copies with gradients on each of {tp} rank{'s' if tp > 1 else ''})",
                   values={"model": model_name, "parameters": count_parameters(model),
                           "tp": tp},
                   fix="verify a smaller config of the same class (fewer layers, a smaller "
                   "hidden size): the schedule is the same")
    return model, schedule_source(model)


def verify_rank(rank: int, model_name: str, tp: int, sequence_parallel: bool,
                ckpt_ratio: float, seed: int) -> dict[str, Any]:
    """One rank of ``torchloom verify``: the model under the layout ``tp`` x ``sp`` x
    ``ckpt_ratio``, built by :func:`torchloom.parallelize` inside :class:`~torchloom.Verify`.

    The model's schedule is applied here with ``tp=True`` (over the mesh's tensor-parallel
    group, which is what :func:`~torchloom.parallelize` applies at ``tp > 1``), so that on
    one rank too the schedule's tensor-parallel primitives are recorded and checked;
    ``parallelize`` then adds the layout's checkpointing and builds."""
    from .. import schedules
    from ..parallel import Layout, create_schedule, init_mesh, parallelize
    from ..tools import usercode
    from ..tools.verify import VerificationError, Verify
    from .train import _has_builtin_schedule

    model = verify_model(model_name, seed)
    if tp > 1:
        # Dropout inside a tensor-parallel region draws per-rank masks (fork_rng), which no
        # single-process model can reproduce: verify the arithmetic with dropout off
        # (nn.Dropout modules, and the plain probabilities some attention modules keep).
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            for name in ("dropout", "attention_dropout", "dropout_rate"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 0.0)
    inputs = _verify_inputs(model_name, model, seed)
    layout = Layout(tp=tp, sp=sequence_parallel, ckpt_ratio=ckpt_ratio, seq_len=_SEQ_LEN)
    mesh = init_mesh(layout)
    sch = create_schedule(model, mesh)
    root = usercode.schedule_root(sch)
    knobs: dict[str, Any] = {}
    if _has_builtin_schedule(model, "tp"):  # tp and sp only for a schedule that takes them
        knobs.update(tp=True, sequence_parallel=sequence_parallel)
    verify = Verify(sch, inputs)
    try:
        with verify:
            schedules.apply_schedule(root, **knobs)
            parallelize(sch, layout, mesh=mesh, apply_schedule=False, schedule_at=root.path,
                        stacks=zoo.layer_paths(model_name)
                        if model_name in zoo.list_models() else None)
    except VerificationError as err:
        return {"ok": False, "message": str(err), "stats": verify.stats,
                "primitives": len(sch.recipe)}
    return {"ok": True, "message": "", "stats": verify.stats, "primitives": len(sch.recipe)}


def run_verify(model: str, tp: int, sp: bool, ckpt_ratio: float, seed: int, timeout: float,
               rank_fn: Callable[..., dict[str, Any]] = verify_rank) -> None:
    """``torchloom verify``: check MODEL, run ``rank_fn`` (:func:`verify_rank`) on ``tp``
    local ranks and print what they compared; exit 1 when the scheduled model differs."""
    from ..runtime.launch import raise_first_failure, run_ranks

    console = Console()
    _, source = check_verify(model, tp, sp)
    what = f"{model} (tiny)" if model in zoo.list_models() else model
    console.print(f"verifying [bold]{escape(what)}[/] on {tp} rank{'s' if tp > 1 else ''}"
                  f"{' with sequence parallelism' if sp else ''}; schedule: "
                  f"{escape(source)}...")
    results = run_ranks(rank_fn, tp, model, tp, sp, ckpt_ratio, seed, timeout_s=timeout)
    # The failing rank's own error first (not its peers' "connection closed"); exit 2.
    raise_first_failure(results, command="torchloom verify")
    table = Table(title=f"torchloom verify {model} --tp {tp}{' --sp' if sp else ''}")
    table.add_column("rank")
    for phase in ("forward output", "input gradient", "parameter gradient"):
        table.add_column(f"{phase}s compared", justify="right")
    table.add_column("verdict")
    for rank, result in enumerate(results):
        stats = result["stats"]
        table.add_row(str(rank), *(str(stats.get(p, "-")) for p in
                                   ("forward output", "input gradient", "parameter gradient")),
                      "[green]equal[/]" if result["ok"] else "[red]differs[/]")
    console.print(table)
    if not results[0]["ok"]:
        console.print(escape(results[0]["message"]))
        raise typer.Exit(code=1)
    console.print(f"[green]ok[/]: {results[0]['primitives']} primitive calls, the scheduled model "
                  "computes what the original does")
