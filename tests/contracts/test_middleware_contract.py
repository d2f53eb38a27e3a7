"""The builtin wrapping layers against the middleware contract."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from polygateway.backends.memory.cache import MemoryCache
from polygateway.context import CallContext
from polygateway.middleware.cache import CacheMiddleware
from polygateway.middleware.structured import StructuredMiddleware
from polygateway.middleware.telemetry import TelemetryMiddleware
from polygateway.ports import Middleware
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.testing import FakeClock
from polygateway.testing.contracts import MiddlewareContract
from polygateway.types import ChatRequest, LLMResponse, TelemetryRecord


class AwaitingRecorder:
    """A recorder with only the async port: the telemetry layer records through tasks, which
    ``drain`` must wait for."""

    def __init__(self) -> None:
        self.records: list[TelemetryRecord] = []

    async def record(self, record: TelemetryRecord) -> None:
        self.records.append(record)

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class TestTelemetryLayerContract(MiddlewareContract):
    @pytest.fixture
    def make_layer(self) -> Callable[[], Middleware]:
        return lambda: TelemetryMiddleware(AwaitingRecorder(), pricing=None, clock=FakeClock())


class TestCacheLayerContract(MiddlewareContract):
    @pytest.fixture
    def make_layer(self) -> Callable[[], Middleware]:
        return lambda: CacheMiddleware(
            MemoryCache(clock=FakeClock()),
            namespace="contract",
            ttl_s=60.0,
            model_identity="contract-model",
            strategy=JsonRepairStrategy(),
        )


class TestStructuredLayerContract(MiddlewareContract):
    @pytest.fixture
    def make_layer(self) -> Callable[[], Middleware]:
        return lambda: StructuredMiddleware(
            JsonRepairStrategy(), providers={}, sources=(), max_retries=1
        )


async def test_the_telemetry_layer_drains_the_rows_it_handed_to_tasks() -> None:
    recorder = AwaitingRecorder()
    layer = TelemetryMiddleware(recorder, pricing=None, clock=FakeClock())

    async def inner(request: ChatRequest) -> LLMResponse:
        return LLMResponse(content="x", call_id="1" * 32)

    await layer(
        ChatRequest(messages=[{"role": "user", "content": "x"}], context=CallContext()), inner
    )
    await layer.drain()
    assert [r.call_id for r in recorder.records] == ["1" * 32]
