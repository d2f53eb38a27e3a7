"""The ``otel`` telemetry recorder: each governed call as OpenTelemetry GenAI spans and metrics.

The recorder takes whole calls (``polygateway.ports.SupportsCallTraces``): ``open_call`` runs
in the caller's task when the call starts and keeps the caller's OpenTelemetry context (an
application span current there becomes the parent) and the start time; the call's rows are
collected as they are made. When the call ends, the call path only appends a compact record
(the rows, the context, the error's name, the governor's decisions) to a bounded buffer
(``pgw_otel.batch``; a full buffer drops the call, counted in ``dropped`` and
``pgw.telemetry.dropped``), and a thread of the recorder's makes one span for the call and
one child span per row (attempt, cache hit, refusal) with explicit start and end times from
the rows (``created_at`` minus ``latency_ms``), so nothing is held open across awaits and the
spans show what the rows show. With an endpoint the spans are written as OTLP protobuf by
hand and posted (``pgw_otel.otlp``, ``pgw_otel.sinks``; the common call straight from its
record, ``pgw_otel.fast``) and metrics are aggregated in plain Python
(``pgw_otel.aggregate``); with an SDK ``span_exporter`` it gets ``ReadableSpan`` objects
built directly. Only a ``tracer_provider`` (or the global one) gets its spans through the
SDK's tracer when the call ends, on the call path: the SDK has no public way to hand a
provider finished spans. A row that arrives without a call (``record``/``record_nowait``,
e.g. from another recorder's replay) becomes a call of one attempt.

Spans follow the OpenTelemetry GenAI semantic conventions: the call span is named
``{gen_ai.operation.name} {gen_ai.request.model}``, kind ``CLIENT``, with
``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` (cached prompt tokens included),
``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``,
``gen_ai.usage.cache_creation.input_tokens``, ``gen_ai.response.finish_reasons``,
``gen_ai.conversation.id`` (the session) and ``error.type`` (the library's error class, or
``cancelled``); the deprecated ``gen_ai.system`` is never set. Token usage is on the call span
only (summed over its attempts, every one of which was charged), so a backend that sums usage
over spans counts each token once; attempt spans carry theirs as ``pgw.usage.*``. Reasoning
tokens are not reported: the rows do not keep them apart from the output tokens.

``pgw.*`` attributes: ``pgw.source``, ``pgw.scope``, ``pgw.cache.namespace``,
``pgw.cache.hit``, ``pgw.ttft_ms``, ``pgw.max_inter_token_ms``, ``pgw.cost``,
``pgw.usage.source``, ``pgw.attempts``, ``pgw.session_id``, ``pgw.parent_call_id``,
``pgw.call_id`` and, per attempt, ``pgw.attempt.number`` and ``pgw.attempt.next`` (what the
governor did after it: ``retry`` on the same source, ``switch`` to another, ``reask`` after a
rejected structured answer) and ``pgw.refusal`` for a call refused before any attempt
(``breaker_open``, ``unavailable``, ``rejected``). The governor's decisions
(``polygateway.types.GovernanceEvent``, through ``on_governance``) add ``pgw.breaker.state``
and ``pgw.breaker.probe`` to attempt spans and ``pgw.limiter.refusals``, ``pgw.limiter.gates``,
``pgw.limiter.queue_wait_s``, ``pgw.breaker.refusals`` to the call span; a scope-level
verdict adds ``pgw.error.reason`` (``stalled``, ...). Prompts and answers
(``gen_ai.input.messages``, ``gen_ai.output.messages``) only with ``capture_content``.

Nothing here reaches the call: span and metric export run in the recorder's batch thread (or,
with SDK providers, the SDK's own threads), a failing or slow collector only delays or loses
exports (one warning per cause), and every step here is guarded (a failure is one warning per
cause and a count in ``dropped``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import Meter, MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider
from polygateway.settings import SourceConfig
from polygateway.types import CallStart, GovernanceEvent, TelemetryRecord

from pgw_otel.aggregate import PlainMeter
from pgw_otel.batch import BatchThread
from pgw_otel.fast import Common, PlainCallWriter
from pgw_otel.options import OtelOptions, parse_headers
from pgw_otel.otlp import KIND_CLIENT, KIND_INTERNAL, OtlpHttp, SpanData, TraceEncoder
from pgw_otel.sinks import OtlpSpanSink, SdkExporterSink, SpanSink

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

INSTRUMENTATION = "pgw_otel"
VERSION = "0.1.0"

DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""``gen_ai.client.operation.duration`` (s), the conventions' advised boundaries."""
TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
"""``gen_ai.client.token.usage`` ({token}), the conventions' advised boundaries."""
CHUNK_BUCKETS = (
    0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""Time to first chunk (s), the conventions' advised boundaries."""
PER_CHUNK_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
"""Time per output chunk (s), the conventions' advised boundaries."""

_BREAKER_RANK = {"closed": 0, "half_open": 1, "open": 2}
"""``pgw.breaker.state`` gauge values."""

_REFUSALS = {
    "CircuitOpenError": "breaker_open",
    "AllSourcesExhausted": "unavailable",
    "ScopeUnavailableError": "unavailable",
}


_SPAN_ID_MASK = (1 << 64) - 1
"""The low 64 bits of a 128-bit draw: one span id (the high 64 bits are the other)."""

_UNSAMPLED = -1
"""``SpanData.kind`` of a call span under an unsampled parent: its spans are not exported."""

_Failure = tuple[str, str | None]
"""A call's error as its spans keep it: ``error.type`` and a verdict's ``reason``."""

_Ended = tuple[
    CallStart,
    otel_context.Context,
    list[tuple[TelemetryRecord, object]],
    float,
    "_Failure | None",
    "Sequence[tuple[int, GovernanceEvent]]",
]
"""What the call path hands the batch thread: the call as it started, the caller's context,
its rows, when it ended, its error and the governor's decisions."""


class _Outcome(NamedTuple):
    """What the spans read of an attempt's outcome (the rest of the response is not kept)."""

    finish_reason: object
    cached_prompt_tokens: object
    cache_write_tokens: object


class _Shutdown(Protocol):
    def force_flush(self, timeout_millis: int = ...) -> bool: ...

    def shutdown(self) -> Any: ...


class _Poster(Protocol):
    def post(self, body: bytes) -> None: ...

    def shutdown(self) -> None: ...


def _sdk_otlp_metric_reader(
    options: OtelOptions, base: str, headers: Mapping[str, str]
) -> MetricReader:
    """The SDK's periodic OTLP metric export (beside a Prometheus reader on one provider)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    return PeriodicExportingMetricReader(
        OTLPMetricExporter(
            endpoint=f"{base}/v1/metrics", headers=dict(headers), timeout=options.export_timeout_s
        ),
        export_interval_millis=options.metric_interval_s * 1000,
        export_timeout_millis=options.export_timeout_s * 1000,
    )


class OtelRecorder:
    """``TelemetryRecorder`` (and ``SupportsCallTraces``) exporting OpenTelemetry spans/metrics.

    Spans go, in order of precedence, to ``span_sink`` (a ``pgw_otel.sinks.SpanSink``; the
    recorder's own OTLP/HTTP exporter is one), to ``span_exporter`` (any SDK ``SpanExporter``,
    fed ``ReadableSpan`` objects), both from a batch thread of the recorder's, or else through
    ``tracer_provider`` (default: the application's global one) with the SDK's tracer, when
    the call ends: the SDK has no public way to hand a provider finished spans, so that path
    costs the SDK's span machinery on the call path. Metrics go to ``meter_provider`` (default:
    the global one), or, with ``metric_exporter``, are aggregated by the recorder
    (``pgw_otel.aggregate.PlainMeter``) and posted as OTLP protobuf every
    ``metric_interval_s`` and on ``flush``. ``sources`` gives each source's configured model
    (``gen_ai.request.model``). ``owned`` are providers the recorder made and shuts down in
    ``aclose``. Counters: ``calls``, ``spans`` (made), ``dropped`` (rows that could not become
    spans: a full buffer, a failed step).
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        span_exporter: SpanExporter | None = None,
        span_sink: SpanSink | None = None,
        metric_exporter: _Poster | None = None,
        resource: Resource | None = None,
        capture_content: bool = False,
        sources: Sequence[SourceConfig] = (),
        owned: Sequence[_Shutdown] = (),
        flush_timeout_s: float = 10.0,
        metric_interval_s: float = 30.0,
        max_queue: int = 4096,
        batch_delay_s: float = 5.0,
    ) -> None:
        if not isinstance(capture_content, bool):
            raise TypeError(f"OtelRecorder capture_content must be a bool, got {capture_content!r}")
        self.capture_content = capture_content
        self._models = {source.name: source.model for source in sources}
        self._owned = tuple(owned)
        self._flush_ms = int(flush_timeout_s * 1000)
        self._flush_s = flush_timeout_s
        self._warned: set[str] = set()
        self._closed = False
        """After ``aclose`` the recorder adds nothing to the shared metric instruments."""
        self._owned_flush: asyncio.Future[None] | None = None
        """The owned providers' flush in progress, awaited by every concurrent ``flush``."""
        self.calls = 0
        self.spans = 0
        self._refused = 0
        """Rows of calls the full (or closing) buffer refused: written where calls end."""
        self._failed = 0
        """Rows a failed step lost: written where spans are made (one thread each)."""
        self._drops: dict[str, int] = {}
        """Rows dropped on the call path, by scope (written there, read by the batch thread)."""
        self._reported_drops: dict[str, int] = {}
        self._resource_attrs: dict[str, Any] = {}
        self._metric_exporter = metric_exporter
        self._plain: PlainMeter | None = None
        if span_sink is None and span_exporter is not None:
            from opentelemetry.sdk.resources import Resource as SdkResource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            span_sink = SdkExporterSink(
                span_exporter,
                resource or SdkResource.create(),
                InstrumentationScope(INSTRUMENTATION, VERSION),
            )
        self._sink = span_sink
        self._tracer: Tracer | None = None
        if span_sink is None:
            self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(
                INSTRUMENTATION, VERSION
            )
        if metric_exporter is not None and meter_provider is None:
            if resource is not None:
                self._resource_attrs = dict(resource.attributes)
            self._plain = PlainMeter(time.time_ns())
            self._metrics = _Metrics(self._plain)
        else:
            meter = (meter_provider or metrics.get_meter_provider()).get_meter(
                INSTRUMENTATION, VERSION
            )
            self._metrics = _Metrics(meter)
        self._ids = random.Random()
        self._fast: PlainCallWriter | None = None
        if isinstance(span_sink, OtlpSpanSink) and self._plain is not None and not capture_content:
            # The common call straight to bytes and points (pgw_otel.fast); others: _build.
            self._fast = PlainCallWriter(
                self._models,
                span_sink.encoder.attributes,
                self._plain,
                self._metrics.breaker_seen,
                self._metrics._breakers,
            )
        self._batches: BatchThread[_Ended | Common] | None = None
        if span_sink is not None:
            self._batches = BatchThread(
                self._handle,
                self._tick,
                max_queue=max_queue,
                delay_s=batch_delay_s,
                tick_s=metric_interval_s,
                close=self._close_exports,
            )
            self._batches.start()

    @classmethod
    def from_options(
        cls, options: OtelOptions, *, sources: Sequence[SourceConfig] = ()
    ) -> OtelRecorder:
        """The recorder ``options`` describe: with an ``endpoint``, spans (and, without
        ``prometheus_port``, metrics) written by the recorder and posted over OTLP/HTTP from
        its batch thread; with ``prometheus_port``, an SDK meter provider of its own serving
        Prometheus (and exporting to the endpoint if set); else the application's global
        providers."""
        owned: list[_Shutdown] = []
        meter_provider: MeterProvider | None = None
        span_sink: SpanSink | None = None
        metric_exporter: OtlpHttp | None = None
        readers: list[Any] = []
        resource = None
        if options.endpoint is not None or options.prometheus_port is not None:
            from opentelemetry.sdk.resources import Resource as SdkResource

            resource = SdkResource.create({"service.name": options.service_name})
        if options.endpoint is not None:
            assert resource is not None
            base = options.endpoint.reveal()
            headers = parse_headers(options.headers.reveal()) if options.headers else {}
            span_sink = OtlpSpanSink(
                TraceEncoder(dict(resource.attributes), INSTRUMENTATION, VERSION),
                OtlpHttp(f"{base}/v1/traces", headers, options.export_timeout_s),
            )
            metrics_http = OtlpHttp(f"{base}/v1/metrics", headers, options.export_timeout_s)
            if options.prometheus_port is None:
                metric_exporter = metrics_http
            else:
                readers.append(_sdk_otlp_metric_reader(options, base, headers))
        if options.prometheus_port is not None:
            from pgw_otel.prometheus import serve_prometheus

            endpoint = serve_prometheus(options.prometheus_port)
            readers.append(endpoint.reader)
            owned.append(endpoint)
        if readers:
            from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter
            from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider

            # No exemplars: each would cost a context lookup per measurement.
            sdk_meter = SdkMeterProvider(
                metric_readers=readers,
                resource=resource,
                exemplar_filter=AlwaysOffExemplarFilter(),
            )
            meter_provider = sdk_meter
            owned.append(sdk_meter)
        return cls(
            meter_provider=meter_provider,
            span_sink=span_sink,
            metric_exporter=metric_exporter,
            resource=resource,
            capture_content=options.capture_content,
            sources=sources,
            owned=owned,
            flush_timeout_s=options.export_timeout_s,
            metric_interval_s=options.metric_interval_s,
        )

    # ------------------------------------------------------------------ the call's side

    @property
    def dropped(self) -> int:
        """Rows that could not become spans: refused by a full or closing buffer, or lost in
        a failed step (two counts, each written by one thread)."""
        return self._refused + self._failed

    @property
    def wants_content(self) -> bool:
        """Rows' content is read only with ``capture_content`` (``ports.DeclaresContentUse``):
        without it the telemetry layer leaves the prompt unencoded."""
        return self.capture_content

    def open_call(self, start: CallStart) -> _Call:
        return _Call(self, start, otel_context.get_current())

    def record_nowait(self, record: TelemetryRecord) -> None:
        """A row without a call: a call of one attempt."""
        start = CallStart(
            "chat",
            record.created_at - record.latency_ms / 1000,
            record.scope,
            record.session_id,
            record.parent_call_id,
            record.cache_namespace,
        )
        self.ended(start, otel_context.get_current(), [(record, None)], record.created_at, None)

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    def ended(
        self,
        start: CallStart,
        parent: otel_context.Context,
        rows: list[tuple[TelemetryRecord, object]],
        ended_at: float,
        error: BaseException | None,
        events: list[tuple[int, GovernanceEvent]] | None = None,
    ) -> None:
        """A call ended: to the batch thread (a common call in its ``Common`` form, any other
        as a compact record: the rows, the caller's context, the error's name), or, through
        an SDK tracer, its spans now."""
        batches = self._batches
        if batches is None:
            failure = None if error is None else _failure(error)
            self.export(start, parent, rows, ended_at, failure, events or ())
            return
        if self._closed:
            return
        fast = self._fast
        item: _Ended | Common | None = None
        if fast is not None and error is None:
            try:
                item = fast.common(start, parent, rows, ended_at, events)
            except Exception:  # noqa: BLE001 - never into the call: the general path counts it
                item = None
        if item is None:
            failure = None if error is None else _failure(error)  # the usual case: no call
            item = (start, parent, rows, ended_at, failure, events or ())
        if not batches.offer(item):
            self._refused += len(rows)
            scope = start.scope or (rows[0][0].scope if rows else "")
            self._drops[scope] = self._drops.get(scope, 0) + len(rows)

    async def flush(self) -> None:
        """Export what the batch thread and the recorder's own providers hold. The batch
        thread answers the flush itself (no thread waits for it); the providers' blocking
        flush runs in one thread at a time, shared by concurrent callers, so a hung
        collector holds one default-executor thread, not one per caller."""
        batches = self._batches
        if batches is not None and not self._closed:
            loop = asyncio.get_running_loop()
            answered: asyncio.Future[None] = loop.create_future()

            def answer() -> None:  # in the batch thread
                loop.call_soon_threadsafe(_resolve, answered)

            if batches.request_flush(answer):
                try:
                    await asyncio.wait_for(answered, self._flush_s)
                except TimeoutError:
                    self._warn("flush", TimeoutError(f"no answer within {self._flush_s:g} s"))
        if self._owned:
            if self._owned_flush is None or self._owned_flush.done():
                self._owned_flush = asyncio.ensure_future(self._flush_owned())
            await asyncio.shield(self._owned_flush)

    async def _flush_owned(self) -> None:
        for provider in self._owned:
            await asyncio.to_thread(provider.force_flush, self._flush_ms)

    async def aclose(self) -> None:
        """Flush, then shut down the batch thread, its sinks and the providers the recorder
        made (never the global ones). A call that ends from here on is dropped and counted
        (the batch thread refuses it); the batch thread shuts its exporters itself, after its
        last export, so nothing else touches them while it may still be posting."""
        if self._closed:
            return
        batches = self._batches
        if batches is not None:
            batches.stop_intake()  # on the loop, where calls end: none lands after the drain
            await asyncio.to_thread(batches.shutdown, self._flush_s)
        self._closed = True
        if batches is None:
            await asyncio.to_thread(self._close_exports)
        owned, self._owned = self._owned, ()
        for provider in owned:
            try:
                await asyncio.to_thread(provider.force_flush, self._flush_ms)
                await asyncio.to_thread(provider.shutdown)
            except Exception as exc:  # noqa: BLE001 - shutdown never raises into the client
                self._warn("shutdown", exc)

    def _close_exports(self) -> None:
        """The span sink and the metric exporter shut (the batch thread's last step)."""
        for closing in (self._sink, self._metric_exporter):
            if closing is not None:
                try:
                    closing.shutdown()
                except Exception as exc:  # noqa: BLE001 - shutdown never raises into the client
                    self._warn("shutdown", exc)

    # ------------------------------------------------------------------ the batch thread

    def _handle(self, batch: list[_Ended | Common]) -> None:
        otlp = self._sink if isinstance(self._sink, OtlpSpanSink) else None
        fast = self._fast
        spans: list[SpanData] = []
        encoded: list[bytes] = []
        for item in batch:
            if type(item[0]) is str:  # a common call (PlainCallWriter.common)
                assert fast is not None
                try:
                    self.calls += 1
                    getrandbits = self._ids.getrandbits
                    parent_context = item[-1]
                    if parent_context is None:  # the usual case: a new trace
                        trace_id = getrandbits(128) or 1
                        parent_id, remote, sampled = 0, False, True
                    else:
                        trace_id, parent_id, remote, sampled = self._trace_of(parent_context)
                        trace_id = self._new_trace(trace_id)
                    span_ids = getrandbits(128)  # both span ids in one draw
                    encoded += fast.write(
                        item, trace_id, span_ids >> 64 or 1, span_ids & _SPAN_ID_MASK or 1,
                        parent_id, remote, sampled,
                    )  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - telemetry never reaches the call
                    self._count_drop(item[2], 1, exc)
                continue
            start, parent, rows, ended_at, failure, events = cast("_Ended", item)
            try:
                made = self._build(start, parent, rows, ended_at, failure, events)
            except Exception as exc:  # noqa: BLE001 - telemetry never reaches the call
                if rows:
                    self._count_drop(start.scope or rows[0][0].scope, len(rows), exc)
                else:
                    self._warn("export", exc)
                continue
            try:
                self._record_call(start, rows, made)
            except Exception as exc:  # noqa: BLE001 - a broken meter never loses the spans
                self._warn("metrics", exc)
            if made and made[0].kind != _UNSAMPLED:
                if otlp is not None:
                    encoded += [otlp.encoder.span(span) for span in made]
                else:
                    spans += made
        try:
            if encoded:
                assert otlp is not None
                otlp.export_encoded(encoded)
                self.spans += len(encoded)
            elif spans:
                assert self._sink is not None
                self._sink.export_spans(spans)
                self.spans += len(spans)
        except Exception as exc:  # noqa: BLE001 - a failing collector is counted, not raised
            self._warn("span export", exc)

    @staticmethod
    def _trace_of(parent: otel_context.Context | None) -> tuple[int, int, bool, bool]:
        """The caller's span as (trace id, span id, remote, sampled); zeros: no span."""
        if not parent:  # an empty context, the usual case: no lookup
            return 0, 0, False, True
        context = trace.get_current_span(parent).get_span_context()
        if context.is_valid:
            return context.trace_id, context.span_id, context.is_remote, context.trace_flags.sampled
        return 0, 0, False, True

    def _new_trace(self, trace_id: int) -> int:
        return trace_id or self._ids.getrandbits(128) or 1

    def _tick(self) -> None:
        """Drops counted on the call path, then (aggregated metrics) the metric export."""
        try:
            for scope, count in list(self._drops.items()):
                new = count - self._reported_drops.get(scope, 0)
                if new:
                    self._reported_drops[scope] = count
                    self._metrics.dropped.add(new, {"pgw.sink": "otel", "pgw.scope": scope})
            plain, exporter = self._plain, self._metric_exporter
            if plain is None or exporter is None:
                return
            request = plain.request(self._resource_attrs, INSTRUMENTATION, VERSION, time.time_ns())
            if request is not None:
                exporter.post(request.SerializeToString())
        except Exception as exc:  # noqa: BLE001 - a failing collector is counted, not raised
            self._warn("metric export", exc)

    # ------------------------------------------------------------------ spans and metrics

    def export(
        self,
        start: CallStart,
        parent: otel_context.Context,
        rows: Sequence[tuple[TelemetryRecord, object]],
        ended_at: float,
        failure: _Failure | None,
        events: Sequence[tuple[int, GovernanceEvent]] = (),
    ) -> None:
        """The call's spans through the SDK tracer, and its metric points; never raises.
        ``events``: the governor's decisions, each with the number of rows made before it."""
        try:
            made = self._build(start, parent, rows, ended_at, failure, events)
            if made:
                self._start_spans(parent, made)
                self._record_call(start, rows, made)
        except Exception as exc:  # noqa: BLE001 - telemetry never reaches the call
            if rows:
                self._count_drop(start.scope or rows[0][0].scope, len(rows), exc)
            else:
                self._warn("export", exc)

    def _count_drop(self, scope: str, rows: int, exc: Exception) -> None:
        """``rows`` rows of a call in ``scope`` lost to a failed step."""
        self._failed += rows
        self._warn("export", exc)
        if not self._closed:
            try:
                self._metrics.dropped.add(rows, {"pgw.sink": "otel", "pgw.scope": scope})
            except Exception as again:  # noqa: BLE001 - a broken meter is dropped too
                self._warn("metrics", again)

    def _start_spans(self, parent: otel_context.Context, made: Sequence[SpanData]) -> None:
        assert self._tracer is not None
        call = self._start_span(made[0], parent, SpanKind.CLIENT)
        child_context = trace.set_span_in_context(call, parent)
        for attempt in made[1:]:
            self._start_span(attempt, child_context, SpanKind.INTERNAL).end(end_time=attempt.end_ns)
        call.end(end_time=made[0].end_ns)
        self.spans += len(made)

    def _start_span(
        self, data: SpanData, parent: otel_context.Context, kind: SpanKind
    ) -> trace.Span:
        assert self._tracer is not None
        span = self._tracer.start_span(
            data.name,
            context=parent,
            kind=kind,
            attributes=data.attributes,
            start_time=data.start_ns,
        )
        if data.error is not None:
            span.set_status(Status(StatusCode.ERROR, data.error))
        return span

    def _build(
        self,
        start: CallStart,
        parent: otel_context.Context,
        rows: Sequence[tuple[TelemetryRecord, object]],
        ended_at: float,
        failure: _Failure | None,
        events: Sequence[tuple[int, GovernanceEvent]],
    ) -> list[SpanData]:
        """The call's spans (the call's first; ids only for the batch thread's sinks) and,
        unless closed, its metric points. A call under an unsampled parent: the call span's
        kind is ``_UNSAMPLED``."""
        self.calls += 1
        if not rows:
            return []
        admitted = {before + 1: event for before, event in events if event.kind == "admitted"}
        final = rows[-1][0]
        operation = start.operation
        request_model = self._models.get(final.source_name, "") or final.model
        error_type = failure[0] if failure is not None else final.error
        call_attrs = self._call_attributes(start, rows, request_model, error_type)
        if events:
            _decision_attributes(call_attrs, events)
            if not self._closed:
                self._metrics.record_decisions(call_attrs["pgw.scope"], events)
        if failure is not None and failure[1]:
            call_attrs["pgw.error.reason"] = failure[1]
        if self.capture_content:
            _content(call_attrs, final, input_too=True)
        started_ns = _ns(min(start.started_at, _row_start(rows[0][0])))
        ended_ns = max(_ns(ended_at), started_ns)
        trace_id = call_id = 0
        parent_id = 0
        remote = False
        kind = KIND_CLIENT
        if self._tracer is None:
            trace_id, parent_id, remote, sampled = self._trace_of(parent)
            trace_id = self._new_trace(trace_id)
            call_id = self._ids.getrandbits(64) or 1
            if not sampled:
                kind = _UNSAMPLED
        made = [
            SpanData(
                f"{operation} {request_model}" if request_model else operation,
                trace_id,
                call_id,
                parent_id,
                remote,
                kind,
                started_ns,
                ended_ns,
                call_attrs,
                error_type,
            )
        ]
        for number, (record, outcome) in enumerate(rows, 1):
            following = rows[number][0] if number < len(rows) else None
            made.append(
                self._attempt_span(
                    trace_id,
                    call_id,
                    operation,
                    record,
                    outcome,
                    number,
                    following,
                    admitted.get(number),
                )
            )
        return made

    def _record_call(
        self, start: CallStart, rows: Sequence[tuple[TelemetryRecord, object]], made: list[SpanData]
    ) -> None:
        if rows and made and not self._closed:
            call = made[0]
            duration_s = (call.end_ns - call.start_ns) / 1e9
            self._metrics.record_call(start, rows, call.attributes, duration_s, rows[-1][1])

    def _call_attributes(
        self,
        start: CallStart,
        rows: Sequence[tuple[TelemetryRecord, object]],
        request_model: str,
        error_type: str | None,
    ) -> dict[str, Any]:
        final, final_outcome = rows[-1]
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": start.operation,
            "gen_ai.provider.name": final.provider or "unknown",
            "pgw.scope": start.scope or final.scope,
            "pgw.attempts": sum(1 for record, _ in rows if not record.cache_hit),
            "pgw.cache.hit": final.cache_hit,
            "pgw.stream": start.stream,
            "pgw.usage.source": final.usage_source,
            "pgw.call_id": final.call_id,
        }
        if final.root_call_id:
            attrs["pgw.root_call_id"] = final.root_call_id
        if request_model:
            attrs["gen_ai.request.model"] = request_model
        if final.source_name:
            attrs["pgw.source"] = final.source_name
        if start.cache_namespace or final.cache_namespace:
            attrs["pgw.cache.namespace"] = start.cache_namespace or final.cache_namespace
        session = start.session_id or final.session_id
        if session:
            attrs["gen_ai.conversation.id"] = session
            attrs["pgw.session_id"] = session
        parent_call = start.parent_call_id or final.parent_call_id
        if parent_call:
            attrs["pgw.parent_call_id"] = parent_call
        # What the call paid for: a cache hit's row repeats the cached answer's usage.
        paid = [(record, outcome) for record, outcome in rows if not record.cache_hit]
        attrs["gen_ai.usage.input_tokens"] = sum(record.prompt_tokens for record, _ in paid)
        attrs["gen_ai.usage.output_tokens"] = sum(record.completion_tokens for record, _ in paid)
        cached = sum(_int(outcome, "cached_prompt_tokens") for _, outcome in paid)
        if cached:
            attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        written = sum(_int(outcome, "cache_write_tokens") for _, outcome in paid)
        if written:
            attrs["gen_ai.usage.cache_creation.input_tokens"] = written
        costs = [record.cost for record, _ in rows if record.cost is not None]
        if costs:
            attrs["pgw.cost"] = float(sum(costs))
        if error_type is None:
            if final.model:
                attrs["gen_ai.response.model"] = final.model
            finish = getattr(final_outcome, "finish_reason", None)
            if isinstance(finish, str) and finish:
                attrs["gen_ai.response.finish_reasons"] = (finish,)
            if final.ttft_ms is not None:
                attrs["pgw.ttft_ms"] = float(final.ttft_ms)
            if final.max_inter_token_ms is not None:
                attrs["pgw.max_inter_token_ms"] = float(final.max_inter_token_ms)
        else:
            attrs["error.type"] = error_type
            if len(rows) == 1 and not final.source_name:  # refused before any attempt
                attrs["pgw.refusal"] = _REFUSALS.get(error_type, "rejected")
        return attrs

    def _attempt_span(
        self,
        trace_id: int,
        parent_id: int,
        operation: str,
        record: TelemetryRecord,
        outcome: object,
        number: int,
        following: TelemetryRecord | None,
        admitted: GovernanceEvent | None = None,
    ) -> SpanData:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": record.provider or "unknown",
            "pgw.attempt.number": number,
            "pgw.usage.input_tokens": record.prompt_tokens,
            "pgw.usage.output_tokens": record.completion_tokens,
            "pgw.call_id": record.call_id,
        }
        # Only what differs from the usual: every attribute costs on the call path.
        if record.cache_hit:
            attrs["pgw.cache.hit"] = True
        if record.usage_source != "measured":
            attrs["pgw.usage.source"] = record.usage_source
        request_model = self._models.get(record.source_name, "")
        if request_model:
            attrs["gen_ai.request.model"] = request_model
        if record.source_name:
            attrs["pgw.source"] = record.source_name
        if record.cost is not None:
            attrs["pgw.cost"] = float(record.cost)
        if record.ttft_ms is not None:
            attrs["pgw.ttft_ms"] = float(record.ttft_ms)
        if record.max_inter_token_ms is not None:
            attrs["pgw.max_inter_token_ms"] = float(record.max_inter_token_ms)
        cached = _int(outcome, "cached_prompt_tokens")
        if cached:
            attrs["pgw.usage.cache_read.input_tokens"] = cached
        if record.error is None:
            if record.model:
                attrs["gen_ai.response.model"] = record.model
            finish = getattr(outcome, "finish_reason", None)
            if isinstance(finish, str) and finish:
                attrs["gen_ai.response.finish_reasons"] = (finish,)
        else:
            attrs["error.type"] = record.error
        if following is not None:
            attrs["pgw.attempt.next"] = _next_step(record, following)
        if admitted is not None and admitted.source == record.source_name:
            attrs["pgw.breaker.state"] = admitted.breaker_state
            if admitted.probe:
                attrs["pgw.breaker.probe"] = True
        if record.cache_hit:
            name = "pgw.cache_hit"
        elif record.source_name:
            name = f"pgw.attempt {record.source_name}"
        else:
            name = "pgw.refused"
        if self.capture_content:
            _content(attrs, record, input_too=False)
        return SpanData(
            name,
            trace_id,
            self._ids.getrandbits(64) or 1 if self._tracer is None else 0,
            parent_id,
            False,
            KIND_INTERNAL,
            _ns(_row_start(record)),
            _ns(record.created_at),
            attrs,
            record.error,
        )

    def _warn(self, cause: str, exc: BaseException) -> None:
        key = f"{cause}:{type(exc).__name__}"
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("OpenTelemetry telemetry: %s failed: %r", cause, exc)

    def __repr__(self) -> str:
        return f"OtelRecorder(capture_content={self.capture_content}, owned={len(self._owned)})"


