"""The limiter's batches under faults, on a real Redis: a backlog of accounting after an
outage, admissions that never reached Redis, ``flush()`` and ``aclose()`` racing batches in
flight, batch failures reaching every caller (each with an exception of its own), and the
batch task's context.

Server-side counts come from ``INFO`` of a Redis this suite runs itself; operations per
script call are counted on their way to it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from pgw_redis.breaker import RedisGate
from pgw_redis.connection import ScriptCall, ScriptClient, connect
from pgw_redis.limiter import MAX_BATCH_ACCOUNTING, MAX_BATCH_ADMISSIONS, RedisLimiter
from pgw_redis.scripts import BATCH, BATCH_ARG_COUNTS
from pgw_redis_test_helpers import RedisServer, wait_until
from polygateway.errors import GovernanceBackendError
from polygateway.ports import Denial, Permit
from polygateway.settings import Limits
from redis.asyncio import Redis

pytestmark = pytest.mark.redis

NO_LIMITS = Limits()

GUARD_S = 30.0
"""Bound on waits that must end by themselves: a hang fails the test instead of stalling it."""


@pytest.fixture
async def admin(spare_redis: RedisServer) -> AsyncIterator[Any]:
    client = Redis.from_url(spare_redis.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


def _limiter(url: str, limits: Limits = NO_LIMITS, scope: str = "S") -> RedisLimiter:
    return RedisLimiter(
        connect(url), scope=scope, global_limits=limits, lease_ttl_s=30.0, owns_client=True
    )


async def _script_calls(admin: Any) -> int:
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def _blocked_clients(admin: Any) -> int:
    return int((await admin.info("clients")).get("blocked_clients", 0))


async def _connected_clients(admin: Any) -> int:
    return int((await admin.info("clients"))["connected_clients"])


# --------------------------------------------------------------------------- R1: backlog


def _operations(call: ScriptCall) -> int:
    """Operations in one call of the BATCH script (each: code, its arguments, where its keys
    start)."""
    args, count, at = call.args, 0, 0
    while at < len(args):
        at += 2 + BATCH_ARG_COUNTS[int(args[at])]
        count += 1
    return count


async def test_a_backlog_of_releases_goes_in_bounded_script_calls_next_to_admissions(
    spare_redis: RedisServer, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = _limiter(spare_redis.url)
    sizes: list[int] = []
    original = ScriptClient.run_many

    async def counting(self: ScriptClient, calls: Sequence[ScriptCall]) -> list[Any]:
        sizes.extend(_operations(call) for call in calls if call.script is BATCH)
        return await original(self, calls)

    try:
        permits: list[Permit] = []
        for _ in range(20):
            results = await asyncio.gather(
                *(limiter.try_acquire("a", 1, NO_LIMITS) for _ in range(250))
            )
            permits.extend(r for r in results if isinstance(r, Permit))
        assert len(permits) == 5000
        await limiter.flush()
        monkeypatch.setattr(ScriptClient, "run_many", counting)
        # Writes paused: the 5000 releases pile up as an outage would leave them.
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            for permit in permits:
                await permit.release()
            await wait_until(lambda: _at_least_blocked(admin, 1))  # the first piece
            admission = asyncio.create_task(limiter.try_acquire("a", 1, NO_LIMITS))
            await wait_until(lambda: _at_least_blocked(admin, 2))  # beside it, not behind
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        async with asyncio.timeout(GUARD_S):
            permit = await admission
            await limiter.flush()
        assert isinstance(permit, Permit)
        assert sum(sizes) == 5000 + 1  # every release and the admission, each sent once
        # No call carried more than one piece of the backlog, the admission's included.
        assert max(sizes) <= MAX_BATCH_ACCOUNTING + MAX_BATCH_ADMISSIONS
        assert len(sizes) >= 5000 // MAX_BATCH_ACCOUNTING
        assert await limiter.inflight() == 1  # every release landed; the new permit holds
        await permit.release()
    finally:
        await limiter.aclose()


async def test_admissions_that_never_reached_redis_leave_nothing_to_undo(
    spare_redis: RedisServer, admin: Any
) -> None:
    spare_redis.stop()
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=1))
    gate = RedisGate(
        connect(spare_redis.url), scope="S", fail_threshold=1, cooldown_s=30.0,
        probe_ttl_s=30.0, owns_client=True,
    )  # fmt: skip
    try:
        results = await asyncio.gather(
            *(limiter.try_acquire("a", 1, NO_LIMITS) for _ in range(5)),
            *(limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS) for _ in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(r, GovernanceBackendError) for r in results), results
        spare_redis.start()  # a fresh server: its counters start at zero
        await limiter.flush()
        await gate.aclose()  # waits for any probe hand-back
        # Refused connections: no script could have run, so no compensation was queued
        # (none sent now, none kept for the retries).
        assert await _script_calls(admin) == 0
        assert await limiter.inflight() == 0
        permit = await limiter.try_acquire("a", 1, NO_LIMITS)
        assert isinstance(permit, Permit)
        await permit.release()
    finally:
        await limiter.aclose()
        await gate.aclose()


# --------------------------------------------------------------------------- R2: flush, aclose


async def test_flush_waits_for_writes_queued_behind_a_batch_in_flight(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url)
    other = _limiter(spare_redis.url)
    try:
        first = await limiter.try_acquire("a", 1, NO_LIMITS)
        assert isinstance(first, Permit)
        await limiter.flush()
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            admission = asyncio.create_task(limiter.try_acquire("a", 1, NO_LIMITS))
            await wait_until(lambda: _at_least_blocked(admin, 1))
            await first.release()  # queued while the admission's batch is on the wire
            flushed = asyncio.create_task(limiter.flush())
            await asyncio.sleep(0)  # flush() has started
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        async with asyncio.timeout(GUARD_S):
            await flushed
        # Nothing queued before flush() is still on its way, and the release has landed.
        assert not limiter._flush_tasks
        assert await other.inflight() == 1
        second = await admission
        assert isinstance(second, Permit)
        await second.release()
    finally:
        await limiter.aclose()
        await other.aclose()


async def test_aclose_refuses_new_admissions_and_leaves_no_batch_lease_or_connection(
    spare_redis: RedisServer, admin: Any
) -> None:
    baseline = await _connected_clients(admin)
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=1))
    permit = await limiter.try_acquire("a", 1, NO_LIMITS)
    assert isinstance(permit, Permit)
    await limiter.flush()
    await permit.release()  # queued: aclose() has something to send
    closing = asyncio.create_task(limiter.aclose())
    await asyncio.sleep(0)  # aclose() has started and waits for Redis
    with pytest.raises(GovernanceBackendError, match="closed"):
        await limiter.try_acquire("a", 1, NO_LIMITS)
    async with asyncio.timeout(GUARD_S):
        await closing
    assert not limiter._flush_tasks
    await wait_until(lambda: _connected_clients_are(admin, baseline))
    other = _limiter(spare_redis.url, Limits(max_concurrency=1))
    try:
        assert await other.inflight() == 0
    finally:
        await other.aclose()


async def test_a_read_cut_by_aclose_leaves_no_connection_behind(
    spare_redis: RedisServer, admin: Any
) -> None:
    baseline = await _connected_clients(admin)
    limiter = _limiter(spare_redis.url)
    await limiter.inflight()  # scripts loaded, one connection made
    await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
    try:
        read = asyncio.create_task(limiter.inflight())
        await wait_until(lambda: _at_least_blocked(admin, 1))
        await limiter.aclose()  # cuts the read's connection
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
    # Redis answers again: still, the read's retry must not open a connection (that nobody
    # would close) on a closed limiter.
    with pytest.raises(GovernanceBackendError):
        async with asyncio.timeout(GUARD_S):
            await read
    await wait_until(lambda: _connected_clients_are(admin, baseline))


# --------------------------------------------------------------------------- R3, R4: failures


async def test_each_caller_of_a_failed_batch_gets_an_exception_of_its_own(
    spare_redis: RedisServer,
) -> None:
    limiter = _limiter(spare_redis.url)
    try:
        await limiter.inflight()
        spare_redis.stop()

        async def call(name: str) -> BaseException:
            try:
                await limiter.try_acquire(name, 1, NO_LIMITS)
            except GovernanceBackendError as exc:
                exc.add_note(f"while serving {name}")
                await asyncio.sleep(0)  # the other caller handles its error meanwhile
                return exc
            raise AssertionError("admitted by a stopped Redis")

        errors = await asyncio.gather(*(call(f"request-{i}") for i in range(3)))
        assert len({id(e) for e in errors}) == 3
        assert len({str(e) for e in errors}) == 1
        assert {type(e.__cause__) for e in errors} == {type(errors[0].__cause__)}
        assert errors[0].__cause__ is not None
        assert [e.__notes__ for e in errors] == [[f"while serving request-{i}"] for i in range(3)]
    finally:
        await limiter.aclose()


def _short_batch_replies(original: Any) -> Any:
    async def run_many(self: ScriptClient, calls: Sequence[ScriptCall]) -> list[Any]:
        results: list[Any] = await original(self, calls)
        return [
            r[:-1] if call.script is BATCH and isinstance(r, list) else r
            for call, r in zip(calls, results, strict=True)
        ]

    return run_many


async def test_a_batch_reply_one_entry_short_fails_every_caller(
    spare_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = _limiter(spare_redis.url)
    try:
        await limiter.inflight()
        monkeypatch.setattr(ScriptClient, "run_many", _short_batch_replies(ScriptClient.run_many))
        async with asyncio.timeout(GUARD_S):
            results = await asyncio.gather(
                *(limiter.try_acquire("a", 1, NO_LIMITS) for _ in range(4)),
                return_exceptions=True,
            )
        assert all(isinstance(r, GovernanceBackendError) for r in results), results
        assert isinstance(results[0].__cause__, ValueError)
        monkeypatch.undo()
        # The scripts ran: the callers' compensations free the leases they took.
        await limiter.flush()
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()


async def test_an_unexpected_error_in_a_batch_reaches_its_callers_and_keeps_the_accounting(
    spare_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = _limiter(spare_redis.url)
    try:
        permit = await limiter.try_acquire("a", 1, NO_LIMITS)
        assert isinstance(permit, Permit)
        await limiter.flush()
        original = ScriptClient.run_many

        async def broken(self: ScriptClient, calls: Sequence[ScriptCall]) -> list[Any]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

        monkeypatch.setattr(ScriptClient, "run_many", broken)
        await permit.release()  # queued: rides in front of the admissions
        async with asyncio.timeout(GUARD_S):
            results = await asyncio.gather(
                *(limiter.try_acquire("a", 1, NO_LIMITS) for _ in range(3)),
                return_exceptions=True,
            )
        assert all(isinstance(r, GovernanceBackendError) for r in results), results
        assert isinstance(results[0].__cause__, UnicodeDecodeError)
        monkeypatch.setattr(ScriptClient, "run_many", original)
        async with asyncio.timeout(GUARD_S):
            await limiter.flush()
        # The release was kept and sent; the failed admissions were compensated.
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()


# --------------------------------------------------------------------------- R5: context

REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("REQUEST")


async def test_the_batch_runs_in_a_context_of_its_own(
    spare_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    limiter = _limiter(spare_redis.url)
    seen: list[str | None] = []
    original = ScriptClient.run_many

    async def recording(self: ScriptClient, calls: Sequence[ScriptCall]) -> list[Any]:
        if any(call.script is BATCH for call in calls):
            seen.append(REQUEST.get(None))
        return await original(self, calls)

    monkeypatch.setattr(ScriptClient, "run_many", recording)

    async def call(name: str) -> Permit | Denial:
        REQUEST.set(name)
        return await limiter.try_acquire("a", 1, NO_LIMITS)

    try:
        permits = await asyncio.gather(call("request-A"), call("request-B"))
        assert seen and all(value is None for value in seen), seen
        for permit in permits:
            assert isinstance(permit, Permit)
            await permit.release()
        await limiter.flush()
    finally:
        await limiter.aclose()


async def _at_least_blocked(admin: Any, count: int) -> bool:
    return await _blocked_clients(admin) >= count


async def _connected_clients_are(admin: Any, count: int) -> bool:
    return await _connected_clients(admin) == count
