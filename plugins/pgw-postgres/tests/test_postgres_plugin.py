"""Registration, the factory and its options, the DSN check, and the report on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pgw_postgres import PostgresOptions, PostgresRecorder
from pgw_postgres.options import RecorderOptions
from pgw_postgres.reader import read_postgres_rows
from polygateway import GatewayClient
from polygateway.config import describe_settings, load_scope, load_settings
from polygateway.errors import ConfigError
from polygateway.plugins import load_registry
from polygateway.testing.contracts.telemetry import sample_record

SECRET = "Sup3r-secret-SENTINEL"
SOURCES = {
    "LLM__QWEN__1__BASE_URL": "http://127.0.0.1:8400/qwen1/v1",
    "LLM__QWEN__1__MODEL": "qwen-model",
}
PICKED = {**SOURCES, "PGW_TELEMETRY_BACKEND": "postgres"}
DSN = f"postgresql://pgw:{SECRET}@db.internal:5432/telemetry"


@pytest.fixture(autouse=True)
def _empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no stray ./.env or ./pgw.toml


def _problems(env: dict[str, str], **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load_settings(env, **kwargs)
    found = list(excinfo.value.problems)
    assert SECRET not in " ".join(found)
    return found


def _one_with(lines: list[str], *needles: str) -> str:
    found = [line for line in lines if all(n in line for n in needles)]
    assert found, f"no problem contains {needles}; problems: {lines}"
    return found[0]


def test_the_entry_point_registers_the_recorder_and_the_readers() -> None:
    registry = load_registry()
    assert registry.provider_of("telemetry", "postgres") == "pgw-postgres"
    assert registry.options_of("telemetry", "postgres") is PostgresOptions
    for scheme in ("postgresql", "postgres"):
        assert registry.provider_of("telemetry_reader", scheme) == "pgw-postgres"


def test_the_dsn_comes_from_pgw_telemetry_pg_dsn_and_the_options_from_scope_keys() -> None:
    env = {
        **PICKED,
        "PGW_TELEMETRY_PG_DSN": DSN.replace("postgresql://", "postgresql+asyncpg://"),
        "LLM__TELEMETRY__BATCH_SIZE": "250",
        "LLM__TELEMETRY__FLUSH_INTERVAL_S": "500ms",
    }
    scope = load_scope("LLM", env)
    options = scope.telemetry.options
    assert isinstance(options, PostgresOptions)
    assert options.dsn.reveal() == DSN  # the +asyncpg suffix stripped
    assert (options.batch_size, options.flush_interval_s) == (250, 0.5)
    recorder = GatewayClient.from_env(env=env).components.telemetry
    assert isinstance(recorder, PostgresRecorder)
    assert (recorder.options.batch_size, recorder.options.flush_interval_s) == (250, 0.5)
    assert SECRET not in repr(recorder) and SECRET not in repr(options)
    shown = describe_settings(load_settings(env))
    assert SECRET not in str(shown)


def test_the_pipeline_file_sets_the_options_and_names_the_dsn_variable(tmp_path: Path) -> None:
    path = tmp_path / "pgw.toml"
    path.write_text(
        '[defaults.telemetry]\nbackend = "postgres"\n'
        '[defaults.telemetry.options]\ndsn_env = "MY_DSN"\nbatch_size = 64\n'
        "command_timeout_s = 2.5\n",
        encoding="utf-8",
    )
    scope = load_scope("LLM", {**SOURCES, "MY_DSN": DSN}, pipeline_path=path)
    options = scope.telemetry.options
    assert (options.dsn.reveal(), options.batch_size, options.command_timeout_s) == (
        DSN,
        64,
        2.5,
    )


def test_a_missing_dsn_is_a_config_error_naming_the_key() -> None:
    _one_with(_problems(PICKED), "PGW_TELEMETRY_PG_DSN: required", "PGW_TELEMETRY_BACKEND=postgres")


@pytest.mark.parametrize(
    "dsn",
    [
        f"mysql://u:{SECRET}@h/db",
        f"u:{SECRET}@h/db",
        f"host=h password={SECRET}",
        f"postgresql+psycopg://u:{SECRET}@h/db",
    ],
)
def test_a_dsn_that_is_not_postgresql_is_rejected_without_showing_it(dsn: str) -> None:
    line = _one_with(_problems({**PICKED, "PGW_TELEMETRY_PG_DSN": dsn}), "PGW_TELEMETRY_PG_DSN")
    assert "postgresql://" in line
    with pytest.raises(ValueError, match="postgresql://") as direct:
        PostgresRecorder(dsn)
    assert SECRET not in str(direct.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("BATCH_SIZE", "0"),
        ("BATCH_SIZE", "many"),
        ("QUEUE_MAX", "-1"),
        ("FLUSH_INTERVAL_S", "nan"),
        ("COMMAND_TIMEOUT_S", "0"),
        ("ACQUIRE_TIMEOUT_S", "inf"),
        ("POOL_MAX_SIZE", "1000"),
        ("BATCHSIZE", "10"),
    ],
)
def test_bad_options_are_config_errors_naming_the_key(key: str, value: str) -> None:
    env = {**PICKED, "PGW_TELEMETRY_PG_DSN": DSN, f"LLM__TELEMETRY__{key}": value}
    _one_with(_problems(env), f"LLM__TELEMETRY__{key}")


def test_the_recorder_checks_its_own_arguments() -> None:
    with pytest.raises(ValueError, match=r"dsn= .* or pool="):
        PostgresRecorder()
    with pytest.raises(ValueError, match="PostgresRecorder batch_size: ") as excinfo:
        PostgresRecorder(DSN, batch_size=0)
    assert SECRET not in str(excinfo.value)
    with pytest.raises(ValueError, match="flush_interval_s"):
        PostgresRecorder(DSN, flush_interval_s=float("nan"))
    assert RecorderOptions().batch_size == PostgresRecorder("postgres://h/db").options.batch_size


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

    retried = sample_record(
        source_name="b-1", model="m-b", error="TransientError", created_at=1.8e9
    )
    records = [
        sample_record(source_name="a-1", model="m-a", created_at=1_700_000_000.0 + i)
        for i in range(4)
    ] + [
        retried,
        # The retry of the same call: one call of two attempts.
        sample_record(
            source_name="b-1", model="m-b", created_at=1.8e9 + 1, root_call_id=retried.call_id
        ),
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
    # calls, failed calls, attempts, failed attempts
    assert lines["a-1"][1:5] == ["4", "0", "4", "0"]
    assert lines["b-1"][1:5] == ["1", "0", "2", "1"]
    assert "calls 5: 5 answered, 0 failed" in out
    assert "TransientError" in out
    assert "<svg" in html.read_text(encoding="utf-8")

    assert main(["telemetry", "report", "--dsn", dsn, "--since", "2025-01-01"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:4] == ["m-b", "1", "0", "2"] for line in out.splitlines())
    assert not any(line.startswith("m-a") for line in out.splitlines())

    # pgw logs reads through the same reader.
    assert main(["logs", "--dsn", dsn, "--json", "-n", "2"]) == 0
    newest = json.loads(capsys.readouterr().out)
    assert [r["call_id"] for r in newest] == [records[-1].call_id, records[-2].call_id]
    assert main(["logs", "--dsn", dsn, "--errors", "--json"]) == 0
    assert [r["error"] for r in json.loads(capsys.readouterr().out)] == ["TransientError"]


def test_the_reader_rejects_a_dsn_that_is_not_postgresql() -> None:
    with pytest.raises(ValueError, match="postgresql://") as excinfo:
        read_postgres_rows(f"mysql://u:{SECRET}@h/db")
    assert SECRET not in str(excinfo.value)
