"""The fake upstream, checked with raw clients (raw sockets, httpx, aiohttp), never the library."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.testing import FakeUpstream, ReceivedRequest, Reply
from polygateway.testing.contracts.transport import wait_until
from polygateway.testing.fake_upstream import estimate_tokens
from polygateway.testing.fake_upstream.replies import piece_count, split
from polygateway.testing.fake_upstream.wire import dumps

FIXED_TIME = 1_700_000_000
MESSAGES = [{"role": "user", "content": "hello"}]


class GatedClock:
    """Every delay waits until the test releases it, so ordering needs no real time."""

    def __init__(self, *, block: bool = True) -> None:
        self.block = block
        self.requested: list[float] = []
        self._gates: list[asyncio.Future[None]] = []
        self._changed: asyncio.Condition | None = None

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return float(FIXED_TIME)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def sleep(self, seconds: float) -> None:
        self.requested.append(seconds)
        if not self.block:
            return
        gate = asyncio.get_running_loop().create_future()
        self._gates.append(gate)
        async with self._condition():
            self._condition().notify_all()
        await gate

    async def wait_sleeping(self, n: int) -> None:
        async with asyncio.timeout(5), self._condition():
            await self._condition().wait_for(lambda: len(self.sleeping()) >= n)

    def sleeping(self) -> list[asyncio.Future[None]]:
        return [gate for gate in self._gates if not gate.done()]

    def release(self) -> None:
        for gate in self.sleeping():
            gate.set_result(None)


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(clock=GatedClock(block=False)) as server:
        yield server


def chat_body(stream: bool = False, include_usage: bool | None = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "stream": stream, **extra}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    return json.dumps(body).encode()


def http_request(
    path: str, body: bytes | None = None, *, method: str = "POST", close: bool = True
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + (body or b"")


async def exchange(port: int, request: bytes) -> bytes:
    """Send one request, read everything until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await reader.read()
    finally:
        writer.close()


