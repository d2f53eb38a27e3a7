"""Telemetry layer (outermost): one row per attempt, per cache hit, per call that never got
as far as an attempt (ARCHITECTURE §4.3, §7.8; D8).

Every row is built by ``polygateway.records.build_record``, the single helper of every call
kind (here through ``build_telemetry_record``, its chat form): attempt successes, each
error class, cache hits, cancellations (``error="cancelled"``) and errors raised before any
attempt all go through it, so the 18 fields mean the same thing on every path. The usual
attempt (a success no layer may still reject, no call trace, the row kept as built) goes to a
recorder that takes rows as values (``ports.SupportsRecordValues``) as ``build_record``'s
values for it, made in place: no record object, no keyword matched by name (a test holds the
two equal on every field).

How rows are produced:
- The layer adds a per-call ``_CallObserver`` to the call's ``CallContext``. The dispatcher
  has the governor call its ``on_attempt`` once per attempt that reached a transport; the
  observer builds the row and hands it to the recorder at once, synchronously (never awaiting:
  recording must not slow, block or outlive a cancellation).
- When the call ends without any attempt observed (a cache hit, a request refused before
  admission, every breaker open, a cancellation while waiting for quota), the layer writes
  the one row itself.
- Every row of one call (its attempts, retries, switches and re-asks) carries the call's
  ``root_call_id``: the ``call_id`` of its first attempt (``polygateway.records.CallRoot``).
- Structured calls: the structured layer reports attempts whose output failed the ladder via
  ``CallContext.result_invalid(call_id, error)``; such an attempt's row carries
  ``error="ResultInvalidError"``. To make that possible the row of a successful structured
  attempt is held back until the next attempt starts or the call ends.

The layer never raises into the call: a recorder or pricing failure is logged once per cause
(by its ``polygateway.records.RowWriter``, which also hands the rows to the recorder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from polygateway.context import CallContext, with_context
from polygateway.digest import canonical_json, canonical_messages_json
from polygateway.ids import elapsed_ms, new_call_id
from polygateway.params import identity
from polygateway.ports import (
    CallTrace,
    Clock,
    Handler,
    Pricing,
    SupportsRecordNowait,
    SupportsRecordValues,
    TelemetryRecorder,
)
from polygateway.records import (
    CANCELLED,
    RowWriter,
    build_record,
    error_name,
    outcome_cost,
)
from polygateway.settings import SourceConfig, TelemetryContent
from polygateway.types import ChatRequest, LLMResponse, TelemetryRecord, TelemetryValues

logger = logging.getLogger(__name__)


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
    """The chat row: ``polygateway.records.build_record`` fed from a chat request.

    ``outcome`` is the attempt's (or cache hit's) response, or the exception that ended it.
    ``source`` is the source the attempt went to (``None`` for cache hits and for errors raised
    before any attempt). ``messages`` may pass a precomputed ``messages_json(request)``.
    Cost: ``0.0`` for a cache hit; otherwise ``pricing.cost`` of the source's configured model
    (``None`` without pricing, for an unknown model, or when no model is known).
    """
    if messages is None:
        messages = messages_json(request)
    return build_record(
        outcome,
        call_id=call_id,
        parent_call_id=request.parent_call_id,
        session_id=request.session_id,
        messages=messages,
        latency_ms=latency_ms,
        created_at=created_at,
        pricing=pricing,
        source=source,
        cache_namespace=request.cache_namespace or "",
        params=params_json(request),
    )


def params_json(request: ChatRequest) -> str:
    """The ``params`` column: the call's own generation parameters (``""`` when none)."""
    args = identity(request.params)
    return "" if args is None else canonical_json(args)


