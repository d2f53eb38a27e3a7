"""The HTTP engines' pool and read timeout as source options, read one way everywhere.

``read_timeout_s``, ``max_connections`` and ``keepalive_s`` are source fields of the call kinds
whose transports post through these engines (``{SCOPE}__{P}__{N}__READ_TIMEOUT_S``...): the
configuration loader checks them, naming the key the user wrote, and the transports read them
again when they build their engine (a ``SourceConfig`` made in code is never loaded).
Durations take the forms of every other duration of the configuration (``15``, ``2.5``,
``"500ms"``, ``"15s"``, ``"1m"``). Importing this module imports no HTTP client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

from polygateway.errors import ConfigError
from polygateway.frozen import frozen_dataclass
from polygateway.options import MAX_COUNT, MAX_DURATION_S, parse_duration, parse_int

ENGINE_SOURCE_FIELDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "READ_TIMEOUT_S": "read_timeout_s",
        "MAX_CONNECTIONS": "max_connections",
        "KEEPALIVE_S": "keepalive_s",
    }
)
"""Source fields (env spelling) -> the engine option they set."""

_OFF = frozenset({"off", "none", ""})


def _duration(value: object) -> float:
    number = parse_duration(value)
    if not 0 <= number <= MAX_DURATION_S:
        raise ValueError(f"must be >= 0 seconds and at most {MAX_DURATION_S / 86400:g} days")
    return number


def read_timeout(value: object) -> float | None:
    """Seconds per socket read, or ``None`` for none: ``off`` (also ``none``) or 0."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    try:
        return _duration(value) or None
    except ValueError as exc:
        raise ValueError(f"{exc}; or off (0) for no read timeout") from None


def keepalive(value: object) -> float:
    """Seconds an idle pooled connection is kept (a duration >= 0; 0 keeps none)."""
    return _duration(value)


def max_connections(value: object) -> int:
    """The pool's size: an integer >= 0 (0: unlimited)."""
    try:
        number = parse_int(value)
    except ValueError:
        number = -1
    if not 0 <= number <= MAX_COUNT:
        raise ValueError(f"must be an integer >= 0 (0: unlimited) and at most {MAX_COUNT}")
    return number


_READERS: Final[Mapping[str, Callable[[object], object]]] = MappingProxyType(
    {
        "read_timeout_s": read_timeout,
        "max_connections": max_connections,
        "keepalive_s": keepalive,
    }
)


@frozen_dataclass(slots=True)
class EngineOptions:
    """What a source's options say of its engine's pool and reads."""

    read_timeout_s: float | None = None
    """``None``: no per-read timeout (the watchdog's deadlines bound a call)."""
    max_connections: int = 1024
    """0: unlimited."""
    keepalive_s: float = 15.0


def engine_option_problems(options: Mapping[str, Any], key_for: Callable[[str], str]) -> list[str]:
    """One line per engine option of ``options`` with a bad value, naming it by
    ``key_for(option)`` and saying what is wrong (the value itself is never shown: a
    misplaced secret stays out of the problem)."""
    problems: list[str] = []
    for name, read in _READERS.items():
        if name not in options:
            continue
        try:
            read(options[name])
        except ValueError as exc:
            problems.append(f"{key_for(name)}: {exc}")
    return problems


def engine_options(options: Mapping[str, Any], source: str) -> EngineOptions:
    """The engine options of a source's ``options`` (defaults for those not given);
    ``ConfigError`` naming the source and the option otherwise."""
    problems = engine_option_problems(options, lambda name: f"source {source!r}: option {name!r}")
    if problems:
        raise ConfigError(problems)
    defaults = EngineOptions()
    return EngineOptions(
        read_timeout_s=read_timeout(options.get("read_timeout_s", defaults.read_timeout_s)),
        max_connections=max_connections(options.get("max_connections", defaults.max_connections)),
        keepalive_s=keepalive(options.get("keepalive_s", defaults.keepalive_s)),
    )


__all__ = [
    "ENGINE_SOURCE_FIELDS",
    "EngineOptions",
    "engine_option_problems",
    "engine_options",
    "keepalive",
    "max_connections",
    "read_timeout",
]
