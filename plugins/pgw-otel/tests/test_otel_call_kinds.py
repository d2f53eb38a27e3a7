"""Other call kinds through the same recorder: each embedding batch is a call span with its
attempts (the kind's own client opens the call)."""

from __future__ import annotations

import pytest
from otel_test_helpers import Sdk, attrs
from polygateway.plugins import load_registry
from polygateway.settings import (
    BackpressureSettings,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.testing import FakeUpstream, Reply

pgw_embedding = pytest.importorskip("pgw_embedding")


async def test_each_embedding_batch_is_a_call_span(sdk: Sdk, fake_upstream: FakeUpstream) -> None:
    source = SourceConfig(
        name="e",
        provider="openai",
        base_url=fake_upstream.base_url("e"),
        model="text-embedding-3-small",
        api_key=Secret("sk-e"),
        scope="EMBED",
        timeout_s=5.0,
        est_tokens=10,
    )
    settings = ScopeSettings(
        scope="EMBED",
        sources=(source,),
        retry=RetrySettings(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0),
        backpressure=BackpressureSettings(quota_full="fail_fast"),
        telemetry=TelemetrySettings(backend="none"),
        batch_size=2,
    )
    fake_upstream.script("e", Reply.error(503), route="embeddings")
    registry = load_registry(autoload=False, extra_plugins=[("pgw-embedding", pgw_embedding)])
    recorder = sdk.recorder(settings)
    async with pgw_embedding.EmbeddingClient(
        settings, registry=registry, telemetry=recorder
    ) as client:
        response = await client.embed(["one", "two", "three"], session_id="s-e")
    assert len(response.vectors) == 3
    spans = sdk.finished()
    calls = [s for s in spans if s.name == "embeddings text-embedding-3-small"]
    assert len(calls) == 2
    for call in calls:
        assert attrs(call)["gen_ai.operation.name"] == "embeddings"
        assert attrs(call)["gen_ai.request.model"] == "text-embedding-3-small"
        assert attrs(call)["gen_ai.conversation.id"] == "s-e"
        assert attrs(call)["pgw.scope"] == "EMBED"
    retried = [c for c in calls if attrs(c)["pgw.attempts"] == 2]
    assert len(retried) == 1
    own = retried[0].context.span_id
    attempts = [s for s in spans if s.parent is not None and s.parent.span_id == own]
    attempts.sort(key=lambda s: attrs(s)["pgw.attempt.number"])
    assert [attrs(a).get("error.type") for a in attempts] == ["TransientError", None]
    assert {attrs(a)["pgw.breaker.state"] for a in attempts} == {"closed"}
