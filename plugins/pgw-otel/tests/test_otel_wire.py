"""The recorder's own OTLP bytes against the SDK's encoding of the same spans.

Every call goes to two recorders at once: one with the recorder's own OTLP export (the common
call written straight to bytes by ``pgw_otel.fast``, the others through the general path and
the hand-written encoder) and one with an SDK exporter, whose ``ReadableSpan`` objects the
SDK's ``encode_spans`` turns into the reference message. Both are parsed and compared span by
span and attribute by attribute (ids compared by the relations they make), and the metric
points both recorders aggregated are compared too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otel_test_helpers import MESSAGES, scope, source
from pgw_otel import OtelRecorder
from pgw_otel.aggregate import PlainMeter
from pgw_otel.fast import PlainCallWriter
from pgw_otel.otlp import OtlpHttp, TraceEncoder, _delimited
from pgw_otel.recorder import INSTRUMENTATION, VERSION, _Outcome
from pgw_otel.sinks import OtlpSpanSink
from polygateway.client import GatewayClient
from polygateway.errors import AllSourcesExhausted, CircuitOpenError
from polygateway.settings import CacheSettings, RetrySettings, ScopeSettings
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import CallStart, TelemetryRecord, admitted_event
from pydantic import BaseModel

RESOURCE = Resource.create({"service.name": "wire-test"})


class _KeptRequests(OtlpSpanSink):
    """The OTLP sink, keeping each request's bytes instead of posting them."""

    def __init__(self) -> None:
        super().__init__(
            TraceEncoder(dict(RESOURCE.attributes), INSTRUMENTATION, VERSION),
            OtlpHttp("http://127.0.0.1:9/v1/traces", {}, 1.0),
        )
        self.requests: list[bytes] = []

    def export_spans(self, spans: Sequence[Any]) -> None:
        self.requests.append(self.encoder.request(spans))

    def export_encoded(self, encoded: Sequence[bytes]) -> None:
        self.requests.append(self.encoder.request_of(encoded))


class _KeptMetrics:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def post(self, body: bytes) -> None:
        self.bodies.append(body)

    def shutdown(self) -> None:
        pass


class _Both:
    """Each call opened on both recorders (``SupportsCallTraces``)."""

    def __init__(self, *recorders: OtelRecorder) -> None:
        self.recorders = recorders

    def open_call(self, start: CallStart) -> Any:
        return _BothCalls([r.open_call(start) for r in self.recorders])

    async def record(self, record: Any) -> None:
        for recorder in self.recorders:
            await recorder.record(record)

    def record_nowait(self, record: Any) -> None:
        for recorder in self.recorders:
            recorder.record_nowait(record)

    async def flush(self) -> None:
        for recorder in self.recorders:
            await recorder.flush()

    async def aclose(self) -> None:
        for recorder in self.recorders:
            await recorder.aclose()


class _BothCalls:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def attempt(self, record: Any, outcome: object) -> None:
        for call in self.calls:
            call.attempt(record, outcome)

    def on_governance(self, event: Any) -> None:
        for call in self.calls:
            call.on_governance(event)

    def close(self, ended_at: float, error: BaseException | None) -> None:
        for call in self.calls:
            call.close(ended_at, error)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    value = getattr(any_value, kind)
    if kind == "array_value":
        return tuple(_value(v) for v in value.values)
    return value


def _spans(requests: Sequence[ExportTraceServiceRequest]) -> list[dict[str, Any]]:
    """Every span, ids replaced by their order of first appearance, attributes as a dict."""
    ids: dict[bytes, int] = {b"": 0}
    found = []
    for request in requests:
        assert len(request.resource_spans) == 1
        resource_spans = request.resource_spans[0]
        assert {a.key: _value(a.value) for a in resource_spans.resource.attributes} == dict(
            RESOURCE.attributes
        )
        for scope_spans in resource_spans.scope_spans:
            assert (scope_spans.scope.name, scope_spans.scope.version) == (INSTRUMENTATION, VERSION)
            for span in scope_spans.spans:
                attributes = {a.key: _value(a.value) for a in span.attributes}
                assert len(attributes) == len(span.attributes)  # no key twice
                found.append(
                    {
                        "trace": ids.setdefault(span.trace_id, len(ids)),
                        "span": ids.setdefault(span.span_id, len(ids)),
                        "parent": ids.setdefault(span.parent_span_id, len(ids)),
                        "name": span.name,
                        "kind": span.kind,
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                        "status": (span.HasField("status"), span.status.code, span.status.message),
                        "flags": span.flags,
                        "trace_state": span.trace_state,
                        "attributes": attributes,
                        "fields": sorted(f.name for f, _ in span.ListFields()),
                    }
                )
    return found


