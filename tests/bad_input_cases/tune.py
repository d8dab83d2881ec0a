"""Bad-input rows: the tuner and ``torchloom tune`` (issue 13 items 2 and 7).

A results file the tuner did not write (not SQLite, another program's, another schema, a
row it never writes) raises TuneDatabaseError; arguments ``torchloom tune`` cannot use
(a model that takes images, non-positive batch sizes, output paths that cannot be
written) raise TuneError before any trial. The command itself prints the same messages
and exits with status 2 (tests/test_tune_trust.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from torchloom.apps.tune_cli import check_arguments
from torchloom.core.errors import TuneDatabaseError, TuneError
from torchloom.tune import Database, TrialRecord
from torchloom.tune.database import APPLICATION_ID


def _ours(tmp_path: Path) -> Path:
    path = tmp_path / "tune.db"
    with Database(path) as db:
        db.save(TrialRecord({"batch_size": 2}, "ok", 10.0, recipe='{"torchloom_recipe": 1, '
                            '"entries": []}'))
    return path


def tune_vit():
    check_arguments("vit", 1.0, "tune.db", None, [1, 2])


def tune_unknown_model():
    check_arguments("gpt3", 1.0, "tune.db", None, [1, 2])


def tune_non_positive_batch_sizes():
    check_arguments("gpt2", 1.0, "tune.db", None, [0, -4])


def tune_ratio_above_one():
    check_arguments("gpt2", 1.0, "tune.db", None, [1], ratios=[0.0, 1.5])


def tune_plot_into_a_missing_folder(tmp_path: Path):
    check_arguments("gpt2", 1.0, str(tmp_path / "tune.db"), str(tmp_path / "no" / "x.png"), [1])


def tune_plot_onto_a_folder(tmp_path: Path):
    check_arguments("gpt2", 1.0, str(tmp_path / "tune.db"), str(tmp_path), [1])


def tune_plot_onto_the_database(tmp_path: Path):
    check_arguments("gpt2", 1.0, str(tmp_path / "tune.db"), str(tmp_path / "tune.db"), [1])


def tune_db_in_a_missing_folder(tmp_path: Path):
    Database(tmp_path / "no" / "tune.db")


def tune_db_that_is_not_sqlite(tmp_path: Path):
    path = tmp_path / "notes.db"
    path.write_text("my notes\n" * 100)
    Database(path)


def tune_db_of_another_program(tmp_path: Path):
    with sqlite3.connect(tmp_path / "app.db") as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    Database(tmp_path / "app.db")


def tune_db_of_the_old_schema(tmp_path: Path):
    with sqlite3.connect(tmp_path / "old.db") as conn:
        conn.execute("CREATE TABLE trials (study TEXT, key TEXT, seq INTEGER, status TEXT, "
                     "throughput REAL, peak_memory_bytes INTEGER, predicted_memory_bytes "
                     "INTEGER, error TEXT, recipe TEXT, seconds REAL, created REAL)")
    Database(tmp_path / "old.db")


def tune_db_of_a_newer_schema(tmp_path: Path):
    with sqlite3.connect(tmp_path / "new.db") as conn:
        conn.execute("CREATE TABLE trials (x TEXT)")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 7")
    Database(tmp_path / "new.db")


def tune_db_of_schema_2(tmp_path: Path):
    with sqlite3.connect(tmp_path / "v2.db") as conn:
        conn.execute("CREATE TABLE trials (x TEXT)")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 2")
    Database(tmp_path / "v2.db")


def tune_db_row_with_a_point_that_is_not_json(tmp_path: Path):
    path = _ours(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE trials SET key = '{not json'")
    Database(path).load()


def tune_db_row_with_an_unknown_status(tmp_path: Path):
    path = _ours(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE trials SET status = 'best'")
    Database(path).load()


def tune_db_row_with_a_recipe_that_is_not_json(tmp_path: Path):
    path = _ours(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE trials SET recipe = 'import os'")
    Database(path).load()


def tune_db_row_with_a_text_throughput(tmp_path: Path):
    path = _ours(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE trials SET throughput = 'fast'")
    Database(path).load()


def tune_db_row_whose_throughput_was_edited(tmp_path: Path):
    from tests.test_tune import Synthetic, schedule, tiny_model
    from torchloom.tune import Space, Tuner

    space = Space()
    space.create_symbol("batch_size", [1, 2])
    space.create_symbol("ckpt_ratio", [0.0])
    path = tmp_path / "tune.db"
    Tuner(space, tiny_model, schedule, Synthetic(), db=path).run("exhaustive")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE trials SET throughput = 1e9 WHERE seq = 0")
    Tuner(space, tiny_model, schedule, Synthetic(), db=path).run("exhaustive")


CASES: list[tuple[Callable, type, str]] = [
    (tune_vit, TuneError, r"torchloom tune\(\.\.\.\): cannot tune 'vit': it takes images "
     r"\(pixel_values\), and this command feeds token ids; the command tunes bert, gpt2, llama, "
     r"opt, t5.*fix: tune one of them, e\.g\. torchloom tune gpt2 --budget-gb 1"),
    (tune_unknown_model, TuneError, r"unknown model 'gpt3'; the command tunes bert, gpt2"),
    (tune_non_positive_batch_sizes, TuneError, r"batch sizes must be positive integers.*"
     r"batch_sizes=\[0, -4\].*fix: --batch-sizes 1,2,4,8"),
    (tune_ratio_above_one, TuneError, r"checkpoint ratios must lie in \[0, 1\].*ratios=\[0\.0, "
     r"1\.5\]"),
    (tune_plot_into_a_missing_folder, TuneError, r"the output --plot '.*x\.png' is in a folder "
     r"that does not exist.*fix: create it first \(mkdir -p .*no\)"),
    (tune_plot_onto_a_folder, TuneError, r"the output --plot '.*' is a folder.*fix: name a file "
     r"in it: --plot .*torchloom-tune\.png"),
    (tune_plot_onto_the_database, TuneError, r"the figure would overwrite the results "
     r"database"),
    (tune_db_in_a_missing_folder, TuneDatabaseError, r"the results file '.*tune\.db' is in a "
     r"folder that does not exist"),
    (tune_db_that_is_not_sqlite, TuneDatabaseError, r"tune\.Database\(\.\.\.\): '.*notes\.db' is "
     r"not a torchloom tuner database: it is not a SQLite database.*fix: pass another results "
     r"file \(--db new\.db\)"),
    (tune_db_of_another_program, TuneDatabaseError, r"is not a torchloom tuner database: it is "
     r"another program's SQLite database.*tables=\['users'\]"),
    (tune_db_of_the_old_schema, TuneDatabaseError, r"'.*old\.db' was written by an older "
     r"torchloom \(schema 1"),
    (tune_db_of_a_newer_schema, TuneDatabaseError, r"is a torchloom tuner database of schema 7; "
     r"this torchloom reads schema 3"),
    (tune_db_row_with_a_point_that_is_not_json, TuneDatabaseError, r"holds a row the tuner "
     r"never writes: its point is not a JSON object in canonical form: '\{not json'"),
    (tune_db_row_with_an_unknown_status, TuneDatabaseError, r"holds a row the tuner never "
     r"writes: unknown status 'best'"),
    (tune_db_row_with_a_recipe_that_is_not_json, TuneDatabaseError, r"its recipe is not a "
     r"recipe's JSON: 'import os'"),
    (tune_db_row_with_a_text_throughput, TuneDatabaseError, r"throughput is 'fast', not a "
     r"non-negative number"),
    (tune_db_of_schema_2, TuneDatabaseError, r"'.*v2\.db' was written by an older torchloom "
     r"\(schema 2: rows without the digest of their figures this torchloom checks\).*"
     r"fix: pass another results file"),
    (tune_db_row_whose_throughput_was_edited, TuneDatabaseError, r"'.*tune\.db' holds a row "
     r"whose recorded figures do not match its digest: the row of point "
     r"\{\"batch_size\":1,\"ckpt_ratio\":0\.0\} was changed after the tuner wrote it.*"
     r"throughput=1000000000\.0.*fix: delete that row and the tuner measures the point again"),
]
