"""The governor: one governed call of any kind, as a loop of attempts.

Each attempt picks a runnable source (not cooling in the memo, not dead for this call, not
refused this round; after a failure, another source than the one that failed when there is
one), passes that source's breaker gate and the limiter (``admission``), then runs the call
kind's ``attempt(source, call_id)``. The error class of a failed attempt decides the next step
(``decisions``); a round in which no source admitted the attempt ends in a wait or a
scope-level error (``stall``). Cancellation propagates from wherever it lands; the permit is
released and a probe handed back on the way out.

The governor knows nothing of chat: ``polygateway.chat`` is one call kind on top of it, and an
embedding or OCR client is another::

    governor = Governor(sources=..., limiter=..., breaker=..., selector=..., retry=...,
                        breaker_settings=..., backpressure=..., clock=...)

    async def attempt(source: SourceConfig, call_id: str) -> Attempted[Vectors]:
        result = await transport.embed(texts=texts, source=source, call_id=call_id)
        return Attempted(result.vectors, tokens=result.prompt_tokens)

    outcome = await governor.run(attempt, est_tokens=estimate)
    outcome.value, outcome.source.name, outcome.call_id, outcome.attempts
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from polygateway.errors import (
    AllSourcesExhausted,
    ConfigError,
    ContentFilterError,
    ContextWindowExceededError,
    ScopeUnavailableError,
    SourceDeadError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.governance.admission import Admission, scope_breaker
from polygateway.governance.attempts import Attempt, AttemptObserver, GovernanceEvents, Outcome
from polygateway.governance.cooldowns import CooldownMemo
from polygateway.governance.decisions import (
    Backoff,
    exhausted_error,
    noted,
    reasons_report,
    retry_after_hint,
    scope_retry_after,
)
from polygateway.governance.health import HealthProber
from polygateway.governance.stall import Blocked, backpressure_problems
from polygateway.ports import (
    Clock,
    Denial,
    GateDecision,
    Permit,
    ProviderGate,
    RateLimiter,
    SourceSelector,
)
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    RetrySettings,
    SourceConfig,
)
from polygateway.types import GovernanceEvent

__all__ = ["Governor", "governor_problems"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def governor_problems(
    sources: Sequence[SourceConfig], retry: RetrySettings, backpressure: BackpressureSettings
) -> list[str]:
    """What makes these settings unusable for a governor (empty list = fine)."""
    names = [s.name for s in sources]
    problems: list[str] = []
    if len(set(names)) != len(names):
        problems.append(f"source names must be unique, got {names}")
    if type(retry.max_attempts) is not int or retry.max_attempts < 1:
        problems.append(f"retry.max_attempts must be an integer >= 1, got {retry.max_attempts!r}")
    if not (retry.base_delay_s >= 0 and retry.max_delay_s >= 0):
        problems.append("retry.base_delay_s and retry.max_delay_s must be >= 0")
    if type(retry.same_source_attempts) is not int or retry.same_source_attempts < 0:
        problems.append(
            f"retry.same_source_attempts must be an integer >= 0, got "
            f"{retry.same_source_attempts!r}"
        )
    if not retry.wait_retry_after_up_to_s >= 0:
        problems.append("retry.wait_retry_after_up_to_s must be >= 0")
    if not retry.max_retry_after_s > 0:
        problems.append("retry.max_retry_after_s must be > 0")
    if retry.call_deadline_s is not None and not 0 < retry.call_deadline_s < math.inf:
        problems.append(
            f"retry.call_deadline_s must be a positive number of seconds, got "
            f"{retry.call_deadline_s!r}"
        )
    problems.extend(backpressure_problems(backpressure))
    return problems


def _same_source_eligible(exc: TransientError) -> bool:
    """5xx, 408, resets and timeouts before any token: worth one more try on the same source.
    429 never (a short Retry-After is waited instead); a stream watchdog verdict never."""
    if exc.reason == "rate_limited" or isinstance(exc, StreamLivenessTimeout):
        return False
    status = exc.status
    return status is None or status >= 500 or status == 408


class _Progress:
    """What a call with a deadline has done so far, for the error that ends it at the deadline."""

    __slots__ = ("attempts", "last_error", "reasons")

    def __init__(self) -> None:
        self.attempts = 0
        self.reasons: dict[str, str] | None = None
        self.last_error: BaseException | None = None


class _DeadlineReached(Exception):
    """Internal: the next wait would end past the call's deadline."""


