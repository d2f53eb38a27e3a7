"""MonkeyOCR's own failure answers -> the error classes of ``polygateway.errors``.

| answer                                                             | error                  |
|--------------------------------------------------------------------|------------------------|
| ``/ocr/*`` HTTP 200 ``success:false``, message with ``400: ...``   | RequestRejectedError   |
| ``/ocr/*`` HTTP 200 ``success:false``, anything else (OOM, bugs)   | TransientError         |
| ``/parse`` HTTP 500 ``{"detail": "Parsing failed: 400: ..."}``     | RequestRejectedError   |
| ``/parse`` HTTP 500 ``Parsing failed: ...`` otherwise              | TransientError         |
| 422 (FastAPI validation: no ``file`` field)                        | RequestRejectedError   |
| other statuses                                                     | the core's status table|
| ``GET /static/...`` 404 (the ZIP is gone)                          | TransientError         |

The server wraps its own ``HTTPException(400, "Unsupported file type ...")`` in a generic
handler, so the only trace of "bad request" is the ``400: `` inside the message; that prefix
is what Starlette's ``str(HTTPException)`` writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from polygateway.errors import PolyGatewayError, RequestRejectedError, TransientError
from polygateway.transports.errors import (
    Secrets,
    describe_error_body,
    error_for_status,
    sanitize_message,
)

_BAD_REQUEST: Final = re.compile(r"(?:^|[:\s])400: ")


def failure_error(
    message: str,
    *,
    endpoint: str,
    status: int | None,
    source_name: str,
    secret: Secrets = None,
) -> PolyGatewayError:
    """The error for a MonkeyOCR failure message (``success:false`` or ``Parsing failed``)."""
    text = sanitize_message(f"source {source_name!r}: {endpoint} failed: {message}", secret)
    if _BAD_REQUEST.search(message):
        return RequestRejectedError(text, status=status, source_name=source_name)
    return TransientError(text, status=status, source_name=source_name)


def status_error(
    status: int,
    body: bytes,
    headers: Mapping[str, str],
    *,
    endpoint: str,
    source_name: str,
    secret: Secrets,
) -> PolyGatewayError:
    """The error for a non-2xx answer of ``endpoint`` (``/parse``, ``/ocr/text``, ``/static``)."""
    if status == 500:
        _code, _kind, message = describe_error_body(body)
        if message.startswith("Parsing failed") or _BAD_REQUEST.search(message):
            return failure_error(
                message, endpoint=endpoint, status=status, source_name=source_name, secret=secret
            )
    if status == 404 and endpoint == "download":
        return TransientError(
            f"source {source_name!r}: the result ZIP is no longer on the server (HTTP 404)",
            status=status,
            source_name=source_name,
        )
    return error_for_status(status, body, headers, source_name=source_name, secret=secret)


__all__ = ["failure_error", "status_error"]
