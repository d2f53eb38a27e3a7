"""Rows of ``pgw_calls`` for ``pgw telemetry report --dsn postgresql://...``."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from pgw_postgres.options import dsn_secrets, normalize_dsn, redact
from pgw_postgres.recorder import WRITE_ERRORS
from pgw_postgres.schema import SCHEMA

READ_TIMEOUT_S = 30.0


def read_postgres_rows(
    dsn: str, *, since: float | None = None, table: str = SCHEMA.table
) -> list[dict[str, Any]]:
    """Every row (optionally created at or after ``since``), oldest first, ``created_at`` in
    epoch seconds (as the SQLite reader gives it).

    :raises ValueError: the DSN is not a PostgreSQL URL, the server cannot be reached, the
        login or the database is refused, or there is no telemetry table. The message names
        the problem, never the password.
    """
    try:
        url = normalize_dsn(dsn)
    except ValueError as exc:
        raise ValueError(f"--dsn: {exc}") from None
    try:
        rows = asyncio.run(_read(url, since, table))
    # What a refused login, a missing database, an unreachable or unparsable address raise.
    except (*WRITE_ERRORS, asyncpg.ClientConfigurationError) as exc:
        detail = redact(f"{type(exc).__name__}: {exc}", dsn_secrets(url))
        raise ValueError(f"cannot read telemetry from PostgreSQL ({detail})") from None
    if rows is None:
        raise ValueError(
            f"no {table} table in that database (is it a PolyGateway telemetry database?)"
        )
    return rows


async def _read(dsn: str, since: float | None, table: str) -> list[dict[str, Any]] | None:
    conn = await asyncpg.connect(dsn, timeout=10, command_timeout=READ_TIMEOUT_S)
    try:
        present = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
        if not present:
            return None
        sql = f"SELECT * FROM {table}"
        params: tuple[Any, ...] = ()
        if since is not None:
            sql += " WHERE created_at >= to_timestamp($1)"
            params = (since,)
        rows = await conn.fetch(sql + " ORDER BY created_at", *params)
    finally:
        await conn.close(timeout=5)
    out = []
    for row in rows:
        values = dict(row)
        values["created_at"] = values["created_at"].timestamp()
        out.append(values)
    return out


__all__ = ["read_postgres_rows"]
