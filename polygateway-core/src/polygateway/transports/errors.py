"""HTTP status / body / wire failures -> the four error classes (ARCHITECTURE §6.2).

| upstream answer                                             | error                         |
|-------------------------------------------------------------|-------------------------------|
| 429 (rate), 500, 502, 503, 504, any other 5xx               | TransientError + Retry-After  |
| 408 (the upstream timed out waiting for us)                 | TransientError (timeout)      |
| 429 / any 4xx with a quota code (``insufficient_quota``...) | SourceDeadError               |
| 401, 403, 402 (payment required: out of credit)             | SourceDeadError               |
| 404 (model not found / wrong base_url)                      | SourceDeadError               |
| 3xx (redirects are not followed: base_url is wrong)         | SourceDeadError               |
| 400 context overflow (``context_length_exceeded``, wordings) | ContextWindowExceededError    |
| 400 content policy (``content_filter``, ``content_policy...``)| ContentFilterError            |
| 400 and any other 4xx                                       | RequestRejectedError          |
| connection errors / read errors / engine timeouts           | TransientError                |

404 is a misconfigured source, not a bad request: the same messages may succeed on another
source, and retrying this one cannot help until someone fixes its model name or URL. Treating it
as ``SourceDeadError`` switches source at once and keeps the breaker of this source open.

Quota exhaustion is recognised by the error ``code`` (protocols.md §1.4: several codes, the
``type`` varies between gateways); the ``type`` and a plain substring are fallbacks for bodies
that are not the usual shape. Messages are sanitised (anything that looks like a key is masked)
and truncated.
"""

from __future__ import annotations

import email.utils
import json
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from polygateway.errors import (
    ContentFilterError,
    ContextWindowExceededError,
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    SourceReason,
    TransientError,
)

QUOTA_CODES: frozenset[str] = frozenset(
    {
        "insufficient_quota",
        "credit_balance_exhausted",
        "organization_spend_limit_exceeded",
        "project_spend_limit_exceeded",
        "organization_usage_limit_exceeded",
    }
)

CONTEXT_OVERFLOW_CODES: frozenset[str] = frozenset(
    {"context_length_exceeded", "exceed_context_size_error", "model_context_window_exceeded"}
)
CONTEXT_OVERFLOW_WORDINGS: tuple[str, ...] = (
    "maximum context length",  # OpenAI, vLLM, Mistral, DeepSeek
    "context length exceeded",
    "context_length_exceeded",
    "exceeds the context window",
    "exceeds the available context size",  # llama.cpp
    "prompt is too long",  # Anthropic
    "exceed context limit",  # Anthropic: input length and max_tokens exceed context limit
    "input token count",  # Gemini: the input token count ... exceeds the maximum
    "range of input length should be",  # Qwen / DashScope
    "input length exceeds",
)
"""Lower-case wordings of a context overflow by provider (bodies without the OpenAI code)."""

CONTENT_FILTER_CODES: frozenset[str] = frozenset(
    {
        "content_filter",
        "content_policy_violation",
        "data_inspection_failed",  # Qwen / DashScope
        "responsibleaipolicyviolation",  # Azure OpenAI
    }
)

MAX_MESSAGE_CHARS = 300
"""Upstream messages are cut to this length (bodies can be whole HTML error pages)."""

_KEY_LIKE = re.compile(
    r"(?i)\b(bearer\s+)[^\s\"',;]+"
    r"|\b((?:api[_-]?key|authorization|access[_-]?token|token)\s*[:=]\s*[\"']?)"
    r"(?:(?:bearer|basic)\s+)?[^\s\"',;]+"
    r"|\b(?:sk|pk|rk|ak)-[A-Za-z0-9_\-*.]{4,}"
    # A long run with both letters and digits is a key; one without digits is an error code
    # or a snake_case word (``unsupported_country_region_territory``) and must stay readable.
    r"|\b(?=[A-Za-z_\-]*[0-9])(?=[0-9_\-]*[A-Za-z])[A-Za-z0-9_\-]{32,}\b"
)


Secrets = str | tuple[str, ...] | None
"""The secrets to mask: one (the API key), several (the key and credential headers), none."""


