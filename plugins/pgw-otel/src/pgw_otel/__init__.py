"""PolyGateway telemetry as OpenTelemetry spans and metrics (entry point ``polygateway: otel``).

Registers the ``otel`` telemetry recorder (``PGW_TELEMETRY_BACKEND=otel``, or beside another
recorder: ``PGW_TELEMETRY_BACKEND=sqlite,otel``, ``backend = ["sqlite", "otel"]`` in the
pipeline file). Only hook implementations live here: the OpenTelemetry SDK is imported when
the factory runs.

Options (``OtelOptions``): ``endpoint`` (``PGW_OTEL_ENDPOINT``: the recorder's own OTLP/HTTP
export from a thread of its own; unset: the application's global providers), ``headers``
(``PGW_OTEL_HEADERS``), ``service_name``, ``capture_content`` (off by default),
``prometheus_port`` (``PGW_OTEL_PROMETHEUS_PORT``), ``export_timeout_s``,
``metric_interval_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.options import OptionsRef
from polygateway.ports import ComponentContext, Register, TelemetryRecorder

if TYPE_CHECKING:
    from pgw_otel.options import OtelOptions
    from pgw_otel.prometheus import PrometheusEndpoint, serve_prometheus
    from pgw_otel.recorder import OtelRecorder

_LAZY = {
    "OtelOptions": "pgw_otel.options",
    "OtelRecorder": "pgw_otel.recorder",
    "PrometheusEndpoint": "pgw_otel.prometheus",
    "serve_prometheus": "pgw_otel.prometheus",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pgw_otel' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


@hookimpl
def pgw_register_telemetry(register: Register) -> None:
    # The options model by reference: imported when a scope picks otel or a PGW_OTEL_* key is
    # set (the loader validates with it); the SDK only when the recorder is built.
    def otel(ctx: ComponentContext[OtelOptions]) -> TelemetryRecorder:
        from pgw_otel.recorder import OtelRecorder

        return OtelRecorder.from_options(ctx.options, sources=ctx.settings.sources)

    options = OptionsRef(
        "pgw_otel.options:OtelOptions",
        env_keys={
            "endpoint": "PGW_OTEL_ENDPOINT",
            "headers": "PGW_OTEL_HEADERS",
            "capture_content": "PGW_OTEL_CAPTURE_CONTENT",
            "prometheus_port": "PGW_OTEL_PROMETHEUS_PORT",
        },
    )
    register("otel", otel, options=options)


__all__ = ["OtelOptions", "OtelRecorder", "PrometheusEndpoint", "serve_prometheus"]