class _Call:
    """One call's rows, kept until it ends (``polygateway.ports.CallTrace``)."""

    __slots__ = ("_events", "_parent", "_recorder", "_rows", "_start")

    def __init__(
        self, recorder: OtelRecorder, start: CallStart, parent: otel_context.Context
    ) -> None:
        self._recorder = recorder
        self._start = start
        self._parent = parent
        self._rows: list[tuple[TelemetryRecord, object]] = []
        self._events: list[tuple[int, GovernanceEvent]] | None = None

    def attempt(self, record: TelemetryRecord, outcome: object) -> None:
        # Only what the spans read of the outcome: the response itself is not kept waiting.
        # tuple.__new__: the _Outcome its generated __new__ makes, without that Python frame.
        kept = tuple.__new__(_Outcome, (
            getattr(outcome, "finish_reason", None),
            getattr(outcome, "cached_prompt_tokens", 0),
            getattr(outcome, "cache_write_tokens", 0),
        ))  # fmt: skip
        self._rows.append((record, kept))

    def on_governance(self, event: GovernanceEvent) -> None:
        """``polygateway.ports.SupportsGovernanceEvents``: kept with its place among the rows."""
        if self._events is None:
            self._events = []
        self._events.append((len(self._rows), event))

    def close(self, ended_at: float, error: BaseException | None) -> None:
        rows, self._rows = self._rows, []
        events, self._events = self._events, None
        self._recorder.ended(self._start, self._parent, rows, ended_at, error, events)


