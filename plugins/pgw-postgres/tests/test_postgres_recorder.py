"""PostgresRecorder on the machine's PostgreSQL: schema and migration, concurrency, bad rows,
the bounded queue, the timeouts, the close deadline, dsn= and pool=."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import asyncpg
import pytest
from pgw_postgres import PostgresRecorder
from pgw_postgres.recorder import APPLICATION_NAME
from pgw_postgres.schema import SCHEMA, VERSIONS_TABLE, Column, ensure_schema
from pgw_postgres_test_helpers import count_rows, fetch_rows, wait_until
from polygateway.testing.contracts.telemetry import assert_row_matches, sample_record

pytestmark = pytest.mark.postgres


@pytest.fixture
async def conn(postgres_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(postgres_dsn)
    try:
        yield connection
    finally:
        await connection.close()


# --------------------------------------------------------------------------- schema


async def test_the_table_has_the_18_columns_created_at_a_primary_key_and_indexes(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    recorder = PostgresRecorder(postgres_dsn)
    record = sample_record()
    await recorder.record(record)
    await recorder.aclose()
    columns = await conn.fetch(
        "SELECT column_name, data_type, is_nullable, column_default FROM "
        "information_schema.columns WHERE table_name = 'pgw_calls' ORDER BY ordinal_position"
    )
    names = [c["column_name"] for c in columns]
    assert names == [*(c.name for c in SCHEMA.columns), "created_at"]
    # the 18, scope, cache_namespace, params (version 2), root_call_id (3), created_at
    assert len(names) == 23
    created = columns[-1]
    assert created["data_type"] == "timestamp with time zone"
    assert created["column_default"] == "now()"
    primary = await conn.fetchval(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
        "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = 'pgw_calls'::regclass AND i.indisprimary"
    )
    assert primary == "call_id"
    indexes = {r["indexdef"] for r in await conn.fetch("SELECT indexdef FROM pg_indexes")}
    assert any("(session_id)" in d and "pgw_calls" in d for d in indexes)
    assert any("(created_at)" in d and "pgw_calls" in d for d in indexes)
    assert any("(root_call_id)" in d and "pgw_calls" in d for d in indexes)
    assert await conn.fetchval(f"SELECT version FROM {VERSIONS_TABLE}") == SCHEMA.version
    (row,) = await fetch_rows(postgres_dsn)
    assert_row_matches(row, record)
    assert row["created_at"].timestamp() == pytest.approx(record.created_at)


async def test_a_record_without_a_timestamp_is_stamped_by_the_server(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    recorder = PostgresRecorder(postgres_dsn)
    await recorder.record(sample_record(created_at=0.0))
    await recorder.aclose()
    (row,) = await fetch_rows(postgres_dsn)
    assert abs(row["created_at"].timestamp() - time.time()) < 300


def _next_schema() -> Any:
    """This schema if it has had a migration, else it plus the columns the call API adds."""
    if SCHEMA.version > 1:
        return SCHEMA
    return SCHEMA.with_columns(
        Column("scope", "text", since=2), Column("cache_namespace", "text", since=2)
    )


async def test_a_database_made_by_the_previous_schema_is_migrated_in_place(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    current = _next_schema()
    previous = current.at_version(current.version - 1)
    old = PostgresRecorder(postgres_dsn, schema=previous)
    kept = sample_record(response="stored by the previous version")
    await old.record(kept)
    await old.aclose()
    assert await conn.fetchval(f"SELECT version FROM {VERSIONS_TABLE}") == previous.version

    new = PostgresRecorder(postgres_dsn, schema=current)
    fresh = sample_record(response="stored after the migration")
    await new.record(fresh)
    await new.aclose()
    assert new.schema_version_found == previous.version
    assert await conn.fetchval(f"SELECT version FROM {VERSIONS_TABLE}") == current.version
    names = [
        r["column_name"]
        for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_name = 'pgw_calls' ORDER BY ordinal_position"
        )
    ]
    added = [c.name for c in current.columns if c.since == current.version]
    assert set(added) <= set(names)
    rows = {r["call_id"]: r for r in await fetch_rows(postgres_dsn)}
    assert set(rows) == {kept.call_id, fresh.call_id}
    # The kept row predates the added columns (NULL, asserted below): compare the rest.
    old_view = {**rows[kept.call_id], **{name: getattr(kept, name) for name in added}}
    assert_row_matches(old_view, kept)
    assert_row_matches(rows[fresh.call_id], fresh)
    assert all(rows[kept.call_id][name] is None for name in added)

    # The previous version, started again, writes on into the newer table.
    again = PostgresRecorder(postgres_dsn, schema=previous)
    await again.record(sample_record())
    await again.aclose()
    assert again.written == 1
    assert await conn.fetchval(f"SELECT version FROM {VERSIONS_TABLE}") == current.version


async def test_a_table_without_a_version_row_gets_the_later_columns(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    current = _next_schema()
    await conn.execute(current.at_version(1).create_table())  # made before versions were kept
    recorder = PostgresRecorder(postgres_dsn, schema=current)
    await recorder.record(sample_record())
    await recorder.aclose()
    assert recorder.written == 1
    assert recorder.schema_version_found is None
    count = await conn.fetchval(
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'pgw_calls'"
    )
    assert count == len(current.columns) + 1


async def test_concurrent_starts_create_the_schema_once(postgres_dsn: str) -> None:
    async def start() -> int | None:
        connection = await asyncpg.connect(postgres_dsn)
        try:
            return await ensure_schema(connection, SCHEMA, command_timeout_s=30)
        finally:
            await connection.close()

    found = await asyncio.gather(*(start() for _ in range(8)))
    assert sorted(found, key=lambda v: v or 0) == [None] + [SCHEMA.version] * 7


def test_a_later_column_must_be_nullable_or_have_a_default() -> None:
    with pytest.raises(ValueError, match="NOT NULL without a DEFAULT"):
        Column("scope", "text", "NOT NULL", since=2)
    Column("scope", "text", "NOT NULL DEFAULT ''", since=2)
    with pytest.raises(ValueError, match="identifier"):
        Column("bad name; drop", "text")


# --------------------------------------------------------------------------- nothing lost


async def test_50_writers_of_200_rows_with_repeats_land_exactly_once(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    recorder = PostgresRecorder(postgres_dsn, batch_size=500, flush_interval_s=0.05)
    replayer = PostgresRecorder(postgres_dsn, batch_size=500, flush_interval_s=0.05)
    batches = [[sample_record(session_id=f"w{w}") for _ in range(200)] for w in range(50)]

    async def writer(records: list[Any]) -> None:
        for i, record in enumerate(records):
            await recorder.record(record)
            await recorder.record(replace(record, response="a repeat"))  # on purpose
            if i % 5 == 0:
                await replayer.record(replace(record, response="from another process"))
            if i % 50 == 0:
                await asyncio.sleep(0)

    await asyncio.gather(*(writer(records) for records in batches))
    await asyncio.gather(recorder.aclose(), replayer.aclose())
    assert await conn.fetchval("SELECT count(*) FROM pgw_calls") == 10_000
    assert await conn.fetchval("SELECT count(DISTINCT call_id) FROM pgw_calls") == 10_000
    # Within one recorder the first of two rows with one call_id wins, as across batches.
    assert await conn.fetchval("SELECT count(*) FROM pgw_calls WHERE response = 'a repeat'") == 0
    for made in (recorder, replayer):
        assert made.dropped == 0
        assert made.written == made.produced
    assert recorder.produced == 20_000
    assert replayer.produced == 50 * 40


async def test_a_nul_a_1mb_message_and_a_bad_row_in_one_batch(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = PostgresRecorder(postgres_dsn, batch_size=100, flush_interval_s=10)
    good = [sample_record() for _ in range(6)]
    nul = sample_record(response="before\x00after", messages='[{"content":"\x00"}]')
    huge = sample_record(messages="m" * (1 << 20))
    bad = sample_record(response="a lone surrogate \ud800 cannot be UTF-8")
    batch = [good[0], nul, good[1], huge, good[2], bad, *good[3:]]
    with caplog.at_level(logging.WARNING, logger="pgw_postgres"):
        for record in batch:
            await recorder.record(record)
        await recorder.flush()  # one batch: fewer rows than batch_size, flushed together
    rows = {r["call_id"]: r for r in await fetch_rows(postgres_dsn)}
    assert set(rows) == {r.call_id for r in batch} - {bad.call_id}
    assert rows[nul.call_id]["response"] == "beforeafter"
    assert len(rows[huge.call_id]["messages"]) == 1 << 20
    assert (recorder.written, recorder.dropped) == (len(batch) - 1, 1)
    assert not recorder.degraded
    messages = [r.getMessage() for r in caplog.records]
    assert any("batch write failed" in m and "one by one" in m for m in messages)
    assert any("row was refused" in m for m in messages)
    # The failure degraded nothing: the next batch goes the fast way again.
    later = sample_record()
    await recorder.record(later)
    await recorder.aclose()
    assert later.call_id in {r["call_id"] for r in await fetch_rows(postgres_dsn)}


async def test_a_full_queue_drops_its_oldest_rows_and_counts_them(
    postgres_dsn: str, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_schema(conn, SCHEMA, command_timeout_s=10)
    recorder = PostgresRecorder(postgres_dsn, queue_max=10, batch_size=5, flush_interval_s=0.01)
    first = sample_record()
    async with conn.transaction():
        await conn.execute("LOCK TABLE pgw_calls IN ACCESS EXCLUSIVE MODE")
        await recorder.record(first)
        await wait_until(lambda: _has_lock_waiter(postgres_dsn), what="the writer to block")
        later = [sample_record() for _ in range(25)]
        with caplog.at_level(logging.WARNING, logger="pgw_postgres"):
            for record in later:
                await recorder.record(record)
        assert recorder.dropped == 15
        full = [r for r in caplog.records if "queue is full" in r.getMessage()]
        assert len(full) == 1  # one warning for the 15 rows, not one each
    await recorder.aclose()
    stored = {r["call_id"] for r in await fetch_rows(postgres_dsn)}
    assert stored == {first.call_id, *(r.call_id for r in later[-10:])}
    assert (recorder.produced, recorder.written, recorder.dropped) == (26, 11, 15)


async def _has_lock_waiter(dsn: str) -> bool:
    """Some session of the database waits for a lock (asked over a connection of its own:
    the test's holds the lock inside a transaction)."""
    other = await asyncpg.connect(dsn)
    try:
        waiting = await other.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return int(waiting) > 0
    finally:
        await other.close()


# --------------------------------------------------------------------------- timeouts


async def test_a_server_that_stops_answering_cannot_hang_the_writer(
    postgres_dsn: str, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_schema(conn, SCHEMA, command_timeout_s=10)
    recorder = PostgresRecorder(postgres_dsn, command_timeout_s=0.3, flush_interval_s=0.01)
    stuck = [sample_record() for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="pgw_postgres"):
        async with conn.transaction():
            await conn.execute("LOCK TABLE pgw_calls IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            for record in stuck:
                await recorder.record(record)
            await recorder.flush()  # returns: the statement timed out, the rows are counted
            assert time.monotonic() - started < 5
            assert (recorder.written, recorder.dropped) == (0, 3)
    assert any("unreachable" in r.getMessage() for r in caplog.records)
    after = sample_record()
    await recorder.record(after)
    await recorder.aclose()
    assert recorder.written == 1
    assert [r["call_id"] for r in await fetch_rows(postgres_dsn)] == [after.call_id]


async def test_a_pool_with_no_free_connection_times_out_the_acquire(postgres_dsn: str) -> None:
    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=1)
    try:
        await ensure_schema(await pool.acquire(), SCHEMA, command_timeout_s=10)  # and keep it
        recorder = PostgresRecorder(pool=pool, acquire_timeout_s=0.2, flush_interval_s=0.01)
        started = time.monotonic()
        await recorder.record(sample_record())
        await recorder.flush()
        assert time.monotonic() - started < 5
        assert recorder.degraded  # the table could not be checked: structural
        assert (recorder.written, recorder.dropped) == (0, 1)
        await recorder.aclose()
        assert not pool._closed
    finally:
        pool.terminate()


async def test_aclose_writes_for_at_most_close_timeout_s_then_counts_the_rest(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    await ensure_schema(conn, SCHEMA, command_timeout_s=10)
    recorder = PostgresRecorder(
        postgres_dsn, command_timeout_s=60, close_timeout_s=0.5, flush_interval_s=0.01
    )
    async with conn.transaction():
        await conn.execute("LOCK TABLE pgw_calls IN ACCESS EXCLUSIVE MODE")
        for _ in range(20):
            await recorder.record(sample_record())
        await wait_until(lambda: _has_lock_waiter(postgres_dsn), what="the writer to block")
        started = time.monotonic()
        await recorder.aclose()
        assert time.monotonic() - started < 3
        assert (recorder.written, recorder.dropped) == (0, 20)
    await recorder.record(sample_record())  # after close: dropped, never raised
    assert recorder.dropped == 21
    assert await count_rows(postgres_dsn) == 0


async def test_a_cancelled_flush_leaves_the_writer_going(postgres_dsn: str) -> None:
    recorder = PostgresRecorder(postgres_dsn, flush_interval_s=0.01)
    await recorder.record(sample_record())
    flush = asyncio.ensure_future(recorder.flush())
    await asyncio.sleep(0)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    await recorder.record(sample_record())
    await recorder.flush()
    assert recorder.written == 2
    await recorder.aclose()


async def test_a_cancelled_aclose_still_closes_the_pool(postgres_dsn: str) -> None:
    recorder = PostgresRecorder(postgres_dsn, flush_interval_s=0.01)
    await recorder.record(sample_record())
    await recorder.flush()
    pool = recorder._pool
    assert pool is not None
    await recorder.record(sample_record())
    closing = asyncio.ensure_future(recorder.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert pool._closed

    async def settled() -> bool:
        return recorder.written + recorder.dropped == recorder.produced == 2

    await wait_until(settled, what="the cancelled writer counted its rows")


# --------------------------------------------------------------------------- construction


async def test_a_given_pool_wins_over_the_dsn(postgres_dsn: str) -> None:
    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=1)
    try:
        recorder = PostgresRecorder("postgresql://nobody@127.0.0.1:1/nowhere", pool=pool)
        await recorder.record(sample_record())
        await recorder.aclose()
        assert recorder.written == 1
        assert await count_rows(postgres_dsn) == 1
    finally:
        await pool.close()


async def test_a_sqlalchemy_style_dsn_is_accepted(postgres_dsn: str) -> None:
    dsn = postgres_dsn.replace("postgresql://", "postgresql+asyncpg://")
    recorder = PostgresRecorder(dsn)
    await recorder.record(sample_record())
    await recorder.aclose()
    assert await count_rows(postgres_dsn) == 1


def test_nothing_connects_before_the_first_record() -> None:
    recorder = PostgresRecorder("postgresql://u:pw@127.0.0.1:1/db")
    assert recorder._task is None
    assert "pw" not in repr(recorder) and "pw" not in repr(recorder.options)


def test_recording_outside_an_event_loop_drops_and_counts() -> None:
    recorder = PostgresRecorder("postgresql://u@127.0.0.1:1/db")
    recorder.record_nowait(sample_record())
    assert (recorder.produced, recorder.dropped) == (1, 1)


async def test_connections_reset_by_the_server_are_replaced(
    postgres_dsn: str, conn: asyncpg.Connection
) -> None:
    recorder = PostgresRecorder(postgres_dsn, flush_interval_s=0.01)
    first = [sample_record() for _ in range(50)]
    for record in first:
        await recorder.record(record)
    await recorder.flush()
    killed = await conn.fetch(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = $1",
        APPLICATION_NAME,
    )
    assert killed and all(r[0] for r in killed)
    later = [sample_record() for _ in range(50)]
    for record in later:
        await recorder.record(record)
    await recorder.aclose()
    # The pool replaces a connection it sees closed; a batch that meets one before that is
    # retried row by row on a fresh connection: nothing is lost either way.
    assert (recorder.produced, recorder.written, recorder.dropped) == (100, 100, 0)
    stored = {r["call_id"] for r in await fetch_rows(postgres_dsn)}
    assert stored == {r.call_id for r in first + later}
