"""Where the telemetry commands (``pgw telemetry report``, ``pgw logs``) read rows from.

The database is the one the configuration names, found as ``from_env`` finds it: env, then
``.env``, then the pipeline file (``PGW_TELEMETRY_SQLITE_PATH``, ``{SCOPE}__TELEMETRY__
SQLITE_PATH``, ``[scopes.X.telemetry].sqlite_path``), unless ``--db`` names a file or ``--dsn``
a database URL. Rows are read by a registered ``telemetry_reader`` (``ports.TelemetryReader``):
``sqlite`` for a file, the reader the URL's scheme names for ``--dsn`` (plugins add them). The price
table's currency label comes from the same configuration (``PGW_PRICING_PATH``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polygateway.errors import ConfigError
from polygateway.frozen import value_methods

if TYPE_CHECKING:
    from polygateway.plugins import Registry

DEFAULT_DB = "pgw_telemetry.db"


@value_methods
@dataclass(frozen=True, repr=False, eq=False)
class TelemetrySource:
    path: str
    """The SQLite file to read, or the ``--dsn`` URL."""
    origin: str
    """How it was chosen (``--db``, ``--dsn``, the configuration key, or the default)."""
    currency: str = ""
    reader: str = "sqlite"
    """The ``telemetry_reader`` that reads it."""

    @property
    def label(self) -> str:
        """How to name it in output: a URL with its password masked."""
        from polygateway.config.models import mask_url

        return mask_url(self.path) if "://" in self.path else self.path


def add_source_arguments(parser: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """``--db`` and the configuration flags (``inherit``: see ``add_config_arguments``)."""
    from polygateway.cli import add_config_arguments

    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--dsn",
        metavar="URL",
        default=argparse.SUPPRESS if inherit else None,
        help="a telemetry database URL, read by the telemetry reader its scheme names "
        "(plugins add readers)",
    )
    where.add_argument(
        "--db",
        metavar="PATH",
        default=argparse.SUPPRESS if inherit else None,
        help="SQLite telemetry file (default: the one the configuration names, as from_env "
        f"finds it: PGW_TELEMETRY_SQLITE_PATH..., else ./{DEFAULT_DB})",
    )
    add_config_arguments(parser, inherit=inherit)


def resolve_source(args: argparse.Namespace) -> TelemetrySource:
    """The database ``args`` (or, without ``--db``, the configuration) names."""
    from polygateway.config import load_settings, read_env
    from polygateway.config.env import FLAT_KEYS

    dsn: str | None = getattr(args, "dsn", None)
    if dsn is not None:
        # "postgresql+asyncpg://" is read by "postgresql"; an odd scheme is not shown (the
        # value may hold a password).
        scheme = dsn.partition("://")[0].partition("+")[0].lower()
        if "://" not in dsn or not scheme.isalnum():
            scheme = "?"
        return TelemetrySource(dsn, "--dsn", reader=scheme)
    pipeline_path = getattr(args, "pipeline_path", None)
    env_file = getattr(args, "env_file", None)
    path: str | None = getattr(args, "db", None)
    origin = "--db"
    currency = ""
    pricing: str | None = None
    try:
        settings = load_settings(None, pipeline_path=pipeline_path, dotenv_path=env_file)
    except ConfigError:
        settings = None  # a broken configuration still has a database to read
    if settings is not None:
        for name, scope in settings.scopes.items():
            pricing = pricing or scope.pricing_path
            if path is None and "sqlite" in scope.telemetry.backends:
                path, origin = scope.telemetry.sqlite_path, f"the configuration (scope {name})"
    if path is None or pricing is None:
        try:
            values = read_env(None, dotenv_path=env_file)
        except ConfigError:
            values = dict(os.environ)
        keys = {loc: key for key, loc in FLAT_KEYS.items()}
        db_key, price_key = keys[("telemetry", "sqlite_path")], keys[("pricing_path",)]
        if path is None and values.get(db_key, "").strip():
            path, origin = values[db_key].strip(), db_key
        pricing = pricing or values.get(price_key, "").strip() or None
    if path is None:
        path, origin = DEFAULT_DB, "the default"
    if pricing:
        currency = _currency_of(pricing)
    return TelemetrySource(path, origin, currency)


def _currency_of(path: str) -> str:
    from polygateway.telemetry.pricing import PricingTable

    try:
        return PricingTable.from_file(path).currency
    except ConfigError:
        return ""  # ``pgw config check`` reports a broken price table; the report goes on


def read_rows(
    source: TelemetrySource, registry: Registry, *, since: float | None
) -> list[dict[str, Any]]:
    """Every row at or after ``since``, oldest first; ``ValueError`` naming the problem."""
    readers = registry.names("telemetry_reader")
    if source.reader not in readers:
        raise ValueError(
            f"--dsn: no telemetry reader for scheme {source.reader!r} (readers: "
            f"{', '.join(readers)}; plugins add readers)"
        )
    if source.reader == "sqlite" and not os.path.exists(source.path):
        raise ValueError(f"{source.path} (from {source.origin}): no such file")
    reader = registry.get("telemetry_reader", source.reader)
    return reader(source.path, since=since)