def sanitize_message(text: str, secret: Secrets = None, *, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Mask the secret(s) and anything key-like, collapse whitespace, truncate to ``limit``."""
    for value in (secret,) if isinstance(secret, str) else secret or ():
        if value:
            text = text.replace(value, "***")
    text = _KEY_LIKE.sub(_mask, text)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _mask(match: re.Match[str]) -> str:
    keep = match.group(1) or match.group(2) or ""
    return f"{keep}***"


def _text(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def describe_error_body(
    body: bytes | str | Mapping[str, Any],
) -> tuple[str | None, str | None, str]:
    """``(code, type, message)`` of an error body in any of the shapes gateways use.

    OpenAI ``{"error": {"message", "type", "code"}}``, OpenRouter (integer ``code``), flat vLLM
    ``{"object": "error", "message", "type", "code"}``, FastAPI ``{"detail": ...}``, or plain text.
    """
    payload: Any = body
    if isinstance(body, (bytes, str)):
        try:
            payload = json.loads(body) if body else None
        except (ValueError, RecursionError):  # not JSON, or nested too deeply: plain text
            raw = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
            return None, None, raw.strip()
    if not isinstance(payload, Mapping):
        return None, None, "" if payload is None else str(payload)
    inner = payload.get("error")
    if isinstance(inner, Mapping):
        source: Mapping[str, Any] = inner
    elif isinstance(inner, str):
        return _text(payload.get("code")), _text(payload.get("type")), inner
    else:
        source = payload
    message = source.get("message")
    if message is None:
        message = source.get("detail", "")
    return _text(source.get("code")), _text(source.get("type")), str(message)


def is_quota_error(code: str | None, kind: str | None, body: bytes | str = b"") -> bool:
    if code is not None:
        return code in QUOTA_CODES
    if kind is not None and kind in QUOTA_CODES:
        return True
    needle = "insufficient_quota"
    return needle in body if isinstance(body, str) else needle.encode() in body


def _seconds(value: str | None, now: float | None = None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        if now is None:
            return None
        try:  # the HTTP-date form: seconds from now (a date in the past is "retry now")
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None  # not an HTTP-date (those are always GMT)
        return max(when.timestamp() - now, 0.0)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        return None
    return seconds


def parse_retry_after(
    headers: Mapping[str, str] | None, *, now: float | None = None
) -> float | None:
    """Seconds from ``retry-after-ms`` (preferred, as the OpenAI SDK does), ``Retry-After``
    (seconds, or an HTTP-date read against ``now``, default the wall clock) or the LiteLLM
    relay's ``llm_provider-retry-after``. Bounding the value is the governor's job.

    ``headers`` is a case-insensitive mapping (what both engines return) or has lower-case keys.
    """
    if not headers:
        return None
    millis = _seconds(headers.get("retry-after-ms"))
    if millis is not None:
        return millis / 1000.0
    wall = time.time() if now is None else now
    for name in ("retry-after", "llm_provider-retry-after"):
        seconds = _seconds(headers.get(name), wall)
        if seconds is not None:
            return seconds
    return None


def rejection(
    code: str | None,
    kind: str | None,
    message: str,
    text: str,
    *,
    status: int | None,
    source_name: str | None,
) -> RequestRejectedError:
    """A rejected request, as the subclass the governor acts on when the body says why."""
    labels = {str(x).lower() for x in (code, kind) if x}
    lowered = message.lower()
    if labels & CONTEXT_OVERFLOW_CODES or any(w in lowered for w in CONTEXT_OVERFLOW_WORDINGS):
        return ContextWindowExceededError(text, status=status, source_name=source_name)
    if labels & CONTENT_FILTER_CODES:
        reason = next(iter(sorted(labels & CONTENT_FILTER_CODES)))
        return ContentFilterError(text, status=status, source_name=source_name, reason=reason)
    return RequestRejectedError(text, status=status, source_name=source_name)


def error_for_status(
    status: int,
    body: bytes | str,
    headers: Mapping[str, str] | None = None,
    *,
    source_name: str | None = None,
    secret: Secrets = None,
) -> PolyGatewayError:
    """The error an HTTP answer other than 2xx stands for (see the module table)."""
    code, kind, message = describe_error_body(body)
    label = "/".join(x for x in (kind, code) if x)
    where = f"source {source_name!r}: " if source_name else ""
    text = sanitize_message(
        f"{where}HTTP {status}{' ' + label if label else ''}: {message}", secret
    )
    if 400 <= status < 500 and is_quota_error(code, kind, body):
        return SourceDeadError(text, status=status, source_name=source_name)
    if status == 429:
        return TransientError(
            text,
            retry_after_s=parse_retry_after(headers),
            status=status,
            source_name=source_name,
            reason="rate_limited",
        )
    if status >= 500:
        reason: SourceReason = "timeout" if status == 504 else "network_error"
        return TransientError(
            text,
            retry_after_s=parse_retry_after(headers),
            status=status,
            source_name=source_name,
            reason=reason,
        )
    if status == 408:
        return TransientError(
            text,
            retry_after_s=parse_retry_after(headers),
            status=status,
            source_name=source_name,
            reason="timeout",
        )
    if status in (401, 402, 403, 404) or 300 <= status < 400:
        return SourceDeadError(text, status=status, source_name=source_name)
    if 400 <= status < 500:
        return rejection(code, kind, message, text, status=status, source_name=source_name)
    # 1xx or another status an HTTP client should never hand over: treat as a wire fault.
    return TransientError(text, status=status, source_name=source_name)


def error_for_stream_event(
    payload: Mapping[str, Any], *, source_name: str | None, secret: Secrets = None
) -> TransientError:
    """An error object sent instead of an answer, on an HTTP 200 (in a stream, or as the whole
    body): ``TransientError`` (§6.2: SSE faults). Shared by every OpenAI-wire transport."""
    code, kind, message = describe_error_body(payload)
    label = "/".join(str(x) for x in (kind, code) if x) or "error"
    prefix = f"source {source_name!r}: " if source_name else ""
    return TransientError(
        sanitize_message(f"{prefix}error event in the stream: {label}: {message}", secret),
        source_name=source_name,
    )


def wire_error(
    exc: BaseException, *, timeout: bool, source_name: str | None, secret: Secrets = None
) -> TransientError:
    """A connection/read failure or an engine timeout, as ``TransientError``."""
    detail = sanitize_message(str(exc), secret)
    what = "timeout" if timeout else "network error"
    where = f" talking to source {source_name!r}" if source_name else ""
    suffix = f": {detail}" if detail else ""
    return TransientError(
        f"{what}{where}: {type(exc).__name__}{suffix}",
        source_name=source_name,
        reason="timeout" if timeout else "network_error",
    )


__all__ = [
    "CONTENT_FILTER_CODES",
    "CONTEXT_OVERFLOW_CODES",
    "CONTEXT_OVERFLOW_WORDINGS",
    "MAX_MESSAGE_CHARS",
    "QUOTA_CODES",
    "Secrets",
    "describe_error_body",
    "error_for_status",
    "error_for_stream_event",
    "is_quota_error",
    "parse_retry_after",
    "rejection",
    "sanitize_message",
    "wire_error",
]
