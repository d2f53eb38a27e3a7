"""``anthropic`` transport behaviour beyond the shared contract, through the fake's Messages
route: stop reasons, cache-aware usage, thinking from the provider profile, tools, errors by
type in the middle of a stream."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pgw_anthropic import pgw_register_providers
from pgw_anthropic.errors import ContextWindowExceededError
from pgw_anthropic.transport import AnthropicTransport
from polygateway.errors import ConfigError, RequestRejectedError, TransientError
from polygateway.ports import ProviderProfile
from polygateway.settings import Secret, SourceConfig
from polygateway.telemetry.pricing import PricingTable
from polygateway.testing.fake_upstream import FakeUpstream, Reply
from polygateway.types import ChatRequest

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]
Open = Callable[..., tuple[AnthropicTransport, SourceConfig]]


def _profiles() -> dict[str, ProviderProfile]:
    found: dict[str, ProviderProfile] = {}
    pgw_register_providers(lambda name, profile: found.__setitem__(name, profile))
    return found


@pytest.fixture
async def open_transport(fake_upstream: FakeUpstream) -> AsyncIterator[Open]:
    made: list[AnthropicTransport] = []

    def open_(**overrides: Any) -> tuple[AnthropicTransport, SourceConfig]:
        source = SourceConfig(
            name="claude",
            provider="anthropic",
            base_url=fake_upstream.base_url("claude"),
            model="claude-test",
            api_key=Secret("sk-ant-test-0123456789"),
        )
        source = dataclasses.replace(source, **overrides)
        transport = AnthropicTransport(source, providers=_profiles())
        made.append(transport)
        return transport, source

    yield open_
    for transport in made:
        await transport.aclose()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize(
    ("stop", "finish"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("pause_turn", "pause_turn"),
        ("stop_sequence", "stop"),
    ],
)
async def test_stop_reasons_map_to_one_vocabulary(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool, stop: str, finish: str
) -> None:
    transport, source = open_transport()
    fake_upstream.script("claude", Reply.ok("Cut short", finish_reason=stop), route="messages")
    result = await transport.send(
        ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c"
    )
    assert (result.content, result.finish_reason) == ("Cut short", finish)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_context_window_exceeded_is_its_own_rejection(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_transport()
    fake_upstream.script(
        "claude", Reply.ok("x", finish_reason="model_context_window_exceeded"), route="messages"
    )
    with pytest.raises(ContextWindowExceededError) as caught:
        await transport.send(ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c")
    assert isinstance(caught.value, RequestRejectedError)


async def test_an_empty_refusal_is_rejected_not_retried(
    open_transport: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script("claude", Reply.ok("", finish_reason="refusal"), route="messages")
    with pytest.raises(RequestRejectedError, match="refusal"):
        await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    # With text, a refusal is an answer (finish_reason content_filter, as OpenAI reports it).
    fake_upstream.script(
        "claude", Reply.ok("I can't help.", finish_reason="refusal"), route="messages"
    )
    result = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    assert result.finish_reason == "content_filter"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_cache_reads_and_writes_are_recorded_apart_and_priced_once(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_transport()
    preamble = "A long shared preamble. " * 40
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": [{"type": "text", "text": preamble, "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "user", "content": "Question?"},
    ]
    request = ChatRequest(messages=messages, stream=stream)
    first = await transport.send(request, source, call_id="c1")
    second = await transport.send(request, source, call_id="c2")
    bodies = [r.body for r in fake_upstream.received("claude", route="messages")]
    assert bodies[0]["system"][0]["cache_control"] == {"type": "ephemeral"}
    written = first.cache_write_tokens
    assert written > 0 and first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == written and second.cache_write_tokens == 0
    # prompt_tokens is the whole prompt: uncached input + cache writes + cache reads.
    assert first.prompt_tokens == second.prompt_tokens > written
    table = PricingTable(
        {
            "claude-test": {
                "input_per_1m": 3.0,
                "output_per_1m": 15.0,
                "cached_input_per_1m": 0.3,
                "cache_write_per_1m": 3.75,
            }
        }
    )
    uncached = first.prompt_tokens - written
    assert table.cost(
        "claude-test",
        second.prompt_tokens,
        second.completion_tokens,
        cached_tokens=second.cached_prompt_tokens,
    ) == pytest.approx((uncached * 3.0 + written * 0.3 + second.completion_tokens * 15.0) / 1e6)
    assert table.cost(
        "claude-test",
        first.prompt_tokens,
        first.completion_tokens,
        cache_write_tokens=first.cache_write_tokens,
    ) == pytest.approx((uncached * 3.0 + written * 3.75 + first.completion_tokens * 15.0) / 1e6)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_thinking_from_the_provider_profile(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_transport(
        enable_thinking=True, options={"thinking_budget_tokens": "2048", "max_tokens": "8192"}
    )
    fake_upstream.script("claude", Reply.ok("4.", reasoning="2 plus 2."), route="messages")
    result = await transport.send(
        ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c"
    )
    assert (result.content, result.thinking) == ("4.", "2 plus 2.")
    [received] = fake_upstream.received("claude", route="messages")
    assert received.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert received.body["max_tokens"] == 8192
    assert received.body["system"] == "Be brief."


async def test_tool_definitions_and_forced_tool_use(
    open_transport: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script("claude", Reply.ok('{"city": "Paris"}'), route="messages")
    request = ChatRequest(
        messages=[{"role": "user", "content": "Weather?"}],
        extra_body={
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "weather", "parameters": {"type": "object"}},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
        },
    )
    result = await transport.send(request, source, call_id="c")
    # A tool call is an answer even without text; the call API issue surfaces its arguments.
    assert result.finish_reason == "tool_calls"
    [received] = fake_upstream.received("claude", route="messages")
    assert received.body["tools"] == [{"name": "weather", "input_schema": {"type": "object"}}]
    assert received.body["tool_choice"] == {"type": "tool", "name": "weather"}


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("overloaded_error", TransientError), ("invalid_request_error", RequestRejectedError)],
)
async def test_mid_stream_error_is_classified_by_its_type(
    open_transport: Open, fake_upstream: FakeUpstream, kind: str, expected: type[Exception]
) -> None:
    transport, source = open_transport()
    reply = dataclasses.replace(Reply.mid_stream_error(after_chunks=2), error_type=kind)
    fake_upstream.script("claude", reply, route="messages")
    with pytest.raises(expected, match=kind) as caught:
        await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    assert type(caught.value) is expected


async def test_rate_limit_error_carries_retry_after(
    open_transport: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script("claude", Reply.error(429, retry_after=4), route="messages")
    with pytest.raises(TransientError) as caught:
        await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    assert (caught.value.retry_after_s, caught.value.reason) == (4.0, "rate_limited")


async def test_missing_message_stop_can_be_salvaged(
    open_transport: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(missing_done="salvage")
    fake_upstream.script("claude", Reply.cut(after_chunks=2), route="messages")
    result = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    assert result.salvaged and result.content
    assert result.usage_source == "estimated"


def test_bad_options_are_config_errors() -> None:
    source = SourceConfig(name="c", provider="anthropic", base_url="http://x/v1", model="m")
    with pytest.raises(ConfigError, match="max_tokens"):
        AnthropicTransport(dataclasses.replace(source, options={"max_tokens": "lots"}))
    with pytest.raises(ConfigError, match="thinking_budget_tokens"):
        AnthropicTransport(dataclasses.replace(source, options={"thinking_budget_tokens": 0}))
    with pytest.raises(ConfigError, match="base_url"):
        AnthropicTransport(dataclasses.replace(source, base_url=" "))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_generation_parameters_are_mapped_onto_the_messages_body(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    from polygateway.params import ChatParams

    transport, source = open_transport(params=ChatParams(temperature=0.9, max_tokens=500))
    params = ChatParams(
        model="claude-other",
        temperature=0.2,
        top_p=0.7,
        stop="END",
        tools=({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},),
        tool_choice="required",
        parallel_tool_calls=False,
        user="u1",
    )
    request = ChatRequest(messages=MESSAGES, stream=stream, params=params)
    await transport.send(request, source, call_id="c")
    [received] = fake_upstream.received("claude", route="messages")
    body = received.body
    assert (body["model"], body["max_tokens"], body["temperature"], body["top_p"]) == (
        "claude-other",
        500,
        0.2,
        0.7,
    )
    assert body["stop_sequences"] == ["END"]
    assert body["tools"] == [{"name": "f", "input_schema": {"type": "object"}}]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["metadata"] == {"user_id": "u1"}


@pytest.mark.parametrize("name", ["seed", "presence_penalty", "frequency_penalty"])
async def test_parameters_without_a_messages_field_are_refused(
    open_transport: Open, fake_upstream: FakeUpstream, name: str
) -> None:
    from polygateway.params import ChatParams

    transport, source = open_transport()
    request = ChatRequest(messages=MESSAGES, params=ChatParams(**{name: 1}))
    with pytest.raises(RequestRejectedError, match=name):
        await transport.send(request, source, call_id="c")
    assert fake_upstream.requests("claude", route="messages") == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_tool_use_becomes_tool_calls(
    open_transport: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    from polygateway.params import ChatParams

    transport, source = open_transport()
    fake_upstream.script(
        "claude", Reply.ok('{"city": "Paris", "n": [1, 2]}', chunks=5), route="messages"
    )
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    params = ChatParams(tools=(tool,), tool_choice="required")
    request = ChatRequest(messages=MESSAGES, stream=stream, params=params)
    result = await transport.send(request, source, call_id="c")
    assert result.finish_reason == "tool_calls"
    (call,) = result.tool_calls
    assert (call.name, call.id.startswith("toolu_fake")) == ("lookup", True)
    assert call.parsed_arguments() == {"city": "Paris", "n": [1, 2]}


async def test_a_large_json_message_arrives_whole(
    open_transport: Open, fake_upstream: FakeUpstream
) -> None:
    # Parsed while it arrives: every cut a chunk boundary can make (escapes, UTF-8, astral).
    piece = 'plain "quoted" back\\slash\nline é 中 😀 '
    content = (piece * 20_000)[:600_000]
    transport, source = open_transport()
    fake_upstream.script("claude", Reply.ok(content), route="messages")
    result = await transport.send(ChatRequest(messages=MESSAGES, stream=False), source, call_id="c")
    assert result.content == content
