"""Error mapping the failover policy depends on: context overflow and content-filter wordings,
Retry-After in every form a provider or relay sends."""

from __future__ import annotations

import pytest
from polygateway.errors import (
    ContentFilterError,
    ContextWindowExceededError,
    RequestRejectedError,
)
from polygateway.transports.errors import error_for_status, parse_retry_after


@pytest.mark.parametrize(
    "body",
    [
        b'{"error":{"message":"too long","type":"invalid_request_error",'
        b'"code":"context_length_exceeded"}}',
        b'{"error":{"message":"prompt is too long: 210000 tokens > 200000 maximum",'
        b'"type":"invalid_request_error"}}',
        b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens"}',
        b'{"error":{"code":400,"message":"the request exceeds the available context size"}}',
        b'{"error":{"message":"Range of input length should be [1, 30720]",'
        b'"code":"InvalidParameter"}}',
    ],
)
def test_context_overflow_wordings_are_their_own_class(body: bytes) -> None:
    error = error_for_status(400, body, source_name="s")
    assert isinstance(error, ContextWindowExceededError)
    assert isinstance(error, RequestRejectedError) and error.status == 400


@pytest.mark.parametrize("code", ["content_filter", "content_policy_violation"])
def test_content_policy_rejections_carry_their_reason(code: str) -> None:
    body = f'{{"error":{{"message":"filtered","code":"{code}"}}}}'.encode()
    error = error_for_status(400, body, source_name="s")
    assert isinstance(error, ContentFilterError) and error.reason == code


def test_a_plain_400_stays_a_plain_rejection() -> None:
    error = error_for_status(400, b'{"error":{"message":"bad temperature"}}')
    assert type(error) is RequestRejectedError


def test_retry_after_http_date_is_seconds_from_now() -> None:
    headers = {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}
    assert parse_retry_after(headers, now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after(headers, now=1445412490.0) == 0.0  # in the past: now


def test_retry_after_forms_and_precedence() -> None:
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"llm_provider-retry-after": "4"}) == 4.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({"retry-after": "-3"}) is None
