"""Telemetry layer (outermost): one row per attempt, per cache hit, per call that never got
as far as an attempt (ARCHITECTURE §4.3, §7.8; D8).

Every row is built by ``build_telemetry_record``, the single helper: attempt successes, each
error class, cache hits, cancellations (``error="cancelled"``) and errors raised before any
attempt all go through it, so the 18 fields mean the same thing on every path.

How rows are produced:
- The layer installs a per-call ``_CallObserver`` on the request. The retry layer calls its
  ``on_attempt`` once per attempt that reached a transport; the observer builds the row and hands
  it to the recorder at once, synchronously (never awaiting: recording must not slow, block or
  outlive a cancellation).
- When the call ends without any attempt observed (a cache hit, a request refused before
  admission, every breaker open, a cancellation while waiting for quota), the layer writes
  the one row itself.
- Structured calls: the structured layer reports attempts whose output failed the ladder via
  the observer's optional ``on_result_invalid(call_id, error)``; such an attempt's row carries
  ``error="ResultInvalidError"``. To make that possible the row of a successful structured
  attempt is held back until the next attempt starts or the call ends.

The layer never raises into the call: a recorder or pricing failure is logged once per cause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from polygateway.digest import canonical_messages_json
from polygateway.ids import elapsed_ms, new_call_id
from polygateway.ports import Clock, Handler, Pricing, TelemetryRecorder
from polygateway.settings import SourceConfig, TelemetryContent
from polygateway.types import ChatRequest, LLMResponse, Message, TelemetryRecord

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"
"""The ``error`` of a row whose attempt (or call) was cancelled."""


_REQUEST_VALUES = attrgetter(
    *[f.name for f in dataclasses.fields(ChatRequest) if f.name != "observer"]
)
"""Every field of a request but ``observer``, in order."""


def _with_observer(request: ChatRequest, observer: Any) -> ChatRequest:
    """``dataclasses.replace(request, observer=observer)`` at half the cost (once per call).

    The other fields go positionally, so ``observer`` must stay the last field of
    ``ChatRequest``: any other layout makes this a ``TypeError`` (tested), never a mix-up.
    """
    # mypy cannot see that the values stop before ``observer``.
    return ChatRequest(*_REQUEST_VALUES(request), observer=observer)  # type: ignore[misc]


def error_name(outcome: BaseException) -> str:
    """The ``error`` column: the exception class name, or ``"cancelled"``."""
    if isinstance(outcome, asyncio.CancelledError):
        return CANCELLED
    return type(outcome).__name__


def messages_json(request: ChatRequest) -> str:
    """The ``messages`` column: multimodal parts replaced by digests (no base64 stored)."""
    return canonical_messages_json(request.messages)


def build_telemetry_record(
    request: ChatRequest,
    outcome: LLMResponse | BaseException,
    *,
    call_id: str,
    latency_ms: int,
    created_at: float,
    pricing: Pricing | None = None,
    source: SourceConfig | None = None,
    messages: str | None = None,
) -> TelemetryRecord:
    """THE telemetry helper: one row from a request and what became of it.

    ``outcome`` is the attempt's (or cache hit's) response, or the exception that ended it.
    ``source`` is the source the attempt went to (``None`` for cache hits and for errors raised
    before any attempt). ``messages`` may pass a precomputed ``messages_json(request)``.
    Cost: ``0.0`` for a cache hit; otherwise ``pricing.cost`` of the source's configured model
    (``None`` without pricing, for an unknown model, or when no model is known).
    """
    if messages is None:
        messages = messages_json(request)
    source_model = source.model if source is not None else ""
    if isinstance(outcome, LLMResponse):
        model = outcome.model or source_model
        prompt_tokens = outcome.prompt_tokens
        completion_tokens = outcome.completion_tokens
        cache_hit = outcome.cache_hit
        if cache_hit:
            cost: float | None = 0.0
        elif pricing is not None and (source_model or model):
            cached, written = outcome.cached_prompt_tokens, outcome.cache_write_tokens
            if cached or written:
                cost = pricing.cost(
                    source_model or model,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens=cached,
                    cache_write_tokens=written,
                )
            else:  # the usual call: pricing implementations without cache rates still work
                cost = pricing.cost(source_model or model, prompt_tokens, completion_tokens)
        else:
            cost = None
        # Positional, in field order: keywords cost a third more on this per-attempt path.
        return TelemetryRecord(
            call_id,
            request.parent_call_id,
            request.session_id,
            model,
            outcome.provider or (source.provider if source is not None else ""),  # provider
            outcome.source_name or (source.name if source is not None else ""),  # source_name
            messages,
            outcome.content,  # response
            outcome.thinking,
            prompt_tokens,
            completion_tokens,
            outcome.usage_source,
            # latency_ms: the response's own, so the row and what the caller saw agree.
            0 if cache_hit else (outcome.latency_ms or latency_ms),
            None if cache_hit else outcome.ttft_ms,
            None if cache_hit else outcome.max_inter_token_ms,
            cache_hit,
            None,  # error
            cost,
            created_at,
        )
    # A failed attempt: the upstream's usage is unknown, so tokens are 0 and marked estimated.
    return TelemetryRecord(
        call_id=call_id,
        parent_call_id=request.parent_call_id,
        session_id=request.session_id,
        model=source_model,
        provider=source.provider if source is not None else "",
        source_name=source.name if source is not None else "",
        messages=messages,
        response="",
        thinking="",
        prompt_tokens=0,
        completion_tokens=0,
        usage_source="estimated",
        latency_ms=latency_ms,
        ttft_ms=None,
        max_inter_token_ms=None,
        cache_hit=False,
        error=error_name(outcome),
        cost=pricing.cost(source_model, 0, 0) if pricing is not None and source_model else None,
        created_at=created_at,
    )


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest() if text else ""


def with_content(record: TelemetryRecord, content: TelemetryContent) -> TelemetryRecord:
    """The row as ``PGW_TELEMETRY_CONTENT`` wants it kept: prompt, answer and thinking as
    ``sha256:<hex>`` digests (equal texts stay recognisable, nothing readable is stored) or
    empty; every other field unchanged."""
    if content == "full":
        return record
    if content == "digest":
        return dataclasses.replace(
            record,
            messages=_digest(record.messages),
            response=_digest(record.response),
            thinking=_digest(record.thinking),
        )
    return dataclasses.replace(record, messages="", response="", thinking="")


class TelemetryMiddleware:
    """Records every attempt, cache hit and pre-attempt failure; fills ``LLMResponse.cost``."""

    __slots__ = ("_clock", "_content", "_pricing", "_recorder", "_submit", "_tasks", "_warned")

    def __init__(
        self,
        recorder: TelemetryRecorder,
        *,
        pricing: Pricing | None,
        clock: Clock,
        content: TelemetryContent = "full",
    ) -> None:
        self._recorder = recorder
        self._content = content
        self._pricing = pricing
        self._clock = clock
        self._warned: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Recorders that can enqueue synchronously (the builtin ones) skip a task per row.
        nowait = getattr(recorder, "record_nowait", None)
        self._submit: Callable[[TelemetryRecord], None] = (
            nowait if callable(nowait) else self._submit_as_task
        )

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        started = self._clock.monotonic()
        observer = _CallObserver(self)
        try:
            response = await call_next(_with_observer(request, observer))
        except asyncio.CancelledError as exc:
            # Recorded synchronously: the cancellation propagates without waiting on telemetry.
            self._after_error(observer, request, exc, started)
            raise
        except Exception as exc:
            self._after_error(observer, request, exc, started)
            raise
        return self._after_success(observer, request, response, started)

    def _after_success(
        self, observer: _CallObserver, request: ChatRequest, response: LLMResponse, started: float
    ) -> LLMResponse:
        try:
            observer.release_pending()
            if not observer.attempts:  # a cache hit, or a layer that answered by itself
                self._emit(
                    request,
                    response,
                    call_id=response.call_id or new_call_id(),
                    latency_ms=elapsed_ms(started, self._clock.monotonic()),
                    messages=observer.canonical_messages(request.messages),
                )
                return response
            if response.cost is None and response.call_id == observer.last_call_id:
                cost = observer.last_cost
                if cost is not None:
                    return dataclasses.replace(response, cost=cost)
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self._warn_once("finish", "telemetry bookkeeping failed: %r", exc)
        return response

    def _after_error(
        self, observer: _CallObserver, request: ChatRequest, exc: BaseException, started: float
    ) -> None:
        try:
            observer.release_pending()
            if not observer.attempts:  # refused, unavailable or cancelled before any attempt
                self._emit(
                    request,
                    exc,
                    call_id=new_call_id(),
                    latency_ms=elapsed_ms(started, self._clock.monotonic()),
                )
        except Exception as error:  # noqa: BLE001 - telemetry must never mask the call's error
            self._warn_once("finish", "telemetry bookkeeping failed: %r", error)

    def build(
        self,
        request: ChatRequest,
        outcome: LLMResponse | BaseException,
        *,
        call_id: str,
        latency_ms: int,
        source: SourceConfig | None = None,
        messages: str | None = None,
    ) -> TelemetryRecord | None:
        """One row via the single helper, stamped with this layer's clock and pricing."""
        try:
            record = build_telemetry_record(
                request,
                outcome,
                call_id=call_id,
                latency_ms=latency_ms,
                created_at=self._clock.time(),
                pricing=self._pricing,
                source=source,
                messages=messages,
            )
            return record if self._content == "full" else with_content(record, self._content)
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self._warn_once("build", "telemetry row could not be built: %r", exc)
            return None

    def submit(self, record: TelemetryRecord) -> None:
        """Hand a row to the recorder without awaiting; never raises."""
        try:
            self._submit(record)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self._warn_once(f"record:{type(exc).__name__}", "telemetry recorder failed: %r", exc)

    def _emit(
        self,
        request: ChatRequest,
        outcome: LLMResponse | BaseException,
        *,
        call_id: str,
        latency_ms: int,
        messages: str | None = None,
    ) -> None:
        record = self.build(
            request, outcome, call_id=call_id, latency_ms=latency_ms, messages=messages
        )
        if record is not None:
            self.submit(record)

    async def drain(self) -> None:
        """Wait until every row handed to a recorder without ``record_nowait`` is recorded.

        The client awaits this on ``aclose`` before flushing the recorder, so a graceful
        shutdown loses no row.
        """
        while self._tasks:
            await asyncio.gather(*tuple(self._tasks), return_exceptions=True)

    def _submit_as_task(self, record: TelemetryRecord) -> None:
        task = asyncio.get_running_loop().create_task(self._record(record))
        self._tasks.add(task)  # a strong reference until done, or the task may vanish
        task.add_done_callback(self._tasks.discard)

    async def _record(self, record: TelemetryRecord) -> None:
        try:
            await self._recorder.record(record)
        except Exception as exc:  # noqa: BLE001 - a failing recorder degrades to a warning
            self._warn_once(f"record:{type(exc).__name__}", "telemetry recorder failed: %r", exc)

    def _warn_once(self, cause: str, message: str, *args: Any) -> None:
        if cause in self._warned:
            return
        self._warned.add(cause)
        logger.warning(message, *args)

    def __repr__(self) -> str:
        return f"TelemetryMiddleware(recorder={self._recorder!r}, pricing={self._pricing!r})"


