"""The chat endpoint: the pinned innermost handler of the chat pipeline.

It checks the messages, runs the governor with the chat transport of whichever source the
governor picks, and builds the ``LLMResponse`` (provenance: model, provider, source, call id,
latency). Wrapping layers (telemetry, cache, structured, plugin middleware) sit outside it in
the order the pipeline file gives; the dispatcher itself is not a layer and is always last.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Awaitable, Mapping, Sequence

from polygateway.chat.messages import check_message_fields
from polygateway.errors import ConfigError, EmptyCompletionError
from polygateway.governance import (
    Attempt,
    Attempted,
    AttemptObserver,
    Governor,
    governor_problems,
)
from polygateway.ids import elapsed_ms
from polygateway.params import ChatParams
from polygateway.ports import (
    CallObserver,
    Clock,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    Transport,
)
from polygateway.settings import BackpressureSettings, BreakerSettings, RetrySettings, SourceConfig
from polygateway.types import ChatRequest, LLMResponse

__all__ = ["ChatDispatcher"]


_DEADLINE_FLOOR_S = 1e-3
"""A re-ask past the call's deadline still gets a (vanishing) deadline, so it ends at once."""


class ChatDispatcher:
    """``ChatRequest -> LLMResponse`` through the governor and the sources' chat transports."""

    __slots__ = ("_clock", "_governor", "_transports")

    def __init__(
        self, governor: Governor, transports: Mapping[str, Transport], *, clock: Clock
    ) -> None:
        problems = _transport_problems(governor.sources, transports)
        if problems:
            raise ConfigError(problems)
        self._governor = governor
        self._transports: dict[str, Transport] = {
            s.name: transports[s.name] for s in governor.sources
        }
        self._clock = clock

    @classmethod
    def create(
        cls,
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
        scope: str | None = None,
    ) -> ChatDispatcher:
        """The governor over ``sources`` and the dispatcher on it; every problem at once.

        :raises ConfigError: what ``Governor`` refuses, and sources without a transport.
        """
        problems = governor_problems(sources, retry, backpressure)
        problems.extend(_transport_problems(sources, transports))
        if problems:
            raise ConfigError(problems)
        governor = Governor(
            sources=sources,
            limiter=limiter,
            breaker=breaker,
            selector=selector,
            retry=retry,
            breaker_settings=breaker_settings,
            backpressure=backpressure,
            clock=clock,
            rng=rng,
            health_probe=functools.partial(_health_probe, dict(transports)),
            scope=scope,
        )
        return cls(governor, transports, clock=clock)

    @property
    def governor(self) -> Governor:
        return self._governor

    def __repr__(self) -> str:
        return f"ChatDispatcher({self._governor!r})"

    async def __call__(self, request: ChatRequest) -> LLMResponse:
        check_message_fields(request.messages)
        context = request.context
        attempt: Attempt[LLMResponse]
        attempt_observer: AttemptObserver[LLMResponse] | None = None
        if context is not None and context.observers:
            # The attempt and its observer in one object: one object less per call.
            observed = _ObservedRequest(self, context.observers, request)
            attempt, attempt_observer = observed.send, observed
        else:
            # The function, not a bound method: one object less per call in flight.
            attempt = functools.partial(type(self)._send, self, request)
        deadline_s = request.deadline_s
        if deadline_s is not None and context is not None and 0 < deadline_s < math.inf:
            # One deadline per call: a structured re-ask dispatches again within what is left.
            now = self._clock.monotonic()
            if context.deadline_at is None:
                context.deadline_at = now + deadline_s
            deadline_s = max(context.deadline_at - now, _DEADLINE_FLOOR_S)
        outcome = await self._governor.run(
            attempt,
            observer=attempt_observer,
            deadline_s=deadline_s,
            events=context.events if context is not None else None,
        )
        return outcome.value

    async def _send(
        self, request: ChatRequest, source: SourceConfig, call_id: str
    ) -> Attempted[LLMResponse]:
        """One chat attempt: the source's transport, then the response with its provenance."""
        clock = self._clock
        started = clock.monotonic()
        result = await self._transports[source.name].send(request, source, call_id=call_id)
        # Positional, in the field order up to tool_calls (once per attempt; a test gives
        # every field its own value): 17 keywords would be matched by name.
        response: LLMResponse = LLMResponse(
            result.content,
            result.thinking,
            result.model or source.model,
            source.provider,
            result.prompt_tokens,
            result.completion_tokens,
            result.latency_ms or elapsed_ms(started, clock.monotonic()),
            result.ttft_ms,
            result.max_inter_token_ms,
            False,  # cache_hit
            call_id,
            source.name,
            None,  # cost
            result.usage_source,
            None,  # structured_data
            result.finish_reason,
            result.salvaged,
            result.cached_prompt_tokens,
            result.cache_write_tokens,
            result.tool_calls,
        )
        if result.usage_source == "estimated":
            # No (trustworthy) usage: TPM keeps the source's est_tokens pre-charge, the
            # conservative fallback (ARCHITECTURE §7.7), not a chars/4 guess that undercharges.
            return Attempted(response, None)
        return Attempted(response, result.prompt_tokens + result.completion_tokens)


_HEALTH_PROBE_REQUEST = ChatRequest(
    messages=({"role": "user", "content": "ping"},),
    stream=False,
    params=ChatParams(max_tokens=1),
)
"""The background health probe: the cheapest answer a chat source can give."""


async def _health_probe(
    transports: Mapping[str, Transport], source: SourceConfig, call_id: str
) -> Attempted[None]:
    try:
        result = await transports[source.name].send(_HEALTH_PROBE_REQUEST, source, call_id=call_id)
    except EmptyCompletionError:
        # Answered, just without text (a reasoning model spends the one token thinking): the
        # source is up. Treated as a failure, it would keep a healthy source open for good.
        return Attempted(None, None)
    if result.usage_source == "estimated":
        return Attempted(None, None)  # TPM keeps the pre-charge, as for a call
    return Attempted(None, result.prompt_tokens + result.completion_tokens)


def _transport_problems(
    sources: Sequence[SourceConfig], transports: Mapping[str, Transport]
) -> list[str]:
    missing = [s.name for s in sources if s.name not in transports]
    return [f"no transport for source(s) {missing}"] if missing else []


class _ObservedRequest:
    """A request dispatched while its call has observers (``CallContext.observers``): the
    governor's attempt (``send``, the dispatcher's ``_send`` of this request) and its
    ``AttemptObserver``, which tells the call's observers about every attempt together with
    the request it sent (a re-ask's, not the caller's)."""

    __slots__ = ("_dispatcher", "_observers", "_request")

    def __init__(
        self,
        dispatcher: ChatDispatcher,
        observers: tuple[CallObserver, ...],
        request: ChatRequest,
    ) -> None:
        self._dispatcher = dispatcher
        self._observers = observers
        self._request = request

    def send(self, source: SourceConfig, call_id: str) -> Awaitable[Attempted[LLMResponse]]:
        """``ChatDispatcher._send`` of the request (a subclass's own, if it has one)."""
        return self._dispatcher._send(self._request, source, call_id)

    def on_attempt(
        self,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        observers = self._observers
        if len(observers) == 1:
            observers[0].on_attempt(self._request, source, call_id, outcome, latency_ms)
            return
        # The governor logs (once) and ignores what an observer raises; one failing observer
        # must not keep the others from hearing of the attempt.
        failed: Exception | None = None
        for observer in observers:
            try:
                observer.on_attempt(self._request, source, call_id, outcome, latency_ms)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others
                failed = exc
        if failed is not None:
            raise failed