def split_response(data: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status_line, headers, body


def frame(event: bytes) -> bytes:
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


def dechunk(body: bytes) -> list[bytes]:
    """The HTTP chunks of a chunked body; asserts the body is properly terminated."""
    chunks = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n", "chunked body must end with 0\\r\\n\\r\\n"
            return chunks
        chunks.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def events(chunks: list[bytes]) -> list[Any]:
    """Each chunk is exactly one SSE event; returns the parsed JSON (or the text of [DONE])."""
    parsed: list[Any] = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
        payload = chunk[6:-2]
        parsed.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return parsed


async def stream_events(fake: FakeUpstream, source: str | None = None, **body: Any) -> list[Any]:
    data = await exchange(
        fake.port,
        http_request(
            (f"/{source}" if source else "") + "/v1/chat/completions", chat_body(True, **body)
        ),
    )
    status, headers, raw = split_response(data)
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    return events(dechunk(raw))


def content_of(parsed: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in parsed
        if isinstance(e, dict) and e.get("choices")
    )


# -- streaming ---------------------------------------------------------------------------------


async def test_stream_bytes_are_exactly_the_openai_wire_format(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok("Hi there", chunks=2))
    data = await exchange(
        fake.port, http_request("/v1/chat/completions", chat_body(True, include_usage=True))
    )
    status, headers, body = split_response(data)
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    assert "content-length" not in headers
    head = (
        '{"id":"chatcmpl-fake1","object":"chat.completion.chunk","created":1700000000,'
        '"model":"m","choices":'
    )

    def chunk(delta: str, finish: str = "null") -> bytes:
        text = f'data: {head}[{{"index":0,"delta":{delta},"logprobs":null,'
        return (text + f'"finish_reason":{finish}}}],"usage":null}}\n\n').encode()

    expected = [
        chunk('{"role":"assistant","content":""}'),
        chunk('{"content":"Hi t"}'),
        chunk('{"content":"here"}'),
        chunk("{}", '"stop"'),
        f'data: {head}[],"usage":{{"prompt_tokens":1,"completion_tokens":2,'
        '"total_tokens":3}}\n\n'.encode(),
        b"data: [DONE]\n\n",
    ]
    assert body == b"".join(frame(e) for e in expected) + b"0\r\n\r\n"


async def test_stream_without_include_usage_has_no_usage_key_and_no_usage_chunk(
    fake: FakeUpstream,
) -> None:
    parsed = await stream_events(fake)
    assert parsed[-1] == "[DONE]"
    chunks = parsed[:-1]
    assert all("usage" not in c for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert content_of(parsed) == "Hello from the fake upstream."


@pytest.mark.parametrize(
    ("forced", "asked", "expect_usage"), [(True, None, True), (False, True, False)]
)
async def test_include_usage_can_be_forced_either_way(
    fake: FakeUpstream, forced: bool, asked: bool | None, expect_usage: bool
) -> None:
    fake.script("default", Reply.ok("abcdefgh", include_usage=forced))
    parsed = await stream_events(fake, include_usage=asked)
    usage_chunks = [c for c in parsed[:-1] if c["choices"] == []]
    assert len(usage_chunks) == (1 if expect_usage else 0)
    if expect_usage:
        assert usage_chunks[0]["usage"]["completion_tokens"] == 2
        assert parsed[-2] is usage_chunks[0], "the usage chunk comes just before [DONE]"


async def test_stream_ids_model_and_created_are_consistent(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok(model="served-model-v2", finish_reason="length"))
    parsed = await stream_events(fake, include_usage=True)
    chunks = parsed[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {"served-model-v2"}
    assert {c["created"] for c in chunks} == {FIXED_TIME}
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    second = await stream_events(fake)
    assert second[0]["id"] != chunks[0]["id"]


async def test_default_chunking_and_explicit_chunk_count(fake: FakeUpstream) -> None:
    long_text = "x" * 1000
    fake.script("default", Reply.ok(long_text), Reply.ok(long_text, chunks=7), Reply.ok("abc"))
    counts = []
    for _ in range(3):
        parsed = await stream_events(fake)
        counts.append(len(parsed) - 3)  # minus role, finish, [DONE]
        assert content_of(parsed) in (long_text, "abc")
    assert counts == [20, 7, 1]


async def test_reasoning_streams_first_as_reasoning_content(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok("The answer.", reasoning="Let me think.", chunks=2))
    parsed = await stream_events(fake)
    deltas = [c["choices"][0]["delta"] for c in parsed[:-2]]
    assert deltas[0] == {"role": "assistant", "content": None, "reasoning_content": ""}
    reasoning = [d for d in deltas[1:] if d.get("reasoning_content")]
    answer = [d for d in deltas[1:] if d.get("content")]
    assert all(d["content"] is None for d in reasoning)
    assert all(d["reasoning_content"] is None for d in answer)
    assert deltas[1:] == reasoning + answer, "all reasoning comes before the content"
    assert "".join(d["reasoning_content"] for d in reasoning) == "Let me think."
    assert "".join(d["content"] for d in answer) == "The answer."


async def test_think_inline_puts_reasoning_inside_content(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok("42", reasoning="hmm", think_inline=True))
    parsed = await stream_events(fake)
    assert content_of(parsed) == "<think>hmm</think>42"
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in parsed[:-2])


async def test_content_callable_answers_from_the_request(fake: FakeUpstream) -> None:
    fake.set_default(
        "default", Reply.ok(lambda request: request["messages"][-1]["content"].upper())
    )
    parsed = await stream_events(fake)
    assert content_of(parsed) == "HELLO"


async def test_failing_content_callable_gives_a_500(fake: FakeUpstream) -> None:
    def broken(request: Any) -> str:
        raise KeyError("nope")

    fake.script("default", Reply.ok(broken))
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
    assert response.status_code == 500
    assert "KeyError" in response.json()["error"]["message"]


# -- non-streaming -----------------------------------------------------------------------------


async def test_non_stream_json_shape(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok("Fine.", prompt_tokens=812, completion_tokens=9))
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    assert response.json() == {
        "id": "chatcmpl-fake1",
        "object": "chat.completion",
        "created": FIXED_TIME,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Fine.", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 812, "completion_tokens": 9, "total_tokens": 821},
    }


async def test_non_stream_reasoning_and_usage_details(fake: FakeUpstream) -> None:
    fake.script("default", Reply.ok("ok", reasoning="r" * 40), Reply.ok(include_usage=False))
    async with httpx.AsyncClient() as client:
        url = fake.base_url() + "/chat/completions"
        first = (await client.post(url, content=chat_body())).json()
        second = (await client.post(url, content=chat_body())).json()
    assert first["choices"][0]["message"]["reasoning_content"] == "r" * 40
    assert first["usage"]["completion_tokens"] == estimate_tokens("ok") + 10
    assert first["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}
    assert "usage" not in second


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "status", "type_", "code"),
    [
        (Reply.error(400), 400, "invalid_request_error", None),
        (Reply.error(401), 401, "invalid_request_error", "invalid_api_key"),
        (Reply.error(403), 403, "request_forbidden", "unsupported_country_region_territory"),
        (Reply.error(404), 404, "invalid_request_error", "model_not_found"),
        (Reply.error(429), 429, "requests", "rate_limit_exceeded"),
        (Reply.error(429, quota=True), 429, "insufficient_quota", "insufficient_quota"),
        (Reply.error(500), 500, "server_error", None),
        (Reply.error(502), 502, "server_error", None),
        (Reply.error(503), 503, "server_error", None),
        (Reply.error(504), 504, "server_error", None),
        (Reply.error(418, code="teapot", type="odd"), 418, "odd", "teapot"),
    ],
)
async def test_error_status_and_openai_error_body(
    fake: FakeUpstream, reply: Reply, status: int, type_: str, code: str | None
) -> None:
    fake.script("default", reply)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            fake.base_url() + "/chat/completions", content=chat_body(stream=True)
        )
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (type_, code, None)
    assert error["message"]


