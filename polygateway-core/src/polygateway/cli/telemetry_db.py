"""Where the telemetry commands (``pgw telemetry report``, ``pgw logs``) read rows from.

The database is the one the configuration names, found as ``from_env`` finds it: env, then
``.env``, then the pipeline file (``PGW_TELEMETRY_SQLITE_PATH``, ``{SCOPE}__TELEMETRY__
SQLITE_PATH``, ``[scopes.X.telemetry].sqlite_path``), unless ``--db`` names a file. The price
table's currency label comes from the same configuration (``PGW_PRICING_PATH``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from polygateway.errors import ConfigError

DEFAULT_DB = "pgw_telemetry.db"


@dataclass(frozen=True)
class TelemetrySource:
    path: str
    """The SQLite file to read."""
    origin: str
    """How it was chosen (``--db``, the configuration key, or the default)."""
    currency: str = ""


def add_source_arguments(parser: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """``--db`` and the configuration flags (``inherit``: see ``add_config_arguments``)."""
    from polygateway.cli import add_config_arguments

    parser.add_argument(
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
            if path is None and scope.telemetry.backend == "sqlite":
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


def read_rows(source: TelemetrySource, *, since: float | None) -> list[dict[str, Any]]:
    """Every row at or after ``since``, oldest first; ``ValueError`` naming the problem."""
    from polygateway.telemetry.report import read_sqlite_rows

    if not os.path.exists(source.path):
        raise ValueError(f"{source.path} (from {source.origin}): no such file")
    return read_sqlite_rows(source.path, since=since)