class _Metrics:
    """The instruments. Synchronous ones: the SDK hands every recorder on a meter provider the
    same instrument for a name, so recorders (two clients, a client rebuilt after ``aclose``)
    add to shared instruments under their own ``pgw.scope`` instead of registering callbacks
    the SDK would keep for the first recorder only and never release. The same definition
    feeds the recorder's own aggregates (``PlainMeter``, which has the same ``create_*``)."""

    __slots__ = (
        "_breakers",
        "admissions",
        "attempts",
        "breaker_refusals",
        "breaker_state",
        "cache",
        "dropped",
        "duration",
        "limiter_refusals",
        "meter",
        "per_chunk",
        "queue_wait",
        "refusals",
        "retries",
        "tokens",
        "ttfc",
        "verdicts",
    )

    def __init__(self, meter: Meter | PlainMeter) -> None:
        self.meter = meter
        self._breakers: dict[tuple[str, str], str] = {}
        """(scope, source) -> the breaker state last set on the gauge."""
        self.admissions = meter.create_counter(
            "pgw.limiter.admissions",
            unit="{attempt}",
            description="Attempts the breaker and the limiter let go, by pgw.source.",
        )
        self.limiter_refusals = meter.create_counter(
            "pgw.limiter.refusals",
            unit="{refusal}",
            description="Limiter refusals, by pgw.source and pgw.limiter.gate.",
        )
        self.breaker_refusals = meter.create_counter(
            "pgw.breaker.refusals",
            unit="{refusal}",
            description="Breaker refusals, by pgw.source and pgw.breaker.state.",
        )
        self.queue_wait = meter.create_histogram(
            "pgw.limiter.queue_wait",
            unit="s",
            description="Time a call waited for quota or a breaker before a new round.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self.ttfc = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            unit="s",
            description="Time to receive the first chunk of a streaming response.",
            explicit_bucket_boundaries_advisory=CHUNK_BUCKETS,
        )
        self.per_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_per_output_chunk",
            unit="s",
            description="Mean time per output chunk after the first one, per attempt.",
            explicit_bucket_boundaries_advisory=PER_CHUNK_BUCKETS,
        )
        self.attempts = meter.create_counter(
            "pgw.call.attempts",
            unit="{call}",
            description="Calls by their number of attempts (pgw.attempts: retries, switches, "
            "re-asks; 0 for a cache hit or a refusal): the attempts-per-call distribution.",
        )
        self.retries = meter.create_counter(
            "pgw.attempt.outcomes",
            unit="{attempt}",
            description="Attempts by what followed them (pgw.attempt.next) and error.type.",
        )
        self.refusals = meter.create_counter(
            "pgw.call.refusals",
            unit="{call}",
            description="Calls refused before any attempt (breaker open, scope unavailable).",
        )
        self.verdicts = meter.create_counter(
            "pgw.call.verdicts",
            unit="{call}",
            description="Calls ended by a scope-level verdict, by pgw.error.reason (stalled, ...).",
        )
        self.cache = meter.create_counter(
            "pgw.cache.lookups",
            unit="{call}",
            description="Calls by pgw.cache.hit: the cache hit ratio is hits over all.",
        )
        self.breaker_state = meter.create_gauge(
            "pgw.breaker.state",
            unit="1",
            description="Breaker state per source as last seen: 0 closed, 1 half_open, 2 open.",
        )
        self.dropped = meter.create_counter(
            "pgw.telemetry.dropped",
            unit="{row}",
            description="Telemetry rows the recorder could not turn into spans, by pgw.scope.",
        )

    def record_decisions(self, scope: str, events: Sequence[tuple[int, GovernanceEvent]]) -> None:
        for _, event in events:
            where = {"pgw.scope": scope, "pgw.source": event.source}
            if event.kind == "admitted":
                self.admissions.add(1, {**where, "pgw.breaker.probe": event.probe})
            elif event.kind == "limiter_refused":
                self.limiter_refusals.add(1, {**where, "pgw.limiter.gate": event.gate})
            elif event.kind == "breaker_refused":
                self.breaker_refusals.add(1, {**where, "pgw.breaker.state": event.breaker_state})
            elif event.kind == "waited":
                self.queue_wait.record(event.wait_s, {"pgw.scope": scope})
            if event.breaker_state and event.source:
                self.breaker_seen(scope, event.source, event.breaker_state)

    def breaker_seen(self, scope: str, source: str, state: str) -> None:
        """The breaker-state gauge as last seen, set on a change only (a measurement costs
        more than the dict lookup)."""
        if self._breakers.get((scope, source)) != state:
            self._breakers[scope, source] = state
            rank = _BREAKER_RANK.get(state, -1)
            self.breaker_state.set(rank, {"pgw.scope": scope, "pgw.source": source})

    def record_call(
        self,
        start: CallStart,
        rows: Sequence[tuple[TelemetryRecord, object]],
        call_attrs: Mapping[str, Any],
        duration_s: float,
        final_outcome: object,
    ) -> None:
        final = rows[-1][0]
        base = {
            key: call_attrs[key]
            for key in (
                "gen_ai.operation.name",
                "gen_ai.provider.name",
                "gen_ai.request.model",
                "gen_ai.response.model",
                "error.type",
                "pgw.scope",
                "pgw.source",
            )
            if key in call_attrs
        }
        # A cache hit is no GenAI operation: counted in pgw.cache.lookups, not timed here.
        if not final.cache_hit:
            self.duration.record(duration_s, base)
        if not final.cache_hit and ("error.type" not in base or call_attrs["pgw.attempts"]):
            self.tokens.record(
                call_attrs["gen_ai.usage.input_tokens"], {**base, "gen_ai.token.type": "input"}
            )
            self.tokens.record(
                call_attrs["gen_ai.usage.output_tokens"], {**base, "gen_ai.token.type": "output"}
            )
        if start.stream and final.error is None and final.ttft_ms is not None:
            self.ttfc.record(final.ttft_ms / 1000, base)
            chunks = final.completion_tokens
            if chunks > 1:
                # Per-chunk times are not kept: the attempt's mean after the first chunk.
                gap_s = max(0.0, final.latency_ms - final.ttft_ms) / 1000 / (chunks - 1)
                self.per_chunk.record(gap_s, base)
        scope = {"pgw.scope": base.get("pgw.scope", "")}
        self.attempts.add(1, {**scope, "pgw.attempts": call_attrs["pgw.attempts"]})
        self.cache.add(1, {**scope, "pgw.cache.hit": final.cache_hit})
        reason = call_attrs.get("pgw.error.reason")
        if reason is not None:  # a scope-level verdict: stalled, quota_exhausted, ...
            verdict = {**scope, "pgw.error.reason": reason, "error.type": base["error.type"]}
            self.verdicts.add(1, verdict)
        refusal = call_attrs.get("pgw.refusal")
        if refusal is not None:
            self.refusals.add(
                1, {**scope, "pgw.refusal": refusal, "error.type": base["error.type"]}
            )
        for number, (record, _) in enumerate(rows[:-1], 1):
            following = rows[number][0]
            what = _next_step(record, following)
            self.retries.add(
                1,
                {
                    **scope,
                    "pgw.source": record.source_name,
                    "pgw.attempt.next": what,
                    "error.type": record.error or "none",
                },
            )


