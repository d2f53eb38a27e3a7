"""Per-source options of the MonkeyOCR transport (``SourceConfig.options``).

Values may be strings (from the environment): booleans as ``true``/``false``, ``yes``/``no``,
``1``/``0``, ``on``/``off``; numbers as decimal strings. An unknown option or a bad value is a
``ConfigError`` naming the source and the option.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn

from polygateway.errors import ConfigError
from polygateway.settings import SourceConfig

ParseMode = Literal["standard", "split"]
ReturnType = Literal["zip_all", "middle_json"]

MIB: Final = 1024 * 1024

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})

_IGNORED: Final = frozenset({"engine"})
"""Options the config loader may set for every source; only the aiohttp engine exists here."""


@dataclass(frozen=True, slots=True)
class MonkeyOcrOptions:
    """Transport settings of one MonkeyOCR source (defaults in the plugin README)."""

    trust_env: bool = False
    """Honour proxy variables / netrc. Off: a LAN server is reached directly, bypassing a
    local proxy that would otherwise swallow the upload."""
    mode: ParseMode = "standard"
    """``standard`` -> ``POST /parse``; ``split`` -> ``POST /parse/split`` (a ZIP per page)."""
    return_type: ReturnType = "zip_all"
    """``middle_json`` asks servers that know ``return_type`` for the JSON inline (no ZIP
    download); servers that do not still answer with the ZIP, which is then used."""
    per_page_timeout_s: float = 2.0
    """Added to the source's ``timeout_s`` for every page (MonkeyOCR: 0.5-2.4 pages/s/GPU)."""
    per_mb_timeout_s: float = 1.0
    """Added to the source's ``timeout_s`` for every MiB uploaded."""
    max_timeout_s: float = 900.0
    """The deadline of one call never exceeds this (nor goes below ``timeout_s``); limiter
    leases and breaker probes of an OCR client are sized on it."""
    max_zip_bytes: int = 256 * MIB
    """A result ZIP larger than this is refused (``TransientError`` naming the cap)."""
    max_member_bytes: int = 64 * MIB
    """Largest decompressed ZIP member read (bounds a ZIP bomb)."""
    bbox_tolerance: float = 0.02
    """How far (fraction of the page size) a bbox may stick out of its page and be clamped."""
    health_timeout_s: float = 5.0
    max_connections: int = 16
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Extra request headers (e.g. for a reverse proxy in front of the server)."""

    @classmethod
    def from_source(cls, source: SourceConfig) -> MonkeyOcrOptions:
        return cls.from_mapping(source.options, source_name=source.name)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], *, source_name: str) -> MonkeyOcrOptions:
        reader = _Reader(options, source_name)
        defaults = cls()
        engine = str(options.get("engine", "aiohttp")).strip().lower()
        if engine != "aiohttp":
            reader.fail("engine", f"the monkeyocr transport runs on aiohttp only, got {engine!r}")
        mode = reader.choice("mode", defaults.mode, ("standard", "split"))
        return_type = reader.choice("return_type", defaults.return_type, ("zip_all", "middle_json"))
        if mode == "split" and return_type != "zip_all":
            reader.fail(
                "return_type",
                "split mode needs return_type 'zip_all' (the server returns one page otherwise)",
            )
        headers = options.get("headers", {})
        if not isinstance(headers, Mapping):
            reader.fail("headers", "must be a mapping of header names to values")
        built = cls(
            trust_env=reader.boolean("trust_env", defaults.trust_env),
            mode=mode,  # type: ignore[arg-type]
            return_type=return_type,  # type: ignore[arg-type]
            per_page_timeout_s=reader.number("per_page_timeout_s", defaults.per_page_timeout_s),
            per_mb_timeout_s=reader.number("per_mb_timeout_s", defaults.per_mb_timeout_s),
            max_timeout_s=reader.number("max_timeout_s", defaults.max_timeout_s, positive=True),
            max_zip_bytes=int(reader.number("max_zip_mb", defaults.max_zip_bytes / MIB) * MIB),
            max_member_bytes=int(
                reader.number("max_member_mb", defaults.max_member_bytes / MIB) * MIB
            ),
            bbox_tolerance=reader.number("bbox_tolerance", defaults.bbox_tolerance),
            health_timeout_s=reader.number(
                "health_timeout_s", defaults.health_timeout_s, positive=True
            ),
            max_connections=int(reader.number("max_connections", defaults.max_connections)),
            headers={str(k): str(v) for k, v in headers.items()},
        )
        known = {*cls.__dataclass_fields__, "max_zip_mb", "max_member_mb", *_IGNORED}
        known -= {"max_zip_bytes", "max_member_bytes"}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            reader.fail(unknown[0], f"unknown option; allowed: {', '.join(sorted(known))}")
        if built.max_zip_bytes <= 0 or built.max_member_bytes <= 0:
            reader.fail("max_zip_mb", "the ZIP and member caps must be > 0")
        return built


class _Reader:
    __slots__ = ("_options", "_source")

    def __init__(self, options: Mapping[str, Any], source: str) -> None:
        self._options = options
        self._source = source

    def fail(self, key: str, why: str) -> NoReturn:
        raise ConfigError(f"source {self._source!r}: option {key!r}: {why}")

    def boolean(self, key: str, default: bool) -> bool:
        value = self._options.get(key, default)
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        self.fail(key, f"must be true or false, got {value!r}")

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        value = self._options.get(key, default)
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(key, f"must be a number, got {value!r}")
        if isinstance(value, bool) or not math.isfinite(number) or number < 0:
            self.fail(key, f"must be a finite number >= 0, got {value!r}")
        if positive and number == 0:
            self.fail(key, "must be > 0")
        return number

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = str(self._options.get(key, default)).strip().lower()
        if value not in allowed:
            self.fail(key, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value


__all__ = ["MIB", "MonkeyOcrOptions", "ParseMode", "ReturnType"]
