"""Trial results in SQLite: one row per (study, fingerprint, point), committed as each
trial ends.

A tuning run that is interrupted (Ctrl-C, a crash, ``kill -9``) loses at most the trial
that was running: every finished trial was committed in its own transaction. When the run
starts again on the same file and study, finished trials are read back and not run again.

Rows carry the study's fingerprint (:mod:`~torchloom.tune.fingerprint`: the model and the
space): a :class:`Database` bound to a fingerprint reads and writes only rows of that
fingerprint, so rows of another model or space are never resumed.

Each row also carries a digest: the SHA-256 of its full content (study, fingerprint,
point, status, measured figures, error, recipe, seconds). A row whose figures were edited
by hand (say, a throughput raised to make a layout look best) no longer matches it;
:attr:`TrialRecord.intact` says so, and the tuner refuses to resume such a row
(:class:`~torchloom.core.errors.TuneDatabaseError`). The digest has no key: whoever edits
the file can compute it again. It catches edits by hand and damage, not a forger; what
guards the reported best is that the tuner measures it again before reporting it when it
comes from the file (:class:`~torchloom.tune.Tuner`, ``remeasure_best``).

Statuses: ``"ok"`` (ran, throughput measured), ``"failed"`` (ran and raised, e.g. out of
memory; throughput 0), ``"pruned"`` (the memory cost model said it cannot fit the budget;
never run). Only ``ok`` and ``failed`` rows count as finished: a pruned row keeps its
predicted memory so that a later run with a larger budget can run it.

The file is data the tuner did not necessarily write: it is opened only if it is a
torchloom tuner database (SQLite with torchloom's application id and schema version, a
``trials`` table of the expected columns), and every row read is checked (a point that
is a JSON object in canonical form, a known status, numbers where numbers belong, a
recipe that is JSON). Anything else raises :class:`~torchloom.core.errors.TuneDatabaseError`
naming the file and what is wrong; nothing in a row is ever run.

>>> db = Database(":memory:")
>>> db.save(TrialRecord(point={"batch_size": 8}, status="ok", throughput=100.0,
...                     peak_memory_bytes=1024))
>>> [r.throughput for r in db.load()]
[100.0]
>>> db.get({"batch_size": 8}).status
'ok'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from ..core.errors import TuneDatabaseError
from .space import Point, point_key

__all__ = ["APPLICATION_ID", "FINISHED", "SCHEMA_VERSION", "Database", "TrialRecord"]

FINISHED = ("ok", "failed")
STATUSES = ("ok", "failed", "pruned")

#: SQLite's ``PRAGMA application_id`` of a torchloom tuner database ("TLTU").
APPLICATION_ID = 0x544C5455
#: ``PRAGMA user_version``: the layout of the ``trials`` table (1 had no fingerprint, 2 no
#: digest).
SCHEMA_VERSION = 3

_COLUMNS = ("study", "fingerprint", "key", "seq", "status", "throughput",
            "peak_memory_bytes", "predicted_memory_bytes", "error", "recipe", "seconds",
            "created", "digest")
_SCHEMA = """
CREATE TABLE trials (
    study TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
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
    digest TEXT NOT NULL,
    PRIMARY KEY (study, fingerprint, key)
)
"""
_FIX = "pass another results file (--db new.db), or move this one away if it is not needed"


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
        intact: whether the row read matches its digest (False: edited after the tuner
            wrote it; a :class:`~torchloom.tune.Tuner` refuses to resume it).
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
    intact: bool = field(default=True, compare=False, repr=False)

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
        path: the file (created if missing), or ``":memory:"``. Its folder must exist.
        study: a name that separates runs sharing one file (e.g. the model's name).
        fingerprint: the study's fingerprint (:func:`~torchloom.tune.fingerprint.study_fingerprint`);
            rows are written with it and only rows with it are read. None: rows are written
            with an empty fingerprint, and :meth:`load` / :meth:`get` read the rows of every
            fingerprint of the study (to inspect a file; a :class:`~torchloom.tune.Tuner`
            always binds its own).

    Raises:
        TuneDatabaseError: the path is not a file the tuner can use (see the module
            docstring).
    """

    def __init__(self, path: str | Path, study: str = "default",
                 fingerprint: str | None = None) -> None:
        self.path = str(path)
        self.study = study
        self.fingerprint = fingerprint
        if self.path != ":memory:":
            check_database_path(self.path)
        self._conn = sqlite3.connect(self.path)
        try:
            self._open()
        except sqlite3.DatabaseError as exc:  # e.g. "file is not a database"
            self._conn.close()
            raise self._error(f"it is not a SQLite database ({exc})") from None
        except TuneDatabaseError:
            self._conn.close()
            raise

    def _error(self, problem: str, *, ours: bool = False, **values: Any) -> TuneDatabaseError:
        lead = "" if ours else " is not a torchloom tuner database:"
        return TuneDatabaseError(
            f"{self.path!r}{lead} {problem}",
            primitive="tune.Database", values={"path": self.path, **values}, fix=_FIX)

    def _open(self) -> None:
        conn = self._conn
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = sorted(r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"))
        if app_id == 0 and version == 0 and not tables:  # new (or empty): make it ours
            with conn:
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif app_id != APPLICATION_ID:
            columns = self._columns() if "trials" in tables else ()
            if tables == ["trials"] and "fingerprint" not in columns and "recipe" in columns:
                raise self._error(
                    "was written by an older torchloom (schema 1: rows without the "
                    "fingerprint of the model and space this torchloom resumes by)",
                    ours=True, schema=1)
            raise self._error("it is another program's SQLite database",
                              application_id=app_id, tables=tables[:8])
        elif version == 2:
            raise self._error(
                "was written by an older torchloom (schema 2: rows without the digest of "
                "their figures this torchloom checks)", ours=True, schema=2)
        elif version != SCHEMA_VERSION:
            raise self._error(f"is a torchloom tuner database of schema {version}; this "
                              f"torchloom reads schema {SCHEMA_VERSION}", ours=True,
                              schema=version)
        elif self._columns() != _COLUMNS:
            raise self._error("its 'trials' table has other columns",
                              columns=list(self._columns())[:16])
        if self.path != ":memory:":
            conn.execute("PRAGMA journal_mode=WAL")

    def _columns(self) -> tuple[str, ...]:
        return tuple(r[1] for r in self._conn.execute("PRAGMA table_info(trials)"))

    def close(self) -> None:
        """Close the connection (rows are committed already)."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _where(self) -> tuple[str, tuple[Any, ...]]:
        if self.fingerprint is None:
            return "study = ?", (self.study,)
        return "study = ? AND fingerprint = ?", (self.study, self.fingerprint)

    def save(self, record: TrialRecord) -> None:
        """Insert or replace the row of ``record.point`` and commit at once."""
        if record.status not in STATUSES:
            raise ValueError(f"unknown status {record.status!r}")
        fingerprint = self.fingerprint or ""
        peak = None if record.peak_memory_bytes is None else int(record.peak_memory_bytes)
        predicted = (None if record.predicted_memory_bytes is None
                     else int(record.predicted_memory_bytes))
        content = (self.study, fingerprint, record.key, record.status, float(record.throughput),
                   peak, predicted, record.error, record.recipe, float(record.seconds))
        with self._conn:  # one transaction per trial: committed when this block ends
            row = self._conn.execute(
                "SELECT seq FROM trials WHERE study = ? AND fingerprint = ? AND key = ?",
                (self.study, fingerprint, record.key)).fetchone()
            if row is None:
                (seq,) = self._conn.execute(
                    "SELECT COALESCE(MAX(seq), -1) + 1 FROM trials WHERE study = ? AND "
                    "fingerprint = ?", (self.study, fingerprint)).fetchone()
            else:
                seq = row[0]
            self._conn.execute(
                "INSERT OR REPLACE INTO trials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*content[:3], seq, *content[3:], time.time(), row_digest(*content)),
            )
        record.seq = seq

    _SELECT = ("SELECT key, status, throughput, peak_memory_bytes, predicted_memory_bytes, "
               "error, recipe, seconds, seq, study, fingerprint, digest FROM trials WHERE ")

    def load(self) -> list[TrialRecord]:
        """Every row of the study (and fingerprint), in the order first written.

        Raises:
            TuneDatabaseError: a row holds something the tuner never writes.
        """
        where, params = self._where()
        try:
            rows = self._conn.execute(self._SELECT + where + " ORDER BY seq", params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._error(f"its rows cannot be read ({exc})") from None
        return [self._record(row) for row in rows]

    def get(self, point: Point) -> TrialRecord | None:
        """The row of ``point``, or None."""
        where, params = self._where()
        row = self._conn.execute(self._SELECT + where + " AND key = ? ORDER BY created DESC",
                                 (*params, point_key(point))).fetchone()
        return None if row is None else self._record(row)

    def _record(self, row: tuple[Any, ...]) -> TrialRecord:
        try:
            record = _record(row[:9])
        except _BadRow as exc:
            raise TuneDatabaseError(
                f"{self.path!r} holds a row the tuner never writes: {exc}",
                primitive="tune.Database",
                values={"path": self.path, "study": self.study, "seq": str(row[8])[:20],
                        "key": str(row[0])[:80]},
                fix=_FIX) from None
        study, fingerprint, digest = row[9:]
        try:
            record.intact = digest == row_digest(
                study, fingerprint, record.key, record.status, record.throughput,
                record.peak_memory_bytes, record.predicted_memory_bytes, record.error,
                record.recipe, record.seconds)
        except (TypeError, ValueError):  # a column of another type than the tuner writes
            record.intact = False
        return record

    def edited_row_error(self, record: TrialRecord) -> TuneDatabaseError:
        """The refusal of ``record``, a row that does not match its digest."""
        return TuneDatabaseError(
            f"{self.path!r} holds a row whose recorded figures do not match its digest: "
            f"the row of point {record.key[:120]} was changed after the tuner wrote it",
            primitive="tune.Database",
            values={"path": self.path, "study": self.study, "seq": record.seq,
                    "status": record.status, "throughput": record.throughput},
            fix=f"delete that row and the tuner measures the point again: sqlite3 {self.path} "
            f"\"DELETE FROM trials WHERE study = '{self.study}' AND fingerprint = "
            f"'{self.fingerprint or ''}' AND seq = {record.seq}\"; or pass another results "
            "file (--db new.db)")


class _BadRow(Exception):
    pass


def check_database_path(path: str) -> None:
    """Raise :class:`TuneDatabaseError` unless ``path`` can hold a database: its folder
    exists and is writable, and the path is not a folder."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        problem = "is a folder"
    elif not folder.is_dir():
        problem = f"is in a folder that does not exist ({str(folder)!r})"
    elif not os.access(folder, os.W_OK):
        problem = f"is in a folder this process cannot write ({str(folder)!r})"
    else:
        return
    raise TuneDatabaseError(f"the results file {path!r} {problem}", primitive="tune.Database",
                            values={"path": path},
                            fix="pass a file in an existing folder, e.g. --db torchloom-tune.db")


def row_digest(study: str, fingerprint: str, key: str, status: str, throughput: float,
               peak_memory_bytes: int | None, predicted_memory_bytes: int | None,
               error: str | None, recipe: str | None, seconds: float) -> str:
    """The hex SHA-256 of a row's content (everything but its order and time of writing),
    as the tuner writes it; no key: it detects edits, it cannot prove who wrote a row."""
    text = json.dumps([study, fingerprint, key, status, float(throughput), peak_memory_bytes,
                       predicted_memory_bytes, error, recipe, float(seconds)],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _number(value: Any, column: str, *, optional: bool = False, integer: bool = False) -> Any:
    if value is None and optional:
        return None
    kinds = (int,) if integer else (int, float)
    if type(value) not in kinds or not math.isfinite(value) or value < 0:
        raise _BadRow(f"{column} is {value!r}, not a non-negative "
                      f"{'integer' if integer else 'number'}")
    return value


def _record(row: tuple[Any, ...]) -> TrialRecord:
    """A row as a record, checking every column; raises ``_BadRow``."""
    key, status, thr, peak, pred, error, recipe, seconds, seq = row
    try:
        point = json.loads(key) if isinstance(key, str) else None
    except (ValueError, RecursionError):
        point = None
    if type(point) is not dict or point_key(point) != key or not all(
            v is None or type(v) in (bool, int, float, str) for v in point.values()):
        raise _BadRow(f"its point is not a JSON object in canonical form: {str(key)[:80]!r}")
    if status not in STATUSES:
        raise _BadRow(f"unknown status {status!r}")
    if error is not None and not isinstance(error, str):
        raise _BadRow(f"error is a {type(error).__name__}, not text")
    if recipe is not None:
        try:
            data = json.loads(recipe) if isinstance(recipe, str) else None
        except (ValueError, RecursionError):
            data = None
        if type(data) is not dict or "torchloom_recipe" not in data:
            raise _BadRow(f"its recipe is not a recipe's JSON: {str(recipe)[:80]!r}")
    return TrialRecord(point=point, status=status, throughput=_number(thr, "throughput"),
                       peak_memory_bytes=_number(peak, "peak_memory_bytes", optional=True,
                                                 integer=True),
                       predicted_memory_bytes=_number(pred, "predicted_memory_bytes",
                                                      optional=True, integer=True),
                       error=error, recipe=recipe, seconds=_number(seconds, "seconds"),
                       seq=_number(seq, "seq", integer=True))
