"""Real-wait variants of the contract cases that move time (the server's clock cannot be faked).

One test here per time-dependent contract case, same name, same assertions, with short real
durations where the semantics allow (lease TTL, cooldown and probe TTL of 1-3 s). The RPM/TPM
windows are real minutes: the four window cases share one minute boundary (a module fixture
prepares each case just before the boundary and the tests check after it), so the module
waits for one boundary, not four.

| contract case (LimiterContract / BreakerContract)          | here                                |
|------------------------------------------------------------|-------------------------------------|
| test_an_unreleased_lease_expires_after_its_ttl             | same name, lease TTL 1.5 s          |
| test_concurrency_wait_hint_is_bounded_by_the_oldest_lease  | same name, lease TTL 2 s            |
| test_rpm_window_rolls_over_after_the_wait_hint             | same name, shared boundary          |
| test_tpm_window_rolls_over_after_the_wait_hint             | same name, shared boundary          |
| test_settle_lands_in_the_acquire_time_window               | same name, shared boundary (+ TTLs) |
| test_stats_reset_in_a_new_window                           | same name, shared boundary          |
| test_progress_age_follows_the_clock                        | same name, 1.5 s                    |
| test_the_first_caller_after_the_cooldown_is_the_probe      | same name, cooldown 1.5 s           |
| test_a_failed_probe_waits_a_full_cooldown_again            | same name, cooldown 2 s             |
| test_a_lapsed_probe_is_reissued                            | same name, probe TTL 1.5 s          |
| test_retry_after_s_tracks_the_clock_and_never_goes_negative| same name, cooldown 3 s             |
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from pgw_redis.breaker import RedisGate
from pgw_redis.connection import connect
from pgw_redis.limiter import RedisLimiter
from pgw_redis.testing import RedisGovernanceBackend, make_governance_backend
from pgw_redis_test_helpers import wait_until
from polygateway.ports import Denial, GateDecision, Permit, SourceStats
from polygateway.settings import Limits

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NO_LIMITS = Limits()
MS = 0.002  # the server answers in whole milliseconds


@pytest.fixture
async def backend(redis_url: str, unique_scope: str) -> AsyncIterator[RedisGovernanceBackend]:
    made = make_governance_backend(redis_url, unique_scope)
    try:
        yield made
    finally:
        await made.cleanup()


def _limiter(
    backend: RedisGovernanceBackend, limits: Limits = NO_LIMITS, ttl: float = 30.0
) -> RedisLimiter:
    return backend.make_limiter(global_limits=limits, lease_ttl_s=ttl)


def _gate(
    backend: RedisGovernanceBackend, *, cooldown_s: float, probe_ttl_s: float = 60.0
) -> RedisGate:
    return backend.make_breaker(fail_threshold=3, cooldown_s=cooldown_s, probe_ttl_s=probe_ttl_s)


async def _admit(
    limiter: RedisLimiter, source: str, est: int = 0, limits: Limits = NO_LIMITS
) -> Permit:
    result = await limiter.try_acquire(source, est, limits)
    assert not isinstance(result, Denial), result
    return result


async def _refuse(
    limiter: RedisLimiter, source: str, est: int = 0, limits: Limits = NO_LIMITS
) -> Denial:
    result = await limiter.try_acquire(source, est, limits)
    assert isinstance(result, Denial), result
    return result


async def _probe(gate: RedisGate, source: str) -> GateDecision:
    decision = await gate.try_enter(source)
    assert decision.allowed and decision.is_probe, decision
    return decision


async def _refused(gate: RedisGate, source: str) -> GateDecision:
    decision = await gate.try_enter(source)
    assert not decision.allowed, decision
    return decision


# --------------------------------------------------------------------------- leases, progress


async def test_an_unreleased_lease_expires_after_its_ttl(backend: RedisGovernanceBackend) -> None:
    limiter = _limiter(backend, Limits(max_concurrency=1), ttl=1.5)
    abandoned = await _admit(limiter, "a")
    await asyncio.sleep(0.5)
    assert await limiter.inflight() == 1
    assert (await _refuse(limiter, "b")).gate == "global_concurrency"
    await wait_until(lambda: _inflight_is(limiter, 0), timeout_s=3.0)
    assert (await limiter.source_stats("a")).inflight == 0
    newer = await _admit(limiter, "b")
    await abandoned.release()  # late release: a no-op, ``newer`` keeps its slot
    assert await limiter.inflight() == 1
    assert (await _refuse(limiter, "c")).gate == "global_concurrency"
    await newer.release()
    assert await limiter.inflight() == 0


async def _inflight_is(limiter: RedisLimiter, expected: int) -> bool:
    return await limiter.inflight() == expected


async def test_concurrency_wait_hint_is_bounded_by_the_oldest_lease(
    backend: RedisGovernanceBackend,
) -> None:
    limiter = _limiter(backend, Limits(max_concurrency=1), ttl=2.0)
    await _admit(limiter, "a", limits=Limits(max_concurrency=1))
    await asyncio.sleep(0.8)
    denial = await _refuse(limiter, "b")
    assert denial.gate == "global_concurrency"
    assert 0.0 < denial.wait_s <= 1.2 + MS
    denial = await _refuse(limiter, "a", limits=Limits(max_concurrency=1))
    assert denial.gate == "global_concurrency"


async def test_progress_age_follows_the_clock(backend: RedisGovernanceBackend) -> None:
    limiter = _limiter(backend)
    await limiter.mark_progress()
    await asyncio.sleep(1.5)
    # The mark is sent when the test first yields: a few ms after the call.
    assert 1.4 <= await limiter.progress_age_s() < 3.0
    await limiter.mark_progress()
    assert 0.0 <= await limiter.progress_age_s() < 1.0


# --------------------------------------------------------------------------- breaker


async def test_the_first_caller_after_the_cooldown_is_the_probe(
    backend: RedisGovernanceBackend,
) -> None:
    gate = _gate(backend, cooldown_s=1.5)
    await gate.force_open("a")
    await asyncio.sleep(0.5)
    refused = await _refused(gate, "a")
    assert refused.state == "open"
    assert 0.0 < refused.retry_after_s <= 1.0 + MS
    await asyncio.sleep(refused.retry_after_s + 0.05)
    await _probe(gate, "a")
    assert (await _refused(gate, "a")).state == "half_open"


async def test_a_failed_probe_waits_a_full_cooldown_again(backend: RedisGovernanceBackend) -> None:
    cooldown = 2.0
    gate = _gate(backend, cooldown_s=cooldown)
    await gate.force_open("a")
    await asyncio.sleep(cooldown + 0.05)
    probe = await _probe(gate, "a")
    await gate.record_failure(probe)
    refused = await _refused(gate, "a")
    assert refused.state == "open"
    assert cooldown - 1.0 < refused.retry_after_s <= cooldown
    await asyncio.sleep(cooldown - 1.0)
    await _refused(gate, "a")
    await asyncio.sleep(1.05)
    later = await _probe(gate, "a")
    update = await gate.record_success(probe)
    assert not update.applied
    assert (update.state, update.epoch) == ("half_open", later.epoch)


async def test_a_lapsed_probe_is_reissued(backend: RedisGovernanceBackend) -> None:
    gate = _gate(backend, cooldown_s=0.0, probe_ttl_s=1.5)
    await gate.force_open("a")
    vanished = await _probe(gate, "a")
    await asyncio.sleep(0.5)
    refused = await _refused(gate, "a")
    assert 0.0 < refused.retry_after_s <= 1.0 + MS
    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert await gate.retry_after_s(["a"]) == 0.0
    reissued = await _probe(gate, "a")
    assert reissued.probe_owner != vanished.probe_owner
    assert reissued.epoch == vanished.epoch
    for update in (await gate.record_success(vanished), await gate.record_failure(vanished)):
        assert not update.applied
        assert (update.state, update.epoch) == ("half_open", vanished.epoch)
    update = await gate.record_success(reissued)
    assert (update.applied, update.state) == (True, "closed")


async def test_retry_after_s_tracks_the_clock_and_never_goes_negative(
    backend: RedisGovernanceBackend,
) -> None:
    cooldown = 3.0
    gate = _gate(backend, cooldown_s=cooldown)
    await gate.force_open("a")
    await asyncio.sleep(1.0)
    await gate.force_open("b")
    assert await gate.retry_after_s(["a", "b"]) == pytest.approx(cooldown - 1.0, abs=0.25)
    assert await gate.retry_after_s(["b"]) == pytest.approx(cooldown, abs=0.25)
    await asyncio.sleep(cooldown + 0.1)
    assert await gate.retry_after_s(["a", "b"]) == 0.0
    assert await gate.state("a") == "open"  # stored state moves on the next try_enter
    await _probe(gate, "a")


# --------------------------------------------------------------------------- minute windows


@dataclass
class _Rollover:
    """Each window case, prepared in the minute before a boundary, checked after it."""

    rpm_limiter: RedisLimiter
    rpm_denial: Denial
    rpm_refused_just_before: Denial
    tpm_limiter: RedisLimiter
    tpm_denial: Denial
    settle_limiter: RedisLimiter
    settle_early: Permit
    settle_late: Permit
    stats_limiter: RedisLimiter
    stats_permit: Permit
    backends: list[RedisGovernanceBackend]


async def _server_time(client: object) -> float:
    seconds, micros = await client.time()  # type: ignore[attr-defined]
    return float(seconds) + float(micros) / 1e6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rolled_over(module_redis_url: str) -> AsyncIterator[_Rollover]:
    import uuid

    backends = [
        make_governance_backend(module_redis_url, f"T{uuid.uuid4().hex[:10]}") for _ in range(4)
    ]
    admin = connect(module_redis_url)
    try:
        # Start 4 s before a boundary: room to prepare, little to wait after.
        now = await _server_time(admin)
        left = 60.0 - now % 60.0
        if left < 4.0:
            await asyncio.sleep(left + 0.05)
            now = await _server_time(admin)
            left = 60.0 - now % 60.0
        await asyncio.sleep(max(0.0, left - 4.0))

        rpm = backends[0].make_limiter(global_limits=Limits(rpm=2), lease_ttl_s=30.0)
        await _admit(rpm, "a")
        await _admit(rpm, "b")
        rpm_denial = await _refuse(rpm, "a")
        assert rpm_denial.gate == "global_rpm"

        tpm = backends[1].make_limiter(global_limits=NO_LIMITS, lease_ttl_s=30.0)
        await _admit(tpm, "a", 100, Limits(tpm=100))
        tpm_denial = await _refuse(tpm, "a", 1, Limits(tpm=100))
        assert tpm_denial.gate == "source_tpm"

        settle = backends[2].make_limiter(global_limits=NO_LIMITS, lease_ttl_s=30.0)
        early = await _admit(settle, "a", 500, Limits(tpm=1000))
        late = await _admit(settle, "a", 400, Limits(tpm=1000))

        stats = backends[3].make_limiter(global_limits=NO_LIMITS, lease_ttl_s=180.0)
        stats_permit = await _admit(stats, "a", 50)

        await asyncio.sleep(max(0.0, rpm_denial.wait_s - 0.5))
        just_before = await _refuse(rpm, "a")
        remaining = 60.0 - (await _server_time(admin)) % 60.0
        await asyncio.sleep(remaining + 0.05)
        yield _Rollover(
            rpm, rpm_denial, just_before, tpm, tpm_denial, settle, early, late, stats, stats_permit,
            backends,
        )  # fmt: skip
    finally:
        await admin.aclose()
        for made in backends:
            await made.cleanup()


@pytest.mark.asyncio(loop_scope="module")
async def test_rpm_window_rolls_over_after_the_wait_hint(rolled_over: _Rollover) -> None:
    assert 0.0 < rolled_over.rpm_denial.wait_s <= 60.0
    assert rolled_over.rpm_refused_just_before.gate == "global_rpm"
    await _admit(rolled_over.rpm_limiter, "a")
    assert (await rolled_over.rpm_limiter.source_stats("a")).rpm_used == 1


@pytest.mark.asyncio(loop_scope="module")
async def test_tpm_window_rolls_over_after_the_wait_hint(rolled_over: _Rollover) -> None:
    assert 0.0 < rolled_over.tpm_denial.wait_s <= 60.0
    await _admit(rolled_over.tpm_limiter, "a", 100, Limits(tpm=100))


@pytest.mark.asyncio(loop_scope="module")
async def test_settle_lands_in_the_acquire_time_window(rolled_over: _Rollover) -> None:
    limiter = rolled_over.settle_limiter
    thousand = Limits(tpm=1000)
    await _admit(limiter, "a", 600, thousand)
    await rolled_over.settle_early.settle(0)  # refunds 500 to the old window, not to this one
    assert (await limiter.source_stats("a")).tpm_used == 600
    assert (await _refuse(limiter, "a", 401, thousand)).gate == "source_tpm"
    await rolled_over.settle_late.settle(5000)  # an overcharge lands in the old window too
    assert (await limiter.source_stats("a")).tpm_used == 600
    await _admit(limiter, "a", 400, thousand)
    # The old window's counters were written after it ended: they must still expire.
    await limiter.flush()
    backend = rolled_over.backends[2]
    admin = connect(backend.redis_url)
    try:
        for key in await backend.scope_keys():
            ttl = await admin.ttl(key)
            assert ttl > 0, f"{key} has TTL {ttl}"
            if ":tpm:" in key or ":rpm:" in key:
                assert ttl <= 120, f"{key} has TTL {ttl}"
    finally:
        await admin.aclose()


@pytest.mark.asyncio(loop_scope="module")
async def test_stats_reset_in_a_new_window(rolled_over: _Rollover) -> None:
    stats = await rolled_over.stats_limiter.source_stats("a")
    assert stats == SourceStats(inflight=1, rpm_used=0, tpm_used=0)
    await rolled_over.stats_permit.release()