class TelemetryMiddleware:
    """Records every attempt, cache hit and pre-attempt failure; fills ``LLMResponse.cost``."""

    __slots__ = (
        "_clock",
        "_monotonic",
        "_recorder",
        "_rows",
        "_traced",
        "namespace",
        "pricing",
        "record_values",
        "rows",
        "scope",
        "submit",
        "time",
        "wants_content",
        "warn_once",
    )

    def __init__(
        self,
        recorder: TelemetryRecorder,
        *,
        pricing: Pricing | None,
        clock: Clock,
        content: TelemetryContent = "full",
        scope: str = "",
        namespace: str | None = None,
    ) -> None:
        """``scope`` and ``namespace`` (the cache's default) fill the rows' ``scope`` and
        ``cache_namespace`` when neither the source nor the call says otherwise."""
        self.scope = scope
        self.namespace = namespace or ""
        self._recorder = recorder
        self._clock = clock
        # The clock's, bound once: read at every call and every row.
        self._monotonic = clock.monotonic
        self.time = clock.time
        self.pricing = pricing
        # PGW_TELEMETRY_CONTENT applies to every row the writer builds.
        self._rows = RowWriter(recorder, clock=clock, pricing=pricing, content=content)
        # The writer's, bound once: the observer submits every row through them.
        self.submit = self._rows.submit
        self.warn_once = self._rows.warn_once
        self.rows = self._rows
        # Checked once: recorders that take whole calls get a CallTrace per call.
        self._traced = self._rows.traces_calls
        # Checked once: a recorder that reads no content spares the prompt's encoding per call.
        self.wants_content = self._rows.wants_content
        # Checked once: the usual attempt's row goes to a recorder that takes rows as values
        # without the record object, when the row is kept as built (content "full").
        self.record_values: Callable[[TelemetryValues], None] | None = (
            recorder.record_values_nowait
            if isinstance(recorder, SupportsRecordValues)
            and isinstance(recorder, SupportsRecordNowait)
            and content == "full"
            else None
        )

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        started = self._monotonic()
        context = request.context
        if context is None:  # a request made without GatewayClient.chat
            context = CallContext()
            request = with_context(request, context)
        trace = self._open_call(request, context) if self._traced else None
        observer = _CallObserver(self, trace)
        context.add_observer(observer)
        try:
            response = await call_next(request)
        except asyncio.CancelledError as exc:
            # Recorded synchronously: the cancellation propagates without waiting on telemetry.
            self._after_error(observer, request, exc, started)
            self._rows.close_call(trace, exc)
            raise
        except Exception as exc:
            self._after_error(observer, request, exc, started)
            self._rows.close_call(trace, exc)
            raise
        if observer.attempts and observer.last_cost is None and observer.pending is None:
            # The usual call: its rows are written and there is no cost to fill in.
            if trace is not None:
                self._rows.close_call(trace, None)
            return response
        response = self._after_success(observer, request, context, response, started)
        if trace is not None:
            self._rows.close_call(trace, None)
        return response

    def _open_call(self, request: ChatRequest, context: CallContext) -> CallTrace | None:
        rows = self._rows
        trace = rows.open_call(
            rows.call_start(
                "chat",
                scope=self.scope,
                session_id=request.session_id,
                parent_call_id=request.parent_call_id,
                cache_namespace=request.cache_namespace or self.namespace,
                stream=context.stream is not None,
            )
        )
        # Optional (ports.SupportsGovernanceEvents): traces that want the governor's decisions.
        on_governance = getattr(trace, "on_governance", None)
        if on_governance is not None:
            context.listen(on_governance)
        return trace

    def _after_success(
        self,
        observer: _CallObserver,
        request: ChatRequest,
        context: CallContext,
        response: LLMResponse,
        started: float,
    ) -> LLMResponse:
        try:
            observer.release_pending()
            if not observer.attempts:  # a cache hit, or a layer that answered by itself
                self._emit(
                    request,
                    response,
                    call_id=response.call_id or new_call_id(),
                    latency_ms=elapsed_ms(started, self._monotonic()),
                    messages=self.messages_of(context, request),
                    trace=observer.trace,
                )
                return response
            if response.cost is None and response.call_id == observer.last_call_id:
                cost = observer.last_cost
                if cost is not None:
                    return dataclasses.replace(response, cost=cost)
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self.warn_once("finish", "telemetry bookkeeping failed: %r", exc)
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
                    latency_ms=elapsed_ms(started, self._monotonic()),
                    trace=observer.trace,
                )
        except Exception as error:  # noqa: BLE001 - telemetry must never mask the call's error
            self.warn_once("finish", "telemetry bookkeeping failed: %r", error)

    def messages_of(self, context: CallContext | None, request: ChatRequest) -> str:
        """The rows' ``messages`` for ``request``: its canonical JSON (encoded once per call
        through ``context``), or ``""`` for a recorder that reads no content
        (``ports.DeclaresContentUse``)."""
        if not self.wants_content:
            return ""
        if context is None:
            return canonical_messages_json(request.messages)
        return context.canonical_messages(request.messages)

    def build(
        self,
        request: ChatRequest,
        outcome: LLMResponse | BaseException,
        *,
        call_id: str,
        latency_ms: int,
        source: SourceConfig | None = None,
        messages: str | None = None,
        root_call_id: str = "",
    ) -> TelemetryRecord | None:
        """One row via the single helper, stamped with this layer's clock and pricing."""
        try:
            if messages is None:
                messages = messages_json(request) if self.wants_content else ""
        except Exception as exc:  # noqa: BLE001 - telemetry must never break the call
            self.warn_once("build", "telemetry row could not be built: %r", exc)
            return None
        return self._rows.build(
            outcome,
            call_id=call_id,
            parent_call_id=request.parent_call_id,
            session_id=request.session_id,
            messages=messages,
            latency_ms=latency_ms,
            source=source,
            scope=self.scope,
            cache_namespace=request.cache_namespace or self.namespace,
            params=params_json(request) if request.params is not None else "",
            root_call_id=root_call_id,
        )

    def _emit(
        self,
        request: ChatRequest,
        outcome: LLMResponse | BaseException,
        *,
        call_id: str,
        latency_ms: int,
        messages: str | None = None,
        trace: CallTrace | None = None,
    ) -> None:
        record = self.build(
            request, outcome, call_id=call_id, latency_ms=latency_ms, messages=messages
        )
        if record is not None:
            self._rows.submit_attempt(trace, record, outcome)

    async def drain(self) -> None:
        """Wait until every row handed to a recorder without ``record_nowait`` is recorded.

        The client awaits this on ``aclose`` before flushing the recorder, so a graceful
        shutdown loses no row.
        """
        await self._rows.drain()

    def __repr__(self) -> str:
        return f"TelemetryMiddleware(recorder={self._recorder!r}, pricing={self._rows.pricing!r})"


