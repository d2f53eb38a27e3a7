"""Properties of the governor's budget: whatever the faults, a call makes at most
``max_attempts`` attempts and ends by its deadline (plus 0.25 s); on real time against the
governor alone, and end to end through the fake upstream on virtual time."""

from __future__ import annotations

import asyncio
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polygateway import GatewayClient
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.errors import (
    AllSourcesExhausted,
    ScopeUnavailableError,
    SourceDeadError,
    TransientError,
)
from polygateway.governance import Attempted, Governor
from polygateway.selectors import PrioritySelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    SourceConfig,
)
from polygateway.testing import FakeUpstream, Reply
from virtual_time import LoopClock, VirtualTimeLoop

FAULTS = st.sampled_from(["ok", "503", "429", "429-short", "429-long", "reset", "dead", "slow"])


def _source(name: str) -> SourceConfig:
    return SourceConfig(
        name=name, provider="p", base_url=f"http://unused.invalid/{name}", model="m"
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    faults=st.lists(FAULTS, min_size=1, max_size=12),
    max_attempts=st.integers(min_value=1, max_value=6),
    same=st.integers(min_value=0, max_value=2),
    deadline_s=st.floats(min_value=0.05, max_value=0.6),
    base_delay_s=st.floats(min_value=0.0, max_value=0.2),
)
def test_attempts_within_budget_and_time_within_deadline(
    faults: list[str], max_attempts: int, same: int, deadline_s: float, base_delay_s: float
) -> None:
    asyncio.run(_one_call(faults, max_attempts, same, deadline_s, base_delay_s))


async def _one_call(
    faults: list[str], max_attempts: int, same: int, deadline_s: float, base_delay_s: float
) -> None:
    clock = SystemClock()
    governor = Governor(
        sources=[_source("primary"), _source("fallback")],
        limiter=InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock),
        breaker=InMemoryGate(fail_threshold=3, cooldown_s=0.2, probe_ttl_s=5.0, clock=clock),
        selector=PrioritySelector(),
        retry=RetrySettings(
            max_attempts=max_attempts,
            base_delay_s=base_delay_s,
            max_delay_s=max(base_delay_s, 0.3),
            same_source_attempts=same,
            wait_retry_after_up_to_s=0.2,
        ),
        breaker_settings=BreakerSettings(fail_threshold=3, cooldown_s=0.2),
        backpressure=BackpressureSettings(poll_interval_s=0.05, stall_window_s=5.0),
        clock=clock,
    )
    script = list(faults)
    made = 0

    async def attempt(source: SourceConfig, call_id: str) -> Attempted[str]:
        nonlocal made
        made += 1
        fault = script.pop(0) if script else "ok"
        if fault == "ok":
            return Attempted("fine", tokens=1)
        if fault == "slow":
            await asyncio.sleep(10.0)  # only the deadline ends this one
            return Attempted("late", tokens=1)
        if fault == "dead":
            raise SourceDeadError("401")
        if fault == "reset":
            raise TransientError("reset")
        hint = {"429": None, "429-short": 0.1, "429-long": 30.0}.get(fault)
        if fault.startswith("429"):
            raise TransientError("429", status=429, retry_after_s=hint, reason="rate_limited")
        raise TransientError("503", status=503)

    started = time.monotonic()
    try:
        await governor.run(attempt, deadline_s=deadline_s)
    except AllSourcesExhausted as exc:
        assert exc.reason in ("retry_exhausted", "stalled")
    elapsed = time.monotonic() - started
    assert made <= max_attempts
    assert elapsed <= deadline_s + 0.25


# The same property end to end: a two-source priority client with default timeouts, through
# the fake upstream, on an event loop on virtual time (silent upstreams, Retry-After waits and
# backoff cost no real time). The attempts are counted from the upstream's own log.

HTTP_FAULTS = st.sampled_from(
    [
        "ok",
        "503",
        "429",
        "429-short",
        "429-long",
        "reset",
        "dead",
        "no-response",
        "slow-first-token",
        "stall",
        "cut",
    ]
)


def _reply(fault: str) -> Reply:
    return {
        "ok": Reply.ok("fine"),
        "503": Reply.error(503),
        "429": Reply.error(429),
        "429-short": Reply.error(429, retry_after=2),
        "429-long": Reply.error(429, retry_after=40),
        "reset": Reply.reset(),
        "dead": Reply.error(401),
        "no-response": Reply.black_hole(),
        "slow-first-token": Reply.ok("late", first_token_delay=45.0),
        "stall": Reply.stall(after_chunks=2),
        "cut": Reply.cut(after_chunks=2),
    }[fault]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    primary=st.lists(HTTP_FAULTS, min_size=1, max_size=6),
    fallback=st.lists(HTTP_FAULTS, min_size=0, max_size=6),
    max_attempts=st.integers(min_value=1, max_value=6),
    deadline_s=st.floats(min_value=0.5, max_value=90.0),
)
def test_through_the_fake_upstream_attempts_within_budget_and_time_within_deadline(
    primary: list[str], fallback: list[str], max_attempts: int, deadline_s: float
) -> None:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        made, elapsed = runner.run(_one_http_call(primary, fallback, max_attempts, deadline_s))
    assert made <= max_attempts
    assert elapsed <= deadline_s + 0.25


async def _one_http_call(
    primary: list[str], fallback: list[str], max_attempts: int, deadline_s: float
) -> tuple[int, float]:
    clock = LoopClock()
    async with FakeUpstream(clock=clock) as fake:
        fake.script("primary", *(_reply(f) for f in primary))
        if fallback:
            fake.script("fallback", *(_reply(f) for f in fallback))
        env = {
            "LLM__SELECTOR": "priority",
            "LLM__RETRY__MAX_ATTEMPTS": str(max_attempts),
            "LLM__OPENAI__1__BASE_URL": fake.base_url("primary"),
            "LLM__OPENAI__1__MODEL": "primary-model",
            "LLM__OPENAI__2__BASE_URL": fake.base_url("fallback"),
            "LLM__OPENAI__2__MODEL": "fallback-model",
            "PGW_TELEMETRY_BACKEND": "none",
            "PGW_CACHE_BACKEND": "none",
            "PGW_PLUGINS": "",
        }
        async with GatewayClient.from_env(env=env, pipeline_path=None, clock=clock) as client:
            started = clock.monotonic()
            try:
                await client.chat([{"role": "user", "content": "hi"}], deadline_s=deadline_s)
            except ScopeUnavailableError as exc:
                assert exc.reason in ("retry_exhausted", "stalled", "source_dead", "circuit_open")
            elapsed = clock.monotonic() - started
        return fake.requests(), elapsed
