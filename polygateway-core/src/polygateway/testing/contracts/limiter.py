"""The rate limiter contract (``ports.RateLimiter``), the same for every backend.

Every test takes the ``governance_backend`` fixture (see ``GovernanceBackend``) and makes its
own limiter. Tests that move time call ``_require_fake_time`` first, so a backend without an
injectable clock skips them before touching any state.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

import pytest

from polygateway.backends import MAX_TOKENS
from polygateway.ports import Denial, Permit, RateLimiter, SourceStats
from polygateway.settings import Limits

if TYPE_CHECKING:
    from polygateway.testing.contracts import GovernanceBackend

LEASE_TTL_S = 30.0
WINDOW_S = 60.0
NO_LIMITS = Limits()
GATES = (
    "global_concurrency",
    "source_concurrency",
    "global_rpm",
    "source_rpm",
    "global_tpm",
    "source_tpm",
)
ODD_SOURCE_NAMES = ("a", "a:b", "{a}", "a}", "{", "a b", "line\nbreak", "源-1", "a:b:c")


def _require_fake_time(backend: GovernanceBackend) -> None:
    if not backend.supports_fake_time:
        reason = getattr(backend.clock, "reason", "time-dependent: needs an injectable clock")
        pytest.skip(reason)


async def _window_headroom(backend: GovernanceBackend, need_s: float) -> None:
    """Make sure at least ``need_s`` seconds remain in the current minute window, so that a
    test counting requests per window cannot be split by a rollover."""
    if backend.supports_fake_time:
        remaining = WINDOW_S - backend.clock.time() % WINDOW_S
        if remaining < need_s:
            backend.clock.advance(remaining + 0.001)
        return
    window_time = getattr(backend, "window_time", None)
    now = await window_time() if window_time is not None else time.time()
    remaining = WINDOW_S - now % WINDOW_S
    if remaining < need_s:
        await asyncio.sleep(remaining + 0.05)


def _limiter(
    backend: GovernanceBackend, global_limits: Limits = NO_LIMITS, lease_ttl_s: float = LEASE_TTL_S
) -> RateLimiter:
    return backend.make_limiter(global_limits=global_limits, lease_ttl_s=lease_ttl_s)


async def _admit(
    limiter: RateLimiter, source: str, est_tokens: int = 0, limits: Limits = NO_LIMITS
) -> Permit:
    result = await limiter.try_acquire(source, est_tokens, limits)
    assert not isinstance(result, Denial), f"expected a permit for {source!r}, got {result!r}"
    return result


async def _refuse(
    limiter: RateLimiter, source: str, est_tokens: int = 0, limits: Limits = NO_LIMITS
) -> Denial:
    result = await limiter.try_acquire(source, est_tokens, limits)
    assert isinstance(result, Denial), f"expected a denial for {source!r}, got {result!r}"
    return result


async def _snapshot(limiter: RateLimiter, *sources: str) -> tuple[Any, ...]:
    stats = [await limiter.source_stats(s) for s in sources]
    return (await limiter.inflight(), *stats)


class LimiterContract:
    """Semantics every ``RateLimiter`` backend shares (ARCHITECTURE §7.3, M2 §2.2)."""

    # ------------------------------------------------------------------ permits, leases

    async def test_permit_describes_the_admitted_attempt(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        permit = await _admit(limiter, "a", 123)
        assert isinstance(permit, Permit)
        assert permit.source == "a"
        assert permit.est_tokens == 123
        assert isinstance(permit.lease_id, str) and permit.lease_id

    async def test_lease_ids_are_unique(self, governance_backend: GovernanceBackend) -> None:
        limiter = _limiter(governance_backend)
        permits = [await _admit(limiter, "ab"[i % 2]) for i in range(50)]
        assert len({p.lease_id for p in permits}) == 50

    async def test_inflight_counts_live_leases(self, governance_backend: GovernanceBackend) -> None:
        limiter = _limiter(governance_backend)
        assert await limiter.inflight() == 0
        a1 = await _admit(limiter, "a")
        await _admit(limiter, "a")
        await _admit(limiter, "b")
        assert await limiter.inflight() == 3
        assert (await limiter.source_stats("a")).inflight == 2
        assert (await limiter.source_stats("b")).inflight == 1
        await a1.release()
        assert await limiter.inflight() == 2
        assert (await limiter.source_stats("a")).inflight == 1

    # ------------------------------------------------------------------ the six gates

    async def test_global_concurrency_refuses_at_the_limit(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend, Limits(max_concurrency=2))
        first = await _admit(limiter, "a")
        await _admit(limiter, "b")
        denial = await _refuse(limiter, "c")
        assert denial.gate == "global_concurrency"
        assert 0.0 < denial.wait_s <= LEASE_TTL_S
        await first.release()
        await _admit(limiter, "c")
        assert (await _refuse(limiter, "a")).gate == "global_concurrency"

    async def test_source_concurrency_refuses_at_the_limit(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        one = Limits(max_concurrency=1)
        held = await _admit(limiter, "a", limits=one)
        denial = await _refuse(limiter, "a", limits=one)
        assert denial.gate == "source_concurrency"
        assert 0.0 < denial.wait_s <= LEASE_TTL_S
        await _admit(limiter, "b", limits=one)  # another source has its own slots
        await held.release()
        await _admit(limiter, "a", limits=one)

    async def test_global_rpm_refuses_at_the_limit_and_release_does_not_refund(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend, Limits(rpm=3))
        for source in ("a", "b", "a"):
            await (await _admit(limiter, source)).release()
        denial = await _refuse(limiter, "c")
        assert denial.gate == "global_rpm"
        assert 0.0 < denial.wait_s <= WINDOW_S

    async def test_source_rpm_refuses_at_the_limit(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        two = Limits(rpm=2)
        await (await _admit(limiter, "a", limits=two)).release()
        await (await _admit(limiter, "a", limits=two)).release()
        denial = await _refuse(limiter, "a", limits=two)
        assert denial.gate == "source_rpm"
        assert 0.0 < denial.wait_s <= WINDOW_S
        await _admit(limiter, "b", limits=two)

    async def test_global_tpm_refuses_when_the_estimate_would_exceed(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend, Limits(tpm=100))
        await _admit(limiter, "a", 60)
        denial = await _refuse(limiter, "b", 41)
        assert denial.gate == "global_tpm"
        assert 0.0 < denial.wait_s <= WINDOW_S
        await _admit(limiter, "b", 40)  # used + est == limit is admitted
        assert (await _refuse(limiter, "a", 1)).gate == "global_tpm"
        await _admit(limiter, "a", 0)  # a zero estimate fits a full window

    async def test_source_tpm_refuses_when_the_estimate_would_exceed(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        hundred = Limits(tpm=100)
        await _admit(limiter, "a", 70, hundred)
        denial = await _refuse(limiter, "a", 31, hundred)
        assert denial.gate == "source_tpm"
        assert 0.0 < denial.wait_s <= WINDOW_S
        await _admit(limiter, "a", 30, hundred)
        await _admit(limiter, "b", 100, hundred)

    async def test_an_estimate_above_the_tpm_limit_is_refused(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        denial = await _refuse(limiter, "a", 101, Limits(tpm=100))
        assert denial.gate == "source_tpm"

    @pytest.mark.parametrize("first_gate", GATES)
    async def test_gates_are_checked_in_order(
        self, governance_backend: GovernanceBackend, first_gate: str
    ) -> None:
        """One held permit exhausts every enabled gate; gates before ``first_gate`` are
        disabled (limit 0), so ``first_gate`` must be the one that answers."""
        await _window_headroom(governance_backend, 5.0)
        enabled = GATES[GATES.index(first_gate) :]

        def limit(gate: str, value: int) -> int:
            return value if gate in enabled else 0

        global_limits = Limits(
            max_concurrency=limit("global_concurrency", 1),
            rpm=limit("global_rpm", 1),
            tpm=limit("global_tpm", 10),
        )
        source_limits = Limits(
            max_concurrency=limit("source_concurrency", 1),
            rpm=limit("source_rpm", 1),
            tpm=limit("source_tpm", 10),
        )
        limiter = _limiter(governance_backend, global_limits)
        await _admit(limiter, "a", 10, source_limits)
        assert (await _refuse(limiter, "a", 1, source_limits)).gate == first_gate

    async def test_zero_limits_disable_every_gate(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend, Limits(0, 0, 0))
        for _ in range(50):
            await _admit(limiter, "a", 1_000_000, Limits(0, 0, 0))
        assert await limiter.inflight() == 50

    # ------------------------------------------------------------------ all-or-nothing

    @pytest.mark.parametrize("gate", GATES)
    async def test_a_refusal_changes_nothing(
        self, governance_backend: GovernanceBackend, gate: str
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        # Only ``gate`` can refuse; everything else has room to spare.
        global_limits = Limits(
            max_concurrency=1 if gate == "global_concurrency" else 100,
            rpm=1 if gate == "global_rpm" else 100,
            tpm=10 if gate == "global_tpm" else 10_000,
        )
        source_limits = Limits(
            max_concurrency=1 if gate == "source_concurrency" else 100,
            rpm=1 if gate == "source_rpm" else 100,
            tpm=10 if gate == "source_tpm" else 10_000,
        )
        limiter = _limiter(governance_backend, global_limits)
        await _admit(limiter, "a", 10, source_limits)
        before = await _snapshot(limiter, "a", "b")
        for _ in range(3):
            assert (await _refuse(limiter, "a", 5, source_limits)).gate == gate
        assert await _snapshot(limiter, "a", "b") == before

    async def test_a_source_refusal_does_not_charge_the_global_gates(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend, Limits(max_concurrency=2, rpm=2, tpm=200))
        small = Limits(tpm=100)
        await _admit(limiter, "a", 60, small)
        assert (await _refuse(limiter, "a", 50, small)).gate == "source_tpm"
        # Had the refusal taken a global slot, request or 50 tokens, this would not fit.
        await _admit(limiter, "b", 140)
        assert (await _refuse(limiter, "c", 0)).gate == "global_concurrency"

    # ------------------------------------------------------------------ settle, release

    async def test_settle_moves_tpm_by_actual_minus_estimate(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        thousand = Limits(tpm=1000)
        permit = await _admit(limiter, "a", 100, thousand)
        assert (await limiter.source_stats("a")).tpm_used == 100
        await permit.settle(30)
        assert (await limiter.source_stats("a")).tpm_used == 30
        assert (await _refuse(limiter, "a", 971, thousand)).gate == "source_tpm"
        await _admit(limiter, "a", 970, thousand)

    async def test_settle_above_the_estimate_charges_more(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend, Limits(tpm=1000))
        permit = await _admit(limiter, "a", 100)
        await permit.settle(400)
        assert (await limiter.source_stats("a")).tpm_used == 400
        assert (await _refuse(limiter, "b", 601)).gate == "global_tpm"
        await _admit(limiter, "b", 600)

    async def test_settle_is_idempotent(self, governance_backend: GovernanceBackend) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        permit = await _admit(limiter, "a", 100)
        await permit.settle(30)
        await permit.settle(500)
        await permit.settle(30)
        assert (await limiter.source_stats("a")).tpm_used == 30

    async def test_settle_after_release_still_charges(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        permit = await _admit(limiter, "a", 100)
        await permit.release()
        await permit.settle(250)
        assert await limiter.source_stats("a") == SourceStats(inflight=0, rpm_used=1, tpm_used=250)

    async def test_release_refunds_neither_requests_nor_tokens(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        permit = await _admit(limiter, "a", 100)
        assert await limiter.source_stats("a") == SourceStats(inflight=1, rpm_used=1, tpm_used=100)
        await permit.release()
        assert await limiter.source_stats("a") == SourceStats(inflight=0, rpm_used=1, tpm_used=100)

    async def test_release_is_idempotent(self, governance_backend: GovernanceBackend) -> None:
        limiter = _limiter(governance_backend, Limits(max_concurrency=2))
        other = await _admit(limiter, "b")
        permit = await _admit(limiter, "a")
        await permit.release()
        await permit.release()
        assert await limiter.inflight() == 1
        newer = await _admit(limiter, "a")
        await permit.release()  # must not free ``newer``'s slot
        assert await limiter.inflight() == 2
        assert (await _refuse(limiter, "c")).gate == "global_concurrency"
        await other.release()
        await newer.release()
        assert await limiter.inflight() == 0

    @pytest.mark.parametrize(
        "bad", [-1, math.nan, math.inf, 1.5, True, MAX_TOKENS + 1, 2**53], ids=repr
    )
    async def test_bad_actual_tokens_raise_and_leave_settle_usable(
        self, governance_backend: GovernanceBackend, bad: Any
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        permit = await _admit(limiter, "a", 100)
        with pytest.raises(ValueError, match="actual_tokens"):
            await permit.settle(bad)
        assert (await limiter.source_stats("a")).tpm_used == 100
        await permit.settle(40)
        assert (await limiter.source_stats("a")).tpm_used == 40

    # ------------------------------------------------------------------ input, names, stats

    @pytest.mark.parametrize(
        "bad", [-1, math.nan, math.inf, -math.inf, 1.5, True, MAX_TOKENS + 1, 2**53], ids=repr
    )
    async def test_bad_estimates_raise_without_side_effect(
        self, governance_backend: GovernanceBackend, bad: Any
    ) -> None:
        limiter = _limiter(governance_backend, Limits(max_concurrency=5, rpm=5, tpm=100))
        with pytest.raises(ValueError, match="est_tokens"):
            await limiter.try_acquire("a", bad, Limits(tpm=100))
        assert await _snapshot(limiter, "a") == (0, SourceStats(0, 0, 0))

    async def test_estimates_at_the_bounds_are_accepted(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        assert (await _admit(limiter, "a", 0)).est_tokens == 0
        assert (await _admit(limiter, "a", MAX_TOKENS)).est_tokens == MAX_TOKENS

    async def test_negative_limits_are_refused(self, governance_backend: GovernanceBackend) -> None:
        limiter = _limiter(governance_backend)
        with pytest.raises(ValueError, match="source_limits"):
            await limiter.try_acquire("a", 1, Limits(rpm=-1))
        assert await limiter.inflight() == 0

    async def test_source_names_never_collide(self, governance_backend: GovernanceBackend) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        one = Limits(max_concurrency=1, rpm=1, tpm=10)
        for name in ODD_SOURCE_NAMES:
            permit = await _admit(limiter, name, 7, one)
            assert permit.source == name
        for name in ODD_SOURCE_NAMES:
            assert (await _refuse(limiter, name, 1, one)).gate == "source_concurrency"
            assert await limiter.source_stats(name) == SourceStats(1, 1, 7)
        assert await limiter.inflight() == len(ODD_SOURCE_NAMES)

    async def test_unknown_source_has_zero_stats(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        assert await limiter.source_stats("never-seen") == SourceStats(0, 0, 0)

    async def test_stats_are_kept_with_every_gate_disabled(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        await _admit(limiter, "a", 11)
        await _admit(limiter, "a", 22)
        assert await limiter.source_stats("a") == SourceStats(inflight=2, rpm_used=2, tpm_used=33)

    # ------------------------------------------------------------------ concurrency

    async def test_concurrent_acquires_respect_global_concurrency(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend, Limits(max_concurrency=10))
        results = await asyncio.gather(
            *(limiter.try_acquire("abcd"[i % 4], 1, NO_LIMITS) for i in range(200))
        )
        permits = [r for r in results if not isinstance(r, Denial)]
        denials = [r for r in results if isinstance(r, Denial)]
        assert len(permits) == 10
        assert {d.gate for d in denials} == {"global_concurrency"}
        assert await limiter.inflight() == 10
        await asyncio.gather(*(p.release() for p in permits))
        assert await limiter.inflight() == 0

    async def test_concurrent_acquires_admit_exactly_the_rpm(
        self, governance_backend: GovernanceBackend
    ) -> None:
        await _window_headroom(governance_backend, 10.0)
        limiter = _limiter(governance_backend)
        five = Limits(rpm=5)
        results = await asyncio.gather(*(limiter.try_acquire("a", 1, five) for _ in range(100)))
        assert sum(not isinstance(r, Denial) for r in results) == 5
        assert (await limiter.source_stats("a")).rpm_used == 5

    # ------------------------------------------------------------------ progress

    async def test_progress_age_is_inf_before_any_mark(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        assert await limiter.progress_age_s() == math.inf

    async def test_progress_age_is_small_right_after_a_mark(
        self, governance_backend: GovernanceBackend
    ) -> None:
        limiter = _limiter(governance_backend)
        await limiter.mark_progress()
        assert 0.0 <= await limiter.progress_age_s() < 5.0

    # ------------------------------------------------------------------ time-dependent

    async def test_an_unreleased_lease_expires_after_its_ttl(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        limiter = _limiter(governance_backend, Limits(max_concurrency=1), lease_ttl_s=10.0)
        abandoned = await _admit(limiter, "a")
        clock.advance(9.0)
        assert await limiter.inflight() == 1
        assert (await _refuse(limiter, "b")).gate == "global_concurrency"
        clock.advance(1.5)
        assert await limiter.inflight() == 0
        assert (await limiter.source_stats("a")).inflight == 0
        newer = await _admit(limiter, "b")
        await abandoned.release()  # late release: a no-op, ``newer`` keeps its slot
        assert await limiter.inflight() == 1
        assert (await _refuse(limiter, "c")).gate == "global_concurrency"
        await newer.release()
        assert await limiter.inflight() == 0

    async def test_concurrency_wait_hint_is_bounded_by_the_oldest_lease(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        limiter = _limiter(governance_backend, Limits(max_concurrency=1), lease_ttl_s=10.0)
        await _admit(limiter, "a", limits=Limits(max_concurrency=1))
        clock.advance(4.0)
        denial = await _refuse(limiter, "b")
        assert denial.gate == "global_concurrency"
        assert 0.0 < denial.wait_s <= 6.0 + 1e-6
        denial = await _refuse(limiter, "a", limits=Limits(max_concurrency=1))
        assert denial.gate == "global_concurrency"

    async def test_concurrency_wait_hint_follows_the_hold_time_not_the_lease_ttl(
        self, governance_backend: GovernanceBackend
    ) -> None:
        # In-flight calls finish in milliseconds: a refusal must not tell the caller to come
        # back after the lease TTL (a dead holder's worst case), for either concurrency gate.
        limiter = _limiter(governance_backend, Limits(max_concurrency=1), lease_ttl_s=120.0)
        one = Limits(max_concurrency=1)
        held = await _admit(limiter, "a", limits=one)
        before = await _refuse(limiter, "b")
        assert before.gate == "global_concurrency"
        assert 0.0 < before.wait_s <= 1.0 + 1e-6  # nothing released yet: 1 s, not 120 s
        await held.release()
        held = await _admit(limiter, "a", limits=one)
        after = await _refuse(limiter, "b")
        assert after.gate == "global_concurrency"
        assert 0.0 < after.wait_s < 1.0  # the released lease was held for milliseconds
        await held.release()
        wide = _limiter(governance_backend, lease_ttl_s=120.0)
        first = await _admit(wide, "s", limits=one)
        await first.release()
        second = await _admit(wide, "s", limits=one)
        denial = await _refuse(wide, "s", limits=one)
        assert denial.gate == "source_concurrency"
        assert 0.0 < denial.wait_s < 1.0
        await second.release()
        if governance_backend.supports_fake_time:
            # Held 0.3 s: the next hint is that hold time.
            clock = governance_backend.clock
            third = await _admit(wide, "t", limits=one)
            clock.advance(0.3)
            await third.release()
            fourth = await _admit(wide, "t", limits=one)
            assert (await _refuse(wide, "t", limits=one)).wait_s == pytest.approx(0.3)
            await fourth.release()

    async def test_rpm_window_rolls_over_after_the_wait_hint(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend, Limits(rpm=2))
        await _admit(limiter, "a")
        await _admit(limiter, "b")
        denial = await _refuse(limiter, "a")
        assert denial.gate == "global_rpm"
        clock.advance(denial.wait_s - 0.5)
        assert (await _refuse(limiter, "a")).gate == "global_rpm"
        clock.advance(0.5 + 1e-3)
        await _admit(limiter, "a")
        assert (await limiter.source_stats("a")).rpm_used == 1

    async def test_tpm_window_rolls_over_after_the_wait_hint(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        await _window_headroom(governance_backend, 5.0)
        limiter = _limiter(governance_backend)
        hundred = Limits(tpm=100)
        await _admit(limiter, "a", 100, hundred)
        denial = await _refuse(limiter, "a", 1, hundred)
        assert denial.gate == "source_tpm"
        clock.advance(denial.wait_s + 1e-3)
        await _admit(limiter, "a", 100, hundred)

    @pytest.mark.parametrize("gate", ["global_tpm", "source_tpm"])
    async def test_settle_lands_in_the_acquire_time_window(
        self, governance_backend: GovernanceBackend, gate: str
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        await _window_headroom(governance_backend, 5.0)
        thousand = Limits(tpm=1000)
        if gate == "global_tpm":
            limiter = _limiter(governance_backend, thousand, lease_ttl_s=3 * WINDOW_S)
            thousand = NO_LIMITS
        else:
            limiter = _limiter(governance_backend, lease_ttl_s=3 * WINDOW_S)
        early = await _admit(limiter, "a", 500, thousand)
        clock.advance(WINDOW_S)  # next window
        await _admit(limiter, "a", 600, thousand)
        await early.settle(0)  # refunds 500 to the old window, not to this one
        assert (await limiter.source_stats("a")).tpm_used == 600
        assert (await _refuse(limiter, "a", 401, thousand)).gate == gate
        late = await _admit(limiter, "a", 400, thousand)
        clock.advance(WINDOW_S)
        await late.settle(5000)  # overcharge lands in the old window too
        assert (await limiter.source_stats("a")).tpm_used == 0
        await _admit(limiter, "a", 1000, thousand)

    async def test_stats_reset_in_a_new_window(self, governance_backend: GovernanceBackend) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        limiter = _limiter(governance_backend, lease_ttl_s=3 * WINDOW_S)
        permit = await _admit(limiter, "a", 50)
        clock.advance(WINDOW_S)
        assert await limiter.source_stats("a") == SourceStats(inflight=1, rpm_used=0, tpm_used=0)
        await permit.release()

    async def test_progress_age_follows_the_clock(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        limiter = _limiter(governance_backend)
        await limiter.mark_progress()
        clock.advance(42.0)
        assert 41.0 < await limiter.progress_age_s() < 43.0
        await limiter.mark_progress()
        assert 0.0 <= await limiter.progress_age_s() < 1.0
