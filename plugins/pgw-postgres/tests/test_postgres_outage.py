"""Governed calls with PostgreSQL telemetry on the suite's own server: the server stopped in
the middle of a run, and servers that refuse the login, lack the database or the privilege,
or are not there at all. The calls never notice; the counters account for every row."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from pgw_postgres import PostgresRecorder
from pgw_postgres_test_helpers import (
    MESSAGES,
    OWN_PASSWORD,
    PostgresServer,
    admin_execute,
    count_rows,
    free_port,
    wait_until,
    with_database,
)
from polygateway import GatewayClient
from polygateway.cli import main
from polygateway.testing import Reply

pytestmark = pytest.mark.postgres


def _env(fake_upstream: Any, dsn: str) -> dict[str, str]:
    return {
        "LLM__OPENAI__1__BASE_URL": fake_upstream.base_url("a"),
        "LLM__OPENAI__1__API_KEY": "sk-test",
        "LLM__OPENAI__1__MODEL": "m",
        "PGW_TELEMETRY_BACKEND": "postgres",
        "PGW_TELEMETRY_PG_DSN": dsn,
        "PGW_CACHE_BACKEND": "none",
    }


@pytest.fixture
def pong(fake_upstream: Any) -> Iterator[Any]:
    fake_upstream.set_default("a", Reply.ok(content="pong"))
    yield fake_upstream


class Calls:
    """Governed calls, each timed; every one must answer."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self.latencies: list[float] = []

    async def run(self, count: int) -> list[float]:
        mine = []
        for _ in range(count):
            started = time.perf_counter()
            response = await self.client.chat(MESSAGES)
            mine.append(time.perf_counter() - started)
            assert response.content == "pong"
        self.latencies += mine
        return mine


