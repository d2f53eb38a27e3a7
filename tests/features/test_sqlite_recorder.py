"""SQLiteRecorder: the recorder contract, plus WAL, busy_timeout, bounded queue and degradation."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from polygateway.telemetry.sqlite import (
    _RECORD_VALUES,
    CALL_COLUMNS,
    COLUMNS,
    NULLABLE,
    OWN_COLUMNS,
    ROOT_IS_CALL_ID,
    SCHEMA,
    SHARED_ALL,
    SHARED_CALL,
    TIMING_COLUMNS,
    SQLiteRecorder,
    bound_values,
    insert,
    shared_tail,
    split_rows,
    statement_sizes,
)
from polygateway.testing.contracts.telemetry import (
    TelemetryRecorderContract,
    assert_row_matches,
    sample_record,
)
from polygateway.types import TelemetryRecord


def read_db(path: Path) -> list[dict[str, Any]]:
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM pgw_calls ORDER BY rowid")]


def count_rows(path: Path) -> int:
    """Rows stored so far; 0 while the database or its table does not exist yet."""
    if not path.exists():
        return 0
    try:
        return len(read_db(path))
    except sqlite3.OperationalError:
        return 0


class TestSQLiteRecorderContract(TelemetryRecorderContract):
    @pytest.fixture
    def db_path(self, tmp_path: Path) -> Path:
        return tmp_path / "telemetry.db"

    @pytest.fixture
    def make_recorder(self, db_path: Path) -> Callable[[], SQLiteRecorder]:
        # A short interval keeps the background batching honest without slowing tests.
        return lambda: SQLiteRecorder(str(db_path), batch_size=64, flush_interval_s=0.05)

    @pytest.fixture
    def read_rows(self, db_path: Path) -> Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]:
        async def read() -> Sequence[Mapping[str, Any]]:
            return read_db(db_path)

        return read


async def test_database_is_in_wal_mode_with_the_documented_schema(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path))
    record = sample_record()
    await recorder.record(record)
    await recorder.aclose()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        columns = [row[1] for row in conn.execute("PRAGMA table_info(pgw_calls)")]
        primary = [row[1] for row in conn.execute("PRAGMA table_info(pgw_calls)") if row[5]]
    assert columns == list(COLUMNS)
    # the 18 fields + created_at + scope, cache_namespace, params, root_call_id
    assert len(columns) == 23
    assert columns[:19] == list(COLUMNS[:19])
    assert primary == ["call_id"]
    (row,) = read_db(path)
    assert_row_matches(row, record)
    assert row["created_at"] == pytest.approx(record.created_at)


def test_the_columns_are_the_record_fields_in_order() -> None:
    """``record_nowait`` hands a record over as its values in ``COLUMNS`` order."""
    assert list(COLUMNS) == [field.name for field in dataclasses.fields(TelemetryRecord)]
    record = sample_record()
    assert _RECORD_VALUES(record) == dataclasses.astuple(record)
    assert TelemetryRecord(*_RECORD_VALUES(record)) == record


async def test_nothing_touches_the_disk_before_the_first_record(tmp_path: Path) -> None:
    path = tmp_path / "lazy.db"
    recorder = SQLiteRecorder(str(path))
    await recorder.flush()
    await recorder.aclose()
    assert not path.exists()


async def test_record_returns_without_waiting_for_the_disk(tmp_path: Path) -> None:
    """The loop only enqueues: 5000 records take far less time than writing them would."""
    recorder = SQLiteRecorder(str(tmp_path / "t.db"))
    records = [sample_record() for _ in range(5000)]
    started = time.perf_counter()
    for record in records:
        recorder.record_nowait(record)
    enqueue_s = time.perf_counter() - started
    await recorder.aclose()
    assert enqueue_s < 0.25, f"enqueueing 5000 rows took {enqueue_s:.3f}s"
    assert len(read_db(tmp_path / "t.db")) == 5000
    assert recorder.dropped == 0


async def test_writes_happen_off_the_event_loop_thread(tmp_path: Path) -> None:
    path = str(tmp_path / "t.db")
    recorder = SQLiteRecorder(path)
    await recorder.record(sample_record())
    await recorder.flush()
    writers = [t for t in threading.enumerate() if t.name == f"pgw-telemetry-sqlite:{path}"]
    assert writers and all(t is not threading.current_thread() for t in writers)
    await recorder.aclose()
    assert not any(t.is_alive() for t in writers)


async def test_rows_are_written_by_the_interval_without_an_explicit_flush(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), flush_interval_s=0.01)
    await recorder.record(sample_record())
    async with asyncio.timeout(5):
        while count_rows(path) == 0:
            await asyncio.sleep(0.01)
    await recorder.aclose()


async def test_unwritable_path_degrades_to_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() == 0:
        # root ignores directory permissions: use a path under a regular file instead.
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        path = blocker / "t.db"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        path = locked / "t.db"
    recorder = SQLiteRecorder(str(path))
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.sqlite"):
        for _ in range(3):
            await recorder.record(sample_record())
        await recorder.flush()  # returns: nothing can be written, nothing waits forever
        for _ in range(3):
            await recorder.record(sample_record())
        await recorder.flush()
        await recorder.aclose()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cannot open SQLite database" in warnings[0].getMessage()
    assert recorder.dropped == 6


async def test_full_queue_drops_counts_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), queue_max=10, flush_interval_s=60.0, batch_size=1000)
    # Hold the writer out of the database so the queue cannot drain during the burst.
    blocker = sqlite3.connect(path, check_same_thread=False)
    blocker.execute("CREATE TABLE hold (x)")
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.sqlite"):
            for _ in range(25):
                recorder.record_nowait(sample_record())
    finally:
        blocker.rollback()
        blocker.close()
    await recorder.aclose()
    assert recorder.dropped == 15
    assert len(read_db(path)) == 10
    full = [r for r in caplog.records if "full" in r.getMessage()]
    assert len(full) == 1


async def test_a_row_sqlite_cannot_bind_is_dropped_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path))
    good = [sample_record() for _ in range(4)]
    bad = sample_record(prompt_tokens=2**70)  # beyond SQLite's 64-bit integers
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.sqlite"):
        for record in [good[0], good[1], bad, good[2], good[3]]:
            await recorder.record(record)
        await recorder.aclose()
    assert {r["call_id"] for r in read_db(path)} == {r.call_id for r in good}
    assert recorder.dropped == 1
    assert any("dropped" in r.getMessage() for r in caplog.records)


async def test_nulls_and_their_look_alikes_are_stored_as_given(tmp_path: Path) -> None:
    # NULL is bound as NaN, which SQLite stores as NULL: no other value of a nullable column
    # may be taken for it, or change its type.
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path))
    nulls = sample_record(**dict.fromkeys(NULLABLE))
    look_alikes = sample_record(
        parent_call_id="0", session_id="", ttft_ms=0.0, max_inter_token_ms=0.0, error="", cost=0.0
    )
    # Outside the declared types, stored as SQLite stores them (a NaN as NULL, as SQLite
    # always stores one).
    odd = sample_record(
        parent_call_id=0,
        session_id=False,
        ttft_ms="",
        max_inter_token_ms=math.nan,
        error=0.0,
        cost=0,
    )
    for record in (nulls, look_alikes, odd):
        await recorder.record(record)
    await recorder.aclose()
    columns = sorted(NULLABLE)
    with closing(sqlite3.connect(path)) as conn:
        stored = {
            call_id: dict(zip(columns, zip(values[::2], values[1::2], strict=True), strict=True))
            for call_id, *values in conn.execute(
                "SELECT call_id, "
                + ", ".join(f"typeof({c}), {c}" for c in columns)
                + " FROM pgw_calls"
            )
        }
    assert stored[nulls.call_id] == dict.fromkeys(columns, ("null", None))
    assert stored[look_alikes.call_id] == {
        "parent_call_id": ("text", "0"),
        "session_id": ("text", ""),
        "ttft_ms": ("real", 0.0),
        "max_inter_token_ms": ("real", 0.0),
        "error": ("text", ""),
        "cost": ("real", 0.0),
    }
    assert stored[odd.call_id] == {
        "parent_call_id": ("text", "0"),
        "session_id": ("text", "0"),
        "ttft_ms": ("text", ""),
        "max_inter_token_ms": ("null", None),
        "error": ("text", "0.0"),
        "cost": ("real", 0.0),
    }


async def test_the_nullable_columns_are_those_the_schema_leaves_nullable(tmp_path: Path) -> None:
    recorder = SQLiteRecorder(str(tmp_path / "t.db"))
    await recorder.record(sample_record())
    await recorder.aclose()
    with closing(sqlite3.connect(tmp_path / "t.db")) as conn:
        info = list(conn.execute("PRAGMA table_info(pgw_calls)"))
    # (cid, name, type, notnull, default, pk): a column without NOT NULL that is not the key
    assert {row[1] for row in info if not row[3] and not row[5]} == NULLABLE


@pytest.mark.parametrize("per", [*range(1, 66), 999 // len(COLUMNS)])
def test_a_batch_is_split_into_prepared_statements_writing_every_row_once(per: int) -> None:
    # per: the rows one statement may carry (fewer than 64 where SQLite binds fewer
    # parameters, 43 on builds before 3.32).
    sizes = statement_sizes(per)
    for rows in range(300):
        split = list(split_rows(rows, per))
        assert sum(split) == rows
        assert set(split) <= sizes
        assert split == sorted(split, reverse=True)
        assert len(split) <= rows // per + per.bit_length()


@pytest.mark.parametrize("size", [1, 3, 63, 64, 65, 200])
async def test_a_batch_of_any_size_writes_every_row(tmp_path: Path, size: int) -> None:
    # Full statements of 64 rows, then the rest by powers of two: every row, none twice.
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), batch_size=4096, flush_interval_s=60)
    records = [sample_record() for _ in range(size)]
    for record in records:
        recorder.record_nowait(record)
    await recorder.flush()  # one batch: the writer drains what the flush found queued
    by_id = {row["call_id"]: row for row in read_db(path)}
    await recorder.aclose()
    assert len(by_id) == size and recorder.dropped == 0
    for record in records:
        assert_row_matches(by_id[record.call_id], record)


class Label(str):
    """A str subclass: equal to its text, stored as its text."""


def queued(record: TelemetryRecord) -> list[Any]:
    """A record's row as the recorder queues it: its values in ``COLUMNS`` order."""
    return list(_RECORD_VALUES(record))


