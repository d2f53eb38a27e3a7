"""Hostile upstreams at the HTTP level, on every engine, through the fake upstream: redirects are
never followed, no secret reaches an exception chain, response bytes are capped (gzip bombs
included), deep nesting is classified, framing fields are read in any case."""

from __future__ import annotations

import asyncio
import gzip
import os
import socket
import threading
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from polygateway.client import GatewayClient
from polygateway.errors import (
    ConfigError,
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    TransientError,
)
from polygateway.settings import (
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import MESSAGES
from polygateway.transports.engines import BodyReader, EngineConfig, make_engine
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest
from test_openai_compat import ENGINES

API_KEY = "sk-hostile-test-0123456789abcdef"
TOKEN = "tok-credential-9876543210"
HEADERS = {"X-Api-Token": TOKEN}

OpenSource = Callable[..., tuple[OpenAICompatTransport, SourceConfig]]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_source(engine: str, fake_upstream: FakeUpstream) -> AsyncIterator[OpenSource]:
    made: list[OpenAICompatTransport] = []

    def open_(name: str = "h", **overrides: Any) -> tuple[OpenAICompatTransport, SourceConfig]:
        options = {"engine": engine, "headers": HEADERS, **overrides.pop("options", {})}
        source = SourceConfig(
            name=name,
            provider="generic",
            base_url=fake_upstream.base_url(name),
            model="m1",
            api_key=Secret(API_KEY),
            timeout_s=overrides.pop("timeout_s", 10.0),
            options=options,
            **overrides,
        )
        transport = OpenAICompatTransport(source)
        made.append(transport)
        return transport, source

    yield open_
    for transport in made:
        await transport.aclose()


def chat(stream: bool) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, stream=stream)


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_no_engine_follows_a_redirect(
    open_source: OpenSource, fake_upstream: FakeUpstream, status: int, stream: bool
) -> None:
    async with FakeUpstream() as elsewhere:
        target = elsewhere.base_url("stolen") + "/chat/completions"
        transport, source = open_source()
        fake_upstream.script(source.name, Reply.redirect(target, status))
        with pytest.raises(SourceDeadError) as info:
            await transport.send(chat(stream), source, call_id="c")
        assert info.value.status == status
        # Nothing reached the other host: no prompt, no Authorization, no credential header.
        assert elsewhere.requests(None) == 0
        assert elsewhere.requests(None, "other") == 0
        assert fake_upstream.requests(source.name) == 1
        [received] = fake_upstream.received(source.name)
        assert received.headers["x-api-token"] == TOKEN  # the header was set: a real check


# --------------------------------------------------------------------------- error messages

