"""A Prometheus scrape endpoint for one-process apps: ``serve_prometheus(port)``.

The OpenTelemetry Prometheus exporter (``opentelemetry-exporter-prometheus``, extra
``prometheus``) as a metric reader on a registry of its own (never the process-wide default
registry), served by ``prometheus_client`` on a thread of its own. Hand ``endpoint.reader`` to
a ``MeterProvider`` (the ``otel`` recorder does with ``prometheus_port``); ``shutdown()``
stops the server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrometheusEndpoint", "serve_prometheus"]


class PrometheusEndpoint:
    """A running scrape endpoint: ``reader`` (a metric reader), ``port``, ``url``."""

    def __init__(self, reader: Any, server: Any, port: int, addr: str) -> None:
        self.reader = reader
        self._server = server
        self.port = port
        self.url = f"http://{addr}:{port}/metrics"

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        return True  # scraped on demand: nothing to push

    def shutdown(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __repr__(self) -> str:
        return f"PrometheusEndpoint(url={self.url!r})"


def serve_prometheus(port: int, *, addr: str = "127.0.0.1") -> PrometheusEndpoint:
    """Serve ``/metrics`` on ``addr:port`` (``port=0``: any free port, see ``.port``).

    :raises ImportError: the ``prometheus`` extra is not installed (the message says so).
    :raises ValueError: a port outside 0..65535.
    """
    if type(port) is not int or not 0 <= port <= 65535:
        raise ValueError(f"serve_prometheus port must be an int in 0..65535, got {port!r}")
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise ImportError(
            "serve_prometheus needs the prometheus extra: "
            "pip install -e 'plugins/pgw-otel[prometheus]' "
            f"({exc})"
        ) from exc
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return PrometheusEndpoint(reader, server, server.server_port, addr)
