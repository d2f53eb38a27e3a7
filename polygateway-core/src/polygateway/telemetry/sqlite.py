"""SQLite telemetry recorder: one row per attempt in ``pgw_calls`` (ARCHITECTURE §7.8).

The event loop only turns a record into its row and appends the row's values to an in-memory
queue; a dedicated writer thread owns the connection and writes batches, each in one
transaction of multi-row INSERTs. That keeps every byte of SQLite I/O (open, WAL checkpoints,
fsync, lock waits) off the loop, and costs the loop no wake-ups per batch. Measured against an
aiosqlite writer task with the same batching, the loop spends about a third of the CPU per row
(0.4-0.6 us against 1.3-1.8 us on the test machine) for the same total CPU: aiosqlite needs
each batch awaited on the loop.

Batches are large (``batch_size`` rows, or whatever ``flush_interval_s`` gathered): a row
costs less the more rows share a commit (about 6.9 us of writer CPU at 256 rows, 4.8 us at
2048 on the test machine, measured when call ids were random; they are time-ordered now, so
each commit's keys land together at the end of the key's index). Values that every row of a
statement shares (the client's source, scope and namespace, NULLs) are bound once for the
statement (``shared_tail``): binding costs SQLite a copy of each text under its mutex.

Failures never reach the call: an unopenable database, a write error or a full queue each log
one warning and count the lost rows in ``dropped``. A database file deleted or replaced while
the recorder runs (log rotation, a cleanup script) is noticed before and after every batch: the
recorder reopens the path (a fresh database) and writes the batch there, so no row goes to an
unlinked file unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

from polygateway.types import TelemetryRecord, TelemetryValues

logger = logging.getLogger(__name__)

TABLE = "pgw_calls"
COLUMNS: tuple[str, ...] = (
    "call_id",
    "parent_call_id",
    "session_id",
    "model",
    "provider",
    "source_name",
    "messages",
    "response",
    "thinking",
    "prompt_tokens",
    "completion_tokens",
    "usage_source",
    "latency_ms",
    "ttft_ms",
    "max_inter_token_ms",
    "cache_hit",
    "error",
    "cost",
    "created_at",
    "scope",
    "cache_namespace",
    "params",
    "root_call_id",
)

ADDED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("scope", "TEXT NOT NULL DEFAULT ''"),
    ("cache_namespace", "TEXT NOT NULL DEFAULT ''"),
    ("params", "TEXT NOT NULL DEFAULT ''"),
    ("root_call_id", "TEXT NOT NULL DEFAULT ''"),
)
"""Columns added after the first schema: a database made before them gets them in place
(``ALTER TABLE ... ADD COLUMN``, old rows read ``''``) when it is opened."""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    call_id TEXT PRIMARY KEY,
    parent_call_id TEXT,
    session_id TEXT,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    source_name TEXT NOT NULL,
    messages TEXT NOT NULL,
    response TEXT NOT NULL,
    thinking TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    usage_source TEXT NOT NULL,
    latency_ms INTEGER NOT NULL,
    ttft_ms REAL,
    max_inter_token_ms REAL,
    cache_hit INTEGER NOT NULL,
    error TEXT,
    cost REAL,
    created_at REAL NOT NULL,
    scope TEXT NOT NULL DEFAULT '',
    cache_namespace TEXT NOT NULL DEFAULT '',
    params TEXT NOT NULL DEFAULT '',
    root_call_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {TABLE}_created_at ON {TABLE} (created_at);
"""

INDEXES = f"""
CREATE INDEX IF NOT EXISTS {TABLE}_root_call_id ON {TABLE} (root_call_id);
"""
"""Indexes on ``ADDED_COLUMNS``: made once ``migrate`` has added the columns to an old table."""

NULLABLE: frozenset[str] = frozenset(
    ("parent_call_id", "session_id", "ttft_ms", "max_inter_token_ms", "error", "cost")
)
"""The columns that may hold NULL (every other one is ``NOT NULL``)."""

_NULL = math.nan
"""What a row binds for NULL: a float NaN, which SQLite stores as NULL (``sqlite3_bind_double``
binds NULL for a NaN, as it always has for a NaN value of a column). Binding ``None`` itself
costs the sqlite3 module an adapter lookup per value (a key tuple, a dict miss, two failed
attribute lookups: about 2.8k instructions), and a row has up to six; a ``float`` binds
directly, without the copy a text or blob stand-in costs SQLite. (A process that registers a
``sqlite3`` adapter for ``float`` changes how every float binds, this one included.)"""


