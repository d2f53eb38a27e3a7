"""Export paths: OTLP/HTTP protobuf to a receiver on loopback, the Prometheus endpoint, the
fan-out from the configuration, and exporters or sinks that fail without touching the call."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from otel_test_helpers import MESSAGES, OtlpReceiver, Sdk, attrs, call_and_attempts, scope
from pgw_otel import OtelOptions, OtelRecorder, serve_prometheus
from polygateway.client import GatewayClient
from polygateway.telemetry.fanout import FanoutRecorder, fanout
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import TelemetryRecord


def _env(fake: FakeUpstream, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("openai-1"),
        "LLM__OPENAI__1__MODEL": "gpt-test",
        "LLM__OPENAI__1__API_KEY": "sk-not-shown",
        "PGW_CACHE_BACKEND": "none",
        "PGW_TELEMETRY_SQLITE_PATH": str(tmp_path / "telemetry.db"),
        **extra,
    }


def _sqlite_rows(path: Path) -> list[sqlite3.Row]:
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        return list(conn.execute("SELECT * FROM pgw_calls ORDER BY created_at, rowid"))


def _value(attribute: Any) -> Any:
    kind = attribute.value.WhichOneof("value")
    value = getattr(attribute.value, kind)
    if kind == "array_value":
        return tuple(getattr(v, v.WhichOneof("value")) for v in value.values)
    return value


async def test_fan_out_from_the_env_sends_every_row_to_sqlite_and_spans_over_otlp(
    fake_upstream: FakeUpstream,
    receiver: OtlpReceiver,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # no stray ./pgw.toml or ./.env
    fake_upstream.script("openai-1", Reply.error(503), Reply.ok(content="Paris"))
    env = _env(
        fake_upstream,
        tmp_path,
        PGW_TELEMETRY_BACKEND="sqlite,otel",
        LLM__TELEMETRY__OTEL__ENDPOINT=receiver.url,
        LLM__TELEMETRY__OTEL__HEADERS="Authorization=Basic cGstbGY6c2stbGY=",
    )
    async with GatewayClient.from_env(env=env) as client:
        recorder = client.components.telemetry
        assert isinstance(recorder, FanoutRecorder)
        assert list(recorder.sinks) == ["sqlite", "otel"]
        assert "cGstbGY6c2stbGY" not in repr(client.settings)
        response = await client.chat(MESSAGES, session_id="s-9")
    assert response.content == "Paris"
    rows = _sqlite_rows(tmp_path / "telemetry.db")
    assert [r["error"] for r in rows] == ["TransientError", None]
    # aclose flushed the exporter: the receiver decoded valid OTLP protobuf.
    spans = receiver.spans()
    assert len(spans) == 3
    assert receiver.headers[0]["Authorization"] == "Basic cGstbGY6c2stbGY="
    call = next(s for s in spans if s.name == "chat gpt-test")
    call_attrs = {a.key: _value(a) for a in call.attributes}
    assert call_attrs["gen_ai.operation.name"] == "chat"
    assert call_attrs["gen_ai.provider.name"] == "openai"
    assert call_attrs["gen_ai.request.model"] == "gpt-test"
    assert call_attrs["gen_ai.conversation.id"] == "s-9"
    assert call_attrs["pgw.attempts"] == 2
    assert "gen_ai.system" not in call_attrs
    children = [s for s in spans if s.parent_span_id == call.span_id]
    assert len(children) == 2 and {s.trace_id for s in spans} == {call.trace_id}
    resource = receiver.traces[0].resource_spans[0].resource
    assert {a.key: _value(a) for a in resource.attributes}["service.name"] == "polygateway"
    names = {
        m.name
        for message in receiver.metrics
        for rm in message.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {"gen_ai.client.operation.duration", "gen_ai.client.token.usage"} <= names


async def test_a_pipeline_file_lists_the_backends_with_options_per_sink(
    fake_upstream: FakeUpstream, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    pipeline = tmp_path / "pgw.toml"
    pipeline.write_text(
        "[scopes.LLM.telemetry]\n"
        'backend = ["sqlite", "otel"]\n'
        "[scopes.LLM.telemetry.options.otel]\n"
        f'endpoint = "{receiver.url}"\n'
        'service_name = "lab-api"\n'
    )
    env = _env(fake_upstream, tmp_path)
    async with GatewayClient.from_env(env=env, pipeline_path=pipeline) as client:
        assert client.settings.telemetry.backends == ("sqlite", "otel")
        await client.chat(MESSAGES)
    resource = receiver.traces[0].resource_spans[0].resource
    assert {a.key: _value(a) for a in resource.attributes}["service.name"] == "lab-api"
    assert len(_sqlite_rows(tmp_path / "telemetry.db")) == 1


async def test_an_unreachable_or_failing_collector_never_fails_the_call(
    fake_upstream: FakeUpstream, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    receiver.fail_with = 500
    settings = scope(fake_upstream)
    recorder = OtelRecorder.from_options(
        OtelOptions(endpoint=receiver.url, export_timeout_s=2.0), sources=settings.sources
    )
    async with GatewayClient(settings, telemetry=recorder) as client:
        response = await client.chat(MESSAGES)
    assert response.content
    assert receiver.traces  # it was tried, and refused
    await recorder.aclose()
    dead = OtelRecorder.from_options(
        OtelOptions(endpoint="http://127.0.0.1:9", export_timeout_s=1.0), sources=settings.sources
    )
    async with GatewayClient(settings, telemetry=dead) as client:
        assert (await client.chat([{"role": "user", "content": "again"}])).content
    await dead.aclose()


class _Raising(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise RuntimeError("exporter down")

    def shutdown(self) -> None:
        pass


async def test_an_exporter_that_raises_in_the_call_path_never_fails_the_call(
    fake_upstream: FakeUpstream,
) -> None:
    exporter = _Raising()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exports inside span.end()
    settings = scope(fake_upstream)
    recorder = OtelRecorder(tracer_provider=provider, meter_provider=MeterProvider())
    async with GatewayClient(settings, telemetry=recorder) as client:
        assert (await client.chat(MESSAGES)).content
    assert exporter.calls >= 2


class _BrokenTracerProvider(TracerProvider):
    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        class Tracer:
            def start_span(self, *args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("tracer broken")

        return Tracer()


async def test_a_broken_tracer_is_counted_and_never_reaches_the_call(
    fake_upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    settings = scope(fake_upstream)
    recorder = OtelRecorder(tracer_provider=_BrokenTracerProvider(), meter_provider=MeterProvider())
    async with GatewayClient(settings, telemetry=recorder) as client:
        assert (await client.chat(MESSAGES)).content
        assert (await client.chat([{"role": "user", "content": "two"}])).content
    assert recorder.dropped == 2
    assert sum("tracer broken" in r.getMessage() for r in caplog.records) == 1  # once per cause


class _FailingSink:
    async def record(self, record: TelemetryRecord) -> None:
        raise OSError("disk gone")

    async def flush(self) -> None:
        raise OSError("disk gone")

    async def aclose(self) -> None:
        pass


class _HangingSink:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.rows: list[TelemetryRecord] = []

    async def record(self, record: TelemetryRecord) -> None:
        await self.release.wait()
        self.rows.append(record)

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_one_failing_sink_never_affects_the_others_or_the_call(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    settings = scope(fake_upstream)
    hanging = _HangingSink()
    recorder = fanout(
        {"bad": _FailingSink(), "slow": hanging, "otel": sdk.recorder(settings)}, max_pending=1
    )
    async with GatewayClient(settings, telemetry=recorder) as client:
        await client.chat(MESSAGES)
        await client.chat([{"role": "user", "content": "two"}])  # "slow" holds one row at most
        # Spans reached the otel sink whatever the others did.
        assert len([s for s in sdk.finished() if s.name == "chat model-a"]) == 2
        hanging.release.set()
    assert recorder.drops == {"bad": 2, "slow": 1, "otel": 0}
    assert len(hanging.rows) == 1


async def test_serve_prometheus_exposes_the_metrics(fake_upstream: FakeUpstream) -> None:
    endpoint = serve_prometheus(0)
    try:
        settings = scope(fake_upstream)
        meter_provider = MeterProvider(metric_readers=[endpoint.reader])
        recorder = OtelRecorder(
            tracer_provider=TracerProvider(),
            meter_provider=meter_provider,
            sources=settings.sources,
        )
        async with GatewayClient(settings, telemetry=recorder) as client:
            await client.chat(MESSAGES)
        async with httpx.AsyncClient() as http:
            text = (await http.get(endpoint.url)).text
        assert "gen_ai_client_operation_duration_seconds_bucket" in text
        assert 'gen_ai_request_model="model-a"' in text
        assert "pgw_cache_lookups" in text
        meter_provider.shutdown()
    finally:
        endpoint.shutdown()


def test_options_are_checked_and_secret() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        OtelOptions(endpoint="collector:4318")
    with pytest.raises(ValueError, match="not name=value"):
        OtelOptions(headers="Authorization")
    options = OtelOptions(endpoint="http://h:4318/", headers="Authorization=Basic s3cr3t")
    assert options.endpoint is not None and options.endpoint.reveal() == "http://h:4318"
    assert "s3cr3t" not in repr(options)
    assert OtelOptions().capture_content is False


async def test_a_row_without_a_call_is_a_call_of_one_attempt(sdk: Sdk) -> None:
    recorder = OtelRecorder(tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider)
    row = TelemetryRecord(
        "c-1", None, "s", "m", "openai", "a", "[]", "hi", "", 5, 1, "measured", 250, 80.0, 5.0,
        False, None, 0.001, created_at=1_700_000_000.0, scope="LLM",
    )  # fmt: skip
    await recorder.record(row)
    call, attempts = call_and_attempts(sdk.finished())
    assert abs(call.end_time - call.start_time - 250_000_000) < 1_000  # float seconds
    assert attrs(call)["gen_ai.usage.input_tokens"] == 5 and attrs(call)["pgw.cost"] == 0.001
    assert len(attempts) == 1


async def test_recorders_on_one_meter_provider_each_report_their_own(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    chat, embed, broken = (scope(fake_upstream, scope=name) for name in ("LLM", "EMBED", "BAD"))
    first = sdk.recorder(chat)
    async with GatewayClient(chat, telemetry=first) as client:
        assert (await client.chat(MESSAGES)).content
        assert (await client.chat(MESSAGES)).content  # a cache hit
    await first.aclose()  # passed in: the caller's to close
    # A client rebuilt after aclose, on the same scope: it keeps counting there.
    async with GatewayClient(chat, telemetry=sdk.recorder(chat)) as client:
        assert (await client.chat([{"role": "user", "content": "rebuilt"}])).content
    async with GatewayClient(embed, telemetry=sdk.recorder(embed)) as client:
        for n in range(3):
            assert (await client.chat([{"role": "user", "content": f"embed {n}"}])).content
    failing = OtelRecorder(
        tracer_provider=_BrokenTracerProvider(), meter_provider=sdk.meter_provider
    )
    async with GatewayClient(broken, telemetry=failing) as client:
        for n in range(7):
            assert (await client.chat([{"role": "user", "content": f"bad {n}"}])).content
    assert failing.dropped == 7
    # A closed recorder reports nothing more, even when a call still reaches it.
    async with GatewayClient(chat, telemetry=first) as client:
        assert (await client.chat([{"role": "user", "content": "after close"}])).content

    found = sdk.metrics()
    lookups = {
        (p.attributes["pgw.scope"], p.attributes["pgw.cache.hit"]): p.value
        for p in found["pgw.cache.lookups"].data.data_points
    }
    assert lookups == {("LLM", False): 2, ("LLM", True): 1, ("EMBED", False): 3}
    dropped = {
        (p.attributes["pgw.scope"], p.attributes["pgw.sink"]): p.value
        for p in found["pgw.telemetry.dropped"].data.data_points
    }
    assert dropped == {("BAD", "otel"): 7}
    durations = {
        p.attributes["pgw.scope"]: p.count
        for p in found["gen_ai.client.operation.duration"].data.data_points
    }
    assert durations == {"LLM": 2, "EMBED": 3}  # cache hits are not timed
    gauge = {
        (p.attributes["pgw.scope"], p.attributes["pgw.source"]): p.value
        for p in found["pgw.breaker.state"].data.data_points
    }
    assert gauge == {("LLM", "a"): 0, ("EMBED", "a"): 0, ("BAD", "a"): 0}
