"""CPU of ``pgw_otel.OtelRecorder.export`` alone: one call of one attempt, ``N`` times.

    valgrind --tool=callgrind python tools/bench/otel_export.py MODE N

``MODE``: ``none`` (no-op tracer and meter providers: the recorder's own work), ``spans`` (the
SDK tracer with a batch span processor, no-op meter), ``metrics`` (the SDK meter, no-op
tracer), ``all``. Instructions per export = (Ir(N2) - Ir(N1)) / (N2 - N1) over two runs.
"""

from __future__ import annotations

import sys
from typing import Any

from opentelemetry import context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracerProvider
from pgw_otel import OtelRecorder
from polygateway.types import CallStart, GovernanceEvent, LLMResponse, TelemetryRecord


class _Discard(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(_Discard()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    recorder = OtelRecorder(
        tracer_provider=tracer_provider if mode in ("all", "spans") else NoOpTracerProvider(),
        meter_provider=meter_provider if mode in ("all", "metrics") else NoOpMeterProvider(),
    )
    row = TelemetryRecord(
        "c-1", None, "s", "m", "openai", "a", "[]", "hi", "", 5, 1, "measured", 250, 80.0, 5.0,
        False, None, 0.001, created_at=1_700_000_000.0, scope="LLM",
    )  # fmt: skip
    response = LLMResponse("hi", finish_reason="stop")
    start = CallStart("chat", 1_699_999_999.0, "LLM")
    events = [(0, GovernanceEvent("admitted", "a", "closed", False))]
    parent = context.get_current()
    for _ in range(n):
        recorder.export(start, parent, [(row, response)], 1_700_000_000.1, None, events)
    tracer_provider.shutdown()


if __name__ == "__main__":
    main()