def reference_rows(records: Sequence[TelemetryRecord]) -> list[tuple[Any, ...]]:
    """The rows of ``records`` as one plain INSERT each writes them (None bound as None)."""
    with closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(SCHEMA)
        for record in records:
            values = [1 if v is True else 0 if v is False else v for v in _RECORD_VALUES(record)]
            conn.execute(
                f"INSERT OR IGNORE INTO pgw_calls ({', '.join(COLUMNS)}) "
                f"VALUES ({', '.join('?' * len(COLUMNS))})",
                values,
            )
        return list(conn.execute("SELECT *, typeof(model), typeof(cost) FROM pgw_calls"))


def test_the_shared_forms_hold_every_column_once() -> None:
    assert sorted(OWN_COLUMNS + TIMING_COLUMNS + CALL_COLUMNS) == sorted(COLUMNS)
    assert (len(CALL_COLUMNS), len(TIMING_COLUMNS + CALL_COLUMNS)) == (SHARED_CALL, SHARED_ALL)
    assert set(TIMING_COLUMNS) < NULLABLE and not set(OWN_COLUMNS) & NULLABLE


_COPY_OF_CALL_ID = object()
"""``root_call_id``: a string equal to the row's ``call_id``, another object."""


def _record(**fields: Any) -> TelemetryRecord:
    record = sample_record(**{k: v for k, v in fields.items() if v is not _COPY_OF_CALL_ID})
    if fields.get("root_call_id") is _COPY_OF_CALL_ID:
        copy = record.call_id[:1] + record.call_id[1:]
        assert copy == record.call_id and copy is not record.call_id
        record = dataclasses.replace(record, root_call_id=copy)
    return record


