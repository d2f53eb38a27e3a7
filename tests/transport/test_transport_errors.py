"""HTTP status/body -> error class (ARCHITECTURE §6.2), Retry-After, message hygiene."""

from __future__ import annotations

import json

import pytest
from polygateway.errors import (
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    TransientError,
)
from polygateway.transports.errors import (
    QUOTA_CODES,
    describe_error_body,
    error_for_status,
    parse_retry_after,
    sanitize_message,
    wire_error,
)


def openai_body(code: str | None = None, type_: str = "invalid_request_error") -> bytes:
    error = {"message": "m", "type": type_, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (429, openai_body("rate_limit_exceeded", "requests"), TransientError),
        (429, openai_body("insufficient_quota", "insufficient_quota"), SourceDeadError),
        # Quota is recognised by code, whatever the type says.
        (429, openai_body("credit_balance_exhausted", "requests"), SourceDeadError),
        (429, b"plain text: insufficient_quota", SourceDeadError),
        (429, b"", TransientError),
        (401, openai_body("invalid_api_key"), SourceDeadError),
        (402, b'{"error":{"message":"Insufficient Balance"}}', SourceDeadError),
        (403, openai_body("unsupported_country_region_territory"), SourceDeadError),
        (404, openai_body("model_not_found"), SourceDeadError),
        (400, openai_body("unsupported_parameter"), RequestRejectedError),
        (400, openai_body("insufficient_quota"), SourceDeadError),
        (408, b"", TransientError),
        (413, b"", RequestRejectedError),
        (422, b'{"detail":"bad"}', RequestRejectedError),
        (500, openai_body(None, "server_error"), TransientError),
        (502, b"<html>bad gateway</html>", TransientError),
        (503, openai_body("server_is_overloaded", "service_unavailable_error"), TransientError),
        (504, b"", TransientError),
        (529, b'{"type":"error","error":{"type":"overloaded_error"}}', TransientError),
        (307, b"", SourceDeadError),
    ],
)
def test_status_table(status: int, body: bytes, expected: type[PolyGatewayError]) -> None:
    error = error_for_status(status, body, {}, source_name="s1")
    assert type(error) is expected
    assert getattr(error, "status", None) == status
    assert getattr(error, "source_name", None) == "s1"


@pytest.mark.parametrize("code", sorted(QUOTA_CODES))
def test_every_quota_code_kills_the_source(code: str) -> None:
    assert isinstance(error_for_status(429, openai_body(code, "whatever"), {}), SourceDeadError)


def test_reasons() -> None:
    assert error_for_status(429, b"", {}).reason == "rate_limited"  # type: ignore[attr-defined]
    assert error_for_status(504, b"", {}).reason == "timeout"  # type: ignore[attr-defined]
    assert error_for_status(500, b"", {}).reason == "network_error"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": " 1.5 "}, 1.5),
        ({"retry-after-ms": "644", "retry-after": "9"}, 0.644),
        ({"retry-after-ms": "junk", "retry-after": "3"}, 3.0),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),  # a past date: now
        ({"retry-after": "-1"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({}, None),
    ],
)
def test_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    assert parse_retry_after(headers) == (pytest.approx(seconds) if seconds is not None else None)
    for status in (429, 503):
        error = error_for_status(status, b"", headers)
        assert isinstance(error, TransientError)
        assert error.retry_after_s == parse_retry_after(headers)


def test_retry_after_header_lookup_is_case_insensitive_with_engine_headers() -> None:
    from multidict import CIMultiDict

    assert parse_retry_after(CIMultiDict({"Retry-After": "4"})) == 4.0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (openai_body("c", "t"), ("c", "t", "m")),
        (b'{"error":{"code":429,"message":"slow down"}}', ("429", None, "slow down")),
        (
            b'{"object":"error","message":"bad","type":"BadRequestError","code":400}',
            ("400", "BadRequestError", "bad"),
        ),
        (b'{"detail":"Parsing failed"}', (None, None, "Parsing failed")),
        (b'{"error":"flat string"}', (None, None, "flat string")),
        (b"<html>oops</html>", (None, None, "<html>oops</html>")),
        (b"", (None, None, "")),
    ],
)
def test_describe_error_body_shapes(
    body: bytes, expected: tuple[str | None, str | None, str]
) -> None:
    assert describe_error_body(body) == expected


def test_messages_never_carry_keys_and_are_truncated() -> None:
    key = "sk-proj-ABCDEFGH12345678abcdefgh"
    body = json.dumps(
        {
            "error": {
                "message": f"Incorrect API key provided: {key}. " + "x " * 500,
                "code": "invalid_api_key",
            }
        }
    ).encode()
    error = error_for_status(401, body, {}, source_name="s", secret=key)
    assert key not in str(error)
    assert len(str(error)) <= 300
    masked = sanitize_message("Authorization: Bearer abc.def-ghi and token=zzz", None)
    assert "abc.def-ghi" not in masked and "zzz" not in masked
    assert sanitize_message("my secret is hunter2", "hunter2") == "my secret is ***"
    # Ordinary words survive.
    assert sanitize_message("Rate limit reached on tokens per min") == (
        "Rate limit reached on tokens per min"
    )


def test_wire_error() -> None:
    error = wire_error(ConnectionResetError("reset by peer"), timeout=False, source_name="s")
    assert isinstance(error, TransientError)
    assert error.reason == "network_error" and error.source_name == "s"
    assert "ConnectionResetError" in str(error)
    assert wire_error(TimeoutError(), timeout=True, source_name=None).reason == "timeout"
