"""``torchloom show`` (a model's size and schedule tree) and ``torchloom list-primitives``."""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from ..core.errors import CliOptionError
from ..core.schedule import Schedule, create_schedule
from ..core.show import rich_tree
from ..primitives import list_primitives
from ..schedules import zoo
from .cli_common import count_text

__all__ = ["list_primitives_command", "show", "show_model"]


def _shape_text(config: Any) -> str:
    """``2 layers, hidden 32, vocabulary 256`` from a transformers config."""
    parts = []
    for key, word in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
                      ("vocab_size", "vocabulary")):
        value = getattr(config, key, None)
        if isinstance(value, int):
            parts.append(f"{value} {word}" if key == "num_hidden_layers" else f"{word} {value}")
    return ", ".join(parts)


def show_model(model: str, size: str) -> tuple[torch.nn.Module, str, list[str]]:
    """The model ``torchloom show`` draws (a folder or config on ``meta``), a sentence
    stating what it is and how large, and its layer lists."""
    from ..runtime.materialise import init_empty_weights
    from .jobconfig import model_kind
    from .train import TrainConfig, count_parameters, layer_lists, meta_model

    kind = model_kind(model)
    if kind == "code":
        from ..tools import usercode

        built = usercode.load(model, meta=True, error=CliOptionError, primitive="torchloom show",
                              flag="MODEL")
        inner = usercode.inner_module(built)
        text = (f"{model}: {type(inner).__name__}, {count_text(count_parameters(built))} parameters"
                " (on meta: shapes only)" + (", wrapped in TokenLM (adds the next-token loss)"
                                            if inner is not built else ""))
        return built, text, layer_lists(built)
    if kind in ("folder", "config"):
        cfg = TrainConfig(model=model, seq_len=2)
        built = meta_model(cfg)
        where = "config.json" if kind == "folder" else "config file"
        text = (f"{model}: {type(built).__name__} from its {where} ({_shape_text(built.config)}), "
                f"{count_text(count_parameters(built))} parameters (on meta: shapes only)")
        return built, text, layer_lists(built)
    if model not in zoo.list_models() and os.path.isdir(model):
        raise CliOptionError("the folder has no config.json (a transformers model folder, as "
                            "save_pretrained writes it, has one)", primitive="torchloom show",
                            values={"model": model}, fix="torchloom show path/to/model-folder")
    with init_empty_weights():
        zoo.make_model(model, size, seed=0)  # unknown names and sizes raise here
    built = zoo.make_model(model, size, seed=0)
    others = [s for s in zoo.SIZES if s != size]
    text = (f"{model}, zoo size {size!r} ({_shape_text(built.config)}): "
            f"{count_text(count_parameters(built))} parameters, randomly initialised"
            + (f"; other sizes: {', '.join(others)} (--size)" if others else ""))
    return built, text, zoo.layer_paths(model)


def show(
    model: str = typer.Argument(..., help=f"A zoo model ({', '.join(zoo.list_models())}), a "
                                "transformers model folder, a config.json, or your own model: "
                                "path/to/file.py:factory."),
    size: str = typer.Option("tiny", help=f"Zoo model size: {', '.join(zoo.SIZES)}."),
    ckpt_ratio: float = typer.Option(
        None, min=0.0, max=1.0,
        help="Apply the demo schedule: checkpoint this fraction of the layers."),
) -> None:
    """Print the schedule tree of a model (its size first) and the primitives applied."""
    console = Console()
    built, text, layers = show_model(model, size)
    console.print(escape(text), highlight=False)
    sch = create_schedule(built)
    if ckpt_ratio is not None:
        for path in layers:
            sch[path].checkpoint(ratio=ckpt_ratio)
    console.print(rich_tree(sch))
    if len(sch.recipe):
        console.print(Panel(Syntax(str(sch.recipe), "python", theme="ansi_dark"),
                            title="schedule (sch.recipe)", expand=False))


def list_primitives_command() -> None:
    """List the primitives a schedule offers."""
    table = Table(title="torchloom primitives")
    table.add_column("primitive", style="bold cyan")
    table.add_column(escape("call on sch[path]"), overflow="fold")
    table.add_column("what it does")
    for name in list_primitives():
        method = getattr(Schedule, name, None)
        if method is None:
            table.add_row(name, "", "")
            continue
        params = list(inspect.signature(method).parameters.values())[1:]  # drop self
        call = f".{name}({', '.join(_param_text(p) for p in params)})"
        doc = (inspect.getdoc(method) or "").split("\n\n")[0].replace("\n", " ")
        doc = doc.split("; see ")[0].rstrip(".") + "."
        table.add_row(name, escape(call), escape(doc))
    Console().print(table)


def _param_text(param: inspect.Parameter) -> str:
    if param.kind is inspect.Parameter.VAR_KEYWORD:
        return f"**{param.name}"
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        return f"*{param.name}"
    return param.name
