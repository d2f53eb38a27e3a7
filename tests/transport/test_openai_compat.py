"""The ``openai-compat`` transport at the HTTP level, on every engine, through the fake upstream."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from polygateway.errors import (
    ConfigError,
    RequestRejectedError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.ports import ProviderProfile, Transport
from polygateway.settings import Secret, SourceConfig
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import (
    MESSAGES,
    OpenTransport,
    TransportContract,
    wait_until,
)
from polygateway.testing.fake_upstream import DEFAULT_CONTENT
from polygateway.transports.aiohttp_engine import AiohttpEngine
from polygateway.transports.engines import DEFAULT_ENGINE, ENGINE_NAMES, PROXY_ENGINE
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest, TransportResult

# Engines on optional packages run when their package is installed and are skipped otherwise.
_ENGINE_MODULES = {"httpx-aiohttp": "httpx_aiohttp", "httpx2": "httpx2"}
ENGINES = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            name in _ENGINE_MODULES and importlib.util.find_spec(_ENGINE_MODULES[name]) is None,
            reason=f"engine {name!r}: optional package not installed",
        ),
    )
    for name in ENGINE_NAMES
]


def _on_engine(engine: str) -> Callable[[SourceConfig], Transport]:
    def make(source: SourceConfig) -> Transport:
        options = {**source.options, "engine": engine}
        return OpenAICompatTransport(dataclasses.replace(source, options=options))

    return make


class TestOpenAICompatContract(TransportContract):
    @pytest.fixture(params=ENGINES)
    def make_transport(self, request: pytest.FixtureRequest) -> Callable[[SourceConfig], Transport]:
        return _on_engine(request.param)


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_transport(
    engine: str, fake_upstream: FakeUpstream
) -> AsyncIterator[Callable[..., tuple[OpenAICompatTransport, SourceConfig]]]:
    made: list[OpenAICompatTransport] = []

    def open_(
        source_name: str = "oc",
        *,
        providers: dict[str, ProviderProfile] | None = None,
        **overrides: Any,
    ) -> tuple[OpenAICompatTransport, SourceConfig]:
        options = {"engine": engine, **overrides.pop("options", {})}
        source = SourceConfig(
            name=source_name,
            provider=overrides.pop("provider", "generic"),
            base_url=fake_upstream.base_url(source_name),
            model="m1",
            api_key=overrides.pop("api_key", Secret("sk-test-key")),
            options=options,
            **overrides,
        )
        transport = OpenAICompatTransport(source, providers=providers)
        made.append(transport)
        return transport, source

    yield open_
    for transport in made:
        await transport.aclose()


def _chat(stream: bool = True, **fields: Any) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, stream=stream, **fields)


# --------------------------------------------------------------------------- body


@pytest.mark.parametrize(
    ("provider", "enable_thinking", "expected"),
    [
        ("deepseek", True, {"thinking": {"type": "enabled"}}),
        ("deepseek", False, {"thinking": {"type": "disabled"}}),
        ("qwen", True, {"enable_thinking": True}),
        ("qwen", False, {"enable_thinking": False}),
        ("openai", True, {}),
        ("generic", True, {}),
        ("qwen", None, {}),
    ],
)
async def test_thinking_parameters_follow_the_provider_profile(
    open_transport: OpenTransport,
    fake_upstream: FakeUpstream,
    provider: str,
    enable_thinking: bool | None,
    expected: dict[str, Any],
) -> None:
    transport, source = open_transport(provider=provider, enable_thinking=enable_thinking)
    await transport.send(_chat(), source, call_id="c")
    [received] = fake_upstream.received(source.name)
    thinking_fields = {
        k: v for k, v in received.body.items() if k in ("thinking", "enable_thinking")
    }
    assert thinking_fields == expected


async def test_qwen_thinking_without_stream_is_rejected_before_sending(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(provider="qwen", enable_thinking=True)
    with pytest.raises(RequestRejectedError, match="stream"):
        await transport.send(_chat(stream=False), source, call_id="c")
    assert fake_upstream.requests(source.name) == 0
    # Thinking off is fine without streaming.
    off = dataclasses.replace(source, enable_thinking=False)
    await transport.send(_chat(stream=False), off, call_id="c")
    assert fake_upstream.received(source.name)[0].body["enable_thinking"] is False


async def test_response_format_and_extra_body_are_sent_extra_body_last(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(provider="deepseek", enable_thinking=True)
    response_format = {"type": "json_object"}
    request = _chat(
        response_format=response_format,
        extra_body={"temperature": 0.25, "thinking": {"type": "disabled"}},
    )
    await transport.send(request, source, call_id="c")
    body = fake_upstream.received(source.name)[0].body
    assert body["response_format"] == response_format
    assert body["temperature"] == 0.25
    assert body["thinking"] == {"type": "disabled"}


async def test_unknown_provider_with_thinking_warns_once(
    open_transport: OpenTransport, fake_upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    transport, source = open_transport(provider="mystery", enable_thinking=True)
    with caplog.at_level(logging.WARNING, logger="polygateway.transports.openai_compat"):
        await transport.send(_chat(), source, call_id="c1")
        await transport.send(_chat(), source, call_id="c2")
    warnings = [r for r in caplog.records if "mystery" in r.getMessage()]
    assert len(warnings) == 1
    assert "thinking" not in fake_upstream.received(source.name)[0].body


async def test_registered_profile_is_used(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    profile = ProviderProfile(name="glm", thinking_body=lambda on: {"thinking": {"type": str(on)}})
    transport, source = open_transport(
        provider="glm", enable_thinking=True, providers={"glm": profile}
    )
    await transport.send(_chat(), source, call_id="c")
    assert fake_upstream.received(source.name)[0].body["thinking"] == {"type": "True"}


async def test_no_api_key_sends_no_authorization_header(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(api_key=Secret(""))
    await transport.send(_chat(), source, call_id="c")
    headers = fake_upstream.received(source.name)[0].headers
    assert "authorization" not in headers
    assert headers["content-type"] == "application/json"


async def test_extra_headers_option_and_trailing_slash(
    engine: str, fake_upstream: FakeUpstream
) -> None:
    source = SourceConfig(
        name="slash",
        provider="generic",
        base_url=fake_upstream.base_url("slash") + "/",
        model="m1",
        options={"engine": engine, "headers": {"X-Title": "pgw"}},
    )
    transport = OpenAICompatTransport(source)
    try:
        await transport.send(_chat(), source, call_id="c")
    finally:
        await transport.aclose()
    [received] = fake_upstream.received("slash")
    assert received.path == "/slash/v1/chat/completions"
    assert received.headers["x-title"] == "pgw"


def test_bad_options_are_config_errors() -> None:
    base = SourceConfig(name="s", provider="generic", base_url="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(ConfigError, match="engine"):
        OpenAICompatTransport(dataclasses.replace(base, options={"engine": "curl"}))
    with pytest.raises(ConfigError, match="trust_env"):
        OpenAICompatTransport(dataclasses.replace(base, options={"trust_env": "maybe"}))
    with pytest.raises(ConfigError, match="read_timeout_s"):
        OpenAICompatTransport(dataclasses.replace(base, options={"read_timeout_s": "soon"}))
    with pytest.raises(ConfigError, match="base_url"):
        OpenAICompatTransport(dataclasses.replace(base, base_url=" "))
    transport = OpenAICompatTransport(
        dataclasses.replace(base, options={"engine": "HTTPX", "trust_env": "true"})
    )
    assert transport.engine.name == "httpx"


@pytest.mark.parametrize(
    ("engine", "module"),
    [("httpx2", "httpx2"), ("httpx-aiohttp", "httpx_aiohttp")],
)
def test_engine_on_a_missing_optional_package_names_the_pip_command(
    engine: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes ``import module`` fail
    base = SourceConfig(name="s", provider="generic", base_url="http://127.0.0.1:9/v1", model="m")
    # The package itself, as the core's extra of the same name lists it (it is on PyPI).
    with pytest.raises(ConfigError, match=rf"pip install '{re.escape(engine)}>="):
        OpenAICompatTransport(dataclasses.replace(base, options={"engine": engine}))


def test_default_engine_is_httptools_and_engines_are_named() -> None:
    base = SourceConfig(name="s", provider="generic", base_url="http://127.0.0.1:9/v1", model="m")
    assert OpenAICompatTransport(base).engine.name == DEFAULT_ENGINE == "httptools"
    # The default engine reads no proxy variables: a source that asks for them without naming
    # an engine gets aiohttp, and naming httptools with them is refused.
    proxied = dataclasses.replace(base, options={"trust_env": "true"})
    assert OpenAICompatTransport(proxied).engine.name == PROXY_ENGINE == "aiohttp"
    with pytest.raises(ConfigError, match="trust_env"):
        OpenAICompatTransport(
            dataclasses.replace(base, options={"trust_env": True, "engine": "httptools"})
        )
    for name in ENGINE_NAMES:
        module = _ENGINE_MODULES.get(name)
        if module is None or importlib.util.find_spec(module) is not None:
            transport = OpenAICompatTransport(dataclasses.replace(base, options={"engine": name}))
            assert transport.engine.name == name


# --------------------------------------------------------------------------- stream outcomes


async def test_salvage_returns_the_partial_answer_with_estimated_usage(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(missing_done="salvage")
    fake_upstream.script(source.name, Reply.cut(after_chunks=2))
    result = await transport.send(_chat(), source, call_id="c")
    assert result.content
    assert DEFAULT_CONTENT.startswith(result.content)
    assert len(result.content) < len(DEFAULT_CONTENT)
    assert result.usage_source == "estimated"
    assert result.salvaged
    assert result.completion_tokens >= 1


async def test_salvage_never_returns_an_empty_answer(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(missing_done="salvage")
    fake_upstream.script(source.name, Reply.cut(after_chunks=0), Reply.early_eof())
    for _ in range(2):
        with pytest.raises(TransientError, match="early EOF"):
            await transport.send(_chat(), source, call_id="c")


async def test_missing_usage_is_estimated(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script(source.name, Reply.ok("x" * 40, include_usage=False))
    result = await transport.send(_chat(), source, call_id="c")
    assert result.usage_source == "estimated"
    assert result.completion_tokens == 10
    assert result.prompt_tokens >= 1


async def test_measured_ttft_and_gaps(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script(
        source.name, Reply.ok("abcd", chunks=4, first_token_delay=0.05, inter_token_delay=0.03)
    )
    result = await transport.send(_chat(), source, call_id="c")
    assert result.content == "abcd"
    assert result.ttft_ms is not None and result.ttft_ms >= 45
    assert result.max_inter_token_ms is not None and result.max_inter_token_ms >= 25
    assert result.latency_ms >= 130


async def test_concurrent_calls_share_one_pool(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    results = await asyncio.gather(
        *(transport.send(_chat(), source, call_id=str(i)) for i in range(50))
    )
    assert all(r.content for r in results)
    assert fake_upstream.requests(source.name) == 50
    await wait_until(lambda: fake_upstream.inflight(source.name) == 0)


async def test_aiohttp_connections_are_reused_and_released(fake_upstream: FakeUpstream) -> None:
    source = SourceConfig(
        name="pool",
        provider="generic",
        base_url=fake_upstream.base_url("pool"),
        model="m",
        options={"engine": "aiohttp"},
    )
    transport = OpenAICompatTransport(source)
    try:
        for stream in (True, False, True):
            await transport.send(_chat(stream), source, call_id="c")
        engine = transport.engine
        assert isinstance(engine, AiohttpEngine) and engine.session is not None
        connector = engine.session.connector
        assert connector is not None
        # One keep-alive connection served all three calls; none is held.
        assert len(connector._conns) == 1  # the pool's own bookkeeping
        assert not connector._acquired
        # A cancelled stream closes its connection instead of returning it half-read.
        fake_upstream.script("pool", Reply.ok("a b c", chunks=3, inter_token_delay=30.0))
        before = fake_upstream.requests("pool")  # the last answer may still count as in flight
        task = asyncio.create_task(transport.send(_chat(), source, call_id="c"))
        await wait_until(
            lambda: fake_upstream.requests("pool") > before and fake_upstream.inflight("pool") == 1
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not connector._acquired
        await wait_until(lambda: fake_upstream.inflight("pool") == 0)
    finally:
        await transport.aclose()


async def test_every_stream_leaves_the_liveness_deadlines_however_it_ends(
    fake_upstream: FakeUpstream,
) -> None:
    source = SourceConfig(
        name="live",
        provider="generic",
        base_url=fake_upstream.base_url("live"),
        model="m",
        timeout_s=5.0,
        ttft_timeout_s=0.3,
        inter_token_timeout_s=0.2,
    )
    transport = OpenAICompatTransport(source)
    try:
        fake_upstream.script(
            "live",
            Reply.ok("fine"),
            Reply.ok("slow", first_token_delay=2.0),  # ttft
            Reply.ok("a b c", chunks=3, inter_token_delay=2.0),  # inter-token
            Reply.error(500),
            Reply.cut(),
        )
        results = await asyncio.gather(
            *(transport.send(_chat(), source, call_id=str(i)) for i in range(5)),
            return_exceptions=True,
        )
        assert sum(isinstance(r, TransportResult) for r in results) == 1
        kinds = sorted(r.kind for r in results if isinstance(r, StreamLivenessTimeout))
        assert kinds == ["inter_token", "ttft"]
        # And one cancelled mid-stream.
        fake_upstream.script("live", Reply.ok("a b c", chunks=3, inter_token_delay=0.1))
        task = asyncio.create_task(transport.send(_chat(), source, call_id="x"))
        await wait_until(lambda: transport.open_streams == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.open_streams == 0
    finally:
        await transport.aclose()


# --------------------------------------------------------------------------- odd upstreams


async def _serve(handler: Callable[[web.Request], Any]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1"


async def test_crlf_comments_and_split_frames_from_a_real_socket(engine: str) -> None:
    """A gateway using CRLF line ends, keep-alive comments and frames split mid-UTF-8."""
    body = (
        ": OPENROUTER PROCESSING\r\n\r\n"
        'data:{"choices":[{"index":0,"delta":{"reasoning":"hmm"}}]}\r\n\r\n'
        'data: {"choices":[{"index":0,"delta":{"content":"Grüß "}}]}\r\n\r\n'
        'data: {"choices":[{"index":0,"delta":{"content":"dich ✓"},'
        '"finish_reason":"stop"}]}\r\n\r\n'
        'data: {"choices":null,"usage":{"prompt_tokens":3,"completion_tokens":4}}\r\n\r\n'
        "data: [DONE]\r\n\r\n"
    ).encode()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for start in range(0, len(body), 7):  # 7-byte pieces cut through "ü", "ß" and "✓"
            await response.write(body[start : start + 7])
        await response.write_eof()
        return response

    runner, url = await _serve(handler)
    source = SourceConfig(
        name="odd", provider="generic", base_url=url, model="m", options={"engine": engine}
    )
    transport = OpenAICompatTransport(source)
    try:
        result = await transport.send(_chat(), source, call_id="c")
    finally:
        await transport.aclose()
        await runner.cleanup()
    assert result.content == "Grüß dich ✓"
    assert result.thinking == "hmm"
    assert (result.prompt_tokens, result.completion_tokens) == (3, 4)
    assert result.usage_source == "measured"
    assert not result.salvaged


async def test_json_answer_to_a_stream_request_is_accepted(engine: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model": "served-model",
                "choices": [{"index": 0, "message": {"content": "plain"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1},
            }
        )

    runner, url = await _serve(handler)
    source = SourceConfig(
        name="json", provider="generic", base_url=url, model="m", options={"engine": engine}
    )
    transport = OpenAICompatTransport(source)
    try:
        result = await transport.send(_chat(), source, call_id="c")
    finally:
        await transport.aclose()
        await runner.cleanup()
    assert result.content == "plain"
    assert result.model == "served-model"
    assert result.usage_source == "measured"


async def test_connection_refused_is_a_network_error(engine: str) -> None:
    source = SourceConfig(
        name="down",
        provider="generic",
        base_url="http://127.0.0.1:9/v1",  # discard port: nothing listens
        model="m",
        options={"engine": engine},
    )
    transport = OpenAICompatTransport(source)
    try:
        with pytest.raises(TransientError) as caught:
            await transport.send(_chat(), source, call_id="c")
    finally:
        await transport.aclose()
    assert caught.value.reason == "network_error"
    assert caught.value.source_name == "down"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_reasoning_without_an_answer_is_an_empty_completion(
    open_transport: OpenTransport, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_transport()
    fake_upstream.script(source.name, Reply.ok("", reasoning="thinking only"))
    with pytest.raises(TransientError, match="empty completion"):
        await transport.send(_chat(stream), source, call_id="c")


async def test_non_streaming_missing_usage_is_estimated(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport()
    fake_upstream.script(source.name, Reply.ok("y" * 8, include_usage=False))
    result = await transport.send(_chat(stream=False), source, call_id="c")
    assert (result.content, result.completion_tokens) == ("y" * 8, 2)
    assert result.usage_source == "estimated"
    assert result.ttft_ms is None


async def test_sse_labelled_as_json_is_still_read_as_a_stream(engine: str) -> None:
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n"
    )

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    runner, url = await _serve(handler)
    source = SourceConfig(
        name="label", provider="generic", base_url=url, model="m", options={"engine": engine}
    )
    transport = OpenAICompatTransport(source)
    try:
        result = await transport.send(_chat(), source, call_id="c")
    finally:
        await transport.aclose()
        await runner.cleanup()
    assert result.content == "ok"
    assert result.usage_source == "estimated"


async def test_non_streaming_total_deadline(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(timeout_s=0.2)
    fake_upstream.script(source.name, Reply.black_hole())
    with pytest.raises(TransientError) as caught:
        await transport.send(_chat(stream=False), source, call_id="c")
    assert caught.value.reason == "timeout"
    assert "0.2s" in str(caught.value)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the deadline's cancel is consumed
    await wait_until(lambda: fake_upstream.inflight(source.name) == 0)


async def test_non_streaming_outside_cancellation_is_not_a_timeout(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(timeout_s=30.0)
    fake_upstream.script(source.name, Reply.black_hole())
    task = asyncio.create_task(transport.send(_chat(stream=False), source, call_id="c"))
    await wait_until(lambda: fake_upstream.inflight(source.name) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: fake_upstream.inflight(source.name) == 0)


async def test_non_streaming_outer_deadline_wins_over_a_later_attempt_deadline(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    transport, source = open_transport(timeout_s=30.0)
    fake_upstream.script(source.name, Reply.black_hole())
    with pytest.raises(TimeoutError) as caught:
        async with asyncio.timeout(0.1):
            await transport.send(_chat(stream=False), source, call_id="c")
    assert not isinstance(caught.value, TransientError)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


# --------------------------------------------------------------------------- large JSON bodies

# Text whose JSON has every kind of cut a chunk boundary can fall on: escapes (\n, \", \\,
# \u0001), two-, three- and four-byte UTF-8 characters, and astral ones (a surrogate pair in
# ASCII-only JSON).
_AWKWARD = 'plain "quoted" back\\slash\nline \x01 é 中 😀 '


@pytest.mark.parametrize("size", [300_000, 3_000_000], ids=["300k", "3M"])
async def test_a_large_json_answer_arrives_whole(
    open_transport: OpenTransport, fake_upstream: FakeUpstream, size: int
) -> None:
    content = (_AWKWARD * (size // len(_AWKWARD) + 1))[:size]
    arguments = '{"text": "' + "x" * 100_000 + '"}'
    fake_upstream.script(
        "oc", Reply.ok(content, tool_calls=[("call_1", "echo", arguments)], completion_tokens=7)
    )
    transport, source = open_transport()
    result = await transport.send(_chat(stream=False), source, call_id="c")
    assert result.content == content
    assert result.tool_calls[0].arguments == arguments
    assert result.completion_tokens == 7
    assert result.usage_source == "measured"


async def test_a_large_broken_json_answer_is_a_transient_error(
    open_transport: OpenTransport, fake_upstream: FakeUpstream
) -> None:
    # Cut in the middle of its content: the body ends inside a long string.
    fake_upstream.script("oc", dataclasses.replace(Reply.malformed(), content="x" * 1_000_000))
    transport, source = open_transport()
    with pytest.raises(TransientError, match="malformed completion body"):
        await transport.send(_chat(stream=False), source, call_id="c")


def test_every_field_of_the_parsed_completion_reaches_its_own_result_field() -> None:
    # ``transport_result`` builds the result by position: every field gets a value of its
    # own here, so a swap of two (even of one type) shows.
    from polygateway.transports.openai_chunks import ParsedCompletion
    from polygateway.transports.openai_compat import transport_result
    from polygateway.types import ToolCall

    calls = (ToolCall("id-1", "lookup", "{}"),)
    source = SourceConfig(
        name="s", provider="openai", base_url="http://x.invalid/v1", model="m", timeout_s=10
    )
    completion = ParsedCompletion(
        "the content", "the thinking", "length", 3, 5, "the model", True, 11, 13, calls
    )
    result = transport_result(
        completion,
        complete=True,
        request=ChatRequest([{"role": "user", "content": "hi"}]),
        source=source,
        latency_s=0.0075,
        ttft_ms=1.5,
        max_inter_token_ms=2.5,
    )
    assert vars(result) == {
        "content": "the content",
        "thinking": "the thinking",
        "model": "the model",
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "usage_source": "measured",
        "latency_ms": 7,
        "ttft_ms": 1.5,
        "max_inter_token_ms": 2.5,
        "finish_reason": "length",
        "salvaged": False,
        "cached_prompt_tokens": 11,
        "cache_write_tokens": 13,
        "tool_calls": calls,
    }
