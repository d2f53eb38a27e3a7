"""Tool calls through the fake upstream: assembled from streamed fragments and read from a
JSON answer, valid and cacheable with no text, and sent back as the next turn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from client_helpers import MESSAGES, http_client
from polygateway import ToolCall, assistant_message
from polygateway.settings import CacheSettings
from polygateway.testing import FakeUpstream, Reply

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CALLS = (
    ("call_1", "lookup", '{"city": "Paris", "days": [1, 2, 3]}'),
    ("call_2", "weather", '{"when": "tomorrow"}'),
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_tool_calls_are_assembled_and_round_trip(fake: FakeUpstream, stream: bool) -> None:
    fake.script(
        "a",
        Reply.ok("", tool_calls=CALLS, finish_reason="tool_calls", chunks=4),
        Reply.ok("It is sunny in Paris."),
    )
    async with http_client(fake, ["a"]) as client:
        first = await client.chat(MESSAGES, tools=[TOOL], stream=stream)
        assert first.finish_reason == "tool_calls"
        assert first.content == ""
        assert first.tool_calls == tuple(ToolCall(*call) for call in CALLS)
        assert first.tool_calls[0].parsed_arguments() == {"city": "Paris", "days": [1, 2, 3]}
        follow_up = [
            *MESSAGES,
            assistant_message(first),
            *(
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
                for call in first.tool_calls
            ),
        ]
        second = await client.chat(follow_up, tools=[TOOL], stream=stream)
    assert second.content == "It is sunny in Paris."
    sent = fake.received("a")[1].body["messages"]
    assert sent[1]["tool_calls"][1] == {
        "id": "call_2",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"when": "tomorrow"}'},
    }
    assert sent[1]["content"] is None
    assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]


async def test_a_tool_call_answer_is_cached(fake: FakeUpstream) -> None:
    fake.script("a", Reply.ok("", tool_calls=CALLS[:1], finish_reason="tool_calls"))
    cache = CacheSettings(backend="memory", namespace="t", ttl_s=60.0)
    async with http_client(fake, ["a"], cache=cache) as client:
        first = await client.chat(MESSAGES, tools=[TOOL])
        hit = await client.chat(MESSAGES, tools=[TOOL])
    assert hit.cache_hit and not first.cache_hit
    assert hit.tool_calls == first.tool_calls == (ToolCall(*CALLS[0]),)
    assert hit.finish_reason == "tool_calls"
    assert fake.requests("a") == 1


def test_arguments_that_are_not_json_name_the_call() -> None:
    call = ToolCall("call_9", "lookup", '{"city": ')
    with pytest.raises(ValueError, match=r"call_9.*lookup"):
        call.parsed_arguments()
    assert ToolCall("c", "f").parsed_arguments() == {}