_VARIANTS: list[dict[str, Any]] = [
    {},
    {"model": "model-b"},
    {"model": Label("model-a")},
    {"error": "TimeoutError"},
    {"parent_call_id": None},
    {"cache_hit": True},
    {"thinking": ""},
    {"ttft_ms": None},
    {"ttft_ms": 1.0},
    {"ttft_ms": float("nan")},
    {"cost": 0.5},
    {"prompt_tokens": 7, "messages": "[]"},
    {"root_call_id": "an earlier attempt"},
    {"root_call_id": _COPY_OF_CALL_ID},
    {"root_call_id": "an earlier attempt", "ttft_ms": 1.0},
]


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize(
    "base",
    [{}, {"ttft_ms": None, "max_inter_token_ms": None, "cost": None, "cache_hit": True}],
)
def test_a_statement_writes_the_rows_plain_inserts_write(rows: int, base: dict[str, Any]) -> None:
    # bound_values picks the statement binding the shared values once (and a row's call_id
    # once for its root_call_id too, when the row's root_call_id is that object), or the one
    # binding every value of every row; each writes the rows plain INSERTs write (the
    # definition).
    forms = set()
    for variant in _VARIANTS:
        for odd_row in (0, rows - 1):
            records = [_record(**(base | variant if i == odd_row else base)) for i in range(rows)]
            batch = [value for record in records for value in queued(record)]
            form, values = bound_values(batch, rows)
            forms.add(form)
            # Read in place in a longer batch: the same statement and parameters.
            around = queued(sample_record(model="elsewhere", ttft_ms=7.0))
            assert bound_values([*around, *batch, *around], rows, len(around)) == (form, values)
            with closing(sqlite3.connect(":memory:")) as conn:
                conn.executescript(SCHEMA)
                conn.execute(insert(rows, form), values)
                written = list(conn.execute("SELECT *, typeof(model), typeof(cost) FROM pgw_calls"))
            assert written == reference_rows(records), (variant, odd_row)
            assert len(written) == rows
    shared = {SHARED_CALL} if not base else {SHARED_CALL, SHARED_ALL}
    expected = {0} if rows == 1 else {0} | shared | {f | ROOT_IS_CALL_ID for f in shared}
    assert forms == expected


