"""Spans and metrics of governed calls, through the fake upstream, read back from the SDK's
in-memory exporters and checked attribute by attribute against the GenAI conventions."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from otel_test_helpers import MESSAGES, Sdk, attrs, call_and_attempts, scope, source
from polygateway.client import GatewayClient
from polygateway.errors import AllSourcesExhausted, CircuitOpenError
from polygateway.settings import BackpressureSettings, CacheSettings, Limits, RetrySettings
from polygateway.testing import FakeUpstream, Reply


async def test_a_retried_call_is_one_span_with_a_child_per_attempt(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.script(
        "a",
        Reply.error(503),
        Reply.ok(content="Paris", prompt_tokens=12, completion_tokens=3, model="model-a-0612"),
    )
    settings = scope(fake_upstream)
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        response = await client.chat(MESSAGES, session_id="s-1", parent_call_id="p-1")
    call, attempts = call_and_attempts(sdk.finished())
    assert call.name == "chat model-a"
    assert call.kind is SpanKind.CLIENT
    assert call.status.status_code is StatusCode.UNSET
    first, second = attempts
    call_attrs = dict(attrs(call))
    # Every row of the call names its first attempt as the call's root.
    assert call_attrs.pop("pgw.root_call_id") == attrs(first)["pgw.call_id"]
    assert call_attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "model-a",
        "gen_ai.response.model": "model-a-0612",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.conversation.id": "s-1",
        "pgw.session_id": "s-1",
        "pgw.parent_call_id": "p-1",
        "pgw.scope": "LLM",
        "pgw.source": "a",
        "pgw.attempts": 2,
        "pgw.cache.hit": False,
        "pgw.cache.namespace": "tenant-1",
        "pgw.stream": False,
        "pgw.usage.source": "measured",
        "pgw.call_id": response.call_id,
        "pgw.ttft_ms": pytest.approx(response.ttft_ms),
    }
    assert response.max_inter_token_ms is None  # one JSON body: no gap to report
    assert "gen_ai.system" not in attrs(call)
    assert first.name == second.name == "pgw.attempt a"
    assert attrs(first)["error.type"] == "TransientError"
    assert attrs(first)["pgw.attempt.next"] == "retry"
    assert first.status.status_code is StatusCode.ERROR
    assert attrs(second)["gen_ai.response.model"] == "model-a-0612"
    assert attrs(second)["pgw.call_id"] == response.call_id
    assert "pgw.attempt.next" not in attrs(second)
    assert (attrs(second)["pgw.usage.input_tokens"], attrs(second)["pgw.usage.output_tokens"]) == (
        12,
        3,
    )
    # Usage is on the call span only, so backends summing over spans count each token once.
    assert not any(k.startswith("gen_ai.usage.") for s in attempts for k in attrs(s))
    # Children lie within the call, in order.
    assert call.start_time <= first.start_time <= first.end_time <= second.start_time
    assert second.end_time <= call.end_time
    assert {s.context.trace_id for s in attempts} == {call.context.trace_id}


async def test_a_switch_to_another_source_is_visible(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    fake_upstream.script("a", Reply.error(401))  # a dead source: the next attempt switches
    settings = scope(fake_upstream, source(fake_upstream, "a"), source(fake_upstream, "b"))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.chat(MESSAGES)
    call, attempts = call_and_attempts(sdk.finished())
    assert [attrs(s)["pgw.source"] for s in attempts] == ["a", "b"]
    assert attrs(attempts[0])["pgw.attempt.next"] == "switch"
    assert attrs(call)["pgw.source"] == "b" and attrs(call)["gen_ai.request.model"] == "model-b"


async def test_a_cache_hit_is_a_call_with_a_cache_hit_child(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    settings = scope(fake_upstream)
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.chat(MESSAGES)
        sdk.spans.clear()
        hit = await client.chat(MESSAGES)
    assert hit.cache_hit
    call, attempts = call_and_attempts(sdk.finished())
    assert attrs(call)["pgw.cache.hit"] is True
    assert attrs(call)["pgw.attempts"] == 0
    assert [s.name for s in attempts] == ["pgw.cache_hit"]
    assert attrs(attempts[0])["pgw.cache.hit"] is True
    assert attrs(call)["pgw.cost"] == 0.0 or "pgw.cost" not in attrs(call)


async def test_a_failed_call_carries_the_library_error_class(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.script("a", Reply.error(503), Reply.error(503))
    settings = scope(
        fake_upstream, retry=RetrySettings(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
    )
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        with pytest.raises(AllSourcesExhausted):
            await client.chat(MESSAGES)
    call, attempts = call_and_attempts(sdk.finished())
    assert attrs(call)["error.type"] == "AllSourcesExhausted"
    assert call.status.status_code is StatusCode.ERROR
    assert "gen_ai.response.model" not in attrs(call)
    assert [attrs(s)["error.type"] for s in attempts] == ["TransientError", "TransientError"]


async def test_a_call_refused_by_open_breakers_says_so(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    settings = scope(fake_upstream, cache=CacheSettings(backend="none"))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.components.breaker.force_open("a")
        with pytest.raises(CircuitOpenError):
            await client.chat(MESSAGES)
    call, attempts = call_and_attempts(sdk.finished())
    assert attrs(call)["error.type"] == "CircuitOpenError"
    assert attrs(call)["pgw.refusal"] == "breaker_open"
    assert [s.name for s in attempts] == ["pgw.refused"]
    assert sdk.metrics()["pgw.call.refusals"].data.data_points[0].attributes["pgw.refusal"] == (
        "breaker_open"
    )


async def test_calls_nest_under_the_application_span(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    settings = scope(fake_upstream)
    tracer = sdk.tracer_provider.get_tracer("app")
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        with tracer.start_as_current_span("handle-request") as app_span:
            await client.chat(MESSAGES)
    spans = sdk.finished()
    app = next(s for s in spans if s.name == "handle-request")
    call = next(s for s in spans if s.name == "chat model-a")
    assert call.parent is not None and call.parent.span_id == app.context.span_id
    assert call.context.trace_id == app_span.get_span_context().trace_id


async def test_content_only_when_opted_in(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    settings = scope(fake_upstream, cache=CacheSettings(backend="none"))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.chat(MESSAGES)
    names = {k for s in sdk.finished() for k in attrs(s)}
    assert not {"gen_ai.input.messages", "gen_ai.output.messages"} & names
    opted = Sdk()
    fake_upstream.script("a", Reply.ok(content="Paris"))
    recorder = opted.recorder(settings, capture_content=True)
    async with GatewayClient(settings, telemetry=recorder) as client:
        await client.chat(MESSAGES)
    call, _ = call_and_attempts(opted.finished())
    assert "capital of France" in attrs(call)["gen_ai.input.messages"]
    assert attrs(call)["gen_ai.output.messages"] == "Paris"


async def test_prompt_cache_reads_are_reported(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    fake_upstream.script(
        "a", Reply.ok(content="ok", prompt_tokens=100, completion_tokens=2, cached_tokens=64)
    )
    settings = scope(fake_upstream, cache=CacheSettings(backend="none"))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.chat(MESSAGES)
    call, _ = call_and_attempts(sdk.finished())
    assert attrs(call)["gen_ai.usage.input_tokens"] == 100  # cached ones included
    assert attrs(call)["gen_ai.usage.cache_read.input_tokens"] == 64


async def test_metrics_follow_the_conventions(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    fake_upstream.script(
        "a",
        Reply.error(503),
        Reply.ok(content="a b c d", chunks=4, prompt_tokens=10, completion_tokens=4),
    )
    settings = scope(fake_upstream)
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        async with client.stream(MESSAGES) as stream:
            async for _ in stream:
                pass
        await client.chat(MESSAGES)  # the same prompt again: a cache hit
    found = sdk.metrics()
    duration = found["gen_ai.client.operation.duration"]
    assert duration.unit == "s"
    points = duration.data.data_points
    assert sum(p.count for p in points) == 1  # the cache hit is no GenAI operation
    assert points[0].explicit_bounds[:3] == (0.01, 0.02, 0.04)
    first = points[0]
    assert dict(first.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "model-a",
        "gen_ai.response.model": "model-a",
        "pgw.scope": "LLM",
        "pgw.source": "a",
    }
    tokens = found["gen_ai.client.token.usage"]
    assert tokens.unit == "{token}"
    by_type = {
        (p.attributes["gen_ai.token.type"], p.attributes.get("pgw.source")): p.sum
        for p in tokens.data.data_points
    }
    # Billable tokens only: the cache hit paid none.
    assert by_type == {("input", "a"): 10, ("output", "a"): 4}
    ttfc = found["gen_ai.client.operation.time_to_first_chunk"].data.data_points
    assert sum(p.count for p in ttfc) == 1  # the streamed call only
    assert "gen_ai.client.operation.time_per_output_chunk" in found
    attempts = found["pgw.call.attempts"].data.data_points
    assert sorted((p.attributes["pgw.attempts"], p.value) for p in attempts) == [(0, 1), (2, 1)]
    lookups = {
        p.attributes["pgw.cache.hit"]: p.value for p in found["pgw.cache.lookups"].data.data_points
    }
    assert lookups == {False: 1, True: 1}
    outcomes = found["pgw.attempt.outcomes"].data.data_points
    assert [
        (p.attributes["pgw.attempt.next"], p.attributes["error.type"], p.value) for p in outcomes
    ] == [("retry", "TransientError", 1)]


async def test_breaker_and_limiter_decisions_are_on_the_spans_and_in_the_metrics(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    # One slot at the source: the second of two concurrent calls is refused by the limiter
    # and waits for the first to finish.
    limited = source(fake_upstream, limits=Limits(max_concurrency=1))
    settings = scope(
        fake_upstream,
        limited,
        cache=CacheSettings(backend="none"),
        backpressure=BackpressureSettings(quota_full="wait", poll_interval_s=0.01),
    )
    fake_upstream.set_default("a", Reply.ok(content="slow", headers_delay=0.2))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await asyncio.gather(
            client.chat(MESSAGES), client.chat([{"role": "user", "content": "second"}])
        )
    calls = [s for s in sdk.finished() if s.name == "chat model-a"]
    waited = [s for s in calls if "pgw.limiter.refusals" in attrs(s)]
    assert len(waited) == 1
    assert attrs(waited[0])["pgw.limiter.gates"] == ("source_concurrency",)
    assert attrs(waited[0])["pgw.limiter.queue_wait_s"] > 0
    attempts = [s for s in sdk.finished() if s.name == "pgw.attempt a"]
    assert {attrs(s)["pgw.breaker.state"] for s in attempts} == {"closed"}
    assert not any("pgw.breaker.probe" in attrs(s) for s in attempts)  # set on a probe only
    found = sdk.metrics()
    admissions = found["pgw.limiter.admissions"].data.data_points
    assert sum(p.value for p in admissions) == 2
    refusals = found["pgw.limiter.refusals"].data.data_points
    assert [(p.attributes["pgw.limiter.gate"], p.attributes["pgw.source"]) for p in refusals] == [
        ("source_concurrency", "a")
    ]
    assert sum(p.count for p in found["pgw.limiter.queue_wait"].data.data_points) >= 1
    gauge = found["pgw.breaker.state"].data.data_points
    assert [(p.attributes["pgw.source"], p.value) for p in gauge] == [("a", 0)]


async def test_a_breaker_refusal_and_the_scope_verdict_are_counted(
    sdk: Sdk, fake_upstream: FakeUpstream
) -> None:
    settings = scope(
        fake_upstream,
        source(fake_upstream, "a"),
        source(fake_upstream, "b"),
        cache=CacheSettings(backend="none"),
    )
    fake_upstream.script("b", Reply.error(503), Reply.error(503), Reply.error(503))
    async with GatewayClient(settings, telemetry=sdk.recorder(settings)) as client:
        await client.components.breaker.force_open("a")
        with pytest.raises(AllSourcesExhausted) as excinfo:
            await client.chat(MESSAGES)
    call = next(s for s in sdk.finished() if s.name.startswith("chat "))
    assert attrs(call)["pgw.breaker.refusals"] >= 1
    assert attrs(call)["pgw.error.reason"] == excinfo.value.reason
    found = sdk.metrics()
    refused = found["pgw.breaker.refusals"].data.data_points
    assert {(p.attributes["pgw.source"], p.attributes["pgw.breaker.state"]) for p in refused} == {
        ("a", "open")
    }
    verdicts = found["pgw.call.verdicts"].data.data_points
    assert [p.attributes["pgw.error.reason"] for p in verdicts] == [excinfo.value.reason]
    gauge = {
        p.attributes["pgw.source"]: p.value for p in found["pgw.breaker.state"].data.data_points
    }
    assert gauge["a"] == 2
    assert "pgw.telemetry.dropped" not in found  # nothing dropped: no point yet


def test_an_attempt_keeps_what_the_outcome_tuple_makes() -> None:
    """``_Call.attempt`` builds its ``_Outcome`` through ``tuple.__new__``: the same tuple, the
    same fields, as the named tuple's own constructor."""
    from types import SimpleNamespace
    from typing import Any, cast

    from opentelemetry.context import Context
    from pgw_otel.recorder import _Call, _Outcome
    from polygateway.types import CallStart

    ended: list[Any] = []

    class Kept:
        def ended(self, *args: Any) -> None:
            ended.append(args)

    start = CallStart("chat", 1.0, "LLM", None, None, "", False)
    call = _Call(cast(Any, Kept()), start, Context())
    outcome = SimpleNamespace(finish_reason="stop", cached_prompt_tokens=64, cache_write_tokens=3)
    call.attempt(cast(Any, "row"), outcome)
    call.attempt(cast(Any, "row"), None)
    call.close(2.0, None)
    kept = [row[1] for row in ended[0][2]]
    assert kept == [_Outcome("stop", 64, 3), _Outcome(None, 0, 0)]
    assert all(type(outcome) is _Outcome for outcome in kept)
    assert kept[0].finish_reason == "stop" and kept[0].cache_write_tokens == 3
