"""Two roles (scopes) handed one limiter: they share its global gates, but each same-named
source keeps its own per-source gate (ARCHITECTURE §7.7: gates are per scope and source),
checked with the fake upstream's in-flight counts per route; a role's own global limits that
the shared limiter would ignore are a ConfigError."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from client_helpers import MESSAGES, http_settings, registry, wait_until
from polygateway import GatewayClient
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.errors import ConfigError
from polygateway.settings import Limits
from polygateway.testing import FakeUpstream, Reply


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


def role(fake: FakeUpstream, scope: str, route: str, **overrides: Any) -> Any:
    """Scope ``scope`` with one source named ``qwen-1`` (max 2 in flight) on ``route``."""
    settings = http_settings(fake, ("qwen-1",), scope=scope, **overrides)
    qwen = dataclasses.replace(
        settings.sources[0],
        base_url=fake.base_url(route),
        model=f"qwen-{route}",
        limits=Limits(max_concurrency=2),
    )
    return dataclasses.replace(settings, sources=(qwen,))


async def hold_calls(clients: list[GatewayClient], per_client: int) -> list[asyncio.Task[Any]]:
    return [
        asyncio.create_task(client.chat(MESSAGES)) for client in clients for _ in range(per_client)
    ]


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_same_named_sources_of_two_roles_keep_their_own_gates(fake: FakeUpstream) -> None:
    fake.set_default("llm", Reply.black_hole())
    fake.set_default("judge", Reply.black_hole())
    llm = GatewayClient(role(fake, "LLM", "llm"), registry=registry())
    judge = GatewayClient(role(fake, "JUDGE", "judge"), registry=registry(), limiter=llm.limiter)
    tasks = await hold_calls([llm, judge], 5)
    try:
        # Each role's qwen-1 fills its own two slots; the rest wait for a slot.
        await wait_until(lambda: fake.inflight("llm") == 2 and fake.inflight("judge") == 2)
        assert await llm.limiter.inflight() == 4  # one limiter: its scope-wide count
        assert (fake.max_inflight("llm"), fake.max_inflight("judge")) == (2, 2)
        assert (await llm.limiter.source_stats("qwen-1")).inflight == 2
        assert (await llm.limiter.source_stats("JUDGE:qwen-1")).inflight == 2
    finally:
        await cancel(tasks)
        await judge.aclose()
        await llm.aclose()


async def test_two_clients_of_one_role_share_its_source_gate(fake: FakeUpstream) -> None:
    fake.set_default("llm", Reply.black_hole())
    first = GatewayClient(role(fake, "LLM", "llm"), registry=registry())
    second = GatewayClient(role(fake, "LLM", "llm"), registry=registry(), limiter=first.limiter)
    tasks = await hold_calls([first, second], 3)
    try:
        await wait_until(lambda: fake.inflight("llm") == 2)
        assert await first.limiter.inflight() == 2
        assert fake.max_inflight("llm") == 2  # the same source: one gate
    finally:
        await cancel(tasks)
        await second.aclose()
        await first.aclose()


async def test_a_user_built_limiter_is_owned_by_the_first_role(fake: FakeUpstream) -> None:
    shared = InMemoryLimiter(
        global_limits=Limits(max_concurrency=3), lease_ttl_s=60.0, clock=SystemClock()
    )
    fake.set_default("llm", Reply.black_hole())
    fake.set_default("judge", Reply.black_hole())
    llm = GatewayClient(role(fake, "LLM", "llm"), registry=registry(), limiter=shared)
    judge = GatewayClient(role(fake, "JUDGE", "judge"), registry=registry(), limiter=shared)
    tasks = await hold_calls([llm, judge], 5)
    try:
        # Per-source gates apart, the shared global concurrency (3) caps both roles together.
        await wait_until(lambda: fake.inflight() == 3)
        assert 1 <= fake.inflight("judge") <= 2 and 1 <= fake.inflight("llm") <= 2
        assert fake.max_inflight() == 3
    finally:
        await cancel(tasks)
        await judge.aclose()
        await llm.aclose()


async def test_own_global_limits_a_shared_limiter_would_ignore_are_refused(
    fake: FakeUpstream,
) -> None:
    llm = GatewayClient(
        role(fake, "LLM", "llm", global_limits=Limits(max_concurrency=3)), registry=registry()
    )
    with pytest.raises(ConfigError, match=r"JUDGE: global limits \(max_concurrency=5"):
        GatewayClient(
            role(fake, "JUDGE", "judge", global_limits=Limits(max_concurrency=5)),
            registry=registry(),
            limiter=llm.limiter,
        )
    # Unset (the shared gates apply) or the same limits: fine.
    for limits in (Limits(), Limits(max_concurrency=3)):
        judge = GatewayClient(
            role(fake, "JUDGE", "judge", global_limits=limits),
            registry=registry(),
            limiter=llm.limiter,
        )
        await judge.aclose()
    await llm.aclose()