class Governor:
    """Runs governed calls over one scope's sources; shared by every call of one client.

    State shared by all calls: the cooldown memo (source -> deadline and reason) and the local
    in-flight count per source. Nothing is global: two governors given the same limiter (or
    breaker) share its gates, and nothing else.

    :raises ConfigError: duplicate source names, ``max_attempts < 1``, negative delays, a
        non-positive poll interval or a negative stall window (every problem at once).
    """

    __slots__ = (
        "_admission",
        "_backoff",
        "_blocked",
        "_breaker",
        "_call_deadline_s",
        "_clock",
        "_cooldown_s",
        "_max_attempts",
        "_max_retry_after_s",
        "_memo",
        "_names",
        "_prober",
        "_same_source_attempts",
        "_selector",
        "_sources",
        "_switch_on_content_filter",
        "_wait_retry_after_up_to_s",
    )

    def __init__(
        self,
        *,
        sources: Sequence[SourceConfig],
        limiter: RateLimiter,
        breaker: ProviderGate,
        selector: SourceSelector,
        retry: RetrySettings,
        breaker_settings: BreakerSettings,
        backpressure: BackpressureSettings,
        clock: Clock,
        rng: random.Random | None = None,
        health_probe: Attempt[Any] | None = None,
        scope: str | None = None,
    ) -> None:
        """:param health_probe: the call kind's cheap request, sent in the background to an
        open source when ``breaker_settings.health_probe`` is on (``aclose`` stops them).
        :param scope: the scope the sources belong to, for the limiter's per-source keys and
        the breaker's per-scope state (``polygateway.governance.admission.gate_key``,
        ``scope_breaker``)."""
        self._sources: tuple[SourceConfig, ...] = tuple(sources)
        self._names: tuple[str, ...] = tuple(s.name for s in self._sources)
        problems = governor_problems(self._sources, retry, backpressure)
        if problems:
            raise ConfigError(problems)
        rng = rng if rng is not None else random.Random()
        # Same-named sources of another scope sharing this breaker keep their own state.
        breaker = scope_breaker(breaker, scope)
        self._breaker = breaker
        self._selector = selector
        self._max_attempts = retry.max_attempts
        self._same_source_attempts = retry.same_source_attempts
        self._wait_retry_after_up_to_s = float(retry.wait_retry_after_up_to_s)
        self._max_retry_after_s = float(retry.max_retry_after_s)
        self._call_deadline_s = retry.call_deadline_s
        self._switch_on_content_filter = retry.switch_on_content_filter
        self._cooldown_s = float(breaker_settings.cooldown_s)
        self._clock = clock
        self._memo = CooldownMemo(clock)
        # One generator for the backoff and the waits: a seeded test sees one sequence.
        self._backoff = Backoff(retry, rng)
        self._blocked = Blocked(
            names=self._names,
            memo=self._memo,
            limiter=limiter,
            breaker=breaker,
            backpressure=backpressure,
            clock=clock,
            rng=rng,
        )
        self._admission = Admission(
            sources=self._sources,
            limiter=limiter,
            breaker=breaker,
            breaker_settings=breaker_settings,
            memo=self._memo,
            clock=clock,
            stall_window_s=self._blocked.stall_window_s,
            scope=scope,
        )
        self._prober: HealthProber | None = None
        if health_probe is not None and breaker_settings.health_probe:
            self._prober = HealthProber(
                sources={s.name: s for s in self._sources},
                admission=self._admission,
                breaker=breaker,
                probe=health_probe,
                clock=clock,
                poll_interval_s=self._blocked.poll_interval_s,
            )
            self._admission.on_open = self._prober.watch

    @property
    def sources(self) -> tuple[SourceConfig, ...]:
        return self._sources

    @property
    def inflight(self) -> Mapping[str, int]:
        """Attempts of this governor currently in flight, per source."""
        return self._admission.inflight

    @property
    def cooldowns(self) -> CooldownMemo:
        """The local cooldown memo (read it; the governor writes it)."""
        return self._memo

    @property
    def health_prober(self) -> HealthProber | None:
        """The background probes of open sources (``None``: off)."""
        return self._prober

    async def aclose(self) -> None:
        """Stop the background health probes (nothing else runs in the background)."""
        if self._prober is not None:
            await self._prober.aclose()

    def __repr__(self) -> str:
        mode = "fail_fast" if self._blocked.fail_fast else "wait"
        return (
            f"Governor(sources={list(self._names)}, max_attempts={self._max_attempts}, "
            f"quota_full={mode})"
        )

    # ------------------------------------------------------------------ the call

    def run(
        self,
        attempt: Attempt[T],
        *,
        est_tokens: int | None = None,
        observer: AttemptObserver[T] | None = None,
        deadline_s: float | None = None,
        events: GovernanceEvents | None = None,
    ) -> Coroutine[Any, Any, Outcome[T]]:
        """Run one governed call: attempts until one succeeds or the call must fail.

        ``await governor.run(...)``. A plain function that hands back the attempt loop's
        coroutine (one coroutine level less on every call); it raises ``ValueError`` for a bad
        ``deadline_s`` when called.

        :param attempt: ``attempt(source, call_id) -> Attempted[T]``, one request.
        :param est_tokens: the TPM pre-charge of each attempt; ``None`` charges each source's
            configured ``est_tokens``. Settled on ``Attempted.tokens`` when it is given.
        :param observer: told about every attempt that reached ``attempt``.
        :param deadline_s: end-to-end deadline of the call across attempts, backoff and
            admission waits (``None``: the scope's ``retry.call_deadline_s``, if any).
        :param events: told about each admission, refusal and wait of the call
            (``polygateway.types.GovernanceEvent``).
        :raises RequestRejectedError: from ``attempt``, at once (no retry, not counted);
            ``ContextWindowExceededError`` only when no source declares a larger window,
            ``ContentFilterError`` unless the scope switches on it.
        :raises ResultInvalidError: from ``attempt``, at once (the breaker counts a success).
        :raises AllSourcesExhausted: the attempt budget is spent, the deadline passed, every
            source died during the call, no source has quota (``fail_fast``), the call stalled,
            or there are no sources; ``reason``, ``retry_after_s`` and
            ``per_source_reasons`` say which.
        :raises CircuitOpenError: ``fail_fast`` and only breakers keep the sources shut.
        :raises GovernanceBackendError: the limiter or breaker could not be asked (fail closed).
        :raises ValueError: ``deadline_s`` is not a positive number of seconds.
        """
        if deadline_s is None:
            deadline_s = self._call_deadline_s
            if deadline_s is None:
                return self._run(attempt, est_tokens, observer, None, None, events)
        elif not 0 < deadline_s < math.inf:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        return self._run_until(deadline_s, attempt, est_tokens, observer, events)

    async def _run_until(
        self,
        deadline_s: float,
        attempt: Attempt[T],
        est_tokens: int | None,
        observer: AttemptObserver[T] | None,
        events: GovernanceEvents | None,
    ) -> Outcome[T]:
        """``_run`` within the call deadline ``deadline_s``."""
        progress = _Progress()
        deadline = self._clock.monotonic() + deadline_s
        try:
            async with asyncio.timeout(deadline_s) as scope:
                return await self._run(attempt, est_tokens, observer, deadline, progress, events)
        except _DeadlineReached:
            raise await self._deadline_error(deadline_s, progress) from progress.last_error
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise await self._deadline_error(deadline_s, progress) from exc

    async def _deadline_error(self, deadline_s: float, progress: _Progress) -> AllSourcesExhausted:
        last = progress.last_error
        detail = f"; last error: {type(last).__name__}: {last}" if last is not None else ""
        return AllSourcesExhausted(
            f"call deadline of {deadline_s:g}s reached after {progress.attempts} attempt(s)"
            + detail,
            retry_after_s=await scope_retry_after(self._names, self._memo, self._breaker),
            reason="retry_exhausted",
            per_source_reasons=reasons_report(self._names, self._memo, progress.reasons),
            last_error=last,
        )

    async def _run(
        self,
        attempt: Attempt[T],
        est_tokens: int | None,
        observer: AttemptObserver[T] | None,
        deadline: float | None,
        progress: _Progress | None,
        events: GovernanceEvents | None = None,
    ) -> Outcome[T]:
        clock = self._clock
        entered_at = clock.monotonic()
        selector = self._selector
        admission = self._admission
        inflight = admission.inflight
        memo = self._memo
        max_attempts = self._max_attempts
        attempts = 0
        # Allocated only when something goes wrong: the clean path touches none of them.
        reasons: dict[str, str] | None = None
        dead: set[str] | None = None
        refused: set[str] | None = None
        denial_wait: float | None = None
        avoid: str | None = None
        prefer: str | None = None
        same_tries: dict[str, int] | None = None
        min_window: int | None = None
        last_error: BaseException | None = None
        # The source whose full concurrency gate refused first this round, while every
        # refusal of the round was one (only a released slot helps): the line to wait in.
        line: SourceConfig | None = None
        # A permit handed over in that line, and its source: the next attempt's.
        queued: tuple[Permit, SourceConfig] | None = None

        while True:
            permit: Permit | None = None
            if queued is not None:
                permit, source = queued
                queued = None
            else:
                if attempts or refused is not None or memo:
                    candidates = self._runnable(dead, refused, avoid, min_window)
                else:
                    candidates = self._sources  # first try, nothing cooling: every source
                if not candidates:
                    if min_window is not None and isinstance(
                        last_error, ContextWindowExceededError
                    ):
                        raise last_error  # nothing larger can take it (any more)
                    # Nothing admitted in this round: raise, or wait and start a new round.
                    waited_from = clock.monotonic()
                    if line is None:
                        await self._blocked.wait_or_raise(
                            entered_at, dead, denial_wait, reasons, last_error
                        )
                    else:
                        earliest = await self._blocked.raise_if_due(
                            entered_at, dead, denial_wait, reasons, last_error
                        )
                        in_line = await admission.wait_in_line(
                            line,
                            line.est_tokens if est_tokens is None else est_tokens,
                            await self._blocked.queue_timeout(entered_at, earliest),
                        )
                        if not isinstance(in_line, Denial):
                            queued = (in_line, line)
                        # Refused again after the wait: the next round asks afresh.
                        line = None
                    if events is not None:
                        waited = clock.monotonic() - waited_from
                        _tell(events, GovernanceEvent("waited", wait_s=waited))
                    refused = None
                    denial_wait = None
                    continue
                preferred: SourceConfig | None = None
                if prefer is not None:
                    # A same-source retry: the failed source again, when it is still runnable.
                    for candidate in candidates:
                        if candidate.name == prefer:
                            preferred = candidate
                            break
                    prefer = None
                source = (
                    preferred if preferred is not None else selector.choose(candidates, inflight)
                )
            name = source.name
            est = source.est_tokens if est_tokens is None else est_tokens
            try:
                admitted = await admission.attempt(
                    source, est, attempt, observer, attempts + 1, events, permit
                )
            except TransientError as exc:
                attempts += 1
                last_error = exc
                reasons = noted(reasons, name, exc.reason)
                if progress is not None:
                    progress.attempts, progress.reasons, progress.last_error = (
                        attempts,
                        reasons,
                        exc,
                    )
                hint = retry_after_hint(exc.retry_after_s)
                if hint is not None:
                    hint = min(hint, self._max_retry_after_s)  # an absurd hint is a cap
                if attempts >= max_attempts:
                    if hint is not None:
                        memo.cool(name, hint, exc.reason)
                    raise await self._exhausted(attempts, reasons, last_error) from exc
                now = clock.monotonic()
                tries = same_tries.get(name, 0) if same_tries is not None else 0
                delay = self._backoff.delay(attempts - 1)
                if (
                    hint is not None
                    and hint <= self._wait_retry_after_up_to_s
                    and (deadline is None or now + hint < deadline)
                ):
                    # A short Retry-After: the source is usually the cheapest and the user's
                    # first choice, so wait it out there instead of switching.
                    prefer, avoid, delay = name, None, hint
                elif (
                    hint is None
                    and tries < self._same_source_attempts
                    and _same_source_eligible(exc)
                ):
                    # A one-off 5xx or reset: one more try where the call was going.
                    prefer, avoid = name, None
                    same_tries = {} if same_tries is None else same_tries
                    same_tries[name] = tries + 1
                else:
                    if hint is not None:
                        memo.cool(name, hint, exc.reason)
                        if hint > delay and not self._runnable(dead, None, None, min_window):
                            # Retry-After speaks for the failed source only: wait it out when
                            # no other source can take the retry, else switch after backoff.
                            delay = hint
                    avoid = name
                refused = None
                denial_wait = None
                if deadline is not None and now + delay >= deadline:
                    raise _DeadlineReached from exc  # never sleep past the deadline
                await clock.sleep(delay)
                continue
            except SourceDeadError as exc:
                attempts += 1
                last_error = exc
                reasons = noted(reasons, name, "source_dead")
                if progress is not None:
                    progress.attempts, progress.reasons, progress.last_error = (
                        attempts,
                        reasons,
                        exc,
                    )
                memo.cool(name, self._cooldown_s, "source_dead")
                if dead is None:
                    dead = set()
                dead.add(name)
                if attempts >= max_attempts:
                    raise await self._exhausted(attempts, reasons, last_error) from exc
                continue  # switch at once, no backoff
            except ContextWindowExceededError as exc:
                # Never re-sent here; only a source declaring a larger window may take it.
                attempts += 1
                window = source.context_window
                if window is None or attempts >= max_attempts:
                    raise
                min_window = window
                last_error = exc
                reasons = noted(reasons, name, "context_window_exceeded")
                dead = {name} if dead is None else dead | {name}
                continue
            except ContentFilterError as exc:
                attempts += 1
                if not self._switch_on_content_filter or attempts >= max_attempts:
                    raise
                last_error = exc
                reasons = noted(reasons, name, exc.reason)
                dead = {name} if dead is None else dead | {name}
                if len(dead) >= len(self._names):
                    raise
                continue
            if isinstance(admitted, Outcome):
                # An earlier attempt's error holds a traceback through this frame, which holds
                # the error: dropped here, the call's objects are freed by reference counting
                # instead of waiting in a cycle for the garbage collector.
                last_error = None
                if progress is not None:
                    progress.last_error = None
                return admitted
            # Refused before the attempt: no attempt spent; try another source this round.
            if refused is None:
                refused = set()
                line = source if admission.queues and _slot_refusal(admitted) else None
            elif line is not None and not _slot_refusal(admitted):
                line = None  # something a released slot does not cure: poll as usual
            if events is not None:
                _tell_refused(events, name, admitted)
            if isinstance(admitted, Denial):
                reasons = noted(reasons, name, "rate_limited")
                wait = admitted.wait_s
                denial_wait = wait if denial_wait is None else min(denial_wait, wait)
                if admitted.gate.startswith("global"):
                    # A scope-wide gate refuses every source alike: asking the others is waste.
                    refused.update(self._names)
                else:
                    refused.add(name)
            else:
                reasons = noted(reasons, name, "circuit_open")
                wait = admitted.retry_after_s
                if admitted.state == "half_open":
                    # Another call holds the probe: its verdict may come any moment, so look
                    # again soon instead of for the whole probe lease.
                    wait = min(wait, self._blocked.poll_interval_s)
                memo.cool(name, wait, "circuit_open")
                refused.add(name)

    # ------------------------------------------------------------------ selection state

    def _runnable(
        self,
        dead: set[str] | None,
        refused: set[str] | None,
        avoid: str | None,
        min_window: int | None = None,
    ) -> Sequence[SourceConfig]:
        """Configured sources minus cooling, dead-for-this-call and refused-this-round ones.

        ``avoid`` (the source that just failed) is left out when another one is runnable: a
        retry switches source. ``min_window``: after a context overflow, only sources
        declaring a larger context window.
        """
        memo = self._memo
        cooling = bool(memo)
        if (
            not cooling
            and dead is None
            and refused is None
            and avoid is None
            and min_window is None
        ):
            return self._sources
        now = self._clock.monotonic() if cooling else 0.0
        runnable: list[SourceConfig] = []
        for source in self._sources:
            name = source.name
            if (dead is not None and name in dead) or (refused is not None and name in refused):
                continue
            if cooling and memo.blocks(name, now):
                continue
            if min_window is not None and (
                source.context_window is None or source.context_window <= min_window
            ):
                continue
            runnable.append(source)
        if avoid is not None and len(runnable) > 1:
            others = [s for s in runnable if s.name != avoid]
            if others:
                return others
        return runnable

    async def _exhausted(
        self, attempts: int, reasons: dict[str, str] | None, last_error: BaseException
    ) -> ScopeUnavailableError:
        return await exhausted_error(
            attempts,
            reasons,
            last_error,
            names=self._names,
            memo=self._memo,
            breaker=self._breaker,
            backoff=self._backoff,
        )


def _slot_refusal(refusal: Denial | GateDecision) -> bool:
    """A refusal only a released concurrency slot cures (no time-based gate, no breaker)."""
    return isinstance(refusal, Denial) and refusal.gate in _SLOT_GATES


_SLOT_GATES = frozenset({"global_concurrency", "source_concurrency"})


def _tell(events: GovernanceEvents, event: GovernanceEvent) -> None:
    try:
        events(event)
    except Exception as exc:  # noqa: BLE001 - an observer never changes the outcome
        logger.debug("governance events observer failed: %r", exc)


def _tell_refused(events: GovernanceEvents, name: str, refusal: Denial | GateDecision) -> None:
    if isinstance(refusal, Denial):
        event = GovernanceEvent("limiter_refused", name, gate=refusal.gate, wait_s=refusal.wait_s)
    else:
        event = GovernanceEvent(
            "breaker_refused", name, breaker_state=refusal.state, wait_s=refusal.retry_after_s
        )
    _tell(events, event)
