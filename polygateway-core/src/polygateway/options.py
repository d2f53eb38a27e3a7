"""Component options: how a plugin declares them, and the one vocabulary for option values.

A component factory registers with an options model::

    from typing import Annotated
    from polygateway.options import ComponentOptions, EnvKey, PositiveDuration, SecretText

    class RedisOptions(ComponentOptions):
        url: Annotated[SecretText, EnvKey("REDIS_URL")]
        socket_timeout_s: PositiveDuration = 2.0

    register("redis", factory, options=RedisOptions)

The configuration loader collects the component's values (``[scopes.X.limiter] options =
{...}``, ``{SCOPE}__LIMITER__SOCKET_TIMEOUT_S``, the flat keys the model declares with
``EnvKey``), validates them with the model and names the key the user wrote in every problem;
the factory gets the validated instance as ``ctx.options``. ``docs/plugins.md`` has the details
(precedence, problem lines, what ``pgw config check`` shows).

Values arrive as TOML typed them or as env strings, so every field type here parses by meaning,
never by Python truthiness (``bool("false")`` is true). The core's own settings use the same
types, so ``yes`` or ``2.5s`` mean the same in a core key and in a plugin option.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    SecretStr,
)

from polygateway.settings import Secret
from polygateway.validation import MAX_TOKENS

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


def _secret(value: object) -> Secret:
    if isinstance(value, Secret):
        return value
    if isinstance(value, SecretStr):
        return Secret(value.get_secret_value())
    if isinstance(value, str):
        return Secret(value.strip())
    raise ValueError("must be a string")


Bool = Annotated[bool, BeforeValidator(parse_bool)]
Int = Annotated[int, BeforeValidator(parse_int)]
MAX_COUNT = MAX_TOKENS
"""Largest count a setting accepts (tokens, limits, sizes): what every limiter accepts, exact as
a Lua double (Redis). A larger value is refused at load time, naming the key, instead of
failing every call later."""

MAX_DURATION_S = 366 * 86400.0
"""Longest duration a setting accepts (a year): far above any timeout, TTL or cooldown, and
its milliseconds fit every timer and Redis expiry."""

PositiveInt = Annotated[Int, Field(ge=1, le=MAX_COUNT)]
NonNegativeInt = Annotated[Int, Field(ge=0, le=MAX_COUNT)]
Number = Annotated[float, BeforeValidator(parse_number)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
PositiveDuration = Annotated[Duration, Field(gt=0, le=MAX_DURATION_S)]
NonNegativeDuration = Annotated[Duration, Field(ge=0, le=MAX_DURATION_S)]
SecretText = Annotated[
    Secret, PlainValidator(_secret), PlainSerializer(lambda secret: secret.masked())
]
"""A string held in the core's ``Secret``: never shown in reprs, problems or ``pgw config``."""


@dataclass(frozen=True, slots=True)
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


class ComponentOptions(BaseModel):
    """Base of an options model: frozen, unknown keys refused, inputs never echoed, and a repr
    that hides credential-looking values even when a field is typed as a plain ``str``."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        hide_input_in_errors=True,
        allow_inf_nan=False,
    )

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            if isinstance(value, Secret | SecretStr):
                yield name, value  # masks itself
            elif (name is not None and is_secret_name(name)) or (
                isinstance(value, str) and "://" in value and "@" in value
            ):
                yield name, "***"
            else:
                yield name, value


def env_keys(model: type[BaseModel]) -> dict[str, str]:
    """Option name -> the flat env key its ``EnvKey`` metadata declares."""
    found: dict[str, str] = {}
    for name, info in model.model_fields.items():
        for meta in info.metadata:
            if isinstance(meta, EnvKey):
                found[info.alias or name] = meta.name
    return found


def is_secret_field(model: type[BaseModel], name: str) -> bool:
    """Whether option ``name`` of ``model`` is typed as a secret (``SecretText``/``SecretStr``)."""
    info = next(
        (f for n, f in model.model_fields.items() if (f.alias or n) == name),
        None,
    )
    if info is None:
        return False
    return _holds_secret(info.annotation) or any(
        isinstance(meta, PlainValidator) and meta.func is _secret for meta in info.metadata
    )


def _holds_secret(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Secret | SecretStr):
        return True
    args: tuple[Any, ...] = getattr(annotation, "__args__", ()) or ()
    return any(_holds_secret(arg) for arg in args)


def dump_options(options: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """Every option value (defaults included) by key, secrets still wrapped (for describing)."""
    if isinstance(options, BaseModel):
        return {
            (info.alias or name): getattr(options, name)
            for name, info in type(options).model_fields.items()
        }
    return dict(options)
