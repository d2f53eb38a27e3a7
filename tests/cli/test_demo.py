"""`pgw demo` runs the governed batch end to end on embedded defaults."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from polygateway.cli import main


def test_demo_runs_the_batch_and_reports_from_telemetry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "demo.db"
    assert main(["demo", "--calls", "60", "--concurrency", "8", "--quiet", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and "dead key (401)" in out
    assert "calls made 61: 61 answered, 0 failed" in out
    assert "structured call: Invoice(number='INV-42', total=99.5)" in out
    assert "deepseek-1: closed -> open" in out
    with closing(sqlite3.connect(db)) as conn:
        hits = conn.execute("SELECT COUNT(*) FROM pgw_calls WHERE cache_hit = 1").fetchone()[0]
        dead = conn.execute(
            "SELECT COUNT(*) FROM pgw_calls WHERE source_name = 'deepseek-1' AND error IS NULL"
        ).fetchone()[0]
        reask = conn.execute(
            "SELECT COUNT(*) FROM pgw_calls WHERE error = 'ResultInvalidError'"
        ).fetchone()[0]
    assert hits == 10  # the repeated prompts of the second phase
    assert dead == 0  # the revoked key never answers
    assert reask == 1  # the structured call's first answer failed validation
    assert "  cache hits 10\n" in out
    assert "  answered calls 61 (51 by a source, 10 from the cache)" in out
    # Computed, not hard-coded: one ResultInvalidError row, so "once".
    assert "(re-asked once after a validation error)" in out


def test_demo_rejects_a_tiny_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "3"]) == 2
    assert "--calls" in capsys.readouterr().err
