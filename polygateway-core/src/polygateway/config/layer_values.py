"""A layer read without pydantic, for the values every configuration writes.

``layer_models.py``'s pydantic models are the definition of a layer. Reading one costs
importing pydantic and building every model, most of a start-up's configuration work, for
input that is nearly always a few plain strings. ``read_plain`` accepts a layer only when each
value is of a shape whose result is certain (a string naming a duration, an int in range, a
known word...) and gives what the model gives (``model_dump(by_alias=True,
exclude_unset=True)``, in field order); anything else (a bad value, an unknown key, an unusual
type) answers ``None`` and the model decides, so problems are always the model's own words.
``tests/config/test_plain_layers.py`` shows both agree on every example configuration and on
generated layers.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from polygateway.frozen import frozen_dataclass
from polygateway.options import (
    MAX_COUNT,
    MAX_DURATION_S,
    parse_bool,
    parse_duration,
    parse_int,
    parse_number,
)


class Unsure(Exception):
    """The value is not one whose result is certain here: the model must read the layer."""


Read = Callable[[Any], Any]


@frozen_dataclass(slots=True)
class LayerSpec:
    """The fields of one layer model, in its field order, each with its plain reader; ``model``
    names the pydantic model (in ``layer_models``) that defines it."""

    model: str
    fields: tuple[tuple[str, Read], ...]

    def reader(self, key: str) -> Read | None:
        return next((read for name, read in self.fields if name == key), None)


def _duration(low: float, *, inclusive: bool) -> Read:
    def read(value: Any) -> float:
        try:
            number = parse_duration(value)
        except ValueError:
            raise Unsure from None
        if (number >= low if inclusive else number > low) and number <= MAX_DURATION_S:
            return number
        raise Unsure

    return read


def _count(low: int) -> Read:
    def read(value: Any) -> int:
        try:
            number = parse_int(value)
        except ValueError:
            raise Unsure from None
        if low <= number <= MAX_COUNT:
            return number
        raise Unsure

    return read


def _bool(value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError:
        raise Unsure from None


def _name(value: Any) -> str:
    if type(value) is str:
        text = value.strip()
        if text:
            return text
    raise Unsure


def _names(value: Any) -> list[str]:
    if type(value) is list:
        return [_name(item) for item in value]
    raise Unsure


def _name_or_names(value: Any) -> str | list[str]:
    return _names(value) if type(value) is list else _name(value)


def _literal(*choices: str) -> Read:
    def read(value: Any) -> str:
        if type(value) is str and value in choices:
            return value
        raise Unsure

    return read


_PROVIDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


def _provider(value: Any) -> str:
    if type(value) is str:
        text = value.strip()
        if _PROVIDER.fullmatch(text):
            return text
    raise Unsure


def http_url(value: str) -> str:
    """``value`` if it is an http:// or https:// URL with a host, else ``ValueError``."""
    try:
        parts = urlsplit(value)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # e.g. an unclosed IPv6 bracket
        valid = False
    if not valid:
        raise ValueError("must be an http:// or https:// URL with a host")
    return value


def _url(value: Any) -> str:
    if type(value) is str:
        try:
            return http_url(value.strip())
        except ValueError:
            pass
    raise Unsure


def _text(value: Any) -> str:
    if type(value) is str:
        return value
    raise Unsure


def _float_range(low: float, high: float) -> Read:
    # Numbers only: a string goes to the model (its float parsing is its own).
    def read(value: Any) -> float:
        if type(value) in (int, float) and math.isfinite(value) and low <= value <= high:
            return float(value)
        raise Unsure

    return read


def _weight(value: Any) -> float:
    try:
        number = parse_number(value)
    except ValueError:
        raise Unsure from None
    if 0 < number <= MAX_DURATION_S:
        return number
    raise Unsure


def _options(value: Any) -> dict[str, Any]:
    if type(value) is dict and all(type(key) is str for key in value):
        return copy.deepcopy(value)
    raise Unsure


def _middleware_options(value: Any) -> dict[str, dict[str, Any]]:
    if type(value) is dict and all(type(k) is str and k and k == k.strip() for k in value):
        return {key: _options(item) for key, item in value.items()}
    raise Unsure