async def test_error_retry_after_message_and_verbatim_body(fake: FakeUpstream) -> None:
    fake.script(
        "default",
        Reply.error(429, retry_after=2, message="slow down"),
        Reply.error(503, retry_after=0.5),
        Reply.error(502, body="<html>bad gateway</html>"),
    )
    async with httpx.AsyncClient() as client:
        url = fake.base_url() + "/chat/completions"
        first, second, third = [await client.post(url, content=chat_body()) for _ in range(3)]
    assert first.headers["retry-after"] == "2"
    assert first.json()["error"]["message"] == "slow down"
    assert second.headers["retry-after"] == "0.5"
    assert third.status_code == 502
    assert third.content == b"<html>bad gateway</html>"


async def test_unknown_route_is_a_404_with_an_openai_body(fake: FakeUpstream) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url("a") + "/completions", content=b"{}")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert fake.requests(route="other") == 1
    assert fake.requests(route="chat") == 0


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b""])
async def test_malformed_request_json_is_a_400_and_does_not_consume_the_script(
    fake: FakeUpstream, payload: bytes
) -> None:
    fake.script("default", Reply.error(503))
    async with httpx.AsyncClient() as client:
        url = fake.base_url() + "/chat/completions"
        rejected = await client.post(url, content=payload)
        scripted = await client.post(url, content=chat_body())
    assert rejected.status_code == 400
    assert rejected.json()["error"]["type"] == "invalid_request_error"
    assert scripted.status_code == 503
    assert fake.requests() == 2


# -- stream faults -----------------------------------------------------------------------------


async def test_cut_ends_the_body_cleanly_without_finish_usage_or_done(fake: FakeUpstream) -> None:
    fake.script("default", Reply.cut(after_chunks=3))
    parsed = await stream_events(fake, include_usage=True)  # dechunk checks the clean end
    assert "[DONE]" not in parsed
    assert len(parsed) == 4  # role + 3 content chunks
    assert all(c["choices"] and c["choices"][0]["finish_reason"] is None for c in parsed)
    assert content_of(parsed) == "Hello from the fake upstream."[: len(content_of(parsed))]


async def test_cut_json_closes_the_connection_mid_body(fake: FakeUpstream) -> None:
    fake.script("default", Reply.cut())
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await client.post(fake.base_url() + "/chat/completions", content=chat_body())


async def test_early_eof_sends_headers_and_zero_events(fake: FakeUpstream) -> None:
    fake.script("default", Reply.early_eof(), Reply.early_eof())
    assert await stream_events(fake) == []
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
    assert (response.status_code, response.content) == (200, b"")


async def test_malformed_frame_is_invalid_json_and_the_rest_is_well_formed(
    fake: FakeUpstream,
) -> None:
    fake.script("default", Reply.malformed(after_chunks=1))
    data = await exchange(fake.port, http_request("/v1/chat/completions", chat_body(True)))
    chunks = dechunk(split_response(data)[2])
    bad = [c for c in chunks if c != b"data: [DONE]\n\n" and not _is_json_event(c)]
    assert len(bad) == 1
    assert chunks.index(bad[0]) == 2  # after the role chunk and one content chunk
    good = events([c for c in chunks if c is not bad[0]])
    assert content_of(good) == "Hello from the fake upstream."
    assert good[-1] == "[DONE]"

    fake.script("default", Reply.malformed())
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
    assert response.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.content)


def _is_json_event(chunk: bytes) -> bool:
    try:
        json.loads(chunk[6:-2])
    except ValueError:
        return False
    return True


async def test_empty_is_a_complete_stream_with_empty_content(fake: FakeUpstream) -> None:
    fake.script("default", Reply.empty(), Reply.empty())
    parsed = await stream_events(fake, include_usage=True)
    assert content_of(parsed) == ""
    assert parsed[-1] == "[DONE]"
    assert parsed[-2]["choices"] == [] and parsed[-2]["usage"]["completion_tokens"] >= 0
    assert parsed[-3]["choices"][0]["finish_reason"] == "stop"
    async with httpx.AsyncClient() as client:
        response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
    assert response.json()["choices"][0]["message"]["content"] == ""
    assert "usage" in response.json()


async def test_mid_stream_error_event_after_200(fake: FakeUpstream) -> None:
    fake.script("default", Reply.mid_stream_error(after_chunks=1))
    parsed = await stream_events(fake, include_usage=True)
    assert len(parsed) == 3
    assert "choices" not in parsed[-1]
    assert parsed[-1]["error"]["type"] == "server_error"
    assert "[DONE]" not in parsed