def _points(bodies: Sequence[bytes]) -> dict[str, Any]:
    """The last export's points: metric name -> its kind, unit and points (no times)."""
    if not bodies:
        return {}
    request = ExportMetricsServiceRequest.FromString(bodies[-1])
    found: dict[str, Any] = {}
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                points = []
                for point in getattr(metric, kind).data_points:
                    data = {f.name: v for f, v in point.ListFields()}
                    data.pop("start_time_unix_nano", None)
                    data.pop("time_unix_nano", None)
                    data["attributes"] = {a.key: _value(a.value) for a in point.attributes}
                    points.append(json.dumps(data, default=list, sort_keys=True))
                found[metric.name] = (kind, metric.unit, sorted(points))
    return found


async def _run_both(
    fake: FakeUpstream,
    settings: ScopeSettings,
    calls: Any,
    *,
    capture_content: bool = False,
) -> tuple[_KeptRequests, InMemorySpanExporter, _KeptMetrics, _KeptMetrics]:
    own, own_metrics = _KeptRequests(), _KeptMetrics()
    sdk, sdk_metrics = InMemorySpanExporter(), _KeptMetrics()
    common: dict[str, Any] = {
        "resource": RESOURCE,
        "sources": settings.sources,
        "capture_content": capture_content,
    }
    written = OtelRecorder(span_sink=own, metric_exporter=own_metrics, **common)
    defined = OtelRecorder(span_exporter=sdk, metric_exporter=sdk_metrics, **common)
    both = _Both(written, defined)
    async with GatewayClient(settings, telemetry=both) as client:
        await calls(client)
    await both.aclose()
    return own, sdk, own_metrics, sdk_metrics


def _assert_same(
    own: _KeptRequests,
    sdk: InMemorySpanExporter,
    own_metrics: _KeptMetrics,
    sdk_metrics: _KeptMetrics,
) -> list[dict[str, Any]]:
    written = _spans([ExportTraceServiceRequest.FromString(body) for body in own.requests])
    finished = sdk.get_finished_spans()
    reference = _spans([ExportTraceServiceRequest.FromString(
        encode_spans(finished).SerializeToString()
    )])  # fmt: skip
    assert written, "no spans written"
    assert len(written) == len(reference)
    for mine, theirs in zip(written, reference, strict=True):
        assert mine["attributes"] == theirs["attributes"], mine["name"]
        assert mine == theirs
    assert _points(own_metrics.bodies) == _points(sdk_metrics.bodies)
    assert _points(own_metrics.bodies)["gen_ai.client.operation.duration"]
    return written


class City(BaseModel):
    name: str
    country: str


