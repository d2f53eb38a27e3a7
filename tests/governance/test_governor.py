"""The governor on its own: a call kind that is not chat, real memory backends, a fake clock.

The chat-specific decisions (through the dispatcher) are in ``tests/client``; these check
what the generic API promises a new call kind: the value comes back untouched, the TPM charge
follows ``est_tokens`` and ``Attempted.tokens``, the observer sees every attempt, the outcome
says who answered after how many attempts.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import pytest
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.errors import (
    ConfigError,
    RequestRejectedError,
    ResultInvalidError,
    SourceDeadError,
    TransientError,
)
from polygateway.governance import Attempted, AttemptObserver, Governor, governor_problems
from polygateway.selectors import RoundRobinSelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    SourceConfig,
)
from polygateway.testing import FakeClock


def source(name: str, est_tokens: int = 50) -> SourceConfig:
    return SourceConfig(
        name=name,
        provider="ocr-vendor",
        base_url=f"http://unused.invalid/{name}",
        model="ocr-model",
        timeout_s=10.0,
        est_tokens=est_tokens,
    )


class Kind:
    """A call kind whose attempts follow a script per source (a value or an error)."""

    def __init__(self, clock: FakeClock, names: tuple[str, ...] = ("a", "b")) -> None:
        self.clock = clock
        self.sources = [source(name) for name in names]
        self.limiter = InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock)
        self.breaker = InMemoryGate(
            fail_threshold=1, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock
        )
        self.governor = Governor(
            sources=self.sources,
            limiter=self.limiter,
            breaker=self.breaker,
            selector=RoundRobinSelector(),
            retry=RetrySettings(max_attempts=3, base_delay_s=1.0, max_delay_s=5.0),
            breaker_settings=BreakerSettings(fail_threshold=1, cooldown_s=30.0),
            backpressure=BackpressureSettings(quota_full="fail_fast"),
            clock=clock,
        )
        self.script: dict[str, deque[Any]] = {name: deque() for name in names}
        self.sent: list[tuple[str, str]] = []

    async def attempt(self, src: SourceConfig, call_id: str) -> Attempted[dict[str, Any]]:
        self.sent.append((src.name, call_id))
        step = self.script[src.name].popleft() if self.script[src.name] else None
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, Attempted):
            return step
        return Attempted({"text": f"page from {src.name}"}, tokens=7)


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def on_attempt(self, source: SourceConfig, call_id: str, outcome: Any, latency_ms: int) -> None:
        self.seen.append((source.name, call_id, outcome))


@pytest.fixture
def kind() -> Kind:
    return Kind(FakeClock())


async def test_the_value_comes_back_as_the_kind_made_it(kind: Kind) -> None:
    observer = Observer()
    assert isinstance(observer, AttemptObserver)
    outcome = await kind.governor.run(kind.attempt, observer=observer)
    assert outcome.value == {"text": "page from a"}
    assert (outcome.source.name, outcome.attempts) == ("a", 1)
    assert kind.sent == [("a", outcome.call_id)]
    assert observer.seen == [("a", outcome.call_id, outcome.value)]
    assert await kind.limiter.inflight() == 0


async def test_run_hands_back_the_attempt_loop_itself(kind: Kind) -> None:
    # No coroutine of its own around the loop (one level less on every call); with a
    # deadline, the loop under it. A bad deadline is refused when run is called.
    plain = kind.governor.run(kind.attempt)
    assert plain.cr_code.co_qualname == "Governor._run"
    assert (await plain).value == {"text": "page from a"}
    timed = kind.governor.run(kind.attempt, deadline_s=5.0)
    assert timed.cr_code.co_qualname == "Governor._run_until"
    assert (await timed).value == {"text": "page from b"}
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="deadline_s"):
            kind.governor.run(kind.attempt, deadline_s=bad)
    assert await kind.limiter.inflight() == 0


async def test_tpm_is_charged_the_estimate_and_settled_on_measured_tokens(kind: Kind) -> None:
    await kind.governor.run(kind.attempt, est_tokens=500)  # measured 7 replaces 500
    assert (await kind.limiter.source_stats("a")).tpm_used == 7
    kind.script["b"].append(Attempted({"text": "no usage"}))  # tokens=None keeps the estimate
    await kind.governor.run(kind.attempt, est_tokens=500)
    assert (await kind.limiter.source_stats("b")).tpm_used == 500
    kind.script["a"].append(Attempted({"text": "no usage"}))
    await kind.governor.run(kind.attempt)  # None: the source's configured est_tokens (50)
    assert (await kind.limiter.source_stats("a")).tpm_used == 7 + 50


async def test_each_attempt_has_its_own_call_id_and_the_observer_sees_them_all(
    kind: Kind,
) -> None:
    failure = TransientError("busy", status=503)
    kind.script["a"].append(failure)
    observer = Observer()
    outcome = await kind.governor.run(kind.attempt, observer=observer)
    assert (outcome.source.name, outcome.attempts) == ("b", 2)
    assert [(name, result) for name, _, result in observer.seen] == [
        ("a", failure),
        ("b", outcome.value),
    ]
    ids = [call_id for _, call_id, _ in observer.seen]
    assert len(set(ids)) == 2 and ids[1] == outcome.call_id
    assert await kind.breaker.state("a") == "open"  # threshold 1


async def test_a_dead_source_is_switched_at_once(kind: Kind) -> None:
    kind.script["a"].append(SourceDeadError("revoked", status=401))
    started = kind.clock.monotonic()
    outcome = await kind.governor.run(kind.attempt)
    assert outcome.source.name == "b" and kind.clock.monotonic() == started
    assert kind.governor.cooldowns.cooling(["a"])["a"][1] == "source_dead"


async def test_a_rejected_request_is_raised_at_once_and_not_counted(kind: Kind) -> None:
    kind.script["a"].append(RequestRejectedError("bad image", status=400))
    with pytest.raises(RequestRejectedError):
        await kind.governor.run(kind.attempt)
    assert len(kind.sent) == 1 and await kind.breaker.state("a") == "closed"


async def test_an_invalid_result_is_raised_and_counts_as_a_success(kind: Kind) -> None:
    await kind.breaker.force_open("a")
    kind.clock.advance(30.0)  # half-open: the next attempt on "a" is the probe
    kind.script["a"].append(ResultInvalidError("unreadable page"))
    with pytest.raises(ResultInvalidError):
        await kind.governor.run(kind.attempt)
    assert await kind.breaker.state("a") == "closed"  # the probe's verdict: the service works


async def test_a_failing_observer_is_logged_once_and_ignored(
    kind: Kind, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        def on_attempt(self, *args: object) -> None:
            raise RuntimeError("observer bug")

    with caplog.at_level(logging.WARNING, logger="polygateway.governance.admission"):
        for _ in range(3):
            assert (await kind.governor.run(kind.attempt, observer=Broken())).value
    warned = [r for r in caplog.records if "attempt observer" in r.getMessage()]
    assert len(warned) == 1


def test_every_settings_problem_is_reported_at_once() -> None:
    problems = governor_problems(
        [source("a"), source("a")],
        RetrySettings(max_attempts=0, base_delay_s=-1.0),
        BackpressureSettings(poll_interval_s=0.0, stall_window_s=-1.0),
    )
    text = "\n".join(problems)
    for fragment in ("unique", "max_attempts", "base_delay_s", "poll_interval_s", "stall_window"):
        assert fragment in text
    clock = FakeClock()
    with pytest.raises(ConfigError) as info:
        Governor(
            sources=[source("a"), source("a")],
            limiter=InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=clock),
            breaker=InMemoryGate(fail_threshold=1, cooldown_s=1.0, probe_ttl_s=5.0, clock=clock),
            selector=RoundRobinSelector(),
            retry=RetrySettings(max_attempts=0),
            breaker_settings=BreakerSettings(),
            backpressure=BackpressureSettings(),
            clock=clock,
        )
    assert "unique" in str(info.value) and "max_attempts" in str(info.value)
