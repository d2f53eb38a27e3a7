"""Registration, the factory and its options, the DSN check, and the report on PostgreSQL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pgw_postgres import PostgresOptions, PostgresRecorder
from pgw_postgres.reader import read_postgres_rows
from polygateway.clock import SystemClock
from polygateway.errors import ConfigError
from polygateway.plugins import load_registry
from polygateway.ports import BuildContext
from polygateway.settings import ScopeSettings, Secret, TelemetrySettings
from polygateway.testing.contracts.telemetry import sample_record

SECRET = "Sup3r-secret"


def _context(dsn: str | None, options: dict[str, Any] | None = None) -> BuildContext:
    telemetry = TelemetrySettings(
        backend="postgres", pg_dsn=Secret(dsn) if dsn is not None else None
    )
    settings = ScopeSettings(scope="LLM", sources=(), telemetry=telemetry)
    return BuildContext(settings=settings, options=options or {}, clock=SystemClock())


def _factory() -> Any:
    return load_registry().get("telemetry", "postgres")


def test_the_entry_point_registers_the_recorder_and_the_readers() -> None:
    registry = load_registry()
    assert registry.provider_of("telemetry", "postgres") == "pgw-postgres"
    for scheme in ("postgresql", "postgres"):
        assert registry.provider_of("telemetry_reader", scheme) == "pgw-postgres"


def test_the_factory_reads_the_dsn_and_the_options() -> None:
    recorder = _factory()(
        _context(
            f"postgresql+asyncpg://u:{SECRET}@db.internal/telemetry",
            {"batch_size": "250", "flush_interval_s": 0.5, "command_timeout_s": "2.5"},
        )
    )
    assert isinstance(recorder, PostgresRecorder)
    assert recorder.options.dsn == f"postgresql://u:{SECRET}@db.internal/telemetry"
    assert (recorder.options.batch_size, recorder.options.flush_interval_s) == (250, 0.5)
    assert recorder.options.command_timeout_s == 2.5
    assert SECRET not in repr(recorder) and SECRET not in repr(recorder.options)


def test_a_missing_dsn_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="PGW_TELEMETRY_PG_DSN"):
        _factory()(_context(None))


@pytest.mark.parametrize(
    "dsn",
    [
        f"mysql://u:{SECRET}@h/db",
        f"u:{SECRET}@h/db",
        f"host=h password={SECRET}",
        f"postgresql+psycopg://u:{SECRET}@h/db",
        "",
    ],
)
def test_a_dsn_that_is_not_postgresql_is_rejected_without_showing_it(dsn: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _factory()(_context(dsn))
    assert "postgresql://" in str(excinfo.value)
    assert SECRET not in str(excinfo.value)
    with pytest.raises(ConfigError) as direct:
        PostgresRecorder(dsn)
    assert SECRET not in str(direct.value)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "many"}, "batch_size"),
        ({"queue_max": -1}, "queue_max"),
        ({"flush_interval_s": float("nan")}, "flush_interval_s"),
        ({"command_timeout_s": 0}, "command_timeout_s"),
        ({"acquire_timeout_s": "inf"}, "acquire_timeout_s"),
        ({"batchsize": 10}, "batchsize"),
        ({"dsn": f"postgresql://u:{SECRET}@h/db"}, "dsn"),
    ],
)
def test_bad_options_are_config_errors_naming_them(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        _factory()(_context(f"postgresql://u:{SECRET}@h/db", options))
    assert f"option {named}" in str(excinfo.value)
    assert SECRET not in str(excinfo.value)


def test_the_recorder_needs_a_dsn_or_a_pool() -> None:
    with pytest.raises(ValueError, match=r"dsn= .* or pool="):
        PostgresRecorder()
    with pytest.raises(ConfigError, match="batch_size"):
        PostgresRecorder("postgresql://h/db", batch_size=0)
    assert PostgresOptions().batch_size == PostgresRecorder("postgres://h/db").options.batch_size


def test_the_package_root_imports_no_driver() -> None:
    code = "import sys, pgw_postgres; print('asyncpg' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the report


@pytest.mark.postgres
def test_the_report_reads_postgres_as_it_reads_sqlite(
    postgres_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from polygateway.cli import main

    records = [
        sample_record(source_name="a-1", model="m-a", created_at=1_700_000_000.0 + i)
        for i in range(4)
    ] + [
        sample_record(source_name="b-1", model="m-b", error="TransientError", created_at=1.8e9),
        sample_record(source_name="b-1", model="m-b", created_at=1.8e9 + 1),
    ]

    async def write() -> None:
        recorder = PostgresRecorder(postgres_dsn)
        for record in records:
            await recorder.record(record)
        await recorder.aclose()

    asyncio.run(write())
    rows = read_postgres_rows(postgres_dsn)
    assert [r["call_id"] for r in rows] == [r.call_id for r in records]
    assert rows[0]["created_at"] == pytest.approx(1_700_000_000.0)
    assert len(read_postgres_rows(postgres_dsn, since=1.75e9)) == 2

    html = tmp_path / "report.html"
    dsn = postgres_dsn.replace("postgresql://", "postgresql+asyncpg://")
    assert main(["telemetry", "report", "--dsn", dsn, "--by", "source", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["a-1"][1:3] == ["4", "0"]  # calls, errors
    assert lines["b-1"][1:3] == ["2", "1"]
    assert "TransientError" in out
    assert "<svg" in html.read_text(encoding="utf-8")

    assert main(["telemetry", "report", "--dsn", dsn, "--since", "2025-01-01"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:2] == ["m-b", "2"] for line in out.splitlines())
    assert not any(line.startswith("m-a") for line in out.splitlines())


def test_the_reader_rejects_a_dsn_that_is_not_postgresql() -> None:
    with pytest.raises(ValueError, match="postgresql://") as excinfo:
        read_postgres_rows(f"mysql://u:{SECRET}@h/db")
    assert SECRET not in str(excinfo.value)
