"""The governed chat path end to end, through the real fake upstream (HTTP on loopback).

Every assertion about retries, switching and the breaker counts what reached the wire
(``fake.requests(source)``). Where time matters the retry layer runs on a FakeClock (backoff
and polling advance it instantly); the transports always run on real network time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator

import pytest
from client_helpers import (
    MESSAGES,
    FaultyBreaker,
    FaultyLimiter,
    http_client,
    wait_until,
)
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.errors import (
    AllSourcesExhausted,
    GovernanceBackendError,
    RequestRejectedError,
    SourceDeadError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.ports import Denial
from polygateway.settings import BackpressureSettings, BreakerSettings, Limits, RetrySettings
from polygateway.testing import FakeClock, FakeUpstream, Reply


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


# Short watchdog limits so that the timing faults cost a fraction of a second each.
WATCHDOG = {"timeout_s": 1.0, "ttft_timeout_s": 0.2, "inter_token_timeout_s": 0.1}

FAULTS = [
    pytest.param(Reply.error(500), TransientError, "transient", id="500"),
    pytest.param(Reply.error(502), TransientError, "transient", id="502"),
    pytest.param(Reply.error(503), TransientError, "transient", id="503"),
    pytest.param(Reply.error(504), TransientError, "transient", id="504"),
    pytest.param(Reply.error(429), TransientError, "transient", id="429-rate"),
    pytest.param(Reply.error(429, quota=True), SourceDeadError, "dead", id="429-quota"),
    pytest.param(Reply.error(401), SourceDeadError, "dead", id="401"),
    pytest.param(Reply.error(403), SourceDeadError, "dead", id="403"),
    pytest.param(Reply.error(400), RequestRejectedError, "rejected", id="400"),
    pytest.param(Reply.cut(after_chunks=3), TransientError, "transient", id="cut-before-done"),
    pytest.param(Reply.early_eof(), TransientError, "transient", id="early-eof"),
    pytest.param(Reply.malformed(), TransientError, "transient", id="malformed-frame"),
    pytest.param(Reply.empty(), TransientError, "transient", id="empty-completion"),
    pytest.param(Reply.mid_stream_error(), TransientError, "transient", id="mid-stream-error"),
    pytest.param(Reply.reset(), TransientError, "transient", id="reset"),
    pytest.param(Reply.reset(after_headers=True), TransientError, "transient", id="reset-late"),
    pytest.param(Reply.ok(headers_delay=0.5), TransientError, "transient", id="slow-headers"),
    pytest.param(
        Reply.ok(first_token_delay=0.5), StreamLivenessTimeout, "transient", id="slow-first-token"
    ),
    pytest.param(
        Reply.ok("one two three four five six", chunks=3, inter_token_delay=0.4),
        StreamLivenessTimeout,
        "transient",
        id="token-gap",
    ),
    pytest.param(Reply.black_hole(), TransientError, "transient", id="black-hole"),
]


@pytest.mark.parametrize(("reply", "error_class", "behaviour"), FAULTS)
async def test_each_fault_has_its_error_class_and_behaviour(
    fake: FakeUpstream, reply: Reply, error_class: type[Exception], behaviour: str
) -> None:
    overrides = {name: WATCHDOG for name in ("solo", "a", "b")}
    # The error class: one source, one attempt.
    solo = http_client(
        fake, ["solo"], source_overrides=overrides, retry=RetrySettings(max_attempts=1)
    )
    fake.script("solo", reply)
    with pytest.raises((AllSourcesExhausted, RequestRejectedError)) as info:
        await solo.chat(MESSAGES)
    error = info.value
    if behaviour == "rejected":
        assert isinstance(error, RequestRejectedError)
    else:
        assert isinstance(error, AllSourcesExhausted) and error.reason == "retry_exhausted"
        assert type(error.last_error) is error_class or (
            error_class is TransientError and isinstance(error.last_error, TransientError)
        ), repr(error.last_error)
    assert fake.requests("solo") == 1
    await solo.aclose()

    # The behaviour: a faulty a, a healthy b, a breaker that opens on the first failure.
    clock = FakeClock()
    client = http_client(
        fake,
        ["a", "b"],
        clock=clock,
        source_overrides=overrides,
        breaker=BreakerSettings(fail_threshold=1, cooldown_s=30.0),
    )
    fake.script("a", reply)
    if behaviour == "rejected":
        with pytest.raises(RequestRejectedError):
            await client.chat(MESSAGES)
        assert (fake.requests("a"), fake.requests("b")) == (1, 0)  # no retry, no switch
        assert await client.breaker.state("a") == "closed"  # not counted
    else:
        response = await client.chat(MESSAGES)
        assert response.source_name == "b"
        assert (fake.requests("a"), fake.requests("b")) == (1, 1)
        assert await client.breaker.state("a") == "open"  # failure counted / forced open
        waited = clock.monotonic() - 1000.0
        if behaviour == "transient":
            assert 0.5 <= waited <= 1.5  # backoff before the switch
        else:
            assert waited == 0.0  # dead: switch at once
        # a is skipped from now on: its breaker is open and memoised
        for _ in range(3):
            assert (await client.chat(MESSAGES)).source_name == "b"
        assert fake.requests("a") == 1
    assert await client.limiter.inflight() == 0
    await client.aclose()


async def test_429_with_retry_after_moves_the_next_attempt_to_b(fake: FakeUpstream) -> None:
    clock = FakeClock()
    # Retry-After above the wait threshold: cool a and switch.
    client = http_client(
        fake, ["a", "b"], clock=clock, retry=RetrySettings(wait_retry_after_up_to_s=1)
    )
    fake.script("a", Reply.error(429, retry_after=2))
    response = await client.chat(MESSAGES)
    assert response.source_name == "b"
    assert (fake.requests("a"), fake.requests("b")) == (1, 1)
    # Retry-After speaks for a only: b takes the retry after the plain backoff (<= 1.5 s)
    assert 0.5 <= clock.monotonic() - 1000.0 <= 1.5
    # a cools down for the Retry-After: the next call goes straight to b
    assert (await client.chat(MESSAGES)).source_name == "b"
    assert fake.requests("a") == 1
    await client.aclose()


async def test_retry_after_is_honoured_when_no_other_source_can_retry(
    fake: FakeUpstream,
) -> None:
    clock = FakeClock()
    client = http_client(fake, ["a"], clock=clock)
    fake.script("a", Reply.error(429, retry_after=2))
    response = await client.chat(MESSAGES)
    assert response.source_name == "a"
    assert fake.requests("a") == 2
    # backoff base 1.0 * jitter <= 1.5 < Retry-After 2: the wait is the Retry-After
    assert clock.monotonic() - 1000.0 == pytest.approx(2.0)
    await client.aclose()


async def test_401_force_opens_a_which_later_calls_skip(fake: FakeUpstream) -> None:
    client = http_client(fake, ["a", "b"], clock=FakeClock())
    fake.set_default("a", Reply.error(401))
    for _ in range(6):
        assert (await client.chat(MESSAGES)).source_name == "b"
    assert fake.requests("a") == 1 and fake.requests("b") == 6
    assert await client.breaker.state("a") == "open"
    await client.aclose()


async def test_400_is_exactly_one_request(fake: FakeUpstream) -> None:
    client = http_client(fake, ["a", "b"], clock=FakeClock())
    fake.set_default("a", Reply.error(400, message="bad parameter"))
    fake.set_default("b", Reply.error(400))
    with pytest.raises(RequestRejectedError, match="bad parameter"):
        await client.chat(MESSAGES)
    assert fake.requests() == 1
    await client.aclose()


async def test_all_sources_down_reports_retry_after_and_reasons(fake: FakeUpstream) -> None:
    clock = FakeClock()
    client = http_client(fake, ["a", "b"], clock=clock, retry=RetrySettings(max_attempts=3))
    fake.set_default("a", Reply.error(503, retry_after=30))
    fake.set_default("b", Reply.error(401))
    with pytest.raises(AllSourcesExhausted) as info:
        await client.chat(MESSAGES)
    error = info.value
    assert error.reason == "retry_exhausted"
    assert error.per_source_reasons == {"a": "network_error", "b": "source_dead"}
    # a: Retry-After 30 (b takes the retry meanwhile, then the call waits a's cooldown out and
    # a fails again); b's breaker reopens ~1 s later. Never less than the next backoff step (4 s).
    assert 4.0 <= error.retry_after_s <= 30.0
    assert isinstance(error.last_error, TransientError) and error.last_error.status == 503
    assert (fake.requests("a"), fake.requests("b")) == (2, 1)
    await client.aclose()


# --------------------------------------------------------------------------- limits under load


async def test_global_concurrency_holds_under_200_concurrent_calls(fake: FakeUpstream) -> None:
    # Real clock: waiting callers poll every few milliseconds.
    client = http_client(
        fake,
        ["a", "b"],
        global_limits=Limits(max_concurrency=8),
        backpressure=BackpressureSettings(poll_interval_s=0.005),
    )
    fake.set_default("a", Reply.ok(headers_delay=0.005))
    fake.set_default("b", Reply.ok(headers_delay=0.005))
    responses = await asyncio.gather(*(client.chat(MESSAGES) for _ in range(200)))
    assert len(responses) == 200 and all(r.content for r in responses)
    assert fake.requests() == 200
    assert 2 <= fake.max_inflight() <= 8
    assert await client.limiter.inflight() == 0
    await client.aclose()


async def test_per_source_rpm_holds_under_200_concurrent_calls(fake: FakeUpstream) -> None:
    client = http_client(
        fake,
        ["a", "b"],
        clock=FakeClock(),
        source_overrides={"a": {"limits": Limits(rpm=30)}, "b": {"limits": Limits(rpm=50)}},
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    outcomes = await asyncio.gather(
        *(client.chat(MESSAGES) for _ in range(200)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(outcomes) - len(refused) == 80
    assert all(
        isinstance(e, AllSourcesExhausted) and e.reason == "quota_exhausted" for e in refused
    )
    assert (fake.requests("a"), fake.requests("b")) == (30, 50)
    await client.aclose()


async def test_two_clients_sharing_a_limiter_share_its_global_concurrency(
    fake: FakeUpstream,
) -> None:
    shared = InMemoryLimiter(
        global_limits=Limits(max_concurrency=3), lease_ttl_s=60.0, clock=SystemClock()
    )
    quick = BackpressureSettings(poll_interval_s=0.005)
    search = http_client(
        fake, ["a"], scope="SEARCH", backpressure=quick, injected={"limiter": shared}
    )
    judge = http_client(
        fake, ["b"], scope="JUDGE", backpressure=quick, injected={"limiter": shared}
    )
    assert search.limiter is judge.limiter is shared
    fake.set_default("a", Reply.ok(headers_delay=0.01))
    fake.set_default("b", Reply.ok(headers_delay=0.01))
    await asyncio.gather(
        *(search.chat(MESSAGES) for _ in range(30)), *(judge.chat(MESSAGES) for _ in range(30))
    )
    assert (fake.requests("a"), fake.requests("b")) == (30, 30)
    assert fake.max_inflight() <= 3  # across both clients' sources
    await search.aclose()
    await judge.aclose()
    assert await shared.inflight() == 0  # injected: still usable, not closed by the clients


# --------------------------------------------------------------------------- cancellation


async def test_cancelling_100_inflight_calls_frees_every_lease_and_the_probe(
    fake: FakeUpstream,
) -> None:
    clock = FakeClock()
    client = http_client(fake, ["a", "b"], clock=clock)
    fake.set_default("a", Reply.black_hole())
    fake.set_default("b", Reply.black_hole())
    await client.breaker.force_open("a")
    clock.advance(30.0)  # a's cooldown is over: the next call into a is the half-open probe
    tasks = [asyncio.create_task(client.chat(MESSAGES)) for _ in range(100)]
    await fake.wait_for_requests(100)
    assert (fake.inflight("a"), fake.inflight("b")) == (1, 99)  # one probe, the rest on b
    assert await client.limiter.inflight() == 100
    for task in tasks:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert await client.limiter.inflight() == 0
    probe = await client.breaker.try_enter("a")
    assert probe.allowed and probe.is_probe  # the probe was handed back, not leaked
    await client.breaker.release_probe(probe)
    assert await client.breaker.state("b") == "closed"  # cancellation is not a failure
    await wait_until(lambda: fake.inflight() == 0)  # connections were closed, not leaked
    await client.aclose()


# --------------------------------------------------------------------------- backpressure


@pytest.mark.parametrize(
    ("waits_past_window", "progress_recent", "stalled"),
    [(True, False, True), (True, True, False), (False, False, False), (False, True, False)],
    ids=["both-past-window", "recent-progress", "short-wait-old-progress", "neither"],
)
async def test_stall_verdict_quadrants(
    fake: FakeUpstream, waits_past_window: bool, progress_recent: bool, stalled: bool
) -> None:
    window = 60.0
    clock = FakeClock()
    client = http_client(
        fake,
        ["a"],
        clock=clock,
        global_limits=Limits(max_concurrency=1),
        backpressure=BackpressureSettings(
            stall_window_s=window, poll_interval_s=0.5, lease_ttl_s=1e6
        ),
    )
    limiter = client.limiter
    # Another holder keeps the only global slot; "progress" = other calls completing.
    held = await limiter.try_acquire("elsewhere", 1, Limits())
    assert not isinstance(held, Denial)
    release_at = clock.monotonic() + (3 * window if waits_past_window else window / 2)
    if stalled:
        release_at = math.inf

    async def elsewhere() -> None:
        while clock.monotonic() < release_at:
            if progress_recent:
                await limiter.mark_progress()
            await asyncio.sleep(0)
        await held.release()

    driver = asyncio.create_task(elsewhere())
    try:
        if stalled:
            with pytest.raises(AllSourcesExhausted) as info:
                await client.chat(MESSAGES)
            assert info.value.reason == "stalled"
            assert window < clock.monotonic() - 1000.0 <= window + 1.0
            assert fake.requests() == 0
        else:
            response = await client.chat(MESSAGES)
            assert response.source_name == "a" and fake.requests() == 1
            assert clock.monotonic() >= release_at
    finally:
        driver.cancel()
        await asyncio.gather(driver, return_exceptions=True)
    await client.aclose()


async def test_fail_fast_refuses_at_once_when_the_quota_is_full(fake: FakeUpstream) -> None:
    clock = FakeClock()
    client = http_client(
        fake,
        ["a", "b"],
        clock=clock,
        global_limits=Limits(max_concurrency=1),
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    held = await client.limiter.try_acquire("elsewhere", 1, Limits())
    with pytest.raises(AllSourcesExhausted) as info:
        await client.chat(MESSAGES)
    assert info.value.reason == "quota_exhausted"
    assert info.value.retry_after_s > 0
    assert fake.requests() == 0 and clock.monotonic() == 1000.0
    assert not isinstance(held, Denial)
    await held.release()
    assert (await client.chat(MESSAGES)).content
    await client.aclose()


# --------------------------------------------------------------------------- degradation


async def test_admission_side_limiter_failure_raises_governance_backend_error(
    fake: FakeUpstream,
) -> None:
    clock = FakeClock()
    limiter = FaultyLimiter(
        InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock), admission=True
    )
    client = http_client(fake, ["a", "b"], clock=clock, injected={"limiter": limiter})
    with pytest.raises(GovernanceBackendError):
        await client.chat(MESSAGES)
    assert fake.requests() == 0
    await client.aclose()
    assert not limiter.closed  # injected parts stay the caller's


async def test_admission_side_breaker_failure_raises_governance_backend_error(
    fake: FakeUpstream,
) -> None:
    clock = FakeClock()
    gate = InMemoryGate(fail_threshold=3, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock)
    client = http_client(
        fake, ["a"], clock=clock, injected={"breaker": FaultyBreaker(gate, admission=True)}
    )
    with pytest.raises(GovernanceBackendError):
        await client.chat(MESSAGES)
    assert fake.requests() == 0
    await client.aclose()


async def test_release_side_failures_only_warn(
    fake: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    real = InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock)
    gate = InMemoryGate(fail_threshold=3, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock)
    client = http_client(
        fake,
        ["a"],
        clock=clock,
        injected={
            "limiter": FaultyLimiter(real, accounting=True),
            "breaker": FaultyBreaker(gate, accounting=True),
        },
    )
    with caplog.at_level(logging.WARNING, logger="polygateway.governance.admission"):
        response = await client.chat(MESSAGES)
    assert response.content and fake.requests() == 1
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "permit.release failed" in warned and "breaker.record_success failed" in warned
    await client.aclose()
