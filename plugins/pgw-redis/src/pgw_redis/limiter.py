"""The shared rate limiter: six gates in one Lua script, state in Redis (M2 §2).

Semantics are the in-memory limiter's (``ports.RateLimiter``): gates in order global
concurrency -> source concurrency -> global RPM -> source RPM -> global TPM -> source TPM;
concurrency and RPM refuse at ``used >= limit``, TPM at ``used + est > limit``; 0 disables a
gate; a refusal changes nothing but dropping expired leases. What differs is where the state
lives: every process using the same Redis and scope shares it.

Time: windows and lease expiry use the Redis server's clock (``TIME`` in the scripts), never
the hosts'. The caller names the window key it expects (so every key is declared, as Redis
Cluster requires) from a local estimate of the server clock; the script refuses a wrong guess
with the server time, and the call is repeated once with the corrected window. The estimate
is learned from every reply, so the repeat happens only around minute boundaries.

Round trips: admission (``try_acquire``) and reads are one round trip each. Accounting
(``settle``, ``release``, ``mark_progress``) never raises and never waits for Redis: it is
queued and sent in one pipelined round trip, either with this limiter's next command or by a
background flush as soon as the caller yields to the event loop. A permit settled and then
released in the same turn costs one script (``release`` applies the TPM correction), and a
progress mark rides along with a release. Reads (``inflight``, ``source_stats``,
``progress_age_s``) see every write queued before them; an admission may not see a release
still on the wire, so at worst it refuses early, never admits too much. ``flush()`` (and
``aclose()``) waits until everything queued has been sent. A process that dies with writes
queued loses them; the lease TTL frees its leases, as it does after a SIGKILL.

Queued writes are never lost to someone else's trouble: when the command they ride with is
cancelled or fails (waiting for a connection, connecting, a connection lost, a timeout), they
go back to the front of the queue and the background flush sends them. Whether they ran
before the failure is often unknowable, so every accounting script is idempotent: a release
removes a lease id (twice is once), and a lease's TPM correction is applied only by the run
that records its id in the window's set of settled leases. When the background flush (or
``flush()``) fails they are kept and sent again in the background, with a backoff from
``RETRY_FIRST_S`` up to ``RETRY_MAX_S``, until they land: a compensation that is dropped leaves
a lease that nobody releases (an acquire sent before Redis froze runs when it thaws), and with
a small concurrency limit the scope would refuse every call until the lease expires. Retrying is
bounded: after ``max(RETRY_FOR_S, 2 * lease_ttl_s)`` of failures in a row the writes are dropped
with a warning (the leases expire after their TTL), and ``aclose()`` stops the retries.

Cancellation: lease ids are made here before the script is sent. If the caller is cancelled
(or the connection fails) after sending, the script may have run, or may still run (the
command can sit in the server's input while the compensation arrives on another connection).
A queued compensation therefore releases the lease and refunds its TPM pre-charge when the
lease exists, and otherwise records the id as abandoned so that the acquire, should it run
afterwards, admits nothing. redis-py drops the connection of a cancelled command, so it is
never a reply behind.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeAlias

from polygateway.errors import GovernanceBackendError
from polygateway.permits import OnceOnlyPermit
from polygateway.ports import Clock, Denial, Permit, SourceStats
from polygateway.settings import Limits
from polygateway.validation import MAX_TOKENS, check_limits, check_token_count, check_ttl
from redis.exceptions import ConnectionError as RedisConnectionError

from pgw_redis._warn import WarnOnce
from pgw_redis.connection import BACKEND_ERRORS, RedisClient, ScriptCall, ScriptClient
from pgw_redis.keys import LimiterKeys, SourceKeys
from pgw_redis.scripts import (
    ACQUIRE,
    INFLIGHT,
    PROGRESS_AGE,
    PROGRESS_MARK,
    RELEASE,
    SETTLE,
    SOURCE_STATS,
)

logger = logging.getLogger(__name__)

WINDOW_MS: Final = 60_000

GateName: TypeAlias = Literal[
    "global_concurrency",
    "source_concurrency",
    "global_rpm",
    "source_rpm",
    "global_tpm",
    "source_tpm",
]

_GATES: Final[tuple[GateName, ...]] = (
    "global_concurrency",
    "source_concurrency",
    "global_rpm",
    "source_rpm",
    "global_tpm",
    "source_tpm",
)

_WINDOW_ATTEMPTS = 3

RETRY_FIRST_S: Final = 0.05
"""First wait before queued accounting that failed is sent again (doubling from there)."""

RETRY_MAX_S: Final = 0.5
"""Longest wait between two retries: a recovered Redis gets the writes within this."""

RETRY_FOR_S: Final = 60.0
"""Least time queued accounting is retried through an outage (at least twice the lease TTL)."""
"""Tries with a corrected window id before giving up (each retry follows a minute boundary)."""


class _QueuedAccounting:
    """What is queued for one lease: a TPM correction, a release, or both (one script)."""

    __slots__ = ("compensation", "delta", "lease_id", "release", "source_keys", "window")

    def __init__(self, lease_id: str, source_keys: SourceKeys, window: int) -> None:
        self.lease_id = lease_id
        self.source_keys = source_keys
        self.window = window
        self.delta = 0
        self.release = False
        self.compensation = False

    def absorb(self, later: _QueuedAccounting) -> None:
        """Add what was queued for the same lease after this entry."""
        # A lease has one TPM correction at most (a permit settles once; a compensation is
        # for a lease no permit was made of), so the sum is that correction, and the script
        # applying it does so once even if this entry's part already ran.
        self.delta += later.delta
        self.release = self.release or later.release
        self.compensation = self.compensation or later.compensation


class _Batch:
    """Accounting taken from the queue to be sent: the entries, and their scripts."""

    __slots__ = ("calls", "entries", "progress")

    def __init__(
        self, entries: dict[str, _QueuedAccounting], progress: bool, calls: list[ScriptCall]
    ) -> None:
        self.entries = entries
        self.progress = progress
        self.calls = calls


class RedisPermit(OnceOnlyPermit):
    """One admitted attempt. ``settle`` and ``release`` act once; later calls are no-ops.

    Both only queue their write (see the module docstring), so neither waits for Redis or
    raises for backend trouble.
    """

    __slots__ = ("_lease_id", "_limiter", "_source_keys", "_window")

    def __init__(
        self,
        limiter: RedisLimiter,
        lease_id: str,
        source: str,
        source_keys: SourceKeys,
        est_tokens: int,
        window: int,
    ) -> None:
        super().__init__(source, est_tokens)
        self._limiter = limiter
        self._lease_id = lease_id
        self._source_keys = source_keys
        self._window = window

    @property
    def lease_id(self) -> str:
        return self._lease_id

    @property
    def window(self) -> int:
        """The acquire-time window id (server minutes since the epoch) that ``settle`` moves."""
        return self._window

    def _apply_settle(self, delta: int) -> None:
        self._limiter._queue(self._lease_id, self._source_keys, self._window, delta=delta)

    def _apply_release(self) -> None:
        self._limiter._queue(self._lease_id, self._source_keys, self._window, release=True)


class RedisLimiter:
    """``ports.RateLimiter`` shared through Redis by every process using the same scope.

    ``client`` is a ``redis.asyncio.Redis`` or ``RedisCluster`` (``pgw_redis.connection.
    connect``); it is closed by ``aclose()`` only when ``owns_client`` is true. ``clock``
    (default: the system clock) only seeds the estimate of the server's minute; every decision
    uses the server's time.
    """

    __slots__ = (
        "_client",
        "_closed",
        "_flush_scheduled",
        "_flush_task",
        "_global_limits",
        "_keys",
        "_lease_ttl_ms",
        "_lease_ttl_s",
        "_monotonic",
        "_now_s",
        "_offset_ms",
        "_owns_client",
        "_pending",
        "_progress_pending",
        "_retry_delay_s",
        "_retry_handle",
        "_retry_since",
        "_scope",
        "_scripts",
        "_source_keys",
        "_warn",
    )

    def __init__(
        self,
        client: RedisClient,
        *,
        scope: str,
        global_limits: Limits,
        lease_ttl_s: float,
        clock: Clock | None = None,
        owns_client: bool = False,
    ) -> None:
        check_limits(global_limits, "global_limits")
        lease_ttl_s = check_ttl(lease_ttl_s, "lease_ttl_s")
        self._client = client
        self._scripts = ScriptClient(client)
        self._scope = scope
        self._keys = LimiterKeys.for_scope(scope)
        self._global_limits = global_limits
        self._lease_ttl_s = lease_ttl_s
        self._lease_ttl_ms = max(1, round(lease_ttl_s * 1000.0))
        self._now_s: Callable[[], float] = clock.time if clock is not None else time.time
        self._monotonic: Callable[[], float] = (
            clock.monotonic if clock is not None else time.monotonic
        )
        self._retry_handle: asyncio.TimerHandle | None = None
        self._retry_since: float | None = None
        self._retry_delay_s = RETRY_FIRST_S
        self._offset_ms = 0.0
        self._owns_client = owns_client
        self._source_keys: dict[str, SourceKeys] = {}
        self._pending: dict[str, _QueuedAccounting] = {}
        self._progress_pending = False
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self._closed = False
        self._warn = WarnOnce(logger, f"Redis limiter (scope {scope!r})")

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def global_limits(self) -> Limits:
        """The scope-wide gates' limits (every client sharing this limiter shares them)."""
        return self._global_limits

    def claim_scope(self, scope: str) -> str:
        """The owner scope (this limiter's key space): another scope's sources are keyed
        ``<scope>:<name>`` inside it, so same-named sources of two roles never share a gate."""
        return self._scope

    # ------------------------------------------------------------------ admission

    async def try_acquire(
        self, source: str, est_tokens: int, source_limits: Limits
    ) -> Permit | Denial:
        if type(est_tokens) is not int or not 0 <= est_tokens <= MAX_TOKENS:
            est_tokens = check_token_count(est_tokens, "est_tokens")
        if (source_limits.max_concurrency | source_limits.rpm | source_limits.tpm) < 0:
            check_limits(source_limits, "source_limits")
        source_keys = self._keys_of(source)
        keys = self._keys
        glimits = self._global_limits
        # Made before sending, so a script that ran for a caller who never saw the reply can
        # still be released by id.
        lease_id = uuid.uuid4().hex
        window = self._guess_window()
        for _ in range(_WINDOW_ATTEMPTS):
            w = str(window)
            call = ScriptCall(
                ACQUIRE,
                (
                    keys.lease,
                    source_keys.lease,
                    keys.rpm_base + w,
                    source_keys.rpm_base + w,
                    keys.tpm_base + w,
                    source_keys.tpm_base + w,
                    keys.abandoned,
                    keys.hold,
                    source_keys.hold,
                ),
                (
                    window,
                    lease_id,
                    est_tokens,
                    self._lease_ttl_ms,
                    glimits.max_concurrency,
                    source_limits.max_concurrency,
                    glimits.rpm,
                    source_limits.rpm,
                    glimits.tpm,
                    source_limits.tpm,
                ),
            )
            try:
                reply = await self._exchange(call, "try_acquire", read=False)
            except (asyncio.CancelledError, GovernanceBackendError):
                # Cancelled or failed after the script may have run: free what it may have
                # taken (a no-op when the lease does not exist), then let the error go on.
                self._queue(lease_id, source_keys, window, delta=-est_tokens, compensate=True)
                raise
            status = int(reply[0])
            if status == 1:
                self._learn_server_time(int(reply[1]))
                return RedisPermit(self, lease_id, source, source_keys, est_tokens, window)
            if status == 0:
                return Denial(_GATES[int(reply[1]) - 1], max(0.0, int(reply[2]) / 1000.0))
            if status == -2:  # only a compensation writes this; its caller is gone
                raise GovernanceBackendError(f"lease {lease_id} was given up before admission")
            window = self._learn_server_time(int(reply[1]))
        raise GovernanceBackendError(
            f"Redis limiter (scope {self._scope!r}): the server's minute kept changing "
            f"during {_WINDOW_ATTEMPTS} admission attempts"
        )

    # ------------------------------------------------------------------ introspection

    async def source_stats(self, source: str) -> SourceStats:
        source_keys = self._keys_of(source)
        window = self._guess_window()
        for _ in range(_WINDOW_ATTEMPTS):
            w = str(window)
            call = ScriptCall(
                SOURCE_STATS,
                (source_keys.lease, source_keys.rpm_base + w, source_keys.tpm_base + w),
                (window,),
            )
            reply = await self._exchange(call, "source_stats")
            if int(reply[0]) == 1:
                return SourceStats(
                    inflight=int(reply[1]), rpm_used=int(reply[2]), tpm_used=int(reply[3])
                )
            window = self._learn_server_time(int(reply[1]))
        raise GovernanceBackendError(
            f"Redis limiter (scope {self._scope!r}): the server's minute kept changing"
        )

    async def inflight(self) -> int:
        reply = await self._exchange(ScriptCall(INFLIGHT, (self._keys.lease,), ()), "inflight")
        return int(reply)

    async def mark_progress(self) -> None:
        self._progress_pending = True
        self._schedule_flush()

    async def progress_age_s(self) -> float:
        call = ScriptCall(PROGRESS_AGE, (self._keys.progress,), ())
        age_ms = int(await self._exchange(call, "progress_age_s"))
        return math.inf if age_ms < 0 else age_ms / 1000.0

    # ------------------------------------------------------------------ lifecycle

    async def flush(self) -> None:
        """Wait until every accounting write queued so far has been sent (and answered)."""
        task = self._flush_task
        if task is not None:
            # asyncio.wait: a caller cancelled here must not cancel the flush itself.
            await asyncio.wait((task,))
        batch = self._take_queued()
        if batch is not None:
            await self._send_accounting(batch)

    async def aclose(self) -> None:
        """Send queued accounting, then close the client if this limiter owns it."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self._closed = True
            if self._retry_handle is not None:
                self._retry_handle.cancel()
                self._retry_handle = None
            if self._pending:
                self._warn.failed(
                    "accounting at close",
                    GovernanceBackendError("Redis did not answer"),
                    f"{len(self._pending)} release/settle write(s) dropped; leases expire "
                    "after their TTL",
                )
                self._pending = {}
            await self._scripts.disconnect()
            if self._owns_client:
                await self._client.aclose()

    # ------------------------------------------------------------------ internals

    def _keys_of(self, source: str) -> SourceKeys:
        keys = self._source_keys.get(source)
        if keys is None:
            keys = self._source_keys[source] = self._keys.source(source)
        return keys

    def _guess_window(self) -> int:
        return int((self._now_s() * 1000.0 + self._offset_ms) // WINDOW_MS)

    def _learn_server_time(self, server_ms: int) -> int:
        """Remember the server clock's offset; return the server's current window id."""
        self._offset_ms = server_ms - self._now_s() * 1000.0
        return server_ms // WINDOW_MS

    async def _exchange(self, call: ScriptCall, operation: str, *, read: bool = True) -> Any:
        """Run ``call`` (admission or read) behind the queued accounting, in one round trip.

        A read first waits for the accounting round trip in flight, if any, so that it sees
        every write this limiter queued before it. An admission does not wait: what it might
        miss is a release or a refund still on the wire, so at worst it refuses a little early
        (and the caller polls), it never admits too much.

        Backend failures raise ``GovernanceBackendError``: these are admission-side answers,
        and a limiter that cannot answer must not let a call through. The accounting taken
        along is not this caller's: if the exchange does not complete it is queued again.
        """
        if read and self._flush_task is not None:
            # asyncio.wait: a reader cancelled here must not cancel the flush itself.
            await asyncio.wait((self._flush_task,))
        batch = self._take_queued()
        delivered = False
        try:
            results = await self._run((call,) if batch is None else (*batch.calls, call))
            delivered = True
        except BACKEND_ERRORS as exc:
            raise GovernanceBackendError(
                f"Redis limiter (scope {self._scope!r}): {operation} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if batch is not None and not delivered:
                self._requeue(batch)
                self._schedule_flush()
        if batch is not None:
            self._delivered()
            self._check_accounting(results)
        result = results[-1]
        if isinstance(result, Exception):
            raise GovernanceBackendError(
                f"Redis limiter (scope {self._scope!r}): {operation} failed: "
                f"{type(result).__name__}: {result}"
            ) from result
        self._warn.succeeded()
        return result

    async def _run(self, calls: Sequence[ScriptCall]) -> list[Any]:
        try:
            return await self._scripts.run_many(calls)
        except RedisConnectionError:
            # A pooled connection that died with the server (restart, failover, idle kill)
            # fails once although Redis is back: one more try, on a fresh connection. Safe,
            # as every script here is idempotent (an acquire is keyed by its lease id).
            return await self._scripts.run_many(calls)

    def _queue(
        self,
        lease_id: str,
        source_keys: SourceKeys,
        window: int,
        *,
        delta: int = 0,
        release: bool = False,
        compensate: bool = False,
    ) -> None:
        entry = self._pending.get(lease_id)
        if entry is None:
            entry = self._pending[lease_id] = _QueuedAccounting(lease_id, source_keys, window)
        entry.delta += delta
        if release or compensate:
            entry.release = True
        if compensate:
            entry.compensation = True
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        # At the next turn of the loop, not now: the caller usually has more to queue, or
        # is about to send a command the queue can ride along with (then no task is made).
        # During an outage the retry timer starts the next flush (no busy loop).
        if (
            self._flush_task is None
            and not self._flush_scheduled
            and self._retry_handle is None
            and not self._closed
        ):
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    def _retry_due(self) -> None:
        self._retry_handle = None
        self._start_flush()

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        if self._flush_task is None and (self._pending or self._progress_pending):
            self._flush_task = asyncio.get_running_loop().create_task(
                self._flush_queued(), name=f"pgw-redis limiter flush ({self._scope})"
            )

    async def _flush_queued(self) -> None:
        # Runs once the caller yields: everything queued in the same turn goes in one
        # pipeline. One round per task, so a reader waiting for "the flush in flight" waits
        # one round trip; whatever was queued meanwhile goes in the next round.
        try:
            batch = self._take_queued()
            if batch is not None:
                await self._send_accounting(batch)
        finally:
            self._flush_task = None
        if self._pending or self._progress_pending:
            self._schedule_flush()

    def _take_queued(self) -> _Batch | None:
        pending = self._pending
        progress = self._progress_pending
        if not pending and not progress:
            return None
        self._pending = {}
        self._progress_pending = False
        keys = self._keys
        calls: list[ScriptCall] = []
        mark = progress
        for entry in pending.values():
            w = str(entry.window)
            window_end_s = (entry.window + 1) * (WINDOW_MS // 1000)
            source_keys = entry.source_keys
            if entry.release:
                calls.append(
                    ScriptCall(
                        RELEASE,
                        (
                            keys.lease,
                            source_keys.lease,
                            keys.tpm_base + w,
                            source_keys.tpm_base + w,
                            keys.progress,
                            keys.abandoned,
                            keys.settled_base + w,
                            keys.hold,
                            source_keys.hold,
                        ),
                        (
                            entry.lease_id,
                            entry.delta,
                            1 if entry.compensation else 0,
                            1 if mark else 0,
                            self._lease_ttl_ms,
                            window_end_s,
                        ),
                    )
                )
                mark = False  # one mark per batch is enough
            elif entry.delta:
                calls.append(
                    ScriptCall(
                        SETTLE,
                        (keys.tpm_base + w, source_keys.tpm_base + w, keys.settled_base + w),
                        (entry.delta, entry.lease_id, window_end_s),
                    )
                )
        if mark:
            calls.append(ScriptCall(PROGRESS_MARK, (keys.progress,), ()))
        return _Batch(pending, progress, calls)

    def _requeue(self, batch: _Batch) -> None:
        """Put ``batch`` back in front of what was queued since (its scripts are idempotent)."""
        entries = batch.entries
        for lease_id, later in self._pending.items():
            entry = entries.get(lease_id)
            if entry is None:
                entries[lease_id] = later
            else:
                entry.absorb(later)
        self._pending = entries
        self._progress_pending = self._progress_pending or batch.progress

    async def _send_accounting(self, batch: _Batch) -> None:
        try:
            results = await self._run(batch.calls)
        except BACKEND_ERRORS as exc:
            self._retry_later(batch, exc)
            return
        except asyncio.CancelledError:
            # Whoever sent it is going away (a cancelled flush(), the loop shutting down):
            # keep it for this limiter's next command or flush rather than lose it.
            self._requeue(batch)
            raise
        self._delivered()
        self._check_accounting(results)

    def _retry_later(self, batch: _Batch, exc: BaseException) -> None:
        """Keep a batch that Redis did not take and send it again after a backoff, unless the
        limiter is closed or the outage outlasted the retry bound (then drop it, warned)."""
        now = self._monotonic()
        if self._retry_since is None:
            self._retry_since = now
        bound_s = max(RETRY_FOR_S, 2.0 * self._lease_ttl_s)
        if self._closed or now - self._retry_since > bound_s:
            self._warn.failed(
                "accounting", exc, "release/settle/progress dropped; leases expire after their TTL"
            )
            self._retry_since = None
            self._retry_delay_s = RETRY_FIRST_S
            return
        self._warn.failed("accounting", exc, "kept and sent again until Redis takes it")
        self._requeue(batch)
        if self._retry_handle is None:
            delay = self._retry_delay_s
            self._retry_delay_s = min(RETRY_MAX_S, delay * 2.0)
            self._retry_handle = asyncio.get_running_loop().call_later(delay, self._retry_due)

    def _delivered(self) -> None:
        """Redis took queued accounting: the next outage starts its backoff afresh."""
        self._retry_since = None
        self._retry_delay_s = RETRY_FIRST_S

    def _check_accounting(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, Exception):
                self._warn.failed("accounting", result, "one release/settle/progress dropped")
                return
        self._warn.succeeded()

    def __repr__(self) -> str:
        return (
            f"RedisLimiter(scope={self._scope!r}, global_limits={self._global_limits!r}, "
            f"lease_ttl_s={self._lease_ttl_s!r})"
        )
