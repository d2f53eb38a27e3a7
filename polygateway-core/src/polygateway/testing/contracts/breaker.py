"""The circuit breaker contract (``ports.ProviderGate``), the same for every backend.

Probe tests that need no waiting use ``cooldown_s=0``: an opened source then hands out its
probe on the very next ``try_enter``. Tests that move time call ``_require_fake_time`` first,
so a backend without an injectable clock skips them before touching any state.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from polygateway.ports import GateDecision, GateUpdate, ProviderGate, ScopedGates

if TYPE_CHECKING:
    from polygateway.testing.contracts import GovernanceBackend

THRESHOLD = 3
COOLDOWN_S = 30.0
PROBE_TTL_S = 60.0
ODD_SOURCE_NAMES = ("a", "a:b", "{a}", "a}", "{", "a b", "line\nbreak", "源-1", "a:b:c")


def _require_fake_time(backend: GovernanceBackend) -> None:
    if not backend.supports_fake_time:
        reason = getattr(backend.clock, "reason", "time-dependent: needs an injectable clock")
        pytest.skip(reason)


def _gate(
    backend: GovernanceBackend,
    *,
    fail_threshold: int = THRESHOLD,
    cooldown_s: float = COOLDOWN_S,
    probe_ttl_s: float = PROBE_TTL_S,
) -> ProviderGate:
    return backend.make_breaker(
        fail_threshold=fail_threshold, cooldown_s=cooldown_s, probe_ttl_s=probe_ttl_s
    )


async def _enter(gate: ProviderGate, source: str) -> GateDecision:
    decision = await gate.try_enter(source)
    assert decision.allowed, f"expected {source!r} to admit, got {decision!r}"
    assert decision.source == source
    return decision


async def _refused(gate: ProviderGate, source: str) -> GateDecision:
    decision = await gate.try_enter(source)
    assert not decision.allowed, f"expected {source!r} to refuse, got {decision!r}"
    assert decision.probe_owner is None
    return decision


async def _probe(gate: ProviderGate, source: str) -> GateDecision:
    decision = await _enter(gate, source)
    assert decision.state == "half_open" and decision.is_probe, decision
    return decision


async def _open_and_probe(gate: ProviderGate, source: str) -> GateDecision:
    """Open ``source`` and take its probe (needs ``cooldown_s=0``)."""
    update = await gate.force_open(source)
    assert update.applied and update.state == "open"
    return await _probe(gate, source)


async def _probe_after_cooldown(
    backend: GovernanceBackend, gate: ProviderGate, source: str
) -> GateDecision:
    """Let the cooldown of ``source`` pass (the fake clock, or real time), then take the probe."""
    for _ in range(100):
        decision = await gate.try_enter(source)
        if decision.allowed:
            assert decision.is_probe, decision
            return decision
        if backend.supports_fake_time:
            backend.clock.advance(decision.retry_after_s)
        else:
            await asyncio.sleep(decision.retry_after_s)  # server time: the cooldown itself
    raise AssertionError(f"{source!r} never handed out its probe")


def _fenced(update: GateUpdate, state: str, epoch: int) -> None:
    assert not update.applied, f"expected a fenced write-back, got {update!r}"
    assert (update.state, update.epoch) == (state, epoch), update


class BreakerContract:
    """Semantics every ``ProviderGate`` backend shares (ARCHITECTURE §7.4, M2 §3)."""

    # ------------------------------------------------------------------ closed

    async def test_a_new_source_is_closed_and_admits(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        assert await gate.state("a") == "closed"
        decision = await _enter(gate, "a")
        assert decision.state == "closed"
        assert not decision.is_probe
        assert decision.retry_after_s == 0.0
        assert isinstance(decision.epoch, int)

    async def test_threshold_consecutive_failures_open_the_gate(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        decision = await _enter(gate, "a")
        epoch = decision.epoch
        for failures in range(1, THRESHOLD):
            update = await gate.record_failure(decision)
            assert update == GateUpdate("a", True, "closed", epoch, failures)
        update = await gate.record_failure(decision)
        assert update == GateUpdate("a", True, "open", epoch + 1, THRESHOLD)
        assert await gate.state("a") == "open"
        refused = await _refused(gate, "a")
        assert refused.state == "open"
        assert refused.epoch == epoch + 1
        assert 0.0 < refused.retry_after_s <= COOLDOWN_S

    async def test_success_in_closed_resets_the_failure_count(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        for _ in range(THRESHOLD - 1):
            await gate.record_failure(await _enter(gate, "a"))
        update = await gate.record_success(await _enter(gate, "a"))
        assert (update.applied, update.state, update.failures) == (True, "closed", 0)
        for _ in range(THRESHOLD - 1):
            update = await gate.record_failure(await _enter(gate, "a"))
        assert update.state == "closed"
        assert await gate.state("a") == "closed"

    async def test_threshold_argument_overrides_the_configured_one(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, fail_threshold=2)
        for failures in range(1, 5):
            update = await gate.record_failure(await _enter(gate, "a"), threshold=5)
            assert (update.state, update.failures) == ("closed", failures)
        update = await gate.record_failure(await _enter(gate, "a"), threshold=5)
        assert (update.applied, update.state, update.failures) == (True, "open", 5)

    @pytest.mark.parametrize("bad", [0, -1])
    async def test_a_threshold_below_one_is_refused(
        self, governance_backend: GovernanceBackend, bad: int
    ) -> None:
        gate = _gate(governance_backend)
        with pytest.raises(ValueError, match="threshold"):
            await gate.record_failure(await _enter(gate, "a"), threshold=bad)
        assert await gate.state("a") == "closed"

    async def test_a_failure_with_force_open_opens_at_once(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        decision = await _enter(gate, "a")
        update = await gate.record_failure(decision, force_open=True)
        assert update == GateUpdate("a", True, "open", decision.epoch + 1, THRESHOLD)
        await _refused(gate, "a")

    async def test_force_open_opens_a_closed_source(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        epoch = (await _enter(gate, "a")).epoch
        update = await gate.force_open("a")
        assert update == GateUpdate("a", True, "open", epoch + 1, THRESHOLD)
        refused = await _refused(gate, "a")
        assert 0.0 < refused.retry_after_s <= COOLDOWN_S

    async def test_force_open_on_an_open_source_keeps_the_epoch(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        first = await gate.force_open("a")
        second = await gate.force_open("a")
        assert second.applied
        assert (second.state, second.epoch) == ("open", first.epoch)

    async def test_force_open_on_a_never_seen_source(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        update = await gate.force_open("never-seen")
        assert (update.applied, update.state) == (True, "open")
        await _refused(gate, "never-seen")

    # ------------------------------------------------------------------ fencing

    async def test_write_backs_from_an_older_epoch_are_fenced(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        stale = await _enter(gate, "a")
        opened = await gate.force_open("a")
        _fenced(await gate.record_success(stale), "open", opened.epoch)
        _fenced(await gate.record_failure(stale), "open", opened.epoch)
        _fenced(await gate.record_failure(stale, force_open=True), "open", opened.epoch)
        assert await gate.state("a") == "open"

    async def test_an_old_decision_is_fenced_after_the_gate_closed_again(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        stale = await _enter(gate, "a")
        probe = await _open_and_probe(gate, "a")
        closed = await gate.record_success(probe)
        assert (closed.applied, closed.state, closed.failures) == (True, "closed", 0)
        assert closed.epoch == stale.epoch + 1
        update = await gate.record_failure(stale, force_open=True)
        _fenced(update, "closed", closed.epoch)
        assert update.failures == 0
        # A fresh decision of the new epoch is applied.
        fresh = await _enter(gate, "a")
        assert (fresh.state, fresh.epoch) == ("closed", closed.epoch)
        assert (await gate.record_failure(fresh)).applied

    async def test_a_refused_decision_cannot_be_written_back(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        await gate.force_open("a")
        refused = await _refused(gate, "a")
        with pytest.raises(ValueError):
            await gate.record_success(refused)
        with pytest.raises(ValueError):
            await gate.record_failure(refused)
        with pytest.raises(ValueError):
            await gate.record_failure(refused, force_open=True)
        await gate.release_probe(refused)  # nothing to hand back: a no-op
        assert await gate.state("a") == "open"

    async def test_a_forged_refused_decision_on_a_closed_source_raises(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        epoch = (await _enter(gate, "a")).epoch
        forged = GateDecision("a", False, "closed", epoch)
        with pytest.raises(ValueError):
            await gate.record_success(forged)
        with pytest.raises(ValueError):
            await gate.record_failure(forged, force_open=True)
        assert await gate.state("a") == "closed"

    # ------------------------------------------------------------------ half-open, probe

    async def test_half_open_admits_exactly_one_probe(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        opened = await gate.force_open("a")
        probe = await _probe(gate, "a")
        assert probe.epoch == opened.epoch
        assert isinstance(probe.probe_owner, str) and probe.probe_owner
        for _ in range(3):
            refused = await _refused(gate, "a")
            assert refused.state == "half_open"
            assert 0.0 < refused.retry_after_s <= PROBE_TTL_S
        assert await gate.state("a") == "half_open"

    async def test_concurrent_callers_get_exactly_one_probe(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        await gate.force_open("a")
        decisions = await asyncio.gather(*(gate.try_enter("a") for _ in range(50)))
        allowed = [d for d in decisions if d.allowed]
        assert len(allowed) == 1
        assert allowed[0].is_probe

    async def test_a_successful_probe_closes_the_gate(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        probe = await _open_and_probe(gate, "a")
        update = await gate.record_success(probe)
        assert update == GateUpdate("a", True, "closed", probe.epoch, 0)
        assert await gate.state("a") == "closed"
        after = await _enter(gate, "a")
        assert (after.state, after.epoch, after.is_probe) == ("closed", probe.epoch, False)
        # The probe's verdict is spent: writing it back again is fenced.
        _fenced(await gate.record_success(probe), "closed", probe.epoch)
        _fenced(await gate.record_failure(probe), "closed", probe.epoch)

    async def test_a_failed_probe_reopens_at_the_threshold(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        probe = await _open_and_probe(gate, "a")
        update = await gate.record_failure(probe)
        assert update == GateUpdate("a", True, "open", probe.epoch + 1, THRESHOLD)
        assert await gate.state("a") == "open"
        # A failed probe of an overridden threshold jumps to that threshold.
        probe = await _probe(gate, "a")
        assert probe.epoch == update.epoch
        update = await gate.record_failure(probe, threshold=7)
        assert (update.state, update.epoch, update.failures) == ("open", probe.epoch + 1, 7)

    async def test_failed_probes_in_a_row_grow_the_cooldown_to_its_cap(
        self, governance_backend: GovernanceBackend
    ) -> None:
        # Short real cooldowns, so that a backend on server time runs it too.
        gate = governance_backend.make_breaker(
            fail_threshold=THRESHOLD, cooldown_s=0.05, probe_ttl_s=PROBE_TTL_S, max_cooldown_s=0.2
        )
        await gate.force_open("a")
        waits = []
        for _ in range(3):
            probe = await _probe_after_cooldown(governance_backend, gate, "a")
            await gate.record_failure(probe)
            waits.append((await _refused(gate, "a")).retry_after_s)
        assert 0.05 < waits[0] <= 0.1 + 1e-3  # doubled once
        assert 0.1 < waits[1] <= 0.2 + 1e-3  # doubled again, at the cap
        assert 0.1 < waits[2] <= 0.2 + 1e-3  # capped
        # A successful probe closes the gate and forgets the streak: the next opening is short.
        probe = await _probe_after_cooldown(governance_backend, gate, "a")
        await gate.record_success(probe)
        await gate.force_open("a")
        assert (await _refused(gate, "a")).retry_after_s <= 0.05 + 1e-3

    async def test_probe_owners_are_unique(self, governance_backend: GovernanceBackend) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        owners = set()
        probe = await _open_and_probe(gate, "a")
        for _ in range(10):
            owners.add(probe.probe_owner)
            await gate.release_probe(probe)
            probe = await _probe(gate, "a")
        owners.add(probe.probe_owner)
        assert len(owners) == 11

    async def test_release_probe_hands_the_probe_over_at_once(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        first = await _open_and_probe(gate, "a")
        await gate.release_probe(first)
        second = await _probe(gate, "a")
        assert second.probe_owner != first.probe_owner
        assert second.epoch == first.epoch  # handing over is not a new epoch
        _fenced(await gate.record_success(first), "half_open", first.epoch)
        await gate.release_probe(first)  # no longer the holder: must not free ``second``
        await _refused(gate, "a")
        update = await gate.record_success(second)
        assert (update.applied, update.state) == (True, "closed")

    async def test_release_probe_is_a_no_op_when_there_is_nothing_to_release(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        decision = await _enter(gate, "a")
        await gate.record_failure(decision)
        await gate.release_probe(decision)  # not a probe
        update = await gate.record_failure(decision)
        assert (update.state, update.failures) == ("closed", 2)
        unknown = GateDecision("never-seen", True, "half_open", 0, probe_owner="nobody")
        await gate.release_probe(unknown)
        assert await gate.state("never-seen") == "closed"
        await _enter(gate, "never-seen")

    async def test_force_open_fences_the_probe_in_flight(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        probe = await _open_and_probe(gate, "a")
        opened = await gate.force_open("a")
        assert (opened.state, opened.epoch) == ("open", probe.epoch + 1)
        _fenced(await gate.record_success(probe), "open", opened.epoch)
        await gate.release_probe(probe)
        assert await gate.state("a") == "open"

    async def test_the_epoch_moves_only_when_entering_open(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        start = (await _enter(gate, "a")).epoch
        epochs = []
        decision = await _enter(gate, "a")
        epochs.append((await gate.record_failure(decision)).epoch)  # closed, 1 failure
        epochs.append((await gate.record_success(decision)).epoch)  # closed, reset
        for _ in range(THRESHOLD):
            update = await gate.record_failure(await _enter(gate, "a"))
        epochs.append(update.epoch)  # -> open: +1
        probe = await _probe(gate, "a")
        epochs.append(probe.epoch)  # probe issued: same
        await gate.release_probe(probe)
        probe = await _probe(gate, "a")
        epochs.append(probe.epoch)  # handed over: same
        epochs.append((await gate.record_failure(probe)).epoch)  # probe failed -> open: +1
        probe = await _probe(gate, "a")
        epochs.append((await gate.record_success(probe)).epoch)  # -> closed: same
        epochs.append((await _enter(gate, "a")).epoch)
        assert epochs == [start, start, start + 1, start + 1, start + 1, start + 2, start + 2,
                          start + 2]  # fmt: skip

    # ------------------------------------------------------------------ retry_after_s, names

    async def test_retry_after_s_of_no_source_is_an_error(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        with pytest.raises(ValueError):
            await gate.retry_after_s([])

    async def test_retry_after_s_is_the_shortest_wait(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        assert await gate.retry_after_s(["a"]) == 0.0
        assert await gate.retry_after_s(["never-seen"]) == 0.0
        await gate.force_open("a")
        await gate.force_open("b")
        wait = await gate.retry_after_s(["a", "b"])
        assert 0.0 < wait <= COOLDOWN_S
        assert await gate.retry_after_s(["a", "b", "c"]) == 0.0  # c is closed
        assert await gate.retry_after_s(("a",)) > 0.0

    async def test_retry_after_s_for_a_held_probe(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend, cooldown_s=0.0)
        probe = await _open_and_probe(gate, "a")
        assert 0.0 < await gate.retry_after_s(["a"]) <= PROBE_TTL_S
        await gate.release_probe(probe)
        assert await gate.retry_after_s(["a"]) == 0.0

    async def test_sources_have_independent_gates(
        self, governance_backend: GovernanceBackend
    ) -> None:
        gate = _gate(governance_backend)
        for name in ODD_SOURCE_NAMES[1:]:
            await _enter(gate, name)
        await gate.force_open(ODD_SOURCE_NAMES[0])
        for name in ODD_SOURCE_NAMES[1:]:
            assert await gate.state(name) == "closed"
            await gate.record_failure(await _enter(gate, name))
        await _refused(gate, ODD_SOURCE_NAMES[0])
        for name in ODD_SOURCE_NAMES[1:]:
            update = await gate.record_failure(await _enter(gate, name))
            assert (update.state, update.failures) == ("closed", 2), name
        await gate.force_open("a:b")
        assert await gate.state("a:b:c") == "closed"
        assert await gate.state("{a}") == "closed"

    # ------------------------------------------------------------------ scopes

    async def test_another_scopes_gate_keeps_same_named_sources_apart(
        self, governance_backend: GovernanceBackend
    ) -> None:
        """``ports.ScopedGates`` (optional): another scope's gate is its own, the same each
        time, and the owner's open source is closed there. Only read on the other scope's
        gate: its state lives outside what ``cleanup`` removes."""
        gate = _gate(governance_backend)
        if not isinstance(gate, ScopedGates):
            pytest.skip("the gate keeps no per-scope state (no for_scope)")
        # The owner scope (a gate built without one is claimed by the first to ask) gets the
        # gate itself.
        assert gate.for_scope(getattr(gate, "scope", None) or "contract-owner") is gate
        other = gate.for_scope("contract-other-scope")
        assert other is not gate
        assert gate.for_scope("contract-other-scope") is other
        assert isinstance(other, ScopedGates) and other.for_scope("contract-other-scope") is other
        await gate.force_open("a")
        assert await gate.state("a") == "open"
        assert await other.state("a") == "closed"
        decision = await _enter(other, "a")
        assert decision.state == "closed"
        assert await other.retry_after_s(["a"]) == 0.0

    # ------------------------------------------------------------------ time-dependent

    async def test_the_first_caller_after_the_cooldown_is_the_probe(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        gate = _gate(governance_backend)
        await gate.force_open("a")
        clock.advance(COOLDOWN_S - 1.0)
        refused = await _refused(gate, "a")
        assert refused.state == "open"
        assert 0.0 < refused.retry_after_s <= 1.0 + 1e-6
        clock.advance(1.5)
        await _probe(gate, "a")
        assert (await _refused(gate, "a")).state == "half_open"

    async def test_a_failed_probe_waits_a_full_cooldown_again(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        gate = _gate(governance_backend)
        await gate.force_open("a")
        clock.advance(COOLDOWN_S + 1.0)
        probe = await _probe(gate, "a")
        await gate.record_failure(probe)
        refused = await _refused(gate, "a")
        assert refused.state == "open"
        assert COOLDOWN_S - 1.0 < refused.retry_after_s <= COOLDOWN_S
        clock.advance(COOLDOWN_S - 1.0)
        await _refused(gate, "a")
        clock.advance(1.5)
        later = await _probe(gate, "a")
        _fenced(await gate.record_success(probe), "half_open", later.epoch)

    async def test_a_lapsed_probe_is_reissued(self, governance_backend: GovernanceBackend) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        gate = _gate(governance_backend, cooldown_s=0.0)
        vanished = await _open_and_probe(gate, "a")
        clock.advance(PROBE_TTL_S - 1.0)
        refused = await _refused(gate, "a")
        assert 0.0 < refused.retry_after_s <= 1.0 + 1e-6
        clock.advance(1.5)
        assert await gate.retry_after_s(["a"]) == 0.0
        reissued = await _probe(gate, "a")
        assert reissued.probe_owner != vanished.probe_owner
        assert reissued.epoch == vanished.epoch
        _fenced(await gate.record_success(vanished), "half_open", vanished.epoch)
        _fenced(await gate.record_failure(vanished), "half_open", vanished.epoch)
        update = await gate.record_success(reissued)
        assert (update.applied, update.state) == (True, "closed")

    async def test_retry_after_s_tracks_the_clock_and_never_goes_negative(
        self, governance_backend: GovernanceBackend
    ) -> None:
        _require_fake_time(governance_backend)
        clock = governance_backend.clock
        gate = _gate(governance_backend)
        await gate.force_open("a")
        clock.advance(10.0)
        await gate.force_open("b")
        assert await gate.retry_after_s(["a", "b"]) == pytest.approx(COOLDOWN_S - 10.0)
        assert await gate.retry_after_s(["b"]) == pytest.approx(COOLDOWN_S)
        clock.advance(COOLDOWN_S * 3)
        assert await gate.retry_after_s(["a", "b"]) == 0.0
        assert await gate.state("a") == "open"  # stored state moves on the next try_enter
        await _probe(gate, "a")