SHARED_CALL = 12
"""A statement's rows share ``CALL_COLUMNS``, the same in most rows of a client."""
SHARED_ALL = 15
"""A statement's rows share ``CALL_COLUMNS`` and ``TIMING_COLUMNS``."""
OWN_COLUMNS = (
    "call_id",
    "messages",
    "response",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "created_at",
    "root_call_id",
)
"""Columns that differ row to row."""
TIMING_COLUMNS = ("ttft_ms", "max_inter_token_ms", "cost")
"""Columns NULL in every row of calls without streaming or pricing."""
CALL_COLUMNS = (
    "model",
    "provider",
    "source_name",
    "thinking",
    "usage_source",
    "scope",
    "cache_namespace",
    "params",
    "parent_call_id",
    "session_id",
    "error",
    "cache_hit",
)
"""Columns the same in most rows of a client: its source, scope and namespace, no error."""
ROOT_IS_CALL_ID = 1 << 8
"""Added to a form's count of shared values: each row's ``root_call_id`` is its ``call_id``
(the call's first attempt: nearly every row), bound once for both columns (a text less a row to
bind, and SQLite copies every text it binds)."""
_OWN_BUT_ROOT = tuple(c for c in OWN_COLUMNS if c != "root_call_id")
_FORMS: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {
    0: (COLUMNS, ()),
    SHARED_CALL: (OWN_COLUMNS + TIMING_COLUMNS, CALL_COLUMNS),
    SHARED_ALL: (OWN_COLUMNS, TIMING_COLUMNS + CALL_COLUMNS),
    SHARED_CALL | ROOT_IS_CALL_ID: (_OWN_BUT_ROOT + TIMING_COLUMNS, CALL_COLUMNS),
    SHARED_ALL | ROOT_IS_CALL_ID: (_OWN_BUT_ROOT, TIMING_COLUMNS + CALL_COLUMNS),
}
"""By form (the count of values a statement's rows share, and ``ROOT_IS_CALL_ID``): the
columns each row binds itself (``call_id`` first), the columns bound once for all."""
_POSITIONS = {
    form: ([COLUMNS.index(c) for c in own], [COLUMNS.index(c) for c in shared])
    for form, (own, shared) in _FORMS.items()
}

_ROW_PARAMS = f"({', '.join('?' * len(COLUMNS))})"
INSERT = f"INSERT OR IGNORE INTO {TABLE} ({', '.join(COLUMNS)}) VALUES {_ROW_PARAMS}"
"""One row; its parameters are a record's values in ``COLUMNS`` order, NULL bound as NaN."""


def insert(rows: int, form: int = 0) -> str:
    """The INSERT of ``rows`` rows; its parameters are every row's values one after the other
    (``form`` 0), or, column after column, the values of the ``rows`` rows that each row
    binds itself, then once for all the values they share (``_FORMS``; ``?NNN`` parameters
    name a bound value again, a row's ``call_id`` for its ``root_call_id`` too in a
    ``ROOT_IS_CALL_ID`` form): ``bound_values`` makes them."""
    if not form:
        return INSERT + f", {_ROW_PARAMS}" * (rows - 1)
    own, common = _FORMS[form]
    root = form & ROOT_IS_CALL_ID
    columns = (*own, "root_call_id", *common) if root else own + common
    into = f"INSERT OR IGNORE INTO {TABLE} ({', '.join(columns)}) VALUES "
    tail = ", ".join(f"?{len(own) * rows + n}" for n in range(1, len(common) + 1))
    return into + ", ".join(
        f"({', '.join(f'?{column * rows + row + 1}' for column in range(len(own)))}, "
        + (f"?{row + 1}, " if root else "")  # call_id, the first column
        + f"{tail})"
        for row in range(rows)
    )


ROWS_PER_STATEMENT = 64
"""Rows one INSERT carries at most. SQLite runs a statement without the GIL, but binding its
parameters needs it: with a statement per row (``executemany``) the writer took the GIL back
from the event loop once per row, each time a context switch for the loop (measured: 0.15 per
call at 8k calls/s, 0.06 with 64 rows a statement; 256 rows cost SQLite more than it saved).
A batch's rows past the last full statement go in statements of 32, 16, ... 1 rows (at most
six), not one by one: a quiet process writes batches of a few rows."""

