"""Property tests: the in-memory limiter and breaker against plain reference models.

Random sequences of operations and clock moves run against both the implementation and a
model written as directly as the rules read (sums over every permit ever granted, one dict
per source); after every step the observable results must agree.

The memory backends never suspend: each coroutine is driven by a single ``send(None)``,
which also checks that no ``await`` sits between checking a gate and taking it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.ports import Denial, GateDecision, GateUpdate, Permit, SourceStats
from polygateway.settings import Limits
from polygateway.testing.clock import FakeClock

T = TypeVar("T")
SOURCES = ("a", "b", "c:{d}")
WINDOW_S = 60.0
STEPS = settings(max_examples=100, stateful_step_count=30, deadline=None)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that must finish without suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("a memory backend operation suspended")


# --------------------------------------------------------------------------- limiter


@dataclass
class ModelPermit:
    source: str
    est: int
    window: int
    expires_at: float
    charged: int
    settled: bool = False
    released: bool = False


class LimiterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(start=1000.0)
        self.permits: list[tuple[Permit, ModelPermit]] = []
        self.progress_at: float | None = None
        # How long released leases were held (moving average, newest weighted 0.2): the
        # concurrency gates' wait hint, globally and per source.
        self.hold: dict[str | None, float] = {}

    @initialize(
        global_limits=st.builds(
            Limits,
            max_concurrency=st.integers(0, 4),
            rpm=st.integers(0, 8),
            tpm=st.integers(0, 150),
        ),
        source_limits=st.fixed_dictionaries(
            {
                s: st.builds(
                    Limits,
                    max_concurrency=st.integers(0, 3),
                    rpm=st.integers(0, 5),
                    tpm=st.integers(0, 100),
                )
                for s in SOURCES
            }
        ),
        lease_ttl_s=st.sampled_from([5.0, 30.0, 90.0]),
    )
    def setup(
        self, global_limits: Limits, source_limits: dict[str, Limits], lease_ttl_s: float
    ) -> None:
        self.global_limits = global_limits
        self.source_limits = source_limits
        self.lease_ttl_s = lease_ttl_s
        self.limiter = InMemoryLimiter(
            global_limits=global_limits, lease_ttl_s=lease_ttl_s, clock=self.clock
        )

    # ---------------------------------------------------------------- model

    def live(self, source: str | None = None) -> list[ModelPermit]:
        now = self.clock.monotonic()
        return [
            m
            for _, m in self.permits
            if not m.released and now < m.expires_at and source in (None, m.source)
        ]

    def used(self, source: str | None, window: int) -> tuple[int, int]:
        mine = [m for _, m in self.permits if m.window == window and source in (None, m.source)]
        return len(mine), sum(m.charged for m in mine)

    def slot_wait(self, live: list[ModelPermit], key: str | None, now: float) -> float:
        """Until the oldest lease expires, at most the typical hold (1 s before any release,
        at least 10 ms)."""
        hold = self.hold.get(key)
        estimate = 1.0 if hold is None else max(0.01, hold)
        return min(min(m.expires_at for m in live) - now, estimate)

    def expected(self, source: str, est: int) -> Denial | None:
        now, wall = self.clock.monotonic(), self.clock.time()
        window = math.floor(wall / WINDOW_S)
        window_wait = (window + 1) * WINDOW_S - wall
        g, s = self.global_limits, self.source_limits[source]
        live_all, live_source = self.live(), self.live(source)
        if g.max_concurrency and len(live_all) >= g.max_concurrency:
            return Denial("global_concurrency", self.slot_wait(live_all, None, now))
        if s.max_concurrency and len(live_source) >= s.max_concurrency:
            return Denial("source_concurrency", self.slot_wait(live_source, source, now))
        g_requests, g_tokens = self.used(None, window)
        s_requests, s_tokens = self.used(source, window)
        if g.rpm and g_requests >= g.rpm:
            return Denial("global_rpm", window_wait)
        if s.rpm and s_requests >= s.rpm:
            return Denial("source_rpm", window_wait)
        if g.tpm and g_tokens + est > g.tpm:
            return Denial("global_tpm", window_wait)
        if s.tpm and s_tokens + est > s.tpm:
            return Denial("source_tpm", window_wait)
        return None

    # ---------------------------------------------------------------- rules

    @rule(source=st.sampled_from(SOURCES), est=st.integers(0, 60))
    def acquire(self, source: str, est: int) -> None:
        expected = self.expected(source, est)
        result = run(self.limiter.try_acquire(source, est, self.source_limits[source]))
        if expected is None:
            assert not isinstance(result, Denial), result
            assert (result.source, result.est_tokens) == (source, est)
            window = math.floor(self.clock.time() / WINDOW_S)
            model = ModelPermit(
                source, est, window, self.clock.monotonic() + self.lease_ttl_s, charged=est
            )
            self.permits.append((result, model))
        else:
            assert isinstance(result, Denial), f"expected {expected}, got {result}"
            assert result.gate == expected.gate
            assert result.wait_s == pytest.approx(expected.wait_s, abs=1e-6)
            assert result.wait_s > 0.0

    @precondition(lambda self: self.permits)
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        permit, model = self.permits[pick % len(self.permits)]
        run(permit.release())
        now = self.clock.monotonic()
        if not model.released and now < model.expires_at:
            held = now - (model.expires_at - self.lease_ttl_s)
            for key in (None, model.source):
                before = self.hold.get(key)
                self.hold[key] = held if before is None else before + 0.2 * (held - before)
        model.released = True

    @precondition(lambda self: self.permits)
    @rule(pick=st.integers(0, 10**6), actual=st.integers(0, 120))
    def settle(self, pick: int, actual: int) -> None:
        permit, model = self.permits[pick % len(self.permits)]
        run(permit.settle(actual))
        if not model.settled:
            model.settled = True
            model.charged = actual

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 4.999, 7.0, 19.9, 30.0, 59.9, 60.0, 61.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def mark_progress(self) -> None:
        run(self.limiter.mark_progress())
        self.progress_at = self.clock.monotonic()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def inflight_matches(self) -> None:
        if hasattr(self, "limiter"):
            assert run(self.limiter.inflight()) == len(self.live())

    @invariant()
    def stats_match(self) -> None:
        if not hasattr(self, "limiter"):
            return
        window = math.floor(self.clock.time() / WINDOW_S)
        for source in SOURCES:
            requests, tokens = self.used(source, window)
            expected = SourceStats(len(self.live(source)), requests, max(0, tokens))
            assert run(self.limiter.source_stats(source)) == expected

    @invariant()
    def progress_matches(self) -> None:
        if not hasattr(self, "limiter"):
            return
        age = run(self.limiter.progress_age_s())
        if self.progress_at is None:
            assert age == math.inf
        else:
            assert age == pytest.approx(self.clock.monotonic() - self.progress_at)
            assert age >= 0.0


TestLimiterAgainstModel = LimiterMachine.TestCase
TestLimiterAgainstModel.settings = STEPS


# --------------------------------------------------------------------------- breaker


@dataclass
class ModelGate:
    state: str = "closed"
    epoch: int = 0
    failures: int = 0
    open_until: float = 0.0
    probe_until: float = 0.0
    probe_owner: str | None = None


class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(start=1000.0)
        self.decisions: list[GateDecision] = []
        self.model = {s: ModelGate() for s in SOURCES}
        self.epochs_seen = {s: 0 for s in SOURCES}

    @initialize(
        fail_threshold=st.integers(1, 4),
        cooldown_s=st.sampled_from([0.0, 5.0, 30.0]),
        probe_ttl_s=st.sampled_from([1.0, 10.0, 60.0]),
    )
    def setup(self, fail_threshold: int, cooldown_s: float, probe_ttl_s: float) -> None:
        self.threshold = fail_threshold
        self.cooldown_s = cooldown_s
        self.probe_ttl_s = probe_ttl_s
        self.gate = InMemoryGate(
            fail_threshold=fail_threshold,
            cooldown_s=cooldown_s,
            probe_ttl_s=probe_ttl_s,
            clock=self.clock,
        )

    # ---------------------------------------------------------------- model

    def holds(self, m: ModelGate, d: GateDecision) -> bool:
        if d.probe_owner is not None:
            return m.state == "half_open" and m.epoch == d.epoch and m.probe_owner == d.probe_owner
        return m.state == "closed" and m.epoch == d.epoch

    def open(self, m: ModelGate, failures: int) -> None:
        m.state, m.epoch, m.failures = "open", m.epoch + 1, failures
        m.open_until = self.clock.monotonic() + self.cooldown_s
        m.probe_owner, m.probe_until = None, 0.0

    def update(self, source: str, applied: bool) -> GateUpdate:
        m = self.model[source]
        return GateUpdate(source, applied, m.state, m.epoch, m.failures)  # type: ignore[arg-type]

    def check(self, got: GateUpdate, source: str, applied: bool) -> None:
        assert got == self.update(source, applied)

    # ---------------------------------------------------------------- rules

    @rule(source=st.sampled_from(SOURCES))
    def try_enter(self, source: str) -> None:
        m, now = self.model[source], self.clock.monotonic()
        d = run(self.gate.try_enter(source))
        assert (d.source, d.epoch) == (source, m.epoch)
        if m.state == "closed":
            assert (d.allowed, d.state, d.probe_owner) == (True, "closed", None)
        elif m.state == "open" and now < m.open_until:
            assert (d.allowed, d.state, d.probe_owner) == (False, "open", None)
            assert d.retry_after_s == pytest.approx(m.open_until - now)
        elif m.state == "half_open" and m.probe_owner is not None and now < m.probe_until:
            assert (d.allowed, d.state, d.probe_owner) == (False, "half_open", None)
            assert d.retry_after_s == pytest.approx(m.probe_until - now)
        else:
            assert (d.allowed, d.state) == (True, "half_open")
            assert d.probe_owner is not None and d.probe_owner != m.probe_owner
            m.state, m.probe_owner = "half_open", d.probe_owner
            m.probe_until = now + self.probe_ttl_s
        if d.allowed:
            self.decisions.append(d)

    @precondition(lambda self: self.decisions)
    @rule(pick=st.integers(0, 10**6))
    def record_success(self, pick: int) -> None:
        d = self.decisions[pick % len(self.decisions)]
        m = self.model[d.source]
        applied = self.holds(m, d)
        got = run(self.gate.record_success(d))
        if applied:
            if d.probe_owner is not None:
                m.state, m.probe_owner, m.probe_until = "closed", None, 0.0
            m.failures = 0
        self.check(got, d.source, applied)

    @precondition(lambda self: self.decisions)
    @rule(
        pick=st.integers(0, 10**6),
        force_open=st.booleans(),
        threshold=st.none() | st.integers(1, 6),
    )
    def record_failure(self, pick: int, force_open: bool, threshold: int | None) -> None:
        d = self.decisions[pick % len(self.decisions)]
        m = self.model[d.source]
        applied = self.holds(m, d)
        got = run(self.gate.record_failure(d, threshold=threshold, force_open=force_open))
        effective = self.threshold if threshold is None else threshold
        if applied:
            if force_open or d.probe_owner is not None:
                self.open(m, max(m.failures, effective))
            else:
                m.failures += 1
                if m.failures >= effective:
                    self.open(m, m.failures)
        self.check(got, d.source, applied)

    @precondition(lambda self: self.decisions)
    @rule(pick=st.integers(0, 10**6))
    def release_probe(self, pick: int) -> None:
        d = self.decisions[pick % len(self.decisions)]
        m = self.model[d.source]
        if d.probe_owner is not None and self.holds(m, d):
            m.probe_owner, m.probe_until = None, 0.0
        run(self.gate.release_probe(d))

    @rule(source=st.sampled_from(SOURCES))
    def force_open(self, source: str) -> None:
        m = self.model[source]
        got = run(self.gate.force_open(source))
        failures = max(m.failures, self.threshold)
        if m.state == "open":
            m.failures = failures
            m.open_until = max(m.open_until, self.clock.monotonic() + self.cooldown_s)
        else:
            self.open(m, failures)
        self.check(got, source, True)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 4.0, 5.0, 9.9, 10.0, 29.0, 31.0, 61.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def states_match(self) -> None:
        if not hasattr(self, "gate"):
            return
        for source in SOURCES:
            assert run(self.gate.state(source)) == self.model[source].state

    @invariant()
    def epochs_never_decrease(self) -> None:
        for source in SOURCES:
            assert self.model[source].epoch >= self.epochs_seen[source]
            self.epochs_seen[source] = self.model[source].epoch

    @invariant()
    def retry_after_matches(self) -> None:
        if not hasattr(self, "gate"):
            return
        now = self.clock.monotonic()
        waits = []
        for source in SOURCES:
            m = self.model[source]
            if m.state == "closed":
                wait = 0.0
            elif m.state == "open":
                wait = m.open_until - now
            else:
                wait = m.probe_until - now if m.probe_owner is not None else 0.0
            waits.append(max(0.0, wait))
            assert run(self.gate.retry_after_s([source])) == pytest.approx(max(0.0, wait))
        assert run(self.gate.retry_after_s(SOURCES)) == pytest.approx(min(waits))


TestBreakerAgainstModel = BreakerMachine.TestCase
TestBreakerAgainstModel.settings = STEPS


# --------------------------------------------------------------------------- construction, clock


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease_ttl_s": 0.0},
        {"lease_ttl_s": -1.0},
        {"lease_ttl_s": math.nan},
        {"lease_ttl_s": math.inf},
        {"global_limits": Limits(max_concurrency=-1)},
        {"global_limits": Limits(tpm=-5)},
    ],
    ids=repr,
)
def test_limiter_refuses_bad_configuration(kwargs: dict[str, Any]) -> None:
    config: dict[str, Any] = {"global_limits": Limits(), "lease_ttl_s": 30.0, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        InMemoryLimiter(clock=FakeClock(), **config)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fail_threshold": 0},
        {"fail_threshold": -2},
        {"cooldown_s": -1.0},
        {"cooldown_s": math.nan},
        {"probe_ttl_s": 0.0},
        {"probe_ttl_s": math.inf},
    ],
    ids=repr,
)
def test_gate_refuses_bad_configuration(kwargs: dict[str, Any]) -> None:
    config: dict[str, Any] = {
        "fail_threshold": 3,
        "cooldown_s": 30.0,
        "probe_ttl_s": 60.0,
        **kwargs,
    }
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        InMemoryGate(clock=FakeClock(), **config)


async def test_retry_after_s_refuses_a_bare_string() -> None:
    gate = InMemoryGate(fail_threshold=1, cooldown_s=1.0, probe_ttl_s=1.0, clock=FakeClock())
    with pytest.raises(ValueError, match="sequence"):
        await gate.retry_after_s("ab")


@given(steps=st.lists(st.floats(min_value=-5.0, max_value=1e6, allow_nan=False), max_size=20))
def test_fake_clock_sleep_advances_exactly_and_never_backwards(steps: list[float]) -> None:
    clock = FakeClock(start=1000.0, wall_start=1.7e9)

    async def scenario() -> None:
        expected = 1000.0
        for seconds in steps:
            await clock.sleep(seconds)
            expected += max(0.0, seconds)
            assert clock.monotonic() == expected
            assert clock.time() == pytest.approx(1.7e9 + expected - 1000.0)

    asyncio.run(scenario())


async def test_fake_clock_sleep_yields_to_other_tasks() -> None:
    clock = FakeClock()
    ran = asyncio.Event()

    async def other() -> None:
        ran.set()

    task = asyncio.create_task(other())
    await clock.sleep(3600.0)
    assert ran.is_set()
    assert clock.monotonic() == 4600.0
    await task


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf])
def test_fake_clock_refuses_to_go_backwards_or_to_infinity(bad: float) -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="advance"):
        clock.advance(bad)
    assert clock.monotonic() == 1000.0
