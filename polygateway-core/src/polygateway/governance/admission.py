"""One attempt on one source: breaker gate -> limiter permit -> ``attempt`` -> verdicts.

The breaker is asked first (a shut source costs no limiter round trip), then the limiter
(global + source gates); a limiter offering ``ports.JointAdmission`` for this breaker asks
both in one step (one round trip to a shared backend), with the same results. A half-open
probe must end with a verdict or be handed back, whatever happens, cancellation included; the
permit is released in ``finally``. The verdict per error class is the breaker column of
``polygateway.governance.decisions``.

Admission-side backend failures (``try_enter``, ``try_acquire``) raise
``GovernanceBackendError`` out of the call (fail closed); accounting calls (``settle``,
``release``, ``release_probe``, ``record_*``, ``mark_progress``) and observers only warn, so
they never mask the call's result or its exception (M2 §10).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

from polygateway.errors import ResultInvalidError, SourceDeadError, TransientError
from polygateway.governance.attempts import Attempt, AttemptObserver, GovernanceEvents, Outcome
from polygateway.governance.cooldowns import CooldownMemo
from polygateway.ids import elapsed_ms, new_call_id
from polygateway.ports import (
    Clock,
    Denial,
    GateDecision,
    JointAdmission,
    Permit,
    ProviderGate,
    QueuedAdmission,
    RateLimiter,
    ScopedGates,
)
from polygateway.settings import BreakerSettings, SourceConfig, effective_fail_threshold
from polygateway.types import admitted_event

__all__ = ["Admission", "gate_key", "scope_breaker"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def gate_key(limiter: RateLimiter, scope: str | None, source: str) -> str:
    """The limiter key of ``source`` of ``scope`` (ARCHITECTURE §7.7: gates are per scope
    and source).

    A limiter that can name its owner scope (``claim_scope``: the builtin memory and the Redis
    limiter) keys its owner's sources by their bare names and another scope's by
    ``<scope>:<name>``, so two roles sharing one limiter share its global gates but each keeps
    its own per-source gates, even for same-named sources. Other limiters get the bare name.
    """
    claim = getattr(limiter, "claim_scope", None)
    if scope is None or claim is None:
        return source
    return source if claim(scope) == scope else f"{scope}:{source}"


def scope_breaker(breaker: ProviderGate, scope: str | None) -> ProviderGate:
    """The gate holding ``scope``'s sources in ``breaker`` (ARCHITECTURE §7.7: breaker state is
    per scope and source, like the limiter's per-source gates).

    A breaker that can keep scopes apart (``ports.ScopedGates``: the builtin memory and the
    Redis gate) answers with its gate for ``scope``, so same-named sources of two roles
    sharing one breaker never open each other. Other breakers, or no scope, as they are.
    """
    # Looked up on the class: a wrapper forwarding unknown attributes to the gate it wraps
    # (``__getattr__``) would hand out the inner gate and be bypassed.
    if scope is None or getattr(type(breaker), "for_scope", None) is None:
        return breaker
    return cast(ScopedGates, breaker).for_scope(scope)


class Admission:
    """Gate, permit and accounting of single attempts, shared by all calls of one governor.

    Holds the local in-flight count per source (what the selector balances on) and the
    effective breaker threshold per source (ARCHITECTURE §7.4: ``max(configured,
    concurrency * 2)``).
    """

    __slots__ = (
        "_breaker",
        "_clock",
        "_gate_keys",
        "_joint",
        "_limiter",
        "_memo",
        "_progress_every_s",
        "_progress_marked_at",
        "_queue",
        "_thresholds",
        "_warned",
        "inflight",
        "on_open",
    )

    def __init__(
        self,
        *,
        sources: Sequence[SourceConfig],
        limiter: RateLimiter,
        breaker: ProviderGate,
        breaker_settings: BreakerSettings,
        memo: CooldownMemo,
        clock: Clock,
        stall_window_s: float,
        scope: str | None = None,
    ) -> None:
        self._limiter = limiter
        self._gate_keys = {s.name: gate_key(limiter, scope, s.name) for s in sources}
        self._breaker = breaker
        # Gate and limiter asked in one backend round trip when the limiter can (Redis); that
        # step keys the limiter by the bare source name, so not for another scope's sources.
        bare = all(key == name for name, key in self._gate_keys.items())
        self._joint = (
            limiter.joint_with(breaker) if bare and isinstance(limiter, JointAdmission) else None
        )
        # A limiter that keeps refused calls in line for a slot (memory): waited on instead
        # of polled.
        self._queue = limiter if isinstance(limiter, QueuedAdmission) else None
        self._memo = memo
        self._clock = clock
        self._thresholds: dict[str, int] = {
            s.name: effective_fail_threshold(breaker_settings.fail_threshold, s) for s in sources
        }
        self.inflight: dict[str, int] = {s.name: 0 for s in sources}
        # Progress is a liveness signal read against windows of minutes: marking it at most
        # every ``_progress_every_s`` spares a backend round trip on most calls.
        self._progress_every_s = min(1.0, stall_window_s / 10.0)
        self._progress_marked_at = -math.inf
        self._warned: set[tuple[str, str]] = set()
        self.on_open: Callable[[str], None] | None = None
        """Told the name of a source found open (refused, or opened by a failure)."""

    @property
    def queues(self) -> bool:
        """Whether a call refused by full concurrency gates can wait in the limiter's line
        (``wait_in_line``) instead of polling."""
        return self._queue is not None

    async def wait_in_line(
        self, source: SourceConfig, est_tokens: int, timeout_s: float
    ) -> Permit | Denial:
        """The limiter's permit for ``source`` once a slot is handed over (``QueuedAdmission``),
        or its refusal after ``timeout_s``; pass the permit to ``attempt``."""
        queue = self._queue
        if queue is None:
            raise RuntimeError("this limiter keeps no line (check Admission.queues)")
        return await queue.acquire_queued(
            self._gate_keys[source.name], est_tokens, source.limits, timeout_s
        )

    async def attempt(
        self,
        source: SourceConfig,
        est_tokens: int,
        attempt: Attempt[T],
        observer: AttemptObserver[T] | None,
        number: int,
        events: GovernanceEvents | None = None,
        permit: Permit | None = None,
    ) -> Outcome[T] | Denial | GateDecision:
        """Admission then one ``attempt`` on ``source``, the call's attempt ``number``.

        Returns the call's ``Outcome``, or the refusal (the limiter's ``Denial`` or the
        breaker's not-allowed ``GateDecision``); raises the attempt's error after the breaker
        verdict. ``permit``: the limiter's permit already taken (``wait_in_line``); it is
        released whatever happens, a breaker refusal included.
        """
        name = source.name
        breaker = self._breaker
        joint = self._joint
        admitted: Permit | Denial | None = permit
        if permit is not None:
            try:
                decision = await breaker.try_enter(name)
            except BaseException:
                await self._release(permit)
                raise
            if not decision.allowed:
                await self._release(permit)
        elif joint is None:
            decision = await breaker.try_enter(name)
        else:
            decision, admitted = await joint(name, est_tokens, source.limits)
        if not decision.allowed:
            if self.on_open is not None:
                self.on_open(name)
            return decision
        # A probe decision must end with a verdict or be handed back, whatever happens.
        probe_pending = decision.probe_owner is not None
        try:
            if admitted is None:
                admitted = await self._limiter.try_acquire(
                    self._gate_keys[name], est_tokens, source.limits
                )
            if isinstance(admitted, Denial):
                return admitted
            permit = admitted
            if events is not None:
                self._admitted(events, name, decision)
            clock = self._clock
            call_id = new_call_id()
            inflight = self.inflight
            inflight[name] += 1
            started = clock.monotonic()
            try:
                attempted = await attempt(source, call_id)
                tokens = attempted.tokens
                if tokens is not None and tokens != permit.est_tokens:
                    try:
                        await permit.settle(tokens)
                    except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
                        self._warn("permit.settle", exc)
            except asyncio.CancelledError as exc:
                self._observe(observer, source, call_id, exc, started)
                raise
            except TransientError as exc:
                self._observe(observer, source, call_id, exc, started)
                # The est pre-charge stays as the TPM charge: the upstream reported no usage.
                await self._record_failure(decision, threshold=self._thresholds[name])
                probe_pending = False
                raise
            except SourceDeadError as exc:
                self._observe(observer, source, call_id, exc, started)
                await self._record_failure(decision, force_open=True)
                probe_pending = False
                raise
            except ResultInvalidError as exc:
                # A bad result is not a bad service (ARCHITECTURE §6.3).
                self._observe(observer, source, call_id, exc, started)
                await self._record_success(decision)
                probe_pending = False
                raise
            except Exception as exc:
                # RequestRejectedError (not counted) or a bug of the call kind: no verdict;
                # the probe is handed back in the outer finally.
                self._observe(observer, source, call_id, exc, started)
                raise
            finally:
                inflight[name] -= 1
                try:
                    await permit.release()
                except Exception as exc:  # noqa: BLE001 - release side degrades (M2 §10)
                    self._warn("permit.release", exc)
            if observer is not None:
                self._observe(observer, source, call_id, attempted.value, started)
            # The accounting calls are inlined on this path: it runs on every call.
            try:
                await breaker.record_success(decision)
            except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
                self._warn("breaker.record_success", exc)
            probe_pending = False
            memo = self._memo
            if memo:
                memo.forget(name)  # the source answered: what was remembered is stale
            now = clock.monotonic()
            if now - self._progress_marked_at >= self._progress_every_s:
                self._progress_marked_at = now
                try:
                    await self._limiter.mark_progress()
                except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
                    self._warn("limiter.mark_progress", exc)
            return Outcome(attempted.value, source, call_id, number)
        finally:
            if probe_pending:
                await self._release_probe(decision)

    # ------------------------------------------------------------------ accounting (warn only)

    def _observe(
        self,
        observer: AttemptObserver[T] | None,
        source: SourceConfig,
        call_id: str,
        outcome: T | BaseException,
        started: float,
    ) -> None:
        if observer is None:
            return
        try:
            observer.on_attempt(
                source, call_id, outcome, elapsed_ms(started, self._clock.monotonic())
            )
        except Exception as exc:  # noqa: BLE001 - an observer must never break the call
            self._warn("attempt observer", exc)

    def _admitted(self, events: GovernanceEvents, name: str, decision: GateDecision) -> None:
        try:
            events(admitted_event(name, decision.state, decision.is_probe))
        except Exception as exc:  # noqa: BLE001 - an observer must never break the call
            self._warn("governance events observer", exc)

    async def _release(self, permit: Permit) -> None:
        try:
            await permit.release()
        except Exception as exc:  # noqa: BLE001 - release side degrades (M2 §10)
            self._warn("permit.release", exc)

    async def _release_probe(self, decision: GateDecision) -> None:
        try:
            await self._breaker.release_probe(decision)
        except Exception as exc:  # noqa: BLE001 - release side degrades (M2 §10)
            self._warn("breaker.release_probe", exc)

    async def _record_success(self, decision: GateDecision) -> None:
        try:
            await self._breaker.record_success(decision)
        except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
            self._warn("breaker.record_success", exc)

    async def _record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> None:
        try:
            update = await self._breaker.record_failure(
                decision, threshold=threshold, force_open=force_open
            )
        except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
            self._warn("breaker.record_failure", exc)
            return
        if update.state == "open" and self.on_open is not None:
            self.on_open(decision.source)

    def _warn(self, operation: str, exc: Exception) -> None:
        """One warning per (operation, error class); repeats go to debug to spare the log."""
        cause = (operation, type(exc).__name__)
        if cause in self._warned:
            logger.debug("%s failed again: %s: %s", operation, type(exc).__name__, exc)
            return
        self._warned.add(cause)
        logger.warning(
            "%s failed (%s: %s); the call continues, governance accounting may lag",
            operation,
            type(exc).__name__,
            exc,
        )

    @property
    def thresholds(self) -> Mapping[str, int]:
        """The effective breaker threshold per source."""
        return self._thresholds
