"""What a caller can rely on: a closed client's error, gather_bounded with
return_exceptions, a plain-string API key, TPM settled on est_tokens when usage is missing,
and cost without a telemetry backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from client_helpers import MESSAGES, http_client, source
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.client import gather_bounded
from polygateway.errors import ClientClosedError, PolyGatewayError
from polygateway.settings import Limits, Secret, SourceConfig
from polygateway.telemetry.pricing import PricingTable
from polygateway.testing import FakeClock, FakeUpstream, Reply


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


async def test_a_closed_client_raises_a_library_error(fake: FakeUpstream) -> None:
    client = http_client(fake, ["a"])
    await client.aclose()
    with pytest.raises(ClientClosedError, match="closed") as caught:
        await client.chat(MESSAGES)
    assert isinstance(caught.value, PolyGatewayError)
    assert fake.requests() == 0


async def test_gather_bounded_can_return_exceptions_in_place() -> None:
    async def job(i: int) -> int:
        await asyncio.sleep(0)
        if i % 3 == 1:
            raise ValueError(f"bad {i}")
        return i

    results = await gather_bounded(
        [lambda i=i: job(i) for i in range(7)], 2, return_exceptions=True
    )
    assert [r if isinstance(r, int) else str(r) for r in results] == [
        0,
        "bad 1",
        2,
        3,
        "bad 4",
        5,
        6,
    ]
    with pytest.raises(ValueError, match="bad 1"):
        await gather_bounded([lambda i=i: job(i) for i in range(7)], 2)


def test_api_key_accepts_a_plain_string() -> None:
    made = SourceConfig(
        name="a", provider="openai", base_url="http://h/v1", model="m", api_key="sk-abc123"
    )
    assert made.api_key == Secret("sk-abc123")
    assert made.api_key_value() == "sk-abc123"
    assert "sk-abc123" not in repr(made)
    with pytest.raises(TypeError, match="api_key"):
        SourceConfig(name="a", provider="openai", base_url="http://h/v1", model="m", api_key=5)  # type: ignore[arg-type]


async def test_missing_usage_settles_tpm_on_est_tokens(fake: FakeUpstream) -> None:
    clock = FakeClock()
    limiter = InMemoryLimiter(clock=clock, global_limits=Limits(), lease_ttl_s=600.0)
    fake.script("a", Reply.ok("a long answer " * 50, include_usage=False))
    overrides = {"a": {"est_tokens": 900, "limits": Limits(tpm=100_000)}}
    async with http_client(
        fake, ["a"], clock=clock, source_overrides=overrides, injected={"limiter": limiter}
    ) as client:
        response = await client.chat(MESSAGES)
        stats = await limiter.source_stats("a")
    assert response.usage_source == "estimated"
    assert response.prompt_tokens + response.completion_tokens < 900  # chars/4 undercharges
    assert stats.tpm_used == 900


async def test_cost_without_a_telemetry_backend(fake: FakeUpstream) -> None:
    fake.script("a", Reply.ok("ok", prompt_tokens=1000, completion_tokens=500))
    pricing = PricingTable({"model-a": {"input_per_1m": 2.0, "output_per_1m": 8.0}})
    async with http_client(fake, ["a"], injected={"pricing": pricing}) as client:
        response = await client.chat(MESSAGES)
    assert response.cost == pytest.approx(1000 / 1e6 * 2 + 500 / 1e6 * 8)


def test_source_helper_still_builds() -> None:
    assert source("x").api_key == Secret("")


@pytest.mark.parametrize("bad", [42, "yaml", dict, object()])
async def test_structured_must_be_json_or_a_model_class(fake: FakeUpstream, bad: object) -> None:
    async with http_client(fake, ["a"]) as client:
        with pytest.raises(TypeError, match="structured must be"):
            await client.chat(MESSAGES, structured=bad)
        with pytest.raises(TypeError, match="structured must be"):
            client.stream(MESSAGES, structured=bad)
    assert fake.requests() == 0
