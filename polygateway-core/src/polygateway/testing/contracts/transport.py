"""Contract suite for chat transports, run against the fake upstream at the HTTP level.

Subclass it in a test module and provide a ``make_transport`` fixture returning a factory
``(SourceConfig) -> Transport``::

    from polygateway.testing.contracts.transport import TransportContract

    class TestMyTransport(TransportContract):
        @pytest.fixture
        def make_transport(self):
            return lambda source: MyTransport(source)

It needs the ``fake_upstream`` fixture of the ``polygateway`` pytest plugin (installed with the
library). A transport that speaks another wire protocol than OpenAI chat completions sets the
class attribute ``protocol`` (``"openai"`` by default, or ``"anthropic"`` for the Messages API):
the cases that look at the wire (request body, auth header, the error table) then check that
protocol's form of the same behaviour.

What it checks: streaming and non-streaming answers, usage, reasoning kept apart from content,
the error translation table of ARCHITECTURE §6.2 for every scripted fault (per protocol),
Retry-After, the liveness watchdog (TTFT, inter-token, total), that cancellation and watchdog
timeouts release the connection, multimodal messages passed through untouched (OpenAI) or
converted (Anthropic), that text which is not Unicode is refused before anything is sent, and
that the API key never appears in an error message.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import pytest

from polygateway.errors import (
    EmptyCompletionError,
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.ports import Transport
from polygateway.settings import Secret, SourceConfig
from polygateway.testing.fake_upstream import FakeUpstream, Reply
from polygateway.types import ChatRequest

CONTRACT_KEY = "sk-contract-0123456789abcdefXYZ"
CONTRACT_MODEL = "contract-model"
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "Say hello."}]

TransportFactory = Callable[[SourceConfig], Transport]
OpenTransport = Callable[..., tuple[Transport, SourceConfig]]

# (id, reply, expected class, expected HTTP status or None)
ERROR_TABLE: list[tuple[str, Reply, type[PolyGatewayError], int | None]] = [
    ("429-rate", Reply.error(429), TransientError, 429),
    ("429-quota", Reply.error(429, quota=True), SourceDeadError, 429),
    (
        "429-spend-limit",
        Reply.error(429, code="organization_spend_limit_exceeded", type="requests"),
        SourceDeadError,
        429,
    ),
    ("401", Reply.error(401), SourceDeadError, 401),
    ("403", Reply.error(403), SourceDeadError, 403),
    ("404", Reply.error(404), SourceDeadError, 404),
    ("400", Reply.error(400), RequestRejectedError, 400),
    ("422", Reply.error(422), RequestRejectedError, 422),
    ("500", Reply.error(500), TransientError, 500),
    ("502", Reply.error(502), TransientError, 502),
    ("503", Reply.error(503), TransientError, 503),
    ("504", Reply.error(504), TransientError, 504),
    ("cut", Reply.cut(after_chunks=2), TransientError, None),
    ("early-eof", Reply.early_eof(), TransientError, None),
    ("malformed", Reply.malformed(), TransientError, None),
    ("empty", Reply.empty(), EmptyCompletionError, None),
    ("mid-stream-error", Reply.mid_stream_error(), TransientError, None),
    ("reset", Reply.reset(), TransientError, None),
    ("reset-after-headers", Reply.reset(after_headers=True), TransientError, None),
    # Closed before the last chunk, the head in odd case (``TRANSFER-ENCODING: Chunked``):
    # incomplete, though what came parses (RFC 9110 sec. 5.1, RFC 9112 sec. 7.1).
    ("truncated-chunked", Reply.truncated(), TransientError, None),
]

_WIRE_FAULTS = ERROR_TABLE[-8:]  # cut .. truncated-chunked: the same for every protocol

# The Messages API classifies by error.type (protocols §4 and corrections).
ANTHROPIC_ERROR_TABLE: list[tuple[str, Reply, type[PolyGatewayError], int | None]] = [
    ("429-rate_limit_error", Reply.error(429), TransientError, 429),
    ("529-overloaded_error", Reply.error(529), TransientError, 529),
    ("500-api_error", Reply.error(500), TransientError, 500),
    ("504-timeout_error", Reply.error(504), TransientError, 504),
    ("401-authentication_error", Reply.error(401), SourceDeadError, 401),
    ("403-permission_error", Reply.error(403), SourceDeadError, 403),
    ("400-billing_error", Reply.error(400, quota=True), SourceDeadError, 400),
    ("404-not_found_error", Reply.error(404), SourceDeadError, 404),
    ("400-invalid_request_error", Reply.error(400), RequestRejectedError, 400),
    ("413-request_too_large", Reply.error(413), RequestRejectedError, 413),
    # By type, not by status: an overload reported with a 500 is still an overload.
    ("500-overloaded_error", Reply.error(500, type="overloaded_error"), TransientError, 500),
    *_WIRE_FAULTS,
]

ERROR_TABLES: dict[str, list[tuple[str, Reply, type[PolyGatewayError], int | None]]] = {
    "openai": ERROR_TABLE,
    "anthropic": ANTHROPIC_ERROR_TABLE,
}
ROUTES: dict[str, str] = {"openai": "chat", "anthropic": "messages"}
"""The fake upstream route each protocol's chat requests arrive on."""


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Poll a condition that has no event to wait on (another thread's counters)."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 - the counters live in another thread
            await asyncio.sleep(0.005)


class TransportContract:
    """The behaviour every chat transport shares. Subclass and provide ``make_transport``."""

    protocol: ClassVar[str] = "openai"

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # The error table depends on the subclass's protocol, known only at collection.
        if "error_case" in metafunc.fixturenames:
            table = ERROR_TABLES[self.protocol]
            metafunc.parametrize(
                "error_case", [pytest.param((r, e, s), id=i) for i, r, e, s in table]
            )

    @property
    def route(self) -> str:
        return ROUTES[self.protocol]

    @pytest.fixture
    def make_transport(self) -> TransportFactory:
        pytest.fail("TransportContract subclasses must provide a make_transport fixture")

    @pytest.fixture
    async def open_transport(
        self, make_transport: TransportFactory, fake_upstream: FakeUpstream
    ) -> AsyncIterator[OpenTransport]:
        made: list[Transport] = []

        def open_(
            source_name: str = "contract", **overrides: Any
        ) -> tuple[Transport, SourceConfig]:
            source = SourceConfig(
                name=source_name,
                provider="generic",
                base_url=fake_upstream.base_url(source_name),
                model=CONTRACT_MODEL,
                api_key=Secret(CONTRACT_KEY),
            )
            source = dataclasses.replace(source, **overrides)
            transport = make_transport(source)
            made.append(transport)
            return transport, source

        yield open_
        for transport in made:
            await transport.aclose()

    # ------------------------------------------------------------------ answers

    async def test_streaming_answer(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name,
            Reply.ok("Hello, contract world!", chunks=5, prompt_tokens=11, completion_tokens=6),
            route=self.route,
        )
        result = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        assert result.content == "Hello, contract world!"
        assert (result.prompt_tokens, result.completion_tokens) == (11, 6)
        assert result.usage_source == "measured"
        assert result.finish_reason == "stop"
        assert result.ttft_ms is not None and result.ttft_ms >= 0
        [received] = fake_upstream.received(source.name, route=self.route)
        assert received.body["model"] == CONTRACT_MODEL
        assert received.body["stream"] is True
        if self.protocol == "anthropic":
            assert "stream_options" not in received.body
            assert received.headers["x-api-key"] == CONTRACT_KEY
            assert received.headers["anthropic-version"]
            assert "authorization" not in received.headers
        else:
            assert received.body["stream_options"] == {"include_usage": True}
            assert received.headers["authorization"] == f"Bearer {CONTRACT_KEY}"

    async def test_non_streaming_answer(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name, Reply.ok("Plain answer.", prompt_tokens=7), route=self.route
        )
        request = ChatRequest(messages=MESSAGES, stream=False)
        result = await transport.send(request, source, call_id="c1")
        assert result.content == "Plain answer."
        assert result.prompt_tokens == 7
        assert result.usage_source == "measured"
        [received] = fake_upstream.received(source.name, route=self.route)
        assert received.body["stream"] is False
        assert "stream_options" not in received.body

    @pytest.mark.parametrize("inline", [False, True], ids=["reasoning_content", "think-tags"])
    @pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
    async def test_reasoning_is_returned_apart_from_content(
        self,
        open_transport: OpenTransport,
        fake_upstream: FakeUpstream,
        inline: bool,
        stream: bool,
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name,
            Reply.ok("The answer is 4.", reasoning="2 plus 2 makes 4.", think_inline=inline),
            route=self.route,
        )
        request = ChatRequest(messages=MESSAGES, stream=stream)
        result = await transport.send(request, source, call_id="c1")
        assert result.content == "The answer is 4."
        assert result.thinking == "2 plus 2 makes 4."

    async def test_multimodal_messages_pass_through_untouched(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        transport, source = open_transport()
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "Describe images. Ünïcödé ✓ 中文"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
                    },
                ],
            },
        ]
        await transport.send(ChatRequest(messages=messages), source, call_id="c1")
        [received] = fake_upstream.received(source.name, route=self.route)
        if self.protocol == "anthropic":
            # The same content in the Messages API's form: system apart, an image block.
            assert received.body["system"] == messages[0]["content"]
            assert received.body["messages"] == [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "iVBORw0KGgo=",
                            },
                        },
                    ],
                }
            ]
            assert "Ünïcödé ✓ 中文".encode() in received.raw_body
            assert b'"iVBORw0KGgo="' in received.raw_body
        else:
            assert received.body["messages"] == messages
            assert b'"data:image/png;base64,iVBORw0KGgo="' in received.raw_body

    # ------------------------------------------------------------------ errors

    @pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
    async def test_error_translation(
        self,
        open_transport: OpenTransport,
        fake_upstream: FakeUpstream,
        error_case: tuple[Reply, type[PolyGatewayError], int | None],
        stream: bool,
    ) -> None:
        """``error_case`` is a row of the protocol's error table (``ERROR_TABLES``)."""
        reply, expected, status = error_case
        transport, source = open_transport()
        fake_upstream.script(source.name, reply, route=self.route)
        request = ChatRequest(messages=MESSAGES, stream=stream)
        with pytest.raises(PolyGatewayError) as caught:
            await transport.send(request, source, call_id="c1")
        assert type(caught.value) is expected, caught.value
        if status is not None:
            assert getattr(caught.value, "status", None) == status
        assert fake_upstream.requests(source.name, route=self.route) == 1
        assert CONTRACT_KEY not in str(caught.value)

    @pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
    async def test_text_that_is_not_unicode_is_rejected_before_sending(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream, stream: bool
    ) -> None:
        # JSON's "\ud800" decodes to a lone surrogate, which has no UTF-8 form.
        transport, source = open_transport()
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "fine"},
            {"role": "user", "content": [{"type": "text", "text": "half a pair: \ud83d"}]},
        ]
        request = ChatRequest(messages=messages, stream=stream)
        with pytest.raises(RequestRejectedError) as caught:
            await transport.send(request, source, call_id="c1")
        assert "messages[1].content[0].text" in str(caught.value)
        assert "U+D83D" in str(caught.value)
        assert fake_upstream.requests(source.name, route=self.route) == 0

    @pytest.mark.parametrize(("status", "seconds"), [(429, 2), (503, 7)])
    async def test_retry_after_seconds_are_parsed(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream, status: int, seconds: int
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name, Reply.error(status, retry_after=seconds), route=self.route
        )
        with pytest.raises(TransientError) as caught:
            await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        assert caught.value.retry_after_s == pytest.approx(float(seconds))

    async def test_api_key_echoed_by_the_upstream_is_not_in_the_error(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name,
            Reply.error(401, message=f"Incorrect API key provided: {CONTRACT_KEY}."),
            route=self.route,
        )
        with pytest.raises(SourceDeadError) as caught:
            await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        assert CONTRACT_KEY not in str(caught.value)
        assert CONTRACT_KEY not in repr(caught.value)

    # ------------------------------------------------------------------ liveness

    @pytest.mark.parametrize(
        ("reply", "timeouts", "kind"),
        [
            pytest.param(
                Reply.ok(first_token_delay=2.0),
                {"ttft_timeout_s": 0.15, "inter_token_timeout_s": 0.1, "timeout_s": 5.0},
                "ttft",
                id="ttft",
            ),
            pytest.param(
                Reply.ok(headers_delay=2.0),
                {"ttft_timeout_s": 0.15, "inter_token_timeout_s": 0.1, "timeout_s": 5.0},
                "ttft",
                id="ttft-headers",
            ),
            pytest.param(
                Reply.black_hole(),
                {"ttft_timeout_s": 0.15, "inter_token_timeout_s": 0.1, "timeout_s": 5.0},
                "ttft",
                id="black-hole",
            ),
            pytest.param(
                Reply.ok("a b c d e f", chunks=3, inter_token_delay=2.0),
                {"ttft_timeout_s": 1.0, "inter_token_timeout_s": 0.15, "timeout_s": 5.0},
                "inter_token",
                id="inter-token",
            ),
            pytest.param(
                Reply.ok("abcdefghijklmnopqrst", chunks=20, inter_token_delay=0.05),
                {"ttft_timeout_s": 0.2, "inter_token_timeout_s": 0.15, "timeout_s": 0.3},
                "total",
                id="total",
            ),
        ],
    )
    async def test_liveness_timeouts(
        self,
        open_transport: OpenTransport,
        fake_upstream: FakeUpstream,
        reply: Reply,
        timeouts: dict[str, float],
        kind: str,
    ) -> None:
        transport, source = open_transport(**timeouts)
        fake_upstream.script(source.name, reply, route=self.route)
        with pytest.raises(StreamLivenessTimeout) as caught:
            await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        assert caught.value.kind == kind
        # The connection was given up: the upstream sees the client leave.
        await wait_until(lambda: fake_upstream.inflight(source.name, route=self.route) == 0)

    async def test_reasoning_deltas_keep_the_stream_alive(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        # 8 reasoning deltas 50 ms apart come before any content: only counting them as tokens
        # keeps the 0.2 s TTFT from firing.
        transport, source = open_transport(
            ttft_timeout_s=0.2, inter_token_timeout_s=0.15, timeout_s=5.0
        )
        fake_upstream.script(
            source.name,
            Reply.ok("done", chunks=1, reasoning="r" * 32, inter_token_delay=0.05),
            route=self.route,
        )
        result = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        assert result.content == "done"
        assert result.thinking == "r" * 32

    async def test_cancellation_mid_stream_releases_the_connection(
        self, open_transport: OpenTransport, fake_upstream: FakeUpstream
    ) -> None:
        transport, source = open_transport()
        fake_upstream.script(
            source.name, Reply.ok("a b c d", chunks=4, inter_token_delay=30.0), route=self.route
        )
        task = asyncio.create_task(
            transport.send(ChatRequest(messages=MESSAGES), source, call_id="c1")
        )
        await fake_upstream.wait_for_requests(1, source.name, route=self.route)
        await wait_until(lambda: fake_upstream.inflight(source.name, route=self.route) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: fake_upstream.inflight(source.name, route=self.route) == 0)
        # The transport still works afterwards.
        result = await transport.send(ChatRequest(messages=MESSAGES), source, call_id="c2")
        assert result.content


__all__ = [
    "ANTHROPIC_ERROR_TABLE",
    "CONTRACT_KEY",
    "ERROR_TABLE",
    "ERROR_TABLES",
    "ROUTES",
    "TransportContract",
    "wait_until",
]
