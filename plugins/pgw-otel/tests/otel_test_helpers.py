"""Builders of the pgw-otel suite: SDK providers with in-memory exporters, a client on the
fake upstream recording through them, and a fake OTLP/HTTP receiver on loopback."""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pgw_otel import OtelRecorder
from polygateway.settings import (
    BackpressureSettings,
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
)
from polygateway.testing import FakeUpstream

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def source(fake: FakeUpstream, name: str = "a", **overrides: Any) -> SourceConfig:
    values: dict[str, Any] = {
        "name": name,
        "provider": "openai",
        "base_url": fake.base_url(name),
        "model": f"model-{name}",
        "api_key": Secret(f"sk-test-{name}"),
        "timeout_s": 10.0,
        "est_tokens": 50,
    }
    values.update(overrides)
    return SourceConfig(**values)


def scope(fake: FakeUpstream, *sources: SourceConfig, **overrides: Any) -> ScopeSettings:
    values: dict[str, Any] = {
        "scope": "LLM",
        "sources": sources or (source(fake),),
        "retry": RetrySettings(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0),
        "backpressure": BackpressureSettings(quota_full="fail_fast"),
        "cache": CacheSettings(backend="memory", namespace="tenant-1", ttl_s=300.0),
    }
    values.update(overrides)
    return ScopeSettings(**values)


@dataclass
class Sdk:
    """SDK providers whose spans and metrics the test reads back."""

    spans: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    reader: InMemoryMetricReader = field(default_factory=InMemoryMetricReader)
    tracer_provider: TracerProvider = field(init=False)
    meter_provider: MeterProvider = field(init=False)

    def __post_init__(self) -> None:
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def recorder(self, settings: ScopeSettings, **kwargs: Any) -> OtelRecorder:
        return OtelRecorder(
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
            sources=settings.sources,
            **kwargs,
        )

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, Any]:
        """Metric name -> the metric (one scope: pgw_otel)."""
        data = self.reader.get_metrics_data()
        found: dict[str, Any] = {}
        if data is None:
            return found
        for resource in data.resource_metrics:
            for scope_metrics in resource.scope_metrics:
                for metric in scope_metrics.metrics:
                    found[metric.name] = metric
        return found


def call_and_attempts(
    spans: list[ReadableSpan],
) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The one call span (parent of the others) and its attempt spans, oldest first."""
    ids = {span.context.span_id for span in spans}
    calls = [s for s in spans if s.parent is None or s.parent.span_id not in ids]
    assert len(calls) == 1, [s.name for s in spans]
    call = calls[0]
    attempts = [
        s for s in spans if s.parent is not None and s.parent.span_id == call.context.span_id
    ]
    attempts.sort(key=lambda s: s.attributes["pgw.attempt.number"] if s.attributes else 0)
    return call, attempts


def attrs(span: ReadableSpan) -> Mapping[str, Any]:
    return dict(span.attributes or {})


@dataclass
class OtlpReceiver:
    """A Langfuse-style OTLP/HTTP receiver: ``/v1/traces`` and ``/v1/metrics``, protobuf."""

    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    headers: list[Mapping[str, str]] = field(default_factory=list)
    fail_with: int | None = None
    runner: web.AppRunner | None = None
    port: int = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _body(self, request: web.Request) -> bytes:
        assert request.content_type == "application/x-protobuf", request.content_type
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.headers.append(dict(request.headers))
        return body

    async def _traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await self._body(request))
        self.traces.append(message)
        if self.fail_with is not None:
            return web.Response(status=self.fail_with)
        return web.Response(content_type="application/x-protobuf", body=b"")

    async def _metrics(self, request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest()
        message.ParseFromString(await self._body(request))
        self.metrics.append(message)
        return web.Response(content_type="application/x-protobuf", body=b"")

    def spans(self) -> list[Any]:
        return [
            span
            for message in self.traces
            for resource in message.resource_spans
            for scope_spans in resource.scope_spans
            for span in scope_spans.spans
        ]
