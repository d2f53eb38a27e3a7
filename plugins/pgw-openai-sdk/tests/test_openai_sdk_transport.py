"""``openai-sdk`` behaviour beyond the shared contract: the SDK's settings, thinking through
``extra_body``, cached-token usage, the same error classes as openai-compat for every
scripted answer, and what the SDK reports for streams that end without ``[DONE]``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from pgw_openai_sdk.transport import OpenAISDKTransport
from polygateway.errors import ConfigError, PolyGatewayError, SourceDeadError, TransientError
from polygateway.ports import Transport
from polygateway.settings import Secret, SourceConfig
from polygateway.testing.contracts.transport import ERROR_TABLE
from polygateway.testing.fake_upstream import FakeUpstream, Reply
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest

KEY = "sk-sdk-test-0123456789abcdef"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
Open = Callable[..., tuple[Transport, SourceConfig]]


def _source(base_url: str, **overrides: Any) -> SourceConfig:
    source = SourceConfig(
        name="sdk", provider="generic", base_url=base_url, model="m", api_key=Secret(KEY)
    )
    return dataclasses.replace(source, **overrides)


@pytest.fixture
async def opened() -> AsyncIterator[list[Transport]]:
    made: list[Transport] = []
    yield made
    for transport in made:
        await transport.aclose()


@pytest.fixture
def open_sdk(fake_upstream: FakeUpstream, opened: list[Transport]) -> Open:
    def open_(**overrides: Any) -> tuple[Transport, SourceConfig]:
        source = _source(fake_upstream.base_url("sdk"), **overrides)
        transport = OpenAISDKTransport(source)
        opened.append(transport)
        return transport, source

    return open_


async def test_sdk_retries_are_off_and_timeouts_come_from_the_source(
    open_sdk: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_sdk(connect_timeout_s=3.5, options={"read_timeout_s": "40"})
    fake_upstream.script("sdk", Reply.error(503), Reply.ok("second"))
    with pytest.raises(TransientError):
        await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
    assert fake_upstream.requests("sdk") == 1  # the SDK did not retry the 503 itself
    assert isinstance(transport, OpenAISDKTransport)
    client = transport.client
    assert client is not None and client.max_retries == 0
    timeout = client.timeout
    assert not isinstance(timeout, float | int) and timeout is not None
    assert (timeout.connect, timeout.read, timeout.pool) == (3.5, 40.0, 3.5)


async def test_the_total_deadline_bounds_a_non_streaming_call(
    open_sdk: Open, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_sdk(timeout_s=0.2)
    fake_upstream.script("sdk", Reply.ok(headers_delay=5.0))
    with pytest.raises(TransientError, match=r"no complete answer within 0\.2s"):
        await transport.send(ChatRequest(messages=MESSAGES, stream=False), source, call_id="c")


@pytest.mark.parametrize(
    ("provider", "field"),
    [("qwen", {"enable_thinking": True}), ("deepseek", {"thinking": {"type": "enabled"}})],
)
async def test_thinking_parameters_go_through_extra_body(
    open_sdk: Open, fake_upstream: FakeUpstream, provider: str, field: dict[str, Any]
) -> None:
    transport, source = open_sdk(provider=provider, enable_thinking=True)
    request = ChatRequest(messages=MESSAGES, extra_body={"temperature": 0.1, "top_k": 3})
    await transport.send(request, source, call_id="c")
    [received] = fake_upstream.received("sdk")
    for key, value in field.items():
        assert received.body[key] == value
    assert (received.body["temperature"], received.body["top_k"]) == (0.1, 3)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_cached_prompt_tokens_are_reported(
    open_sdk: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_sdk()
    fake_upstream.script("sdk", Reply.ok("ok", prompt_tokens=2000, cached_tokens=1536))
    result = await transport.send(
        ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c"
    )
    assert (result.prompt_tokens, result.cached_prompt_tokens) == (2000, 1536)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize(
    "reply", [pytest.param(r, id=i) for i, r, _, _ in ERROR_TABLE if r.kind == "error"]
)
async def test_same_error_as_openai_compat(
    fake_upstream: FakeUpstream, opened: list[Transport], reply: Reply, stream: bool
) -> None:
    errors: list[PolyGatewayError] = []
    for make in (OpenAISDKTransport, OpenAICompatTransport):
        source = _source(fake_upstream.base_url("same"))
        transport = make(source)
        opened.append(transport)
        fake_upstream.script("same", dataclasses.replace(reply, retry_after=3))
        with pytest.raises(PolyGatewayError) as caught:
            await transport.send(ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c")
        errors.append(caught.value)
    sdk, compat = errors
    assert type(sdk) is type(compat)
    assert str(sdk) == str(compat)
    for name in ("status", "reason", "retry_after_s"):
        assert getattr(sdk, name, None) == getattr(compat, name, None)


async def test_unusable_url_is_a_dead_source(opened: list[Transport]) -> None:
    source = _source("ftp://127.0.0.1:9/v1")
    transport = OpenAISDKTransport(source)
    opened.append(transport)
    with pytest.raises(SourceDeadError, match="unusable URL"):
        await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="engine 'httpx'"):
        OpenAISDKTransport(_source("http://x/v1", options={"engine": "httpx"}))
    with pytest.raises(ConfigError, match="headers"):
        OpenAISDKTransport(_source("http://x/v1", options={"headers": "x"}))


# --------------------------------------------------------------------------- missing [DONE]

_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
_CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[%s],"usage":%s}\n\n'
)
_ROLE = b'{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}'
_TEXT = b'{"index":0,"delta":{"content":"Hello"},"finish_reason":null}'
_FINISH = b'{"index":0,"delta":{},"finish_reason":"stop"}'
_USAGE = b'{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}'

ENDINGS: dict[str, bytes] = {
    "complete": _CHUNK % (_ROLE, b"null")
    + _CHUNK % (_TEXT, b"null")
    + _CHUNK % (_FINISH, b"null")
    + _CHUNK % (b"", _USAGE)
    + b"data: [DONE]\n\n",
    "no-done": _CHUNK % (_ROLE, b"null")
    + _CHUNK % (_TEXT, b"null")
    + _CHUNK % (_FINISH, b"null")
    + _CHUNK % (b"", _USAGE),
    "cut-after-finish": _CHUNK % (_ROLE, b"null")
    + _CHUNK % (_TEXT, b"null")
    + _CHUNK % (_FINISH, b"null"),
    "cut-before-finish": _CHUNK % (_ROLE, b"null") + _CHUNK % (_TEXT, b"null"),
}


@pytest.fixture
async def raw_stream_server() -> AsyncIterator[Callable[[bytes], str]]:
    """A loopback HTTP server answering every request with the bytes it is given, then
    closing the connection (the end of a body without ``[DONE]``, exactly)."""
    body: list[bytes] = [b""]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        writer.write(_HEAD + body[0])
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def serve(data: bytes) -> str:
        body[0] = data
        return f"http://127.0.0.1:{port}/v1"

    yield serve
    server.close()
    await server.wait_closed()


# What each party reports for each ending (measured by the test below; README table).
EXPECTED: dict[str, tuple[int, str, str]] = {
    # ending: (chunks the raw SDK iterator yields without raising, openai-sdk, openai-compat)
    "complete": (4, "answer", "answer"),
    "no-done": (4, "answer", "answer"),
    "cut-after-finish": (3, "answer (usage estimated)", "answer (usage estimated)"),
    "cut-before-finish": (2, "TransientError", "TransientError"),
}


def _outcome(result: Any) -> str:
    if isinstance(result, Exception):
        return type(result).__name__
    return "answer" if result.usage_source == "measured" else "answer (usage estimated)"


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_what_the_sdk_reports_for_a_stream_without_done(
    raw_stream_server: Callable[[bytes], str], opened: list[Transport], ending: str
) -> None:
    base_url = raw_stream_server(ENDINGS[ending])
    sdk = openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0)
    try:
        stream = await sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        chunks = [chunk async for chunk in stream]  # ends quietly: no [DONE] is no error
    finally:
        await sdk.close()
    outcomes: list[str] = []
    for make in (OpenAISDKTransport, OpenAICompatTransport):
        source = _source(base_url)
        transport = make(source)
        opened.append(transport)
        try:
            result: Any = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c")
        except TransientError as exc:
            result = exc
        outcomes.append(_outcome(result))
    assert (len(chunks), *outcomes) == EXPECTED[ending]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_generation_parameters_reach_the_wire(
    open_sdk: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    from polygateway.params import ChatParams

    transport, source = open_sdk(provider="openai", params=ChatParams(temperature=0.5, seed=1))
    params = ChatParams(
        model="per-call",
        temperature=0.2,
        max_tokens=33,
        stop=("END",),
        tools=({"type": "function", "function": {"name": "f"}},),
        tool_choice="required",
        user="u1",
        extra_body={"top_k": 4},
    )
    request = ChatRequest(messages=MESSAGES, stream=stream, params=params)
    await transport.send(request, source, call_id="c")
    [received] = fake_upstream.received("sdk")
    body = received.body
    assert body["model"] == "per-call"
    assert (body["temperature"], body["seed"], body["max_completion_tokens"]) == (0.2, 1, 33)
    assert (body["stop"], body["tool_choice"], body["user"], body["top_k"]) == (
        ["END"],
        "required",
        "u1",
        4,
    )
    assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_tool_calls_are_assembled(
    open_sdk: Open, fake_upstream: FakeUpstream, stream: bool
) -> None:
    from polygateway.types import ToolCall

    transport, source = open_sdk()
    calls = (("call_1", "lookup", '{"q": "Paris"}'), ("call_2", "time", "{}"))
    fake_upstream.script(
        "sdk", Reply.ok("", tool_calls=calls, finish_reason="tool_calls", chunks=3)
    )
    result = await transport.send(
        ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c"
    )
    assert result.finish_reason == "tool_calls"
    assert result.tool_calls == tuple(ToolCall(*call) for call in calls)


async def test_client_stream_yields_deltas_as_the_chunks_arrive(
    fake_upstream: FakeUpstream,
) -> None:
    from polygateway import GatewayClient
    from polygateway.settings import CacheSettings, ScopeSettings

    text = "one two three four five six seven eight"
    fake_upstream.script(
        "sdk",
        Reply.ok(
            text,
            reasoning="thinking it over",
            chunks=6,
            inter_token_delay=0.05,
            tool_calls=[("call-1", "lookup", '{"city": "Paris"}')],
            finish_reason="tool_calls",
        ),
    )
    source = _source(fake_upstream.base_url("sdk"), transport="openai-sdk")
    settings = ScopeSettings(
        scope="LLM",
        sources=(source,),
        cache=CacheSettings(backend="none"),
        middleware=("structured",),
    )
    deltas = []
    in_flight_at_first_content: int | None = None
    async with (
        GatewayClient(settings) as client,
        client.stream(MESSAGES) as stream,
    ):
        assert type(client.components.transports["sdk"]).__name__ == "OpenAISDKTransport"
        async for delta in stream:
            if delta.kind == "content" and in_flight_at_first_content is None:
                in_flight_at_first_content = fake_upstream.inflight("sdk")
            deltas.append(delta)
    response = stream.response
    # The first content arrived while the upstream was still sending the rest.
    assert in_flight_at_first_content == 1
    content = [d.text for d in deltas if d.kind == "content"]
    assert len(content) >= 3
    assert "".join(content) == text == response.content
    assert deltas[0].kind == "thinking"
    assert "".join(d.text for d in deltas if d.kind == "thinking") == "thinking it over"
    assert response.thinking == "thinking it over"
    calls = [d for d in deltas if d.kind == "tool_call"]
    assert (calls[0].tool_call_id, calls[0].name) == ("call-1", "lookup")
    assert "".join(d.text for d in calls) == '{"city": "Paris"}'
    assert response.tool_calls[0].parsed_arguments() == {"city": "Paris"}