BUSY_TIMEOUT_MS = 5000


def split_rows(rows: int, per: int) -> Iterator[int]:
    """The row counts of the statements that write ``rows`` rows, ``per`` at most a statement:
    full statements, then the rest by powers of two (``per`` 64, 107 rows: 64, 32, 8, 2, 1)."""
    while rows >= per:
        yield per
        rows -= per
    while rows:
        size = 1 << (rows.bit_length() - 1)
        yield size
        rows -= size


def statement_sizes(per: int) -> frozenset[int]:
    """Every row count ``split_rows`` yields with ``per`` rows at most a statement."""
    return frozenset((per, *(1 << bit for bit in range(per.bit_length()) if 1 << bit < per)))


ROW_WIDTH = len(COLUMNS)
"""Values a row takes in the recorder's queue."""

_CACHE_HIT = COLUMNS.index("cache_hit")
_CREATED_AT = COLUMNS.index("created_at")
_CALL_ID = COLUMNS.index("call_id")
_ROOT_CALL_ID = COLUMNS.index("root_call_id")
_TIMING = [COLUMNS.index(name) for name in TIMING_COLUMNS]


def shared_tail(rows: list[Any], count: int, start: int = 0) -> int:
    """How many values the ``count`` rows of ``rows`` from index ``start`` (their values one
    after the other, ``COLUMNS`` order) may bind once for all: ``SHARED_ALL``, ``SHARED_CALL``
    or 0.

    Binding a value costs more than inserting it (SQLite copies every text it binds, under
    its connection's mutex), and most of a row's values are those of its client: bound once
    for a statement of 64 rows, a row binds 8 values instead of 23. A value is shared when
    every row's equals the first row's, which is an exact ``str`` (its text), ``None``, or
    for ``cache_hit`` a ``bool`` or ``int`` (equal numbers are equally true): equal values
    of these store the same (a ``str`` subclass redefining equality aside), so the rows are
    those of the statement binding every value (a test holds the two equal).
    """
    end = start + count * ROW_WIDTH
    for position in _POSITIONS[SHARED_CALL][1]:
        column = rows[start + position : end : ROW_WIDTH]
        first = column[0]
        kind = type(first)
        if position == _CACHE_HIT:
            if kind is not bool and kind is not int:
                return 0
        elif kind is not str and first is not None:
            return 0
        if column.count(first) != count:
            return 0
    for position in _TIMING:
        if (
            rows[start + position] is not None
            or rows[start + position : end : ROW_WIDTH].count(None) != count
        ):
            return SHARED_CALL
    return SHARED_ALL


def bound_values(rows: list[Any], count: int, start: int = 0) -> tuple[int, list[Any]]:
    """The statement for the ``count`` rows of ``rows`` from index ``start`` (their values
    one after the other, ``COLUMNS`` order) and its parameters: ``(form, parameters)`` for
    ``insert(count, form)``. ``None`` is bound as NULL's stand-in, ``cache_hit`` as 0 or 1.

    The rows are read in place (each column a slice), not copied out of a batch first."""
    end = start + count * ROW_WIDTH
    form = shared_tail(rows, count, start) if count > 1 else 0
    if not form:
        values = [_NULL if value is None else value for value in rows[start:end]]
        values[_CACHE_HIT::ROW_WIDTH] = [
            1 if hit else 0 for hit in rows[start + _CACHE_HIT : end : ROW_WIDTH]
        ]
        return 0, values
    # Equal, as shared values are (a ``str`` subclass redefining equality aside): the same
    # object in nearly every row, which list equality settles without comparing texts.
    if rows[start + _CALL_ID : end : ROW_WIDTH] == rows[start + _ROOT_CALL_ID : end : ROW_WIDTH]:
        form |= ROOT_IS_CALL_ID
    own, common = _POSITIONS[form]
    values = rows[start + own[0] : end : ROW_WIDTH]
    for position in own[1:]:
        column = rows[start + position : end : ROW_WIDTH]
        # None in a NOT NULL column is no row either way: only TIMING_COLUMNS need looking at.
        if position in _TIMING and None in column:
            column = [_NULL if value is None else value for value in column]
        values += column
    first = rows[start : start + ROW_WIDTH]
    first[_CACHE_HIT] = 1 if first[_CACHE_HIT] else 0
    values += [_NULL if first[position] is None else first[position] for position in common]
    return form, values


