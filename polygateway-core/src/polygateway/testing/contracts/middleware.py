"""The wrapping-layer contract (``ports.Middleware``), the same for every layer.

Subclass ``MiddlewareContract`` and provide a ``make_layer`` fixture returning a zero-argument
factory of the layer under test (built as its middleware factory would build it)::

    class TestAuditContract(MiddlewareContract):
        @pytest.fixture
        def make_layer(self):
            return lambda: AuditLayer(...)

What it holds a layer to: it is a ``ports.Middleware``; the call's ``CallContext`` (the
declared side channel: attempt observers, the shared message encoding, rejected results)
reaches the inner handler unchanged, derived requests included; the inner handler's errors and
cancellation propagate as themselves; and a layer that hands work to the background implements
``ports.Drainable`` so ``GatewayClient.aclose`` can wait for it (checked with a plain call).
The layer is called with requests that ask for nothing special (no structured output, no
salt): a layer may answer such a call itself (a cache hit) only after a first call went in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from polygateway.context import CallContext
from polygateway.errors import RequestRejectedError, SourceDeadError, TransientError
from polygateway.ports import Drainable, Middleware
from polygateway.types import ChatRequest, LLMResponse

__all__ = ["MiddlewareContract"]

LayerFactory = Callable[[], Middleware]


def _request(text: str) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], context=CallContext())


def _response(call_id: str = "0" * 32) -> LLMResponse:
    return LLMResponse(
        content="contract answer",
        model="contract-model",
        provider="contract",
        prompt_tokens=3,
        completion_tokens=4,
        call_id=call_id,
        source_name="contract-source",
        finish_reason="stop",
    )


class MiddlewareContract:
    """Behaviour every wrapping layer shares."""

    @pytest.fixture
    def make_layer(self) -> LayerFactory:
        raise NotImplementedError("subclass MiddlewareContract and provide a make_layer fixture")

    def test_the_layer_is_a_middleware(self, make_layer: LayerFactory) -> None:
        assert isinstance(make_layer(), Middleware)

    async def test_the_call_context_reaches_the_inner_handler(
        self, make_layer: LayerFactory
    ) -> None:
        layer = make_layer()
        request = _request("context")
        seen: list[CallContext | None] = []

        async def inner(received: ChatRequest) -> LLMResponse:
            seen.append(received.context)
            return _response()

        response = await layer(request, inner)
        assert seen, "the layer never called the inner handler on a first call"
        assert all(context is request.context for context in seen)
        assert response.content == "contract answer"

    @pytest.mark.parametrize(
        "error",
        [
            TransientError("contract: transient", status=503),
            SourceDeadError("contract: dead", status=401),
            RequestRejectedError("contract: rejected", status=400),
        ],
        ids=lambda e: type(e).__name__,
    )
    async def test_errors_of_the_inner_handler_propagate_as_themselves(
        self, make_layer: LayerFactory, error: Exception
    ) -> None:
        layer = make_layer()

        async def inner(received: ChatRequest) -> LLMResponse:
            raise error

        with pytest.raises(type(error)) as info:
            await layer(_request(f"error {type(error).__name__}"), inner)
        assert info.value is error

    async def test_cancellation_propagates(self, make_layer: LayerFactory) -> None:
        layer = make_layer()
        entered = asyncio.Event()

        async def inner(received: ChatRequest) -> LLMResponse:
            entered.set()
            await asyncio.Event().wait()  # never set: only cancellation ends it
            raise AssertionError("unreachable")

        task = asyncio.create_task(layer(_request("cancel"), inner))
        async with asyncio.timeout(5):
            await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def test_drain_completes_after_calls(self, make_layer: LayerFactory) -> None:
        layer = make_layer()
        if not isinstance(layer, Drainable):
            pytest.skip("this layer does not implement ports.Drainable")

        async def inner(received: ChatRequest) -> LLMResponse:
            return _response()

        await layer.drain()  # nothing pending yet
        await layer(_request("drain"), inner)
        async with asyncio.timeout(5):
            await layer.drain()
            await layer.drain()  # idempotent
