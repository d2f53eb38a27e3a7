"""The common call written straight to OTLP bytes and metric points: the batch thread's fast path.

Most calls are one successful attempt whose only governor decision is its admission. With the
recorder's own OTLP export and aggregated metrics, ``PlainCallWriter.write`` makes the two spans'
bytes and the metric points without building attribute dicts or span objects: the attributes
that repeat from call to call (operation, provider, scope, models, source, finish reason, ...)
are encoded once per distinct combination, kept with the span names and the metric point keys,
and each call adds only what is its own (ids, times, token counts, cost, timings).

The definition is the recorder's general path (``OtelRecorder._build`` and ``_Metrics``); the
suite checks both give the same spans (parsed, attribute by attribute) and the same points. Any
other call (a retry, a cache hit, an error, a refusal, a probe, a wait, content capture) takes
the general path: ``PlainCallWriter.takes`` says which.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polygateway.types import CallStart, GovernanceEvent, TelemetryRecord

from pgw_otel.aggregate import HistogramPoint, Key, PlainMeter
from pgw_otel.otlp import (
    KIND_CLIENT,
    KIND_INTERNAL,
    SPAN_FLAGS_LOCAL,
    SPAN_FLAGS_REMOTE,
    SPAN_TIMES,
    AttributeKey,
    double_attribute,
    int_attribute,
    name_field,
    span_field,
    str_attribute,
)

__all__ = ["PlainCallWriter"]

_BLOCK_LIMIT = 1024
"""Distinct attribute combinations kept; beyond it each is encoded on its own."""


@dataclass(frozen=True, slots=True)
class _Block:
    """What one combination of repeated attributes encodes to, and its metric point keys."""

    call_attrs: bytes
    call_name: bytes
    attempt_attrs: bytes
    attempt_name: bytes
    base_key: Key
    input_key: Key
    output_key: Key
    attempts_key: Key
    cache_key: Key
    admission_key: Key
    points: list[HistogramPoint | None]
    """The histogram points of this combination once recorded (duration, input tokens,
    output tokens, time to first chunk, time per chunk): kept, their keys not hashed again."""


class PlainCallWriter:
    """See the module docstring. ``models``: each source's configured model; ``attributes``: the
    encoder's (its cache of repeated pairs); ``meter``: the recorder's aggregates;
    ``breaker_seen``: the recorder's breaker-state gauge update."""

    def __init__(
        self,
        models: Mapping[str, str],
        attributes: Callable[[Mapping[str, Any]], bytes],
        meter: PlainMeter,
        breaker_seen: Callable[[str, str, str], None],
    ) -> None:
        self._models = models
        self._breaker_seen = breaker_seen
        self._admissions = meter.counter("pgw.limiter.admissions")
        self._attributes = attributes
        self._duration = meter.histogram("gen_ai.client.operation.duration")
        self._tokens = meter.histogram("gen_ai.client.token.usage")
        self._ttfc = meter.histogram("gen_ai.client.operation.time_to_first_chunk")
        self._per_chunk = meter.histogram("gen_ai.client.operation.time_per_output_chunk")
        self._attempts = meter.counter("pgw.call.attempts")
        self._cache = meter.counter("pgw.cache.lookups")
        self._blocks: dict[tuple[Any, ...], _Block] = {}
        self._keys = {
            name: AttributeKey(name)
            for name in (
                "pgw.call_id",
                "pgw.root_call_id",
                "gen_ai.conversation.id",
                "pgw.session_id",
                "pgw.parent_call_id",
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.output_tokens",
                "gen_ai.usage.cache_read.input_tokens",
                "gen_ai.usage.cache_creation.input_tokens",
                "pgw.cost",
                "pgw.ttft_ms",
                "pgw.max_inter_token_ms",
                "pgw.usage.input_tokens",
                "pgw.usage.output_tokens",
                "pgw.usage.cache_read.input_tokens",
            )
        }
        # The token fields of each count below 128 (one varint byte), made once: indexed by
        # the count, what int_attribute gives for it.
        self._input_small = self._small_fields("gen_ai.usage.input_tokens")
        self._output_small = self._small_fields("gen_ai.usage.output_tokens")
        self._attempt_input_small = self._small_fields("pgw.usage.input_tokens")
        self._attempt_output_small = self._small_fields("pgw.usage.output_tokens")

    def _small_fields(self, name: str) -> list[bytes]:
        key = self._keys[name]
        return [int_attribute(key, count) for count in range(0x80)]

    @staticmethod
    def takes(
        rows: list[tuple[TelemetryRecord, object]],
        failure: object,
        events: Sequence[tuple[int, GovernanceEvent]],
    ) -> bool:
        """A call of one successful attempt, no error, and at most the governor's admission
        of that attempt (no probe, no refusal, no wait) to report."""
        if len(rows) != 1 or failure is not None:
            return False
        record = rows[0][0]
        if record.error is not None or record.cache_hit or not record.source_name:
            return False
        if not events:
            return True
        if len(events) != 1:
            return False
        before, event = events[0]
        return (
            before == 0
            and event.kind == "admitted"
            and not event.probe
            and event.source == record.source_name
        )

    def write(
        self,
        start: CallStart,
        rows: list[tuple[TelemetryRecord, object]],
        events: Sequence[tuple[int, GovernanceEvent]],
        ended_at: float,
        trace_id: int,
        call_id: int,
        attempt_id: int,
        parent_id: int,
        parent_is_remote: bool,
        sampled: bool,
    ) -> list[bytes]:
        """The call's two spans (fields of ``ScopeSpans``; none when not ``sampled``), its
        metric points recorded."""
        record, outcome = rows[0]
        finish = getattr(outcome, "finish_reason", None)
        if not isinstance(finish, str):
            finish = ""
        scope = start.scope or record.scope
        namespace = start.cache_namespace or record.cache_namespace
        breaker_state = events[0][1].breaker_state if events else None
        block_key = (
            start.operation,
            record.provider,
            scope,
            start.stream,
            record.usage_source,
            record.source_name,
            record.model,
            namespace,
            finish,
            breaker_state,
        )
        block = self._blocks.get(block_key)
        if block is None:
            block = self._block(start, record, scope, namespace, finish, breaker_state)
            if len(self._blocks) < _BLOCK_LIMIT:
                self._blocks[block_key] = block
        started_s = start.started_at
        row_start = record.created_at - record.latency_ms / 1000
        if row_start < started_s:
            started_s = row_start
        started_ns = int(started_s * 1_000_000_000)
        ended_ns = int(ended_at * 1_000_000_000)
        if ended_ns < started_ns:
            ended_ns = started_ns
        # Metrics (the definition: _Metrics.record_decisions and record_call).
        if breaker_state is not None:  # the attempt's admission
            self._admissions.add_key(1, block.admission_key)
            if breaker_state:
                self._breaker_seen(scope, record.source_name, breaker_state)
        points = block.points
        duration_s = (ended_ns - started_ns) / 1e9
        duration = self._duration
        point = points[0] or duration.point_of(block.base_key, duration_s)
        points[0] = point
        duration.record_point(duration_s, point)
        prompt = record.prompt_tokens
        completion = record.completion_tokens
        tokens = self._tokens
        point = points[1] or tokens.point_of(block.input_key, prompt)
        points[1] = point
        tokens.record_point(prompt, point)
        point = points[2] or tokens.point_of(block.output_key, completion)
        points[2] = point
        tokens.record_point(completion, point)
        ttft = record.ttft_ms
        if start.stream and ttft is not None:
            ttfc_s = ttft / 1000
            ttfc = self._ttfc
            point = points[3] or ttfc.point_of(block.base_key, ttfc_s)
            points[3] = point
            ttfc.record_point(ttfc_s, point)
            if completion > 1:
                gap_s = max(0.0, record.latency_ms - ttft) / 1000 / (completion - 1)
                per_chunk = self._per_chunk
                point = points[4] or per_chunk.point_of(block.base_key, gap_s)
                points[4] = point
                per_chunk.record_point(gap_s, point)
        self._attempts.add_key(1, block.attempts_key)
        self._cache.add_key(1, block.cache_key)
        if not sampled:
            return []
        # Spans (the definition: OtelRecorder._call_attributes and _attempt_span, encoded as
        # otlp.wire_span does; the ids both spans share are written once).
        keys = self._keys
        call_id_field = str_attribute(keys["pgw.call_id"], record.call_id)
        trace_field = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        call_span_id = call_id.to_bytes(8, "big")
        call = [trace_field, b"\x12\x08", call_span_id]
        if parent_id:
            call += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        call += (
            block.call_name,
            SPAN_TIMES(0x30, KIND_CLIENT, 0x39, started_ns, 0x41, ended_ns),
            block.call_attrs,
            call_id_field,
        )
        if record.root_call_id:
            call.append(str_attribute(keys["pgw.root_call_id"], record.root_call_id))
        session = start.session_id or record.session_id
        if session:
            call.append(str_attribute(keys["gen_ai.conversation.id"], session))
            call.append(str_attribute(keys["pgw.session_id"], session))
        parent_call = start.parent_call_id or record.parent_call_id
        if parent_call:
            call.append(str_attribute(keys["pgw.parent_call_id"], parent_call))
        row_start_ns = int(row_start * 1_000_000_000)
        attempt = [
            trace_field,
            b"\x12\x08",
            attempt_id.to_bytes(8, "big"),
            b"\x22\x08",
            call_span_id,
            block.attempt_name,
            SPAN_TIMES(
                0x30,
                KIND_INTERNAL,
                0x39,
                row_start_ns,
                0x41,
                int(record.created_at * 1_000_000_000),
            ),
            block.attempt_attrs,
        ]
        if 0 <= prompt < 0x80 and 0 <= completion < 0x80:  # the usual small counts
            call += (self._input_small[prompt], self._output_small[completion])
            attempt += (self._attempt_input_small[prompt], self._attempt_output_small[completion])
        else:
            call += (
                int_attribute(keys["gen_ai.usage.input_tokens"], prompt),
                int_attribute(keys["gen_ai.usage.output_tokens"], completion),
            )
            attempt += (
                int_attribute(keys["pgw.usage.input_tokens"], prompt),
                int_attribute(keys["pgw.usage.output_tokens"], completion),
            )
        attempt.append(call_id_field)
        cached = getattr(outcome, "cached_prompt_tokens", 0)
        if type(cached) is int and cached:
            call.append(int_attribute(keys["gen_ai.usage.cache_read.input_tokens"], cached))
            attempt.append(int_attribute(keys["pgw.usage.cache_read.input_tokens"], cached))
        written = getattr(outcome, "cache_write_tokens", 0)
        if type(written) is int and written:
            call.append(int_attribute(keys["gen_ai.usage.cache_creation.input_tokens"], written))
        if record.cost is not None:
            cost = double_attribute(keys["pgw.cost"], float(record.cost))
            call.append(cost)
            attempt.append(cost)
        if ttft is not None:
            field = double_attribute(keys["pgw.ttft_ms"], float(ttft))
            call.append(field)
            attempt.append(field)
        if record.max_inter_token_ms is not None:
            field = double_attribute(
                keys["pgw.max_inter_token_ms"], float(record.max_inter_token_ms)
            )
            call.append(field)
            attempt.append(field)
        call += (b"\x7a\x00", SPAN_FLAGS_REMOTE if parent_is_remote else SPAN_FLAGS_LOCAL)
        attempt += (b"\x7a\x00", SPAN_FLAGS_LOCAL)
        return [span_field(b"".join(call)), span_field(b"".join(attempt))]

    def _block(
        self,
        start: CallStart,
        record: TelemetryRecord,
        scope: str,
        namespace: str,
        finish: str,
        breaker_state: str | None,
    ) -> _Block:
        operation = start.operation
        provider = record.provider or "unknown"
        configured = self._models.get(record.source_name, "")
        request_model = configured or record.model
        call: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "pgw.scope": scope,
            "pgw.attempts": 1,
            "pgw.cache.hit": False,
            "pgw.stream": start.stream,
            "pgw.usage.source": record.usage_source,
        }
        if request_model:
            call["gen_ai.request.model"] = request_model
        call["pgw.source"] = record.source_name
        if namespace:
            call["pgw.cache.namespace"] = namespace
        if record.model:
            call["gen_ai.response.model"] = record.model
        if finish:
            call["gen_ai.response.finish_reasons"] = (finish,)
        attempt: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "pgw.attempt.number": 1,
        }
        if record.usage_source != "measured":
            attempt["pgw.usage.source"] = record.usage_source
        if configured:
            attempt["gen_ai.request.model"] = configured
        attempt["pgw.source"] = record.source_name
        if record.model:
            attempt["gen_ai.response.model"] = record.model
        if finish:
            attempt["gen_ai.response.finish_reasons"] = (finish,)
        if breaker_state is not None:
            attempt["pgw.breaker.state"] = breaker_state
        base: list[tuple[str, Any]] = [
            ("gen_ai.operation.name", operation),
            ("gen_ai.provider.name", provider),
        ]
        if request_model:
            base.append(("gen_ai.request.model", request_model))
        if record.model:
            base.append(("gen_ai.response.model", record.model))
        base += (("pgw.scope", scope), ("pgw.source", record.source_name))
        base_key: Key = tuple(base)
        return _Block(
            call_attrs=self._attributes(call),
            call_name=name_field(f"{operation} {request_model}" if request_model else operation),
            attempt_attrs=self._attributes(attempt),
            attempt_name=name_field(f"pgw.attempt {record.source_name}"),
            base_key=base_key,
            input_key=(*base_key, ("gen_ai.token.type", "input")),
            output_key=(*base_key, ("gen_ai.token.type", "output")),
            attempts_key=(("pgw.scope", scope), ("pgw.attempts", 1)),
            cache_key=(("pgw.scope", scope), ("pgw.cache.hit", False)),
            admission_key=(
                ("pgw.scope", scope),
                ("pgw.source", record.source_name),
                ("pgw.breaker.probe", False),
            ),
            points=[None] * 5,
        )
