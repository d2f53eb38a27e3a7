"""The background health probe of an embedding scope (``EMBED__BREAKER__HEALTH_PROBE``)
through the fake upstream: an open primary gets one short input per cooldown with no call
waiting, and the probe that finds it back closes its breaker without a caller. Time is a
``FakeClock`` shared with the upstream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from pgw_embedding import EmbeddingClient
from pgw_embedding.client import HEALTH_PROBE_TEXTS
from pgw_embedding_test_helpers import registry
from polygateway.testing import FakeClock, FakeUpstream, Reply

PRIMARY, FALLBACK = "openai-1", "openai-2"
ROUTE = "embeddings"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def fake(clock: FakeClock) -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(clock=clock) as server:
        yield server


def _client(fake: FakeUpstream, clock: FakeClock, *, health_probe: bool = True) -> EmbeddingClient:
    env = {
        "EMBED__SELECTOR": "priority",
        "EMBED__BATCH_SIZE": "8",
        "EMBED__BREAKER__FAIL_THRESHOLD": "1",
        "EMBED__BREAKER__HEALTH_PROBE": "true" if health_probe else "false",
        "EMBED__OPENAI__1__BASE_URL": fake.base_url("primary"),
        "EMBED__OPENAI__1__MODEL": "text-embedding-3-small",
        "EMBED__OPENAI__2__BASE_URL": fake.base_url("fallback"),
        "EMBED__OPENAI__2__MODEL": "text-embedding-3-small",
        "PGW_TELEMETRY_BACKEND": "none",
    }
    return EmbeddingClient.from_env(env=env, registry=registry(), clock=clock)


async def _until(condition: Callable[[], bool], *, turns: int = 10_000) -> None:
    """Yield to the loop until ``condition()`` holds (the background task's progress)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def _probes(fake: FakeUpstream) -> int:
    """Requests the primary received that were the health probe (its one short input)."""
    return sum(
        r.body["input"] == list(HEALTH_PROBE_TEXTS) for r in fake.received("primary", route=ROUTE)
    )


async def _open_primary(client: EmbeddingClient) -> None:
    """A call that the fallback answers after the primary failed (threshold 1: it opens; on
    the fake clock a background probe may already hold it half-open)."""
    response = await client.embed(["a sentence"])
    assert response.source_name == FALLBACK
    assert await client.breaker.state(PRIMARY) != "closed"


async def test_the_probe_brings_an_open_primary_back_without_a_caller(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503), route=ROUTE)
    async with _client(fake, clock) as client:
        await _open_primary(client)
        calls = fake.requests("fallback", route=ROUTE)
        prober = client.governor.health_prober
        assert prober is not None and prober.watching == {PRIMARY}
        # No call from here on: only the probe reaches the primary, once per cooldown.
        await _until(lambda: _probes(fake) >= 2)
        assert await client.breaker.state(PRIMARY) != "closed"
        # Back: the next probe closes the breaker, with no caller involved.
        fake.set_default("primary", Reply.ok(), route=ROUTE)
        await _until(lambda: not prober.watching)
        assert await client.breaker.state(PRIMARY) == "closed"
        assert fake.requests("fallback", route=ROUTE) == calls
        probe = fake.received("primary", route=ROUTE)[-1].body
        assert probe["input"] == ["ping"] and probe["model"] == "text-embedding-3-small"
        response = await client.embed(["a sentence"])
        assert response.source_name == PRIMARY


async def test_off_by_default_no_request_without_a_call(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503), route=ROUTE)
    async with _client(fake, clock, health_probe=False) as client:
        await _open_primary(client)
        assert client.governor.health_prober is None
        before = fake.requests("primary", route=ROUTE)
        clock.advance(600.0)
        for _ in range(100):
            await asyncio.sleep(0)
        assert fake.requests("primary", route=ROUTE) == before
