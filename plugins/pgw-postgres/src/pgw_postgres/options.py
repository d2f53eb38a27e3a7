"""Options of the ``postgres`` telemetry recorder, declared for the loader, and the DSN check.

``PostgresOptions`` is what ``register("postgres", factory, options=PostgresOptions)`` hands
the loader: ``dsn`` comes from ``PGW_TELEMETRY_PG_DSN`` (or ``[...telemetry.options] dsn_env``,
``{SCOPE}__TELEMETRY__DSN``), the rest from the pipeline file's ``[...telemetry.options]`` or
``{SCOPE}__TELEMETRY__BATCH_SIZE`` and the like. ``RecorderOptions`` (everything but the DSN)
is what ``PostgresRecorder(...)`` validates its keyword arguments with.

The DSN must be a ``postgresql://`` or ``postgres://`` URL; a SQLAlchemy-style driver suffix
(``postgresql+asyncpg://``) is accepted and stripped. Errors never show the DSN (it may hold a
password).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from polygateway.options import ComponentOptions, EnvKey, PositiveDuration, PositiveInt
from polygateway.options import SecretText as _SecretText
from polygateway.settings import Secret
from pydantic import AfterValidator, Field, ValidationError

SCHEMES = ("postgresql", "postgres")
DRIVER_SUFFIX = "+asyncpg"
_HIDDEN = "(value not shown: it may hold a password)"


def normalize_dsn(dsn: str) -> str:
    """The DSN asyncpg accepts: scheme checked, ``+asyncpg`` stripped.

    :raises ValueError: not a ``postgresql://`` / ``postgres://`` URL (the message does not
        show it).
    """
    scheme, sep, rest = dsn.strip().partition("://")
    scheme = scheme.lower().removesuffix(DRIVER_SUFFIX)
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"must be a postgresql:// or postgres:// URL (a +asyncpg suffix is accepted) {_HIDDEN}"
        )
    return f"{scheme}://{rest}"


def _dsn(value: Secret) -> Secret:
    return Secret(normalize_dsn(value.reveal()))


PostgresDsn = Annotated[_SecretText, EnvKey("PGW_TELEMETRY_PG_DSN"), AfterValidator(_dsn)]


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


class RecorderOptions(ComponentOptions):
    """How the recorder batches, waits and gives up (everything but where it writes)."""

    batch_size: Annotated[PositiveInt, Field(le=100_000)] = 1000
    """Rows per write (one COPY and one INSERT ... SELECT)."""
    queue_max: PositiveInt = 100_000
    """Rows waiting in memory at most; when full, the oldest is dropped (and counted)."""
    flush_interval_s: PositiveDuration = 0.2
    """A partial batch is written after at most this long."""
    command_timeout_s: PositiveDuration = 5.0
    """Every statement's timeout (a server that stopped answering cannot hang the writer)."""
    acquire_timeout_s: PositiveDuration = 2.0
    """Waiting for a pooled connection (a new connection included)."""
    connect_timeout_s: PositiveDuration = 5.0
    """Opening one connection (the pool's first one included)."""
    close_timeout_s: PositiveDuration = 10.0
    """``aclose()`` writes what is queued for at most this long; the rest is dropped."""
    pool_max_size: Annotated[PositiveInt, Field(le=100)] = 2
    """Connections of the pool the recorder makes (one writer uses one at a time)."""

    @classmethod
    def checked(cls, values: Mapping[str, Any], *, where: str) -> RecorderOptions:
        """``cls(**values)``, a validation error turned into one ``ValueError`` line per
        problem, each naming the option (inputs are never echoed)."""
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = [
                f"{where} {'.'.join(str(p) for p in e['loc']) or 'options'}: {e['msg']}"
                for e in exc.errors(include_input=False, include_url=False)
            ]
            raise ValueError("; ".join(problems)) from None


class PostgresOptions(RecorderOptions):
    """The ``postgres`` telemetry backend's options: the DSN, then the recorder's."""

    dsn: PostgresDsn


__all__ = [
    "PostgresDsn",
    "PostgresOptions",
    "RecorderOptions",
    "dsn_secrets",
    "normalize_dsn",
    "redact",
]
