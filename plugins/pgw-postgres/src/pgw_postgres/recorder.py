"""PostgreSQL telemetry recorder: one row per attempt in ``pgw_calls`` (ARCHITECTURE §7.8, M2 §5).

A call only appends its record to a bounded in-memory queue (``record_nowait``: no await, no
I/O). One writer task on the same event loop drains it in batches: each batch is one
transaction that COPYs the rows into a per-connection temporary table and moves them with
``INSERT ... SELECT ... ON CONFLICT (call_id) DO NOTHING`` (idempotent: a replayed row is
skipped). Measured against ``executemany`` of the same ``INSERT ... ON CONFLICT`` in the same
batches of 1000 (``tools/bench/telemetry.py``, ``tools/bench/RESULTS.md``), this path wrote
about 1.2x the rows per second for about a third less server CPU per row (14 against 22 us),
so it is the only write path.

Nothing here ever reaches the call. Degradation has exactly two levels (M2 §5):

1. Structural: the pool cannot be made or the table cannot be created or migrated. One
   warning, then the recorder is degraded for good: every queued and later row is dropped
   and counted, no connection is attempted again.
2. Runtime: a batch fails. One warning per kind of failure (until a batch succeeds again),
   and the batch is retried once row by row, so one bad row does not sink the rest; the rows
   that still fail are dropped and counted. When the server itself is unreachable (refused,
   reset, timed out) the row-by-row retry stops at the first such failure and drops the rest
   of the batch at once instead of waiting out a timeout per row. The next batch tries again:
   writes resume by themselves once the server is back (the pool reconnects).

A full queue drops its oldest row (counted). Every statement has ``command_timeout_s``, every
connection wait ``acquire_timeout_s``, opening ``connect_timeout_s``. ``aclose()`` writes
what is queued for at most ``close_timeout_s``. Text loses its ``\\x00`` characters
(PostgreSQL rejects them). ``written + dropped`` accounts for every row recorded once the
queue is drained (``flush``/``aclose``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import asyncpg
from polygateway.types import TelemetryRecord

from pgw_postgres._warn import WarnOnce
from pgw_postgres.options import PostgresOptions, RecorderOptions, dsn_secrets, normalize_dsn
from pgw_postgres.schema import SCHEMA, Row, Schema, ensure_schema

logger = logging.getLogger(__name__)

_DEFAULTS = RecorderOptions()
APPLICATION_NAME = "pgw-telemetry"

WRITE_ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
    ValueError,  # UnicodeEncodeError of a lone surrogate, asyncpg's DataError
    TypeError,
    OverflowError,
)
"""What a write can raise that is about the data or the server, never a bug of ours."""

_UNREACHABLE: tuple[type[Exception], ...] = (
    OSError,
    TimeoutError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, disk full
)
"""Failures of the server or the link, not of a row: retrying other rows cannot help."""


class PostgresRecorder:
    """Buffered, batched, idempotent PostgreSQL recorder that never blocks or fails a call.

    ``PostgresRecorder(dsn)`` makes its own pool on the first record (lazy: constructing it
    connects nowhere) and closes it in ``aclose``; ``PostgresRecorder(pool=pool)`` writes
    through an existing ``asyncpg`` pool and leaves it open (the pool wins over a DSN).
    Counters: ``written``, ``dropped``, ``degraded`` (and ``produced``, ``queued``).
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool | None = None,
        batch_size: int = _DEFAULTS.batch_size,
        queue_max: int = _DEFAULTS.queue_max,
        flush_interval_s: float = _DEFAULTS.flush_interval_s,
        command_timeout_s: float = _DEFAULTS.command_timeout_s,
        acquire_timeout_s: float = _DEFAULTS.acquire_timeout_s,
        connect_timeout_s: float = _DEFAULTS.connect_timeout_s,
        close_timeout_s: float = _DEFAULTS.close_timeout_s,
        pool_max_size: int = _DEFAULTS.pool_max_size,
        schema: Schema = SCHEMA,
    ) -> None:
        options = RecorderOptions.checked(
            {
                "batch_size": batch_size,
                "queue_max": queue_max,
                "flush_interval_s": flush_interval_s,
                "command_timeout_s": command_timeout_s,
                "acquire_timeout_s": acquire_timeout_s,
                "connect_timeout_s": connect_timeout_s,
                "close_timeout_s": close_timeout_s,
                "pool_max_size": pool_max_size,
            },
            where="PostgresRecorder",
        )
        if dsn is not None:
            if not isinstance(dsn, str):
                raise TypeError(f"PostgresRecorder dsn must be a str, got {type(dsn).__name__}")
            try:
                dsn = normalize_dsn(dsn)
            except ValueError as exc:
                raise ValueError(f"PostgresRecorder dsn: {exc}") from None
        elif pool is None:
            raise ValueError("PostgresRecorder needs dsn= (a postgresql:// URL) or pool=")
        if not isinstance(schema, Schema):
            raise TypeError(f"PostgresRecorder schema must be a Schema, got {schema!r}")
        self.options = options
        self.schema = schema
        self._dsn = dsn  # never shown: not in repr, errors or warnings
        self._pool: asyncpg.Pool | None = pool
        self._owns_pool = False
        self._secrets = dsn_secrets(dsn) if dsn else ()
        self._warn = WarnOnce(logger, "PostgreSQL telemetry", self._secrets)
        self._queue: deque[TelemetryRecord] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._produced = 0
        self._written = 0
        self._dropped = 0
        self._in_flight = 0  # rows taken from the queue and not yet written or dropped
        self._stopping = False
        self._closed = False
        self._degraded = False
        self._full_warned = False
        self.schema_version_found: int | None = None
        """The version the table had when this recorder opened it (``None``: no table)."""

    @classmethod
    def from_options(
        cls, options: PostgresOptions, *, pool: asyncpg.Pool | None = None
    ) -> PostgresRecorder:
        """The recorder the ``postgres`` telemetry backend's validated options describe."""
        tuning = {name: getattr(options, name) for name in RecorderOptions.model_fields}
        return cls(options.dsn.reveal(), pool=pool, **tuning)

    # ------------------------------------------------------------------ counters

    @property
    def produced(self) -> int:
        """Rows handed to the recorder (every ``record``/``record_nowait``)."""
        return self._produced

    @property
    def written(self) -> int:
        """Rows in the table: committed by a batch or one by one (a replayed ``call_id``
        counts once it is known to be there)."""
        return self._written

    @property
    def dropped(self) -> int:
        """Rows lost: queue full (oldest first), failed writes, degraded, closed, timed out."""
        return self._dropped

    @property
    def degraded(self) -> bool:
        """The pool or the table could not be made: every row is dropped from then on."""
        return self._degraded

    @property
    def queued(self) -> int:
        return len(self._queue) + self._in_flight

    # ------------------------------------------------------------------ the call's side

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    def record_nowait(self, record: TelemetryRecord) -> None:
        """Enqueue without waiting; never raises. Needs to run on the event loop."""
        self._produced += 1
        if self._closed or self._degraded:
            self._dropped += 1
            if self._closed:
                self._warn.failed("recording after aclose()", None, "rows are dropped")
            return
        queue = self._queue
        if len(queue) >= self.options.queue_max:
            queue.popleft()
            self._dropped += 1
            if not self._full_warned:  # once until the writer catches up and empties it
                self._full_warned = True
                logger.warning(
                    "PostgreSQL telemetry: the queue is full (%d rows): dropping the oldest "
                    "rows (counted in .dropped)",
                    self.options.queue_max,
                )
        queue.append(record)
        if self._task is None:
            self._start()
        elif len(queue) == 1 or len(queue) >= self.options.batch_size:
            self._wake.set()  # the writer waits for a first row, then for a full batch

    async def flush(self) -> None:
        """Wait until every row recorded before this call is written or counted as dropped."""
        target = self._produced
        task = self._task
        if self._settled() >= target or task is None or task.done():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        self._wake.set()
        try:
            await future
        finally:
            if not future.done():  # this flush was cancelled
                future.cancel()
                self._waiters = [w for w in self._waiters if w[1] is not future]

    async def aclose(self) -> None:
        """Stop taking rows, write the queued ones (for at most ``close_timeout_s``), close
        the pool this recorder made. Rows still queued at the deadline are dropped (counted).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        task = self._task
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.close_timeout_s
        graceful = False
        try:
            if task is not None and not task.done():
                self._wake.set()
                done, _ = await asyncio.wait({task}, timeout=self.options.close_timeout_s)
                if not done:
                    self._warn.failed(
                        "closing",
                        None,
                        f"{self.queued} rows still unwritten after close_timeout_s="
                        f"{self.options.close_timeout_s:g}: dropped (counted in .dropped)",
                    )
                    task.cancel()
                    await asyncio.wait({task})
            graceful = True
        finally:
            if task is not None and not task.done():  # aclose itself was cancelled
                task.cancel()
            await self._close_pool(deadline - loop.time() if graceful else 0.0)

    # ------------------------------------------------------------------ the writer

    def _start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            lost = len(self._queue)
            self._queue.clear()
            self._dropped += lost
            self._warn.failed(
                "record_nowait() outside an event loop", None, "the row is dropped (counted)"
            )
            return
        self._task = loop.create_task(self._run(), name="pgw-telemetry-postgres")

    def _settled(self) -> int:
        return self._written + self._dropped

    async def _run(self) -> None:
        try:
            if await self._open():
                await self._write_until_stopped()
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave flush() waiting forever
            self._degraded = True
            logger.warning(
                "PostgreSQL telemetry: the writer stopped (%s); rows are dropped from now on",
                self._warn.describe(exc),
            )
        finally:
            # Stopped, degraded or cancelled at the close deadline: what is left is lost.
            self._dropped += self._in_flight + len(self._queue)
            self._in_flight = 0
            self._queue.clear()
            self._resolve_waiters(force=True)

    async def _open(self) -> bool:
        """The structural step: the pool, then the table. False: degraded for good."""
        options = self.options
        try:
            async with asyncio.timeout(options.connect_timeout_s + options.command_timeout_s):
                if self._pool is None:
                    self._owns_pool = True
                    self._pool = await asyncpg.create_pool(
                        self._dsn,
                        min_size=1,
                        max_size=options.pool_max_size,
                        timeout=options.connect_timeout_s,
                        command_timeout=options.command_timeout_s,
                        # Named in pg_stat_activity, unless the DSN names it already.
                        server_settings=None
                        if "application_name" in (self._dsn or "")
                        else {"application_name": APPLICATION_NAME},
                    )
                async with self._pool.acquire(timeout=options.acquire_timeout_s) as conn:
                    self.schema_version_found = await ensure_schema(
                        conn, self.schema, command_timeout_s=options.command_timeout_s
                    )
        # Whatever a bad DSN, a refused login or a missing database raises (asyncpg's errors,
        # OSError, ValueError, TimeoutError, ...), the call must never see it.
        except Exception as exc:  # noqa: BLE001
            self._degraded = True
            logger.warning(
                "PostgreSQL telemetry disabled: cannot %s (%s); rows are dropped and counted "
                "in .dropped from now on",
                "create the connection pool" if self._pool is None else "open the table",
                self._warn.describe(exc),
            )
            await self._close_pool(0.0)
            return False
        return True

    async def _write_until_stopped(self) -> None:
        queue, wake = self._queue, self._wake
        batch_size, interval = self.options.batch_size, self.options.flush_interval_s
        while True:
            if not queue:
                self._full_warned = False
                if self._stopping:
                    return
                wake.clear()
                await wake.wait()
                continue
            if len(queue) < batch_size and not (self._waiters or self._stopping):
                # Gather a fuller batch: a row waits at most about flush_interval_s.
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await wake.wait()
            count = min(batch_size, len(queue))
            batch = [queue.popleft() for _ in range(count)]
            self._in_flight = count
            await self._write(self._rows(batch))
            self._resolve_waiters()

    def _rows(self, batch: list[TelemetryRecord]) -> list[Row]:
        row_of, texts = self.schema.row_of, self.schema.text_positions
        rows = []
        for record in batch:
            row = row_of(record)
            for i in texts:
                value = row[i]
                if isinstance(value, str) and "\x00" in value:
                    row = _without_nul(row, texts)
                    break
            rows.append(row)
        return rows

    async def _write(self, rows: list[Row]) -> None:
        pool, schema, options = self._pool, self.schema, self.options
        assert pool is not None
        timeout = options.command_timeout_s
        try:
            async with (
                pool.acquire(timeout=options.acquire_timeout_s) as conn,
                conn.transaction(),
            ):
                await conn.execute(schema.create_stage(), timeout=timeout)
                await conn.copy_records_to_table(
                    schema.stage, records=_first_of_each(rows), timeout=timeout
                )
                await conn.execute(schema.merge_stage(), timeout=timeout)
        except WRITE_ERRORS as exc:
            self._warn.failed("a batch write failed", exc, "retrying its rows one by one")
            await self._write_one_by_one(pool, rows)
            return
        self._settle(written=len(rows))
        self._warn.succeeded()

    async def _write_one_by_one(self, pool: asyncpg.Pool, rows: list[Row]) -> None:
        options = self.options
        insert, timeout = self.schema.insert_row(), options.command_timeout_s
        done = wrote = 0
        try:
            async with pool.acquire(timeout=options.acquire_timeout_s) as conn:
                for row in rows:
                    try:
                        await conn.execute(insert, *row, timeout=timeout)
                    except WRITE_ERRORS as exc:
                        if isinstance(exc, _UNREACHABLE):
                            raise
                        done += 1
                        self._settle(dropped=1)
                        self._warn.failed(
                            "a row was refused", exc, "it is dropped (counted in .dropped)"
                        )
                    else:
                        done += 1
                        wrote += 1
                        self._settle(written=1)
        except WRITE_ERRORS as exc:
            lost = len(rows) - done
            self._settle(dropped=lost)
            self._warn.failed(
                "PostgreSQL is unreachable",
                exc,
                "the rows of the failed batch are dropped (counted in .dropped); the next "
                "batch tries again",
            )
            return
        if wrote:
            self._warn.succeeded()

    def _settle(self, *, written: int = 0, dropped: int = 0) -> None:
        self._written += written
        self._dropped += dropped
        self._in_flight -= written + dropped

    def _resolve_waiters(self, *, force: bool = False) -> None:
        if not self._waiters:
            return
        settled = self._settled()
        keep = []
        for target, future in self._waiters:
            if force or target <= settled:
                if not future.done():
                    future.set_result(None)
            else:
                keep.append((target, future))
        self._waiters = keep

    async def _close_pool(self, grace_s: float) -> None:
        """Close the pool this recorder made: gracefully within ``grace_s``, else at once."""
        pool, self._pool = self._pool, None
        if pool is None or not self._owns_pool:
            return
        if grace_s > 0:
            try:
                async with asyncio.timeout(grace_s):
                    await pool.close()
                return
            except WRITE_ERRORS:  # TimeoutError included
                pass
        pool.terminate()

    def __repr__(self) -> str:
        return (
            f"PostgresRecorder(table={self.schema.table!r}, queued={self.queued}, "
            f"written={self._written}, dropped={self._dropped}, degraded={self._degraded})"
        )


def _without_nul(row: Row, texts: tuple[int, ...]) -> Row:
    values = list(row)
    for i in texts:
        value = values[i]
        if isinstance(value, str):
            values[i] = value.replace("\x00", "")
    return tuple(values)


def _first_of_each(rows: list[Row]) -> list[Row]:
    """The rows without repeats of a ``call_id`` within the batch, the first one kept (as a
    replay across batches keeps the stored one)."""
    seen: set[Any] = set()
    unique = []
    for row in rows:
        key = row[0]
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


__all__ = ["APPLICATION_NAME", "WRITE_ERRORS", "PostgresRecorder"]
