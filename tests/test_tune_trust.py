"""The tuner trusts nothing it did not write: studies keyed by a fingerprint of the model
and space, stored rows resumed only when their recipe is the schedule function's, files
that are not its own refused, output paths checked before the first trial."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

import torchloom as tl
from tests.test_tune import Synthetic, schedule, tiny_model
from torchloom.core.errors import TuneDatabaseError, TuneError
from torchloom.tune import Database, Space, Tuner, point_key
from torchloom.tune.fingerprint import study_fingerprint


def grid_space() -> Space:
    """8 points (test_tune's grid has 72): the checks here need few."""
    space = Space()
    space.create_symbol("batch_size", [1, 4, 16, 64])
    space.create_symbol("ckpt_ratio", [0.0, 1.0])
    return space


def _run(db: Path, make_model=tiny_model, space=None, evaluate=None):
    evaluate = evaluate or Synthetic()
    tuner = Tuner(space or grid_space(), make_model, schedule, evaluate, db=db)
    try:
        return tuner.run("exhaustive"), evaluate, tuner.fingerprint
    finally:
        tuner.close()


def test_forged_rows_are_neither_resumed_nor_shown(tmp_path: Path) -> None:
    db = tmp_path / "trials.db"
    reference, first, fingerprint = _run(db)
    assert len(first.calls) == 8 and reference.best is not None
    marker = tmp_path / "PWNED"
    payload = json.dumps({"torchloom_recipe": 1, "entries": [
        {"primitive": "__setattr__", "path": "", "args": ["shard", {"__ref__": "os:system"}]},
        {"primitive": "shard", "path": "", "args": [f"touch {marker}"]}]})
    harmless = tl.Recipe([tl.RecipeEntry("checkpoint", "", (), {"ratio": 0.0})]).to_json(indent=None)
    worst = {"batch_size": 64, "ckpt_ratio": 1.0}
    slow = {"batch_size": 1, "ckpt_ratio": 0.0}
    with sqlite3.connect(db) as conn:
        # (1) a row of another fingerprint (another model or space) claiming a record speed
        conn.execute("INSERT INTO trials VALUES (?, ?, ?, 0, 'ok', 1e12, 1, 1, NULL, ?, 0, 0, '')",
                     ("default", "f" * 64, point_key(reference.best.point), harmless))
        # (2) this study's row of a bad point, given a record speed and the code payload
        conn.execute("UPDATE trials SET throughput = 1e12, recipe = ? WHERE key = ?",
                     (payload, point_key(worst)))
        # (3) a row whose recipe is another point's (harmless) recipe
        conn.execute("UPDATE trials SET throughput = 1e9, recipe = ? WHERE key = ?",
                     (harmless.replace("0.0", "0.5"), point_key(slow)))
    again, second, same = _run(db)
    assert same == fingerprint
    # the two discarded rows run again, then the best (read from the file) is re-measured
    assert [point_key(p) for p in second.calls] == [point_key(slow), point_key(worst),
                                                    point_key(reference.best.point)]
    assert again.discarded == 2 and again.resumed == 6 and again.evaluations == 2
    assert again.remeasured == 1 and again.notes == []
    assert again.best is not None and again.best.point == reference.best.point
    assert again.best.throughput == reference.best.throughput
    assert max(r.throughput for r in again.records) == reference.best.throughput
    assert again.best_recipe == reference.best_recipe
    assert not marker.exists()
    rows = {r.key: r for r in Database(db, fingerprint=fingerprint).load()}
    assert len(rows) == 8 and rows[point_key(worst)].throughput < 1e12  # replaced
    assert "os:system" not in (rows[point_key(worst)].recipe or "")


def test_a_study_of_another_model_or_space_is_not_resumed(tmp_path: Path) -> None:
    db = tmp_path / "trials.db"
    _, first, fingerprint = _run(db)
    wider = lambda: nn.Sequential(*[nn.Linear(4, 5 if i == 7 else 4) for i in range(8)])  # noqa: E731
    _, other_model, other = _run(db, make_model=wider)
    assert other != fingerprint and len(other_model.calls) == 8  # nothing resumed
    space = grid_space()
    space.add_constraint(lambda p: p["batch_size"] != 1)
    _, other_space, third = _run(db, space=space)
    assert third not in (fingerprint, other) and len(other_space.calls) == space.count()
    resumed, same_again, again = _run(db)
    assert again == fingerprint and resumed.resumed == 8
    assert same_again.calls == [resumed.best.point] and resumed.remeasured == 1  # the best
    # a transformers model: its config is part of the fingerprint
    from torchloom.schedules import zoo

    assert study_fingerprint(lambda: zoo.make_model("gpt2"), space) != \
        study_fingerprint(lambda: zoo.make_model("gpt2", layer_norm_epsilon=1e-3), space)


def test_a_file_that_is_not_ours_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    text = tmp_path / "notes.db"
    text.write_bytes(b"my notes, not a database\n" * 100)
    with pytest.raises(TuneDatabaseError, match="it is not a SQLite database"):
        Tuner(grid_space(), tiny_model, schedule, Synthetic(), db=text)
    assert text.read_bytes() == b"my notes, not a database\n" * 100
    with sqlite3.connect(tmp_path / "app.db") as conn:
        conn.execute("CREATE TABLE trials (name TEXT)")
        conn.execute("INSERT INTO trials VALUES ('keep me')")
    with pytest.raises(TuneDatabaseError, match="another program's SQLite database"):
        Database(tmp_path / "app.db")
    with sqlite3.connect(tmp_path / "app.db") as conn:
        assert conn.execute("SELECT * FROM trials").fetchall() == [("keep me",)]
        assert conn.execute("PRAGMA application_id").fetchone() == (0,)


def test_a_database_bound_to_another_fingerprint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TuneError, match="bound to another study fingerprint"):
        Tuner(grid_space(), tiny_model, schedule, Synthetic(),
              db=Database(tmp_path / "x.db", fingerprint="0" * 64))


