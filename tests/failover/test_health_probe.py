"""The background health probe (``LLM__BREAKER__HEALTH_PROBE``) on the in-process breaker,
through the fake upstream: an open primary is probed once per (growing) cooldown with no call
waiting, comes back without a caller paying for the probe, and ``aclose`` leaves nothing
behind. Time is a ``FakeClock`` shared with the upstream, so the gaps are exact."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest
from polygateway import GatewayClient
from polygateway.testing import FakeClock, FakeUpstream, Reply

MESSAGES = [{"role": "user", "content": "hello"}]
PRIMARY, FALLBACK = "openai-1", "openai-2"


def _client(fake: FakeUpstream, clock: FakeClock, *, health_probe: bool = True) -> GatewayClient:
    env = {
        "LLM__SELECTOR": "priority",
        "LLM__BREAKER__HEALTH_PROBE": "true" if health_probe else "false",
        "LLM__OPENAI__1__BASE_URL": fake.base_url("primary"),
        "LLM__OPENAI__1__MODEL": "primary-model",
        "LLM__OPENAI__2__BASE_URL": fake.base_url("fallback"),
        "LLM__OPENAI__2__MODEL": "fallback-model",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
        "PGW_PLUGINS": "",
    }
    return GatewayClient.from_env(env=env, pipeline_path=None, clock=clock)


async def _until(condition: Callable[[], bool], *, turns: int = 10_000) -> None:
    """Yield to the loop until ``condition()`` holds (the background task's progress)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def _probe_bodies(fake: FakeUpstream) -> list[bool]:
    """For each request the primary received: was it the health probe (``max_tokens`` 1)?"""
    return [
        r.body.get("max_completion_tokens", r.body.get("max_tokens")) == 1
        for r in fake.received("primary")
    ]


async def _open_primary(client: GatewayClient) -> None:
    """Calls until the primary's breaker opens (they are answered by the fallback)."""
    for _ in range(10):
        assert (await client.chat(MESSAGES)).source_name == FALLBACK
        if await client.breaker.state(PRIMARY) != "closed":
            return
    raise AssertionError("the primary never opened")


async def test_an_open_primary_is_probed_once_per_growing_cooldown_and_comes_back(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    async with _client(fake, clock) as client:
        await _open_primary(client)
        calls = fake.requests("fallback")
        # No call is made from here on: only the background probe reaches the primary, the
        # first after the first cooldown, then once per doubled cooldown.
        await _until(lambda: sum(_probe_bodies(fake)) >= 4)
        received = fake.received("primary")
        probes = [r.at for r, probe in zip(received, _probe_bodies(fake), strict=True) if probe]
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        assert gaps == pytest.approx([10.0, 20.0, 40.0])  # 5 s doubling: the defaults
        assert fake.requests("fallback") == calls  # no call was made meanwhile
        # The primary recovers: the next probe closes the breaker, with no caller involved.
        fake.set_default("primary", Reply.ok("back"))
        await _until(lambda: sum(_probe_bodies(fake)) >= 5)
        recovered_gap = fake.received("primary")[-1].at - probes[3]
        assert recovered_gap == pytest.approx(60.0)  # 80 s capped
        prober = client.governor.health_prober
        assert prober is not None
        await _until(lambda: not prober.watching)
        assert await client.breaker.state(PRIMARY) == "closed"
        response = await client.chat(MESSAGES)
        assert (response.source_name, response.content) == (PRIMARY, "back")


async def test_off_by_default_no_request_without_a_call(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    async with _client(fake, clock, health_probe=False) as client:
        assert client.settings.breaker.health_probe is False
        await _open_primary(client)
        assert client.governor.health_prober is None
        before = fake.requests("primary")
        clock.advance(600.0)
        for _ in range(100):
            await asyncio.sleep(0)
    assert fake.requests("primary") == before


async def test_aclose_cancels_a_probe_in_flight_and_hands_its_lease_back(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    client = _client(fake, clock)
    await _open_primary(client)
    before = fake.requests("primary")
    fake.set_default("primary", Reply.black_hole())  # the probe hangs until cancelled
    await _until(lambda: fake.inflight("primary") == 1)
    assert fake.requests("primary") == before + 1
    assert await client.breaker.state(PRIMARY) == "half_open"
    prober = client.governor.health_prober
    assert prober is not None and prober.watching == {PRIMARY}
    await client.aclose()
    assert not prober.watching
    # The lease went back at once (no probe TTL to wait out), the connection is gone and no
    # in-flight count is left.
    assert await client.breaker.retry_after_s([PRIMARY]) == 0.0
    assert client.governor.inflight[PRIMARY] == 0
    await _until(lambda: fake.inflight("primary") == 0)


async def test_a_reasoning_source_that_spends_the_probe_token_thinking_comes_back(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    async with _client(fake, clock) as client:
        await _open_primary(client)
        # Back, but a reasoning model: the probe's one token goes to thinking, the answer is
        # empty with finish_reason=length. The source is up; the probe must close it.
        fake.set_default(
            "primary", Reply.ok("", reasoning="hmm", finish_reason="length", completion_tokens=1)
        )
        before = sum(_probe_bodies(fake))
        prober = client.governor.health_prober
        assert prober is not None
        await _until(lambda: sum(_probe_bodies(fake)) > before and not prober.watching)
        assert sum(_probe_bodies(fake)) == before + 1  # one probe was enough
        assert await client.breaker.state(PRIMARY) == "closed"