async def test_reset_before_headers_is_a_connection_error_for_every_client(
    fake: FakeUpstream,
) -> None:
    fake.script("default", Reply.reset(), Reply.reset(), Reply.reset())
    with pytest.raises(ConnectionResetError):
        await exchange(fake.port, http_request("/v1/chat/completions", chat_body(True)))
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadError):
            await client.post(fake.base_url() + "/chat/completions", content=chat_body(True))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.post(fake.base_url() + "/chat/completions", data=chat_body(True))
    assert fake.requests() == 3
    assert fake.inflight() == 0


async def test_reset_after_headers_delivers_the_status_then_resets(fake: FakeUpstream) -> None:
    fake.script("default", Reply.reset(after_headers=True), Reply.reset(after_headers=True))
    reader, writer = await asyncio.open_connection("127.0.0.1", fake.port)
    try:
        writer.write(http_request("/v1/chat/completions", chat_body(True), close=False))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"text/event-stream" in head
        with pytest.raises(ConnectionResetError):
            await reader.read()
    finally:
        writer.close()
    async with (
        aiohttp.ClientSession() as session,
        session.post(fake.base_url() + "/chat/completions", data=chat_body(True)) as response,
    ):
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()


async def test_black_hole_never_answers_and_the_client_times_out(fake: FakeUpstream) -> None:
    fake.script("default", Reply.black_hole())
    timeout = httpx.Timeout(5.0, read=0.2)
    async with httpx.AsyncClient(timeout=timeout) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(fake.base_url() + "/chat/completions", content=chat_body(True))
    assert fake.requests() == 1


async def test_stop_closes_black_holed_and_delayed_connections() -> None:
    fake = FakeUpstream()
    await fake.start()
    fake.script("default", Reply.black_hole(), Reply.ok(headers_delay=3600))
    async with httpx.AsyncClient(timeout=30) as client:
        url = fake.base_url() + "/chat/completions"
        calls = [asyncio.create_task(client.post(url, content=chat_body())) for _ in range(2)]
        await fake.wait_for_requests(2)
        assert fake.inflight() == 2
        async with asyncio.timeout(5):
            await fake.stop()
            results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, httpx.TransportError) for r in results), results
    assert fake.inflight() == 0


async def test_reset_closes_connections_still_being_answered(fake: FakeUpstream) -> None:
    fake.script("default", Reply.black_hole())
    async with httpx.AsyncClient(timeout=30) as client:
        call = asyncio.create_task(
            client.post(fake.base_url() + "/chat/completions", content=chat_body())
        )
        await fake.wait_for_requests(1)
        fake.reset()
        with pytest.raises(httpx.TransportError):
            async with asyncio.timeout(5):
                await call
    assert (fake.requests(), fake.inflight()) == (0, 0)


# -- delays ------------------------------------------------------------------------------------


async def test_delays_are_requested_in_order_for_streams_and_json() -> None:
    clock = GatedClock(block=False)
    async with FakeUpstream(clock=clock) as fake:
        delays = {"headers_delay": 1.0, "first_token_delay": 2.0, "inter_token_delay": 3.0}
        fake.script("default", Reply.ok("abcd", chunks=4, **delays))
        parsed = await stream_events(fake)
        assert content_of(parsed) == "abcd"
        assert clock.requested == [1.0, 2.0, 3.0, 3.0, 3.0]

        clock.requested.clear()
        fake.script(
            "default",
            Reply.ok("abcd", chunks=4, **delays),
            Reply.error(500, **{"headers_delay": 0.5}),
        )
        async with httpx.AsyncClient() as client:
            await client.post(fake.base_url() + "/chat/completions", content=chat_body())
            await client.post(fake.base_url() + "/chat/completions", content=chat_body())
        # JSON: the whole generation time before the status line; errors: headers_delay.
        assert clock.requested == [1.0 + 2.0 + 3 * 3.0, 0.5]


async def test_role_chunk_precedes_first_token_delay_and_content_follows_it() -> None:
    clock = GatedClock()
    async with FakeUpstream(clock=clock) as fake:
        fake.script("default", Reply.ok("abc", chunks=1, first_token_delay=9.0))
        reader, writer = await asyncio.open_connection("127.0.0.1", fake.port)
        try:
            writer.write(http_request("/v1/chat/completions", chat_body(True)))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK")
            size = int(await reader.readuntil(b"\r\n"), 16)
            role = json.loads((await reader.readexactly(size + 2))[6:-4])
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            await clock.wait_sleeping(1)
            assert clock.requested == [9.0]
            clock.release()
            rest = dechunk(await reader.read())
        finally:
            writer.close()
        assert content_of(events(rest)) == "abc"


