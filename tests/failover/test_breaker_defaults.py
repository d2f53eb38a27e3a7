"""The breaker a client gets from default settings (in-process backend): the first cooldown is
5 s, each failed probe in a row doubles it up to 60 s, a successful probe resets it."""

from __future__ import annotations

import pytest
from polygateway import GatewayClient, ScopeUnavailableError
from polygateway.testing import FakeClock, FakeUpstream, Reply

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_default_cooldown_grows_from_5_to_60_s_and_resets_on_success(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("only", Reply.error(503))
    env = {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("only"),
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__RETRY__MAX_ATTEMPTS": "1",  # each call is the probe alone
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
        "PGW_PLUGINS": "",
    }
    async with GatewayClient.from_env(env=env, pipeline_path=None, clock=clock) as client:
        breaker = client.breaker
        await breaker.force_open("openai-1")
        waits = [await breaker.retry_after_s(["openai-1"])]
        for _ in range(5):
            clock.advance(waits[-1])
            with pytest.raises(ScopeUnavailableError):
                await client.chat(MESSAGES)  # the probe fails
            waits.append(await breaker.retry_after_s(["openai-1"]))
        assert waits == pytest.approx([5.0, 10.0, 20.0, 40.0, 60.0, 60.0])
        fake.set_default("only", Reply.ok("back"))
        clock.advance(waits[-1])
        assert (await client.chat(MESSAGES)).content == "back"  # the probe closes it
        await breaker.force_open("openai-1")
        assert await breaker.retry_after_s(["openai-1"]) == pytest.approx(5.0)  # reset