def test_values_differing_between_rows_are_not_shared() -> None:
    same = [sample_record(ttft_ms=None, max_inter_token_ms=None, cost=None) for _ in range(4)]
    batch = [value for record in same for value in queued(record)]
    assert shared_tail(batch, 4) == SHARED_ALL
    for name, value in [("model", "other"), ("error", "E"), ("cache_hit", True), ("scope", "s")]:
        changed = batch.copy()
        changed[3 * len(COLUMNS) + COLUMNS.index(name)] = value
        assert shared_tail(changed, 4) == 0, name
    for name in TIMING_COLUMNS:
        changed = batch.copy()
        changed[COLUMNS.index(name)] = 1.5
        assert shared_tail(changed, 4) == SHARED_CALL, name
    # A first value of another type than the column's plain ones is bound row by row.
    for name, value in [("model", 5), ("cache_hit", "yes")]:
        changed = batch.copy()
        for row in range(4):
            changed[row * len(COLUMNS) + COLUMNS.index(name)] = value
        assert shared_tail(changed, 4) == 0, name


async def test_every_insert_is_compiled_when_the_database_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A statement of each size compiled on its first use would cost that batch the compile
    # (the 64-row statement's is most of 2 ms), at a moment the traffic picks. SQLite asks the
    # authorizer while it compiles a statement, never when it runs a compiled one.
    compiled: list[str] = []

    def authorize(action: int, table: str | None, *rest: object) -> int:
        if action == sqlite3.SQLITE_INSERT:
            compiled.append(str(table))
        return sqlite3.SQLITE_OK

    connect = sqlite3.connect

    def connect_with_authorizer(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        conn.set_authorizer(authorize)  # before any statement: setting it expires them all
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect_with_authorizer)
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), batch_size=4096, flush_interval_s=60)
    first = sample_record()
    recorder.record_nowait(first)
    await recorder.flush()  # opened and written; the writer is idle until the next flush
    assert compiled, "the authorizer sees compiles"
    compiled.clear()
    records = [sample_record() for _ in range(127)]  # statements of 64, 32, 16, 8, 4, 2, 1 rows
    for record in records:
        recorder.record_nowait(record)
    await recorder.flush()
    await recorder.aclose()
    assert compiled == []
    stored = [row["call_id"] for row in read_db(path)]
    assert stored == [r.call_id for r in [first, *records]], "compiling wrote no row of its own"


