"""``client.stream``: deltas as they arrive through the fake upstream, the final response, its
telemetry row and settle; retries before the first delta, a cut after it, cancellation with
nothing leaked, cache replay, tool-call fragments."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path

import pytest
from client_helpers import MESSAGES, http_client, wait_until
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.errors import TransientError
from polygateway.settings import CacheSettings, Limits, RetrySettings
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import StreamDelta, ToolCall

TEXT = "one two three four five six seven eight"
FAST_RETRY = RetrySettings(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0)


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


def limiter() -> InMemoryLimiter:
    return InMemoryLimiter(clock=SystemClock(), global_limits=Limits(), lease_ttl_s=600.0)


async def collect(stream: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
    return [delta async for delta in stream]


async def test_deltas_then_the_response_its_row_and_the_settle(
    fake: FakeUpstream, tmp_path: Path
) -> None:
    fake.script(
        "a",
        Reply.ok(
            TEXT,
            reasoning="thinking it over",
            chunks=6,
            # Chunks arrive apart (far enough for a loaded machine): deltas come as they do.
            inter_token_delay=0.05,
            prompt_tokens=40,
            completion_tokens=9,
        ),
    )
    gates = limiter()
    recorder = SQLiteRecorder(str(tmp_path / "t.db"))
    client = http_client(fake, ["a"], injected={"limiter": gates, "telemetry": recorder})
    async with client:
        async with client.stream(MESSAGES, temperature=0.3) as stream:
            deltas = await collect(stream)
        response = stream.response
        stats = await gates.source_stats("a")
    await recorder.aclose()
    content = [d.text for d in deltas if d.kind == "content"]
    assert len(content) >= 2  # deltas as chunks arrive, not one at the end
    assert "".join(content) == TEXT == response.content
    assert "".join(d.text for d in deltas if d.kind == "thinking") == "thinking it over"
    assert deltas[0].kind == "thinking"
    assert (response.prompt_tokens, response.completion_tokens) == (40, 9)
    assert stats.tpm_used == 49 and stats.inflight == 0  # settled on the real usage
    assert fake.received("a")[0].body["temperature"] == 0.3
    with closing(sqlite3.connect(tmp_path / "t.db")) as conn:
        rows = conn.execute("SELECT call_id, response, error FROM pgw_calls").fetchall()
    assert rows == [(response.call_id, TEXT, None)]


async def test_a_failure_before_the_first_delta_retries(fake: FakeUpstream) -> None:
    fake.script("a", Reply.error(503), Reply.ok(TEXT))
    client = http_client(fake, ["a"], retry=FAST_RETRY)
    async with client, client.stream(MESSAGES) as stream:
        deltas = await collect(stream)
    assert "".join(d.text for d in deltas) == TEXT
    assert all(d.kind == "content" for d in deltas)
    assert fake.requests("a") == 2


async def test_a_cut_after_the_first_delta_raises_and_is_not_retried(fake: FakeUpstream) -> None:
    fake.script("a", Reply.cut(after_chunks=3), Reply.ok("second answer"))
    gates = limiter()
    async with http_client(fake, ["a"], retry=FAST_RETRY, injected={"limiter": gates}) as client:
        seen: list[StreamDelta] = []
        with pytest.raises(TransientError, match="stream cut after"):
            async with client.stream(MESSAGES) as stream:
                async for delta in stream:
                    seen.append(delta)
        assert seen and all(d.kind == "content" for d in seen)
        assert await gates.inflight() == 0
    assert fake.requests("a") == 1


async def test_restart_on_cut_marks_the_restart(fake: FakeUpstream) -> None:
    fake.script("a", Reply.cut(after_chunks=3), Reply.ok("second answer"))
    client = http_client(fake, ["a"], retry=FAST_RETRY)
    async with client, client.stream(MESSAGES, restart_on_cut=True) as stream:
        deltas = await collect(stream)
    kinds = [d.kind for d in deltas]
    assert "restart" in kinds
    after = deltas[kinds.index("restart") + 1 :]
    assert "".join(d.text for d in after) == "second answer" == stream.response.content
    assert fake.requests("a") == 2


async def test_leaving_mid_stream_releases_everything(fake: FakeUpstream) -> None:
    fake.script("a", Reply.ok(TEXT, chunks=8, inter_token_delay=0.05))
    gates = limiter()
    async with http_client(fake, ["a"], injected={"limiter": gates}) as client:
        async with client.stream(MESSAGES) as stream:
            async for delta in stream:
                assert delta.kind == "content"
                break  # the consumer stops after the first delta
        assert await gates.inflight() == 0
        assert (await gates.source_stats("a")).inflight == 0
        await wait_until(lambda: fake.inflight("a") == 0)
        # the breaker was not charged with a failure: the next call goes through
        fake.script("a", Reply.ok("next"))
        assert (await client.chat(MESSAGES)).content == "next"


async def test_cancelling_the_consumer_releases_everything(fake: FakeUpstream) -> None:
    fake.script("a", Reply.ok(TEXT, chunks=8, inter_token_delay=0.2))
    gates = limiter()
    first = asyncio.Event()
    async with http_client(fake, ["a"], injected={"limiter": gates}) as client:

        async def consume() -> None:
            async with client.stream(MESSAGES) as stream:
                async for _ in stream:
                    first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await gates.inflight() == 0
        await wait_until(lambda: fake.inflight("a") == 0)


async def test_a_cached_answer_replays_as_one_delta(fake: FakeUpstream) -> None:
    cache = CacheSettings(backend="memory", namespace="t", ttl_s=60.0)
    async with http_client(fake, ["a"], cache=cache) as client:
        await client.chat(MESSAGES)
        async with client.stream(MESSAGES) as stream:
            deltas = await collect(stream)
    assert stream.response.cache_hit
    assert deltas == [StreamDelta("content", stream.response.content)]
    assert fake.requests("a") == 1


async def test_tool_call_fragments_stream(fake: FakeUpstream) -> None:
    calls = (("call_1", "lookup", '{"city": "Paris"}'),)
    reply = Reply.ok(
        "", tool_calls=calls, finish_reason="tool_calls", chunks=3, inter_token_delay=0.02
    )
    fake.script("a", reply)
    async with http_client(fake, ["a"]) as client, client.stream(MESSAGES) as stream:
        deltas = await collect(stream)
    fragments = [d for d in deltas if d.kind == "tool_call"]
    assert len(fragments) >= 2
    assert (fragments[0].tool_call_id, fragments[0].name) == ("call_1", "lookup")
    assert "".join(d.text for d in fragments) == '{"city": "Paris"}'
    assert stream.response.tool_calls == (ToolCall(*calls[0]),)
