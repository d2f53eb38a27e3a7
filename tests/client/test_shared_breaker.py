"""Two roles (scopes) handed one breaker: each same-named source keeps its own breaker state
(ARCHITECTURE §7.7: governance state is per scope and source), checked through the fake
upstream; two clients of one role share their sources' state."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
from client_helpers import MESSAGES, http_settings, registry
from polygateway import GatewayClient
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.clock import SystemClock
from polygateway.errors import AllSourcesExhausted, CircuitOpenError
from polygateway.settings import BackpressureSettings, BreakerSettings, RetrySettings
from polygateway.testing import FakeUpstream, Reply


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


def role(fake: FakeUpstream, scope: str, route: str) -> Any:
    """Scope ``scope`` with one source named ``openai-1`` on ``route``: one attempt per call, the
    first failure opens the breaker, and a call finding it open fails at once."""
    settings = http_settings(
        fake,
        ("openai-1",),
        scope=scope,
        breaker=BreakerSettings(fail_threshold=1, cooldown_s=60.0),
        retry=RetrySettings(max_attempts=1, base_delay_s=0.0, max_delay_s=0.0),
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    source = dataclasses.replace(settings.sources[0], base_url=fake.base_url(route))
    return dataclasses.replace(settings, sources=(source,))


async def test_a_failure_in_one_role_leaves_the_same_named_source_of_another_closed(
    fake: FakeUpstream,
) -> None:
    fake.set_default("llm", Reply.error(503))
    fake.set_default("judge", Reply.ok("judged"))
    llm = GatewayClient(role(fake, "LLM", "llm"), registry=registry())
    judge = GatewayClient(role(fake, "JUDGE", "judge"), registry=registry(), breaker=llm.breaker)
    try:
        with pytest.raises(AllSourcesExhausted):
            await llm.chat(MESSAGES)
        assert await llm.breaker.state("openai-1") == "open"
        # JUDGE's openai-1 is another source: its breaker never saw that failure.
        response = await judge.chat(MESSAGES)
        assert (response.source_name, response.content) == ("openai-1", "judged")
        assert fake.requests("judge") == 1
        # Each client's breaker is its role's: the shared instance is the first role's.
        assert judge.breaker is not llm.breaker
        assert await judge.breaker.state("openai-1") == "closed"
        assert await llm.breaker.state("openai-1") == "open"
    finally:
        await judge.aclose()
        await llm.aclose()


async def test_a_user_built_breaker_keeps_each_role_apart(fake: FakeUpstream) -> None:
    shared = InMemoryGate(fail_threshold=1, cooldown_s=60.0, probe_ttl_s=30.0, clock=SystemClock())
    fake.set_default("llm", Reply.ok("fine"))
    fake.set_default("judge", Reply.error(503))
    llm = GatewayClient(role(fake, "LLM", "llm"), registry=registry(), breaker=shared)
    judge = GatewayClient(role(fake, "JUDGE", "judge"), registry=registry(), breaker=shared)
    try:
        with pytest.raises(AllSourcesExhausted):
            await judge.chat(MESSAGES)
        for _ in range(3):
            assert (await llm.chat(MESSAGES)).content == "fine"
        assert fake.requests("llm") == 3
        # The first role assembled on it owns it; the other got its own gate from it.
        assert llm.breaker is shared and judge.breaker is shared.for_scope("JUDGE")
        assert await shared.state("openai-1") == "closed"
        assert await shared.for_scope("JUDGE").state("openai-1") == "open"
    finally:
        await judge.aclose()
        await llm.aclose()


async def test_two_clients_of_one_role_share_its_sources_breaker_state(
    fake: FakeUpstream,
) -> None:
    fake.set_default("llm", Reply.error(503))
    first = GatewayClient(role(fake, "LLM", "llm"), registry=registry())
    second = GatewayClient(role(fake, "LLM", "llm"), registry=registry(), breaker=first.breaker)
    try:
        with pytest.raises(AllSourcesExhausted):
            await first.chat(MESSAGES)
        with pytest.raises(CircuitOpenError):
            await second.chat(MESSAGES)
        assert fake.requests("llm") == 1  # the second found the shared breaker open
    finally:
        await second.aclose()
        await first.aclose()


class _Forwarding:
    """A breaker wrapper forwarding what it does not define (``__getattr__``), as a user's
    logging decorator might: it must not be bypassed by the inner gate's ``for_scope``."""

    def __init__(self, inner: InMemoryGate) -> None:
        self.inner = inner
        self.entered: list[str] = []

    async def try_enter(self, source: str) -> Any:
        self.entered.append(source)
        return await self.inner.try_enter(source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_forwarding_wrapper_is_used_as_it_is(fake: FakeUpstream) -> None:
    wrapper = _Forwarding(
        InMemoryGate(fail_threshold=1, cooldown_s=60.0, probe_ttl_s=30.0, clock=SystemClock())
    )
    fake.set_default("llm", Reply.ok("fine"))
    async with GatewayClient(role(fake, "LLM", "llm"), registry=registry(), breaker=wrapper) as llm:
        assert llm.breaker is wrapper
        assert (await llm.chat(MESSAGES)).content == "fine"
    assert wrapper.entered == ["openai-1"]
