"""Anthropic error bodies -> the four error classes, by ``error.type`` (never by status alone).

| ``error.type``                                                | error                       |
|---------------------------------------------------------------|-----------------------------|
| ``overloaded_error`` (529), ``api_error`` (500)               | TransientError              |
| ``timeout_error`` (504)                                       | TransientError (timeout)    |
| ``rate_limit_error`` (429)                                    | TransientError + retry-after|
| ``authentication_error``, ``permission_error``, ``billing_error``, | SourceDeadError      |
| ``not_found_error`` (401, 403, 400/402, 404)                  |                             |
| ``invalid_request_error``, ``request_too_large`` (413)        | RequestRejectedError        |
| no recognisable body (a proxy's HTML page, 413 by status only)| the core's status table     |

The same table classifies an ``event: error`` that arrives in the middle of a stream on HTTP
200: an ``overloaded_error`` there is as transient as a 529. ``not_found_error`` means a wrong
model name or base URL: a misconfigured source, as the core treats 404.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from polygateway.errors import (
    ContextWindowExceededError,
    PolyGatewayError,
    SourceDeadError,
    TransientError,
)
from polygateway.transports.errors import (
    Secrets,
    error_for_status,
    parse_retry_after,
    rejection,
    sanitize_message,
)

TRANSIENT_TYPES = frozenset(("overloaded_error", "api_error", "timeout_error", "rate_limit_error"))
DEAD_TYPES = frozenset(
    ("authentication_error", "permission_error", "billing_error", "not_found_error")
)
REJECTED_TYPES = frozenset(("invalid_request_error", "request_too_large"))


def describe_anthropic_error(body: bytes | str | Mapping[str, Any]) -> tuple[str | None, str]:
    """``(error.type, message)`` of ``{"type": "error", "error": {"type", "message"}}``;
    ``(None, text)`` for anything else."""
    payload: Any = body
    if isinstance(body, (bytes, str)):
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            return None, text.strip()
    if isinstance(payload, Mapping):
        inner = payload.get("error")
        if isinstance(inner, Mapping):
            kind = inner.get("type")
            return (kind if isinstance(kind, str) and kind else None), str(inner.get("message", ""))
    return None, "" if payload is None else str(payload)


def classify_error(
    kind: str | None,
    message: str,
    *,
    status: int | None,
    headers: Mapping[str, str] | None = None,
    source_name: str | None = None,
    secret: Secrets = None,
    mid_stream: bool = False,
) -> PolyGatewayError | None:
    """The error for an Anthropic ``error.type``; ``None`` when the type is not one of the
    table (the caller then falls back to the status)."""
    where = f"source {source_name!r}: " if source_name else ""
    at = "error event in the stream" if mid_stream else f"HTTP {status}"
    text = sanitize_message(f"{where}{at} {kind}: {message}", secret)
    if kind in TRANSIENT_TYPES:
        return TransientError(
            text,
            retry_after_s=parse_retry_after(headers),
            status=status,
            source_name=source_name,
            reason=(
                "rate_limited"
                if kind == "rate_limit_error"
                else "timeout"
                if kind == "timeout_error"
                else "network_error"
            ),
        )
    if kind in DEAD_TYPES:
        return SourceDeadError(text, status=status, source_name=source_name)
    if kind in REJECTED_TYPES:
        return rejection(None, kind, message, text, status=status, source_name=source_name)
    return None


def error_for_response(
    status: int,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    *,
    source_name: str | None = None,
    secret: Secrets = None,
) -> PolyGatewayError:
    """The error a non-2xx Messages API answer stands for (see the module table)."""
    kind, message = describe_anthropic_error(body)
    error = classify_error(
        kind, message, status=status, headers=headers, source_name=source_name, secret=secret
    )
    if error is not None:
        return error
    return error_for_status(status, body, headers, source_name=source_name, secret=secret)


def error_for_event(
    payload: Mapping[str, Any], *, source_name: str | None = None, secret: Secrets = None
) -> PolyGatewayError:
    """An ``event: error`` on HTTP 200, classified by its type (unknown types: transient, as
    any broken stream)."""
    kind, message = describe_anthropic_error(payload)
    error = classify_error(
        kind, message, status=None, source_name=source_name, secret=secret, mid_stream=True
    )
    if error is not None:
        return error
    where = f"source {source_name!r}: " if source_name else ""
    return TransientError(
        sanitize_message(f"{where}error event in the stream: {kind or 'error'}: {message}", secret),
        source_name=source_name,
    )


__all__ = [
    "DEAD_TYPES",
    "REJECTED_TYPES",
    "TRANSIENT_TYPES",
    "ContextWindowExceededError",
    "classify_error",
    "describe_anthropic_error",
    "error_for_event",
    "error_for_response",
]
