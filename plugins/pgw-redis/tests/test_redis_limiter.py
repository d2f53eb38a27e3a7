"""The Redis limiter beyond the contract: keys, TTLs, round trips, sharing, cancellation,
outages and clock skew, on a real Redis (the machine's, or one this suite starts)."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pgw_redis.connection import connect
from pgw_redis.keys import LimiterKeys, encode_name, gate_key, scope_tag
from pgw_redis.limiter import RedisLimiter, RedisPermit
from pgw_redis.testing import (
    RedisGovernanceBackend,
    counting_client,
    make_governance_backend,
    scope_keys,
)
from pgw_redis_test_helpers import (
    RedisProxy,
    RedisServer,
    free_port,
    gateway_settings,
    scope_snapshot,
    wait_until,
)
from polygateway.errors import GovernanceBackendError
from polygateway.ports import Denial, Permit, SourceStats
from polygateway.settings import Limits
from redis.asyncio import Redis
from redis.crc import key_slot

pytestmark = pytest.mark.redis

NO_LIMITS = Limits()
ODD_NAMES = (
    "a",
    "a:b",
    "a:b:c",
    "{a}",
    "a}",
    "{",
    "}",
    "a b",
    "line\nbreak",
    "源-1",
    "%7B",
    "%",
    "",
)


@pytest.fixture
async def backend(redis_url: str, unique_scope: str) -> AsyncIterator[RedisGovernanceBackend]:
    made = make_governance_backend(redis_url, unique_scope)
    try:
        yield made
    finally:
        await made.cleanup()


async def _admit(
    limiter: RedisLimiter, source: str, est: int = 0, limits: Limits = NO_LIMITS
) -> Permit:
    result = await limiter.try_acquire(source, est, limits)
    assert not isinstance(result, Denial), result
    return result


async def _refuse(
    limiter: RedisLimiter, source: str, est: int = 0, limits: Limits = NO_LIMITS
) -> Denial:
    result = await limiter.try_acquire(source, est, limits)
    assert isinstance(result, Denial), result
    return result


async def _window_headroom(client: Any, need_s: float) -> None:
    """Keep a test that counts per minute clear of the next boundary (server clock)."""
    seconds, micros = await client.time()
    left = 60.0 - (seconds % 60 + micros / 1e6)
    if left < need_s:
        await asyncio.sleep(left + 0.05)


# --------------------------------------------------------------------------- keys


def test_every_key_of_a_scope_hashes_to_one_slot_whatever_the_names() -> None:
    for scope in (n for n in ODD_NAMES if n):
        keys = LimiterKeys.for_scope(scope)
        names = [
            keys.lease,
            keys.rpm_base + "1",
            keys.tpm_base + "1",
            keys.progress,
            keys.abandoned,
        ]
        for source in (n for n in ODD_NAMES if n):
            source_keys = keys.source(source)
            names += [source_keys.lease, source_keys.rpm_base + "1", source_keys.tpm_base + "1"]
            names.append(gate_key(scope_tag(scope), source))
        assert len({key_slot(name.encode()) for name in names}) == 1, scope
        for name in names:
            # Exactly one tag, the scope's: nothing in a name can open or close another one.
            assert name.count("{") == 1 and name.count("}") == 1, name
            assert name.index("{") < name.index("}")


def test_encoded_names_are_distinct_and_delimiter_free() -> None:
    names = [n for n in ODD_NAMES if n]
    encoded = [encode_name(n, "name") for n in names]
    assert len(set(encoded)) == len(names)
    for value in encoded:
        assert not set(value) & set("{}: \n"), value
    keys = LimiterKeys.for_scope("s")
    leases = {keys.source(n).lease for n in names}
    assert len(leases) == len(names)


@pytest.mark.parametrize("bad", ["", None, 1])
def test_unusable_names_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="scope"):
        LimiterKeys.for_scope(bad)
    with pytest.raises(ValueError, match="source"):
        LimiterKeys.for_scope("s").source(bad)


async def test_empty_source_name_is_refused_before_any_state(
    backend: RedisGovernanceBackend,
) -> None:
    limiter = backend.make_limiter(global_limits=NO_LIMITS, lease_ttl_s=30.0)
    with pytest.raises(ValueError, match="source name"):
        await limiter.try_acquire("", 1, NO_LIMITS)
    assert await backend.scope_keys() == []


# --------------------------------------------------------------------------- TTLs, snapshots


async def test_no_key_is_ever_left_without_a_ttl(
    backend: RedisGovernanceBackend, raw_redis: Any
) -> None:
    await _window_headroom(raw_redis, 5.0)  # a minute's settled set expires at its end
    limiter = backend.make_limiter(global_limits=Limits(tpm=10_000), lease_ttl_s=30.0)
    gate = backend.make_breaker(fail_threshold=2, cooldown_s=5.0, probe_ttl_s=10.0)
    for name in ("a", "{b}:c", "源"):
        permit = await _admit(limiter, name, 100, Limits(max_concurrency=5, rpm=5, tpm=500))
        await permit.release()
        await permit.settle(40)  # after release: a settle of its own
        held = await _admit(limiter, name, 10)
        await held.settle(0)
        await _refuse(limiter, name, 1000, Limits(tpm=500))
        decision = await gate.try_enter(name)
        await gate.record_failure(decision)
        await gate.record_failure(decision)
    await limiter.mark_progress()
    await gate.force_open("never-seen")
    await limiter.flush()
    keys = await backend.scope_keys()
    assert len(keys) >= 15, keys
    for key in keys:
        ttl = await raw_redis.pttl(key)
        assert ttl > 0, f"{key} has PTTL {ttl}"


@pytest.mark.parametrize(
    "gate",
    [
        "global_concurrency",
        "source_concurrency",
        "global_rpm",
        "source_rpm",
        "global_tpm",
        "source_tpm",
    ],
)
async def test_a_refusal_changes_no_key(
    backend: RedisGovernanceBackend, raw_redis: Any, gate: str
) -> None:
    await _window_headroom(raw_redis, 5.0)
    global_limits = Limits(
        max_concurrency=1 if gate == "global_concurrency" else 100,
        rpm=1 if gate == "global_rpm" else 100,
        tpm=10 if gate == "global_tpm" else 10_000,
    )
    source_limits = Limits(
        max_concurrency=1 if gate == "source_concurrency" else 100,
        rpm=1 if gate == "source_rpm" else 100,
        tpm=10 if gate == "source_tpm" else 10_000,
    )
    limiter = backend.make_limiter(global_limits=global_limits, lease_ttl_s=60.0)
    await _admit(limiter, "a", 10, source_limits)
    await limiter.flush()
    before = await scope_snapshot(raw_redis, await backend.scope_keys())
    for _ in range(3):
        assert (await _refuse(limiter, "a", 5, source_limits)).gate == gate
    await limiter.flush()
    assert await scope_snapshot(raw_redis, await backend.scope_keys()) == before


async def test_stats_clamp_a_negative_tpm_counter_and_the_counter_keeps_its_ttl(
    backend: RedisGovernanceBackend, raw_redis: Any
) -> None:
    await _window_headroom(raw_redis, 5.0)
    limiter = backend.make_limiter(global_limits=NO_LIMITS, lease_ttl_s=30.0)
    permit = await _admit(limiter, "a", 100)
    tpm_keys = [k for k in await backend.scope_keys() if ":tpm:" in k]
    assert len(tpm_keys) == 2
    await raw_redis.delete(*tpm_keys)  # as if the counters had expired or Redis restarted
    await permit.settle(0)
    assert (await limiter.source_stats("a")).tpm_used == 0
    for key in tpm_keys:
        assert await raw_redis.get(key) == "-100"
        assert 0 < await raw_redis.ttl(key) <= 120


# --------------------------------------------------------------------------- round trips


async def test_settle_release_and_progress_cost_one_script_in_one_round_trip(
    spare_redis: RedisServer,
) -> None:
    client, trips = counting_client(spare_redis.url)
    admin = Redis.from_url(spare_redis.url, decode_responses=True)
    limiter = RedisLimiter(
        client, scope="S", global_limits=Limits(max_concurrency=4), lease_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip
    try:
        permit = await _admit(limiter, "a", 100)
        await admin.config_resetstat()
        trips.count = 0
        await permit.settle(30)
        await permit.release()
        await limiter.mark_progress()
        await limiter.flush()
        assert trips.count == 1
        stats = await admin.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert await limiter.source_stats("a") == SourceStats(inflight=0, rpm_used=1, tpm_used=30)
        assert await limiter.progress_age_s() < 5.0
    finally:
        await limiter.aclose()
        await admin.aclose()


async def test_queued_accounting_rides_with_the_next_command(
    redis_url: str, unique_scope: str
) -> None:
    client, trips = counting_client(redis_url)
    limiter = RedisLimiter(
        client, scope=unique_scope, global_limits=Limits(max_concurrency=1), lease_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip
    try:
        permit = await _admit(limiter, "a")
        trips.count = 0
        await permit.release()
        # Same turn, no yield: the release goes in front of the acquire, in one pipeline.
        again = await _admit(limiter, "a")
        assert trips.count == 1
        await again.release()
        await limiter.flush()
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()
        await _delete_scope(redis_url, unique_scope)


async def _delete_scope(url: str, scope: str) -> None:
    client = connect(url)
    try:
        keys = await scope_keys(client, scope)
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- two pools


async def test_two_pools_share_global_concurrency_rpm_and_progress(
    backend: RedisGovernanceBackend, raw_redis: Any
) -> None:
    await _window_headroom(raw_redis, 5.0)
    limits = Limits(max_concurrency=2, rpm=3)
    one = backend.make_limiter(global_limits=limits, lease_ttl_s=30.0)
    two = backend.make_limiter(global_limits=limits, lease_ttl_s=30.0)  # its own connection pool
    held = await _admit(one, "a")
    await _admit(two, "b")
    assert (await _refuse(one, "c")).gate == "global_concurrency"
    assert (await _refuse(two, "c")).gate == "global_concurrency"
    assert await one.inflight() == await two.inflight() == 2
    await held.release()
    await one.flush()
    await (await _admit(two, "c")).release()  # the slot freed through one is seen by two
    await two.flush()
    # Three requests taken in this window (a, b, c): the RPM gate is full for both.
    assert (await _refuse(one, "d")).gate == "global_rpm"
    assert (await _refuse(two, "d")).gate == "global_rpm"
    assert await two.progress_age_s() == math.inf
    await one.mark_progress()
    await one.flush()
    assert 0.0 <= await two.progress_age_s() < 5.0


# --------------------------------------------------------------------------- cancellation


async def _blocked_clients(admin: Any) -> int:
    info = await admin.info("clients")
    return int(info["blocked_clients"])


async def test_an_acquire_cancelled_after_sending_leaves_no_lease(spare_redis: RedisServer) -> None:
    admin = Redis.from_url(spare_redis.url, decode_responses=True)
    limiter = RedisLimiter(
        connect(spare_redis.url), scope="S", global_limits=Limits(max_concurrency=1),
        lease_ttl_s=60.0, owns_client=True,
    )  # fmt: skip
    try:
        await (await _admit(limiter, "a", 10)).release()  # scripts loaded, connection warm
        await limiter.flush()
        # Hold every script on the server: the acquire below is sent and then waits there.
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            task = asyncio.create_task(limiter.try_acquire("a", 10, NO_LIMITS))
            await wait_until(lambda: _blocked_clients(admin))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        await limiter.flush()
        assert await admin.zcard("pgw:limit:{S}:global:lease") == 0
        assert await limiter.inflight() == 0
        assert (await limiter.source_stats("a")).tpm_used == 10  # the first permit's only
        # The pool is in sync: the single slot is free and answers come back in order.
        permit = await _admit(limiter, "a", 5, Limits(max_concurrency=1))
        assert (await _refuse(limiter, "a", 5, Limits(max_concurrency=1))).gate == (
            "global_concurrency"
        )
        await permit.release()
    finally:
        await limiter.aclose()
        await admin.aclose()


async def test_cancelled_calls_through_the_client_leave_no_lease(
    redis_url: str, unique_scope: str, fake_upstream: Any, raw_redis: Any
) -> None:
    from polygateway import GatewayClient
    from polygateway.testing import Reply

    fake_upstream.set_default("a", Reply.ok(first_token_delay=10.0))
    settings = gateway_settings(
        fake_upstream.base_url("a"),
        redis_url,
        unique_scope,
        global_limits=Limits(max_concurrency=20),
    )
    client = GatewayClient(settings)
    try:
        tasks = [
            asyncio.create_task(client.chat([{"role": "user", "content": f"hi {i}"}]))
            for i in range(10)
        ]
        await fake_upstream.wait_for_requests(10, source="a", timeout=10.0)
        lease_key = f"pgw:limit:{scope_tag(unique_scope)}:global:lease"
        assert await raw_redis.zcard(lease_key) == 10
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
    finally:
        await client.aclose()  # flushes the queued releases
    assert await raw_redis.zcard(lease_key) == 0
    await _delete_scope(redis_url, unique_scope)


# --------------------------------------------------------------------------- queued accounting
# Accounting queued by earlier calls rides with the next admission. Whatever becomes of that
# admission (cancelled, failed, its connection lost), the accounting must still reach Redis,
# and exactly once.


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[RedisProxy]:
    made = RedisProxy(6379)
    await made.start()
    try:
        yield made
    finally:
        await made.aclose()


def _proxied_limiter(proxy: RedisProxy, scope: str, **options: Any) -> RedisLimiter:
    return RedisLimiter(
        connect(proxy.url(db=3), **options), scope=scope,
        global_limits=Limits(max_concurrency=10), lease_ttl_s=60.0, owns_client=True,
    )  # fmt: skip


async def _settle_release_then_acquire(
    limiter: RedisLimiter, permits: list[Permit]
) -> Permit | Denial:
    # No await in front of try_acquire yields: the admission takes all of this accounting.
    for permit in permits:
        await permit.settle(10)
        await permit.release()
    return await limiter.try_acquire("a", 100, NO_LIMITS)


async def test_an_admission_cancelled_waiting_for_a_connection_keeps_the_queued_accounting(
    proxy: RedisProxy, redis_url: str, unique_scope: str, raw_redis: Any
) -> None:
    await _window_headroom(raw_redis, 3.0)
    limiter = _proxied_limiter(proxy, unique_scope, max_connections=1)
    try:
        permits = [await _admit(limiter, "a", 100) for _ in range(3)]
        proxy.hold_replies()
        reader = asyncio.create_task(limiter.inflight())  # holds the one connection
        await proxy.replies_held.wait()
        task = asyncio.create_task(_settle_release_then_acquire(limiter, permits))
        await asyncio.sleep(0)  # one turn: it queues, takes the queue, waits for the connection
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.forward_replies()
        assert await reader == 3
        await limiter.flush()
        assert await limiter.inflight() == 0
        assert await raw_redis.zcard(f"pgw:limit:{{{unique_scope}}}:global:lease") == 0
        assert await limiter.source_stats("a") == SourceStats(inflight=0, rpm_used=3, tpm_used=30)
    finally:
        await limiter.aclose()
        await _delete_scope(redis_url, unique_scope)


@pytest.mark.parametrize("redis_back", [True, False], ids=["admitted", "failed"])
async def test_a_lost_connection_under_an_admission_keeps_the_queued_accounting(
    proxy: RedisProxy, redis_url: str, unique_scope: str, raw_redis: Any, redis_back: bool
) -> None:
    await _window_headroom(raw_redis, 3.0)
    limiter = _proxied_limiter(proxy, unique_scope)
    try:
        permits = [await _admit(limiter, "a", 100) for _ in range(3)]
        proxy.cut_connections()  # the pooled connection dies (failover, restart, idle kill)
        if redis_back:  # the fresh connection of the second try works
            again = await _settle_release_then_acquire(limiter, permits)
            assert isinstance(again, RedisPermit)
        else:  # it fails too: so does the admission
            proxy.refuse = True
            with pytest.raises(GovernanceBackendError):
                await _settle_release_then_acquire(limiter, permits)
            proxy.refuse = False
        await limiter.flush()
        assert await limiter.inflight() == (1 if redis_back else 0)
        assert (await limiter.source_stats("a")).tpm_used == 30 + (100 if redis_back else 0)
    finally:
        await limiter.aclose()
        await _delete_scope(redis_url, unique_scope)


async def test_accounting_resent_after_a_lost_reply_applies_once(
    proxy: RedisProxy, redis_url: str, unique_scope: str, raw_redis: Any
) -> None:
    await _window_headroom(raw_redis, 3.0)
    limiter = _proxied_limiter(proxy, unique_scope)
    try:
        released = await _admit(limiter, "a", 10)
        kept = await _admit(limiter, "a", 10)
        proxy.drop_replies = True

        async def account_then_acquire() -> Permit | Denial:
            await released.settle(100)  # settle and release: one release script
            await released.release()
            await kept.settle(50)  # settle alone: a settle script
            return await limiter.try_acquire("a", 5, NO_LIMITS)

        task = asyncio.create_task(account_then_acquire())
        await proxy.replies_dropped.wait()  # Redis ran the whole pipeline; no reply arrives
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.drop_replies = False
        await limiter.flush()  # sends the same accounting again, and the compensation
        assert await limiter.inflight() == 1
        assert (await limiter.source_stats("a")).tpm_used == 100 + 50
    finally:
        await limiter.aclose()
        await _delete_scope(redis_url, unique_scope)


# --------------------------------------------------------------------------- outages, faults


async def test_calls_fail_closed_during_an_outage_and_succeed_after_a_restart(
    spare_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    from pgw_redis.breaker import RedisGate

    limiter = RedisLimiter(
        connect(spare_redis.url, socket_timeout_s=1.0, connect_timeout_s=1.0), scope="S",
        global_limits=Limits(max_concurrency=5), lease_ttl_s=30.0, owns_client=True,
    )  # fmt: skip
    gate = RedisGate(
        connect(spare_redis.url, socket_timeout_s=1.0, connect_timeout_s=1.0), scope="S",
        fail_threshold=3, cooldown_s=5.0, probe_ttl_s=10.0, owns_client=True,
    )  # fmt: skip
    try:
        held = await _admit(limiter, "a", 10)
        decision = await gate.try_enter("a")
        assert decision.allowed

        spare_redis.stop()
        started = time.monotonic()
        with pytest.raises(GovernanceBackendError):
            await limiter.try_acquire("a", 10, NO_LIMITS)
        with pytest.raises(GovernanceBackendError):
            await gate.try_enter("a")
        with pytest.raises(GovernanceBackendError):
            await limiter.progress_age_s()
        with pytest.raises(GovernanceBackendError):
            await gate.retry_after_s(["a"])
        assert time.monotonic() - started < 5.0  # refused connections fail fast
        with caplog.at_level(logging.WARNING, logger="pgw_redis"):
            await held.settle(20)
            await held.release()  # accounting side: a warning, never an exception
            await limiter.mark_progress()
            await limiter.flush()
            await gate.release_probe(decision)
        assert any("accounting failed" in r.getMessage() for r in caplog.records)

        spare_redis.start()  # same port, empty: no state, no scripts
        permit = await _admit(limiter, "a", 10)  # NOSCRIPT -> scripts loaded again
        assert (await gate.try_enter("a")).allowed
        assert await limiter.inflight() == 1
        await permit.release()
        await limiter.flush()
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()
        await gate.aclose()


async def test_script_flush_then_the_next_acquire_succeeds(spare_redis: RedisServer) -> None:
    admin = Redis.from_url(spare_redis.url, decode_responses=True)
    limiter = RedisLimiter(
        connect(spare_redis.url), scope="S", global_limits=NO_LIMITS, lease_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip
    try:
        first = await _admit(limiter, "a", 1)
        await admin.script_flush()
        second = await _admit(limiter, "a", 1)
        # A pipeline after the flush: every script in it misses alike and is repeated in order.
        await first.release()
        await admin.script_flush()
        assert await limiter.inflight() == 1
        await second.release()
        await limiter.mark_progress()
        await admin.script_flush()
        await limiter.flush()
        assert await limiter.inflight() == 0
        assert await limiter.progress_age_s() < 5.0
    finally:
        await limiter.aclose()
        await admin.aclose()


async def test_a_black_holed_redis_fails_within_the_socket_timeout() -> None:
    """A server that accepts connections and never answers: bounded latency, fail closed."""
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limiter = RedisLimiter(
        connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3, connect_timeout_s=0.3),
        scope="S", global_limits=NO_LIMITS, lease_ttl_s=30.0, owns_client=True,
    )  # fmt: skip
    try:
        started = time.monotonic()
        with pytest.raises(GovernanceBackendError, match="Timeout"):
            await limiter.try_acquire("a", 1, NO_LIMITS)
        assert time.monotonic() - started < 2.0
        # Later calls carry queued accounting (the compensation of the failed acquire) ahead
        # of their own script: at most two socket timeouts, as the README says.
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(GovernanceBackendError, match="Timeout"):
                await limiter.try_acquire("a", 1, NO_LIMITS)
            assert time.monotonic() - started < 2 * 0.3 + 0.7
    finally:
        await limiter.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_refused_connection_fails_closed_at_once() -> None:
    limiter = RedisLimiter(
        connect(f"redis://127.0.0.1:{free_port()}/0"), scope="S", global_limits=NO_LIMITS,
        lease_ttl_s=30.0, owns_client=True,
    )  # fmt: skip
    try:
        started = time.monotonic()
        with pytest.raises(GovernanceBackendError) as caught:
            await limiter.try_acquire("a", 1, NO_LIMITS)
        assert time.monotonic() - started < 2.0
        assert "try_acquire" in str(caught.value)
    finally:
        await limiter.aclose()


# --------------------------------------------------------------------------- clocks, processes


class _SkewedClock:
    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time() + self.skew_s

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@pytest.mark.parametrize("skew_s", [-90.0, 61.0])
async def test_a_skewed_host_clock_changes_no_decision(
    redis_url: str, unique_scope: str, raw_redis: Any, skew_s: float
) -> None:
    await _window_headroom(raw_redis, 5.0)
    skewed = RedisLimiter(
        connect(redis_url), scope=unique_scope, global_limits=Limits(rpm=2), lease_ttl_s=30.0,
        clock=_SkewedClock(skew_s), owns_client=True,
    )  # fmt: skip
    honest = RedisLimiter(
        connect(redis_url), scope=unique_scope, global_limits=Limits(rpm=2), lease_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip
    try:
        await _admit(skewed, "a")
        await _admit(honest, "a")
        # Both count in the server's minute: the window is full for both.
        assert (await _refuse(skewed, "a")).gate == "global_rpm"
        assert (await _refuse(honest, "a")).gate == "global_rpm"
        assert (await skewed.source_stats("a")).rpm_used == 2
        rpm_keys = [k for k in await scope_keys(raw_redis, unique_scope) if ":rpm:" in k]
        assert len(rpm_keys) == 2  # one global and one source key: a single window
    finally:
        await skewed.aclose()
        await honest.aclose()
        await _delete_scope(redis_url, unique_scope)


_HOLDER = """
import asyncio, sys
from pgw_redis.connection import connect
from pgw_redis.limiter import RedisLimiter, RedisPermit
from polygateway.settings import Limits

async def main() -> None:
    limiter = RedisLimiter(connect(sys.argv[1]), scope=sys.argv[2],
                           global_limits=Limits(max_concurrency=1), lease_ttl_s=1.5)
    await limiter.try_acquire("a", 10, Limits())
    print("held", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_a_worker_killed_while_holding_a_lease_frees_it_after_the_ttl(
    backend: RedisGovernanceBackend,
) -> None:
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, backend.redis_url, backend.scope,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        async with asyncio.timeout(30):
            assert (await worker.stdout.readline()).strip() == b"held"
        worker.send_signal(signal.SIGKILL)
        async with asyncio.timeout(10):
            await worker.wait()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
    limiter = backend.make_limiter(global_limits=Limits(max_concurrency=1), lease_ttl_s=1.5)
    killed_at = time.monotonic()
    assert (await _refuse(limiter, "b")).gate == "global_concurrency"
    await wait_until(lambda: _admitted(limiter), timeout_s=5.0)
    assert time.monotonic() - killed_at < 3.0


async def _admitted(limiter: RedisLimiter) -> bool:
    return not isinstance(await limiter.try_acquire("b", 1, Limits(max_concurrency=1)), Denial)
