"""Trial results in SQLite: one row per (study, point), committed as each trial ends.

A tuning run that is interrupted (Ctrl-C, a crash, ``kill -9``) loses at most the trial
that was running: every finished trial was committed in its own transaction. When the run
starts again on the same file and study, finished trials are read back and not run again.

Statuses: ``"ok"`` (ran, throughput measured), ``"failed"`` (ran and raised, e.g. out of
memory; throughput 0), ``"pruned"`` (the memory cost model said it cannot fit the budget;
never run). Only ``ok`` and ``failed`` rows count as finished: a pruned row keeps its
predicted memory so that a later run with a larger budget can run it.

>>> db = Database(":memory:")
>>> db.save(TrialRecord(point={"batch_size": 8}, status="ok", throughput=100.0,
...                     peak_memory_bytes=1024))
>>> [r.throughput for r in db.load()]
[100.0]
>>> db.get({"batch_size": 8}).status
'ok'
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from .space import Point, point_key

__all__ = ["FINISHED", "Database", "TrialRecord"]

FINISHED = ("ok", "failed")
STATUSES = ("ok", "failed", "pruned")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trials (
    study TEXT NOT NULL,
    key TEXT NOT NULL,
    seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    throughput REAL NOT NULL,
    peak_memory_bytes INTEGER,
    predicted_memory_bytes INTEGER,
    error TEXT,
    recipe TEXT,
    seconds REAL NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (study, key)
)
"""


@dataclass
class TrialRecord:
    """What is known about one point.

    Attributes:
        point: the knob values.
        status: ``"ok"``, ``"failed"`` or ``"pruned"``.
        throughput: measured throughput (0 unless ``ok``).
        peak_memory_bytes: measured peak memory, or None if not run / not measured.
        predicted_memory_bytes: the cost model's prediction, or None.
        error: why it failed or was pruned.
        recipe: the candidate's recipe as JSON, when it could be serialised.
        seconds: time spent evaluating it.
        seq: the order in which the row was first written (set by the database).
    """

    point: Point
    status: str
    throughput: float = 0.0
    peak_memory_bytes: int | None = None
    predicted_memory_bytes: int | None = None
    error: str | None = None
    recipe: str | None = None
    seconds: float = 0.0
    seq: int = field(default=-1)

    @property
    def key(self) -> str:
        """The canonical JSON of the point."""
        return point_key(self.point)

    @property
    def finished(self) -> bool:
        """Whether the trial ran to an outcome (ok or failed)."""
        return self.status in FINISHED


class Database:
    """A SQLite file of :class:`TrialRecord` s for one study.

    Args:
        path: the file (created if missing), or ``":memory:"``.
        study: a name that separates runs sharing one file (e.g. the model's name).
    """

    def __init__(self, path: str | Path, study: str = "default") -> None:
        self.path = str(path)
        self.study = study
        self._conn = sqlite3.connect(self.path)
        if self.path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
        with self._conn:
            self._conn.execute(_SCHEMA)

    def close(self) -> None:
        """Close the connection (rows are committed already)."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def save(self, record: TrialRecord) -> None:
        """Insert or replace the row of ``record.point`` and commit at once."""
        if record.status not in STATUSES:
            raise ValueError(f"unknown status {record.status!r}")
        with self._conn:  # one transaction per trial: committed when this block ends
            row = self._conn.execute(
                "SELECT seq FROM trials WHERE study = ? AND key = ?", (self.study, record.key)
            ).fetchone()
            if row is None:
                (seq,) = self._conn.execute(
                    "SELECT COALESCE(MAX(seq), -1) + 1 FROM trials WHERE study = ?", (self.study,)
                ).fetchone()
            else:
                seq = row[0]
            self._conn.execute(
                "INSERT OR REPLACE INTO trials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (self.study, record.key, seq, record.status, float(record.throughput),
                 record.peak_memory_bytes, record.predicted_memory_bytes, record.error,
                 record.recipe, float(record.seconds), time.time()),
            )
        record.seq = seq

    def load(self) -> list[TrialRecord]:
        """Every row of the study, in the order first written."""
        rows = self._conn.execute(
            "SELECT key, status, throughput, peak_memory_bytes, predicted_memory_bytes, error, "
            "recipe, seconds, seq FROM trials WHERE study = ? ORDER BY seq", (self.study,)
        ).fetchall()
        return [_record(row) for row in rows]

    def get(self, point: Point) -> TrialRecord | None:
        """The row of ``point``, or None."""
        row = self._conn.execute(
            "SELECT key, status, throughput, peak_memory_bytes, predicted_memory_bytes, error, "
            "recipe, seconds, seq FROM trials WHERE study = ? AND key = ?",
            (self.study, point_key(point)),
        ).fetchone()
        return None if row is None else _record(row)


def _record(row: tuple[Any, ...]) -> TrialRecord:
    key, status, thr, peak, pred, error, recipe, seconds, seq = row
    return TrialRecord(point=json.loads(key), status=status, throughput=thr,
                       peak_memory_bytes=peak, predicted_memory_bytes=pred, error=error,
                       recipe=recipe, seconds=seconds, seq=seq)
