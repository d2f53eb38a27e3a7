"""The fake upstream's Messages route, read by the official ``anthropic`` SDK with strict
response validation: if the fake drifted from the real wire, the SDK would complain here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from polygateway.testing.fake_upstream import FakeUpstream, Reply

KEY = "sk-ant-fake-0123456789"


@pytest.fixture
async def client(fake_upstream: FakeUpstream) -> AsyncIterator[anthropic.AsyncAnthropic]:
    sdk = anthropic.AsyncAnthropic(
        api_key=KEY,
        # The SDK appends /v1/messages itself.
        base_url=fake_upstream.base_url("claude").removesuffix("/v1"),
        max_retries=0,
        _strict_response_validation=True,
    )
    yield sdk
    await sdk.close()


async def test_stream_with_every_event_type(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.script(
        "claude",
        Reply.ok("The answer is 4.", reasoning="2 plus 2 makes 4.", chunks=3, cached_tokens=7),
        route="messages",
    )
    document: dict[str, Any] = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "2 + 2 = 4"},
        "citations": {"enabled": True},
    }
    seen: list[str] = []
    deltas: set[str] = set()
    async with client.messages.stream(
        model="claude-test",
        max_tokens=2048,
        system="Be exact.",
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": [document, {"type": "text", "text": "2+2?"}]}],
    ) as stream:
        async for event in stream:
            seen.append(event.type)
            if event.type == "content_block_delta":
                deltas.add(event.delta.type)
        message = await stream.get_final_message()
    for kind in (
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ):
        assert kind in seen
    assert deltas == {"thinking_delta", "signature_delta", "text_delta", "citations_delta"}
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].type == "text" and message.content[1].text == "The answer is 4."
    assert message.stop_reason == "end_turn"
    assert message.usage.cache_read_input_tokens == 7
    [received] = fake_upstream.received("claude", route="messages")
    # SDK 2.x sends the key as a bearer token and its own, newer anthropic-version.
    assert KEY in (received.headers.get("x-api-key"), received.headers.get("authorization", "")[7:])
    assert received.headers["anthropic-version"]


async def test_forced_tool_use_streams_input_json(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.script("claude", Reply.ok('{"city": "Paris"}', chunks=4), route="messages")
    async with client.messages.stream(
        model="claude-test",
        max_tokens=256,
        tools=[{"name": "weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "tool", "name": "weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:
        message = await stream.get_final_message()
    [block] = message.content
    assert block.type == "tool_use" and block.name == "weather"
    assert block.input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    "stop", ["max_tokens", "refusal", "model_context_window_exceeded", "pause_turn"]
)
async def test_non_streaming_message_and_stop_reasons(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream, stop: str
) -> None:
    fake_upstream.script("claude", Reply.ok("Partial", finish_reason=stop), route="messages")
    message = await client.messages.create(
        model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.stop_reason == stop
    assert message.content[0].type == "text" and message.content[0].text == "Partial"
    assert message.usage.input_tokens >= 1


async def test_prompt_cache_writes_then_reads(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream
) -> None:
    system: Any = [
        {
            "type": "text",
            "text": "A long shared preamble. " * 40,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    usages = []
    for _ in range(2):
        message = await client.messages.create(
            model="claude-test",
            max_tokens=16,
            system=system,
            messages=[{"role": "user", "content": "Question?"}],
        )
        usages.append(message.usage)
    first, second = usages
    assert first.cache_creation_input_tokens and not first.cache_read_input_tokens
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert not second.cache_creation_input_tokens
    assert first.input_tokens == second.input_tokens >= 1  # the uncached tail only


@pytest.mark.parametrize(
    ("reply", "exception", "kind"),
    [
        (Reply.error(529), anthropic.OverloadedError, "overloaded_error"),
        (Reply.error(429, retry_after=3), anthropic.RateLimitError, "rate_limit_error"),
        (Reply.error(401), anthropic.AuthenticationError, "authentication_error"),
        (Reply.error(403), anthropic.PermissionDeniedError, "permission_error"),
        (Reply.error(400, quota=True), anthropic.BadRequestError, "billing_error"),
        (Reply.error(404), anthropic.NotFoundError, "not_found_error"),
        (Reply.error(413), anthropic.APIStatusError, "request_too_large"),
        (Reply.error(504), anthropic.InternalServerError, "timeout_error"),
        (Reply.error(500), anthropic.InternalServerError, "api_error"),
    ],
)
async def test_error_answers(
    client: anthropic.AsyncAnthropic,
    fake_upstream: FakeUpstream,
    reply: Reply,
    exception: type[anthropic.APIStatusError],
    kind: str,
) -> None:
    fake_upstream.script("claude", reply, route="messages")
    with pytest.raises(exception) as caught:
        await client.messages.create(
            model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == kind
    assert caught.value.request_id == body["request_id"]


async def test_mid_stream_error_event_on_http_200(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.script("claude", Reply.mid_stream_error(after_chunks=2), route="messages")
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(
            model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            async for _ in stream:
                pass
    assert caught.value.status_code == 200
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "overloaded_error"


async def test_requests_the_real_api_refuses(
    client: anthropic.AsyncAnthropic, fake_upstream: FakeUpstream
) -> None:
    with pytest.raises(anthropic.BadRequestError, match="system"):
        await client.messages.create(
            model="claude-test",
            max_tokens=16,
            messages=[{"role": "system", "content": "x"}],  # type: ignore[list-item,typeddict-item]
        )
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        await client.messages.create(
            model="claude-test",
            max_tokens=1024,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "x"}],
        )