FOREIGN_KEY = "AIzaSyD-0123456789abcdefABCDEF_ghijklmn"  # key-like, not this source's key


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_error_codes_stay_readable_while_keys_are_masked(
    open_source: OpenSource, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_source()
    fake_upstream.script(
        source.name,
        Reply.error(403),  # the real API's body: code unsupported_country_region_territory
        Reply.error(
            403,
            code="organization_usage_limit_exceeded_for_region",
            message=f"Key {FOREIGN_KEY} and {API_KEY} are not allowed here",
        ),
    )
    with pytest.raises(SourceDeadError) as info:
        await transport.send(chat(stream), source, call_id="c")
    assert "request_forbidden/unsupported_country_region_territory" in str(info.value)
    with pytest.raises(SourceDeadError) as info:
        await transport.send(chat(stream), source, call_id="c")
    text = str(info.value)
    assert "organization_usage_limit_exceeded_for_region" in text
    assert FOREIGN_KEY not in text and API_KEY not in text
    assert "Key *** and *** are not allowed" in text


# --------------------------------------------------------------------------- exception chains

# Every fault the fake upstream can inject, plus hostile bodies echoing the credentials.
FAULTS = [
    pytest.param(Reply.error(400), id="400"),
    pytest.param(Reply.error(401), id="401"),
    pytest.param(Reply.error(403), id="403"),
    pytest.param(Reply.error(404), id="404"),
    pytest.param(Reply.error(408), id="408"),
    pytest.param(Reply.error(429, retry_after=1), id="429"),
    pytest.param(Reply.error(429, quota=True), id="429-quota"),
    pytest.param(Reply.error(500), id="500"),
    pytest.param(Reply.error(503), id="503"),
    pytest.param(
        Reply.error(401, message=f"bad key Bearer {API_KEY}, header X-Api-Token: {TOKEN}"),
        id="echoed-credentials",
    ),
    pytest.param(Reply.error(502, body=f"<html>{API_KEY} {TOKEN}</html>"), id="echoed-in-html"),
    pytest.param(Reply.cut(after_chunks=2), id="cut"),
    pytest.param(Reply.early_eof(), id="early-eof"),
    pytest.param(Reply.malformed(), id="malformed"),
    pytest.param(Reply.empty(), id="empty"),
    pytest.param(Reply.mid_stream_error(), id="mid-stream-error"),
    pytest.param(Reply.reset(), id="reset"),
    pytest.param(Reply.reset(after_headers=True), id="reset-after-headers"),
    pytest.param(Reply.black_hole(), id="black-hole"),
    pytest.param(Reply.ok(headers_delay=1.0), id="slow-headers"),
    pytest.param(Reply.ok(first_token_delay=1.0), id="slow-first-token"),
    pytest.param(Reply.redirect("http://127.0.0.1:9/x"), id="redirect"),
    pytest.param(Reply.garbage(), id="not-http"),
]


def chain(error: BaseException) -> Iterator[BaseException]:
    """The error, its causes and contexts, and the errors a scope error carries."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for linked in (
            current.__cause__,
            current.__context__,
            getattr(current, "last_error", None),
        ):
            if isinstance(linked, BaseException):
                todo.append(linked)


def assert_no_secret(error: BaseException) -> None:
    links = list(chain(error))
    texts = ["".join(traceback.format_exception(error))]
    for link in links:
        texts += [str(link), repr(link), repr(link.args), repr(vars(link))]
    for text in texts:
        assert API_KEY not in text, text
        assert TOKEN not in text, text
        assert "Bearer sk-" not in text, text


@pytest.mark.parametrize("reply", FAULTS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_no_secret_anywhere_in_the_exception_chain(
    open_source: OpenSource, fake_upstream: FakeUpstream, reply: Reply, stream: bool
) -> None:
    transport, source = open_source(timeout_s=0.5, ttft_timeout_s=0.3)
    fake_upstream.script(source.name, reply)
    with pytest.raises(PolyGatewayError) as info:
        await transport.send(chat(stream), source, call_id="c")
    assert_no_secret(info.value)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_no_password_of_the_url_in_a_connection_error(engine: str, stream: bool) -> None:
    password = "pw-in-the-url-424242"
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = SourceConfig(
        name="u",
        provider="generic",
        base_url=f"http://user:{password}@127.0.0.1:{port}/v1",
        model="m1",
        options={"engine": engine},
    )
    if engine == "httpx-aiohttp":
        with pytest.raises(ConfigError, match="cannot send credentials given in base_url") as bad:
            OpenAICompatTransport(source)
        assert password not in str(bad.value)
        return
    transport = OpenAICompatTransport(source)
    try:
        with pytest.raises(TransientError) as info:
            await transport.send(chat(stream), source, call_id="c")
    finally:
        await transport.aclose()
    assert "network error" in str(info.value)
    for link in chain(info.value):
        for text in (str(link), repr(link), repr(link.args), repr(vars(link))):
            assert password not in text, text


@pytest.mark.parametrize("reply", FAULTS)
async def test_no_secret_in_what_the_client_raises(
    fake_upstream: FakeUpstream, reply: Reply
) -> None:
    source = SourceConfig(
        name="cl",
        provider="generic",
        base_url=fake_upstream.base_url("cl"),
        model="m1",
        api_key=Secret(API_KEY),
        timeout_s=0.5,
        ttft_timeout_s=0.3,
        options={"headers": HEADERS},
    )
    settings = ScopeSettings(
        scope="LLM",
        sources=(source,),
        retry=RetrySettings(max_attempts=1),
        cache=CacheSettings(backend="none"),
        telemetry=TelemetrySettings(backend="none"),
    )
    fake_upstream.script(source.name, reply)
    async with GatewayClient(settings) as client:
        with pytest.raises(PolyGatewayError) as info:
            await client.chat(MESSAGES)
    assert_no_secret(info.value)


# --------------------------------------------------------------------------- response size

CAP = 1024 * 1024


class RssSampler:
    """Peak resident set size above the starting one, sampled from a thread (Linux)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 1e6


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS read from /proc")
@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip-bomb"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_response_bytes_are_capped_on_the_wire_and_decoded(
    open_source: OpenSource, fake_upstream: FakeUpstream, stream: bool, gzip: bool
) -> None:
    transport, source = open_source(max_response_bytes=CAP, timeout_s=20.0)
    # 1 GB of well-formed answer (plain) or of its gzip (~1 MB on the wire), made as it is sent.
    fake_upstream.script(source.name, Reply.flood(1024**3, gzip=gzip))
    started = time.monotonic()
    with RssSampler() as rss, pytest.raises(TransientError) as info:
        await transport.send(chat(stream), source, call_id="c")
    assert f"max_response_bytes={CAP}" in str(info.value)
    assert rss.growth_mb < 48, f"RSS grew {rss.growth_mb:.1f} MB"
    assert time.monotonic() - started < 10.0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_gzip_answers_within_the_cap_are_decoded(
    open_source: OpenSource, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_source(max_response_bytes=CAP)
    fake_upstream.script(source.name, Reply.flood(200_000, gzip=True), Reply.flood(200_000))
    zipped = await transport.send(chat(stream), source, call_id="c")
    plain = await transport.send(chat(stream), source, call_id="c")
    assert zipped.content == plain.content
    assert set(zipped.content) == {"x"} and len(zipped.content) > 150_000
    [first, _] = fake_upstream.received(source.name)
    assert first.headers["accept-encoding"] == "gzip, deflate"


def test_the_default_cap_is_set_and_documented() -> None:
    source = SourceConfig(name="d", provider="generic", base_url="http://x.invalid/v1", model="m")
    assert source.max_response_bytes == 64 * 1024 * 1024


# --------------------------------------------------------------------------- deep nesting

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, RequestRejectedError),
        (401, SourceDeadError),
        (404, SourceDeadError),
        (429, TransientError),
        (500, TransientError),
        (503, TransientError),
    ],
)
@pytest.mark.parametrize("body", [DEEP, '{"error":' + DEEP + "}"], ids=["bare", "in-error"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_deeply_nested_error_body_is_classified_by_status(
    open_source: OpenSource,
    fake_upstream: FakeUpstream,
    status: int,
    error_class: type[Exception],
    body: str,
    stream: bool,
) -> None:
    transport, source = open_source()
    fake_upstream.script(source.name, Reply.error(status, body=body))
    with pytest.raises(error_class) as info:
        await transport.send(chat(stream), source, call_id="c")
    assert type(info.value) is error_class
    assert f"HTTP {status}" in str(info.value)
    assert len(str(info.value)) <= 300


# --------------------------------------------------------------------------- body decoding


def body_reader(chunks: list[bytes], encoding: str | None, cap: int | None = None) -> BodyReader:
    pending = list(chunks)

    async def raw() -> bytes:
        return pending.pop(0) if pending else b""

    return BodyReader(raw, encoding, EngineConfig(source_name="d", max_response_bytes=cap))


def pieces(data: bytes, size: int = 7) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


TEXT = b'{"choices":[{"message":{"content":"' + b"hello " * 5000 + b'"}}]}'


def deflated(data: bytes, wbits: int) -> bytes:
    compressor = zlib.compressobj(wbits=wbits)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("encoding", "wire"),
    [
        (None, TEXT),
        ("identity", TEXT),
        ("gzip", gzip.compress(TEXT)),
        ("x-gzip", gzip.compress(TEXT)),
        ("gzip", gzip.compress(TEXT[:1000]) + gzip.compress(TEXT[1000:])),  # two members
        ("deflate", deflated(TEXT, 15)),  # zlib-wrapped, as the RFC says
        ("deflate", deflated(TEXT, -15)),  # raw, as some servers send it
    ],
    ids=["none", "identity", "gzip", "x-gzip", "gzip-members", "deflate", "raw-deflate"],
)
async def test_bodies_are_decoded_whatever_the_chunking(encoding: str | None, wire: bytes) -> None:
    reader = body_reader(pieces(wire), encoding)
    assert await reader.read() == TEXT
    assert reader.exhausted


async def test_unsupported_or_corrupt_encodings_are_transient_errors() -> None:
    with pytest.raises(TransientError, match="unsupported Content-Encoding 'br'"):
        await body_reader([b"\x1b\x00"], "br").read()
    with pytest.raises(TransientError, match="corrupt compressed body"):
        await body_reader([b"not gzip at all"], "gzip").read()


async def test_a_chunk_is_at_most_64_kib_and_the_cap_counts_wire_and_decoded_bytes() -> None:
    reader = body_reader([TEXT * 4], None)
    sizes = []
    while chunk := await reader.read_chunk():
        sizes.append(len(chunk))
    assert max(sizes) <= 64 * 1024 and sum(sizes) == 4 * len(TEXT)
    with pytest.raises(TransientError, match=r"max_response_bytes=1000 \(on the wire\)"):
        await body_reader([TEXT], None, cap=1000).read()
    bomb = gzip.compress(b"\0" * 10_000_000)
    assert len(bomb) < 20_000
    with pytest.raises(TransientError, match=r"max_response_bytes=100000 \(decoded\)"):
        await body_reader(pieces(bomb, 4096), "gzip", cap=100_000).read()


# --------------------------------------------------------------------------- header case


async def _answer_every_request_with(head: bytes, body: bytes) -> tuple[asyncio.Server, str]:
    """A loopback server writing ``head`` and ``body`` to each request, then keeping its end
    open until the client leaves (only what the answer says decides its connection's fate)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head + body)
            await writer.drain()
            await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"


def _one_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)


ODD_CASE_HEADS = {
    # RFC 9110 sec. 5.1: field names are case-insensitive; so are the codings (sec. 8.4.1,
    # RFC 9112 sec. 7) and the connection options (sec. 7.6.1).
    "chunked": (b"transfer-encoding: CHUNKED\r\n", _one_chunk),
    "length": (b"CONTENT-LENGTH: %d\r\n", None),
}


@pytest.mark.parametrize("framing", sorted(ODD_CASE_HEADS))
@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "close"])
async def test_framing_and_coding_fields_are_read_in_any_case(
    engine: str, framing: str, close: bool
) -> None:
    zipped = gzip.compress(TEXT)
    field, encode = ODD_CASE_HEADS[framing]
    body = encode(zipped) if encode is not None else zipped
    head = b"HTTP/1.1 200 OK\r\nCONTENT-TYPE: application/json\r\nContent-Encoding: GZIP\r\n"
    head += field % len(zipped) if b"%d" in field else field
    head += b"CONNECTION: Close\r\n\r\n" if close else b"Connection: Keep-Alive\r\n\r\n"
    server, url = await _answer_every_request_with(head, body)
    client = make_engine(engine, EngineConfig(source_name="case", plain_http=True))
    try:
        response = await client.post(url, b"{}")
        assert response.headers["content-encoding"] == "GZIP"
        assert await response.read() == TEXT
        await response.aclose()
        if engine == "httptools":
            # ``Connection: close`` in any case: that connection is never pooled.
            assert client.idle_connections == (0 if close else 1)  # type: ignore[attr-defined]
    finally:
        await client.aclose()
        server.close()


@pytest.mark.parametrize("framing", sorted(ODD_CASE_HEADS))
async def test_a_body_cut_short_is_a_transient_error_in_any_case(engine: str, framing: str) -> None:
    # The server closes (FIN) before the body is complete: before the chunked body's last
    # chunk, or short of its length. Read as a clean end, it would pass for a short answer.
    field = {"chunked": b"Transfer-Encoding: Chunked\r\n", "length": b"Content-LENGTH: 200\r\n"}
    body = {"chunked": b"5\r\nhello\r\n", "length": b"hello"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\n" + field[framing] + b"\r\n" + body[framing])
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = make_engine(engine, EngineConfig(source_name="cut", plain_http=True))
    try:
        response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}")
        try:
            with pytest.raises(TransientError) as caught:
                await response.read()
        finally:
            await response.aclose()
        assert caught.value.reason == "network_error"
    finally:
        await client.aclose()
        server.close()
