"""Options of the ``otel`` telemetry recorder, declared for the loader.

``OtelOptions`` is what ``register("otel", factory, options=OtelOptions)`` hands the loader:
values from the pipeline file's ``[scopes.X.telemetry.options]`` (in a fan-out,
``[scopes.X.telemetry.options.otel]``), ``{SCOPE}__TELEMETRY__<OPTION>`` (in a fan-out
``{SCOPE}__TELEMETRY__OTEL__<OPTION>``) or the flat keys below.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated

from polygateway.options import Bool, ComponentOptions, EnvKey, PositiveDuration, SecretText
from polygateway.settings import Secret
from pydantic import AfterValidator, Field

from pgw_otel.exchange import check_headers


def _endpoint(value: Secret | None) -> Secret | None:
    if value is None:
        return None
    text = value.reveal().strip().rstrip("/")
    if not text.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL (the OTLP/HTTP base, e.g. :4318)")
    parts = urllib.parse.urlsplit(text)
    if parts.query or parts.fragment or "?" in text or "#" in text:
        # /v1/traces is appended to the base: it would land inside the query.
        raise ValueError("must have no query or fragment (put keys in headers)")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must have no user:password@ (never sent: put it in headers)")
    return Secret(text)


def _headers(value: Secret | None) -> Secret | None:
    if value is None:
        return None
    parse_headers(value.reveal())
    return value


def parse_headers(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (the ``OTEL_EXPORTER_OTLP_HEADERS`` form) as a dict.

    :raises ValueError: a pair without ``=``, a name that is no HTTP token, a value HTTP
        cannot carry (``pgw_otel.exchange.check_headers``); the message never shows a value.
    """
    headers: dict[str, str] = {}
    for index, pair in enumerate(p for p in text.split(",") if p.strip()):
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"header {index + 1} is not name=value (values not shown)")
        headers[name.strip()] = value.strip()
    check_headers(headers)
    return headers


class OtelOptions(ComponentOptions):
    """Where spans and metrics go, and what they carry."""

    endpoint: Annotated[
        SecretText | None, EnvKey("PGW_OTEL_ENDPOINT"), AfterValidator(_endpoint)
    ] = None
    """OTLP/HTTP base URL (``http://collector:4318``; ``/v1/traces`` and ``/v1/metrics`` are
    appended). Set: the recorder writes OTLP protobuf itself and posts it there from a
    thread of its own (spans in batches, metrics aggregated and posted every
    ``metric_interval_s``). Unset: it uses the application's global providers
    (``opentelemetry.trace`` / ``opentelemetry.metrics``), so the app's own OTel set-up
    decides."""
    headers: Annotated[SecretText | None, EnvKey("PGW_OTEL_HEADERS"), AfterValidator(_headers)] = (
        None
    )
    """Headers of every export, ``name=value,name2=value2`` (``Authorization=Basic ...`` for
    Langfuse). Never shown."""
    service_name: Annotated[str, Field(min_length=1)] = "polygateway"
    """``service.name`` of the recorder's own providers."""
    capture_content: Annotated[Bool, EnvKey("PGW_OTEL_CAPTURE_CONTENT")] = False
    """Put prompts and answers on the spans (``gen_ai.input.messages`` /
    ``gen_ai.output.messages``). Off by default: spans carry no content."""
    prometheus_port: Annotated[
        int | None, EnvKey("PGW_OTEL_PROMETHEUS_PORT"), Field(ge=1, le=65535)
    ] = None
    """Serve the metrics for Prometheus on this port (127.0.0.1), with the recorder's own
    meter provider (``serve_prometheus``)."""
    export_timeout_s: PositiveDuration = 10.0
    """Timeout of one export (spans or metrics); a slow collector never reaches a call."""
    metric_interval_s: PositiveDuration = 30.0
    """How often metrics are exported over OTLP."""


__all__ = ["OtelOptions", "parse_headers"]
