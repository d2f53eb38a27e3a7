"""Built-in provider profiles and request body assembly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from polygateway.context import CallContext
from polygateway.errors import RequestRejectedError
from polygateway.providers import BUILTIN_PROFILES, builtin_profiles_by_name
from polygateway.settings import SourceConfig
from polygateway.transports.openai_compat import (
    build_request_body,
    estimate_completion_tokens,
    estimate_prompt_tokens,
    json_dumps,
)
from polygateway.types import ChatRequest

SOURCE = SourceConfig(name="s", provider="generic", base_url="http://x/v1", model="m")


def test_builtin_profiles() -> None:
    profiles = builtin_profiles_by_name()
    assert set(profiles) == {"openai", "deepseek", "qwen", "zhipu", "generic"}
    assert len(BUILTIN_PROFILES) == 5
    assert profiles["openai"].supports_native_schema
    assert profiles["openai"].thinking_body is None
    assert profiles["generic"].thinking_body is None
    deepseek, qwen = profiles["deepseek"], profiles["qwen"]
    assert deepseek.thinking_body is not None and qwen.thinking_body is not None
    assert deepseek.thinking_body(True) == {"thinking": {"type": "enabled"}}
    assert deepseek.thinking_body(False) == {"thinking": {"type": "disabled"}}
    assert qwen.thinking_body(True) == {"enable_thinking": True}
    assert qwen.thinking_requires_stream and not deepseek.thinking_requires_stream


def test_body_fields_and_order_of_precedence() -> None:
    messages = ({"role": "user", "content": "hi"},)
    request = ChatRequest(
        messages=messages,
        response_format={"type": "json_object"},
        extra_body={"stream_options": {"include_usage": False}, "seed": 1},
    )
    body = build_request_body(request, SOURCE, builtin_profiles_by_name()["generic"])
    assert body["model"] == "m"
    assert body["messages"] == list(messages)
    assert body["stream"] is True
    assert body["response_format"] == {"type": "json_object"}
    # extra_body is merged last: the caller's explicit choice wins.
    assert body["stream_options"] == {"include_usage": False}
    assert body["seed"] == 1


def test_non_stream_body_has_no_stream_options() -> None:
    body = build_request_body(
        ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=False), SOURCE, None
    )
    assert body["stream"] is False and "stream_options" not in body


def test_empty_messages_are_rejected() -> None:
    with pytest.raises(RequestRejectedError, match="messages"):
        build_request_body(ChatRequest(messages=[]), SOURCE, None)


def test_json_dumps_handles_read_only_mappings_and_keeps_unicode() -> None:
    from types import MappingProxyType

    message: Any = MappingProxyType({"role": "user", "content": ("中文", "✓")})
    raw = json_dumps({"messages": [message]})
    assert json.loads(raw) == {"messages": [{"role": "user", "content": ["中文", "✓"]}]}
    assert "中文".encode() in raw


def test_token_estimates() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    messages = [{"role": "user", "content": [image]}]
    small = estimate_prompt_tokens(messages)
    # The base64 payload is counted by its digest, not its size.
    assert 1 <= small < 200
    # From the JSON the call's context holds (shared with the cache key and the rows): equal.
    context = CallContext()
    assert estimate_prompt_tokens(messages, context) == small
    assert context.canonical_messages(messages) is context.canonical_messages(messages)
    assert estimate_completion_tokens("abcdefgh") == 2
    assert estimate_completion_tokens("abc", "d") == 1
    assert estimate_completion_tokens("") == 0


async def test_unserialisable_body_is_rejected_before_sending() -> None:
    from polygateway.transports.openai_compat import OpenAICompatTransport

    transport = OpenAICompatTransport(SOURCE)
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], extra_body={"x": object()})
    try:
        with pytest.raises(RequestRejectedError, match="JSON"):
            await transport.send(request, SOURCE, call_id="c")
    finally:
        await transport.aclose()
