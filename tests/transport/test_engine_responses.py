"""An engine's response after ``aclose()``, on every engine, through the fake upstream: a body
read to its end reads as ended, one closed before its end refuses every later read
(``ResponseClosedError``) rather than passing for a short body, and ``at_eof`` says which."""

from __future__ import annotations

import gzip as gzip_module
import json
from collections.abc import AsyncIterator

import pytest
from polygateway.errors import ResponseClosedError
from polygateway.testing import FakeUpstream, Reply
from polygateway.transports.engines import (
    ACCEPT_ENCODING,
    BodyReader,
    EngineConfig,
    HttpEngine,
    make_engine,
)
from test_openai_compat import ENGINES

SIZE = 400_000
"""A JSON answer of this many content bytes: several reads, so one read leaves most unread."""

REQUEST = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
).encode()


@pytest.fixture(params=ENGINES)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[HttpEngine]:
    config = EngineConfig(
        source_name="closed",
        headers={"Content-Type": "application/json", "Accept-Encoding": ACCEPT_ENCODING},
        plain_http=True,
    )
    client = make_engine(str(request.param), config)
    yield client
    await client.aclose()


def url(fake: FakeUpstream) -> str:
    return fake.base_url("closed") + "/chat/completions"


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_a_body_read_to_its_end_reads_as_ended_after_close(
    engine: HttpEngine, fake_upstream: FakeUpstream, gzip: bool
) -> None:
    fake_upstream.script("closed", Reply.flood(SIZE, gzip=gzip))
    response = await engine.post(url(fake_upstream), REQUEST)
    assert response.headers.get("content-encoding") == ("gzip" if gzip else None)
    body = await response.read()
    content = json.loads(body)["choices"][0]["message"]["content"]
    assert set(content) == {"x"} and len(content) > SIZE - 1000  # about SIZE: the whole answer
    assert response.at_eof()
    await response.aclose()
    assert response.at_eof()
    assert await response.read_chunk() == b""
    assert await response.read() == b""
    await response.aclose()  # idempotent
    assert await response.read_chunk() == b""


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_a_read_after_closing_mid_body_is_an_error(
    engine: HttpEngine, fake_upstream: FakeUpstream, gzip: bool
) -> None:
    fake_upstream.script("closed", Reply.flood(SIZE, gzip=gzip))
    response = await engine.post(url(fake_upstream), REQUEST)
    first = await response.read_chunk()
    assert first.startswith(b"{")  # decoded, when gzip
    assert not response.at_eof()
    await response.aclose()
    assert not response.at_eof()  # the rest was never read: not passed off as the end
    with pytest.raises(ResponseClosedError, match=r"source 'closed': .* after aclose\(\)"):
        await response.read_chunk()
    with pytest.raises(ResponseClosedError):
        await response.read()
    await response.aclose()  # idempotent, and still refusing reads
    with pytest.raises(ResponseClosedError):
        await response.read_chunk()
    assert not response.at_eof()


async def test_input_the_decoder_still_holds_at_close_is_not_passed_off_as_the_end() -> None:
    # One raw read of 1 MB of zeros gzipped: decoded 64 KiB a step, so the decoder still
    # holds input when the reader is detached; then the raw body has ended.
    wire = [gzip_module.compress(b"\0" * 1_000_000)]

    async def raw() -> bytes:
        return wire.pop() if wire else b""

    reader = BodyReader(raw, "gzip", EngineConfig(source_name="held"))
    assert await reader.read_chunk() == b"\0" * 64 * 1024
    assert not wire  # everything arrived: only the decoder is behind
    reader.detach()
    assert not reader.exhausted
    with pytest.raises(ResponseClosedError):
        await reader.read_chunk()


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_at_eof_never_passes_a_partly_handed_out_body_for_its_end(
    engine: HttpEngine, fake_upstream: FakeUpstream, gzip: bool
) -> None:
    # ``read_json_body`` stops at the chunk after which ``at_eof()`` holds, without the read
    # of b"" that would say so: at_eof must then hold only when everything was handed out.
    fake_upstream.script("closed", Reply.flood(3000, gzip=gzip))
    response = await engine.post(url(fake_upstream), REQUEST)
    parts = []
    while not response.at_eof():
        chunk = await response.read_chunk()
        if not chunk:
            break
        parts.append(chunk)
    content = json.loads(b"".join(parts))["choices"][0]["message"]["content"]
    assert set(content) == {"x"} and len(content) > 2000
    assert await response.read_chunk() == b""
    await response.aclose()
    assert response.at_eof()
    assert await response.read_chunk() == b""


async def test_a_small_aiohttp_body_is_known_to_end_with_its_last_chunk(
    fake_upstream: FakeUpstream,
) -> None:
    engine = make_engine("aiohttp", EngineConfig(source_name="closed", headers={}, plain_http=True))
    try:
        fake_upstream.script("closed", Reply.ok(content="short answer"))
        response = await engine.post(url(fake_upstream), REQUEST)
        chunk = await response.read_chunk()
        assert json.loads(chunk)["choices"][0]["message"]["content"] == "short answer"
        assert response.at_eof()  # no read of b"" needed to know
        await response.aclose()
        assert await response.read_chunk() == b""
    finally:
        await engine.aclose()
