"""A concurrency refusal tells the caller when a slot is likely to free, not the lease TTL."""

from __future__ import annotations

import asyncio

import pytest
from polygateway import AllSourcesExhausted, GatewayClient
from polygateway.testing import FakeUpstream, Reply


def env_for(fake: FakeUpstream) -> dict[str, str]:
    return {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("a"),
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__OPENAI__1__MAX_CONCURRENCY": "1",
        "LLM__OPENAI__1__TIMEOUT_S": "120",  # lease TTL 150 s
        "PGW_QUOTA_FULL": "fail_fast",
        "PGW_PLUGINS": "",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
    }


async def test_fail_fast_reports_the_gate_hint(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("a", Reply.ok(content="quick"), Reply.black_hole())
    async with GatewayClient.from_env(env=env_for(fake_upstream)) as client:
        assert client.settings.lease_ttl_s == 150.0
        await client.chat([{"role": "user", "content": "one"}])  # held for milliseconds
        slow = asyncio.ensure_future(client.chat([{"role": "user", "content": "two"}]))
        await fake_upstream.wait_for_requests(2, "a")
        try:
            with pytest.raises(AllSourcesExhausted) as caught:
                await client.chat([{"role": "user", "content": "three"}])
        finally:
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
    assert caught.value.reason == "quota_exhausted"
    # The one lease held so far lasted milliseconds: the hint says so (at least the 10 ms
    # floor), nowhere near the 150 s lease TTL.
    assert 0.0 < caught.value.retry_after_s < 1.0
