"""The common call written straight to OTLP bytes and metric points: the batch thread's fast path.

Most calls are one successful attempt whose only governor decision is its admission. With the
recorder's own OTLP export and aggregated metrics, ``PlainCallWriter.write`` makes the two spans'
bytes and the metric points without building attribute dicts or span objects: the attributes
that repeat from call to call (operation, provider, scope, models, source, finish reason, ...)
are encoded once per distinct combination, kept with the span names and the metric point keys,
and each call adds only what is its own (ids, times, token counts, cost, timings). The call
path hands such a call over in its ``Common`` form (``PlainCallWriter.common``: a tuple of
plain values the garbage collector stops tracking), and the counters of a combination's calls
are kept in its block's cell and added into the counters before every metric export
(``PlainCallWriter.fold``, through ``PlainMeter.settle``).

The definition is the recorder's general path (``OtelRecorder._build`` and ``_Metrics``); the
suite checks both give the same spans (parsed, attribute by attribute) and the same points. Any
other call (a retry, a cache hit, an error, a refusal, a probe, a wait, content capture) takes
the general path: ``PlainCallWriter.common`` says which.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from polygateway.types import CallStart, GovernanceEvent, TelemetryRecord

from pgw_otel.aggregate import (
    OVERFLOW_KEY,
    HistogramPoint,
    Key,
    PlainCounter,
    PlainHistogram,
    PlainMeter,
)
from pgw_otel.otlp import (
    KIND_CLIENT,
    KIND_INTERNAL,
    PACK_DOUBLE,
    SPAN_FLAGS_LOCAL,
    SPAN_FLAGS_REMOTE,
    SPAN_TIMES,
    AttributeKey,
    int_attribute,
    name_field,
    span_field,
    str_attribute,
)

__all__ = ["Common", "PlainCallWriter"]

_BLOCK_LIMIT = 1024
"""Distinct attribute combinations kept; beyond it each is encoded on its own."""


Common = tuple[Any, ...]
"""A common call as the call path hands it to the batch thread (``PlainCallWriter.common``):
first its block key, the values of the repeated attributes (operation, provider, scope,
stream, usage source, source, response model, cache namespace, finish reason, breaker state),
then ``started_at``, ``created_at``, ``latency_ms``, ``ended_at``, prompt and completion
tokens, ``ttft_ms``, ``max_inter_token_ms``, ``cost``, ``call_id``, ``root_call_id``, the
session, the parent call, cached and written prompt tokens, and the caller's context (``None``
when empty). Only strs, numbers and ``None``: the garbage collector stops tracking such a
tuple at its first pass, so a call waiting in the batch buffer costs its passes nothing more
(the rows, the call's start and the governor's event it was read from are freed at once)."""


class _Block:
    """What one combination of repeated attributes encodes to, its metric point keys, and
    the counts of its calls not yet added into the counters."""

    __slots__ = (
        "admission_key",
        "attempt_attrs",
        "attempt_name",
        "attempts_key",
        "base_key",
        "breaker_key",
        "cache_key",
        "call_attrs",
        "call_name",
        "counted",
        "input_key",
        "output_key",
        "pending",
        "points",
    )

    def __init__(
        self,
        call_attrs: bytes,
        call_name: bytes,
        attempt_attrs: bytes,
        attempt_name: bytes,
        base_key: Key,
        input_key: Key,
        output_key: Key,
        attempts_key: Key,
        cache_key: Key,
        admission_key: Key | None,
        breaker_key: tuple[str, str],
    ) -> None:
        self.call_attrs = call_attrs
        self.call_name = call_name
        self.attempt_attrs = attempt_attrs
        self.attempt_name = attempt_name
        self.base_key = base_key
        self.input_key = input_key
        self.output_key = output_key
        self.attempts_key = attempts_key
        self.cache_key = cache_key
        self.admission_key = admission_key
        """``None``: the calls of this block had no admission to report."""
        self.breaker_key = breaker_key
        """``(scope, source)``: the breaker-state gauge's key in ``breaker_states``."""
        self.points: list[HistogramPoint | None] = [None] * 5
        """The histogram points of this combination once recorded (duration, input tokens,
        output tokens, time to first chunk, time per chunk): kept, their keys not hashed
        again."""
        self.counted: tuple[tuple[PlainCounter, Key], ...] = ()
        """Where the first call's counter updates went (each counter's point: the key, or the
        overflow point when the counter was full): every later call of the block goes to the
        same points, as points are never dropped. Empty until the first call."""
        self.pending = 0
        """Calls after the first not yet added into ``counted`` (``PlainCallWriter.fold``)."""