_RECORD_VALUES: Callable[[TelemetryRecord], TelemetryValues] = attrgetter(*COLUMNS)
"""A record's values in ``COLUMNS`` order, which is its field order (a test holds the two
equal): ``TelemetryRecord(*_RECORD_VALUES(record))`` is ``record``."""


def migrate(conn: sqlite3.Connection) -> list[str]:
    """Add the ``ADDED_COLUMNS`` an older table lacks; the names added."""
    present = {str(row[1]) for row in conn.execute(f"PRAGMA table_info({TABLE})")}
    added = []
    for name, declaration in ADDED_COLUMNS:
        if name not in present:
            conn.execute(f"ALTER TABLE {TABLE} ADD COLUMN {name} {declaration}")
            added.append(name)
    return added


class SQLiteRecorder:
    """Buffered, idempotent (``call_id`` primary key, ``INSERT OR IGNORE``) SQLite recorder.

    The database is opened lazily by the writer thread on the first record. ``record`` and
    ``record_nowait`` only enqueue; ``flush`` waits until everything queued before it is
    written; ``aclose`` flushes and closes (a graceful shutdown loses nothing). When the queue
    holds ``queue_max`` rows, new rows are dropped and counted in ``dropped``.
    """

    def __init__(
        self,
        path: str,
        *,
        batch_size: int = 2048,
        flush_interval_s: float = 0.2,
        queue_max: int = 100_000,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"SQLiteRecorder path must be a non-empty string, got {path!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"SQLiteRecorder batch_size must be an int >= 1, got {batch_size!r}")
        if (
            isinstance(flush_interval_s, bool)
            or not isinstance(flush_interval_s, int | float)
            or not (math.isfinite(flush_interval_s) and flush_interval_s > 0)
        ):
            raise ValueError(
                "SQLiteRecorder flush_interval_s must be a finite number > 0, "
                f"got {flush_interval_s!r}"
            )
        if isinstance(queue_max, bool) or not isinstance(queue_max, int) or queue_max < 1:
            raise ValueError(f"SQLiteRecorder queue_max must be an int >= 1, got {queue_max!r}")
        self.path = path
        self.batch_size = batch_size
        self.flush_interval_s = float(flush_interval_s)
        self.queue_max = queue_max
        # A list's extend, slice and slice deletion are each atomic under the GIL (not on a
        # free-threaded build, which this queue does not support): the loop thread appends at
        # the end, the writer thread copies the values at the front and deletes them, no lock
        # on the hot path (the loop only ever adds after what the writer took). Each counter
        # has a single writing thread.
        # It holds each row's values one after the other (ROW_WIDTH a row; a row's values are
        # added in one extend, so the queue always holds whole rows): plain values, which the
        # garbage collector does not track. A tuple per waiting row would be one more object
        # it counts, a young collection every few hundred calls at a few thousand calls/s,
        # each walking every call in flight. The writer takes them in two C calls, not a
        # ``deque.popleft`` per value (measured: 3k instructions a row).
        self._queue: list[Any] = []
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._accepted = 0  # loop thread
        self._dropped_on_loop = 0  # loop thread
        self._processed = 0  # writer thread: rows written or dropped by the writer
        self._dropped_by_writer = 0  # writer thread
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._thread: threading.Thread | None = None
        self._writer_done = False  # set under _lock when the writer thread exits
        self._stopping = False
        self._closed = False
        self._broken = False  # the database is unusable: every further row is dropped
        self._warned: set[str] = set()
        # Writer thread only: the multi-row INSERTs by their row counts, sized when the
        # database is opened, the connection, and the identity (device, inode) of the file it
        # has open.
        self._rows_per_statement = 1
        self._inserts: dict[tuple[int, int], str] = {(1, 0): INSERT}
        self._conn: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None

    @property
    def dropped(self) -> int:
        """Rows lost: queue full, database unusable, write failed, or recorded after close."""
        return self._dropped_on_loop + self._dropped_by_writer

    # ------------------------------------------------------------------ loop side

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    def record_nowait(self, record: TelemetryRecord) -> None:
        """Enqueue without waiting; never raises. Safe to call from synchronous code."""
        self.record_values_nowait(_RECORD_VALUES(record))

    def record_values_nowait(self, values: TelemetryValues) -> None:
        """``record_nowait(TelemetryRecord(*values))`` (``ports.SupportsRecordValues``)."""
        queue = self._queue
        if self._closed or self._broken or len(queue) >= self.queue_max * ROW_WIDTH:
            self._drop_on_loop()
            return
        if len(values) != ROW_WIDTH:
            raise ValueError(f"a row has {ROW_WIDTH} values, got {len(values)}")
        # The row's values as given: the writer binds None as NULL and cache_hit as 0 or 1
        # (``bound_values``), mostly once for a statement of 64 rows.
        if values[_CREATED_AT]:
            queue.extend(values)
        else:
            queue.extend((*values[:_CREATED_AT], time.time(), *values[_CREATED_AT + 1 :]))
        self._accepted += 1
        if self._thread is None:
            self._start()
        elif len(queue) >= self.batch_size * ROW_WIDTH and not self._wake.is_set():
            self._wake.set()

    def _drop_on_loop(self) -> None:
        """Count (and warn of, once per cause) a row refused on the loop: the recorder is
        closed or broken, or its queue is full."""
        self._dropped_on_loop += 1
        if self._closed:
            self._warn_once(
                "closed",
                "telemetry row dropped: the SQLite recorder for %s is closed",
                self.path,
            )
        elif not self._broken:
            self._warn_once(
                "full",
                "telemetry queue for %s is full (%d rows): dropping rows, counted in .dropped",
                self.path,
                self.queue_max,
            )

    async def flush(self) -> None:
        """Wait until every row recorded before this call is written (or counted as dropped)."""
        target = self._accepted
        thread = self._thread
        if thread is None or self._processed >= target or not thread.is_alive():
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._writer_done:  # it exited after the check above: nothing will be written
                return
            self._waiters.append((target, loop, future))
        self._wake.set()
        # The writer resolves the future from its thread; shielding keeps a cancelled flush
        # from cancelling a future the writer is about to resolve.
        await asyncio.shield(future)

    async def aclose(self) -> None:
        """Flush, then stop the writer and close the database. Idempotent."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self._closed = True
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._stopping = True
                self._wake.set()
                await asyncio.to_thread(thread.join)

    def _start(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"pgw-telemetry-sqlite:{self.path}", daemon=True
        )
        self._thread = thread
        try:
            thread.start()
        except RuntimeError as exc:  # interpreter shutting down or the thread limit reached
            self._broken = True
            self._dropped_on_loop += len(self._queue) // ROW_WIDTH
            self._queue.clear()
            self._warn_once("thread", "telemetry disabled: cannot start the writer thread: %s", exc)

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        if cause in self._warned:
            return
        self._warned.add(cause)
        logger.warning(message, *args)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        self._connect()
        try:
            while True:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                self._drain()
                self._resolve_waiters()
                if self._stopping and not self._queue:
                    break
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave flush() waiting forever
            self._broken = True
            self._warn_once("writer", "telemetry writer for %s stopped: %r", self.path, exc)
        finally:
            self._disconnect()
            self._drain()  # anything left is lost: count it so nobody waits for it
            with self._lock:
                self._writer_done = True
            self._resolve_waiters(force=True)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if not mode or str(mode[0]).lower() != "wal":
                self._warn_once(
                    "wal",
                    "telemetry database %s did not switch to WAL (journal_mode=%s)",
                    self.path,
                    mode[0] if mode else None,
                )
            # NORMAL is durable across application crashes in WAL mode; only an OS crash can
            # lose the last transactions, an acceptable trade for telemetry.
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(SCHEMA)
            migrate(conn)
            conn.executescript(INDEXES)
            conn.commit()
            # SQLite builds before 3.32 bind at most 999 parameters to one statement.
            fit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(COLUMNS)
            self._rows_per_statement = per = max(1, min(ROWS_PER_STATEMENT, fit))
            self._inserts = {
                (rows, form): insert(rows, form)
                for rows in statement_sizes(per)
                for form in (_FORMS if rows > 1 else (0,))
            }
            self._compile_inserts(conn)
        except Exception:
            conn.close()
            raise
        return conn

    def _compile_inserts(self, conn: sqlite3.Connection) -> None:
        """Compile every INSERT now, into the connection's statement cache.

        Compiled on first use instead, each size would cost its first batch the compile (about
        2 ms for all of them, most of it the 64-row statement) at a moment set by the traffic.
        Rows of NULLs break the NOT NULL columns, and ``INSERT OR IGNORE`` skips such rows:
        nothing is written.
        """
        with conn:
            for (rows, form), sql in self._inserts.items():
                own, common = _FORMS[form]
                conn.execute(sql, (None,) * (rows * len(own) + len(common)))

    def _connect(self) -> bool:
        """Open the database; ``False`` (one warning, the recorder broken) when it cannot."""
        try:
            self._conn = self._open()
        except (sqlite3.Error, OSError) as exc:
            self._broken = True
            self._warn_once(
                "open", "telemetry disabled: cannot open SQLite database %s: %s", self.path, exc
            )
            return False
        self._file = self._file_identity()
        return True

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.close()
        except sqlite3.Error as exc:
            self._warn_once("close", "closing telemetry database %s failed: %s", self.path, exc)

    def _file_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the database file, ``None`` when it does not exist (or the path
        is SQLite's in-memory database)."""
        if self.path == ":memory:":
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_dev, info.st_ino

    def _file_is_gone(self) -> bool:
        """Whether the open connection's file was deleted or replaced at its path."""
        return self.path != ":memory:" and self._file_identity() != self._file

    def _reconnect(self) -> bool:
        """Open the path again (a fresh database when the file was deleted); ``False`` (and the
        recorder broken) when that fails."""
        self._warn_once(
            "reopen",
            "telemetry database %s was deleted or replaced while open: reopened it",
            self.path,
        )
        self._disconnect()
        return self._connect()

    def _drain(self) -> None:
        queue = self._queue
        width = self.batch_size * ROW_WIDTH
        while queue:
            # Whole rows: the loop thread adds a row's values in one extend. Rows wait in the
            # queue until their batch is taken (``queue_max`` counts them): under a backlog,
            # each batch moves the values behind it down the list, one ``memmove``.
            batch = queue[:width]
            del queue[: len(batch)]
            rows = len(batch) // ROW_WIDTH
            if self._conn is not None and self._file_is_gone():
                self._reconnect()
            conn = self._conn
            if conn is None:
                self._dropped_by_writer += rows
            else:
                self._write(conn, batch)
                # Deleted while the batch was written: it went to the unlinked file. Write it
                # again to the new one (INSERT OR IGNORE: a row never lands twice).
                if self._file_is_gone() and self._reconnect() and self._conn is not None:
                    self._write(self._conn, batch)
            self._processed += rows

    def _write(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        """Write ``batch`` (rows' values one after the other) in one transaction."""
        inserts = self._inserts
        try:
            with conn:
                start = 0
                for size in split_rows(len(batch) // ROW_WIDTH, self._rows_per_statement):
                    form, values = bound_values(batch, size, start)
                    conn.execute(inserts[size, form], values)
                    start += size * ROW_WIDTH
            return
        except _WRITE_ERRORS as exc:
            self._warn_once(
                f"batch:{type(exc).__name__}",
                "telemetry batch write to %s failed (%s: %s); retrying row by row",
                self.path,
                type(exc).__name__,
                exc,
            )
        # One bad row (or a lock that outlasted busy_timeout) must not sink its neighbours.
        for start in range(0, len(batch), ROW_WIDTH):
            try:
                with conn:
                    conn.execute(INSERT, bound_values(batch[start : start + ROW_WIDTH], 1)[1])
            except _WRITE_ERRORS as exc:
                self._dropped_by_writer += 1
                self._warn_once(
                    f"row:{type(exc).__name__}",
                    "telemetry row dropped: write to %s failed (%s: %s)",
                    self.path,
                    type(exc).__name__,
                    exc,
                )

    def _resolve_waiters(self, *, force: bool = False) -> None:
        with self._lock:
            if not self._waiters:
                return
            done = self._processed
            ready = [w for w in self._waiters if force or w[0] <= done]
            self._waiters = [w for w in self._waiters if not (force or w[0] <= done)]
        for _, loop, future in ready:
            # RuntimeError: that loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_done, future)

    def __repr__(self) -> str:
        queued = len(self._queue) // ROW_WIDTH
        return f"SQLiteRecorder({self.path!r}, queued={queued}, dropped={self.dropped})"


_WRITE_ERRORS = (sqlite3.Error, ValueError, TypeError, OverflowError)


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


__all__ = ["COLUMNS", "TABLE", "SQLiteRecorder"]