def _nested(spec: LayerSpec) -> Read:
    def read(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise Unsure
        found = _read(value, spec)
        if found is None:
            raise Unsure
        return found

    return read


POSITIVE_DURATION = _duration(0, inclusive=False)
NON_NEGATIVE_DURATION = _duration(0, inclusive=True)
POSITIVE_INT = _count(1)
NON_NEGATIVE_INT = _count(0)

_SOURCE_DEFAULT_FIELDS: tuple[tuple[str, Read], ...] = (
    ("timeout_s", POSITIVE_DURATION),
    ("connect_timeout_s", POSITIVE_DURATION),
    ("ttft_timeout_s", POSITIVE_DURATION),
    ("inter_token_timeout_s", POSITIVE_DURATION),
    ("max_concurrency", NON_NEGATIVE_INT),
    ("rpm", NON_NEGATIVE_INT),
    ("tpm", NON_NEGATIVE_INT),
    ("est_tokens", POSITIVE_INT),
    ("enable_thinking", _bool),
    ("missing_done", _literal("retry", "salvage")),
    ("max_response_bytes", NON_NEGATIVE_INT),
    ("transport", _name),
    ("engine", _literal("aiohttp", "httpx", "httpx-aiohttp", "httpx2", "httptools")),
    ("trust_env", _bool),
    ("options", _options),
    ("temperature", _float_range(0, 2)),
    ("top_p", _float_range(0, 1)),
    ("max_tokens", POSITIVE_INT),
    ("seed", NON_NEGATIVE_INT),
    ("presence_penalty", _float_range(-2, 2)),
    ("frequency_penalty", _float_range(-2, 2)),
    ("stop", _name_or_names),
    ("user", _name),
    ("parallel_tool_calls", _bool),
)

SOURCE_DEFAULTS = LayerSpec("SourceDefaultsLayer", _SOURCE_DEFAULT_FIELDS)
SOURCE = LayerSpec(
    "SourceLayer",
    (
        *_SOURCE_DEFAULT_FIELDS,
        ("provider", _provider),
        ("name", _name),
        ("base_url", _url),
        ("model", _name),
        ("api_key", _text),
        ("api_key_env", _name),
        ("priority", NON_NEGATIVE_INT),
        ("weight", _weight),
        ("context_window", POSITIVE_INT),
    ),
)
RETRY = LayerSpec(
    "RetryLayer",
    (
        ("max_attempts", POSITIVE_INT),
        ("base_delay_s", NON_NEGATIVE_DURATION),
        ("max_delay_s", NON_NEGATIVE_DURATION),
        ("same_source_attempts", NON_NEGATIVE_INT),
        ("wait_retry_after_up_to_s", NON_NEGATIVE_DURATION),
        ("max_retry_after_s", POSITIVE_DURATION),
        ("call_deadline_s", POSITIVE_DURATION),
        ("switch_on_content_filter", _bool),
    ),
)
BREAKER = LayerSpec(
    "BreakerLayer",
    (
        ("fail_threshold", POSITIVE_INT),
        ("cooldown_s", POSITIVE_DURATION),
        ("probe_ttl_s", POSITIVE_DURATION),
        ("max_cooldown_s", POSITIVE_DURATION),
        ("health_probe", _bool),
        ("backend", _name),
        ("options", _options),
    ),
)
BACKPRESSURE = LayerSpec(
    "BackpressureLayer",
    (
        ("quota_full", _literal("wait", "fail_fast")),
        ("stall_window_s", POSITIVE_DURATION),
        ("poll_interval_s", POSITIVE_DURATION),
        ("lease_ttl_s", POSITIVE_DURATION),
    ),
)
GLOBAL = LayerSpec(
    "GlobalLayer",
    (("max_concurrency", NON_NEGATIVE_INT), ("rpm", NON_NEGATIVE_INT), ("tpm", NON_NEGATIVE_INT)),
)
LIMITER = LayerSpec("LimiterLayer", (("name", _name), ("options", _options)))
CACHE = LayerSpec(
    "CacheLayer",
    (
        ("backend", _name),
        ("namespace", _name),
        ("ttl_s", POSITIVE_DURATION),
        ("options", _options),
    ),
)
TELEMETRY = LayerSpec(
    "TelemetryLayer",
    (
        ("backend", _name_or_names),
        ("sqlite_path", _name),
        ("content", _literal("full", "digest", "none")),
        ("options", _options),
    ),
)
STRUCTURED = LayerSpec("StructuredLayer", (("strategy", _name), ("max_retries", NON_NEGATIVE_INT)))
SCOPE_COMMON = LayerSpec(
    "ScopeCommonLayer",
    (
        ("state", _name),
        ("middleware", _names),
        ("selector", _name),
        ("batch_size", POSITIVE_INT),
        ("batch_concurrency", POSITIVE_INT),
        ("pricing_path", _name),
        ("retry", _nested(RETRY)),
        ("breaker", _nested(BREAKER)),
        ("backpressure", _nested(BACKPRESSURE)),
        ("global", _nested(GLOBAL)),
        ("limiter", _nested(LIMITER)),
        ("cache", _nested(CACHE)),
        ("telemetry", _nested(TELEMETRY)),
        ("structured", _nested(STRUCTURED)),
        ("source_defaults", _nested(SOURCE_DEFAULTS)),
        ("middleware_options", _middleware_options),
    ),
)

SPECS: tuple[LayerSpec, ...] = (
    SOURCE_DEFAULTS,
    SOURCE,
    RETRY,
    BREAKER,
    BACKPRESSURE,
    GLOBAL,
    LIMITER,
    CACHE,
    TELEMETRY,
    STRUCTURED,
    SCOPE_COMMON,
)


def _read(raw: Mapping[str, Any], spec: LayerSpec) -> dict[str, Any] | None:
    if any(spec.reader(key) is None for key in raw):
        return None  # an unknown key: the model names it and the allowed ones
    found: dict[str, Any] = {}
    try:
        for name, read in spec.fields:
            if name in raw:
                value = raw[name]
                found[name] = None if value is None else read(value)
    except Unsure:
        return None
    return found


def read_plain(raw: Mapping[str, Any], spec: LayerSpec) -> dict[str, Any] | None:
    """The layer's accepted values as the model would dump them, or ``None`` when the model
    must read it (see the module docstring)."""
    return _read(raw, spec)
