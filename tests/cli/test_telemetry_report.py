"""`pgw telemetry report` over a database written by the real SQLite recorder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from polygateway.cli import main
from polygateway.telemetry.report import build_report, parse_since, percentile, read_sqlite_rows
from polygateway.types import TelemetryRecord


def _record(i: int, **overrides: object) -> TelemetryRecord:
    fields: dict[str, object] = {
        "call_id": f"call-{i}",
        "parent_call_id": None,
        "session_id": f"s{i % 2}",
        "model": "m-a" if i % 3 else "m-b",
        "provider": "openai",
        "source_name": "openai-1" if i % 2 else "qwen-1",
        "messages": '[{"role":"user","content":"hi"}]',
        "response": "ok",
        "thinking": "",
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "usage_source": "measured",
        "latency_ms": 100 + i,
        "ttft_ms": 20.0 + i,
        "max_inter_token_ms": 3.0,
        "cache_hit": False,
        "error": None,
        "cost": 0.001,
        "created_at": 1_700_000_000.0 + i,
    }
    fields.update(overrides)
    return TelemetryRecord(**fields)  # type: ignore[arg-type]


@pytest.fixture
def telemetry_db(tmp_path: Path) -> str:
    from polygateway.telemetry.sqlite import SQLiteRecorder

    path = str(tmp_path / "t.db")

    async def write() -> None:
        recorder = SQLiteRecorder(path)
        for i in range(20):
            await recorder.record(_record(i))
        await recorder.record(_record(20, error="TransientError", source_name="qwen-1"))
        # The switch of the same call to another source, which failed too: a failed call.
        await recorder.record(
            _record(21, error="SourceDeadError", source_name="deepseek-1", root_call_id="call-20")
        )
        await recorder.record(_record(22, cache_hit=True, latency_ms=0, cost=0.0))
        await recorder.aclose()

    asyncio.run(write())
    return path


def test_report_aggregates_rows(telemetry_db: str) -> None:
    rows = read_sqlite_rows(telemetry_db)
    assert len(rows) == 23
    report = build_report(rows, by="source")
    # Calls, attempts and cache hits are counted apart: 20 successful attempts and one cache
    # hit answered 21 calls; one call failed after two attempts; 22 rows reached a source.
    assert report.total.rows == 23
    assert report.total.calls == 22
    assert (report.total.answered, report.total.failed_calls) == (21, 1)
    assert report.total.retries == 1
    assert report.total.attempts == 22
    assert report.total.errors == 2
    assert report.total.cache_hits == 1
    assert report.errors_by_class == {"TransientError": 1, "SourceDeadError": 1}
    assert report.errors_by_source["deepseek-1"] == {"SourceDeadError": 1}
    # latency percentiles exclude errors and cache hits
    assert len(report.total.latencies) == 20
    assert percentile(report.total.latencies, 50) == 109.0
    assert report.total.cost == pytest.approx(0.022)


def test_a_call_is_counted_once_in_the_group_that_answered_it() -> None:
    rows = [
        {"call_id": "a1", "root_call_id": "a1", "source_name": "qwen-1", "error": "TransientError"},
        {"call_id": "a2", "root_call_id": "a1", "source_name": "openai-1", "error": None},
        {"call_id": "b1", "root_call_id": "b1", "source_name": "openai-1", "error": "Transient"},
        {"call_id": "b2", "root_call_id": "b1", "source_name": "qwen-1", "error": "Transient"},
        # A row written before root_call_id existed: a call of its own.
        {"call_id": "old", "root_call_id": "", "source_name": "qwen-1", "error": None},
    ]
    for i, row in enumerate(rows):
        row.update(created_at=1_700_000_000.0 + i, latency_ms=5, cost=None)
    report = build_report(rows, by="source")
    groups = {g.key: (g.calls, g.answered, g.failed_calls, g.attempts) for g in report.groups}
    # a1 answered by openai-1 after a switch; b1 failed, its last attempt on qwen-1.
    assert groups == {"openai-1": (1, 1, 0, 2), "qwen-1": (2, 1, 1, 3)}
    total = report.total
    assert (total.calls, total.answered, total.failed_calls, total.retries) == (3, 2, 1, 2)


def test_since_filters_and_parses() -> None:
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("2026-01-01T00:00:00+00:00") == 1767225600.0
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday")


def test_cli_prints_tables_and_writes_html(
    telemetry_db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    html_path = tmp_path / "report.html"
    code = main(
        ["telemetry", "report", "--db", telemetry_db, "--by", "model", "--html", str(html_path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "m-a" in out and "m-b" in out
    assert "TransientError" in out
    page = html_path.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>")
    assert "Latency of successful attempts" in page and "Cost over time" in page
    assert "Errors by source" in page and "<svg" in page
    assert "<script" not in page  # self-contained, static


def test_cli_rejects_missing_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["telemetry", "report", "--db", str(tmp_path / "nope.db")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_report_by_scope_and_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from polygateway.telemetry.sqlite import SQLiteRecorder

    path = str(tmp_path / "roles.db")

    async def write() -> None:
        recorder = SQLiteRecorder(path)
        for i in range(6):
            scope = "JUDGE" if i % 3 == 0 else "SEARCH"
            await recorder.record(_record(i, scope=scope, cache_namespace=f"tenant-{i % 2}"))
        await recorder.aclose()

    asyncio.run(write())
    rows = read_sqlite_rows(path)
    by_scope = {g.key: g.calls for g in build_report(rows, by="scope").groups}
    assert by_scope == {"JUDGE": 2, "SEARCH": 4}
    by_namespace = {g.key: g.calls for g in build_report(rows, by="namespace").groups}
    assert by_namespace == {"tenant-0": 3, "tenant-1": 3}
    assert main(["telemetry", "report", "--db", path, "--by", "scope"]) == 0
    out = capsys.readouterr().out
    assert "JUDGE" in out and "SEARCH" in out


@pytest.mark.parametrize(
    ("dsn", "scheme"), [("mysql://u:Secret-9@h/db", "'mysql'"), ("u:Secret-9@h/db", "'?'")]
)
def test_cli_names_a_dsn_no_reader_reads_without_showing_it(
    dsn: str, scheme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["telemetry", "report", "--dsn", dsn]) == 2
    err = capsys.readouterr().err
    assert f"no telemetry reader for scheme {scheme}" in err
    assert "sqlite" in err  # the readers there are
    assert "Secret-9" not in err


def test_cli_takes_a_file_or_a_dsn_not_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["telemetry", "report", "--db", "x.db", "--dsn", "postgresql://h/db"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
