"""The Failover Bench scenarios through the fake upstream, with a two-source priority client
built from defaults only (``LLM__SELECTOR=priority``, a primary and a fallback).

Each test asserts the answer (or the error) and the conduct from the upstream's own request
log: how many requests each source got, the gaps between them, that a 400 is never re-sent.
Time is a ``FakeClock`` shared by the client and the upstream, so backoff and Retry-After waits
are measured exactly and cost no real time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from polygateway import (
    AllSourcesExhausted,
    ContentFilterError,
    ContextWindowExceededError,
    GatewayClient,
)
from polygateway.settings import DEFAULT_INTER_TOKEN_TIMEOUT_S, DEFAULT_TTFT_TIMEOUT_S
from polygateway.testing import FakeClock, FakeUpstream, Reply
from virtual_time import LoopClock, VirtualTimeLoop

MESSAGES = [{"role": "user", "content": "hello"}]
SIXTY = " ".join(f"w{i}" for i in range(60))


def _client(fake: FakeUpstream, clock: FakeClock | None, **extra: str) -> GatewayClient:
    env = {
        "LLM__SELECTOR": "priority",
        "LLM__OPENAI__1__BASE_URL": fake.base_url("primary"),
        "LLM__OPENAI__1__MODEL": "primary-model",
        "LLM__OPENAI__1__API_KEY": "sk-primary",
        "LLM__OPENAI__2__BASE_URL": fake.base_url("fallback"),
        "LLM__OPENAI__2__MODEL": "fallback-model",
        "LLM__OPENAI__2__API_KEY": "sk-fallback",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
        "PGW_PLUGINS": "",
        **extra,
    }
    if clock is None:
        return GatewayClient.from_env(env=env, pipeline_path=None)
    return GatewayClient.from_env(env=env, pipeline_path=None, clock=clock)


PRIMARY, FALLBACK = "openai-1", "openai-2"


def _gaps(fake: FakeUpstream, source: str | None = None) -> list[float]:
    times = [r.at for r in fake.received(source)]
    return [b - a for a, b in itertools.pairwise(times)]


async def test_s01_429_with_short_retry_after_waits_on_the_primary(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.script("primary", Reply.error(429, retry_after=2))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.source_name == PRIMARY
    assert (fake.requests("primary"), fake.requests("fallback")) == (2, 0)
    assert _gaps(fake, "primary") == [pytest.approx(2.0)]  # exactly the hint, no hammering


async def test_s02_429_persistent_switches_at_once_to_the_fallback(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(429))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.source_name == FALLBACK and response.model == "fallback-model"
    assert (fake.requests("primary"), fake.requests("fallback")) == (1, 1)  # 429: no re-try


async def test_s03_500_once_is_retried_on_the_primary(fake: FakeUpstream, clock: FakeClock) -> None:
    fake.script("primary", Reply.error(500))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.source_name == PRIMARY
    assert (fake.requests("primary"), fake.requests("fallback")) == (2, 0)
    assert 0.5 <= _gaps(fake, "primary")[0] <= 1.5  # one backoff step


async def test_s04_503_persistent_moves_to_the_fallback_after_one_retry(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
        assert response.source_name == FALLBACK
        assert (fake.requests("primary"), fake.requests("fallback")) == (2, 1)


async def test_s05_tcp_reset_is_retried_on_the_primary(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.script("primary", Reply.reset())
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.source_name == PRIMARY
    assert (fake.requests("primary"), fake.requests("fallback")) == (2, 0)


async def test_s08_stream_cut_after_40_of_60_tokens_gets_the_whole_answer(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.script("primary", Reply.cut(after_chunks=40))
    fake.set_default("primary", Reply.ok(SIXTY, chunks=60))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.content == SIXTY and not response.salvaged
    assert response.usage_source == "measured"
    assert fake.requests("primary") == 2


async def test_s10_malformed_chunk_is_retried(fake: FakeUpstream, clock: FakeClock) -> None:
    fake.script("primary", Reply.malformed(after_chunks=2))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.content and response.source_name == PRIMARY
    assert (fake.requests("primary"), fake.requests("fallback")) == (2, 0)


async def test_s11_complete_stream_without_done_is_accepted_once(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.script("primary", Reply.no_done("all of it"))
    async with _client(fake, clock) as client:  # missing_done=retry, the default
        response = await client.chat(MESSAGES)
    assert response.content == "all of it" and not response.salvaged
    assert response.usage_source == "measured"
    assert fake.requests("primary") == 1


async def test_s12_context_length_goes_only_to_a_larger_window(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.context_length_exceeded())
    windows = {"LLM__OPENAI__1__CONTEXT_WINDOW": "8192", "LLM__OPENAI__2__CONTEXT_WINDOW": "128000"}
    async with _client(fake, clock, **windows) as client:
        response = await client.chat(MESSAGES)
        assert response.source_name == FALLBACK
        assert (fake.requests("primary"), fake.requests("fallback")) == (1, 1)  # no re-send
        assert await client.breaker.state(PRIMARY) == "closed"  # never counted


async def test_s12_context_length_without_a_larger_window_raises_at_once(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.context_length_exceeded())
    async with _client(fake, clock) as client:
        with pytest.raises(ContextWindowExceededError, match="maximum context length"):
            await client.chat(MESSAGES)
    assert (fake.requests("primary"), fake.requests("fallback")) == (1, 0)


async def test_s13_content_filter_reaches_the_caller_and_is_not_retried(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.content_filter())
    async with _client(fake, clock) as client:
        with pytest.raises(ContentFilterError) as caught:
            await client.chat(MESSAGES)
    assert caught.value.reason == "content_filter"
    assert (fake.requests("primary"), fake.requests("fallback")) == (1, 0)


async def test_s13_content_filter_switches_when_the_scope_says_so(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.content_filter())
    async with _client(fake, clock, LLM__RETRY__SWITCH_ON_CONTENT_FILTER="true") as client:
        response = await client.chat(MESSAGES)
    assert response.source_name == FALLBACK
    assert (fake.requests("primary"), fake.requests("fallback")) == (1, 1)


async def test_s14_cut_stream_fallback_that_rejects_prefill_gets_the_original_request(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.cut(after_chunks=3))
    fake.set_default("fallback", Reply.ok("from the fallback", reject_prefill=True))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert response.content == "from the fallback" and response.source_name == FALLBACK
    (sent,) = fake.received("fallback")
    assert sent.body["messages"] == MESSAGES  # no assistant prefill


async def test_s15_flapping_primary_serves_again_within_one_cooldown_of_recovering(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    start = clock.monotonic()
    fake.flap("primary", down=Reply.error(503), down_s=20.0, up_s=3600.0)
    served: list[tuple[float, str]] = []
    back_by = 20.0  # when the open period in force at the recovery ends
    async with _client(fake, clock) as client:
        breaker = client.settings.breaker
        assert (breaker.cooldown_s, breaker.cooldown_cap_s) == (5.0, 60.0)  # the defaults
        for _ in range(20):  # 20 requests over about 60 s
            at = clock.monotonic() - start
            served.append((at, (await client.chat(MESSAGES)).source_name))
            if fake.received("primary")[-1].at - start < 20.0:  # its last word was a failure
                wait = await client.breaker.retry_after_s([PRIMARY])
                assert wait <= breaker.cooldown_cap_s
                back_by = max(back_by, clock.monotonic() - start + wait)
            await clock.sleep(3.0)
    assert any(name == FALLBACK for at, name in served if at < 20.0)
    # Back on the primary at the first call after the cooldown in force at its recovery (calls
    # come every 3 s), and there for good.
    recovered = [at for at, name in served if at >= 20.0 and name == PRIMARY]
    assert recovered and recovered[0] <= back_by + 3.0 + 1.0
    assert back_by - 20.0 <= 2 * breaker.cooldown_s  # it had doubled once at most
    assert all(name == PRIMARY for at, name in served if at >= recovered[0])
    # No hammering: while down the primary saw few requests, never back to back.
    down = [r.at - start for r in fake.received("primary") if r.at - start < 20.0]
    assert len(down) <= 8
    assert all(gap >= 0.5 for gap in _gaps(fake, "primary"))


async def _flap_with_health_probe() -> tuple[list[tuple[float, str]], list[float], float]:
    clock = LoopClock()
    async with FakeUpstream(clock=clock) as live:
        start = clock.monotonic()
        live.flap("primary", down=Reply.error(503), down_s=20.0, up_s=3600.0)
        served: list[tuple[float, str]] = []
        async with _client(live, clock, LLM__BREAKER__HEALTH_PROBE="true") as client:

            async def cooldown_end_at_recovery() -> float:
                # Read the breaker at the recovery itself: a background probe that failed
                # after the last call before it may have set the cooldown in force.
                await clock.sleep(start + 20.0 - clock.monotonic())
                wait = await client.breaker.retry_after_s([PRIMARY])
                return clock.monotonic() - start + wait

            sampled = asyncio.ensure_future(cooldown_end_at_recovery())
            for _ in range(20):
                at = clock.monotonic() - start
                served.append((at, (await client.chat(MESSAGES)).source_name))
                await clock.sleep(3.0)
            back_by = await sampled
        answered = [
            r.at - start
            for r in live.received("primary")
            if r.at - start >= 20.0 and r.body.get("max_completion_tokens") == 1
        ]
        return served, answered, back_by


def test_s15_with_the_health_probe_the_primary_is_back_when_its_cooldown_ends() -> None:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        served, probes_after_recovery, back_by = runner.run(_flap_with_health_probe())
    assert any(name == FALLBACK for at, name in served if at < 20.0)
    # The background probe, not a call, found the primary back: right when the cooldown in
    # force at the recovery ended (the probes in between were at most doubled once).
    assert probes_after_recovery, "no health probe after the recovery"
    assert probes_after_recovery[0] <= back_by + 0.5
    assert back_by - 20.0 <= 10.0
    assert all(name == PRIMARY for at, name in served if at >= probes_after_recovery[0] + 0.5)


async def test_s16_accounting_names_the_answering_source(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    fake.set_default("fallback", Reply.ok("ok", prompt_tokens=11, completion_tokens=7))
    async with _client(fake, clock) as client:
        response = await client.chat(MESSAGES)
    assert (response.source_name, response.model, response.provider) == (
        FALLBACK,
        "fallback-model",
        "openai",
    )
    assert (response.prompt_tokens, response.completion_tokens) == (11, 7)


async def test_s16_failed_attempts_have_their_own_rows_at_zero_cost(
    fake: FakeUpstream, clock: FakeClock, tmp_path: Path
) -> None:
    fake.set_default("primary", Reply.error(503))
    fake.set_default("fallback", Reply.ok("ok", prompt_tokens=1000, completion_tokens=500))
    prices = {
        "primary-model": {"input_per_1m": 5.0, "output_per_1m": 15.0},
        "fallback-model": {"input_per_1m": 2.0, "output_per_1m": 8.0},
    }
    pricing = tmp_path / "prices.json"
    pricing.write_text(json.dumps(prices), encoding="utf-8")
    db = tmp_path / "calls.db"
    telemetry = {
        "PGW_TELEMETRY_BACKEND": "sqlite",
        "PGW_TELEMETRY_SQLITE_PATH": str(db),
        "PGW_PRICING_PATH": str(pricing),
    }
    async with _client(fake, clock, **telemetry) as client:
        response = await client.chat(MESSAGES, session_id="s16")
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM pgw_calls ORDER BY rowid")]
    # Two failed attempts on the primary (the same-source retry), then the fallback's answer.
    assert [(r["source_name"], r["model"], r["error"]) for r in rows] == [
        (PRIMARY, "primary-model", "TransientError"),
        (PRIMARY, "primary-model", "TransientError"),
        (FALLBACK, "fallback-model", None),
    ]
    assert len({r["call_id"] for r in rows}) == 3 and {r["session_id"] for r in rows} == {"s16"}
    for row in rows[:2]:
        assert (row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (0, 0, 0.0)
    answered = rows[2]
    expected_cost = 1000 / 1e6 * 2.0 + 500 / 1e6 * 8.0  # the fallback's prices, not the primary's
    assert (answered["prompt_tokens"], answered["completion_tokens"]) == (1000, 500)
    assert answered["cost"] == pytest.approx(expected_cost)
    assert answered["call_id"] == response.call_id
    assert (response.prompt_tokens, response.completion_tokens) == (1000, 500)
    assert response.cost == pytest.approx(expected_cost)


async def test_deadline_ends_the_call_with_the_exhausted_fields(
    fake: FakeUpstream, clock: FakeClock
) -> None:
    fake.set_default("primary", Reply.error(503))
    fake.set_default("fallback", Reply.error(503))
    async with _client(fake, clock, LLM__RETRY__MAX_ATTEMPTS="10") as client:
        started = clock.monotonic()
        with pytest.raises(AllSourcesExhausted) as caught:
            await client.chat(MESSAGES, deadline_s=2.0)
    assert caught.value.reason == "retry_exhausted" and "deadline" in str(caught.value)
    assert clock.monotonic() - started <= 2.0
    assert caught.value.per_source_reasons[PRIMARY] == "network_error"
    assert isinstance(caught.value.last_error, Exception)


# Silent upstreams: the stream watchdog's timers are the event loop's, so these run on a loop
# on virtual time (it jumps to the next timer whenever nothing is ready). The client keeps its
# default TTFT, inter-token and total timeouts; the faults outlast them.


async def _silent_primary(fault: Reply) -> tuple[str, int, int, float, float]:
    clock = LoopClock()
    async with FakeUpstream(clock=clock) as live:
        live.set_default("primary", fault)
        async with _client(live, clock) as client:
            source = client.settings.source(PRIMARY)
            started = clock.monotonic()
            response = await client.chat(MESSAGES)
            elapsed = clock.monotonic() - started
        assert source.timeout_s == 120.0  # the defaults, nothing declared
        limit = source.ttft_timeout_s if fault.kind != "stall" else source.inter_token_timeout_s
        assert limit is not None
        return (
            response.source_name,
            live.requests("primary"),
            live.requests("fallback"),
            elapsed,
            limit,
        )


@pytest.mark.parametrize(
    ("fault", "limit_name"),
    [
        pytest.param(Reply.black_hole(), "ttft", id="s06-no-response"),
        pytest.param(Reply.ok("late", first_token_delay=600.0), "ttft", id="s07-slow-first-token"),
        pytest.param(Reply.stall(after_chunks=3), "inter_token", id="s09-stream-stall"),
    ],
)
def test_silent_primary_is_left_for_the_fallback_with_default_timeouts(
    fault: Reply, limit_name: str
) -> None:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        answered_by, primary, fallback, elapsed, limit = runner.run(_silent_primary(fault))
    assert (
        limit
        == {"ttft": DEFAULT_TTFT_TIMEOUT_S, "inter_token": DEFAULT_INTER_TOKEN_TIMEOUT_S}[
            limit_name
        ]
    )
    assert answered_by == FALLBACK
    assert (primary, fallback) == (1, 1)  # a watchdog verdict is not retried on the same source
    # The watchdog ended the primary's attempt at its default bound, long before the 120 s
    # total timeout (a backoff step at most comes on top).
    assert limit <= elapsed < limit + 5.0
