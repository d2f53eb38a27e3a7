"""The governor's decisions through the chat dispatcher, with scripted transports and the real
memory backends (formerly the tests of the retry layer).

Time is a FakeClock: backoff and waits advance it instantly, so every delay is asserted exactly.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from typing import Any

import pytest
from client_helpers import (
    MESSAGES,
    FaultyBreaker,
    FaultyLimiter,
    ScriptedLimiter,
    make_rig,
    ok,
    source,
    wait_until,
)
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.chat import ChatDispatcher, check_message_fields
from polygateway.context import CallContext
from polygateway.errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    ConfigError,
    GovernanceBackendError,
    RequestRejectedError,
    ResultInvalidError,
    ScopeUnavailableError,
    SourceDeadError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.ports import Denial
from polygateway.selectors import LeastInflightSelector, RoundRobinSelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
)
from polygateway.testing import FakeClock
from polygateway.types import ChatRequest


def transient(status: int = 503, retry_after: float | None = None) -> TransientError:
    return TransientError(f"HTTP {status}", status=status, retry_after_s=retry_after)


# --------------------------------------------------------------------------- success


async def test_success_builds_provenance_and_reports_one_attempt() -> None:
    rig = make_rig(["a"])
    response = await rig.call()
    assert response.content == "fine"
    assert response.source_name == "a"
    assert response.provider == "openai"
    assert response.model == "served-model"
    assert (response.prompt_tokens, response.completion_tokens) == (3, 4)
    assert (
        response.latency_ms == 5 and response.ttft_ms == 1.0 and response.max_inter_token_ms == 2.0
    )
    assert response.cache_hit is False and response.finish_reason == "stop"
    assert len(response.call_id) == 32 and response.call_id == rig.transport.calls[0][1]
    assert len(rig.observer.attempts) == 1
    name, call_id, outcome, _ = rig.observer.attempts[0]
    assert (name, call_id) == ("a", response.call_id) and outcome is response
    assert await rig.limiter.inflight() == 0
    assert await rig.limiter.progress_age_s() == 0.0
    assert rig.clock.monotonic() == 1000.0  # no sleep on the clean path


async def test_tpm_is_settled_on_real_usage() -> None:
    rig = make_rig(["a"], sources=[source("a", est_tokens=100)])
    rig.transport.script("a", ok(prompt=30, completion=12))
    await rig.call()
    assert (await rig.limiter.source_stats("a")).tpm_used == 42


async def test_model_falls_back_to_the_source_model() -> None:
    rig = make_rig(["a"])
    rig.transport.script("a", ok().__class__(content="x"))
    response = await rig.call()
    assert response.model == "model-a"


async def test_the_dispatcher_is_a_plain_handler_without_call_next() -> None:
    rig = make_rig(["a"])
    assert list(inspect.signature(rig.layer.__call__).parameters) == ["request"]
    assert (await rig.call()).content == "fine"


async def test_a_subclass_attempt_is_the_one_the_governor_runs() -> None:
    # The attempt is the class's own ``_send`` (bound without a method object per call).
    rig = make_rig(["a"])
    sent: list[str] = []

    class Tagging(ChatDispatcher):
        __slots__ = ()

        async def _send(self, request: Any, source: Any, call_id: str) -> Any:
            sent.append(call_id)
            return await super()._send(request, source, call_id)

    tagging = Tagging(rig.layer.governor, {"a": rig.transport}, clock=rig.clock)
    response = await tagging(ChatRequest(messages=MESSAGES))
    assert sent == [response.call_id]
    # With observers too: the attempt that tells them is the subclass's.
    context = CallContext()
    context.add_observer(rig.observer)
    request = ChatRequest(messages=MESSAGES, context=context)
    observed = await tagging(request)
    assert sent == [response.call_id, observed.call_id]
    assert [(call_id, outcome) for _, call_id, outcome, _ in rig.observer.attempts] == [
        (observed.call_id, observed)
    ]


class _Failing:
    def on_attempt(self, *args: Any) -> None:
        raise RuntimeError("observer down")

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        pass


class _Hearing:
    def __init__(self) -> None:
        self.requests: list[ChatRequest] = []

    def on_attempt(self, request: ChatRequest, *args: Any) -> None:
        self.requests.append(request)

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        pass


async def test_every_observer_hears_of_an_attempt_when_one_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(["a"])
    hearing = _Hearing()
    context = CallContext()
    context.add_observer(_Failing())
    context.add_observer(hearing)
    request = ChatRequest(messages=MESSAGES, context=context)
    with caplog.at_level(logging.WARNING):
        response = await rig.layer(request)
    assert response.content == "fine"
    assert hearing.requests == [request]  # with the request the attempt sent
    assert "observer down" in caplog.text  # logged by the governor, not raised into the call


# --------------------------------------------------------------------------- transient


async def test_transient_backs_off_then_switches_source_with_new_call_id() -> None:
    rig = make_rig(["a", "b"], retry=RetrySettings(same_source_attempts=0))
    rig.transport.script("a", transient(502))
    response = await rig.call()
    assert [s for s, _ in rig.transport.calls] == ["a", "b"]
    first, second = (c for _, c in rig.transport.calls)
    assert first != second and response.call_id == second
    waited = rig.clock.monotonic() - 1000.0
    assert 0.5 <= waited <= 1.5  # base 1.0 * uniform(0.5, 1.5)
    outcomes = [o for _, _, o, _ in rig.observer.attempts]
    assert isinstance(outcomes[0], TransientError) and outcomes[1] is response


async def test_single_source_retries_the_same_source_with_growing_backoff() -> None:
    rig = make_rig(
        ["a"],
        retry=RetrySettings(max_attempts=4, base_delay_s=1.0, max_delay_s=3.0),
        breaker_settings=BreakerSettings(fail_threshold=10),
    )
    rig.transport.script("a", transient(), transient(), transient())
    await rig.call()
    assert rig.transport.count("a") == 4
    waited = rig.clock.monotonic() - 1000.0
    # 1, 2, then capped at 3; each * uniform(0.5, 1.5)
    assert 0.5 * (1 + 2 + 3) <= waited <= 1.5 * (1 + 2 + 3)


async def test_retry_after_cools_only_its_source_and_the_retry_goes_elsewhere() -> None:
    rig = make_rig(["a", "b"])
    rig.transport.script(
        "a", TransientError("429", status=429, retry_after_s=7.0, reason="rate_limited")
    )
    await rig.call()
    assert [s for s, _ in rig.transport.calls] == ["a", "b"]
    # b is free: the switch waits the plain backoff (base 1.0 x jitter), not a's 7 s
    assert 0.5 <= rig.clock.monotonic() - 1000.0 <= 1.5


async def test_retry_after_is_the_floor_of_the_backoff_when_no_other_source_is_free() -> None:
    rig = make_rig(["a"])
    rig.transport.script(
        "a", TransientError("429", status=429, retry_after_s=7.0, reason="rate_limited")
    )
    await rig.call()
    assert [s for s, _ in rig.transport.calls] == ["a", "a"]
    assert rig.clock.monotonic() - 1000.0 == pytest.approx(7.0)


async def test_retry_after_cools_the_source_for_other_calls() -> None:
    rig = make_rig(["a", "b"], retry=RetrySettings(max_attempts=1))
    rig.transport.script(
        "a", TransientError("429", status=429, retry_after_s=20.0, reason="rate_limited")
    )
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.per_source_reasons == {"a": "rate_limited"}
    # b is ready at once; the floor is the next backoff step (base 1.0)
    assert info.value.retry_after_s == pytest.approx(1.0)
    for _ in range(3):
        await rig.call()
    assert rig.transport.count("a") == 1 and rig.transport.count("b") == 3
    rig.clock.advance(20.0)
    await rig.call()
    await rig.call()
    assert rig.transport.count("a") == 2


async def test_retry_after_of_the_only_source_is_the_scope_retry_after() -> None:
    rig = make_rig(["a"], retry=RetrySettings(max_attempts=1))
    rig.transport.script(
        "a", TransientError("429", status=429, retry_after_s=20.0, reason="rate_limited")
    )
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.retry_after_s == pytest.approx(20.0)


async def test_transient_failures_open_the_breaker_at_the_threshold() -> None:
    rig = make_rig(["a"], retry=RetrySettings(max_attempts=3, base_delay_s=0.1, max_delay_s=0.1))
    rig.transport.script("a", transient(), transient(), transient())
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.reason == "retry_exhausted"
    assert isinstance(info.value.last_error, TransientError)
    assert info.value.__cause__ is info.value.last_error
    assert await rig.breaker.state("a") == "open"  # threshold 3
    # The next call finds the breaker open: no request, CircuitOpenError in fail-fast terms
    # (here: wait mode waits for the reopening, then the probe succeeds).
    before = rig.clock.monotonic()
    response = await rig.call()
    assert response.source_name == "a"
    assert rig.clock.monotonic() - before >= 30.0 - 1.0  # cooldown 30 s minus the backoff slept
    assert await rig.breaker.state("a") == "closed"


@pytest.mark.parametrize(("failures", "state"), [(7, "closed"), (8, "open")])
async def test_effective_threshold_is_twice_the_source_concurrency(
    failures: int, state: str
) -> None:
    sources = [source("a", limits=Limits(max_concurrency=4))]  # threshold max(3, 4 * 2) = 8
    rig = make_rig(
        sources=sources,
        retry=RetrySettings(max_attempts=failures, base_delay_s=0.01, max_delay_s=0.01),
    )
    rig.transport.script("a", *[transient() for _ in range(failures)])
    with pytest.raises(AllSourcesExhausted):
        await rig.call()
    assert await rig.breaker.state("a") == state


async def test_liveness_timeout_counts_as_transient() -> None:
    rig = make_rig(["a", "b"])
    rig.transport.script("a", StreamLivenessTimeout("ttft", 5.0))
    response = await rig.call()
    assert response.source_name == "b"


async def test_all_sources_down_reports_reasons_and_a_sensible_retry_after() -> None:
    rig = make_rig(
        ["a", "b"], retry=RetrySettings(max_attempts=4, base_delay_s=1.0, max_delay_s=30.0)
    )
    for name in ("a", "b"):
        rig.transport.script(name, transient(500), transient(500))
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    error = info.value
    assert error.reason == "retry_exhausted"
    assert error.per_source_reasons == {"a": "network_error", "b": "network_error"}
    assert rig.transport.count("a") == 2 and rig.transport.count("b") == 2
    # nothing is cooling, so the floor is the next backoff step: base * 2^3 = 8
    assert error.retry_after_s == pytest.approx(8.0)
    assert "4 attempt(s) failed" in str(error)


# --------------------------------------------------------------------------- source dead


async def test_source_dead_force_opens_switches_at_once_and_is_skipped_later() -> None:
    rig = make_rig(["a", "b"])
    rig.transport.script("a", SourceDeadError("401", status=401))
    response = await rig.call()
    assert response.source_name == "b"
    assert rig.clock.monotonic() == 1000.0  # no backoff
    assert await rig.breaker.state("a") == "open"
    for _ in range(4):
        assert (await rig.call()).source_name == "b"
    assert rig.transport.count("a") == 1


async def test_every_source_dead_is_exhausted_with_source_dead_reasons() -> None:
    rig = make_rig(
        ["a", "b"],
        retry=RetrySettings(max_attempts=5),
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    rig.transport.script("a", SourceDeadError("401", status=401))
    rig.transport.script("b", SourceDeadError("403", status=403))
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    error = info.value
    assert error.reason == "retry_exhausted"
    assert error.per_source_reasons == {"a": "source_dead", "b": "source_dead"}
    assert error.retry_after_s == pytest.approx(30.0)  # breaker cooldown
    assert isinstance(error.last_error, SourceDeadError)
    assert rig.transport.count() == 2
    # A later call: both are skipped by the cooldown memo, and still read as dead sources.
    with pytest.raises(ScopeUnavailableError) as later:
        await rig.call()
    assert later.value.per_source_reasons == {"a": "source_dead", "b": "source_dead"}
    assert rig.transport.count() == 2


# --------------------------------------------------------------------------- rejected / invalid


async def test_request_rejected_is_raised_at_once_and_not_counted() -> None:
    rig = make_rig(["a", "b"], breaker_settings=BreakerSettings(fail_threshold=1, cooldown_s=30.0))
    rig.transport.script("a", RequestRejectedError("400", status=400))
    with pytest.raises(RequestRejectedError):
        await rig.call()
    assert rig.transport.count() == 1
    assert await rig.breaker.state("a") == "closed"  # threshold 1 would have opened it
    assert await rig.limiter.inflight() == 0
    assert isinstance(rig.observer.attempts[0][2], RequestRejectedError)


async def test_result_invalid_counts_as_breaker_success() -> None:
    rig = make_rig(["a"], breaker_settings=BreakerSettings(fail_threshold=2, cooldown_s=30.0))
    rig.transport.script("a", transient(), ResultInvalidError("bad"))
    with pytest.raises(ResultInvalidError):
        await rig.call()
    # one failure then a success: the count was reset, so one more failure stays closed
    rig.transport.script("a", transient(), ok())
    await rig.call()
    assert await rig.breaker.state("a") == "closed"


async def test_unexpected_transport_error_propagates_and_frees_everything() -> None:
    clock = FakeClock()
    breaker = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    rig = make_rig(["a"], breaker=breaker, clock=clock)
    await breaker.force_open("a")
    clock.advance(5.0)  # the next call is the half-open probe
    rig.transport.script("a", KeyError("bug"))
    with pytest.raises(KeyError):
        await rig.call()
    assert await rig.limiter.inflight() == 0
    assert (await breaker.try_enter("a")).is_probe  # the probe was handed back


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"content": "x"}], "no 'role'"),
        ([{"role": "", "content": "x"}], "non-empty string"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": 3}], "got int"),
        ([{"role": "user", "content": None}], "got NoneType"),
    ],
)
async def test_bad_messages_are_rejected_before_any_attempt(
    messages: list[dict[str, object]], fragment: str
) -> None:
    rig = make_rig(["a"])
    with pytest.raises(RequestRejectedError, match=fragment):
        await rig.call(messages)
    assert rig.transport.count() == 0 and rig.observer.attempts == []


def test_message_fields_accept_parts_and_tool_call_turns() -> None:
    check_message_fields(
        [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
        ]
    )


# --------------------------------------------------------------------------- breaker open


async def test_all_breakers_open_fail_fast_raises_circuit_open_without_requests() -> None:
    rig = make_rig(["a", "b"], backpressure=BackpressureSettings(quota_full="fail_fast"))
    await rig.breaker.force_open("a")
    rig.clock.advance(10.0)
    await rig.breaker.force_open("b")
    with pytest.raises(CircuitOpenError) as info:
        await rig.call()
    error = info.value
    assert error.reason == "circuit_open"
    assert error.retry_after_s == pytest.approx(20.0)  # a reopens first
    assert error.per_source_reasons == {"a": "circuit_open", "b": "circuit_open"}
    assert rig.transport.count() == 0


async def test_open_breaker_is_memoised_and_not_asked_again_until_its_reopening() -> None:
    clock = FakeClock()
    inner = InMemoryGate(fail_threshold=1, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock)

    gate = FaultyBreaker(inner)
    rig = make_rig(["a", "b"], breaker=gate, clock=clock)
    await inner.force_open("a")
    for _ in range(4):
        assert (await rig.call()).source_name == "b"
    assert gate.entered.count("a") == 1  # refused once, then skipped from the memo


async def test_wait_mode_waits_for_the_earliest_reopening() -> None:
    rig = make_rig(["a"])
    await rig.breaker.force_open("a")
    response = await rig.call()
    assert response.source_name == "a"
    waited = rig.clock.monotonic() - 1000.0
    assert 30.0 <= waited <= 30.0 + 0.5  # reopening + jitter of at most one poll interval


# --------------------------------------------------------------------------- limiter denials


async def test_quota_full_fail_fast_raises_quota_exhausted() -> None:
    clock = FakeClock()
    limiter = InMemoryLimiter(global_limits=Limits(rpm=1), lease_ttl_s=60.0, clock=clock)
    rig = make_rig(
        ["a", "b"],
        limiter=limiter,
        clock=clock,
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    await rig.call()
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    error = info.value
    assert error.reason == "quota_exhausted"
    assert 0.0 < error.retry_after_s <= 60.0  # until the minute window rolls
    assert rig.transport.count() == 1


async def test_source_gate_denial_moves_to_another_source() -> None:
    sources = [source("a", limits=Limits(max_concurrency=1)), source("b")]
    rig = make_rig(sources=sources, selector=RoundRobinSelector())
    held = await rig.limiter.try_acquire("a", 1, Limits(max_concurrency=1))
    assert not isinstance(held, Denial)
    for _ in range(3):
        assert (await rig.call()).source_name == "b"
    await held.release()


async def test_quota_wait_polls_with_jitter_until_admitted() -> None:
    clock = FakeClock()
    limiter = ScriptedLimiter(clock, admit_after=1003.0, wait_s=10.0, progress_age=lambda now: 0.0)
    rig = make_rig(["a"], limiter=limiter, clock=clock)
    await rig.call()
    # each poll sleeps min(10, 0.5) * uniform(0.5, 1.5): several polls, no wait past 0.75 s
    assert 1003.0 <= clock.monotonic() <= 1003.75
    assert limiter.acquire_calls >= 5
    assert limiter.progress_age_calls == []  # the stall check needs local wait > window first


async def test_probe_is_handed_back_when_the_limiter_refuses() -> None:
    clock = FakeClock()
    breaker = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    limiter = ScriptedLimiter(clock, gate="source_rpm")
    rig = make_rig(
        ["a"],
        breaker=breaker,
        limiter=limiter,
        clock=clock,
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    await breaker.force_open("a")
    clock.advance(5.0)
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.reason == "quota_exhausted"
    assert info.value.per_source_reasons == {"a": "rate_limited"}
    assert (await breaker.try_enter("a")).is_probe


# --------------------------------------------------------------------------- stall verdict (M2 §4)

WINDOW = 60.0


def stall_rig(*, admit_after: float, progress_age: float) -> tuple[object, ScriptedLimiter]:
    clock = FakeClock()
    limiter = ScriptedLimiter(
        clock, admit_after=admit_after, wait_s=5.0, progress_age=lambda now: progress_age
    )
    rig = make_rig(
        ["a"],
        limiter=limiter,
        clock=clock,
        backpressure=BackpressureSettings(stall_window_s=WINDOW, poll_interval_s=2.0),
    )
    return rig, limiter


async def test_stall_both_past_the_window_is_stalled() -> None:
    rig, limiter = stall_rig(admit_after=math.inf, progress_age=math.inf)
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()  # type: ignore[attr-defined]
    assert info.value.reason == "stalled"
    waited = limiter.clock.monotonic() - 1000.0
    assert WINDOW < waited <= WINDOW + 3.0  # one jittered poll past the window at most
    assert info.value.per_source_reasons == {"a": "rate_limited"}


async def test_stall_local_wait_past_window_with_recent_progress_keeps_waiting() -> None:
    rig, limiter = stall_rig(admit_after=1000.0 + 3 * WINDOW, progress_age=1.0)
    response = await rig.call()  # type: ignore[attr-defined]
    assert response.source_name == "a"
    assert limiter.clock.monotonic() >= 1000.0 + 3 * WINDOW
    assert limiter.progress_age_calls  # it did ask, and was told progress is recent


async def test_stall_old_progress_but_short_local_wait_keeps_waiting() -> None:
    rig, limiter = stall_rig(admit_after=1000.0 + WINDOW / 2, progress_age=math.inf)
    response = await rig.call()  # type: ignore[attr-defined]
    assert response.source_name == "a"
    assert limiter.progress_age_calls == []


async def test_stall_neither_condition_keeps_waiting() -> None:
    rig, limiter = stall_rig(admit_after=1000.0 + WINDOW / 2, progress_age=0.0)
    response = await rig.call()  # type: ignore[attr-defined]
    assert response.source_name == "a"
    assert limiter.progress_age_calls == []


async def test_fail_fast_never_waits_for_the_stall_window() -> None:
    clock = FakeClock()
    limiter = ScriptedLimiter(clock)
    rig = make_rig(
        ["a"],
        limiter=limiter,
        clock=clock,
        backpressure=BackpressureSettings(quota_full="fail_fast"),
    )
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.reason == "quota_exhausted"
    assert clock.monotonic() == 1000.0 and limiter.progress_age_calls == []


# --------------------------------------------------------------------------- cancellation


async def test_cancel_during_send_releases_permit_and_probe_and_is_observed() -> None:
    clock = FakeClock()
    breaker = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    rig = make_rig(["a"], breaker=breaker, clock=clock)
    await breaker.force_open("a")
    clock.advance(5.0)
    entered = asyncio.Event()

    async def hang() -> object:
        entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    rig.transport.script("a", hang)
    task = asyncio.create_task(rig.call())
    await entered.wait()
    assert await rig.limiter.inflight() == 1
    assert rig.layer.governor.inflight["a"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await rig.limiter.inflight() == 0
    assert rig.layer.governor.inflight["a"] == 0
    assert (await breaker.try_enter("a")).is_probe  # probe handed back: next caller probes
    assert isinstance(rig.observer.attempts[0][2], asyncio.CancelledError)


async def test_cancel_during_backoff_propagates() -> None:
    sleeping = asyncio.Event()
    rig = make_rig(["a"], clock=_BlockingSleepClock(sleeping))
    rig.transport.script("a", transient())
    task = asyncio.create_task(rig.call())
    await sleeping.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await rig.limiter.inflight() == 0
    assert rig.transport.count() == 1


class _BlockingSleepClock(FakeClock):
    __slots__ = ("_event",)

    def __init__(self, event: asyncio.Event) -> None:
        super().__init__()
        self._event = event

    async def sleep(self, seconds: float) -> None:
        self._event.set()
        await asyncio.Event().wait()


# --------------------------------------------------------------------------- degradation (M2 §10)


async def test_admission_side_limiter_failure_fails_closed_and_hands_back_the_probe() -> None:
    clock = FakeClock()
    breaker = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    limiter = FaultyLimiter(
        InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock), admission=True
    )
    rig = make_rig(["a"], breaker=breaker, limiter=limiter, clock=clock)
    await breaker.force_open("a")
    clock.advance(5.0)
    with pytest.raises(GovernanceBackendError):
        await rig.call()
    assert rig.transport.count() == 0
    assert (await breaker.try_enter("a")).is_probe


async def test_admission_side_breaker_failure_fails_closed() -> None:
    clock = FakeClock()
    inner = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    rig = make_rig(["a"], breaker=FaultyBreaker(inner, admission=True), clock=clock)
    with pytest.raises(GovernanceBackendError):
        await rig.call()
    assert rig.transport.count() == 0


async def test_accounting_side_failures_only_warn(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    real = InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock)
    gate = InMemoryGate(fail_threshold=5, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    rig = make_rig(
        ["a", "b"],
        limiter=FaultyLimiter(real, accounting=True),
        breaker=FaultyBreaker(gate, accounting=True),
        clock=clock,
        retry=RetrySettings(same_source_attempts=0),
    )
    rig.transport.script("a", transient())
    with caplog.at_level(logging.WARNING, logger="polygateway.governance.admission"):
        response = await rig.call()
        await rig.call()
    assert response.source_name == "b"
    assert await real.inflight() == 0  # the release reached the limiter before failing
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for operation in (
        "permit.settle",
        "permit.release",
        "breaker.record_failure",
        "breaker.record_success",
        "limiter.mark_progress",
    ):
        assert sum(m.startswith(operation) for m in warned) == 1, operation  # once per cause


async def test_accounting_failure_never_masks_the_attempt_error() -> None:
    clock = FakeClock()
    gate = InMemoryGate(fail_threshold=5, cooldown_s=5.0, probe_ttl_s=60.0, clock=clock)
    rig = make_rig(["a"], breaker=FaultyBreaker(gate, accounting=True), clock=clock)
    rig.transport.script("a", RequestRejectedError("400", status=400))
    with pytest.raises(RequestRejectedError):
        await rig.call()


async def test_a_failing_observer_does_not_break_the_call() -> None:
    rig = make_rig(["a"])

    class Broken:
        def on_attempt(self, *args: object) -> None:
            raise RuntimeError("telemetry bug")

    rig.observer = Broken()  # type: ignore[assignment]
    assert (await rig.call()).content == "fine"


# --------------------------------------------------------------------------- construction


def test_construction_refuses_missing_transports_and_bad_attempts() -> None:
    clock = FakeClock()
    with pytest.raises(ConfigError) as info:
        ChatDispatcher.create(
            sources=[source("a"), source("a")],
            transports={},
            limiter=InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock),
            breaker=InMemoryGate(fail_threshold=1, cooldown_s=1.0, probe_ttl_s=5.0, clock=clock),
            selector=RoundRobinSelector(),
            retry=RetrySettings(max_attempts=0),
            breaker_settings=BreakerSettings(),
            backpressure=BackpressureSettings(),
            clock=clock,
        )
    text = str(info.value)
    assert "unique" in text and "no transport" in text and "max_attempts" in text


async def test_no_sources_is_reported_as_such() -> None:
    rig = make_rig([])
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.call()
    assert info.value.reason == "no_sources"


# --------------------------------------------------------------------------- selectors


def test_round_robin_rotates() -> None:
    selector = RoundRobinSelector()
    sources = [source("a"), source("b"), source("c")]
    picks = [selector.choose(sources, {}).name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_inflight_prefers_the_idlest_and_rotates_ties() -> None:
    selector = LeastInflightSelector()
    sources = [source("a"), source("b"), source("c")]
    assert selector.choose(sources, {"a": 2, "b": 0, "c": 1}).name == "b"
    ties = {selector.choose(sources, {"a": 0, "b": 0, "c": 0}).name for _ in range(3)}
    assert ties == {"a", "b", "c"}


async def test_least_inflight_spreads_concurrent_calls() -> None:
    rig = make_rig(["a", "b"], selector=LeastInflightSelector())
    gate = asyncio.Event()

    async def slow() -> object:
        await gate.wait()
        return ok()

    rig.transport.script("a", slow, slow)
    rig.transport.script("b", slow, slow)
    tasks = [asyncio.create_task(rig.call()) for _ in range(4)]
    await wait_until(lambda: rig.transport.count() == 4)
    assert rig.layer.governor.inflight == {"a": 2, "b": 2}
    gate.set()
    await asyncio.gather(*tasks)
    assert rig.layer.governor.inflight == {"a": 0, "b": 0}


def test_messages_constant_is_valid() -> None:
    check_message_fields(MESSAGES)


async def test_a_refusal_during_a_probe_does_not_shut_the_source_after_it_recovers() -> None:
    clock = FakeClock()
    breaker = InMemoryGate(fail_threshold=1, cooldown_s=5.0, probe_ttl_s=240.0, clock=clock)
    rig = make_rig(
        ["a"],
        breaker=breaker,
        clock=clock,
        backpressure=BackpressureSettings(quota_full="fail_fast", poll_interval_s=0.5),
    )
    await breaker.force_open("a")
    clock.advance(5.0)  # half-open: the next call becomes the probe
    gate = asyncio.Event()

    async def slow_probe() -> Any:
        await gate.wait()
        return ok()

    rig.transport.script("a", slow_probe)
    probe = asyncio.create_task(rig.call())
    async with asyncio.timeout(5):
        while rig.transport.count("a") == 0:
            await asyncio.sleep(0)
    with pytest.raises(CircuitOpenError) as refused:  # someone else holds the probe
        await rig.call()
    assert refused.value.retry_after_s <= 0.5  # look again soon, not after the 240 s lease
    gate.set()
    await probe
    assert await breaker.state("a") == "closed"
    await rig.call()  # the recovered source takes calls at once: no stale local memo
    assert rig.transport.count("a") == 2


async def test_every_field_of_the_transport_result_reaches_its_own_response_field() -> None:
    # The dispatcher builds the response by position: every field gets a value of its own
    # here, so a swap of two (even of one type) shows.
    from polygateway.types import ToolCall, TransportResult

    calls = (ToolCall("id-1", "lookup", "{}"),)
    rig = make_rig(["a"])
    rig.transport.script(
        "a",
        TransportResult(
            content="the content",
            thinking="the thinking",
            model="the model",
            prompt_tokens=3,
            completion_tokens=5,
            usage_source="estimated",
            latency_ms=7,
            ttft_ms=1.5,
            max_inter_token_ms=2.5,
            finish_reason="length",
            salvaged=True,
            cached_prompt_tokens=11,
            cache_write_tokens=13,
            tool_calls=calls,
        ),
    )
    response = await rig.call()
    assert vars(response) == {
        "content": "the content",
        "thinking": "the thinking",
        "model": "the model",
        "provider": "openai",
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "latency_ms": 7,
        "ttft_ms": 1.5,
        "max_inter_token_ms": 2.5,
        "cache_hit": False,
        "call_id": rig.transport.calls[0][1],
        "source_name": "a",
        "cost": None,
        "usage_source": "estimated",
        "structured_data": None,
        "finish_reason": "length",
        "salvaged": True,
        "cached_prompt_tokens": 11,
        "cache_write_tokens": 13,
        "tool_calls": calls,
    }
