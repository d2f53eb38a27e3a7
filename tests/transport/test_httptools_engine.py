"""What only the ``httptools`` engine has to show (the contract suite and the wire cases run it
with every other engine): its pool, TLS through asyncio, flow control, bodies delimited by the
connection closing, interim answers, an endless head, the bounds on sending and on getting a
connection, what its reprs hide, and what it refuses to configure."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import os
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from polygateway.errors import ConfigError, SourceDeadError, TransientError
from polygateway.settings import Secret, SourceConfig
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import MESSAGES, wait_until
from polygateway.transports.engines import EngineConfig, make_engine
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest

httptools_engine = pytest.importorskip("polygateway.transports.httptools_engine")
HttptoolsEngine = httptools_engine.HttptoolsEngine

ANSWER = {
    "model": "m",
    "choices": [{"index": 0, "message": {"content": "plain"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1},
}
SSE = (
    b'data: {"choices":[{"index":0,"delta":{"content":"over "}}]}\n\n'
    b'data: {"choices":[{"index":0,"delta":{"content":"tls"},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI")


def chat(stream: bool = True) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, stream=stream)


def source_at(url: str, **options: Any) -> SourceConfig:
    return SourceConfig(
        name="ht",
        provider="generic",
        base_url=url,
        model="m",
        timeout_s=5.0,
        options={"engine": "httptools", **options},
    )


def engine_of(transport: OpenAICompatTransport) -> Any:
    engine = transport.engine
    assert isinstance(engine, HttptoolsEngine)
    return engine


async def send_expecting_error(source: SourceConfig) -> TransientError:
    """The ``TransientError`` one streamed call on a new transport for ``source`` raises."""
    transport = OpenAICompatTransport(source)
    try:
        with pytest.raises(TransientError) as caught:
            await transport.send(chat(), source, call_id="c")
    finally:
        await transport.aclose()
    return caught.value


async def serve(
    path: str,
    handler: Callable[[web.Request], Any],
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """An aiohttp server on a free loopback port answering POST ``path``."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    return runner, runner.addresses[0][1]


async def stream_octets(request: web.Request, pieces: Iterable[bytes]) -> web.StreamResponse:
    """An ``application/octet-stream`` answer to ``request`` written piece by piece."""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await response.write_eof()
    return response


# --------------------------------------------------------------------------- pool


async def test_one_keepalive_connection_serves_sequential_calls(
    fake_upstream: FakeUpstream,
) -> None:
    source = source_at(fake_upstream.base_url("pool"))
    transport = OpenAICompatTransport(source)
    try:
        for stream in (True, False, True):
            result = await transport.send(chat(stream), source, call_id="c")
            assert result.content
        engine = engine_of(transport)
        assert (engine.idle_connections, engine.busy_connections) == (1, 0)
        # A cancelled stream aborts its connection instead of pooling it half-read.
        fake_upstream.script("pool", Reply.ok("a b c", chunks=3, inter_token_delay=30.0))
        # The server's thread counts the last answer as in flight until its handler returns,
        # which may be after the client has read it: wait for the new request itself.
        before = fake_upstream.requests("pool")
        task = asyncio.create_task(transport.send(chat(), source, call_id="c"))
        await wait_until(
            lambda: fake_upstream.requests("pool") > before and fake_upstream.inflight("pool") == 1
        )
        assert engine.busy_connections == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.busy_connections == 0
        await wait_until(lambda: fake_upstream.inflight("pool") == 0)
        assert (await transport.send(chat(), source, call_id="c")).content
    finally:
        await transport.aclose()


async def test_concurrent_calls_open_no_more_than_max_connections(
    fake_upstream: FakeUpstream,
) -> None:
    source = source_at(fake_upstream.base_url("lim"), max_connections=3)
    transport = OpenAICompatTransport(source)
    try:
        results = await asyncio.gather(
            *(transport.send(chat(), source, call_id=str(i)) for i in range(12))
        )
        assert all(r.content for r in results)
        engine = engine_of(transport)
        assert engine.busy_connections == 0
        assert engine.idle_connections == 3
    finally:
        await transport.aclose()


async def test_credentials_in_the_url_become_basic_auth(fake_upstream: FakeUpstream) -> None:
    url = fake_upstream.base_url("cred").replace("http://", "http://us%40er:p%3Aw@")
    source = source_at(url)
    transport = OpenAICompatTransport(source)
    try:
        await transport.send(chat(), source, call_id="c")
    finally:
        await transport.aclose()
    [received] = fake_upstream.received("cred")
    expected = base64.b64encode(b"us@er:p:w").decode()
    assert received.headers["authorization"] == f"Basic {expected}"