class PricingMiddleware:
    """Fills ``LLMResponse.cost`` when a pricing table is configured but telemetry is off
    (with telemetry on, the telemetry layer does it from the row)."""

    __slots__ = ("_models", "_pricing", "_warned")

    def __init__(self, pricing: Pricing, *, sources: Sequence[SourceConfig]) -> None:
        self._pricing = pricing
        # Cost is of the source's configured model, as in the telemetry rows.
        self._models = {source.name: source.model for source in sources}
        self._warned = False

    async def __call__(self, request: ChatRequest, call_next: Handler) -> LLMResponse:
        response = await call_next(request)
        if response.cost is not None:
            return response
        try:
            model = self._models.get(response.source_name) or response.model
            cost = outcome_cost(response, model, self._pricing)
        except Exception as exc:  # noqa: BLE001 - pricing never breaks the call
            if not self._warned:
                self._warned = True
                logger.warning("cost could not be computed: %r", exc)
            return response
        return response if cost is None else dataclasses.replace(response, cost=cost)

    def __repr__(self) -> str:
        return f"PricingMiddleware(pricing={self._pricing!r})"


class _CallObserver:
    """Per-call ``ports.CallObserver``: turns attempts into rows as they happen."""

    __slots__ = (
        "_layer",
        "_pending_outcome",
        "attempts",
        "last_call_id",
        "last_cost",
        "pending",
        "root_call_id",
        "trace",
    )

    def __init__(self, layer: TelemetryMiddleware, trace: CallTrace | None = None) -> None:
        # No reference to the call's context: the context holds this observer, and the cycle
        # would keep both alive until a garbage collection, one per call. Attempts bring the
        # context along (``request.context``).
        self._layer = layer
        self.trace = trace
        self.attempts = 0
        self.pending: TelemetryRecord | None = None
        """A structured attempt's row, held until its output passes or fails the ladder."""
        self._pending_outcome: object = None
        self.last_call_id = ""
        self.last_cost: float | None = None
        self.root_call_id = ""
        """The call's ``root_call_id``: the first attempt's ``call_id`` (``records.CallRoot``'s
        rule, kept as a string: one object less per call)."""

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
            if self.pending is not None:
                self.release_pending()
            root_call_id = self.root_call_id
            if not root_call_id:
                root_call_id = self.root_call_id = call_id
            record_values = layer.record_values
            if (
                record_values is None
                or type(outcome) is not LLMResponse
                or request.structured is not None
                or self.trace is not None
            ):
                self._record(request, source, call_id, outcome, latency_ms)
                return
            # The usual attempt (a success no layer may still reject, no call trace, the row
            # kept as built): build_record's values, field for field (a test holds the two
            # equal), handed over without the record object or a keyword matched by name.
            messages = layer.messages_of(request.context, request)
            params = "" if request.params is None else params_json(request)
            try:
                cache_hit = outcome.cache_hit
                model = outcome.model or source.model
                cost = outcome_cost(outcome, source.model or model, layer.pricing)
                values: TelemetryValues = (
                    call_id,
                    request.parent_call_id,
                    request.session_id,
                    model,
                    outcome.provider or source.provider,
                    outcome.source_name or source.name,
                    messages,
                    outcome.content,
                    outcome.thinking,
                    outcome.prompt_tokens,
                    outcome.completion_tokens,
                    outcome.usage_source,
                    0 if cache_hit else outcome.latency_ms,
                    None if cache_hit else outcome.ttft_ms,
                    None if cache_hit else outcome.max_inter_token_ms,
                    cache_hit,
                    None,  # error
                    cost,
                    layer.time(),  # created_at
                    layer.scope or source.scope,
                    request.cache_namespace or layer.namespace,
                    params,
                    root_call_id,
                )
            except Exception as exc:  # noqa: BLE001 - as RowWriter.build: no row, one warning
                layer.warn_once("build", "telemetry row could not be built: %r", exc)
                return
            self.last_call_id = call_id
            self.last_cost = cost
            try:
                record_values(values)
            except Exception as exc:  # noqa: BLE001 - as RowWriter.submit: one warning a cause
                layer.warn_once(
                    f"record:{type(exc).__name__}", "telemetry recorder failed: %r", exc
                )
        except Exception as exc:  # noqa: BLE001 - the observer never raises into the call
            layer.warn_once("observer", "telemetry observer failed: %r", exc)

    def _record(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        """Any attempt's row through ``build_record``: the definition of the usual one."""
        layer = self._layer
        record = layer.build(
            request,
            outcome,
            call_id=call_id,
            latency_ms=latency_ms,
            source=source,
            messages=layer.messages_of(request.context, request),
            root_call_id=self.root_call_id,
        )
        if record is None:
            return
        if isinstance(outcome, LLMResponse):
            self.last_call_id = call_id
            self.last_cost = record.cost
            if request.structured is not None:
                # The ladder may still reject this output: hold the row until we know.
                self.pending = record
                self._pending_outcome = outcome
                return
        if self.trace is None:
            layer.submit(record)
        else:
            layer.rows.submit_attempt(self.trace, record, outcome)

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        """The structured ladder rejected the output of attempt ``call_id``."""
        pending = self.pending
        if pending is not None and pending.call_id == call_id:
            self.pending = dataclasses.replace(pending, error=error_name(error))
            self._pending_outcome = error

    def release_pending(self) -> None:
        pending = self.pending
        if pending is not None:
            self.pending = None
            if self.trace is None:
                self._layer.submit(pending)
            else:
                self._layer.rows.submit_attempt(self.trace, pending, self._pending_outcome)


__all__ = [
    "CANCELLED",
    "PricingMiddleware",
    "TelemetryMiddleware",
    "build_telemetry_record",
    "error_name",
    "messages_json",
]
