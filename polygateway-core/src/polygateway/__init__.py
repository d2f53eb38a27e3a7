"""PolyGateway: a governed asyncio gateway for model calls.

    client = GatewayClient.from_env()
    resp = await client.chat(messages)

Types, errors and ports import eagerly (they are light); the client and its implementations are
imported on first use so that ``import polygateway`` stays fast.

Comments cite the design as ``D1``-``D14``, ``ARCHITECTURE §N``, ``M2 §N`` and ``protocols §N``:
each is a section of ``docs/design.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    ConfigError,
    ContentFilterError,
    ContextWindowExceededError,
    EmptyCompletionError,
    GovernanceBackendError,
    PluginError,
    PolyGatewayError,
    RequestRejectedError,
    ResultInvalidError,
    ScopeUnavailableError,
    SourceDeadError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.hookspecs import hookimpl
from polygateway.params import ChatParams
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    GatewaySettings,
    Limits,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
)
from polygateway.types import (
    ChatRequest,
    EmbeddingResponse,
    LLMResponse,
    OcrBBoxIssue,
    OcrElement,
    OcrLayoutResult,
    OcrTextResult,
    StreamDelta,
    TelemetryRecord,
    ToolCall,
    TransportResult,
    Usage,
    assistant_message,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from polygateway.client import GatewayClient, gather_bounded
    from polygateway.governance import Attempted, Governor, Outcome
    from polygateway.telemetry.pricing import PricingTable

_LAZY = {
    "GatewayClient": "polygateway.client",
    "gather_bounded": "polygateway.client",
    "Governor": "polygateway.governance",
    "Attempted": "polygateway.governance",
    "Outcome": "polygateway.governance",
    "PricingTable": "polygateway.telemetry.pricing",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polygateway' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AllSourcesExhausted",
    "Attempted",
    "BackpressureSettings",
    "BreakerSettings",
    "ChatParams",
    "ChatRequest",
    "CircuitOpenError",
    "ConfigError",
    "ContentFilterError",
    "ContextWindowExceededError",
    "EmbeddingResponse",
    "EmptyCompletionError",
    "GatewayClient",
    "GatewaySettings",
    "GovernanceBackendError",
    "Governor",
    "LLMResponse",
    "Limits",
    "OcrBBoxIssue",
    "OcrElement",
    "OcrLayoutResult",
    "OcrTextResult",
    "Outcome",
    "PluginError",
    "PolyGatewayError",
    "PricingTable",
    "RequestRejectedError",
    "ResultInvalidError",
    "RetrySettings",
    "ScopeSettings",
    "ScopeUnavailableError",
    "Secret",
    "SourceConfig",
    "SourceDeadError",
    "StreamDelta",
    "StreamLivenessTimeout",
    "TelemetryRecord",
    "ToolCall",
    "TransientError",
    "TransportResult",
    "Usage",
    "__version__",
    "assistant_message",
    "gather_bounded",
    "hookimpl",
]
