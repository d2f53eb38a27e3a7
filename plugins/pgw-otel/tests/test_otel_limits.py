"""The export side's limits: the batch thread under steady load, a hostile collector, secrets,
calls ending during ``aclose``, flushes against a hung collector, metric cardinality."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.sdk.resources import Resource
from otel_test_helpers import OtlpReceiver
from pgw_otel import OtelRecorder
from pgw_otel.aggregate import OVERFLOW_KEY, PlainMeter
from pgw_otel.batch import BatchThread
from pgw_otel.exchange import ANSWER_LIMIT, READ_LIMIT
from pgw_otel.options import OtelOptions, parse_headers
from pgw_otel.otlp import OtlpHttp, TraceEncoder
from pgw_otel.recorder import INSTRUMENTATION, VERSION
from pgw_otel.sinks import OtlpSpanSink
from polygateway.types import TelemetryRecord

RESOURCE = Resource.create({"service.name": "limits-test"})
SECRET = "sk-SECRET-TOKEN"

# ------------------------------------------------------------------ the batch thread


FEED_LIMIT = 100_000
"""Items the feeding ``handle`` offers at most (so a thread that never leaves its drain still
ends and the test fails instead of hanging)."""


class _Feeding:
    """A ``handle`` that offers one more item each time it is called, until ``tick`` ran:
    steady load, one call ending during each export."""

    def __init__(self) -> None:
        self.thread: BatchThread[int] = BatchThread(
            self.handle, self.tick, batch_size=1, delay_s=3600.0, tick_s=3600.0
        )
        self.fed = 0
        self.fed_at_tick: list[int] = []
        self.ticked = threading.Event()

    def handle(self, batch: list[int]) -> None:
        if not self.fed_at_tick and self.fed < FEED_LIMIT:
            self.fed += 1
            self.thread.offer(self.fed)

    def tick(self) -> None:
        self.fed_at_tick.append(self.fed)
        self.ticked.set()


def test_a_flush_under_steady_load_is_answered_after_what_waited() -> None:
    feeding = _Feeding()
    feeding.thread.start()
    feeding.thread.offer(0)
    try:
        assert feeding.thread.flush(60.0)
        # Answered after a turn or two, not once the load stopped.
        assert feeding.fed_at_tick and feeding.fed_at_tick[0] < 10
    finally:
        assert feeding.thread.shutdown(60.0)


def test_metrics_are_exported_on_schedule_under_steady_load() -> None:
    feeding = _Feeding()
    feeding.thread = BatchThread(
        feeding.handle, feeding.tick, batch_size=1, delay_s=3600.0, tick_s=0.0
    )  # the metric interval is over at every turn
    feeding.thread.start()
    feeding.thread.offer(0)
    try:
        assert feeding.ticked.wait(60.0)  # no flush: the schedule alone
        assert feeding.fed_at_tick[0] < 10
    finally:
        assert feeding.thread.shutdown(60.0)


def test_shutdown_drains_everything_then_closes_in_the_thread() -> None:
    handled: list[int] = []
    closed_in: list[str] = []
    batches: BatchThread[int] = BatchThread(
        handled.extend,
        lambda: None,
        batch_size=2,
        delay_s=3600.0,
        close=lambda: closed_in.append(threading.current_thread().name),
        name="limits-export",
    )
    batches.start()
    for item in range(5):
        assert batches.offer(item)
    assert batches.shutdown(60.0)
    assert handled == [0, 1, 2, 3, 4] and closed_in == ["limits-export"]
    assert not batches.offer(5)  # refused once shut down
    assert not batches.flush(1.0)


# ------------------------------------------------------------------ a hostile collector


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head


class _RawCollector:
    """A collector on loopback, one connection at a time, answering every request with
    ``answer(conn)`` in a thread of its own; ``finished`` is set once an answer ended
    (``error``: how it ended when the client went away)."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self._answer = answer
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.connections = 0
        self.error: OSError | None = None
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def url(self, path: str = "/v1/traces") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while True:
                    try:
                        head = _read_request(conn)
                    except OSError:  # the client went away
                        break
                    if not head:
                        break
                    self.requests.append(head)
                    try:
                        self._answer(conn)
                    except OSError as exc:
                        self.error = exc
                        break
                    finally:
                        self.finished.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept (Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


HUGE = 64 * 1024 * 1024


def _huge_with_length(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % HUGE)
    block = b"x" * 65536
    for _ in range(HUGE // len(block)):
        conn.sendall(block)


def _huge_chunked(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
    for _ in range(HUGE // 65536):
        conn.sendall(chunk)
    conn.sendall(b"0\r\n\r\n")


@pytest.mark.parametrize("answer", [_huge_with_length, _huge_chunked], ids=["length", "chunked"])
def test_a_huge_answer_is_read_up_to_a_cap_and_the_rest_left(
    answer: Callable[[socket.socket], None],
) -> None:
    collector = _RawCollector(answer)
    try:
        http = OtlpHttp(collector.url(), {}, 60.0)
        http.post(b"spans")  # a 2xx: the status decides, the body is not the export's
        assert collector.finished.wait(60.0)
        # The connection was dropped after the cap: the collector could not send it all.
        assert isinstance(collector.error, (BrokenPipeError, ConnectionResetError))
        http.shutdown()
    finally:
        collector.close()


def test_a_huge_error_answer_still_raises_with_its_status() -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % HUGE)
        conn.sendall(b"x" * (4 * ANSWER_LIMIT))

    collector = _RawCollector(answer)
    try:
        with pytest.raises(http.client.HTTPException, match="HTTP 500"):
            OtlpHttp(collector.url(), {}, 60.0).post(b"spans")
    finally:
        collector.close()


def test_endless_headers_stop_at_the_read_cap() -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n")
        # Fewer and shorter lines than http.client's own limits, more bytes than the cap.
        line = b"X-Filler: " + b"y" * 2000 + b"\r\n"
        for _ in range(READ_LIMIT // len(line) + 2):
            conn.sendall(line)
        conn.sendall(b"\r\n")

    collector = _RawCollector(answer)
    try:
        with pytest.raises(http.client.HTTPException, match="longer than"):
            OtlpHttp(collector.url(), {}, 60.0).post(b"spans")
    finally:
        collector.close()


class _SteppingClock:
    """A monotonic clock moving ``step`` seconds each time it is read, letting the collector
    send one more byte each time (the drip: every read gets its byte in time)."""

    def __init__(self, step: float) -> None:
        self.now = 1000.0
        self.step = step
        self.reads = threading.Semaphore(0)

    def __call__(self) -> float:
        self.now += self.step
        self.reads.release()
        return self.now


def test_a_dripping_collector_gets_one_deadline_for_the_whole_export() -> None:
    clock = _SteppingClock(0.25)
    answer_bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    sent: list[int] = []

    def drip(conn: socket.socket) -> None:
        for byte in answer_bytes:
            if not clock.reads.acquire(timeout=60.0):
                return
            conn.sendall(bytes((byte,)))
            sent.append(byte)

    collector = _RawCollector(drip)
    try:
        http = OtlpHttp(collector.url(), {}, 1.0, clock=clock)
        with pytest.raises(TimeoutError, match="longer than 1 s"):
            http.post(b"spans")
        assert len(sent) < len(answer_bytes)  # given up while bytes still came
    finally:
        collector.close()


def test_an_answer_after_connection_close_is_read_and_the_next_export_reconnects() -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
        conn.shutdown(socket.SHUT_WR)

    collector = _RawCollector(answer)
    try:
        http = OtlpHttp(collector.url(), {}, 60.0)
        http.post(b"one")
        http.post(b"two")
        assert collector.connections == 2 and len(collector.requests) == 2
    finally:
        collector.close()


async def test_exports_keep_one_connection_alive(receiver: OtlpReceiver) -> None:
    http = OtlpHttp(f"{receiver.url}/v1/traces", {"Authorization": "Bearer t"}, 60.0)
    body = TraceEncoder(dict(RESOURCE.attributes), INSTRUMENTATION, VERSION).request([])
    for _ in range(3):
        await asyncio.to_thread(http.post, body)
    await asyncio.to_thread(http.shutdown)
    assert len(receiver.traces) == 3 and receiver.headers[0]["Authorization"] == "Bearer t"


def test_a_redirect_is_not_followed() -> None:
    elsewhere = _RawCollector(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n"))

    def redirect(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n"
            % elsewhere.url().encode()
        )

    collector = _RawCollector(redirect)
    try:
        with pytest.raises(http.client.HTTPException, match="HTTP 307"):
            OtlpHttp(collector.url(), {"Authorization": SECRET}, 60.0).post(b"spans")
        assert elsewhere.connections == 0
    finally:
        collector.close()
        elsewhere.close()


# ------------------------------------------------------------------ secrets


@pytest.mark.parametrize(
    "value",
    [f"Bearer sk\u2013{SECRET}", f"Bearer {SECRET}\r\nX-Injected: 1", f"Bearer {SECRET}\x00"],
)
def test_a_header_value_http_cannot_carry_is_refused_naming_only_the_header(value: str) -> None:
    for make in (
        lambda: parse_headers(f"Authorization={value}"),
        lambda: OtelOptions(endpoint="http://h:4318", headers=f"Authorization={value}"),
        lambda: OtlpHttp("http://h:4318/v1/traces", {"Authorization": value}, 1.0),
    ):
        with pytest.raises(ValueError, match="Authorization") as raised:
            make()
        assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)


def test_a_header_name_that_is_no_token_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match="header 1") as raised:
        parse_headers(f"Bearer {SECRET}=x")
    assert SECRET not in str(raised.value)


def test_the_url_never_shows_its_query_and_credentials_are_refused() -> None:
    http = OtlpHttp(f"http://h:4318/v1/traces?api_key={SECRET}", {}, 1.0)
    sink = OtlpSpanSink(TraceEncoder({}, INSTRUMENTATION, VERSION), http)
    assert SECRET not in repr(http) and SECRET not in repr(sink)
    assert "/v1/traces" in repr(http)
    with pytest.raises(ValueError, match="credentials") as raised:
        OtlpHttp(f"https://user:{SECRET}@h:4318/v1/traces", {}, 1.0)
    assert SECRET not in str(raised.value)
    for endpoint in (f"http://h:4318?api_key={SECRET}", f"https://user:{SECRET}@h:4318"):
        with pytest.raises(ValueError) as raised_options:
            OtelOptions(endpoint=endpoint)
        assert SECRET not in str(raised_options.value)


async def test_a_failing_export_logs_no_secret(
    receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.fail_with = 401
    options = OtelOptions(
        endpoint=receiver.url, headers=f"Authorization=Bearer {SECRET}", export_timeout_s=30.0
    )
    recorder = OtelRecorder.from_options(options)
    with caplog.at_level(logging.WARNING):
        recorder.record_nowait(_row("c-1"))
        await recorder.flush()
        await recorder.aclose()
    assert "HTTP 401" in caplog.text and SECRET not in caplog.text


# ------------------------------------------------------------------ aclose and flush


def _row(call_id: str, model: str = "m", scope: str = "LLM") -> TelemetryRecord:
    return TelemetryRecord(
        call_id, None, "s", model, "openai", "a", "[]", "hi", "", 5, 1, "measured", 250, 80.0,
        5.0, False, None, 0.001, created_at=1_700_000_000.0, scope=scope,
    )  # fmt: skip


class _Kept:
    """Export bodies, kept; with ``hold``, the first export waits for ``release``."""

    def __init__(self, *, hold: bool = False) -> None:
        self.bodies: list[bytes] = []
        self.hold = hold
        self.entered = threading.Event()
        self.on_enter: Callable[[], object] = lambda: None
        self.release = threading.Event()
        self.closed_in: list[str] = []

    def post(self, body: bytes) -> None:
        self.entered.set()
        self.on_enter()
        if self.hold:
            self.release.wait(60.0)
        self.bodies.append(body)

    def shutdown(self) -> None:
        self.closed_in.append(threading.current_thread().name)


class _HeldSpans(OtlpSpanSink):
    """The OTLP sink posting through a ``_Kept`` instead of a connection."""

    def __init__(self, kept: _Kept) -> None:
        encoder = TraceEncoder(dict(RESOURCE.attributes), INSTRUMENTATION, VERSION)
        super().__init__(encoder, kept)  # type: ignore[arg-type]


def _dropped_points(bodies: Sequence[bytes]) -> list[Any]:
    request = ExportMetricsServiceRequest.FromString(bodies[-1])
    return [
        point
        for resource in request.resource_metrics
        for scope_metrics in resource.scope_metrics
        for metric in scope_metrics.metrics
        if metric.name == "pgw.telemetry.dropped"
        for point in metric.sum.data_points
    ]


async def test_a_call_ending_during_aclose_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spans, metrics = _Kept(hold=True), _Kept()
    recorder = OtelRecorder(span_sink=_HeldSpans(spans), metric_exporter=metrics, resource=RESOURCE)
    with caplog.at_level(logging.WARNING):
        recorder.record_nowait(_row("c-1"))
        flushing = asyncio.ensure_future(recorder.flush())
        assert await asyncio.to_thread(spans.entered.wait, 60.0)  # the thread is exporting
        closing = asyncio.ensure_future(recorder.aclose())
        await asyncio.sleep(0)  # one loop turn: aclose runs up to its first await
        recorder.record_nowait(_row("c-2"))  # a call ending while aclose waits
        spans.release.set()
        await flushing
        await closing
    assert recorder.dropped == 1 and "failed" not in caplog.text
    (point,) = _dropped_points(metrics.bodies)
    assert point.as_int == 1
    # The exporters were shut by the batch thread, after its last export.
    assert spans.closed_in == metrics.closed_in == ["pgw-otel-export"]


async def test_flushes_against_a_hung_collector_hold_no_executor_thread() -> None:
    spans = _Kept(hold=True)
    recorder = OtelRecorder(span_sink=_HeldSpans(spans), resource=RESOURCE, flush_timeout_s=30.0)
    loop = asyncio.get_running_loop()
    exporting = asyncio.Event()
    spans.on_enter = lambda: loop.call_soon_threadsafe(exporting.set)
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    try:
        recorder.record_nowait(_row("c-1"))
        flushes = [asyncio.ensure_future(recorder.flush()) for _ in range(4)]
        await exporting.wait()
        # The one executor thread is free while every flush waits for the collector.
        assert await loop.run_in_executor(None, lambda: 42) == 42
        assert not any(flush.done() for flush in flushes)
        spans.release.set()
        await asyncio.gather(*flushes)
    finally:
        spans.release.set()
        await recorder.aclose()


class _HungProvider:
    """An owned provider whose flush waits for ``release``."""

    def __init__(self) -> None:
        self.flushes = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def force_flush(self, timeout_millis: int = 0) -> bool:
        self.flushes += 1
        self.entered.set()
        return self.release.wait(60.0)

    def shutdown(self) -> None:
        pass


async def test_concurrent_flushes_share_one_flush_of_the_owned_providers() -> None:
    provider = _HungProvider()
    recorder = OtelRecorder(owned=[provider], flush_timeout_s=60.0)
    flushes = [asyncio.ensure_future(recorder.flush()) for _ in range(4)]
    assert await asyncio.to_thread(provider.entered.wait, 60.0)
    provider.release.set()
    await asyncio.gather(*flushes)
    assert provider.flushes == 1
    await recorder.aclose()


# ------------------------------------------------------------------ cardinality


def test_each_instrument_keeps_at_most_its_limit_of_attribute_sets() -> None:
    meter = PlainMeter(0, point_limit=100)
    counter = meter.create_counter("c")
    histogram = meter.create_histogram("h", explicit_bucket_boundaries_advisory=(1.0,))
    gauge = meter.create_gauge("g")
    for n in range(5000):
        counter.add(1, {"gen_ai.response.model": f"m-{n}"})
        histogram.record(2.0, {"gen_ai.response.model": f"m-{n}"})
        gauge.set(n, {"gen_ai.response.model": f"m-{n}"})
    for instrument in (counter, histogram, gauge):
        assert len(instrument.points) == 101 and instrument.overflowed == 4900
    assert counter.points[OVERFLOW_KEY] == 4900
    assert histogram.points[OVERFLOW_KEY].counts == [0, 4900]
    assert gauge.points[OVERFLOW_KEY] == 4999
    counter.add(1, {"gen_ai.response.model": "m-0"})  # a kept set still counts on its own
    assert counter.points[(("gen_ai.response.model", "m-0"),)] == 2
    assert meter.overflowed == 3 * 4900


async def test_varying_upstream_models_stay_under_the_limit_in_every_export() -> None:
    spans, metrics = _Kept(), _Kept()
    recorder = OtelRecorder(
        span_sink=_HeldSpans(spans), metric_exporter=metrics, resource=RESOURCE, max_queue=8192
    )
    for n in range(5000):
        recorder.record_nowait(_row(f"c-{n}", model=f"model-{n}"))
    await recorder.flush()
    await recorder.aclose()
    request = ExportMetricsServiceRequest.FromString(metrics.bodies[-1])
    for metric in request.resource_metrics[0].scope_metrics[0].metrics:
        points = getattr(metric, metric.WhichOneof("data")).data_points
        assert len(points) <= 2001, metric.name
        if metric.name == "gen_ai.client.operation.duration":
            overflow = [
                p for p in points if [a.key for a in p.attributes] == ["otel.metric.overflow"]
            ]
            assert len(overflow) == 1 and overflow[0].count == 3000
