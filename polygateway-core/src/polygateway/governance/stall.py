"""No source admitted an attempt this round: raise the scope-level error, or wait (M2 §4).

``quota_full = "fail_fast"`` raises at once: ``CircuitOpenError`` when only breakers keep the
sources shut, ``AllSourcesExhausted(reason="quota_exhausted")`` otherwise. ``"wait"`` sleeps
until a source may admit again (polling, with jitter; a call refused only by full concurrency
gates waits instead in the limiter's line when it has one, ``ports.QueuedAdmission``), and raises
``AllSourcesExhausted(reason="stalled")`` only on the double condition: this call has waited
past ``stall_window_s`` AND nobody sharing the limiter made progress within it (the local and
the global clock are never mixed).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from polygateway.errors import AllSourcesExhausted, CircuitOpenError, ConfigError
from polygateway.governance.cooldowns import BREAKER_REASONS, CooldownMemo
from polygateway.governance.decisions import reasons_report, scope_retry_after
from polygateway.ports import Clock, ProviderGate, RateLimiter
from polygateway.settings import BackpressureSettings

__all__ = ["Blocked", "backpressure_problems"]


def backpressure_problems(backpressure: BackpressureSettings) -> list[str]:
    problems: list[str] = []
    poll = backpressure.poll_interval_s
    if not (poll > 0 and math.isfinite(poll)):
        problems.append(f"backpressure.poll_interval_s must be > 0, got {poll!r}")
    if not backpressure.stall_window_s >= 0:
        problems.append(
            f"backpressure.stall_window_s must be >= 0, got {backpressure.stall_window_s!r}"
        )
    return problems


class Blocked:
    """The verdict for a round in which no source admitted the attempt."""

    __slots__ = (
        "_breaker",
        "_clock",
        "_fail_fast",
        "_limiter",
        "_memo",
        "_names",
        "_rng",
        "poll_interval_s",
        "stall_window_s",
    )

    def __init__(
        self,
        *,
        names: Sequence[str],
        memo: CooldownMemo,
        limiter: RateLimiter,
        breaker: ProviderGate,
        backpressure: BackpressureSettings,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        problems = backpressure_problems(backpressure)
        if problems:
            raise ConfigError(problems)
        self._names = tuple(names)
        self._memo = memo
        self._limiter = limiter
        self._breaker = breaker
        self._clock = clock
        self._rng = rng
        self._fail_fast = backpressure.quota_full == "fail_fast"
        self.stall_window_s = float(backpressure.stall_window_s)
        self.poll_interval_s = float(backpressure.poll_interval_s)

    @property
    def fail_fast(self) -> bool:
        return self._fail_fast

    async def wait_or_raise(
        self,
        entered_at: float,
        dead: set[str] | None,
        denial_wait: float | None,
        reasons: Mapping[str, str] | None,
        last_error: BaseException | None,
    ) -> None:
        """Raise the scope-level error, or sleep until a new round is worth trying.

        ``entered_at``: when the call started (monotonic); ``dead``: sources that failed as
        dead during this call; ``denial_wait``: the shortest limiter hint of this round, or
        ``None`` when no limiter refused.
        """
        earliest = await self.raise_if_due(entered_at, dead, denial_wait, reasons, last_error)
        window = self.stall_window_s
        poll = self.poll_interval_s
        if denial_wait is not None:
            # The limiter's hint is an upper bound (a release frees a slot earlier): poll.
            delay = min(denial_wait if denial_wait > 0 else poll, poll)
            if earliest is not None:
                delay = min(delay, earliest)
            delay *= self._rng.uniform(0.5, 1.5)
        elif earliest is not None:
            # Wait for the earliest reopening; the jitter spreads the waiters of one reopening.
            delay = min(earliest, window) + poll * self._rng.random()
        else:
            delay = poll * self._rng.uniform(0.5, 1.5)
        await self._clock.sleep(delay)

    async def queue_timeout(self, entered_at: float, earliest: float | None) -> float:
        """How long a call may wait in a limiter's line for a slot (``QueuedAdmission``):
        until the stall verdict may be due (the call waited past the window and nobody made
        progress within it; one poll interval later, as a polling call would see it), and
        no longer than the earliest reopening of a cooling source (``earliest``)."""
        window = self.stall_window_s
        until_window = entered_at + window - self._clock.monotonic()
        until_idle = window - await self._limiter.progress_age_s()
        timeout = max(until_window, until_idle, 0.0) + self.poll_interval_s
        return timeout if earliest is None else min(timeout, earliest)

    async def raise_if_due(
        self,
        entered_at: float,
        dead: set[str] | None,
        denial_wait: float | None,
        reasons: Mapping[str, str] | None,
        last_error: BaseException | None,
    ) -> float | None:
        """Raise the scope-level error this round calls for (see ``wait_or_raise``), if any;
        else return the earliest reopening of a cooling alive source (``None``: none cools).
        """
        names = self._names
        memo = self._memo
        if not names:
            raise AllSourcesExhausted(
                "no sources are configured for this scope", retry_after_s=0.0, reason="no_sources"
            )
        alive = names if dead is None else tuple(n for n in names if n not in dead)
        if not alive:
            raise AllSourcesExhausted(
                "every source failed as dead during this call",
                retry_after_s=await scope_retry_after(names, memo, self._breaker),
                reason="retry_exhausted",
                per_source_reasons=reasons_report(names, memo, reasons),
                last_error=last_error,
            )
        cooling = memo.cooling(alive)
        earliest = min((wait for wait, _ in cooling.values()), default=None)
        # Only the breaker keeps the sources shut: every alive source is cooling for a breaker
        # reason or was refused by its breaker this round (no limiter denial).
        breaker_only = denial_wait is None and all(
            reason in BREAKER_REASONS for _, reason in cooling.values()
        )
        if self._fail_fast:
            if breaker_only:
                # The local memo is the sooner hint when a source is half-open: its probe's
                # verdict may come long before the probe lease runs out.
                reopen = await self._breaker.retry_after_s(names)
                raise CircuitOpenError(
                    "every source's circuit breaker is open",
                    retry_after_s=reopen if earliest is None else min(reopen, earliest),
                    reason="circuit_open",
                    per_source_reasons=reasons_report(names, memo, reasons),
                    last_error=last_error,
                )
            hints = [w for w in (denial_wait, earliest) if w is not None]
            raise AllSourcesExhausted(
                "no source has quota right now (quota_full=fail_fast)",
                retry_after_s=min(hints, default=0.0),
                reason="quota_exhausted",
                per_source_reasons=reasons_report(names, memo, reasons),
                last_error=last_error,
            )
        # wait: stalled only when this call waited past the window AND nobody anywhere made
        # progress within it (M2 §4: both conditions, local and global clocks never mixed).
        window = self.stall_window_s
        if (
            self._clock.monotonic() - entered_at > window
            and await self._limiter.progress_age_s() > window
        ):
            raise AllSourcesExhausted(
                f"no progress for more than stall_window_s={window:g}s",
                retry_after_s=await self._breaker.retry_after_s(names),
                reason="stalled",
                per_source_reasons=reasons_report(names, memo, reasons),
                last_error=last_error,
            )
        return earliest
