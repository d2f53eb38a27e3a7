"""Options of the ``postgres`` telemetry recorder, and the DSN: checked here, never shown.

The DSN must be a ``postgresql://`` or ``postgres://`` URL; a SQLAlchemy-style driver suffix
(``postgresql+asyncpg://``) is accepted and stripped. Errors name the option and what is wrong,
never the DSN itself (it may hold a password).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from polygateway.errors import ConfigError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

SCHEMES = ("postgresql", "postgres")
DRIVER_SUFFIX = "+asyncpg"


def normalize_dsn(dsn: object, *, name: str = "dsn") -> str:
    """The DSN asyncpg accepts: scheme checked, ``+asyncpg`` stripped.

    :raises ConfigError: not a string, or not a ``postgresql://`` / ``postgres://`` URL.
    """
    hidden = "(value not shown: it may hold a password)"
    if not isinstance(dsn, str) or not dsn.strip():
        raise ConfigError(f"{name}: must be a non-empty postgresql:// URL {hidden}")
    text = dsn.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ConfigError(f"{name}: must be a postgresql:// or postgres:// URL {hidden}")
    scheme = scheme.lower()
    if scheme.endswith(DRIVER_SUFFIX):
        scheme = scheme[: -len(DRIVER_SUFFIX)]
    if scheme not in SCHEMES:
        shown = scheme if scheme.replace("+", "").isalnum() else "?"
        raise ConfigError(
            f"{name}: scheme {shown!r} is not postgresql:// or postgres:// "
            f"(a +asyncpg suffix is accepted) {hidden}"
        )
    return f"{scheme}://{rest}"


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """The password of a DSN in every spelling that could reach a message (raw and decoded)."""
    found: list[str] = []
    try:
        parts = urlsplit(dsn)
        if parts.password:
            found += [parts.password, unquote(parts.password)]
        found += [v for k, v in parse_qsl(parts.query) if k.lower() == "password"]
    except ValueError:  # an unparsable netloc (a bad port): fall back to the raw user:pass
        netloc = dsn.partition("://")[2].rpartition("@")[0]
        if ":" in netloc:
            raw = netloc.partition(":")[2]
            found += [raw, unquote(raw)]
    return tuple(sorted({s for s in found if s}, key=len, reverse=True))


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Seconds = Annotated[float, Field(gt=0), AfterValidator(_finite)]


class PostgresOptions(BaseModel):
    """Everything the recorder can be told. Pipeline file: ``[scope.telemetry] options``."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    dsn: str | None = Field(default=None, repr=False)
    """``PGW_TELEMETRY_PG_DSN``; normalized (``+asyncpg`` stripped). Unused when a pool is given."""
    batch_size: int = Field(default=1000, ge=1, le=100_000)
    """Rows per write (one COPY and one INSERT ... SELECT)."""
    queue_max: int = Field(default=100_000, ge=1)
    """Rows waiting in memory at most; when full, the oldest is dropped (and counted)."""
    flush_interval_s: Seconds = 0.2
    """A partial batch is written after at most this long."""
    command_timeout_s: Seconds = 5.0
    """Every statement's timeout (a server that stopped answering cannot hang the writer)."""
    acquire_timeout_s: Seconds = 2.0
    """Waiting for a pooled connection (a new connection included)."""
    connect_timeout_s: Seconds = 5.0
    """Opening one connection (the pool's first one included)."""
    close_timeout_s: Seconds = 10.0
    """``aclose()`` writes what is queued for at most this long; the rest is dropped."""
    pool_max_size: int = Field(default=2, ge=1, le=100)
    """Connections of the pool the recorder makes (one writer uses one at a time)."""

    def __init__(self, **values: Any) -> None:
        if values.get("dsn") is not None:
            values["dsn"] = normalize_dsn(values["dsn"])
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_problems(exc, values)) from None

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self if k != "dsn")
        return f"PostgresOptions(dsn={'***' if self.dsn else None}, {shown})"

    __str__ = __repr__


def _problems(exc: ValidationError, values: Mapping[str, Any]) -> list[str]:
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        name = ".".join(str(part) for part in error["loc"]) or "options"
        given = "" if name == "dsn" or name not in values else f", got {values[name]!r}"
        problems.append(f"telemetry backend postgres: option {name}: {error['msg']}{given}")
    return problems


def options_from(dsn: str | None, options: Mapping[str, Any]) -> PostgresOptions:
    """The options of a factory call: the configured DSN plus the pipeline file's table."""
    values = dict(options)
    if "dsn" in values:
        raise ConfigError(
            "telemetry backend postgres: option dsn: set the DSN with PGW_TELEMETRY_PG_DSN "
            "(or pg_dsn_env in the pipeline file), not in options"
        )
    if dsn is None:
        raise ConfigError(
            "PGW_TELEMETRY_PG_DSN: required by telemetry backend postgres "
            "(a postgresql:// URL; or pg_dsn_env in the pipeline file)"
        )
    return PostgresOptions(dsn=normalize_dsn(dsn, name="PGW_TELEMETRY_PG_DSN"), **values)


__all__ = ["PostgresOptions", "dsn_secrets", "normalize_dsn", "options_from", "redact"]
