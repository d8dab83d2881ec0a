"""How every ``torchloom`` command reports a :class:`~torchloom.ScheduleError`: its message
on standard error, no traceback, exit status 2 (shared by ``torchloom.apps.cli`` and the
``torchloom plan`` command, which its own module defines).

>>> import typer
>>> from typer.testing import CliRunner
>>> from torchloom.core.errors import ScheduleError
>>> app = typer.Typer()
>>> @app.command()
... @clean_errors
... def fail() -> None:
...     raise ScheduleError("no such layer", primitive="demo", fix="check the path")
>>> result = CliRunner().invoke(app, [])
>>> result.exit_code, "error: demo(...): no such layer" in result.output
(2, True)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..core.errors import ScheduleError

__all__ = ["EXIT_SCHEDULE_ERROR", "clean_errors"]

EXIT_SCHEDULE_ERROR = 2

F = TypeVar("F", bound=Callable[..., Any])


def clean_errors(command: F) -> F:
    """Print a ScheduleError as its message (no traceback) and exit with status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ScheduleError as exc:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(exc))}")
            raise typer.Exit(EXIT_SCHEDULE_ERROR) from None

    return wrapper  # type: ignore[return-value]
