"""A mixed scope (openai-compat + anthropic) through the governed client: a 529 on either
side fails over to the other, both answer in one ``LLMResponse`` shape, and the telemetry rows
carry cache-aware costs from the pricing table."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest
from polygateway import GatewayClient
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import LLMResponse

PRICES = {
    "claude-test": {
        "input_per_1m": 3.0,
        "output_per_1m": 15.0,
        "cached_input_per_1m": 0.3,
        "cache_write_per_1m": 3.75,
    },
    "gpt-test": {"input_per_1m": 2.0, "output_per_1m": 8.0, "cached_input_per_1m": 0.5},
}


def _client(fake: FakeUpstream, tmp_path: Path) -> GatewayClient:
    pricing = tmp_path / "pricing.json"
    pricing.write_text(json.dumps(PRICES), encoding="utf-8")
    env = {
        "LLM__ANTHROPIC__1__BASE_URL": fake.base_url("claude"),
        "LLM__ANTHROPIC__1__MODEL": "claude-test",
        "LLM__ANTHROPIC__1__API_KEY": "sk-ant-mixed-0123456789",
        "LLM__ANTHROPIC__1__TRANSPORT": "anthropic",
        "LLM__OPENAI__1__BASE_URL": fake.base_url("gpt"),
        "LLM__OPENAI__1__MODEL": "gpt-test",
        "LLM__OPENAI__1__API_KEY": "sk-mixed-0123456789",
        "LLM__RETRY__MAX_ATTEMPTS": "3",
        "LLM__RETRY__BASE_DELAY_S": "0.01",
        "LLM__RETRY__MAX_DELAY_S": "0.02",
        "PGW_TELEMETRY_BACKEND": "sqlite",
        "PGW_TELEMETRY_SQLITE_PATH": str(tmp_path / "telemetry.db"),
        "PGW_PRICING_PATH": str(pricing),
        "PGW_CACHE_BACKEND": "none",
    }
    empty = tmp_path / "empty.env"  # not the working directory's .env
    empty.write_text("", encoding="utf-8")
    return GatewayClient.from_env(env=env, dotenv_path=empty)


def _shape(response: LLMResponse) -> dict[str, object]:
    """The fields a caller reads, by kind (values differ between the sources, kinds must not)."""
    return {
        "content": bool(response.content),
        "provider": type(response.provider),
        "tokens": response.prompt_tokens > 0 and response.completion_tokens > 0,
        "usage_source": response.usage_source,
        "finish_reason": response.finish_reason,
        "cost": type(response.cost),
        "ttft": type(response.ttft_ms),
        "salvaged": response.salvaged,
    }


async def test_529_fails_over_both_ways_with_one_response_shape(tmp_path: Path) -> None:
    async with FakeUpstream() as fake:
        client = _client(fake, tmp_path)
        try:
            fake.set_default("claude", Reply.error(529), route="messages")
            from_gpt = [await client.chat([{"role": "user", "content": f"q{i}"}]) for i in range(3)]
            assert {r.source_name for r in from_gpt} == {"openai-1"}
            assert fake.requests("claude", route="messages") >= 1  # tried, and failed over

            fake.reset()
            fake.set_default("gpt", Reply.error(529))
            from_claude = [
                await client.chat([{"role": "user", "content": f"r{i}"}]) for i in range(3)
            ]
            assert {r.source_name for r in from_claude} == {"anthropic-1"}
            assert fake.requests("gpt") >= 1
        finally:
            await client.aclose()
    shapes = {json.dumps(_shape(r), default=str, sort_keys=True) for r in from_gpt + from_claude}
    assert len(shapes) == 1, shapes
    assert from_claude[0].provider == "anthropic" and from_gpt[0].provider == "openai"
    assert dataclasses.fields(from_claude[0]) == dataclasses.fields(from_gpt[0])


async def test_cache_aware_cost_in_the_telemetry_rows(tmp_path: Path) -> None:
    preamble = "A long shared preamble. " * 40
    messages = [
        {
            "role": "system",
            "content": [{"type": "text", "text": preamble, "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "user", "content": "Question?"},
    ]
    async with FakeUpstream() as fake:
        client = _client(fake, tmp_path)
        try:
            fake.set_default("gpt", Reply.error(529))
            first = await client.chat(messages)
            second = await client.chat(messages)
            fake.reset()
            fake.set_default("claude", Reply.error(529), route="messages")
            fake.set_default(
                "gpt", Reply.ok("ok", prompt_tokens=2000, completion_tokens=10, cached_tokens=1500)
            )
            third = await client.chat([{"role": "user", "content": "gpt please"}])
        finally:
            await client.aclose()
    assert first.source_name == second.source_name == "anthropic-1"
    assert first.cache_write_tokens > 0 and second.cached_prompt_tokens == first.cache_write_tokens
    cached = second.cached_prompt_tokens
    uncached = second.prompt_tokens - cached
    expected_second = (uncached * 3.0 + cached * 0.3 + second.completion_tokens * 15.0) / 1e6
    expected_first = (uncached * 3.0 + cached * 3.75 + first.completion_tokens * 15.0) / 1e6
    expected_third = (500 * 2.0 + 1500 * 0.5 + 10 * 8.0) / 1e6
    assert (first.cost, second.cost, third.cost) == (
        pytest.approx(expected_first),
        pytest.approx(expected_second),
        pytest.approx(expected_third),
    )
    with sqlite3.connect(tmp_path / "telemetry.db") as db:
        rows = dict(
            db.execute("SELECT call_id, cost FROM pgw_calls WHERE error IS NULL").fetchall()
        )
    assert rows[second.call_id] == pytest.approx(expected_second)
    assert rows[third.call_id] == pytest.approx(expected_third)