def _decision_attributes(
    attrs: dict[str, Any], events: Sequence[tuple[int, GovernanceEvent]]
) -> None:
    """What the breaker and the limiter decided during the call, on the call span."""
    limiter = [event for _, event in events if event.kind == "limiter_refused"]
    breaker = [event for _, event in events if event.kind == "breaker_refused"]
    waited = [event.wait_s for _, event in events if event.kind == "waited"]
    if limiter:
        attrs["pgw.limiter.refusals"] = len(limiter)
        attrs["pgw.limiter.gates"] = tuple(dict.fromkeys(event.gate for event in limiter))
    if breaker:
        attrs["pgw.breaker.refusals"] = len(breaker)
    if waited:
        attrs["pgw.limiter.queue_wait_s"] = float(sum(waited))
    if any(event.probe for _, event in events):
        attrs["pgw.breaker.probe"] = True


def _next_step(record: TelemetryRecord, following: TelemetryRecord) -> str:
    """What the governor did after attempt ``record``: re-ask, retry the source, or switch."""
    if record.error == "ResultInvalidError":
        return "reask"
    return "retry" if following.source_name == record.source_name else "switch"


def _content(attrs: dict[str, Any], record: TelemetryRecord, *, input_too: bool) -> None:
    if input_too and record.messages:
        attrs["gen_ai.input.messages"] = record.messages
    if record.response:
        attrs["gen_ai.output.messages"] = record.response


def _resolve(answered: asyncio.Future[None]) -> None:
    if not answered.done():  # a flush that timed out is cancelled
        answered.set_result(None)


def _failure(error: BaseException | None) -> _Failure | None:
    """What the spans keep of the call's error: ``error.type`` and a verdict's ``reason``
    (the exception itself is not kept: its traceback would outlive the call)."""
    if error is None:
        return None
    if isinstance(error, asyncio.CancelledError):
        return ("cancelled", None)
    reason = getattr(error, "reason", None)
    return (type(error).__name__, reason if isinstance(reason, str) and reason else None)


def _int(outcome: object, name: str) -> int:
    value = getattr(outcome, name, 0)
    return value if type(value) is int else 0


def _row_start(record: TelemetryRecord) -> float:
    return record.created_at - record.latency_ms / 1000


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


__all__ = ["OtelRecorder"]