def _console() -> Console:
    return Console(record=True, width=200, force_terminal=False)


def test_output_paths_are_checked_before_the_first_trial(tmp_path: Path) -> None:
    from torchloom.apps.tune_cli import tune_command

    console = _console()
    db = tmp_path / "tune.db"
    status = tune_command("gpt2", 0.004, "binary", str(db), str(tmp_path / "no" / "space.png"),
                          batch_sizes=(2,), seq_len=8, steps=1, warmup=0, threads=1,
                          console=console)
    text = console.export_text()
    assert status == 2, text
    assert "the output --plot" in text and "is in a folder that does not exist" in text
    assert not db.exists() and "tuning gpt2" not in text  # nothing was built, nothing ran
    status = tune_command("gpt2", 0.004, "binary", str(db), str(db), batch_sizes=(2,),
                          console=console)
    assert status == 2 and "the figure would overwrite the results database" in \
        console.export_text()


def test_the_command_refuses_vit_and_non_positive_batch_sizes() -> None:
    from torchloom.apps.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["tune", "vit", "--budget-gb", "1"])
    assert result.exit_code == 2, result.output
    assert "cannot tune 'vit': it takes images" in result.output
    assert "the command tunes bert, gpt2, llama, opt, t5" in result.output
    result = runner.invoke(app, ["tune", "gpt2", "--budget-gb", "1", "--batch-sizes", "0,-4"])
    assert result.exit_code == 2, result.output
    assert "batch sizes must be positive integers" in result.output
    assert "batch_sizes=[0, -4]" in result.output


def test_a_row_whose_figures_were_edited_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "trials.db"
    reference, _, _ = _run(db)
    slow = {"batch_size": 1, "ckpt_ratio": 0.0}
    with sqlite3.connect(db) as conn:  # the throughput alone, recipe untouched
        conn.execute("UPDATE trials SET throughput = 1e12 WHERE key = ?", (point_key(slow),))
    evaluate = Synthetic()
    with pytest.raises(TuneDatabaseError, match=(
            r"(?s)tune\.Database\(\.\.\.\): '.*trials\.db' holds a row whose recorded figures do "
            r"not match its digest: the row of point \{\"batch_size\":1,\"ckpt_ratio\":0\.0\} "
            r"was changed after the tuner wrote it.*throughput=1000000000000\.0.*fix: delete "
            r"that row and the tuner measures the point again: sqlite3 .*DELETE FROM trials "
            r"WHERE study = 'default' AND fingerprint = '[0-9a-f]{64}' AND seq = 0")):
        _run(db, evaluate=evaluate)
    assert evaluate.calls == []
    assert [r.intact for r in Database(db).load()].count(False) == 1
    with sqlite3.connect(db) as conn:  # the fix the message gives
        conn.execute("DELETE FROM trials WHERE key = ?", (point_key(slow),))
    again, evaluate, _ = _run(db)
    assert evaluate.calls == [slow, reference.best.point] and again.evaluations == 1
    assert again.best.point == reference.best.point


def _forge_throughput(db: Path, point: dict, throughput: float) -> None:
    """Raise a row's throughput and recompute its digest (the digest has no secret)."""
    from torchloom.tune.database import row_digest

    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT study, fingerprint, key, status, throughput, "
                           "peak_memory_bytes, predicted_memory_bytes, error, recipe, seconds "
                           "FROM trials WHERE key = ?", (point_key(point),)).fetchone()
        conn.execute("UPDATE trials SET throughput = ?, digest = ? WHERE key = ?",
                     (throughput, row_digest(*row[:4], throughput, *row[5:]), point_key(point)))


def test_a_forged_best_with_a_recomputed_digest_is_measured_again(tmp_path: Path) -> None:
    db = tmp_path / "trials.db"
    reference, _, fingerprint = _run(db)
    slow = {"batch_size": 1, "ckpt_ratio": 0.0}
    _forge_throughput(db, slow, 1e12)
    assert Database(db, fingerprint=fingerprint).get(slow).intact
    with pytest.warns(UserWarning, match=r"the stored best \{'batch_size': 1, 'ckpt_ratio': "
                      r"0\.0\} \(throughput 1e\+12 in .*trials\.db\) measured 111\.111 when run "
                      r"again; the row now holds the new measurement"):
        again, evaluate, _ = _run(db)
    # the forged row, then the true best (also from the file) measured again
    assert evaluate.calls == [slow, reference.best.point] and again.remeasured == 2
    assert again.best.point == reference.best.point
    assert again.best.throughput == reference.best.throughput and len(again.notes) == 1
    assert Database(db, fingerprint=fingerprint).get(slow).throughput < 1e3  # replaced
    # without the re-measurement, the forgery would be reported
    _forge_throughput(db, slow, 1e12)
    tuner = Tuner(grid_space(), tiny_model, schedule, Synthetic(), db=db, remeasure_best=False)
    try:
        assert tuner.run("exhaustive").best.point == slow
    finally:
        tuner.close()
    with pytest.raises(TuneError, match=r"remeasure_tolerance must be a non-negative fraction"):
        Tuner(grid_space(), tiny_model, schedule, Synthetic(), remeasure_tolerance=-1)
