"""A Redis that freezes (SIGSTOP) and thaws (SIGCONT) with an acquire in its input: the
compensation of that acquire is retried until it lands, so the scope admits at full capacity
within a second of Redis coming back, and ``aclose`` stops the retries."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest
from pgw_redis.connection import connect
from pgw_redis.limiter import RETRY_MAX_S, RedisLimiter
from pgw_redis_test_helpers import RedisServer, wait_until
from polygateway.errors import GovernanceBackendError
from polygateway.ports import Denial
from polygateway.settings import Limits
from redis.asyncio import Redis

ONE = Limits(max_concurrency=1)
LEASE_KEY = "pgw:limit:{S}:global:lease"


@pytest.fixture
def frozen(spare_redis: RedisServer) -> Iterator[RedisServer]:
    """The spare Redis, thawed again whatever the test did."""
    try:
        yield spare_redis
    finally:
        if spare_redis.process is not None:
            os.kill(spare_redis.process.pid, signal.SIGCONT)


def _signal(server: RedisServer, sig: signal.Signals) -> None:
    assert server.process is not None
    os.kill(server.process.pid, sig)


def _limiter(server: RedisServer) -> RedisLimiter:
    return RedisLimiter(
        connect(server.url, socket_timeout_s=0.3, connect_timeout_s=0.3),
        scope="S",
        global_limits=ONE,
        lease_ttl_s=32.0,
        owns_client=True,
    )


async def test_the_scope_admits_within_a_second_after_a_black_hole(
    frozen: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = Redis.from_url(frozen.url, decode_responses=True)
    limiter = _limiter(frozen)
    try:
        await (await limiter.try_acquire("a", 1, ONE)).release()  # type: ignore[union-attr]
        await limiter.flush()  # scripts loaded, connection warm
        with caplog.at_level(logging.WARNING, logger="pgw_redis"):
            _signal(frozen, signal.SIGSTOP)
            # Sent, then the socket times out: the script sits in the frozen server's input.
            with pytest.raises(GovernanceBackendError):
                await limiter.try_acquire("a", 1, ONE)
            # The compensation's background flush fails at least once while frozen.
            await wait_until(
                lambda: any("accounting failed" in r.getMessage() for r in caplog.records)
            )
            _signal(frozen, signal.SIGCONT)
            thawed = time.monotonic()

            async def admitted() -> bool:
                try:
                    result = await limiter.try_acquire("a", 1, ONE)
                except GovernanceBackendError:
                    return False  # a connection that died in the freeze, replaced
                if isinstance(result, Denial):
                    return False
                await result.release()
                return True

            await wait_until(admitted, timeout_s=5.0, every_s=0.05)
            recovered_s = time.monotonic() - thawed
        assert recovered_s < 1.0, f"admitted again {recovered_s:.2f}s after Redis came back"
        await limiter.flush()
        assert await admin.zcard(LEASE_KEY) == 0  # the stale acquire's lease is gone
        assert any("sent again" in r.getMessage() for r in caplog.records)
    finally:
        await limiter.aclose()
        await admin.aclose()


async def test_aclose_stops_the_retries(
    frozen: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = _limiter(frozen)
    permit = await limiter.try_acquire("a", 1, ONE)
    assert not isinstance(permit, Denial)
    await limiter.flush()
    with caplog.at_level(logging.WARNING, logger="pgw_redis"):
        _signal(frozen, signal.SIGSTOP)
        await permit.release()  # queued; the background flush fails and is retried
        await wait_until(lambda: any("sent again" in r.getMessage() for r in caplog.records))
        started = time.monotonic()
        await limiter.aclose()
        # One more try at close (bounded by the socket timeout), then nothing is left behind.
        assert time.monotonic() - started < 0.3 * 4 + RETRY_MAX_S
    assert limiter._retry_handle is None
    assert not limiter._pending
    assert any("dropped" in r.getMessage() for r in caplog.records)
