"""The fake upstream's Anthropic Messages route, checked byte for byte with a raw client (the
official SDK reads it too, in pgw-anthropic's tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from polygateway.testing import FakeUpstream, Reply

BODY: dict[str, Any] = {
    "model": "claude-test",
    "max_tokens": 64,
    "system": "Be brief.",
    "messages": [{"role": "user", "content": "Hi"}],
}


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


async def _post(fake: FakeUpstream, body: dict[str, Any]) -> tuple[int, Mapping[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{fake.base_url('claude')}/messages", json=body) as response,
    ):
        # A case-insensitive copy: aiohttp spells well-known header names its own way.
        return response.status, response.headers.copy(), await response.read()


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:]  # data.type equals the event name
        events.append((name_line[7:], data))
    return events


async def test_stream_is_the_messages_event_sequence(fake: FakeUpstream) -> None:
    fake.script("claude", Reply.ok("Hello!", chunks=2, reasoning="hm"), route="messages")
    status, headers, raw = await _post(fake, {**BODY, "stream": True})
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert headers["request-id"].startswith("req_")
    events = _events(raw)
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "text_delta",
    ]
    assert "".join(d.get("text", "") for d in deltas) == "Hello!"
    usage = events[0][1]["message"]["usage"]
    assert set(usage) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert events[-2][1]["usage"]["output_tokens"] >= 1


async def test_error_body_shape_and_headers(fake: FakeUpstream) -> None:
    fake.script("claude", Reply.error(529, retry_after=2), route="messages")
    status, headers, raw = await _post(fake, BODY)
    assert status == 529
    assert headers["x-should-retry"] == "true"
    assert headers["retry-after"] == "2"
    body = json.loads(raw)
    assert body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
        "request_id": headers["request-id"],
    }


async def test_mid_stream_error_is_an_error_event_on_200(fake: FakeUpstream) -> None:
    fake.script("claude", Reply.mid_stream_error(after_chunks=1), route="messages")
    status, _, raw = await _post(fake, {**BODY, "stream": True})
    assert status == 200
    name, data = _events(raw)[-1]
    assert name == "error"
    assert data["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget_tokens"),
    ],
)
async def test_requests_the_api_refuses(
    fake: FakeUpstream, change: dict[str, Any], needle: str
) -> None:
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None}
    status, _, raw = await _post(fake, body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]