async def test_waiting_rows_hold_no_object_the_garbage_collector_tracks(
    tmp_path: Path, collector_paused: None
) -> None:
    # A busy client queues a few hundred rows between two batches: an object per waiting row
    # would set off young collections, each walking every call in flight.
    recorder = SQLiteRecorder(str(tmp_path / "t.db"), batch_size=4096, flush_interval_s=60)
    records = [sample_record() for _ in range(1000)]
    recorder.record_nowait(records[0])
    await recorder.flush()  # the writer thread has started and opened the database: idle now
    gc.collect()
    before = gc.get_count()[0]
    for record in records[1:]:
        recorder.record_nowait(record)
    grown = gc.get_count()[0] - before
    await recorder.aclose()
    assert grown < 10, f"{grown} tracked objects kept by 999 waiting rows"
    assert count_rows(tmp_path / "t.db") == 1000 and recorder.dropped == 0


async def test_busy_timeout_waits_for_a_concurrent_writer(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), flush_interval_s=0.01)
    await recorder.record(sample_record())
    await recorder.flush()
    other = sqlite3.connect(path, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process holding the write lock briefly
    await recorder.record(sample_record())
    released = threading.Timer(0.3, other.rollback)
    released.start()
    try:
        await recorder.flush()
    finally:
        released.join()
        other.close()
    await recorder.aclose()
    assert len(read_db(path)) == 2
    assert recorder.dropped == 0


async def test_a_database_whose_directory_vanished_counts_every_lost_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "rotating"
    folder.mkdir()
    recorder = SQLiteRecorder(str(folder / "t.db"), flush_interval_s=0.05)
    await recorder.record(sample_record())
    await recorder.flush()
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()  # nowhere to reopen: the rows must be counted, not silently lost
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.sqlite"):
        for _ in range(3):
            await recorder.record(sample_record())
        await recorder.flush()
    await recorder.aclose()
    assert recorder.dropped == 3
    assert "deleted or replaced" in caplog.text


async def test_records_after_close_are_dropped_not_raised(tmp_path: Path) -> None:
    recorder = SQLiteRecorder(str(tmp_path / "t.db"))
    await recorder.record(sample_record())
    await recorder.aclose()
    await recorder.record(sample_record())
    recorder.record_nowait(sample_record())
    assert recorder.dropped == 2
    assert len(read_db(tmp_path / "t.db")) == 1


async def test_a_cancelled_flush_leaves_the_recorder_usable(tmp_path: Path) -> None:
    recorder = SQLiteRecorder(str(tmp_path / "t.db"), flush_interval_s=60.0, batch_size=10_000)
    await recorder.record(sample_record())
    flushing = asyncio.ensure_future(recorder.flush())
    await asyncio.sleep(0)
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    await recorder.record(sample_record())
    await recorder.aclose()
    assert len(read_db(tmp_path / "t.db")) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"flush_interval_s": 0}, "flush_interval_s"),
        ({"flush_interval_s": float("nan")}, "flush_interval_s"),
        ({"queue_max": 0}, "queue_max"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SQLiteRecorder(str(tmp_path / "t.db"), **kwargs)


async def test_an_older_database_gains_the_new_columns_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old_columns = ", ".join(
        f"{name} {'REAL' if name == 'created_at' else 'TEXT'}" for name in COLUMNS[:19]
    )
    with closing(sqlite3.connect(path)) as conn:
        keyed = old_columns.replace("call_id TEXT", "call_id TEXT PRIMARY KEY", 1)
        conn.execute(f"CREATE TABLE pgw_calls ({keyed})")
        conn.execute("INSERT INTO pgw_calls (call_id, created_at) VALUES ('old', 1.0)")
        conn.commit()
    recorder = SQLiteRecorder(str(path))
    record = sample_record(
        scope="JUDGE", cache_namespace="tenant-1", params='{"seed":1}', root_call_id="first"
    )
    await recorder.record(record)
    await recorder.aclose()
    rows = {row["call_id"]: row for row in read_db(path)}
    old = rows["old"]
    assert (old["scope"], old["cache_namespace"], old["params"], old["root_call_id"]) == (
        "",
        "",
        "",
        "",
    )
    new = rows[record.call_id]
    assert (new["scope"], new["cache_namespace"], new["params"], new["root_call_id"]) == (
        "JUDGE",
        "tenant-1",
        '{"seed":1}',
        "first",
    )
    with closing(sqlite3.connect(path)) as conn:
        indexes = [row[1] for row in conn.execute("PRAGMA index_list(pgw_calls)")]
    assert "pgw_calls_root_call_id" in indexes  # made once the column was added