async def test_headers_delay_holds_back_the_status_line() -> None:
    clock = GatedClock()
    async with FakeUpstream(clock=clock) as fake:
        fake.script("default", Reply.ok(headers_delay=4.0))
        reader, writer = await asyncio.open_connection("127.0.0.1", fake.port)
        try:
            writer.write(http_request("/v1/chat/completions", chat_body(True)))
            first_byte = asyncio.create_task(reader.read(1))
            await clock.wait_sleeping(1)
            assert fake.inflight() == 1
            assert not first_byte.done()
            clock.release()
            assert await first_byte == b"H"
        finally:
            writer.close()


async def test_real_time_delay_is_measurable() -> None:
    async with FakeUpstream() as fake:
        fake.script("default", Reply.ok(headers_delay=0.15))
        async with httpx.AsyncClient() as client:
            started = time.perf_counter()
            response = await client.post(fake.base_url() + "/chat/completions", content=chat_body())
            elapsed = time.perf_counter() - started
    assert response.status_code == 200
    assert elapsed >= 0.15


async def test_large_delayed_stream_survives_write_backpressure(fake: FakeUpstream) -> None:
    content = "0123456789" * 300_000
    fake.script("default", Reply.ok(content, chunks=20, first_token_delay=0.001))
    async with (
        aiohttp.ClientSession() as session,
        session.post(fake.base_url() + "/chat/completions", data=chat_body(True)) as response,
    ):
        received = []
        async for line in response.content:
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                received.append(delta.get("content") or "")
    assert "".join(received) == content


# -- counters, sources, scripts ----------------------------------------------------------------


async def test_max_inflight_counts_concurrent_requests_per_source() -> None:
    clock = GatedClock()
    async with FakeUpstream(clock=clock) as fake:
        fake.set_default("a", Reply.ok(headers_delay=1.0))
        fake.set_default("b", Reply.ok(headers_delay=1.0))
        async with httpx.AsyncClient() as client:
            calls = [
                asyncio.create_task(
                    client.post(fake.base_url(src) + "/chat/completions", content=chat_body())
                )
                for src in ["a"] * 5 + ["b"] * 3
            ]
            await clock.wait_sleeping(8)
            assert (fake.inflight("a"), fake.inflight("b"), fake.inflight()) == (5, 3, 8)
            clock.release()
            responses = await asyncio.gather(*calls)
        assert all(r.status_code == 200 for r in responses)
        assert (fake.max_inflight("a"), fake.max_inflight("b"), fake.max_inflight()) == (5, 3, 8)
        assert (fake.inflight("a"), fake.inflight()) == (0, 0)
        assert (fake.requests("a"), fake.requests("b"), fake.requests()) == (5, 3, 8)
        assert fake.requests("a", route="embeddings") == 0


async def test_answer_together_holds_requests_until_a_group_is_full(fake: FakeUpstream) -> None:
    fake.answer_together("a", 3)
    async with httpx.AsyncClient() as client:

        def post(source: str) -> asyncio.Task[httpx.Response]:
            url = fake.base_url(source) + "/chat/completions"
            return asyncio.create_task(client.post(url, content=chat_body()))

        first = [post("a"), post("a")]
        await fake.wait_for_requests(2, "a")
        # Another source is not held: its answer comes while the two wait.
        assert (await post("b")).status_code == 200
        assert fake.inflight("a") == 2 and not any(task.done() for task in first)
        responses = await asyncio.gather(*first, post("a"))
        assert [r.status_code for r in responses] == [200] * 3
        assert fake.max_inflight("a") == 3  # none was answered before the third arrived
        fake.answer_together("a", 1)  # ends it
        assert (await post("a")).status_code == 200


async def test_a_client_leaving_answer_together_drops_out_of_its_group(
    fake: FakeUpstream,
) -> None:
    fake.answer_together("a", 2)
    url = fake.base_url("a") + "/chat/completions"
    async with httpx.AsyncClient() as leaving:
        left = asyncio.create_task(leaving.post(url, content=chat_body()))
        await fake.wait_for_requests(1, "a")
        left.cancel()
    await asyncio.gather(left, return_exceptions=True)
    await wait_until(lambda: fake.inflight("a") == 0)  # its connection closed: it left
    async with httpx.AsyncClient() as client:
        alone = asyncio.create_task(client.post(url, content=chat_body()))
        await fake.wait_for_requests(2, "a")
        assert fake.inflight("a") == 1 and not alone.done()  # the one that left does not count
        responses = await asyncio.gather(alone, client.post(url, content=chat_body()))
    assert [r.status_code for r in responses] == [200, 200]


