"""Entry points of the worker processes the multi-process tests start (spawned, so importable)."""

from __future__ import annotations

import asyncio
from typing import Any


def admit_many(barrier: Any, results: Any, redis_url: str, scope: str, tasks: int) -> None:
    """``tasks`` concurrent acquires against a global RPM of 5; report how many got in."""
    from pgw_redis.connection import connect
    from pgw_redis.limiter import RedisLimiter
    from polygateway.ports import Denial
    from polygateway.settings import Limits

    async def run() -> int:
        limiter = RedisLimiter(
            connect(redis_url), scope=scope, global_limits=Limits(rpm=5), lease_ttl_s=30.0,
            owns_client=True,
        )  # fmt: skip
        try:
            await limiter.inflight()  # connected, scripts loaded: the race starts together
            await asyncio.to_thread(barrier.wait)
            outcomes = await asyncio.gather(
                *(limiter.try_acquire("abcd"[i % 4], 1, Limits()) for i in range(tasks))
            )
            admitted = [o for o in outcomes if not isinstance(o, Denial)]
            for permit in admitted:
                await permit.release()
            return len(admitted)
        finally:
            await limiter.aclose()

    results.put(asyncio.run(run()))


def race_for_the_probe(barrier: Any, results: Any, redis_url: str, scope: str) -> None:
    """One ``try_enter`` on an open source whose cooldown is over; report the decision."""
    from pgw_redis.breaker import RedisGate
    from pgw_redis.connection import connect

    async def run() -> tuple[bool, str | None]:
        gate = RedisGate(
            connect(redis_url), scope=scope, fail_threshold=3, cooldown_s=0.0, probe_ttl_s=60.0,
            owns_client=True,
        )  # fmt: skip
        try:
            await gate.state("a")  # connected, scripts loaded
            await asyncio.to_thread(barrier.wait)
            decision = await gate.try_enter("a")
            return decision.allowed, decision.probe_owner
        finally:
            await gate.aclose()

    results.put(asyncio.run(run()))


def chat_many(
    barrier: Any,
    results: Any,
    source_url: str,
    redis_url: str,
    scope: str,
    calls: int,
    max_concurrency: int,
    rpm: int,
) -> None:
    """``calls`` concurrent governed chats through ``GatewayClient``; report the outcomes."""
    from pgw_redis_test_helpers import gateway_settings
    from polygateway import GatewayClient
    from polygateway.settings import Limits

    async def run() -> list[str]:
        settings = gateway_settings(
            source_url,
            redis_url,
            scope,
            global_limits=Limits(max_concurrency=max_concurrency, rpm=rpm),
        )
        client = GatewayClient(settings)
        try:
            await asyncio.to_thread(barrier.wait)
            outcomes = await asyncio.gather(
                *(client.chat([{"role": "user", "content": f"call {i}"}]) for i in range(calls)),
                return_exceptions=True,
            )
            return [o.content if not isinstance(o, BaseException) else repr(o) for o in outcomes]
        finally:
            await client.aclose()

    results.put(asyncio.run(run()))


def chat_through_a_flap(
    barrier: Any,
    results: Any,
    primary_url: str,
    fallback_url: str,
    redis_url: str,
    scope: str,
    cooldown_s: float,
    run_s: float,
    max_cooldown_s: float | None = None,
    health_probe: bool = False,
    calls_s: float | None = None,
) -> None:
    """Sequential chats for ``run_s`` seconds through a primary/fallback client (priority
    selector, Redis breaker with ``cooldown_s`` growing to ``max_cooldown_s``); report who
    answered each. With ``calls_s``, the chats stop after that long and the process stays
    idle (its background health probes at work) until ``run_s``, then makes one last chat
    and reports the primary's breaker state seen just before it as well."""
    import dataclasses
    import time

    from pgw_redis_test_helpers import gateway_settings
    from polygateway import GatewayClient
    from polygateway.settings import BreakerSettings

    async def run() -> list[str]:
        settings = gateway_settings(
            primary_url,
            redis_url,
            scope,
            source_name="primary",
            selector="priority",
            breaker=BreakerSettings(
                fail_threshold=1,
                cooldown_s=cooldown_s,
                max_cooldown_s=max_cooldown_s,
                health_probe=health_probe,
            ),
        )
        fallback = dataclasses.replace(settings.sources[0], name="fallback", base_url=fallback_url)
        settings = dataclasses.replace(settings, sources=(*settings.sources, fallback))
        client = GatewayClient(settings)
        served: list[str] = []
        try:
            await asyncio.to_thread(barrier.wait)
            started = time.monotonic()
            end = started + (run_s if calls_s is None else calls_s)
            while time.monotonic() < end:
                response = await client.chat([{"role": "user", "content": "hi"}])
                served.append(response.source_name)
                await asyncio.sleep(0.05)  # a steady trickle of calls, not a measurement wait
            if calls_s is not None:
                await asyncio.sleep(started + run_s - time.monotonic())  # idle, by design
                served.append(await client.breaker.state("primary"))
                response = await client.chat([{"role": "user", "content": "hi"}])
                served.append(response.source_name)
            return served
        finally:
            await client.aclose()

    results.put(asyncio.run(run()))
