"""The ``openai-compat`` embedding transport against the fake upstream over real HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from pgw_embedding.transport import OpenAICompatEmbeddingTransport
from pgw_embedding_test_helpers import API_KEY, b64_floats, embed_source, http_server, wait_until
from polygateway.errors import (
    ConfigError,
    PolyGatewayError,
    RequestRejectedError,
    ResultInvalidError,
    SourceDeadError,
    TransientError,
)
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import EmbeddingTransportResult

TEXTS = ["the cat sat on the mat", "a dog barked", "rain again today"]


async def embed(
    fake: FakeUpstream, texts: list[str], name: str = "e1", **options: object
) -> tuple[OpenAICompatEmbeddingTransport, EmbeddingTransportResult]:
    source = embed_source(fake, name, options=options)
    transport = OpenAICompatEmbeddingTransport(source)
    try:
        return transport, await transport.embed(texts=texts, source=source, call_id="c1")
    finally:
        await transport.aclose()


async def test_base64_by_default_and_vectors_match_the_float_encoding(
    fake_upstream: FakeUpstream,
) -> None:
    _, as_b64 = await embed(fake_upstream, TEXTS)
    _, as_float = await embed(fake_upstream, TEXTS, encoding_format="float")
    sent = [r.body for r in fake_upstream.received("e1", route="embeddings")]
    assert sent[0] == {
        "model": "text-embedding-3-small",
        "input": TEXTS,
        "encoding_format": "base64",
    }
    assert sent[1]["encoding_format"] == "float"
    assert "dimensions" not in sent[0]
    assert as_b64.vectors == as_float.vectors
    assert as_b64.dim == fake_upstream.embedding_dim == len(as_b64.vectors[0])
    assert all(isinstance(x, float) for v in as_b64.vectors for x in v)


async def test_vectors_follow_the_input_order(fake_upstream: FakeUpstream) -> None:
    _, batch = await embed(fake_upstream, TEXTS)
    singles = [(await embed(fake_upstream, [text]))[1] for text in TEXTS]
    assert batch.vectors == [s.vectors[0] for s in singles]
    assert len({tuple(v) for v in batch.vectors}) == len(TEXTS)


async def test_dimensions_option_is_sent(fake_upstream: FakeUpstream) -> None:
    _, result = await embed(fake_upstream, TEXTS, dimensions="5")
    assert fake_upstream.received("e1", route="embeddings")[0].body["dimensions"] == 5
    assert result.dim == 5


async def test_measured_usage_and_model(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("e1", Reply.ok(prompt_tokens=42, model="emb-v9"), route="embeddings")
    _, result = await embed(fake_upstream, TEXTS)
    assert (result.prompt_tokens, result.usage_source) == (42, "measured")
    assert result.model == "emb-v9"
    assert "data" not in result.raw and result.raw["usage"]["prompt_tokens"] == 42


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (Reply.error(401), SourceDeadError),
        (Reply.error(403), SourceDeadError),
        (Reply.error(404), SourceDeadError),
        (Reply.error(429, quota=True), SourceDeadError),
        (Reply.error(429, retry_after=3), TransientError),
        (Reply.error(500), TransientError),
        (Reply.error(503), TransientError),
        (Reply.error(400), RequestRejectedError),
        (Reply.error(413), RequestRejectedError),
        (Reply.malformed(), TransientError),
        (Reply.mid_stream_error(), TransientError),
        (Reply.early_eof(), TransientError),
        (Reply.reset(), TransientError),
        (Reply.empty(), ResultInvalidError),
    ],
)
async def test_error_translation(
    fake_upstream: FakeUpstream, reply: Reply, expected: type[PolyGatewayError]
) -> None:
    fake_upstream.script("e1", reply, route="embeddings")
    with pytest.raises(PolyGatewayError) as excinfo:
        await embed(fake_upstream, TEXTS)
    assert type(excinfo.value) is expected
    assert API_KEY not in str(excinfo.value)
    if isinstance(excinfo.value, TransientError) and reply.retry_after is not None:
        assert excinfo.value.retry_after_s == 3.0
    if reply.kind == "error":
        assert getattr(excinfo.value, "status", None) == reply.status


async def test_empty_data_names_the_problem(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("e1", Reply.empty(), route="embeddings")
    with pytest.raises(ResultInvalidError, match="empty data for 3 texts"):
        await embed(fake_upstream, TEXTS)


async def test_total_timeout_is_transient(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("e1", Reply.black_hole(), route="embeddings")
    source = embed_source(fake_upstream, "e1", timeout_s=0.2)
    transport = OpenAICompatEmbeddingTransport(source)
    try:
        with pytest.raises(TransientError, match=r"within 0\.2s") as excinfo:
            await transport.embed(texts=TEXTS, source=source, call_id="c1")
        assert excinfo.value.reason == "timeout"
        await wait_until(lambda: fake_upstream.inflight("e1", route="embeddings") == 0)
    finally:
        await transport.aclose()


async def test_cancellation_closes_the_connection(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("e1", Reply.black_hole(), route="embeddings")
    source = embed_source(fake_upstream, "e1")
    transport = OpenAICompatEmbeddingTransport(source)
    try:
        task = asyncio.create_task(transport.embed(texts=TEXTS, source=source, call_id="c1"))
        await fake_upstream.wait_for_requests(1, "e1", route="embeddings")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: fake_upstream.inflight("e1", route="embeddings") == 0)
    finally:
        await transport.aclose()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"encoding_format": "bf16"}, "encoding_format"),
        ({"dimensions": "0"}, "dimensions"),
        ({"dimensions": "many"}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        OpenAICompatEmbeddingTransport(
            embed_source(None, "e1", base_url="http://x/v1", options=options)
        )


def test_empty_base_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="base_url is empty"):
        OpenAICompatEmbeddingTransport(embed_source(None, "e1", base_url="  "))


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_redirects_are_not_followed(engine: str) -> None:
    hits: list[str] = []

    async def redirect(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async with http_server(redirect) as base_url:
        with pytest.raises(SourceDeadError) as excinfo:
            await embed_at(base_url, TEXTS, engine=engine)
    assert excinfo.value.status == 307
    assert hits == ["/v1/embeddings"]  # the key and the texts went nowhere else


async def embed_at(base_url: str, texts: list[str], **options: object) -> EmbeddingTransportResult:
    source = embed_source(None, "e1", base_url=base_url, options=options)
    transport = OpenAICompatEmbeddingTransport(source)
    try:
        return await transport.embed(texts=texts, source=source, call_id="c1")
    finally:
        await transport.aclose()


def answering(body: object) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body)

    return handler


async def test_vectors_of_mixed_length_over_http_are_result_invalid() -> None:
    data = [
        {"object": "embedding", "index": 1, "embedding": [0.5, 0.5]},
        {"object": "embedding", "index": 0, "embedding": b64_floats([1.0, 0.0, 0.0])},
    ]
    async with http_server(answering({"object": "list", "data": data})) as base_url:
        with pytest.raises(ResultInvalidError, match="mixed length"):
            await embed_at(base_url, ["a", "b"])


async def test_floats_answered_to_a_base64_request_are_accepted_and_usage_estimated() -> None:
    data = [{"object": "embedding", "index": i, "embedding": [float(i), 1.0]} for i in (1, 0)]
    async with http_server(answering({"data": data})) as base_url:
        result = await embed_at(base_url, ["abcdefgh", "abcd"])
    assert result.vectors == [[0.0, 1.0], [1.0, 1.0]]
    assert (result.prompt_tokens, result.usage_source) == (3, "estimated")
    assert result.model == "text-embedding-3-small"  # the source's, when the answer names none
