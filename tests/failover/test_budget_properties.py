"""Properties of the governor's budget on real time: whatever the faults, a call makes at most
``max_attempts`` attempts and ends by its deadline (plus 0.25 s)."""

from __future__ import annotations

import asyncio
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.errors import AllSourcesExhausted, SourceDeadError, TransientError
from polygateway.governance import Attempted, Governor
from polygateway.selectors import PrioritySelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    SourceConfig,
)

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
