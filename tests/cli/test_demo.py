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
    # The healthy source rejects two requests (400): their calls fail at once.
    assert "calls made 61: 59 answered, 2 failed {'RequestRejectedError': 2}" in out
    assert "  calls 61: 59 answered, 2 failed\n" in out
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
        calls = conn.execute("SELECT COUNT(DISTINCT root_call_id) FROM pgw_calls").fetchone()[0]
    assert calls == 61  # every call the demo made, however many attempts each took
    # The ten repeated prompts of the second phase, but for those whose first asking was
    # rejected (nothing cached): at most the two rejected calls.
    assert 8 <= hits <= 10
    assert dead == 0  # the revoked key never answers
    assert reask == 1  # the structured call's first answer failed validation
    assert f"  cache hits {hits}\n" in out
    assert f"  answered calls 59 ({59 - hits} by a source, {hits} from the cache)" in out
    # Computed, not hard-coded: one ResultInvalidError row, so "once".
    assert "(re-asked once after a validation error)" in out


def test_demo_rejects_a_tiny_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--calls", "3"]) == 2
    assert "--calls" in capsys.readouterr().err