# --------------------------------------------------------------------------- odd answers


async def _raw_server(
    respond: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await respond(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1"


async def test_an_interim_answer_then_a_body_ended_by_closing(fake_upstream: FakeUpstream) -> None:
    data = orjson.dumps(ANSWER)

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        for start in range(0, len(data), 5):  # no length, no chunks: the close ends it
            writer.write(data[start : start + 5])
            await writer.drain()

    server, url = await _raw_server(respond)
    source = source_at(url)
    transport = OpenAICompatTransport(source)
    try:
        for _ in range(2):  # the closed connection is not reused: the second call opens one
            result = await transport.send(chat(stream=False), source, call_id="c")
            assert result.content == "plain"
        assert engine_of(transport).idle_connections == 0
    finally:
        await transport.aclose()
        server.close()


async def test_an_endless_response_head_is_a_network_error() -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):
            writer.write(b"X-Filler-%d: %b\r\n" % (i, b"y" * 100))
            await writer.drain()

    server, url = await _raw_server(respond)
    try:
        error = await send_expecting_error(source_at(url))
    finally:
        server.close()
    assert error.reason == "network_error"
    assert "response head over" in str(error)


async def _hold_open(reader: asyncio.StreamReader) -> None:
    """Keep the server's end open until the client closes (a pool could keep it)."""
    await reader.read()


async def test_bytes_after_the_response_are_not_parsed_into_it_nor_pooled() -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Evil: 1\r\n\r\nEVIL!"
        )
        await _hold_open(reader)

    server, url = await _raw_server(respond)
    engine = make_engine("httptools", EngineConfig(source_name="extra"))
    try:
        response = await engine.post(f"{url}/chat/completions", b"{}")
        assert await response.read() == b"hello"
        assert "x-evil" not in response.headers
        assert response.headers["content-length"] == "5"
        await response.aclose()
        assert engine.idle_connections == 0  # the connection that lied is dropped
    finally:
        await engine.aclose()
        server.close()


async def test_chunked_trailers_are_not_kept() -> None:
    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        trailers = b"".join(b"X-Trailer-%d: %b\r\n" % (i, b"t" * 50) for i in range(5000))
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n"
        )
        await _hold_open(reader)

    server, url = await _raw_server(respond)
    engine = make_engine("httptools", EngineConfig(source_name="trailers"))
    try:
        response = await engine.post(f"{url}/chat/completions", b"{}")
        assert await response.read() == b"hello"
        assert not [name for name in response.headers if name.startswith("x-trailer")]
        await response.aclose()
    finally:
        await engine.aclose()
        server.close()


async def test_a_response_left_unread_with_reading_paused_is_not_pooled() -> None:
    # One byte over the pause threshold: reading pauses on the body's last byte, so the
    # response is complete (and would look reusable) with the socket paused.
    size = 256 * 1024 + 1

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"e" * size)
        await writer.drain()
        await _hold_open(reader)

    server, url = await _raw_server(respond)
    engine = make_engine("httptools", EngineConfig(source_name="unread"))
    try:
        response = await engine.post(f"{url}/chat/completions", b"{}")
        await wait_until(lambda: response.reading_paused)
        await response.aclose()  # an error status: the body is not read
        assert engine.idle_connections == 0
        second = await engine.post(f"{url}/chat/completions", b"{}")  # a new connection
        assert second.status == 400
        await second.aclose()
    finally:
        await engine.aclose()
        server.close()


async def test_a_slow_reader_pauses_the_socket_and_misses_nothing() -> None:
    piece = b"z" * 65536
    pieces = 128  # 8 MiB

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_octets(request, [piece] * pieces)

    runner, port = await serve("/big", handler)
    engine = make_engine("httptools", EngineConfig(source_name="big"))
    try:
        response = await engine.post(f"http://127.0.0.1:{port}/big", b"{}")
        total = len(await response.read_chunk())
        # The reader is behind: the connection stops reading with a bounded buffer.
        await wait_until(lambda: response.reading_paused)
        assert response.buffered_bytes <= 512 * 1024
        while chunk := await response.read_chunk():
            total += len(chunk)
            assert response.buffered_bytes <= 512 * 1024
        assert total == len(piece) * pieces
        assert response.at_eof()
        await response.aclose()
        assert engine.idle_connections == 1
    finally:
        await engine.aclose()
        await runner.cleanup()


