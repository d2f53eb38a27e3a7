"""HTTP status / body / wire failures -> the four error classes (ARCHITECTURE §6.2).

| upstream answer                                             | error                         |
|-------------------------------------------------------------|-------------------------------|
| an error rule matches (the profile's, then the common ones) | the rule's verdict            |
| 429 (rate), 409 (conflict), 500, 502, 503, 504, other 5xx   | TransientError + Retry-After  |
| 408 (the upstream timed out waiting for us)                 | TransientError (timeout)      |
| 401, 403, 402 (payment required: out of credit)             | SourceDeadError               |
| 404 (model not found / wrong base_url)                      | SourceDeadError               |
| 3xx (redirects are not followed: base_url is wrong)         | SourceDeadError               |
| 400 context overflow (``context_length_exceeded``, wordings) | ContextWindowExceededError    |
| 400 content policy (``content_filter``, ``content_policy...``)| ContentFilterError            |
| 400 and any other 4xx                                       | RequestRejectedError          |
| connection errors / read errors / engine timeouts           | TransientError                |

Then ``x-should-retry`` (the header the OpenAI SDKs obey before their own rules): ``false``
turns a would-be ``TransientError`` into ``RequestRejectedError`` (raised at once: no retry, no
switch, and the breaker does not count it, since the server answered and asked that this
request not be repeated, which says nothing against the source); ``true`` turns a
``RequestRejectedError`` into a ``TransientError`` (retried). A ``SourceDeadError`` stays: an
exhausted balance or a revoked key is not cured by repeating the request.

404 is a misconfigured source, not a bad request: the same messages may succeed on another
source, and retrying this one cannot help until someone fixes its model name or URL. Treating it
as ``SourceDeadError`` switches source at once and keeps the breaker of this source open.

Exhausted quota or balance is recognised by rules (``ErrorRule``, data: provider profiles add
their own): by error ``code`` (protocols §1.4: several codes, the ``type`` varies between
gateways), by the ``type`` when the code is missing, and by the message a relay keeps when it
drops the code. An error event in a stream (HTTP 200) is a ``TransientError`` unless a rule
matches (``tool_use_failed``, a context-length error: the same request fails the same way on
any source) or its integer ``code`` is an HTTP status (OpenRouter, vLLM), which is then
classified like that status. Messages are sanitised (anything that looks like a key is masked)
and truncated.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
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
from polygateway.ports import ErrorRule, ErrorVerdict

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

COMMON_ERROR_RULES: tuple[ErrorRule, ...] = (
    # Exhausted quota, credit or balance, whatever the status (a 429 of this kind never heals
    # by waiting).
    ErrorRule("source_dead", codes=tuple(sorted(QUOTA_CODES))),
    # Relays that drop the code keep OpenAI's message (or the code inside the text).
    ErrorRule(
        "source_dead",
        messages=("exceeded your current quota", "insufficient_quota", "insufficient balance"),
    ),
    # Deterministic client errors: the same request fails the same way on every source, also
    # when reported in the middle of a stream (Groq ``tool_use_failed``, context length).
    ErrorRule(
        "rejected",
        codes=(
            "tool_use_failed",
            "json_validate_failed",
            "context_length_exceeded",
            "string_above_max_length",
        ),
    ),
    ErrorRule("rejected", messages=("maximum context length",)),
)
"""Tried after a profile's own rules by every OpenAI-wire transport (see ``ErrorRule``)."""

MAX_MESSAGE_CHARS = 300
"""Upstream messages are cut to this length (bodies can be whole HTML error pages)."""

