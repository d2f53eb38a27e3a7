"""Where the recorder's batch thread sends finished spans (``SpanSink``).

``OtlpSpanSink``: the hand-written OTLP protobuf (``pgw_otel.otlp.TraceEncoder``) posted over
OTLP/HTTP, the default with an endpoint. ``SdkExporterSink``: any SDK ``SpanExporter`` (the
in-memory one in tests, an application's own), fed ``ReadableSpan`` objects built directly
from the ``SpanData`` (no tracer, no span processor): ``readable_span`` is that conversion,
and with the SDK's ``encode_spans`` the definition the hand-written bytes are checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pgw_otel.otlp import KIND_CLIENT, OtlpHttp, SpanData, TraceEncoder

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

__all__ = ["OtlpSpanSink", "SdkExporterSink", "SpanSink", "readable_span"]


class SpanSink(Protocol):
    """Takes batches of finished spans, in the recorder's batch thread (may block)."""

    def export_spans(self, spans: Sequence[SpanData]) -> None: ...

    def shutdown(self) -> None: ...


class OtlpSpanSink:
    """``ExportTraceServiceRequest`` bytes written by hand, POSTed to ``.../v1/traces``."""

    def __init__(self, encoder: TraceEncoder, http: OtlpHttp) -> None:
        self.encoder = encoder
        self._http = http

    def export_spans(self, spans: Sequence[SpanData]) -> None:
        self._http.post(self.encoder.request(spans))

    def export_encoded(self, encoded: Sequence[bytes]) -> None:
        """Spans already encoded with ``encoder`` (``TraceEncoder.span``/``wire_span``)."""
        self._http.post(self.encoder.request_of(encoded))

    def shutdown(self) -> None:
        self._http.shutdown()

    def __repr__(self) -> str:
        return f"OtlpSpanSink({self._http!r})"


class SdkExporterSink:
    """An SDK ``SpanExporter`` fed ``ReadableSpan`` objects made straight from the data."""

    def __init__(
        self, exporter: SpanExporter, resource: Resource, scope: InstrumentationScope
    ) -> None:
        self.exporter = exporter
        self._resource = resource
        self._scope = scope

    def export_spans(self, spans: Sequence[SpanData]) -> None:
        self.exporter.export([readable_span(span, self._resource, self._scope) for span in spans])

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def __repr__(self) -> str:
        return f"SdkExporterSink({type(self.exporter).__name__})"


def readable_span(span: SpanData, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The SDK's finished-span object of ``span`` (sampled, no trace state)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    sampled = TraceFlags(TraceFlags.SAMPLED)
    parent = None
    if span.parent_span_id:
        parent = SpanContext(
            span.trace_id, span.parent_span_id, is_remote=span.parent_is_remote, trace_flags=sampled
        )
    return ReadableSpan(
        name=span.name,
        context=SpanContext(span.trace_id, span.span_id, is_remote=False, trace_flags=sampled),
        parent=parent,
        resource=resource,
        attributes=dict(span.attributes),
        kind=SpanKind.CLIENT if span.kind == KIND_CLIENT else SpanKind.INTERNAL,
        status=Status(StatusCode.UNSET)
        if span.error is None
        else Status(StatusCode.ERROR, span.error),
        start_time=span.start_ns,
        end_time=span.end_ns,
        instrumentation_scope=scope,
    )
