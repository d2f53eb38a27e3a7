"""OpenAI-style requests -> Anthropic Messages bodies (pure conversion, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest
from pgw_anthropic.convert import convert_messages, convert_tool_choice, convert_tools
from pgw_anthropic.profile import ANTHROPIC_PROFILE
from pgw_anthropic.transport import build_messages_body
from polygateway.errors import RequestRejectedError
from polygateway.settings import SourceConfig
from polygateway.types import ChatRequest

SOURCE = SourceConfig(name="claude", provider="anthropic", base_url="http://x/v1", model="m")


def test_system_messages_are_hoisted_and_single_texts_stay_strings() -> None:
    system, messages = convert_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "developer", "content": [{"type": "text", "text": "No emojis."}]},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert system == [
        {"type": "text", "text": "Be brief."},
        {"type": "text", "text": "No emojis."},
    ]
    assert messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    system, _ = convert_messages(
        [{"role": "system", "content": "One."}, {"role": "user", "content": "x"}]
    )
    assert system == "One."


def test_image_parts_become_image_blocks() -> None:
    _, messages = convert_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
                    },
                    {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}},
                ],
            }
        ]
    )
    assert messages[0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
        },
        {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.jpg"}},
    ]


def test_tool_calls_and_results_become_tool_use_and_tool_result_blocks() -> None:
    _, messages = convert_messages(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "21C"}],
            },
            {"role": "user", "content": "Thanks"},
        ]
    )
    assert messages[1] == {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}},
        ],
    }
    # Both results and the next user text share one user turn (the API wants them together).
    assert messages[2] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
            {
                "type": "tool_result",
                "tool_use_id": "call_2",
                "content": [{"type": "text", "text": "21C"}],
            },
            {"type": "text", "text": "Thanks"},
        ],
    }


def test_tool_definitions_and_choice_are_converted() -> None:
    tools = convert_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            },
            {"type": "web_search_20250305", "name": "web_search"},
        ]
    )
    assert tools == [
        {
            "name": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            "description": "Current weather",
        },
        {"type": "web_search_20250305", "name": "web_search"},
    ]
    assert convert_tool_choice("required") == {"type": "any"}
    assert convert_tool_choice("auto") == {"type": "auto"}
    assert convert_tool_choice({"type": "function", "function": {"name": "weather"}}) == {
        "type": "tool",
        "name": "weather",
    }


def test_body_carries_max_tokens_thinking_and_converted_extra_body() -> None:
    source = SourceConfig(
        name="claude", provider="anthropic", base_url="http://x/v1", model="m", enable_thinking=True
    )
    request = ChatRequest(
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        extra_body={
            "max_completion_tokens": 5000,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
            "stop": "END",
            "temperature": 1,
        },
    )
    body = build_messages_body(request, source, ANTHROPIC_PROFILE, thinking_budget=2048)
    assert body == {
        "model": "m",
        "max_tokens": 5000,
        "system": "S",
        "messages": [{"role": "user", "content": "U"}],
        "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
        "tool_choice": {"type": "auto"},
        "stop_sequences": ["END"],
        "temperature": 1,
    }
    off = build_messages_body(
        ChatRequest(messages=[{"role": "user", "content": "U"}], stream=False),
        SourceConfig(
            name="c", provider="anthropic", base_url="u", model="m", enable_thinking=False
        ),
        ANTHROPIC_PROFILE,
    )
    assert off["thinking"] == {"type": "disabled"}
    assert off["stream"] is False


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "input_audio",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/bmp;base64,AA"}}
                    ],
                }
            ],
            "image/bmp",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/x"}}],
                }
            ],
            "data URL or http",
        ),
        ([{"role": "tool", "content": "x"}], "tool_call_id"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            "not valid JSON",
        ),
        ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
        ([{"role": "system", "content": "only a system prompt"}], "at least one user"),
        (
            [
                {
                    "role": "system",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                },
                {"role": "user", "content": "x"},
            ],
            "only hold text",
        ),
    ],
)
def test_bad_input_is_rejected_naming_what_is_wrong(
    messages: list[dict[str, Any]], needle: str
) -> None:
    with pytest.raises(RequestRejectedError) as caught:
        build_messages_body(ChatRequest(messages=messages), SOURCE, ANTHROPIC_PROFILE)
    assert needle in str(caught.value)


def test_thinking_budget_must_stay_below_max_tokens() -> None:
    source = SourceConfig(
        name="c", provider="anthropic", base_url="u", model="m", enable_thinking=True
    )
    with pytest.raises(RequestRejectedError, match="budget_tokens"):
        build_messages_body(
            ChatRequest(messages=[{"role": "user", "content": "x"}]),
            source,
            ANTHROPIC_PROFILE,
            max_tokens=1000,
            thinking_budget=1024,
        )


def test_response_format_is_refused_clearly() -> None:
    request = ChatRequest(
        messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
    )
    with pytest.raises(RequestRejectedError, match="response_format"):
        build_messages_body(request, SOURCE, ANTHROPIC_PROFILE)