class PlainCallWriter:
    """See the module docstring. ``models``: each source's configured model; ``attributes``: the
    encoder's (its cache of repeated pairs); ``meter``: the recorder's aggregates;
    ``breaker_seen``: the recorder's breaker-state gauge update, ``breaker_states``: the states
    it last set, by ``(scope, source)`` (it is called on a change only)."""

    def __init__(
        self,
        models: Mapping[str, str],
        attributes: Callable[[Mapping[str, Any]], bytes],
        meter: PlainMeter,
        breaker_seen: Callable[[str, str, str], None],
        breaker_states: Mapping[tuple[str, str], str],
    ) -> None:
        self._models = models
        self._breaker_seen = breaker_seen
        self._breaker_states = breaker_states
        self._admissions = meter.counter("pgw.limiter.admissions")
        self._attributes = attributes
        self._duration = meter.histogram("gen_ai.client.operation.duration")
        self._tokens = meter.histogram("gen_ai.client.token.usage")
        self._ttfc = meter.histogram("gen_ai.client.operation.time_to_first_chunk")
        self._per_chunk = meter.histogram("gen_ai.client.operation.time_per_output_chunk")
        self._attempts = meter.counter("pgw.call.attempts")
        self._cache = meter.counter("pgw.cache.lookups")
        self._blocks: dict[tuple[Any, ...], _Block] = {}
        meter.on_settle(self.fold)
        self._duration_bounds = self._duration.bounds
        self._token_bounds = self._tokens.bounds
        self._ttfc_bounds = self._ttfc.bounds
        self._per_chunk_bounds = self._per_chunk.bounds
        # The token histogram's bucket of each count below 128, made once.
        self._token_small = [bisect_left(self._token_bounds, count) for count in range(0x80)]
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
        self._call_id_prefixes = self._keys["pgw.call_id"].str_prefixes
        self._root_call_id_prefixes = self._keys["pgw.root_call_id"].str_prefixes
        self._cost_prefix = self._keys["pgw.cost"].double_prefix
        self._ttft_prefix = self._keys["pgw.ttft_ms"].double_prefix
        self._max_inter_prefix = self._keys["pgw.max_inter_token_ms"].double_prefix

    def _small_fields(self, name: str) -> list[bytes]:
        key = self._keys[name]
        return [int_attribute(key, count) for count in range(0x80)]

    @staticmethod
    def common(
        start: CallStart,
        parent: Context,
        rows: list[tuple[TelemetryRecord, object]],
        ended_at: float,
        events: Sequence[tuple[int, GovernanceEvent]] | None,
    ) -> Common | None:
        """On the call path, a call ended without an error: its ``Common`` form when it is a
        common call (one successful attempt, at most the governor's admission of that attempt
        to report: no probe, no refusal, no wait), else ``None`` (the general path)."""
        if len(rows) != 1:
            return None
        record, outcome = rows[0]
        source = record.source_name
        if record.error is not None or record.cache_hit or not source:
            return None
        breaker_state = None
        if events:
            if len(events) != 1:
                return None
            before, event = events[0]
            if before or event.kind != "admitted" or event.probe or event.source != source:
                return None
            breaker_state = event.breaker_state
        finish = getattr(outcome, "finish_reason", None)
        if not isinstance(finish, str):
            finish = ""
        cached = getattr(outcome, "cached_prompt_tokens", 0)
        written = getattr(outcome, "cache_write_tokens", 0)
        return (
            start.operation,
            record.provider,
            start.scope or record.scope,
            start.stream,
            record.usage_source,
            source,
            record.model,
            start.cache_namespace or record.cache_namespace,
            finish,
            breaker_state,
            start.started_at,
            record.created_at,
            record.latency_ms,
            ended_at,
            record.prompt_tokens,
            record.completion_tokens,
            record.ttft_ms,
            record.max_inter_token_ms,
            record.cost,
            record.call_id,
            record.root_call_id,
            start.session_id or record.session_id,
            start.parent_call_id or record.parent_call_id,
            cached if type(cached) is int else 0,
            written if type(written) is int else 0,
            parent or None,
        )

    def fold(self) -> None:
        """The blocks' pending calls added into the counters (before every metric export:
        ``PlainMeter.settle``)."""
        for block in self._blocks.values():
            pending = block.pending
            if pending:
                block.pending = 0
                for counter, key in block.counted:
                    counter.points[key] += pending
                    if key is OVERFLOW_KEY:
                        counter.overflowed += pending

    def _count_first(self, block: _Block) -> None:
        """A block's first call counted as ``_Metrics`` counts it, and where it went kept."""
        counted = []
        if block.admission_key is not None:
            counted.append((self._admissions, block.admission_key))
        counted += ((self._attempts, block.attempts_key), (self._cache, block.cache_key))
        for counter, key in counted:
            counter.add_key(1, key)
        block.counted = tuple(
            (counter, key if key in counter.points else OVERFLOW_KEY) for counter, key in counted
        )

    def _point(
        self, histogram: PlainHistogram, block: _Block, at: int, key: Key, amount: float
    ) -> HistogramPoint:
        """``histogram``'s point of ``key``, kept in the block's ``at`` unless it is the
        overflow point: a measurement there counts in ``overflowed``, so it goes through
        ``point_of`` every time."""
        point = histogram.point_of(key, amount)
        if histogram.points.get(key) is point:
            block.points[at] = point
        return point

    def write(
        self,
        call: Common,
        trace_id: int,
        call_id: int,
        attempt_id: int,
        parent_id: int,
        parent_is_remote: bool,
        sampled: bool,
    ) -> list[bytes]:
        """The call's two spans (fields of ``ScopeSpans``; none when not ``sampled``), its
        metric points recorded."""
        (
            operation,
            provider,
            scope,
            stream,
            usage_source,
            source_name,
            model,
            namespace,
            finish,
            breaker_state,
            started_s,
            created_at,
            latency_ms,
            ended_at,
            prompt,
            completion,
            ttft,
            max_inter_token_ms,
            cost,
            record_call_id,
            root_call_id,
            session,
            parent_call,
            cached,
            written,
            _,
        ) = call
        block_key = call[:10]
        block = self._blocks.get(block_key)
        if block is None:
            block = self._block(
                operation, provider, scope, stream, usage_source, source_name, model,
                namespace, finish, breaker_state,
            )  # fmt: skip
            if len(self._blocks) < _BLOCK_LIMIT:
                self._blocks[block_key] = block
        row_start = created_at - latency_ms / 1000
        if row_start < started_s:
            started_s = row_start
        started_ns = int(started_s * 1_000_000_000)
        ended_ns = int(ended_at * 1_000_000_000)
        if ended_ns < started_ns:
            ended_ns = started_ns
        # Metrics (the definition: _Metrics.record_decisions and record_call). The counters:
        # the block's first call as _Metrics counts it, the others in the block's cell.
        if block.counted:
            block.pending += 1
        else:
            self._count_first(block)
        if breaker_state and self._breaker_states.get(block.breaker_key) != breaker_state:
            self._breaker_seen(scope, source_name, breaker_state)  # a change of state
        # The histograms: PlainHistogram.record_point, inline.
        points = block.points
        duration_s = (ended_ns - started_ns) / 1e9
        point = points[0] or self._point(self._duration, block, 0, block.base_key, duration_s)
        point.counts[bisect_left(self._duration_bounds, duration_s)] += 1
        point.sum += duration_s
        if duration_s < point.min:
            point.min = duration_s
        elif duration_s > point.max:
            point.max = duration_s
        small = 0 <= prompt < 0x80 and 0 <= completion < 0x80  # the usual small counts
        point = points[1] or self._point(self._tokens, block, 1, block.input_key, prompt)
        point.counts[
            self._token_small[prompt] if small else bisect_left(self._token_bounds, prompt)
        ] += 1
        point.sum += prompt
        if prompt < point.min:
            point.min = prompt
        elif prompt > point.max:
            point.max = prompt
        point = points[2] or self._point(self._tokens, block, 2, block.output_key, completion)
        point.counts[
            self._token_small[completion] if small else bisect_left(self._token_bounds, completion)
        ] += 1
        point.sum += completion
        if completion < point.min:
            point.min = completion
        elif completion > point.max:
            point.max = completion
        if ttft is not None and stream:
            ttfc_s = ttft / 1000
            point = points[3] or self._point(self._ttfc, block, 3, block.base_key, ttfc_s)
            point.counts[bisect_left(self._ttfc_bounds, ttfc_s)] += 1
            point.sum += ttfc_s
            if ttfc_s < point.min:
                point.min = ttfc_s
            elif ttfc_s > point.max:
                point.max = ttfc_s
            if completion > 1:
                gap_s = max(0.0, latency_ms - ttft) / 1000 / (completion - 1)
                point = points[4] or self._point(self._per_chunk, block, 4, block.base_key, gap_s)
                point.counts[bisect_left(self._per_chunk_bounds, gap_s)] += 1
                point.sum += gap_s
                if gap_s < point.min:
                    point.min = gap_s
                elif gap_s > point.max:
                    point.max = gap_s
        if not sampled:
            return []
        # Spans (the definition: OtelRecorder._call_attributes and _attempt_span, encoded as
        # otlp.wire_span does; the ids both spans share are written once).
        keys = self._keys
        encoded = record_call_id.encode()
        try:  # str_attribute, inline
            call_id_field = self._call_id_prefixes[len(encoded)] + encoded
        except IndexError:
            call_id_field = str_attribute(keys["pgw.call_id"], record_call_id)
        trace_field = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        call_span_id = call_id.to_bytes(8, "big")
        spans = [trace_field, b"\x12\x08", call_span_id]
        if parent_id:
            spans += (b"\x22\x08", parent_id.to_bytes(8, "big"))
        spans += (
            block.call_name,
            SPAN_TIMES(0x30, KIND_CLIENT, 0x39, started_ns, 0x41, ended_ns),
            block.call_attrs,
            call_id_field,
        )
        if root_call_id:
            encoded = root_call_id.encode()
            try:
                spans.append(self._root_call_id_prefixes[len(encoded)] + encoded)
            except IndexError:
                spans.append(str_attribute(keys["pgw.root_call_id"], root_call_id))
        if session:
            spans.append(str_attribute(keys["gen_ai.conversation.id"], session))
            spans.append(str_attribute(keys["pgw.session_id"], session))
        if parent_call:
            spans.append(str_attribute(keys["pgw.parent_call_id"], parent_call))
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
                int(row_start * 1_000_000_000),
                0x41,
                int(created_at * 1_000_000_000),
            ),
            block.attempt_attrs,
        ]
        if small:
            spans += (self._input_small[prompt], self._output_small[completion])
            attempt += (self._attempt_input_small[prompt], self._attempt_output_small[completion])
        else:
            spans += (
                int_attribute(keys["gen_ai.usage.input_tokens"], prompt),
                int_attribute(keys["gen_ai.usage.output_tokens"], completion),
            )
            attempt += (
                int_attribute(keys["pgw.usage.input_tokens"], prompt),
                int_attribute(keys["pgw.usage.output_tokens"], completion),
            )
        attempt.append(call_id_field)
        if cached:
            spans.append(int_attribute(keys["gen_ai.usage.cache_read.input_tokens"], cached))
            attempt.append(int_attribute(keys["pgw.usage.cache_read.input_tokens"], cached))
        if written:
            spans.append(int_attribute(keys["gen_ai.usage.cache_creation.input_tokens"], written))
        if cost is not None:  # double_attribute, inline
            field = self._cost_prefix + PACK_DOUBLE(float(cost))
            spans.append(field)
            attempt.append(field)
        if ttft is not None:
            field = self._ttft_prefix + PACK_DOUBLE(float(ttft))
            spans.append(field)
            attempt.append(field)
        if max_inter_token_ms is not None:
            field = self._max_inter_prefix + PACK_DOUBLE(float(max_inter_token_ms))
            spans.append(field)
            attempt.append(field)
        spans += (b"\x7a\x00", SPAN_FLAGS_REMOTE if parent_is_remote else SPAN_FLAGS_LOCAL)
        attempt += (b"\x7a\x00", SPAN_FLAGS_LOCAL)
        return [span_field(b"".join(spans)), span_field(b"".join(attempt))]

    def _block(
        self,
        operation: str,
        provider: str,
        scope: str,
        stream: bool,
        usage_source: str,
        source_name: str,
        model: str,
        namespace: str,
        finish: str,
        breaker_state: str | None,
    ) -> _Block:
        """The block of a block key (``Common``)."""
        provider = provider or "unknown"
        configured = self._models.get(source_name, "")
        request_model = configured or model
        call: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "pgw.scope": scope,
            "pgw.attempts": 1,
            "pgw.cache.hit": False,
            "pgw.stream": stream,
            "pgw.usage.source": usage_source,
        }
        if request_model:
            call["gen_ai.request.model"] = request_model
        call["pgw.source"] = source_name
        if namespace:
            call["pgw.cache.namespace"] = namespace
        if model:
            call["gen_ai.response.model"] = model
        if finish:
            call["gen_ai.response.finish_reasons"] = (finish,)
        attempt: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "pgw.attempt.number": 1,
        }
        if usage_source != "measured":
            attempt["pgw.usage.source"] = usage_source
        if configured:
            attempt["gen_ai.request.model"] = configured
        attempt["pgw.source"] = source_name
        if model:
            attempt["gen_ai.response.model"] = model
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
        if model:
            base.append(("gen_ai.response.model", model))
        base += (("pgw.scope", scope), ("pgw.source", source_name))
        base_key: Key = tuple(base)
        return _Block(
            call_attrs=self._attributes(call),
            call_name=name_field(f"{operation} {request_model}" if request_model else operation),
            attempt_attrs=self._attributes(attempt),
            attempt_name=name_field(f"pgw.attempt {source_name}"),
            base_key=base_key,
            input_key=(*base_key, ("gen_ai.token.type", "input")),
            output_key=(*base_key, ("gen_ai.token.type", "output")),
            attempts_key=(("pgw.scope", scope), ("pgw.attempts", 1)),
            cache_key=(("pgw.scope", scope), ("pgw.cache.hit", False)),
            admission_key=None
            if breaker_state is None
            else (
                ("pgw.scope", scope),
                ("pgw.source", source_name),
                ("pgw.breaker.probe", False),
            ),
            breaker_key=(scope, source_name),
        )