class _CallObserver:
    """Per-call ``ports.CallObserver``: turns attempts into rows as they happen."""

    __slots__ = (
        "_layer",
        "_messages_for",
        "_messages_json",
        "_pending",
        "attempts",
        "last_call_id",
        "last_cost",
    )

    def __init__(self, layer: TelemetryMiddleware) -> None:
        self._layer = layer
        self.attempts = 0
        self._pending: TelemetryRecord | None = None
        self._messages_for: object = None
        self._messages_json = ""
        self.last_call_id = ""
        self.last_cost: float | None = None

    def on_attempt(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        self.attempts += 1
        layer = self._layer
        try:
            self.release_pending()
            record = layer.build(
                request,
                outcome,
                call_id=call_id,
                latency_ms=latency_ms,
                source=source,
                messages=self.canonical_messages(request.messages),
            )
            if record is None:
                return
            if isinstance(outcome, LLMResponse):
                self.last_call_id = call_id
                self.last_cost = record.cost
                if request.structured is not None:
                    # The ladder may still reject this output: hold the row until we know.
                    self._pending = record
                    return
            layer.submit(record)
        except Exception as exc:  # noqa: BLE001 - the observer never raises into the call
            layer._warn_once("observer", "telemetry observer failed: %r", exc)

    def canonical_messages(self, messages: Sequence[Message]) -> str:
        """``canonical_messages_json(messages)``, computed once per call.

        The attempts of one call share one messages list (re-asks aside), and the cache layer
        hashes the same string for its key: it asks here instead of encoding it again.
        """
        if messages is not self._messages_for:
            self._messages_json = canonical_messages_json(messages)
            self._messages_for = messages
        return self._messages_json

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        """The structured ladder rejected the output of attempt ``call_id``."""
        pending = self._pending
        if pending is not None and pending.call_id == call_id:
            self._pending = dataclasses.replace(pending, error=error_name(error))

    def release_pending(self) -> None:
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._layer.submit(pending)


__all__ = [
    "CANCELLED",
    "TelemetryMiddleware",
    "build_telemetry_record",
    "error_name",
    "messages_json",
]
