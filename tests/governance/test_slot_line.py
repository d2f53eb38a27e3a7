"""Waiting for a concurrency slot: the memory limiter's line (``ports.QueuedAdmission``).

A call refused by a full concurrency gate waits in line instead of polling: a release hands
the slot to the first waiter it admits before anyone else can take it; a waiter cancelled
after the hand-over passes the slot on; time (the caller's timeout, a dead holder's lease
expiry) runs on the injected clock. The clock here moves only when a test moves it, so
nothing in these tests can be woken by the passing of time unless the test says so.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.governance import Attempted, Governor
from polygateway.ports import Denial, Permit, QueuedAdmission
from polygateway.selectors import RoundRobinSelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    SourceConfig,
)
from polygateway.testing import FakeClock


class HeldClock(FakeClock):
    """A fake clock whose ``sleep`` ends only once the test has moved time past its end."""

    __slots__ = ("_sleepers",)

    def __init__(self) -> None:
        super().__init__()
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        now = self.monotonic()
        for end, future in self._sleepers:
            if end <= now and not future.done():
                future.set_result(None)
        self._sleepers = [(end, f) for end, f in self._sleepers if not f.done()]

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.monotonic() + max(0.0, seconds), future))
        await future

    @property
    def sleeping(self) -> int:
        return sum(not f.done() for _, f in self._sleepers)


async def settle() -> None:
    """Let every ready task run until none is left ready."""
    for _ in range(20):
        await asyncio.sleep(0)


def limiter(clock: FakeClock, slots: int = 1, ttl_s: float = 60.0) -> InMemoryLimiter:
    return InMemoryLimiter(
        global_limits=Limits(max_concurrency=slots), lease_ttl_s=ttl_s, clock=clock
    )


async def take(lim: InMemoryLimiter, source: str = "a") -> Permit:
    permit = await lim.try_acquire(source, 1, Limits())
    assert not isinstance(permit, Denial)
    return permit


def test_the_memory_limiter_keeps_a_line() -> None:
    assert isinstance(limiter(FakeClock()), QueuedAdmission)


async def test_a_release_hands_the_slot_to_the_first_in_line_and_nobody_else() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    held = await take(lim)
    waiters = [asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0)) for _ in range(3)]
    await settle()
    assert not any(w.done() for w in waiters)

    await held.release()
    # Handed over at the release: a caller arriving now finds the gate full.
    barger = await lim.try_acquire("a", 1, Limits())
    assert isinstance(barger, Denial) and barger.gate == "global_concurrency"
    await settle()
    assert [w.done() for w in waiters] == [True, False, False]

    first = waiters[0].result()
    assert not isinstance(first, Denial)
    await first.release()
    await settle()
    assert [w.done() for w in waiters] == [True, True, False]
    second = waiters[1].result()
    assert not isinstance(second, Denial)
    await second.release()
    await settle()
    third = waiters[2].result()
    assert not isinstance(third, Denial)
    assert await lim.inflight() == 1
    await third.release()
    assert await lim.inflight() == 0


async def test_a_waiter_cancelled_after_the_hand_over_passes_the_slot_on() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    held = await take(lim)
    first = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0))
    second = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0))
    await settle()
    await held.release()  # the slot is now the first waiter's, which has not run yet
    first.cancel()
    await settle()
    assert first.cancelled()
    permit = second.result()
    assert not isinstance(permit, Denial)
    assert await lim.inflight() == 1
    await permit.release()
    assert await lim.inflight() == 0


async def test_a_waiter_cancelled_in_line_leaves_it() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    held = await take(lim)
    gone = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0))
    kept = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0))
    await settle()
    gone.cancel()
    await settle()
    await held.release()
    await settle()
    permit = kept.result()
    assert not isinstance(permit, Denial)
    await permit.release()
    assert clock.sleeping == 0  # no timer left behind
    assert not isinstance(await lim.try_acquire("a", 1, Limits()), Denial)


async def test_the_timeout_runs_on_the_clock_and_ends_in_the_refusal() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    held = await take(lim)
    waiter = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 5.0))
    await settle()
    clock.advance(4.9)
    await settle()
    assert not waiter.done()
    clock.advance(0.1)
    await settle()
    refusal = waiter.result()
    assert isinstance(refusal, Denial) and refusal.gate == "global_concurrency"
    # Out of line: the next release frees the slot for whoever asks.
    await held.release()
    assert not isinstance(await lim.try_acquire("a", 1, Limits()), Denial)


async def test_a_dead_holders_slot_goes_to_the_line_at_its_lease_expiry() -> None:
    clock = HeldClock()
    lim = limiter(clock, ttl_s=30.0)
    await take(lim)  # never released
    waiter = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 1000.0))
    await settle()
    clock.advance(29.0)
    await settle()
    assert not waiter.done()
    clock.advance(1.0)
    await settle()
    permit = waiter.result()
    assert not isinstance(permit, Denial)
    await permit.release()


async def test_a_source_gate_waiter_keeps_its_place_while_another_source_goes_first() -> None:
    clock = HeldClock()
    lim = limiter(clock, slots=2)
    one = Limits(max_concurrency=1)
    held_a = await lim.try_acquire("a", 1, one)
    held_b = await lim.try_acquire("b", 1, one)
    assert not isinstance(held_a, Denial) and not isinstance(held_b, Denial)
    wants_a = asyncio.create_task(lim.acquire_queued("a", 1, one, 100.0))
    wants_b = asyncio.create_task(lim.acquire_queued("b", 1, one, 100.0))
    await settle()
    await held_b.release()  # frees a global slot and b's: a's waiter cannot use it
    await settle()
    assert not wants_a.done()
    got_b = wants_b.result()
    assert not isinstance(got_b, Denial)
    await held_a.release()
    await settle()
    got_a = wants_a.result()
    assert not isinstance(got_a, Denial)
    await got_a.release()
    await got_b.release()


async def test_a_waiter_refused_by_a_time_gate_gets_that_refusal_at_once() -> None:
    clock = HeldClock()
    lim = InMemoryLimiter(
        global_limits=Limits(max_concurrency=1, rpm=1), lease_ttl_s=60.0, clock=clock
    )
    held = await take(lim)
    waiter = asyncio.create_task(lim.acquire_queued("a", 1, Limits(), 100.0))
    await settle()
    await held.release()
    await settle()
    refusal = waiter.result()
    assert isinstance(refusal, Denial) and refusal.gate == "global_rpm"
    assert await lim.inflight() == 0


# --------------------------------------------------------------------------- the governor


def chat_source(name: str) -> SourceConfig:
    return SourceConfig(
        name=name,
        provider="ocr-vendor",
        base_url=f"http://unused.invalid/{name}",
        model="m",
        timeout_s=10.0,
        est_tokens=5,
    )


def governor(clock: FakeClock, lim: InMemoryLimiter, names: tuple[str, ...] = ("a",)) -> Governor:
    return Governor(
        sources=[chat_source(n) for n in names],
        limiter=lim,
        breaker=InMemoryGate(fail_threshold=5, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock),
        selector=RoundRobinSelector(),
        retry=RetrySettings(max_attempts=3, base_delay_s=1.0, max_delay_s=5.0),
        breaker_settings=BreakerSettings(fail_threshold=5, cooldown_s=30.0),
        backpressure=BackpressureSettings(quota_full="wait", stall_window_s=60.0),
        clock=clock,
    )


async def test_a_governed_call_waiting_for_a_slot_is_woken_by_the_release() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    gov = governor(clock, lim, names=("a", "b"))
    held = await take(lim, "elsewhere")
    sent: list[str] = []

    async def attempt(src: SourceConfig, call_id: str) -> Attempted[str]:
        sent.append(src.name)
        return Attempted(f"from {src.name}", tokens=3)

    calls = [asyncio.create_task(gov.run(attempt)) for _ in range(3)]
    await settle()
    assert sent == [] and not any(c.done() for c in calls)
    await held.release()
    await settle()
    # Each finished call releases its slot to the next in line; time never moved.
    assert all(c.done() for c in calls)
    assert [c.result().value.startswith("from ") for c in calls] == [True] * 3
    assert len(sent) == 3
    assert clock.monotonic() == 1000.0
    assert await lim.inflight() == 0


async def test_a_governed_call_cancelled_in_line_frees_nothing_it_does_not_hold() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    gov = governor(clock, lim)
    held = await take(lim, "elsewhere")

    async def attempt(src: SourceConfig, call_id: str) -> Attempted[Any]:
        return Attempted(None, tokens=1)

    call = asyncio.create_task(gov.run(attempt))
    await settle()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await lim.inflight() == 1
    await held.release()
    assert await lim.inflight() == 0


async def test_a_governed_call_cancelled_after_the_hand_over_passes_the_slot_on() -> None:
    clock = HeldClock()
    lim = limiter(clock)
    gov = governor(clock, lim)
    held = await take(lim, "elsewhere")

    async def attempt(src: SourceConfig, call_id: str) -> Attempted[Any]:
        return Attempted(None, tokens=1)

    first = asyncio.create_task(gov.run(attempt))
    second = asyncio.create_task(gov.run(attempt))
    await settle()
    await held.release()
    first.cancel()
    await settle()
    assert first.cancelled()
    assert second.done() and second.result().value is None
    assert await lim.inflight() == 0


async def test_a_stalled_line_ends_in_the_stall_verdict_on_the_clock() -> None:
    clock = HeldClock()
    lim = limiter(clock, ttl_s=600.0)
    gov = governor(clock, lim)
    await take(lim, "elsewhere")  # held past the window, nobody makes progress

    async def attempt(src: SourceConfig, call_id: str) -> Attempted[Any]:
        return Attempted(None, tokens=1)

    call = asyncio.create_task(gov.run(attempt))
    for _ in range(400):  # 100 s in steps of 0.25 s
        await settle()
        if call.done():
            break
        clock.advance(0.25)
    exc = call.exception()
    assert exc is not None and getattr(exc, "reason", None) == "stalled"
    assert 60.0 < clock.monotonic() - 1000.0 <= 61.0
