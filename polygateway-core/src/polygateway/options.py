"""Component options: how a plugin declares them, and the one vocabulary for option values.

A component factory registers with an options model::

    from typing import Annotated
    from polygateway.options import ComponentOptions, EnvKey, PositiveDuration, SecretText

    class RedisOptions(ComponentOptions):
        url: Annotated[SecretText, EnvKey("REDIS_URL")]
        socket_timeout_s: PositiveDuration = 2.0

    register("redis", factory, options=RedisOptions)

or, so that registration and the unknown-key check do not import the model (nor pydantic)
until the component's options are used, by reference with its flat keys declared up front::

    register("redis", factory, options=OptionsRef("pgw_redis.options:RedisOptions",
                                                  env_keys={"url": "REDIS_URL"}))

The configuration loader collects the component's values (``[scopes.X.limiter] options =
{...}``, ``{SCOPE}__LIMITER__SOCKET_TIMEOUT_S``, the flat keys the model declares with
``EnvKey``), validates them with the model and names the key the user wrote in every problem;
the factory gets the validated instance as ``ctx.options``. ``docs/plugins.md`` has the details
(precedence, problem lines, what ``pgw config check`` shows).

Values arrive as TOML typed them or as env strings, so every field type here parses by meaning,
never by Python truthiness (``bool("false")`` is true). The core's own settings use the same
types, so ``yes`` or ``2.5s`` mean the same in a core key and in a plugin option.


The parsers, ``EnvKey`` and the limits import nothing heavy; the pydantic types and
``ComponentOptions`` live in ``polygateway.option_types`` and are imported from here on first
use, so a module that only parses values (a transport, the configuration loader) does not
import pydantic.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from polygateway.frozen import frozen_dataclass
from polygateway.options_ref import OptionsRef
from polygateway.validation import MAX_TOKENS

if TYPE_CHECKING:
    from pydantic import BaseModel

    from polygateway.option_types import (
        Bool,
        ComponentOptions,
        Duration,
        Int,
        NonNegativeDuration,
        NonNegativeInt,
        Number,
        PositiveDuration,
        PositiveInt,
        SecretText,
        dump_options,
        is_secret_field,
    )

__all__ = [
    "BOOL_WORDS",
    "MAX_COUNT",
    "MAX_DURATION_S",
    "Bool",
    "ComponentOptions",
    "Duration",
    "EnvKey",
    "Int",
    "NonNegativeDuration",
    "NonNegativeInt",
    "Number",
    "OptionsRef",
    "PositiveDuration",
    "PositiveInt",
    "SecretText",
    "dump_options",
    "env_keys",
    "is_secret_field",
    "is_secret_name",
    "parse_bool",
    "parse_duration",
    "parse_int",
    "parse_number",
]

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})
BOOL_WORDS = "true or false (also yes/no, on/off, 1/0)"
"""How problems describe an accepted boolean."""

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ms|s|m|h)?$")
_DURATION_WORDS = "must be a number of seconds (or with a unit: 500ms, 2s, 1m, 1h)"


def parse_bool(value: object) -> bool:
    """``True``/``False``, ``1``/``0``, or ``true``/``false``, ``yes``/``no``, ``on``/``off``,
    ``1``/``0`` as strings (any case, surrounding blanks ignored); else ``ValueError``."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return value == 1
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ValueError(f"must be {BOOL_WORDS}")


def parse_int(value: object) -> int:
    """An int or a string of one; floats (even ``8.0``) and booleans are refused."""
    if type(value) is int:
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError("must be an integer")


def parse_number(value: object) -> float:
    """An int, a float or a decimal string, as a float; booleans are refused."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _finite(float(value))
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
        else:
            return _finite(number)
    raise ValueError("must be a number")


def _finite(number: float) -> float:
    # Refused here rather than by the float schema, so the problem shows the value as written.
    if not math.isfinite(number):
        raise ValueError("must be a finite number")
    return number


def parse_duration(value: object) -> float:
    """Seconds: a number (``30``, ``2.5``, ``"2.5"``) or a string with a unit (``"500ms"``,
    ``"2.5s"``, ``"1m"``, ``"1h"``). The range (``> 0``...) is the field's to check."""
    if isinstance(value, str):
        text = value.strip().lower()
        match = _DURATION.match(text)
        if match is not None:
            return _finite(float(match.group(1)) * _UNITS[match.group(2) or "s"])
        try:
            return _finite(float(text))  # inf/nan parse, and are refused as not finite
        except ValueError as exc:
            if "finite" in str(exc):
                raise
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return _finite(float(value))
    raise ValueError(_DURATION_WORDS)


MAX_COUNT = MAX_TOKENS
"""Largest count a setting accepts (tokens, limits, sizes): what every limiter accepts, exact as
a Lua double (Redis). A larger value is refused at load time, naming the key, instead of
failing every call later."""

MAX_DURATION_S = 366 * 86400.0
"""Longest duration a setting accepts (a year): far above any timeout, TTL or cooldown, and
its milliseconds fit every timer and Redis expiry."""


@frozen_dataclass(slots=True)
class EnvKey:
    """Field metadata: a flat env key (``REDIS_URL``) that sets this option for every scope.

    It ranks like the core's flat keys: above the file's ``[defaults]``, below a scope's own
    table and its ``{SCOPE}__{KIND}__{OPTION}`` keys. When set, it is validated even if no
    scope picks the component (the user wrote it).
    """

    name: str


_SECRET_NAME = re.compile(
    r"(^|[_\-])(api[_\-]?key|key|secret|password|passwd|pwd|token|dsn|credentials?|auth|"
    r"authorization)$",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """Whether an option name looks like it holds a credential (``password``, ``api_token``)."""
    return bool(_SECRET_NAME.search(name))


def env_keys(model: type[BaseModel]) -> dict[str, str]:
    """Option name -> the flat env key its ``EnvKey`` metadata declares."""
    found: dict[str, str] = {}
    for name, info in model.model_fields.items():
        for meta in info.metadata:
            if isinstance(meta, EnvKey):
                found[info.alias or name] = meta.name
    return found


_PYDANTIC_NAMES = frozenset(
    {
        "Bool",
        "ComponentOptions",
        "Duration",
        "Int",
        "NonNegativeDuration",
        "NonNegativeInt",
        "Number",
        "PositiveDuration",
        "PositiveInt",
        "SecretText",
        "dump_options",
        "is_secret_field",
    }
)


def __getattr__(name: str) -> Any:
    # The pydantic side of the vocabulary, imported by whoever declares or validates options.
    if name in _PYDANTIC_NAMES:
        from polygateway import option_types

        return getattr(option_types, name)
    raise AttributeError(f"module 'polygateway.options' has no attribute {name!r}")
