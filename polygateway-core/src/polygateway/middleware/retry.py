"""The retry layer: the innermost middleware, owner of every attempt.

ARCHITECTURE §4.3, §4.4, §6, §7.2, §7.3, §7.4, §7.7 and M2 §4 (stall), M2 §10 (degradation).
One call is a loop of attempts; each attempt picks a runnable source, passes that source's
breaker gate and the limiter (global + source), then sends through the source's transport. The
error class of a failed attempt decides what happens next (``polygateway.errors``):

| error                | next step                                   | breaker           |
|----------------------|---------------------------------------------|-------------------|
| TransientError       | backoff (max with Retry-After), switch      | failure           |
| SourceDeadError      | switch at once, source excluded for the call| force open        |
| RequestRejectedError | raise                                       | not counted       |
| ResultInvalidError   | raise                                       | success           |
| CancelledError       | propagate; permit and probe released        | probe handed back |

Admission-side backend failures (``try_enter``, ``try_acquire``, ``retry_after_s``,
``progress_age_s``) raise ``GovernanceBackendError`` out of the call (fail closed); accounting
calls (``settle``, ``release``, ``release_probe``, ``record_*``, ``mark_progress``) only warn,
so they never mask the call's result or its exception.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from polygateway.errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    ConfigError,
    RequestRejectedError,
    ResultInvalidError,
    ScopeUnavailableError,
    SourceDeadError,
    TransientError,
)
from polygateway.ids import elapsed_ms, new_call_id
from polygateway.ports import (
    Clock,
    Denial,
    GateDecision,
    Handler,
    Permit,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    Transport,
)
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    RetrySettings,
    SourceConfig,
    effective_fail_threshold,
)
from polygateway.types import ChatRequest, LLMResponse

__all__ = ["RetryMiddleware", "check_message_fields", "check_message_shape"]

logger = logging.getLogger(__name__)

# Cooldown reasons that mean "the breaker keeps this source shut" (CircuitOpenError territory).
_BREAKER_REASONS = frozenset({"circuit_open", "source_dead"})


# --------------------------------------------------------------------------- message checks


def check_message_shape(messages: object) -> None:
    """Refuse anything that is not a non-empty list of mappings (before any layer digests it)."""
    if type(messages) is not list and not isinstance(messages, list | tuple):
        raise RequestRejectedError(
            f"messages must be a non-empty list of message mappings, got {type(messages).__name__}"
        )
    if not messages:
        raise RequestRejectedError("messages is empty: at least one message is required")
    for index, message in enumerate(messages):
        # ``type() is dict`` first: the usual message, without the ABC machinery.
        if type(message) is not dict and not isinstance(message, Mapping):
            raise RequestRejectedError(
                f"messages[{index}] must be a mapping with 'role' and 'content', "
                f"got {type(message).__name__}"
            )


def check_message_fields(messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse messages without a ``role`` string or with a ``content`` of the wrong type."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            if role is None:
                raise RequestRejectedError(f"messages[{index}] has no 'role'")
            raise RequestRejectedError(
                f"messages[{index}]['role'] must be a non-empty string, got {role!r}"
            )
        if "content" not in message:
            raise RequestRejectedError(f"messages[{index}] has no 'content'")
        content = message["content"]
        if type(content) is str or isinstance(content, str | list | tuple):
            continue
        # An assistant turn that only carries tool calls has ``content: null`` (OpenAI format).
        if content is None and role == "assistant":
            continue
        raise RequestRejectedError(
            f"messages[{index}]['content'] must be a string or a list of content parts, "
            f"got {type(content).__name__}"
        )


# --------------------------------------------------------------------------- the layer


class RetryMiddleware:
    """The innermost layer: it ignores ``call_next`` and calls the transports itself.

    State shared by all calls of one client: the cooldown memo (source -> monotonic deadline
    and reason, ARCHITECTURE D6: skip sources known to be shut instead of burning a request
    on them) and the local in-flight count per source (for the selector).
    """

    __slots__ = (
        "_breaker",
        "_clock",
        "_cooldown_s",
        "_cooldowns",
        "_fail_fast",
        "_inflight",
        "_limiter",
        "_max_attempts",
        "_names",
        "_poll_interval_s",
        "_progress_every_s",
        "_progress_marked_at",
        "_retry",
        "_rng",
        "_selector",
        "_sources",
        "_stall_window_s",
        "_thresholds",
        "_transports",
        "_warned",
    )

    def __init__(
        self,
        *,
        sources: Sequence[SourceConfig],
        transports: Mapping[str, Transport],
        limiter: RateLimiter,
        breaker: ProviderGate,
        selector: SourceSelector,
        retry: RetrySettings,
        breaker_settings: BreakerSettings,
        backpressure: BackpressureSettings,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self._sources: tuple[SourceConfig, ...] = tuple(sources)
        self._names: tuple[str, ...] = tuple(s.name for s in self._sources)
        problems: list[str] = []
        if len(set(self._names)) != len(self._names):
            problems.append(f"source names must be unique, got {list(self._names)}")
        missing = [name for name in self._names if name not in transports]
        if missing:
            problems.append(f"no transport for source(s) {missing}")
        if type(retry.max_attempts) is not int or retry.max_attempts < 1:
            problems.append(
                f"retry.max_attempts must be an integer >= 1, got {retry.max_attempts!r}"
            )
        if not (retry.base_delay_s >= 0 and retry.max_delay_s >= 0):
            problems.append("retry.base_delay_s and retry.max_delay_s must be >= 0")
        if not (backpressure.poll_interval_s > 0 and math.isfinite(backpressure.poll_interval_s)):
            problems.append(
                f"backpressure.poll_interval_s must be > 0, got {backpressure.poll_interval_s!r}"
            )
        if not backpressure.stall_window_s >= 0:
            problems.append(
                f"backpressure.stall_window_s must be >= 0, got {backpressure.stall_window_s!r}"
            )
        if problems:
            raise ConfigError(problems)
        self._transports: dict[str, Transport] = {n: transports[n] for n in self._names}
        self._limiter = limiter
        self._breaker = breaker
        self._selector = selector
        self._retry = retry
        self._max_attempts = retry.max_attempts
        self._cooldown_s = float(breaker_settings.cooldown_s)
        self._fail_fast = backpressure.quota_full == "fail_fast"
        self._stall_window_s = float(backpressure.stall_window_s)
        self._poll_interval_s = float(backpressure.poll_interval_s)
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        # ARCHITECTURE §7.4: effective threshold = max(configured, concurrency * 2).
        self._thresholds: dict[str, int] = {
            s.name: effective_fail_threshold(breaker_settings.fail_threshold, s)
            for s in self._sources
        }
        self._inflight: dict[str, int] = dict.fromkeys(self._names, 0)
        self._progress_every_s = min(1.0, self._stall_window_s / 10.0)
        self._progress_marked_at = -math.inf
        self._cooldowns: dict[str, tuple[float, str]] = {}
        self._warned: set[tuple[str, str]] = set()

    @property
    def inflight(self) -> Mapping[str, int]:
        """Attempts of this client currently in flight, per source."""
        return self._inflight

    def __repr__(self) -> str:
        return (
            f"RetryMiddleware(sources={list(self._names)}, max_attempts={self._max_attempts}, "
            f"quota_full={'fail_fast' if self._fail_fast else 'wait'})"
        )

    # ------------------------------------------------------------------ the call

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        check_message_fields(request.messages)
        clock = self._clock
        entered_at = clock.monotonic()
        selector = self._selector
        inflight = self._inflight
        max_attempts = self._max_attempts
        attempts = 0
        # Allocated only when something goes wrong: the clean path touches none of them.
        reasons: dict[str, str] | None = None
        dead: set[str] | None = None
        refused: set[str] | None = None
        denial_wait: float | None = None
        avoid: str | None = None
        last_error: BaseException | None = None

        while True:
            if attempts or self._cooldowns or refused is not None:
                candidates = self._runnable(dead, refused, avoid)
            else:
                candidates = self._sources  # first try, nothing cooling: every source
            if not candidates:
                # Nothing admitted in this round: raise, or wait and start a new round.
                await self._when_blocked(entered_at, dead, denial_wait, reasons, last_error)
                refused = None
                denial_wait = None
                continue
            source = selector.choose(candidates, inflight)
            name = source.name
            try:
                outcome = await self._attempt(request, source)
            except TransientError as exc:
                attempts += 1
                last_error = exc
                reasons = _noted(reasons, name, exc.reason)
                hint = exc.retry_after_s
                if hint is not None and 0.0 < hint < math.inf:
                    self._cool(name, hint, exc.reason)
                else:
                    hint = 0.0
                if attempts >= max_attempts:
                    raise await self._exhausted(attempts, reasons, last_error) from exc
                delay = self._backoff(attempts - 1)
                if hint > delay and not self._runnable(dead, None, None):
                    # Retry-After speaks for the failed source only: wait it out when no
                    # other source can take the retry, otherwise switch after the backoff.
                    delay = hint
                avoid = name
                refused = None
                denial_wait = None
                await clock.sleep(delay)
                continue
            except SourceDeadError as exc:
                attempts += 1
                last_error = exc
                reasons = _noted(reasons, name, "source_dead")
                self._cool(name, self._cooldown_s, "source_dead")
                if dead is None:
                    dead = set()
                dead.add(name)
                if attempts >= max_attempts:
                    raise await self._exhausted(attempts, reasons, last_error) from exc
                continue  # switch at once, no backoff
            if isinstance(outcome, LLMResponse):
                return outcome
            # Refused before the transport: no attempt spent; try another source this round.
            if refused is None:
                refused = set()
            if isinstance(outcome, Denial):
                reasons = _noted(reasons, name, "rate_limited")
                wait = outcome.wait_s
                denial_wait = wait if denial_wait is None else min(denial_wait, wait)
                if outcome.gate.startswith("global"):
                    # A scope-wide gate refuses every source alike: asking the others is waste.
                    refused.update(self._names)
                else:
                    refused.add(name)
            else:
                reasons = _noted(reasons, name, "circuit_open")
                wait = outcome.retry_after_s
                if outcome.state == "half_open":
                    # Another call holds the probe: its verdict may come any moment, so look
                    # again soon instead of for the whole probe lease.
                    wait = min(wait, self._poll_interval_s)
                self._cool(name, wait, "circuit_open")
                refused.add(name)

    async def _attempt(
        self, request: ChatRequest, source: SourceConfig
    ) -> LLMResponse | Denial | GateDecision:
        """Admission then one send on ``source``.

        Returns the response, or the refusal (the limiter's ``Denial`` or the breaker's
        not-allowed ``GateDecision``); raises the attempt's error after the breaker verdict.
        """
        name = source.name
        decision = await self._breaker.try_enter(name)
        if not decision.allowed:
            return decision
        # A probe decision must end with a verdict or be handed back, whatever happens.
        probe_pending = decision.probe_owner is not None
        try:
            admitted = await self._limiter.try_acquire(name, source.est_tokens, source.limits)
            if isinstance(admitted, Denial):
                return admitted
            permit: Permit = admitted
            clock = self._clock
            call_id = new_call_id()
            inflight = self._inflight
            inflight[name] += 1
            started = clock.monotonic()
            try:
                result = await self._transports[name].send(request, source, call_id=call_id)
                tokens = result.prompt_tokens + result.completion_tokens
                if tokens != permit.est_tokens:
                    await self._settle(permit, tokens)
            except asyncio.CancelledError as exc:
                self._observe(request, source, call_id, exc, started)
                raise
            except TransientError as exc:
                self._observe(request, source, call_id, exc, started)
                # The est pre-charge stays as the TPM charge: the upstream reported no usage.
                await self._record_failure(decision, threshold=self._thresholds[name])
                probe_pending = False
                raise
            except SourceDeadError as exc:
                self._observe(request, source, call_id, exc, started)
                await self._record_failure(decision, force_open=True)
                probe_pending = False
                raise
            except ResultInvalidError as exc:
                # A bad result is not a bad service (ARCHITECTURE §6.3).
                self._observe(request, source, call_id, exc, started)
                await self._record_success(decision)
                probe_pending = False
                raise
            except Exception as exc:
                # RequestRejectedError (not counted) or a transport bug: no verdict; the probe
                # is handed back in the outer finally.
                self._observe(request, source, call_id, exc, started)
                raise
            finally:
                inflight[name] -= 1
                try:
                    await permit.release()
                except Exception as exc:  # noqa: BLE001 - release side degrades (M2 §10)
                    self._warn("permit.release", exc)
            response = LLMResponse(
                content=result.content,
                thinking=result.thinking,
                model=result.model or source.model,
                provider=source.provider,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                latency_ms=result.latency_ms or elapsed_ms(started, clock.monotonic()),
                ttft_ms=result.ttft_ms,
                max_inter_token_ms=result.max_inter_token_ms,
                call_id=call_id,
                source_name=name,
                usage_source=result.usage_source,
                finish_reason=result.finish_reason,
                salvaged=result.salvaged,
                cached_prompt_tokens=result.cached_prompt_tokens,
                cache_write_tokens=result.cache_write_tokens,
            )
            if request.observer is not None:
                self._observe(request, source, call_id, response, started)
            # The accounting calls are inlined on this path: it runs on every call.
            try:
                await self._breaker.record_success(decision)
            except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
                self._warn("breaker.record_success", exc)
            probe_pending = False
            if self._cooldowns:
                # The source answered: whatever this client remembered against it is stale.
                self._cooldowns.pop(name, None)
            # Progress is a liveness signal read against windows of minutes: marking it at
            # most every ``_progress_every_s`` spares a backend round trip on most calls.
            now = clock.monotonic()
            if now - self._progress_marked_at >= self._progress_every_s:
                self._progress_marked_at = now
                try:
                    await self._limiter.mark_progress()
                except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
                    self._warn("limiter.mark_progress", exc)
            return response
        finally:
            if probe_pending:
                await self._release_probe(decision)

    # ------------------------------------------------------------------ selection state

    def _runnable(
        self, dead: set[str] | None, refused: set[str] | None, avoid: str | None
    ) -> Sequence[SourceConfig]:
        """Configured sources minus cooling, dead-for-this-call and refused-this-round ones.

        ``avoid`` (the source that just failed) is left out when another one is runnable: a
        retry switches source.
        """
        cooldowns = self._cooldowns
        if not cooldowns and dead is None and refused is None and avoid is None:
            return self._sources
        now = self._clock.monotonic() if cooldowns else 0.0
        runnable: list[SourceConfig] = []
        for source in self._sources:
            name = source.name
            if (dead is not None and name in dead) or (refused is not None and name in refused):
                continue
            if cooldowns:
                entry = cooldowns.get(name)
                if entry is not None:
                    if entry[0] > now:
                        continue
                    del cooldowns[name]
            runnable.append(source)
        if avoid is not None and len(runnable) > 1:
            others = [s for s in runnable if s.name != avoid]
            if others:
                return others
        return runnable

    def _cool(self, name: str, seconds: float, reason: str) -> None:
        """Remember locally that ``name`` is shut for ``seconds`` (keeps the later deadline)."""
        if not seconds > 0:
            return
        deadline = self._clock.monotonic() + seconds
        entry = self._cooldowns.get(name)
        if entry is None or entry[0] < deadline:
            self._cooldowns[name] = (deadline, reason)

    def _cooling(self, names: Sequence[str]) -> dict[str, tuple[float, str]]:
        """Remaining cooldown (seconds, reason) of each of ``names`` that is cooling now."""
        now = self._clock.monotonic()
        out: dict[str, tuple[float, str]] = {}
        for name in names:
            entry = self._cooldowns.get(name)
            if entry is not None and entry[0] > now:
                out[name] = (entry[0] - now, entry[1])
        return out

    def _backoff(self, retry_index: int) -> float:
        """ARCHITECTURE §7.2: ``min(base * 2^n, max) * uniform(0.5, 1.5)``."""
        return self._backoff_base(retry_index) * self._rng.uniform(0.5, 1.5)

    def _backoff_base(self, retry_index: int) -> float:
        retry = self._retry
        return float(min(retry.base_delay_s * 2.0 ** min(retry_index, 64), retry.max_delay_s))

    # ------------------------------------------------------------------ scope-level outcomes

    async def _when_blocked(
        self,
        entered_at: float,
        dead: set[str] | None,
        denial_wait: float | None,
        reasons: dict[str, str] | None,
        last_error: BaseException | None,
    ) -> None:
        """No source admitted the attempt: raise the scope-level error, or wait (M2 §4)."""
        names = self._names
        if not names:
            raise AllSourcesExhausted(
                "no sources are configured for this scope", retry_after_s=0.0, reason="no_sources"
            )
        alive = names if dead is None else tuple(n for n in names if n not in dead)
        if not alive:
            raise AllSourcesExhausted(
                "every source failed as dead during this call",
                retry_after_s=await self._scope_retry_after(),
                reason="retry_exhausted",
                per_source_reasons=self._reasons_report(reasons),
                last_error=last_error,
            )
        cooling = self._cooling(alive)
        earliest = min((wait for wait, _ in cooling.values()), default=None)
        # Only the breaker keeps the sources shut: every alive source is cooling for a breaker
        # reason or was refused by its breaker this round (no limiter denial).
        breaker_only = denial_wait is None and all(
            reason in _BREAKER_REASONS for _, reason in cooling.values()
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
                    per_source_reasons=self._reasons_report(reasons),
                    last_error=last_error,
                )
            hints = [w for w in (denial_wait, earliest) if w is not None]
            raise AllSourcesExhausted(
                "no source has quota right now (quota_full=fail_fast)",
                retry_after_s=min(hints, default=0.0),
                reason="quota_exhausted",
                per_source_reasons=self._reasons_report(reasons),
                last_error=last_error,
            )
        # wait: stalled only when this call waited past the window AND nobody anywhere made
        # progress within it (M2 §4: both conditions, local and global clocks never mixed).
        window = self._stall_window_s
        if (
            self._clock.monotonic() - entered_at > window
            and await self._limiter.progress_age_s() > window
        ):
            raise AllSourcesExhausted(
                f"no progress for more than stall_window_s={window:g}s",
                retry_after_s=await self._breaker.retry_after_s(names),
                reason="stalled",
                per_source_reasons=self._reasons_report(reasons),
                last_error=last_error,
            )
        poll = self._poll_interval_s
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

    async def _exhausted(
        self, attempts: int, reasons: dict[str, str] | None, last_error: BaseException
    ) -> ScopeUnavailableError:
        # Never "retry at once" after a spent budget: at least the next backoff step.
        floor = self._backoff_base(attempts - 1)
        return AllSourcesExhausted(
            f"{attempts} attempt(s) failed; last error: {type(last_error).__name__}: {last_error}",
            retry_after_s=max(floor, await self._scope_retry_after()),
            reason="retry_exhausted",
            per_source_reasons=self._reasons_report(reasons),
            last_error=last_error,
        )

    async def _scope_retry_after(self) -> float:
        """Seconds until some source may take a new call: per source the later of the local
        cooldown and its breaker's reopening, then the minimum over sources."""
        cooling = self._cooling(self._names)
        best = math.inf
        for name in self._names:
            local = cooling[name][0] if name in cooling else 0.0
            wait = max(local, await self._breaker.retry_after_s((name,)))
            if wait < best:
                best = wait
                if best <= 0.0:
                    break
        return 0.0 if best == math.inf else best

    def _reasons_report(self, reasons: dict[str, str] | None) -> dict[str, str]:
        """Per-source reasons of this call, plus ``cooldown`` for sources skipped by the memo."""
        report = dict(reasons) if reasons else {}
        for name in self._cooling(self._names):
            report.setdefault(name, "cooldown")
        return report

    # ------------------------------------------------------------------ accounting (warn only)

    def _observe(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        started: float,
    ) -> None:
        observer = request.observer
        if observer is None:
            return
        try:
            observer.on_attempt(
                request, source, call_id, outcome, elapsed_ms(started, self._clock.monotonic())
            )
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self._warn("telemetry observer", exc)

    async def _settle(self, permit: Permit, tokens: int) -> None:
        try:
            await permit.settle(tokens)
        except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
            self._warn("permit.settle", exc)

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
            await self._breaker.record_failure(decision, threshold=threshold, force_open=force_open)
        except Exception as exc:  # noqa: BLE001 - accounting side degrades (M2 §10)
            self._warn("breaker.record_failure", exc)

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


def _noted(reasons: dict[str, str] | None, name: str, reason: str) -> dict[str, str]:
    if reasons is None:
        return {name: reason}
    reasons[name] = reason
    return reasons
