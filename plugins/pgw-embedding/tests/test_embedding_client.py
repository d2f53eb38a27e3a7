"""``EmbeddingClient`` through the fake upstream: batches, order, governance, telemetry."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from pgw_embedding import EmbeddingClient
from pgw_embedding_test_helpers import (
    FirstSelector,
    embed_settings,
    http_server,
    memory_gate,
    memory_limiter,
    read_rows,
    registry,
    wait_until,
)
from polygateway.errors import (
    AllSourcesExhausted,
    ConfigError,
    PolyGatewayError,
    RequestRejectedError,
    ResultInvalidError,
)
from polygateway.hookspecs import hookimpl
from polygateway.ports import Register
from polygateway.settings import Limits, ScopeSettings
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeClock, FakeUpstream, Reply
from polygateway.testing.fake_upstream.embeddings import embedding_vector
from polygateway.transports.engine_options import EngineOptions, engine_options

TEXTS = [f"sentence number {i}" for i in range(13)]  # 5 batches of 3 (the last has 1)


def client_for(settings: ScopeSettings, **parts: Any) -> EmbeddingClient:
    parts.setdefault("registry", registry())
    return EmbeddingClient(settings, **parts)


def embedded(fake: FakeUpstream, source: str) -> list[list[str]]:
    """The batches of texts ``source`` received, in arrival order."""
    return [r.body["input"] for r in fake.received(source, route="embeddings")]


# --------------------------------------------------------------------------- order, batches


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_order_is_restored_across_batches(
    fake_upstream: FakeUpstream, concurrency: int
) -> None:
    settings = embed_settings(fake_upstream, ("a",), batch_concurrency=concurrency)
    async with client_for(settings) as client:
        response = await client.embed(TEXTS)
    assert response.vectors == [embedding_vector(text, 8) for text in TEXTS]
    assert response.dim == 8 and len(response.vectors) == 13
    batches = embedded(fake_upstream, "a")
    assert sorted(batches) == sorted([TEXTS[i : i + 3] for i in range(0, 13, 3)])
    if concurrency == 1:
        assert batches == [TEXTS[i : i + 3] for i in range(0, 13, 3)], "serial, in order"
    assert all(
        r.body["encoding_format"] == "base64" for r in fake_upstream.received("a", "embeddings")
    )


async def test_merged_response(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script(
        "a", *(Reply.ok(prompt_tokens=10 + i) for i in range(5)), route="embeddings"
    )
    async with client_for(embed_settings(fake_upstream, ("a",))) as client:
        response = await client.embed(TEXTS)
    assert response.prompt_tokens == sum(10 + i for i in range(5))
    assert response.usage_source == "measured"
    assert (response.source_name, response.provider) == ("a", "openai")
    assert response.model == "text-embedding-3-small"
    assert len(response.call_id) == 32
    assert response.cost is None  # no pricing configured


async def test_concurrency_bounds_batches_in_flight_and_cancel_releases_everything(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.set_default("a", Reply.black_hole(), route="embeddings")
    limiter = memory_limiter()
    settings = embed_settings(fake_upstream, ("a",), batch_concurrency=3)
    async with client_for(settings, limiter=limiter) as client:
        task = asyncio.create_task(client.embed(TEXTS))
        await fake_upstream.wait_for_requests(3, "a", route="embeddings")
        assert await limiter.inflight() == 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await limiter.inflight() == 0
        await wait_until(lambda: fake_upstream.inflight("a", route="embeddings") == 0)
    assert fake_upstream.requests("a", route="embeddings") == 3, "no 4th batch started"


async def test_cancelling_a_probe_batch_hands_the_probe_back(fake_upstream: FakeUpstream) -> None:
    clock = FakeClock()
    breaker = memory_gate(clock)
    await breaker.inner.force_open("a")
    clock.advance(31.0)  # past the cooldown: the next call is the half-open probe
    fake_upstream.set_default("a", Reply.black_hole(), route="embeddings")
    settings = embed_settings(fake_upstream, ("a",))
    async with client_for(settings, breaker=breaker, clock=clock) as client:
        task = asyncio.create_task(client.embed(TEXTS))
        await fake_upstream.wait_for_requests(1, "a", route="embeddings")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert breaker.writes == [("release_probe", "a")]
    decision = await breaker.try_enter("a")
    assert decision.allowed and decision.is_probe, "the next caller probes at once"


async def test_a_failed_batch_fails_the_call_and_cancels_the_others(
    fake_upstream: FakeUpstream,
) -> None:
    # Batch 1 hangs, batch 2 is refused (400): the call fails with the 400, batch 1 is
    # cancelled and its connection closed, batches 4 and 5 never start.
    fake_upstream.script(
        "a", Reply.black_hole(), Reply.error(400), Reply.black_hole(), route="embeddings"
    )
    limiter = memory_limiter()
    settings = embed_settings(fake_upstream, ("a",), batch_concurrency=2)
    async with client_for(settings, limiter=limiter) as client:
        with pytest.raises(RequestRejectedError):
            await client.embed(TEXTS)
        assert await limiter.inflight() == 0
    await wait_until(lambda: fake_upstream.inflight("a", route="embeddings") == 0)
    assert fake_upstream.requests("a", route="embeddings") == 2


# --------------------------------------------------------------------------- governance


async def test_a_429_on_batch_3_of_5_switches_source_for_that_batch_only(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.script(
        "a", Reply.ok(), Reply.ok(), Reply.error(429), Reply.ok(), Reply.ok(), route="embeddings"
    )
    breaker = memory_gate()
    settings = embed_settings(fake_upstream, ("a", "b"))
    async with client_for(settings, selector=FirstSelector(), breaker=breaker) as client:
        response = await client.embed(TEXTS)
    assert response.vectors == [embedding_vector(text, 8) for text in TEXTS]
    batches = [TEXTS[i : i + 3] for i in range(0, 13, 3)]
    assert embedded(fake_upstream, "a") == batches  # batch 3 was tried here first
    assert embedded(fake_upstream, "b") == [batches[2]]  # and only batch 3 went to b
    assert breaker.failures("a") == 1 and breaker.failures("b") == 0


async def test_wrong_dimension_is_result_invalid_and_leaves_the_breaker_alone(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.embedding_dim = 16
    breaker = memory_gate()
    settings = embed_settings(fake_upstream, ("a", "b"))
    async with client_for(settings, breaker=breaker, expected_dim=8) as client:
        with pytest.raises(ResultInvalidError, match="dimension 16, expected 8"):
            await client.embed(TEXTS)
        assert await breaker.state("a") == "closed"
    assert breaker.failures("a") == breaker.failures("b") == 0
    assert fake_upstream.requests(route="embeddings") == 1, "no retry, no switch"


async def test_batches_of_another_dimension_cannot_be_merged(fake_upstream: FakeUpstream) -> None:
    # Batch 1 from a (dim 8), then a dies and b answers with dimensions=4.
    fake_upstream.script("a", Reply.ok(), Reply.error(401), route="embeddings")
    settings = embed_settings(fake_upstream, ("a",))
    other = embed_settings(fake_upstream, ("b",), options={"dimensions": 4}).sources
    settings = ScopeSettings(**{**_fields(settings), "sources": settings.sources + other})
    async with client_for(settings, selector=FirstSelector()) as client:
        with pytest.raises(ResultInvalidError, match="dimension 4, expected 8"):
            await client.embed(TEXTS)


def _fields(settings: ScopeSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in ScopeSettings.__dataclass_fields__}


async def test_tpm_settles_on_the_measured_prompt_tokens(fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("a", *(Reply.ok(prompt_tokens=7) for _ in range(5)), route="embeddings")
    limiter = memory_limiter(Limits(tpm=100_000))
    async with client_for(embed_settings(fake_upstream, ("a",)), limiter=limiter) as client:
        await client.embed(TEXTS)
    stats = await limiter.source_stats("a")
    assert stats.tpm_used == 35  # 5 batches x 7 measured, not the estimates charged first
    assert stats.rpm_used == 5


async def test_quota_full_fail_fast(fake_upstream: FakeUpstream) -> None:
    limiter = memory_limiter(Limits(rpm=2))
    settings = embed_settings(fake_upstream, ("a", "b"), quota_full="fail_fast")
    async with client_for(settings, limiter=limiter) as client:
        with pytest.raises(AllSourcesExhausted) as excinfo:
            await client.embed(TEXTS)
    error = excinfo.value
    assert error.reason == "quota_exhausted"
    assert error.retry_after_s > 0
    # A scope-wide gate refuses every source alike: the governor names the one it asked.
    assert error.per_source_reasons and set(error.per_source_reasons.values()) == {"rate_limited"}
    assert fake_upstream.requests(route="embeddings") == 2


async def test_quota_full_wait_ends_in_the_stall_verdict(fake_upstream: FakeUpstream) -> None:
    clock = FakeClock()
    limiter = memory_limiter(Limits(max_concurrency=1), clock=clock)
    held = await limiter.try_acquire("x", 1, Limits())  # someone else holds the only slot
    settings = embed_settings(fake_upstream, ("a",), stall_window_s=30.0)
    async with client_for(settings, limiter=limiter, clock=clock) as client:
        with pytest.raises(AllSourcesExhausted) as excinfo:
            await client.embed(TEXTS)
    assert excinfo.value.reason == "stalled"
    assert clock.monotonic() - 1000.0 > 30.0  # it waited the stall window (on the fake clock)
    assert fake_upstream.requests(route="embeddings") == 0
    await held.release()  # type: ignore[union-attr]


async def test_all_sources_exhausted_carries_its_fields(fake_upstream: FakeUpstream) -> None:
    for name in ("a", "b"):
        fake_upstream.set_default(name, Reply.error(503), route="embeddings")
    async with client_for(embed_settings(fake_upstream, ("a", "b"), max_attempts=3)) as client:
        with pytest.raises(AllSourcesExhausted) as excinfo:
            await client.embed(TEXTS)
    error = excinfo.value
    assert error.reason == "retry_exhausted"
    assert set(error.per_source_reasons) == {"a", "b"}
    assert error.retry_after_s >= 0
    assert fake_upstream.requests(route="embeddings") == 3


# --------------------------------------------------------------------------- inputs


async def test_empty_list_is_an_empty_response_without_a_request(
    fake_upstream: FakeUpstream,
) -> None:
    async with client_for(embed_settings(fake_upstream, ("a",)), expected_dim=8) as client:
        response = await client.embed([])
    assert response.vectors == [] and response.dim == 8 and response.prompt_tokens == 0
    assert fake_upstream.requests(route="embeddings") == 0


@pytest.mark.parametrize(
    ("texts", "needle"),
    [
        ("one text", "must be a list of strings"),
        (["ok", ""], r"texts\[1\] is an empty string"),
        (["ok", None], r"texts\[1\] must be a string, got NoneType"),
        (["ok", "x" * 101], r"texts\[1\] has 101 characters.*'a'"),
    ],
)
async def test_bad_input_is_refused_before_any_request(
    fake_upstream: FakeUpstream, texts: Any, needle: str
) -> None:
    settings = embed_settings(fake_upstream, ("a",), options={"max_input_chars": 100})
    async with client_for(settings) as client:
        with pytest.raises(RequestRejectedError, match=needle):
            await client.embed(texts)
    assert fake_upstream.requests(route="embeddings") == 0


async def test_normalize() -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        texts = (await request.json())["input"]
        data = [{"index": i, "embedding": [3.0, 4.0]} for i in range(len(texts))]
        return web.json_response({"data": data, "usage": {"prompt_tokens": 1}})

    async with http_server(answer) as base_url:
        settings = embed_settings(None, ("a",), base_url=base_url)
        async with client_for(settings, normalize=True) as client:
            response = await client.embed(["x", "y"])
        async with client_for(settings) as client:
            raw = await client.embed(["x"])
    assert response.vectors == [[0.6, 0.8], [0.6, 0.8]]
    assert raw.vectors == [[3.0, 4.0]]


# --------------------------------------------------------------------------- telemetry


async def test_a_batch_refused_before_any_attempt_leaves_its_row(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    db = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(db))
    breaker = memory_gate(FakeClock())
    await breaker.inner.force_open("a")  # the only source: the call fails with no attempt
    settings = embed_settings(fake_upstream, ("a",), quota_full="fail_fast")
    async with client_for(settings, telemetry=recorder, breaker=breaker) as client:
        with pytest.raises(PolyGatewayError) as caught:
            await client.embed(TEXTS[:2], session_id="s-9")
    await recorder.aclose()
    assert fake_upstream.requests("a", route="embeddings") == 0
    (row,) = read_rows(db)
    error = type(caught.value).__name__
    assert (row["error"], row["source_name"], row["session_id"]) == (error, "", "s-9")
    assert row["root_call_id"] == row["call_id"]  # a failed call, counted by the report


async def test_one_row_per_batch_attempt_sharing_parent_call_id(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(), Reply.error(500), route="embeddings")
    db = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(db))
    # The point is the switch: no second try of the 500 on the same source.
    settings = embed_settings(fake_upstream, ("a", "b"), same_source_attempts=0)
    async with client_for(settings, telemetry=recorder, selector=FirstSelector()) as client:
        response = await client.embed(TEXTS[:7], session_id="s-1", parent_call_id="p-1")
    await recorder.aclose()
    rows = read_rows(db)
    assert len(rows) == 4  # batch 1, batch 2 (500 on a, then b), batch 3
    assert {row["parent_call_id"] for row in rows} == {"p-1"}
    assert {row["session_id"] for row in rows} == {"s-1"}
    assert len({row["call_id"] for row in rows}) == 4
    assert rows[0]["call_id"] == response.call_id
    # Each batch is a governed call of its own: batch 2's switch shares its first attempt's root.
    ids = [row["call_id"] for row in rows]
    assert [row["root_call_id"] for row in rows] == [ids[0], ids[1], ids[1], ids[3]]
    failed = [row for row in rows if row["error"]]
    assert [(r["error"], r["source_name"], r["response"]) for r in failed] == [
        ("TransientError", "a", "")
    ]
    ok = [row for row in rows if not row["error"]]
    assert [row["response"] for row in ok] == [
        "<vectors n=3 dim=8>",
        "<vectors n=3 dim=8>",
        "<vectors n=1 dim=8>",
    ]
    assert [row["source_name"] for row in ok] == ["a", "b", "a"]
    assert all(row["completion_tokens"] == 0 and row["usage_source"] == "measured" for row in ok)
    summary = json.loads(ok[0]["messages"])
    assert summary["texts"] == 3 and summary["chars"] == sum(map(len, TEXTS[:3]))
    assert summary["head"] == TEXTS[:3]
    assert len(summary["sha256"]) == 64


async def test_rows_summarise_long_texts(fake_upstream: FakeUpstream, tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(db))
    texts = [f"{i} " + "word " * 2000 for i in range(3)]
    settings = embed_settings(fake_upstream, ("a",), batch_size=10)
    async with client_for(settings, telemetry=recorder) as client:
        await client.embed(texts)
    await recorder.aclose()
    [row] = read_rows(db)
    assert len(row["messages"]) < 500 < sum(map(len, texts))
    assert all(len(head) == 80 for head in json.loads(row["messages"])["head"])


# --------------------------------------------------------------------------- assembly


def test_from_env(fake_upstream: FakeUpstream) -> None:
    env = {
        "EMBED__OPENAI__1__BASE_URL": fake_upstream.base_url("a"),
        "EMBED__OPENAI__1__MODEL": "text-embedding-3-small",
        "EMBED__OPENAI__1__API_KEY": "sk-test",
        "EMBED__BATCH_SIZE": "64",
        "EMBED__BATCH_CONCURRENCY": "2",
        "PGW_TELEMETRY_BACKEND": "none",
    }

    async def run() -> None:
        async with EmbeddingClient.from_env(env=env, registry=registry()) as client:
            assert client.settings.batch_size == 64
            assert client.settings.batch_concurrency == 2
            response = await client.embed(["hello"])
            assert response.source_name == "openai-1"
        assert client.closed

    asyncio.run(run())
    with pytest.raises(ConfigError, match="EMBED__BATCH_SIZE"):
        EmbeddingClient.from_env(
            env={k: v for k, v in env.items() if k != "EMBED__BATCH_SIZE"}, registry=registry()
        )


class _VectorsOnly:
    """A plugin with an embedding transport of a name no chat transport has."""

    @staticmethod
    @hookimpl
    def pgw_register_embedding_transports(register: Register) -> None:
        from pgw_embedding.transport import OpenAICompatEmbeddingTransport

        register("vectors-only", OpenAICompatEmbeddingTransport)


def test_from_env_looks_transports_up_among_embedding_transports(
    fake_upstream: FakeUpstream,
) -> None:
    import pgw_embedding
    from polygateway.plugins import load_registry

    plugins = load_registry(
        autoload=False,
        extra_plugins=[("pgw-embedding", pgw_embedding), ("vectors-only", _VectorsOnly)],
    )
    env = {
        "EMBED__OPENAI__1__BASE_URL": fake_upstream.base_url("a"),
        "EMBED__OPENAI__1__MODEL": "text-embedding-3-small",
        "EMBED__OPENAI__1__TRANSPORT": "vectors-only",
        "EMBED__BATCH_SIZE": "8",
        "PGW_TELEMETRY_BACKEND": "none",
    }

    async def run() -> None:
        async with EmbeddingClient.from_env(env=env, registry=plugins) as client:
            assert (await client.embed(["hello"])).source_name == "openai-1"

    asyncio.run(run())
    # A chat transport's name is not an embedding transport.
    chat_only = {**env, "EMBED__OPENAI__1__TRANSPORT": "monkeyocr"}
    with pytest.raises(ConfigError, match=r"EMBED__OPENAI__1__TRANSPORT: embedding_transport"):
        EmbeddingClient.from_env(env=chat_only, registry=plugins)


def test_constructor_problems(fake_upstream: FakeUpstream) -> None:
    settings = embed_settings(fake_upstream, ("a",))
    no_batch = ScopeSettings(**{**_fields(settings), "batch_size": None})
    with pytest.raises(ConfigError, match="EMBED__BATCH_SIZE"):
        client_for(no_batch)
    with pytest.raises(ConfigError, match="expected_dim"):
        client_for(settings, expected_dim=0)
    with pytest.raises(ConfigError, match="no sources"):
        client_for(ScopeSettings(**{**_fields(settings), "sources": ()}))
    with pytest.raises(TypeError, match="ScopeSettings"):
        EmbeddingClient(object())  # type: ignore[arg-type]


async def test_aclose_closes_what_it_built_only(fake_upstream: FakeUpstream) -> None:
    limiter = memory_limiter()
    client = client_for(embed_settings(fake_upstream, ("a",)), limiter=limiter)
    await client.embed(["x"])
    transport = client.transports["a"]
    engine = transport.engine
    assert engine.idle_connections == 1  # type: ignore[attr-defined]
    await client.aclose()
    await client.aclose()  # idempotent
    assert engine.idle_connections == engine.busy_connections == 0  # type: ignore[attr-defined]
    await limiter.try_acquire("a", 1, Limits())  # still usable: it is the caller's
    with pytest.raises(RuntimeError, match="closed"):
        await client.embed(["x"])


def test_the_readme_pipeline_file_example(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "pgw.toml"
    path.write_text(example)
    client = EmbeddingClient.from_env(
        env={"PGW_TELEMETRY_BACKEND": "none"}, pipeline_path=path, registry=registry()
    )
    assert client.settings.batch_size == 64 and client.settings.batch_concurrency == 2
    [source] = client.settings.sources
    assert source.options["dimensions"] == 512
    assert client.transports[source.name].request_body(["x"], source)["dimensions"] == 512  # type: ignore[attr-defined]
    asyncio.run(client.aclose())


def test_the_engine_source_fields_are_read_and_checked_as_for_chat(
    fake_upstream: FakeUpstream,
) -> None:
    # The embedding transport posts through the core's HTTP engines: same pool fields.
    env = {
        "EMBED__OPENAI__1__BASE_URL": fake_upstream.base_url("a"),
        "EMBED__OPENAI__1__MODEL": "text-embedding-3-small",
        "EMBED__OPENAI__1__KEEPALIVE_S": "30s",
        "EMBED__OPENAI__1__MAX_CONNECTIONS": "4",
        "EMBED__OPENAI__1__READ_TIMEOUT_S": "off",
        "EMBED__BATCH_SIZE": "64",
        "PGW_TELEMETRY_BACKEND": "none",
    }

    async def run() -> None:
        async with EmbeddingClient.from_env(env=env, registry=registry()) as client:
            [source] = client.settings.sources
            assert engine_options(source.options, source.name) == EngineOptions(
                read_timeout_s=None, max_connections=4, keepalive_s=30.0
            )
            assert (await client.embed(["hello"])).source_name == "openai-1"

    asyncio.run(run())
    bad = {**env, "EMBED__OPENAI__1__MAX_CONNECTIONS": "many"}
    with pytest.raises(ConfigError) as excinfo:
        EmbeddingClient.from_env(env=bad, registry=registry())
    [line] = excinfo.value.problems
    assert line.startswith("EMBED__OPENAI__1__MAX_CONNECTIONS: must be an integer >= 0")