async def test_ending_answer_together_answers_the_requests_it_held(fake: FakeUpstream) -> None:
    fake.answer_together("a", 3)
    url = fake.base_url("a") + "/chat/completions"
    async with httpx.AsyncClient() as client:
        held = [asyncio.create_task(client.post(url, content=chat_body())) for _ in range(2)]
        await fake.wait_for_requests(2, "a")
        assert fake.inflight("a") == 2
        fake.answer_together("a", 1)
        async with asyncio.timeout(30):
            responses = await asyncio.gather(*held)
    assert [r.status_code for r in responses] == [200, 200]


def test_ending_answer_together_from_another_thread_answers_the_held_request() -> None:
    with FakeUpstream.in_thread() as fake, ThreadPoolExecutor(1) as pool:
        fake.answer_together("a", 2)
        url = fake.base_url("a") + "/chat/completions"
        held = pool.submit(httpx.post, url, content=chat_body(), timeout=30)
        fake.wait_for_requests_sync(1, "a")
        fake.answer_together("a", 1)  # from this thread, not the server's
        assert held.result(timeout=30).status_code == 200


def test_answer_together_rejects_a_size_below_one() -> None:
    fake = FakeUpstream()
    for size in (0, -2, 2.0):
        with pytest.raises(ValueError, match="size must be an int >= 1"):
            fake.answer_together("a", size)  # type: ignore[arg-type]


async def test_scripts_are_fifo_per_source_then_default(fake: FakeUpstream) -> None:
    fake.script("a", Reply.error(500), Reply.ok("from script"))
    fake.set_default("b", Reply.error(401))
    fake.set_default("a", Reply.ok("a default"))
    async with httpx.AsyncClient() as client:

        async def call(source: str | None) -> tuple[int, str]:
            response = await client.post(
                fake.base_url(source) + "/chat/completions", content=chat_body()
            )
            body = response.json()
            text = body["choices"][0]["message"]["content"] if response.status_code == 200 else ""
            return response.status_code, text

        assert [await call("a") for _ in range(3)] == [
            (500, ""),
            (200, "from script"),
            (200, "a default"),
        ]
        assert await call("b") == (401, "")
        assert await call(None) == (200, "Hello from the fake upstream.")
        assert await call("default") == (200, "Hello from the fake upstream.")
        assert (fake.requests("a"), fake.requests("b"), fake.requests("default")) == (3, 1, 2)

        fake.reset()
        assert fake.requests() == 0
        assert await call("b") == (200, "Hello from the fake upstream.")


async def test_default_reply_of_the_server_applies_to_every_source() -> None:
    async with FakeUpstream(default_reply=Reply.ok("bench", chunks=2)) as fake:
        fake.set_default("x", Reply.ok("own"))
        assert content_of(await stream_events(fake, "any")) == "bench"
        assert content_of(await stream_events(fake, "x")) == "own"
        fake.reset()
        assert content_of(await stream_events(fake, "x")) == "bench"


async def test_received_requests_record_body_headers_and_path(fake: FakeUpstream) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(
            fake.base_url("a") + "/chat/completions?x=1",
            content=chat_body(temperature=0.5),
            headers={"Authorization": "Bearer sk-test", "X-Trace": "t1"},
        )
    [received] = fake.received("a")
    assert isinstance(received, ReceivedRequest)
    assert received.source == "a"
    assert received.path == "/a/v1/chat/completions?x=1"
    assert received.body["temperature"] == 0.5
    assert received.headers["authorization"] == "Bearer sk-test"
    assert received.headers["x-trace"] == "t1"
    assert fake.received("b") == []
    assert fake.received(route="embeddings") == []


async def test_wait_for_requests_wakes_on_arrival_and_times_out(fake: FakeUpstream) -> None:
    fake.script("a", Reply.black_hole(), Reply.black_hole())
    async with httpx.AsyncClient(timeout=30) as client:
        url = fake.base_url("a") + "/chat/completions"
        waiter = asyncio.create_task(fake.wait_for_requests(2, source="a"))
        calls = [asyncio.create_task(client.post(url, content=chat_body())) for _ in range(2)]
        await waiter
        assert fake.inflight("a") == 2
        with pytest.raises(TimeoutError, match="saw 2"):
            await fake.wait_for_requests(3, source="a", timeout=0.05)
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


def test_bad_arguments_are_rejected_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="chunks"):
        Reply.ok(chunks=0)
    with pytest.raises(ValueError, match="headers_delay"):
        Reply.ok(headers_delay=-1)
    with pytest.raises(ValueError, match=r"400\.\.599"):
        Reply.error(200)
    fake = FakeUpstream()
    with pytest.raises(ValueError, match="source"):
        fake.script("a/b", Reply.ok())
    with pytest.raises(ValueError, match="route"):
        fake.requests(route="chats")
    with pytest.raises(TypeError, match="Reply"):
        fake.script("a", "ok")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not started"):
        fake.base_url()