async def test_postgres_stopped_mid_run_costs_the_calls_nothing(
    own_postgres: PostgresServer,
    own_postgres_dsn: str,
    pong: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pgw_postgres")
    client = GatewayClient.from_env(env=_env(pong, own_postgres_dsn))
    recorder = client.components.telemetry
    assert isinstance(recorder, PostgresRecorder)
    calls = Calls(client)
    try:
        before = await calls.run(100)
        await recorder.flush()
        assert recorder.written == recorder.produced == 100

        # Stop the server while calls keep going, and go on until rows are being lost.
        stopping = asyncio.ensure_future(asyncio.to_thread(own_postgres.stop))
        during: list[float] = []
        while not stopping.done() or recorder.dropped == 0:
            during += await calls.run(5)
            if len(during) > 20_000:
                raise AssertionError("no row was dropped while the server was down")
        await stopping
        during += await calls.run(50)  # with the server gone for good
        await recorder.flush()  # returns: failed batches are counted, not waited for
        dropped_while_down = recorder.dropped
        assert dropped_while_down > 0

        # Start it again: writes resume by themselves (the pool reconnects).
        await asyncio.to_thread(own_postgres.start)
        written_before = recorder.written
        after: list[float] = []

        async def resumed() -> bool:
            after.extend(await calls.run(5))
            return recorder.written > written_before

        await wait_until(resumed, what="writes to resume after the restart")
        after += await calls.run(20)
    finally:
        await client.aclose()

    made = len(calls.latencies)
    assert recorder.produced == made
    assert recorder.written + recorder.dropped == made
    assert not recorder.degraded
    assert await count_rows(own_postgres_dsn) == recorder.written
    # The rows made after the restart all landed: nothing is lost once the server is back.
    assert recorder.dropped == dropped_while_down
    # Within normal latency: the writer's failures never sit on the call's path.
    normal = statistics.median(before)
    assert statistics.median(during) < 5 * normal + 0.02, (normal, statistics.median(during))
    assert max(during) < 1.0, max(during)
    assert max(after) < 1.0, max(after)
    # The outage was reported (once per kind of failure, not per batch), then its end.
    messages = [r.getMessage() for r in caplog.records]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(warnings) <= 6, messages
    assert "accepts rows again" in messages[-1]
    assert all(OWN_PASSWORD not in m for m in messages)


@pytest.fixture
def reader_role(own_postgres: PostgresServer, own_postgres_dsn: str) -> Iterator[str]:
    """A role that may log in to the test database but not create tables in it."""
    role = "pgw_reader"
    admin = own_postgres.admin_dsn
    asyncio.run(admin_execute(admin, f"DROP ROLE IF EXISTS {role}"))
    asyncio.run(admin_execute(admin, f"CREATE ROLE {role} LOGIN PASSWORD '{OWN_PASSWORD}'"))
    database = own_postgres_dsn.rsplit("/", 1)[1]
    try:
        yield own_postgres.dsn(database, user=role)
    finally:
        asyncio.run(admin_execute(admin, f'REVOKE ALL ON DATABASE "{database}" FROM {role}'))
        asyncio.run(admin_execute(admin, f'DROP OWNED BY {role}; DROP ROLE "{role}"'))


def _bad_dsn(kind: str, server: PostgresServer, good_dsn: str, reader: str | None) -> str:
    if kind == "wrong password":
        return good_dsn.replace(OWN_PASSWORD, "not-the-Pa55word")
    if kind == "missing database":
        return with_database(good_dsn, "pgw_no_such_database")
    if kind == "nothing listening":
        return f"postgresql://pgw:{OWN_PASSWORD}@127.0.0.1:{free_port()}/postgres"
    if kind == "bad port":
        return f"postgresql://pgw:{OWN_PASSWORD}@127.0.0.1:99999/postgres"
    assert kind == "no create privilege" and reader is not None
    return reader


EXPECTED = {
    "wrong password": "password authentication failed",
    "missing database": "does not exist",
    "nothing listening": "Connect call failed",
    "bad port": "",
    "no create privilege": "permission denied",
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_an_unusable_database_costs_one_warning_and_no_call(
    kind: str,
    own_postgres: PostgresServer,
    own_postgres_dsn: str,
    pong: Any,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    reader = request.getfixturevalue("reader_role") if kind == "no create privilege" else None
    dsn = _bad_dsn(kind, own_postgres, own_postgres_dsn, reader)
    client = GatewayClient.from_env(env=_env(pong, dsn))
    recorder = client.components.telemetry
    assert isinstance(recorder, PostgresRecorder)

    async def calls() -> list[Any]:
        try:
            responses = [await client.chat(MESSAGES) for _ in range(5)]
            await recorder.flush()
            return responses + await asyncio.gather(*(client.chat(MESSAGES) for _ in range(20)))
        finally:
            await client.aclose()

    with caplog.at_level(logging.DEBUG, logger="pgw_postgres"):
        responses = asyncio.run(calls())
    assert [r.content for r in responses] == ["pong"] * 25
    assert recorder.degraded
    assert (recorder.produced, recorder.written, recorder.dropped) == (25, 0, 25)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "PostgreSQL telemetry disabled" in message
    assert EXPECTED[kind] in message
    assert all(OWN_PASSWORD not in r.getMessage() for r in caplog.records)

    if kind == "no create privilege":
        return  # the login works: that report is the missing-table case below
    assert main(["telemetry", "report", "--dsn", dsn]) == 2
    err = capsys.readouterr().err
    assert "pgw telemetry report: cannot read telemetry from PostgreSQL" in err
    assert EXPECTED[kind] in err
    assert OWN_PASSWORD not in err


def test_the_report_names_a_database_without_telemetry(
    own_postgres_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["telemetry", "report", "--dsn", own_postgres_dsn]) == 2
    err = capsys.readouterr().err
    assert "no pgw_calls table" in err
    assert OWN_PASSWORD not in err


async def test_a_server_restarted_before_the_first_row_is_simply_used(
    own_postgres: PostgresServer, own_postgres_dsn: str
) -> None:
    # Construction connects nowhere: a server that is down then but up at the first row is
    # not a structural failure.
    recorder = PostgresRecorder(own_postgres_dsn)
    await asyncio.to_thread(own_postgres.stop)
    await asyncio.to_thread(own_postgres.start)
    await recorder.record(_row())
    await recorder.aclose()
    assert (recorder.written, recorder.degraded) == (1, False)
    conn = await asyncpg.connect(own_postgres_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pgw_calls") == 1
    finally:
        await conn.close()


def _row() -> Any:
    from polygateway.testing.contracts.telemetry import sample_record

    return sample_record()
