"""The Redis limiter's speed and round trips, against the ``limits`` library on the same Redis.

    python tools/bench/redis_limiter.py [--redis-url redis://127.0.0.1:6379/3] [--seconds 3]

Measures, in one run, on one connection pool each:

1. ``RedisLimiter`` acquire + release pairs per second at concurrency 1 and 64 (every gate
   enabled with limits far above the load, so all six are evaluated; releases are queued and
   pipelined as in production);
2. ``limits`` (``limits.aio.storage.RedisStorage`` on redis-py +
   ``MovingWindowRateLimiter.hit``) hits per second at the same concurrencies, and the ratio;
3. Redis round trips per successful governed call (``GatewayClient`` against the fake
   upstream, limiter and breaker on Redis), counted at the socket: one per command or
   pipeline written, at concurrency 1 and 64.

Machines here are noisy: compare the ratios printed by one run, not absolute numbers.
Every key written is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from pgw_redis.testing import counting_client

MESSAGES = [{"role": "user", "content": "ping"}]


async def rate(worker: Callable[[], Awaitable[None]], concurrency: int, seconds: float) -> float:
    """Operations per second of ``concurrency`` tasks looping on ``worker`` for ``seconds``."""
    done = 0
    stop_at = 0.0

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await worker()
            done += 1

    stop_at = time.perf_counter() + min(0.5, seconds / 4)  # warm-up
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    done = 0
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def bench_pgw(url: str, concurrency: int, seconds: float, scope: str) -> float:
    from pgw_redis.connection import connect
    from pgw_redis.limiter import RedisLimiter
    from polygateway.ports import Denial
    from polygateway.settings import Limits

    big = Limits(max_concurrency=1_000_000, rpm=1_000_000_000, tpm=2_000_000_000)
    limiter = RedisLimiter(
        connect(url), scope=scope, global_limits=big, lease_ttl_s=60.0, owns_client=True
    )
    sources = [f"s{i}" for i in range(4)]
    counter = 0

    async def pair() -> None:
        nonlocal counter
        counter += 1
        permit = await limiter.try_acquire(sources[counter % 4], 10, big)
        if isinstance(permit, Denial):
            raise RuntimeError(f"unexpected denial: {permit}")
        await permit.release()

    try:
        return await rate(pair, concurrency, seconds)
    finally:
        await limiter.aclose()


async def bench_limits(url: str, concurrency: int, seconds: float, key: str) -> float:
    from limits import RateLimitItemPerMinute
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter

    storage = RedisStorage(
        url.replace("redis://", "async+redis://", 1), implementation="redispy",
        max_connections=64,
    )  # fmt: skip
    limiter = MovingWindowRateLimiter(storage)
    item = RateLimitItemPerMinute(1_000_000)

    async def hit() -> None:
        if not await limiter.hit(item, "pgw-bench", key):
            raise RuntimeError("unexpected refusal from limits")

    try:
        return await rate(hit, concurrency, seconds)
    finally:
        await storage.reset()


async def round_trips_per_call(url: str, concurrency: int, calls: int, scope: str) -> float:
    from pgw_redis.breaker import RedisGate
    from pgw_redis.limiter import RedisLimiter
    from polygateway import GatewayClient
    from polygateway.settings import (
        BreakerSettings,
        CacheSettings,
        Limits,
        ScopeSettings,
        Secret,
        SourceConfig,
        TelemetrySettings,
    )
    from polygateway.testing import FakeUpstream

    limits = Limits(max_concurrency=1000, rpm=1_000_000, tpm=1_000_000_000)
    with FakeUpstream.in_thread() as fake:
        settings = ScopeSettings(
            scope=scope,
            sources=(
                SourceConfig(
                    name="a", provider="openai", base_url=fake.base_url("a"), model="m",
                    api_key=Secret("sk-bench"), scope=scope, timeout_s=30.0,
                ),
            ),
            global_limits=limits,
            breaker=BreakerSettings(fail_threshold=3, cooldown_s=30.0),
            cache=CacheSettings(backend="none"),
            telemetry=TelemetrySettings(backend="none"),
        )  # fmt: skip
        limiter_client, limiter_trips = counting_client(url)
        gate_client, gate_trips = counting_client(url)
        limiter = RedisLimiter(
            limiter_client, scope=scope, global_limits=limits, lease_ttl_s=settings.lease_ttl_s,
            owns_client=True,
        )  # fmt: skip
        gate = RedisGate(
            gate_client, scope=scope, fail_threshold=3, cooldown_s=30.0,
            probe_ttl_s=settings.probe_ttl_s, owns_client=True,
        )  # fmt: skip
        client = GatewayClient(settings, limiter=limiter, breaker=gate)
        try:
            await asyncio.gather(*(client.chat(MESSAGES) for _ in range(concurrency)))  # warm
            await limiter.flush()
            limiter_trips.count = gate_trips.count = 0
            semaphore = asyncio.Semaphore(concurrency)

            async def one() -> None:
                async with semaphore:
                    await client.chat(MESSAGES)

            await asyncio.gather(*(one() for _ in range(calls)))
            await limiter.flush()
            return (limiter_trips.count + gate_trips.count) / calls
        finally:
            await client.aclose()
            await limiter.aclose()
            await gate.aclose()


async def delete_scope(url: str, scope: str) -> None:
    from pgw_redis.connection import connect
    from pgw_redis.testing import scope_keys

    client = connect(url)
    try:
        keys = await scope_keys(client, scope)
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/3")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    url: str = args.redis_url
    run_id = uuid.uuid4().hex[:8]
    scopes: list[str] = []

    print(f"Redis {url}, {args.seconds:g} s per measurement")
    print(f"{'concurrency':>11}  {'pgw-redis pairs/s':>17}  {'limits hits/s':>13}  {'ratio':>6}")
    try:
        for concurrency in (1, 64):
            scope = f"bench-{run_id}-{concurrency}"
            scopes.append(scope)
            ours = await bench_pgw(url, concurrency, args.seconds, scope)
            theirs = await bench_limits(url, concurrency, args.seconds, f"{run_id}-{concurrency}")
            print(f"{concurrency:>11}  {ours:>17,.0f}  {theirs:>13,.0f}  {ours / theirs:>6.2f}")
        print()
        print(f"{'concurrency':>11}  {'round trips per successful governed call':>41}")
        for concurrency in (1, 64):
            scope = f"bench-{run_id}-rt{concurrency}"
            scopes.append(scope)
            trips = await round_trips_per_call(url, concurrency, args.calls, scope)
            print(f"{concurrency:>11}  {trips:>41.2f}")
    finally:
        for scope in scopes:
            await delete_scope(url, scope)


if __name__ == "__main__":
    asyncio.run(main())
