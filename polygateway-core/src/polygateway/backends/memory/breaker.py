"""The in-process circuit breaker (``ports.ProviderGate``), one state record per source.

Same algorithm as the Redis backend, field for field: ``state``, ``epoch``, ``failures``,
``open_until``, ``probe_until``, ``probe_owner``. No method awaits anything, so every
operation is atomic with respect to other tasks on the event loop.

- Cooldown: ``cooldown_s`` after the threshold opens the gate, doubling on every failed probe
  in a row up to ``max_cooldown_s`` (default: no growth); a successful probe resets it, so a
  source that recovers comes back after a short cooldown and a dead one is not probed often.
- closed: every caller passes; consecutive failures count; ``threshold`` failures -> open.
- open: refused until ``open_until`` (cooldown); the first caller after it becomes the probe.
- half_open: exactly one probe, leased until ``probe_until``; when the lease runs out without
  a verdict (the holder vanished) the next caller gets a new probe (lazy reissue).
- The epoch increments only when entering open. A write-back is applied only when it quotes
  the current epoch and, for a probe, the current probe owner; otherwise it is fenced
  (``applied=False``, state untouched).

State is per scope and source (``ports.ScopedGates``): the gate holds the sources of the scope
it was built for (else of the first scope that asks); ``for_scope`` gives every other scope
sharing it a gate of its own, so same-named sources of two roles never open each other.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence

from polygateway.ports import Clock, GateDecision, GateState, GateUpdate
from polygateway.validation import check_max_cooldown, check_threshold, grown_cooldown


class _GateRecord:
    __slots__ = (
        "clean_success",
        "closed_decision",
        "epoch",
        "failures",
        "open_until",
        "probe_owner",
        "probe_until",
        "state",
        "streak",
    )

    def __init__(self, source: str) -> None:
        self.state: GateState = "closed"
        self.epoch = 0
        self.failures = 0
        self.open_until = 0.0
        self.probe_until = 0.0
        self.probe_owner: str | None = None
        self.streak = 0  # failed probes in a row: the cooldown's doublings
        # Immutable answers shared by every caller of the epoch: the closed path, taken by
        # nearly every call, then allocates nothing.
        self.closed_decision = GateDecision(source, True, "closed", 0)
        self.clean_success = GateUpdate(source, True, "closed", 0, 0)

    def close(self, source: str) -> None:
        self.state = "closed"
        self.failures = 0
        self.streak = 0
        self.probe_owner = None
        self.probe_until = 0.0
        self.closed_decision = GateDecision(source, True, "closed", self.epoch)
        self.clean_success = GateUpdate(source, True, "closed", self.epoch, 0)


class InMemoryGate:
    """``ports.ProviderGate`` for one process. Time comes from ``clock.monotonic()``."""

    __slots__ = (
        "_clock",
        "_cooldown_s",
        "_fail_threshold",
        "_max_cooldown_s",
        "_probe_ttl_s",
        "_records",
        "_scope",
        "_scopes",
    )

    def __init__(
        self,
        *,
        fail_threshold: int,
        cooldown_s: float,
        probe_ttl_s: float,
        clock: Clock,
        max_cooldown_s: float | None = None,
        scope: str | None = None,
    ) -> None:
        """``scope``: the scope this gate is built for (``None``: the first scope whose client
        is assembled on it, ``for_scope``)."""
        check_threshold(fail_threshold, "fail_threshold")
        if not (cooldown_s >= 0.0 and math.isfinite(cooldown_s)):
            raise ValueError(f"cooldown_s must be a finite number >= 0, got {cooldown_s!r}")
        self._max_cooldown_s = check_max_cooldown(cooldown_s, max_cooldown_s)
        if not (probe_ttl_s > 0.0 and math.isfinite(probe_ttl_s)):
            raise ValueError(f"probe_ttl_s must be a finite number > 0, got {probe_ttl_s!r}")
        self._fail_threshold = fail_threshold
        self._cooldown_s = float(cooldown_s)
        self._probe_ttl_s = float(probe_ttl_s)
        self._clock = clock
        self._records: dict[str, _GateRecord] = {}
        self._scope = scope
        # scope -> its gate, shared by this gate and every gate ``for_scope`` made from it.
        self._scopes: dict[str, InMemoryGate] = {} if scope is None else {scope: self}

    @property
    def scope(self) -> str | None:
        """The owner scope (``None`` until a scope asks for its gate)."""
        return self._scope

    def for_scope(self, scope: str) -> InMemoryGate:
        """The gate of ``scope``'s sources: this one for the owner scope (the one given at
        construction, else the first to ask), else that scope's own, the same each time."""
        scopes = self._scopes
        if self._scope is None and not scopes:
            self._scope = scope
            scopes[scope] = self
        gate = scopes.get(scope)
        if gate is None:
            gate = scopes[scope] = InMemoryGate(
                fail_threshold=self._fail_threshold,
                cooldown_s=self._cooldown_s,
                probe_ttl_s=self._probe_ttl_s,
                clock=self._clock,
                max_cooldown_s=self._max_cooldown_s,
                scope=scope,
            )
            gate._scopes = scopes
        return gate

    # ------------------------------------------------------------------ admission

    async def try_enter(self, source: str) -> GateDecision:
        record = self._records.get(source)
        if record is None:
            record = self._records[source] = _GateRecord(source)
        if record.state == "closed":
            return record.closed_decision
        now = self._clock.monotonic()
        if record.state == "open":
            if now < record.open_until:
                return GateDecision(
                    source, False, "open", record.epoch, retry_after_s=record.open_until - now
                )
        elif record.probe_owner is not None and now < record.probe_until:
            return GateDecision(
                source, False, "half_open", record.epoch, retry_after_s=record.probe_until - now
            )
        # Cooldown over, or the probe lease is free or lapsed: this caller is the probe.
        owner = uuid.uuid4().hex
        record.state = "half_open"
        record.probe_owner = owner
        record.probe_until = now + self._probe_ttl_s
        return GateDecision(source, True, "half_open", record.epoch, probe_owner=owner)

    async def retry_after_s(self, sources: Sequence[str]) -> float:
        if isinstance(sources, str):
            raise ValueError("retry_after_s needs a sequence of source names, not one string")
        if not sources:
            raise ValueError("retry_after_s needs at least one source name")
        now = self._clock.monotonic()
        shortest = math.inf
        for source in sources:
            record = self._records.get(source)
            if record is None or record.state == "closed":
                return 0.0
            if record.state == "open":
                wait = record.open_until - now
            elif record.probe_owner is not None:
                wait = record.probe_until - now
            else:
                wait = 0.0
            shortest = min(shortest, wait)
        return max(0.0, shortest)

    async def state(self, source: str) -> GateState:
        """The stored state; open -> half_open happens on the next ``try_enter``."""
        record = self._records.get(source)
        return "closed" if record is None else record.state

    # ------------------------------------------------------------------ write-backs

    async def record_success(self, decision: GateDecision) -> GateUpdate:
        # The path of nearly every call: a closed gate, a decision of the current epoch.
        record = self._records.get(decision.source)
        if (
            record is not None
            and decision.probe_owner is None
            and record.state == "closed"
            and record.epoch == decision.epoch
            and decision.allowed
        ):
            record.failures = 0
            return record.clean_success
        record = self._record_for_write_back(decision, "record_success")
        if not _holds(record, decision):
            return _snapshot(decision.source, record, applied=False)
        if decision.probe_owner is not None:
            record.close(decision.source)
        else:
            record.failures = 0
        return record.clean_success

    async def record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> GateUpdate:
        if threshold is None:
            threshold = self._fail_threshold
        else:
            check_threshold(threshold, "threshold")
        record = self._record_for_write_back(decision, "record_failure")
        if not _holds(record, decision):
            return _snapshot(decision.source, record, applied=False)
        if force_open or decision.probe_owner is not None:
            # A dead source, or a failed probe: straight back to open, for longer each time.
            if decision.probe_owner is not None:
                record.streak += 1
            self._open(record, max(record.failures, threshold))
        else:
            record.failures += 1
            if record.failures >= threshold:
                self._open(record, record.failures)
        return _snapshot(decision.source, record, applied=True)

    async def release_probe(self, decision: GateDecision) -> None:
        """Hand the probe back (no verdict): the next ``try_enter`` becomes the probe at once.

        A no-op for non-probe decisions, unknown sources and probes no longer held.
        """
        if decision.probe_owner is None:
            return
        record = self._records.get(decision.source)
        if record is not None and _holds(record, decision):
            record.probe_owner = None
            record.probe_until = 0.0

    async def force_open(self, source: str) -> GateUpdate:
        """Open now, whatever the state. Already open: the cooldown restarts, same epoch."""
        record = self._records.get(source)
        if record is None:
            record = self._records[source] = _GateRecord(source)
        failures = max(record.failures, self._fail_threshold)
        if record.state == "open":
            record.failures = failures
            record.open_until = max(
                record.open_until, self._clock.monotonic() + self._cooldown_for(record)
            )
        else:
            self._open(record, failures)
        return _snapshot(source, record, applied=True)

    async def aclose(self) -> None:
        """Nothing to close: state lives in this object."""

    # ------------------------------------------------------------------ internals

    def _record_for_write_back(self, decision: GateDecision, method: str) -> _GateRecord:
        if not decision.allowed:
            raise ValueError(
                f"{method} got a refused decision for source {decision.source!r}: "
                "only admitted attempts report an outcome"
            )
        record = self._records.get(decision.source)
        if record is None:
            record = self._records[decision.source] = _GateRecord(decision.source)
        return record

    def _open(self, record: _GateRecord, failures: int) -> None:
        record.state = "open"
        record.epoch += 1
        record.failures = failures
        record.open_until = self._clock.monotonic() + self._cooldown_for(record)
        record.probe_owner = None
        record.probe_until = 0.0

    def _cooldown_for(self, record: _GateRecord) -> float:
        return grown_cooldown(self._cooldown_s, self._max_cooldown_s, record.streak)

    def __repr__(self) -> str:
        return (
            f"InMemoryGate(fail_threshold={self._fail_threshold}, cooldown_s={self._cooldown_s}, "
            f"probe_ttl_s={self._probe_ttl_s}, scope={self._scope!r}, "
            f"sources={len(self._records)})"
        )


def _holds(record: _GateRecord, decision: GateDecision) -> bool:
    """Whether ``decision`` still speaks for the current state (the fencing rule)."""
    if decision.probe_owner is not None:
        return (
            record.state == "half_open"
            and record.epoch == decision.epoch
            and record.probe_owner == decision.probe_owner
        )
    return record.state == "closed" and record.epoch == decision.epoch


def _snapshot(source: str, record: _GateRecord, *, applied: bool) -> GateUpdate:
    return GateUpdate(source, applied, record.state, record.epoch, record.failures)