# -- embeddings and models ---------------------------------------------------------------------


async def test_embeddings_float_and_base64_agree_and_carry_index(fake: FakeUpstream) -> None:
    url = fake.base_url() + "/embeddings"
    async with httpx.AsyncClient() as client:
        floats = (await client.post(url, json={"model": "e", "input": ["alpha", "beta"]})).json()
        encoded = (
            await client.post(
                url, json={"model": "e", "input": ["alpha", "beta"], "encoding_format": "base64"}
            )
        ).json()
        single = (await client.post(url, json={"model": "e", "input": "beta"})).json()
    assert floats["object"] == "list" and floats["model"] == "e"
    # data[] comes out of input order (the default): every index once, never the input order.
    assert [d["index"] for d in floats["data"]] == [1, 0]
    assert all(d["object"] == "embedding" for d in floats["data"])
    alpha, beta = (d["embedding"] for d in sorted(floats["data"], key=lambda d: d["index"]))
    assert len(alpha) == 8 and alpha != beta
    assert math.isclose(math.fsum(v * v for v in alpha), 1.0, rel_tol=1e-5)
    assert single["data"][0]["embedding"] == beta, "deterministic per text"
    decoded = [
        list(struct.unpack("<8f", base64.b64decode(d["embedding"])))
        for d in sorted(encoded["data"], key=lambda d: d["index"])
    ]
    assert decoded == [alpha, beta]
    assert floats["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert fake.requests(route="embeddings") == 3
    assert fake.requests(route="chat") == 0


async def test_embeddings_data_order_is_shuffled_unless_turned_off(fake: FakeUpstream) -> None:
    url = fake.base_url() + "/embeddings"
    texts = [f"text {i}" for i in range(20)]
    async with httpx.AsyncClient() as client:
        shuffled = [
            (await client.post(url, json={"model": "e", "input": texts})).json()["data"]
            for _ in range(3)
        ]
        fake.shuffle_embeddings = False
        in_order = (await client.post(url, json={"model": "e", "input": texts})).json()["data"]
    orders = [[d["index"] for d in data] for data in shuffled]
    assert all(sorted(order) == list(range(20)) and order != list(range(20)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1, "the permutation varies per request"
    assert [d["index"] for d in in_order] == list(range(20))
    by_index = {d["index"]: d["embedding"] for d in shuffled[0]}
    assert [by_index[i] for i in range(20)] == [d["embedding"] for d in in_order]
    fake.reset()
    assert fake.shuffle_embeddings is True


async def test_embedding_dimensions_token_arrays_and_invalid_input(fake: FakeUpstream) -> None:
    url = fake.base_url() + "/embeddings"
    fake.embedding_dim = 3
    async with httpx.AsyncClient() as client:
        small = (await client.post(url, json={"model": "e", "input": "x"})).json()
        asked = (await client.post(url, json={"model": "e", "input": "x", "dimensions": 5})).json()
        tokens = (await client.post(url, json={"model": "e", "input": [[1, 2, 3], [4]]})).json()
        one_array = (await client.post(url, json={"model": "e", "input": [1, 2]})).json()
        empty = await client.post(url, json={"model": "e", "input": ""})
        fake.script("default", Reply.error(429, retry_after=1), route="embeddings")
        limited = await client.post(url, json={"model": "e", "input": "x"})
    assert len(small["data"][0]["embedding"]) == 3
    assert len(asked["data"][0]["embedding"]) == 5
    assert [d["index"] for d in tokens["data"]] == [1, 0]  # out of input order
    assert tokens["usage"]["prompt_tokens"] == 4
    assert len(one_array["data"]) == 1
    assert empty.status_code == 400
    assert (limited.status_code, limited.headers["retry-after"]) == (429, "1")


async def test_models_lists_the_configured_models(fake: FakeUpstream) -> None:
    fake.models = ["a-model", "b-model"]
    async with httpx.AsyncClient() as client:
        response = await client.get(fake.base_url("src") + "/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["a-model", "b-model"]
    assert fake.requests("src", route="models") == 1


# -- HTTP/1.1 details --------------------------------------------------------------------------


async def test_keep_alive_serves_several_requests_on_one_connection(fake: FakeUpstream) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", fake.port)
    try:
        for _ in range(3):
            writer.write(http_request("/v1/chat/completions", chat_body(), close=False))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK")
            assert b"connection: close" not in head.lower()
            length = int(split_response(head)[1]["content-length"])
            assert json.loads(await reader.readexactly(length))["object"] == "chat.completion"
        writer.write(http_request("/v1/chat/completions", chat_body(True), close=True))
        _, headers, body = split_response(await reader.read())  # EOF: server closed
        assert headers["connection"] == "close"
        assert events(dechunk(body))[-1] == "[DONE]"
    finally:
        writer.close()
    assert fake.requests() == 4


async def test_aiohttp_session_reuses_its_connection(fake: FakeUpstream) -> None:
    created: list[object] = []
    reused: list[object] = []
    tracing = aiohttp.TraceConfig()

    async def on_create(*args: object) -> None:
        created.append(args)

    async def on_reuse(*args: object) -> None:
        reused.append(args)

    tracing.on_connection_create_end.append(on_create)
    tracing.on_connection_reuseconn.append(on_reuse)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1), trace_configs=[tracing]
    ) as session:
        for _ in range(3):
            async with session.post(
                fake.base_url() + "/chat/completions", data=chat_body(True)
            ) as response:
                assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert (len(created), len(reused)) == (1, 2)


async def test_chunked_request_body_and_expect_continue(fake: FakeUpstream) -> None:
    body = chat_body()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\nConnection: close\r\n\r\n"
        + frame(body[:10])
        + frame(body[10:])
        + b"0\r\n\r\n"
    )
    data = await exchange(fake.port, request)
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    assert fake.received()[0].body["model"] == "m"


async def test_garbage_request_line_gets_a_400_and_a_close(fake: FakeUpstream) -> None:
    data = await exchange(fake.port, b"NONSENSE\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")


# -- thread mode, pytest fixture, command line -------------------------------------------------


def test_in_thread_serves_sync_code_and_stops_deterministically() -> None:
    with FakeUpstream.in_thread() as fake:
        fake.script("a", Reply.error(503))
        url = fake.base_url("a") + "/chat/completions"
        assert httpx.post(url, content=chat_body()).status_code == 503
        assert httpx.post(url, content=chat_body()).status_code == 200
        assert fake.requests("a") == 2
        port = fake.port
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"http://127.0.0.1:{port}/v1/models")