# Compiled at its first use, through ``re``'s cache: compiling it costs about 8 M instructions,
# and a start-up that meets no error never needs it.
_KEY_LIKE = (
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
    text = re.sub(_KEY_LIKE, _mask, text)
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
    """Whether an error is an exhausted quota or balance by the common rules."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    return rule_verdict(None, code, kind, text) == "source_dead"


def rule_verdict(
    status: int | None,
    code: str | None,
    kind: str | None,
    message: str,
    rules: Sequence[ErrorRule] = (),
) -> ErrorVerdict | None:
    """The verdict of the first matching rule, ``rules`` before ``COMMON_ERROR_RULES``;
    ``None`` when none matches."""
    lowered = message.lower()
    for rule in (*rules, *COMMON_ERROR_RULES):
        if rule.matches(status, code, kind, lowered):
            return rule.verdict
    return None


def _seconds(value: str | None, now: float | None = None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        if now is None:
            return None
        import email.utils  # only for this rare form: not on every start (~10 M instructions)

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


def _status_verdict(status: int) -> ErrorVerdict:
    if status >= 500 or status in (408, 409, 429) or status < 300:
        # 1xx or another status an HTTP client should never hand over: a wire fault.
        return "transient"
    if status in (401, 402, 403, 404) or 300 <= status < 400:
        return "source_dead"
    return "rejected"


def _should_retry(headers: Mapping[str, str] | None) -> bool | None:
    """The ``x-should-retry`` header: ``True``/``False``, ``None`` when absent or unclear."""
    value = headers.get("x-should-retry") if headers else None
    if value is None:
        return None
    value = value.strip().lower()
    return True if value == "true" else False if value == "false" else None


def _status_reason(status: int | None) -> SourceReason:
    if status in (408, 504):
        return "timeout"
    return "rate_limited" if status == 429 else "network_error"


def _classified(
    verdict: ErrorVerdict,
    text: str,
    status: int | None,
    source_name: str | None,
    retry_after_s: float | None,
    described: tuple[str | None, str | None, str] = (None, None, ""),
) -> PolyGatewayError:
    if verdict == "source_dead":
        return SourceDeadError(text, status=status, source_name=source_name)
    if verdict == "rejected":
        code, kind, message = described
        return rejection(code, kind, message, text, status=status, source_name=source_name)
    return TransientError(
        text,
        retry_after_s=retry_after_s,
        status=status,
        source_name=source_name,
        reason=_status_reason(status),
    )


def error_for_status(
    status: int,
    body: bytes | str,
    headers: Mapping[str, str] | None = None,
    *,
    source_name: str | None = None,
    secret: Secrets = None,
    rules: Sequence[ErrorRule] = (),
) -> PolyGatewayError:
    """The error an HTTP answer other than 2xx stands for (see the module table).

    ``rules``: the source's provider profile's ``error_rules`` (tried before the common ones).
    """
    code, kind, message = describe_error_body(body)
    label = "/".join(x for x in (kind, code) if x)
    where = f"source {source_name!r}: " if source_name else ""
    verdict = rule_verdict(status, code, kind, message, rules) or _status_verdict(status)
    should_retry = _should_retry(headers)
    note = ""
    if should_retry is False and verdict == "transient":
        verdict, note = "rejected", " (x-should-retry: false)"
    elif should_retry is True and verdict == "rejected":
        verdict, note = "transient", " (x-should-retry: true)"
    text = sanitize_message(
        f"{where}HTTP {status}{' ' + label if label else ''}{note}: {message}", secret
    )
    return _classified(
        verdict, text, status, source_name, parse_retry_after(headers), (code, kind, message)
    )


def _event_status(code: str | None) -> int | None:
    """An error event's integer ``code`` that is an HTTP error status (OpenRouter, vLLM)."""
    if code is not None and len(code) == 3 and code.isdigit() and 400 <= int(code) <= 599:
        return int(code)
    return None


def error_for_stream_event(
    payload: Mapping[str, Any],
    *,
    source_name: str | None,
    secret: Secrets = None,
    rules: Sequence[ErrorRule] = (),
) -> PolyGatewayError:
    """An error object sent instead of an answer, on an HTTP 200 (in a stream, or as the whole
    body). ``TransientError`` (ARCHITECTURE §6.2: SSE faults) unless a rule matches (``rules``
    first: the source's profile's) or the event's integer ``code`` is an HTTP status, classified
    as that status. Shared by every OpenAI-wire transport."""
    code, kind, message = describe_error_body(payload)
    label = "/".join(str(x) for x in (kind, code) if x) or "error"
    prefix = f"source {source_name!r}: " if source_name else ""
    text = sanitize_message(f"{prefix}error event in the stream: {label}: {message}", secret)
    verdict = rule_verdict(None, code, kind, message, rules)
    status = _event_status(code)
    if verdict is None:
        verdict = _status_verdict(status) if status is not None else "transient"
    return _classified(verdict, text, status, source_name, None, (code, kind, message))


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
    "COMMON_ERROR_RULES",
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
    "rule_verdict",
    "sanitize_message",
    "wire_error",
]