async def test_common_calls_retries_switches_and_reasks_encode_as_the_sdk_does(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.script(
        "a",
        Reply.ok(content="Paris", prompt_tokens=12, completion_tokens=3, model="model-a-0612"),
        Reply.ok(content="ok", chunks=4, prompt_tokens=100, completion_tokens=4, cached_tokens=64),
        Reply.error(503),
        Reply.ok(content="retried"),
        Reply.ok(content='{"name": "Paris"}'),  # invalid: a re-ask
        Reply.ok(content='{"name": "Paris", "country": "France"}'),
    )
    settings = scope(fake_upstream)

    async def calls(client: GatewayClient) -> None:
        await client.chat(MESSAGES, session_id="s-1")
        await client.chat([{"role": "user", "content": "stream"}], stream=True)
        await client.chat([{"role": "user", "content": "retry"}])
        await client.chat([{"role": "user", "content": "reask"}], structured=City)
        await client.chat(MESSAGES, session_id="s-1")  # a cache hit

    spans = _assert_same(*await _run_both(fake_upstream, settings, calls))
    names = [span["name"] for span in spans]
    assert names.count("pgw.cache_hit") == 1
    nexts = {span["attributes"].get("pgw.attempt.next") for span in spans}
    assert {"retry", "reask"} <= nexts
    assert any("gen_ai.usage.cache_read.input_tokens" in s["attributes"] for s in spans)


async def test_errors_refusals_and_content_encode_as_the_sdk_does(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.script("a", Reply.error(503), Reply.error(503), Reply.ok(content="Paris"))
    settings = scope(
        fake_upstream,
        retry=RetrySettings(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0),
        cache=CacheSettings(backend="none"),
    )

    async def calls(client: GatewayClient) -> None:
        with pytest.raises(AllSourcesExhausted):
            await client.chat(MESSAGES)
        await client.chat([{"role": "user", "content": "answered"}])
        await client.components.breaker.force_open("a")
        with pytest.raises(CircuitOpenError):
            await client.chat(MESSAGES)

    spans = _assert_same(*await _run_both(fake_upstream, settings, calls, capture_content=True))
    assert {s["status"][1] for s in spans} == {0, 2}
    assert any(s["name"] == "pgw.refused" for s in spans)
    assert any("gen_ai.output.messages" in s["attributes"] for s in spans)


async def test_switches_and_calls_under_an_application_span_encode_as_the_sdk_does(
    fake_upstream: FakeUpstream,
) -> None:
    fake_upstream.script("a", Reply.error(401))  # a dead source: the next attempt switches
    sources = (source(fake_upstream, "a"), source(fake_upstream, "b"))
    settings = scope(fake_upstream, *sources, cache=CacheSettings(backend="none"))
    tracer = TracerProvider().get_tracer("app")

    async def calls(client: GatewayClient) -> None:
        with tracer.start_as_current_span("handle-request"):
            await client.chat(MESSAGES)
            await client.chat([{"role": "user", "content": "two"}])
        await client.chat([{"role": "user", "content": "outside"}])

    spans = _assert_same(*await _run_both(fake_upstream, settings, calls))
    assert any(s["attributes"].get("pgw.attempt.next") == "switch" for s in spans)
    calls_ = [s for s in spans if s["name"].startswith("chat ")]
    assert calls_[0]["trace"] == calls_[1]["trace"] != calls_[2]["trace"]
    assert calls_[0]["parent"] == calls_[1]["parent"] != 0 and calls_[2]["parent"] == 0


class _HeldSink(_KeptRequests):
    """Holds the batch thread in its first export until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def export_encoded(self, encoded: Sequence[bytes]) -> None:
        self.entered.set()
        self.release.wait(30)
        super().export_encoded(encoded)


async def test_a_full_buffer_drops_calls_counted_and_never_waits(
    fake_upstream: FakeUpstream,
) -> None:
    settings = scope(fake_upstream, cache=CacheSettings(backend="none"))
    held, metrics = _HeldSink(), _KeptMetrics()
    recorder = OtelRecorder(
        span_sink=held,
        metric_exporter=metrics,
        resource=RESOURCE,
        sources=settings.sources,
        max_queue=2,
        batch_delay_s=0.01,
    )
    async with GatewayClient(settings, telemetry=recorder) as client:
        await client.chat(MESSAGES)
        assert await asyncio.to_thread(held.entered.wait, 10)  # the thread is stuck exporting
        for n in range(5):
            assert (await client.chat([{"role": "user", "content": f"more {n}"}])).content
        assert recorder.dropped == 3  # two waited in the buffer, three did not fit
        held.release.set()
    await recorder.aclose()
    assert len(_spans([ExportTraceServiceRequest.FromString(b) for b in held.requests])) == 6
    dropped = _points(metrics.bodies)["pgw.telemetry.dropped"]
    assert dropped[0] == "sum" and '"as_int": 3' in dropped[2][0]


def _row(call_id: str, scope: str, error: str | None = None) -> TelemetryRecord:
    return TelemetryRecord(
        call_id, None, "s", "m", "openai", "a", "[]", "hi", "", 5, 1, "measured", 250, 80.0,
        5.0, False, error, 0.001, created_at=1_700_000_000.0, scope=scope,
    )  # fmt: skip


async def test_common_calls_beyond_every_limit_count_as_the_general_path_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # More scopes than blocks kept and than points per instrument (both limits lowered): blocks
    # of their own per call, overflow points, and kept blocks whose calls wait in their cells
    # until an export, some of them (after failed calls filled the counters) for an overflow
    # point.
    monkeypatch.setattr("pgw_otel.fast._BLOCK_LIMIT", 40)
    monkeypatch.setattr(PlainMeter.__init__, "__defaults__", (100,))
    own, own_metrics = _KeptRequests(), _KeptMetrics()
    sdk, sdk_metrics = InMemorySpanExporter(), _KeptMetrics()
    written = OtelRecorder(span_sink=own, metric_exporter=own_metrics, resource=RESOURCE)
    defined = OtelRecorder(span_exporter=sdk, metric_exporter=sdk_metrics, resource=RESOURCE)
    for n in range(90):  # the general path: a failed call per scope
        for recorder in (written, defined):
            recorder.record_nowait(_row(f"e-{n}", scope=f"e-{n}", error="UpstreamError"))
    for round_ in range(2):
        for n in range(150):
            for recorder in (written, defined):
                recorder.record_nowait(_row(f"c-{round_}-{n}", scope=f"s-{n % 110}"))
        await written.flush()
        await defined.flush()
        points = _points(own_metrics.bodies)
        assert points == _points(sdk_metrics.bodies)
        attempts = points["pgw.call.attempts"][2]
        assert len(attempts) == 101 and any("otel.metric.overflow" in p for p in attempts)
        assert written._plain is not None and defined._plain is not None
        assert written._plain.overflowed == defined._plain.overflowed > 0
    await written.aclose()
    await defined.aclose()
    assert written.spans == len(sdk.get_finished_spans()) == 2 * 90 + 2 * 2 * 150


def test_a_common_call_waits_as_plain_values_the_collector_stops_tracking() -> None:
    start = CallStart("chat", 1_699_999_999.0, "LLM", "s-1", None, "tenant-1", True)
    row = _row("c-1", "LLM")
    kept = tuple.__new__(_Outcome, ("stop", 3, 0))
    admitted = admitted_event("a", "closed", False)
    common = PlainCallWriter.common(
        start, otel_context.get_current(), [(row, kept)], 1_700_000_000.5, [(0, admitted)]
    )
    assert common is not None
    del start, row, kept, admitted
    gc.collect()
    assert not gc.is_tracked(common)
    # Not common: a probe, a second decision, a refusal, a retried call.
    probe = admitted_event("a", "half_open", True)
    row = _row("c-2", "LLM")
    for rows, events in (
        ([(row, None)], [(0, probe)]),
        ([(row, None)], [(0, admitted_event("a", "closed", False))] * 2),
        ([(row, None), (row, None)], None),
        ([(_row("c-3", ""), None)], [(1, admitted_event("a", "closed", False))]),
    ):
        assert (
            PlainCallWriter.common(
                CallStart("chat", 0.0), otel_context.Context(), rows, 1.0, events
            )
            is None
        )


@pytest.mark.parametrize("size", [1, 60, 200, 20_000])
@pytest.mark.parametrize("count", [0, 1, 3, 300])
def test_a_request_of_encoded_spans_is_their_nested_fields(size: int, count: int) -> None:
    encoder = TraceEncoder({"service.name": "wire-test", "long": "x" * 300}, "pgw_otel", "0.1")
    encoded = [bytes([n % 256]) * size for n in range(count)]
    scope_spans = _delimited(0x12, encoder._scope_block + b"".join(encoded))
    assert encoder.request_of(encoded) == _delimited(0x0A, encoder._resource_block + scope_spans)