def test_in_thread_raises_when_it_cannot_bind() -> None:
    with FakeUpstream.in_thread() as first, pytest.raises(OSError):  # noqa: SIM117
        with FakeUpstream.in_thread(port=first.port):
            pass


def test_fixture_in_a_sync_test(fake_upstream: FakeUpstream) -> None:
    assert fake_upstream.requests() == 0, "reset between tests"
    fake_upstream.script("s", Reply.black_hole())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            fake_upstream.base_url("s") + "/chat/completions",
            content=chat_body(),
            timeout=httpx.Timeout(5.0, read=0.1),
        )
    fake_upstream.wait_for_requests_sync(1, source="s")
    with httpx.stream(
        "POST", fake_upstream.base_url() + "/chat/completions", content=chat_body(True)
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


async def test_fixture_in_an_async_test_waits_across_threads(fake_upstream: FakeUpstream) -> None:
    assert fake_upstream.requests() == 0, "reset between tests"
    fake_upstream.set_default("t", Reply.ok("threaded"))
    async with httpx.AsyncClient() as client:
        url = fake_upstream.base_url("t") + "/chat/completions"
        calls = [asyncio.create_task(client.post(url, content=chat_body())) for _ in range(4)]
        await fake_upstream.wait_for_requests(4, source="t")
        responses = await asyncio.gather(*calls)
    assert {r.json()["choices"][0]["message"]["content"] for r in responses} == {"threaded"}


def test_command_line_serves_the_configured_default_until_sigterm() -> None:
    script = (
        "import argparse, sys\n"
        "from polygateway.cli.fake_upstream_cmd import configure\n"
        "parser = argparse.ArgumentParser()\n"
        "sys.exit(configure(parser)(parser.parse_args(sys.argv[1:])))\n"
    )
    command = [
        sys.executable,
        "-c",
        script,
        "--port",
        "0",
        "--chunks",
        "5",
        "--content-bytes",
        "60",
        "--embedding-dim",
        "5",
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            base_url = process.stdout.readline().strip()
            assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
            with httpx.stream(
                "POST", base_url + "/chat/completions", content=chat_body(True)
            ) as response:
                parsed = [
                    json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"
                ]
            assert len(parsed) == 1 + 5 + 1
            assert len(content_of(parsed)) == 60
            vectors = httpx.post(base_url + "/embeddings", json={"model": "e", "input": "x"})
            assert len(vectors.json()["data"][0]["embedding"]) == 5
        finally:
            process.terminate()
            assert process.wait(timeout=10) == 0


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.none() | st.integers(-3, 250))
def test_a_json_answer_counts_the_pieces_a_stream_would_send(text: str, pieces: int | None) -> None:
    # A JSON answer waits an inter-token delay per piece but needs only their count.
    assert piece_count(text, pieces) == len(split(text, pieces))


def test_the_fake_encodes_json_as_the_stdlib_dumps_does() -> None:
    value = {"a": [1, 2.5, None, True], "é": "ü ✓ \u2028", "n": {"x": float("1e-05")}}
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