@pytest.mark.parametrize(
    "tls", [pytest.param(False, id="tcp"), pytest.param(True, id="tls", marks=needs_openssl)]
)
async def test_connections_reading_into_one_buffer_keep_every_body_apart(
    tls: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The connections of a loop read into one buffer (over TLS, asyncio's SSL protocol
    # decrypts into it): what a read hands the consumer must be its own bytes, untouched by
    # the reads of the other connections after it, also when a reader falls behind and its
    # connection pauses.
    piece_size, pieces = 7001, 48  # about 330 KiB each: more than one read of the buffer

    def body_of(mark: bytes) -> list[bytes]:
        return [mark * (piece_size // len(mark)) + bytes([index]) for index in range(pieces)]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream_octets(request, body_of(await request.read()))

    context, host = None, "127.0.0.1"
    if tls:
        cert, key = request.getfixturevalue("certificate")
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # read when the engine is made
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        host = "localhost"  # the name the certificate gives
    runner, port = await serve("/mark", handler, context)
    engine = make_engine("httptools", EngineConfig(source_name="marks", plain_http=not tls))
    url = f"{'https' if tls else 'http'}://{host}:{port}/mark"

    async def fetch(mark: bytes, behind: bool = False) -> list[bytes]:
        response = await engine.post(url, mark)
        if behind:  # nothing read yet: the connection stops reading, the others go on
            await wait_until(lambda: response.reading_paused)
        chunks = []
        while chunk := await response.read_chunk():
            chunks.append(chunk)
            await asyncio.sleep(0)  # the other connections read meanwhile
        await response.aclose()
        return chunks

    try:
        marks = [b"%02d" % n for n in range(24)]
        async with asyncio.timeout(60):  # a body that never ends fails, not hangs
            got = await asyncio.gather(*(fetch(mark, behind=mark == b"07") for mark in marks))
            await asyncio.gather(*(fetch(mark) for mark in reversed(marks)))  # more reads after
    finally:
        await engine.aclose()
        await runner.cleanup()
    for mark, chunks in zip(marks, got, strict=True):
        assert all(type(chunk) is bytes for chunk in chunks)
        assert b"".join(chunks) == b"".join(body_of(mark))


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("engine", ["httpx", "httptools"])
async def test_sending_to_a_server_that_never_reads_is_bounded_by_the_read_timeout(
    engine: str,
) -> None:
    # The kernel completes the handshake, nobody accepts: the socket's buffers fill and the
    # request stays unsent. httpx bounds the send by its write timeout (= read_timeout_s).
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/chat/completions"
    client = make_engine(engine, EngineConfig(source_name="w", read_timeout_s=0.2, plain_http=True))
    try:
        async with asyncio.timeout(60):  # a guard against a hang, not a measured bound
            with pytest.raises(TransientError) as caught:
                await client.post(url, b"x" * (32 << 20))
        assert caught.value.reason == "timeout"
    finally:
        await client.aclose()
        listener.close()


class _MovableClockLoop(asyncio.SelectorEventLoop):
    """Real I/O on a clock the test moves forward (its timers fire by it): waits measured in
    seconds pass at once, exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0.0

    def time(self) -> float:
        return super().time() + self.moved


def test_waiting_for_a_connection_and_connecting_share_one_connect_timeout() -> None:
    budget = 100.0

    async def scenario(loop: _MovableClockLoop) -> None:
        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()
            writer.close()

        holder_server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        holder_url = f"http://127.0.0.1:{holder_server.sockets[0].getsockname()[1]}/v1"
        # A listener whose accept queue is full: the kernel drops further handshakes, so a
        # connection to it never completes.
        full = socket.socket()
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = []
        for _ in range(2):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(full.getsockname())
            queued.append(filler)
        full_url = f"http://127.0.0.1:{full.getsockname()[1]}/v1"
        engine = HttptoolsEngine(
            EngineConfig(source_name="budget", max_connections=1, connect_timeout_s=budget)
        )
        holder = asyncio.create_task(engine.post(holder_url, b"{}"))
        waiter: asyncio.Task[Any] | None = None
        try:
            await wait_until(lambda: engine.busy_connections == 1)  # the only permit is taken
            waiter = asyncio.create_task(engine.post(full_url, b"{}"))
            for _ in range(3):
                await asyncio.sleep(0)  # the waiter queues for the permit
            loop.moved += 0.9 * budget  # ... and waits most of connect_timeout_s for it
            holder.cancel()  # the permit is free: the waiter connects, which never completes
            with pytest.raises(asyncio.CancelledError):
                await holder
            for _ in range(3):
                await asyncio.sleep(0)
            loop.moved += 0.2 * budget  # past the budget, counted from the call's start
            for _ in range(20):
                if waiter.done():
                    break
                await asyncio.sleep(0)
            assert waiter.done(), "connecting got a connect_timeout_s of its own"
            with pytest.raises(TransientError) as caught:
                await waiter
            assert caught.value.reason == "timeout"
        finally:
            for task in (holder, waiter):
                if task is not None and not task.done():
                    task.cancel()
            await asyncio.gather(holder, *([waiter] if waiter else []), return_exceptions=True)
            await engine.aclose()
            holder_server.close()
            for sock in (full, *queued):
                sock.close()

    with asyncio.Runner(loop_factory=_MovableClockLoop) as runner:
        loop = runner.get_loop()
        assert isinstance(loop, _MovableClockLoop)
        runner.run(scenario(loop))


# --------------------------------------------------------------------------- reprs, cache


def test_no_credential_in_a_target_repr_and_the_url_cache_is_bounded() -> None:
    keyed = HttptoolsEngine(
        EngineConfig(source_name="r", headers={"Authorization": "Bearer sk-repr-0123456789"})
    )
    by_url = HttptoolsEngine(EngineConfig(source_name="r"))
    url = "http://127.0.0.1:9/v1/chat/completions"
    shown = repr(keyed._target(url)) + repr(by_url._target(url.replace("//", "//us:pw-secret@")))
    shown += repr(keyed._targets) + repr(by_url._targets)
    assert "sk-repr-0123456789" not in shown
    assert "pw-secret" not in shown
    assert base64.b64encode(b"us:pw-secret").decode() not in shown
    assert "127.0.0.1" in shown  # what a target is, still readable
    for index in range(2000):  # URLs varying per call (their query)
        keyed._target(f"{url}?call={index}")
    assert len(keyed._targets) <= 256


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` only (not for 127.0.0.1)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
async def tls_upstream(certificate: tuple[Path, Path]) -> AsyncIterator[int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        asked = orjson.loads(await request.read())
        if asked.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for start in range(0, len(SSE), 9):
                await response.write(SSE[start : start + 9])
            await response.write_eof()
            return response
        return web.Response(
            body=gzip.compress(orjson.dumps(ANSWER)),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    runner, port = await serve("/v1/chat/completions", handler, context)
    yield port
    await runner.cleanup()


@needs_openssl
@pytest.mark.parametrize("engine", ["aiohttp", "httptools"])
async def test_tls_verifies_the_certificate_by_default(tls_upstream: int, engine: str) -> None:
    source = dataclasses.replace(
        source_at(f"https://localhost:{tls_upstream}/v1"),
        api_key=Secret("sk-tls-0123456789abcdef"),
        options={"engine": engine},
    )
    error = await send_expecting_error(source)
    assert error.reason == "network_error"
    assert "certificate" in str(error).lower()
    assert "sk-tls-0123456789abcdef" not in str(error)


@needs_openssl
async def test_tls_with_a_trusted_certificate_streams_and_checks_the_host_name(
    tls_upstream: int, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's default context, begun with the engine, trusts what this names (aiohttp
    # builds its context when imported, so it cannot be shown the same way).
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    source = source_at(f"https://localhost:{tls_upstream}/v1")
    transport = OpenAICompatTransport(source)
    # The store named when the engine was made is the one read, in its thread, whenever that
    # runs (a context made at the first connection would trust nothing here).
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0].with_name("absent.pem")))
    try:
        streamed = await transport.send(chat(), source, call_id="c")
        zipped = await transport.send(chat(stream=False), source, call_id="c")
    finally:
        await transport.aclose()
    assert streamed.content == "over tls"
    assert zipped.content == "plain"
    # The same server by address: the certificate does not name 127.0.0.1.
    elsewhere = dataclasses.replace(source, base_url=f"https://127.0.0.1:{tls_upstream}/v1")
    text = str(await send_expecting_error(elsewhere)).lower()
    assert "certificate" in text or "hostname" in text


# --------------------------------------------------------------------------- refused set-ups


def test_proxies_and_broken_header_values_are_refused() -> None:
    with pytest.raises(ConfigError, match="does not use proxies"):
        OpenAICompatTransport(source_at("http://127.0.0.1:9/v1", trust_env=True))
    secret = "tok-with-a-line-break-0123456789"
    with pytest.raises(ConfigError, match="line break") as caught:
        OpenAICompatTransport(
            source_at("http://127.0.0.1:9/v1", headers={"X-Token": f"{secret}\r\nX-Evil: 1"})
        )
    assert secret not in str(caught.value)


class _RecordingTransport(asyncio.Transport):
    """Keeps what is written, as the objects given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(data)  # type: ignore[arg-type]

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("size", [10, 64 * 1024, 64 * 1024 + 1, 5 << 20])
async def test_a_large_body_is_written_as_it_is_never_joined_to_its_head(size: int) -> None:
    connection = httptools_engine._Connection(
        asyncio.get_running_loop(), httptools_engine.read_buffer()
    )
    transport = _RecordingTransport()
    connection.connection_made(transport)
    head, body = b"POST /v1 HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % size, b"x" * size
    assert connection.send(head, body) is False
    assert b"".join(transport.writes) == head + body
    if size > 64 * 1024:  # an image's megabytes: the body object itself, no copy
        assert len(transport.writes) == 2 and transport.writes[1] is body
    else:  # one write, one system call
        assert len(transport.writes) == 1


@needs_openssl
def test_one_tls_context_serves_every_engine_of_a_ca_store(
    monkeypatch: pytest.MonkeyPatch, certificate: tuple[Path, Path]
) -> None:
    # Made once per CA store, not once per https source (each costs a read of the whole store).
    first = httptools_engine.tls_context()
    assert httptools_engine.tls_context() is first
    context = first.result(timeout=60)  # made in a thread of its own
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))  # a store of its own
    other = httptools_engine.tls_context()
    assert other is not first and other.result(timeout=60) is not context
    assert [cert["subject"] for cert in other.result().get_ca_certs()] == [
        ((("commonName", "localhost"),),)
    ]


@needs_openssl
async def test_a_call_that_stops_waiting_leaves_the_shared_context_to_be_made(
    certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    store = tmp_path / "store.pem"  # a store of its own: its context is only now begun
    store.write_bytes(certificate[0].read_bytes())
    made = httptools_engine.tls_context_of(str(store), None)
    waiting = asyncio.wrap_future(made)
    waiting.cancel()  # a cancelled call: what it waited on is every engine's
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not made.cancelled()
    assert isinstance(made.result(timeout=60), ssl.SSLContext)
    assert httptools_engine.tls_context_of(str(store), None) is made


def _threaded_tls_server(certificate: tuple[Path, Path]) -> tuple[ThreadingHTTPServer, int]:
    """A TLS server in threads of its own, answering every POST with the streamed answer
    (serves a forked child while the parent waits for it)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(SSE)))
            self.end_headers()
            self.wfile.write(SSE)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@needs_openssl
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_while_the_context_is_made_makes_its_own(
    certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = tmp_path / "large.pem"  # long enough to read that the fork comes first
    store.write_bytes(certificate[0].read_bytes() * 300)
    monkeypatch.setenv("SSL_CERT_FILE", str(store))
    server, port = _threaded_tls_server(certificate)
    try:
        source = source_at(f"https://localhost:{port}/v1")
        transport = OpenAICompatTransport(source)
        forked_while_made = not engine_of(transport)._tls.done()
        child = os.fork()
        if child == 0:  # the child: its call must not wait on the parent's thread
            code = 1
            try:
                answer = asyncio.run(transport.send(chat(), source, call_id="c"))
                code = 0 if answer.content == "over tls" else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert forked_while_made  # else this run forked too late to show it
    finally:
        server.shutdown()
        server.server_close()


@needs_openssl
async def test_a_ca_store_that_cannot_be_read_fails_the_https_calls_not_the_build(
    tls_upstream: int,
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(broken))
    source = source_at(f"https://localhost:{tls_upstream}/v1")
    transport = OpenAICompatTransport(source)  # the store is read in a thread: no error yet
    try:
        for _ in range(2):  # every call says so, not only the first
            with pytest.raises(SourceDeadError) as caught:
                await transport.send(chat(), source, call_id="c")
            text = str(caught.value)
            assert "no TLS context could be made" in text and str(broken) in text
            assert caught.value.source_name == "ht" and caught.value.__cause__ is None
        # Repaired, the same engine reads the store again at its next connection.
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
        assert (await transport.send(chat(), source, call_id="c")).content == "over tls"
    finally:
        await transport.aclose()


@needs_openssl
async def test_a_ca_store_repaired_where_it_is_is_read_at_the_next_connection(
    tls_upstream: int,
    certificate: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    store = tmp_path / "store.pem"
    store.write_text("not a certificate\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(store))
    source = source_at(f"https://localhost:{tls_upstream}/v1")
    transport = OpenAICompatTransport(source)
    try:
        with pytest.raises(SourceDeadError):
            await transport.send(chat(), source, call_id="c")
        store.write_bytes(certificate[0].read_bytes())  # same path: the same cache key
        assert (await transport.send(chat(), source, call_id="c")).content == "over tls"
    finally:
        await transport.aclose()
