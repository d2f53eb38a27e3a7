"""The core components' options as plain frozen values, read without pydantic.

``builtin_options``' models are the definition (problems, ``pgw config check``). A start-up
reads the options of the memory cache and the sqlite recorder (the default configuration picks
both), and importing pydantic for a handful of numbers is most of its configuration work, so
``read_memory_cache`` / ``read_sqlite_telemetry`` give the value the model gives when they are
certain of it (known keys, values in range) and ``None`` otherwise, for the model to decide.
``tests/config/test_plain_builtin_options.py`` shows both agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from polygateway.frozen import frozen_dataclass
from polygateway.options import (
    MAX_COUNT,
    MAX_DURATION_S,
    OptionsRef,
    parse_duration,
    parse_int,
)


@frozen_dataclass(slots=True)
class MemoryCacheValues:
    """What ``MemoryCacheOptions`` holds."""

    max_entries: int = 10_000


@frozen_dataclass(slots=True)
class SQLiteTelemetryValues:
    """What ``SQLiteTelemetryOptions`` holds."""

    batch_size: int = 2048
    flush_interval_s: float = 0.2
    queue_max: int = 100_000


def _positive_int(value: Any) -> int | None:
    try:
        number = parse_int(value)
    except ValueError:
        return None
    return number if 1 <= number <= MAX_COUNT else None


def _positive_duration(value: Any) -> float | None:
    try:
        number = parse_duration(value)
    except ValueError:
        return None
    return number if 0 < number <= MAX_DURATION_S else None


Values = TypeVar("Values")


def _reader(
    values: type[Values], readers: Mapping[str, Callable[[Any], Any]]
) -> Callable[[Mapping[str, Any]], Values | None]:
    def read(options: Mapping[str, Any]) -> Values | None:
        parsed: dict[str, Any] = {}
        for key, raw in options.items():
            read_one = readers.get(key)
            value = None if read_one is None else read_one(raw)
            if value is None:
                return None  # unknown key or a value the model must judge
            parsed[key] = value
        return values(**parsed)

    return read


read_memory_cache = _reader(MemoryCacheValues, {"max_entries": _positive_int})
read_sqlite_telemetry = _reader(
    SQLiteTelemetryValues,
    {
        "batch_size": _positive_int,
        "flush_interval_s": _positive_duration,
        "queue_max": _positive_int,
    },
)

MEMORY_CACHE_OPTIONS = OptionsRef(
    "polygateway.builtin_options:MemoryCacheOptions",
    plain=MemoryCacheValues,
    read_plain=read_memory_cache,
)
SQLITE_TELEMETRY_OPTIONS = OptionsRef(
    "polygateway.builtin_options:SQLiteTelemetryOptions",
    plain=SQLiteTelemetryValues,
    read_plain=read_sqlite_telemetry,
)
