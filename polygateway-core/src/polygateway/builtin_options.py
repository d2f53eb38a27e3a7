"""Options models of the core's own components (declared like any plugin's, see
``polygateway.options``). Imported when the registration hooks run, never by ``import
polygateway``."""

from __future__ import annotations

from polygateway.options import ComponentOptions, PositiveDuration, PositiveInt


class MemoryCacheOptions(ComponentOptions):
    """``[scopes.X.cache.options]`` of the ``memory`` cache."""

    max_entries: PositiveInt = 10_000


class SQLiteTelemetryOptions(ComponentOptions):
    """``[scopes.X.telemetry.options]`` of the ``sqlite`` recorder (the file is
    ``PGW_TELEMETRY_SQLITE_PATH`` / ``[scopes.X.telemetry].sqlite_path``)."""

    batch_size: PositiveInt = 2048
    flush_interval_s: PositiveDuration = 0.2
    queue_max: PositiveInt = 100_000
