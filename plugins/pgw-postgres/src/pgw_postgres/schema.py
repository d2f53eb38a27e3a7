"""The ``pgw_calls`` table in PostgreSQL, its schema version and its in-place migration.

The table has the 18 telemetry columns under the names of ``TelemetryRecord`` plus
``created_at timestamptz DEFAULT now()``; ``call_id`` is the primary key. A column added later
is one line in ``COLUMNS`` carrying the schema version that added it (``since``): a database
made by an older version gets it through ``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` the next
time a recorder opens it, and the version stored in ``pgw_schema_versions`` moves up. Such a
column must be nullable or have a default (existing rows get it too). A database already at a
newer version is left alone: newer columns are nullable, so this version's rows still fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from polygateway.types import TelemetryRecord

VERSIONS_TABLE = "pgw_schema_versions"
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,55}$")


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str
    """SQL type: ``text``, ``bigint``, ``double precision``, ``boolean``."""
    constraint: str = ""
    """``NOT NULL``, ``PRIMARY KEY``, ``DEFAULT ...``."""
    since: int = 1
    """The schema version that added the column."""

    def __post_init__(self) -> None:
        if not _IDENTIFIER.match(self.name):
            raise ValueError(f"column name {self.name!r} is not a plain lower-case identifier")
        if self.since < 1:
            raise ValueError(f"column {self.name}: since must be >= 1, got {self.since}")
        constraint = self.constraint.upper()
        if self.since > 1 and "NOT NULL" in constraint and "DEFAULT" not in constraint:
            raise ValueError(
                f"column {self.name} (since version {self.since}) is NOT NULL without a "
                "DEFAULT: rows already stored could not get it"
            )

    def definition(self) -> str:
        return f"{self.name} {self.type} {self.constraint}".rstrip()


COLUMNS: tuple[Column, ...] = (
    Column("call_id", "text", "PRIMARY KEY"),
    Column("parent_call_id", "text"),
    Column("session_id", "text"),
    Column("model", "text", "NOT NULL"),
    Column("provider", "text", "NOT NULL"),
    Column("source_name", "text", "NOT NULL"),
    Column("messages", "text", "NOT NULL"),
    Column("response", "text", "NOT NULL"),
    Column("thinking", "text", "NOT NULL"),
    Column("prompt_tokens", "bigint", "NOT NULL"),
    Column("completion_tokens", "bigint", "NOT NULL"),
    Column("usage_source", "text", "NOT NULL"),
    Column("latency_ms", "bigint", "NOT NULL"),
    Column("ttft_ms", "double precision"),
    Column("max_inter_token_ms", "double precision"),
    Column("cache_hit", "boolean", "NOT NULL"),
    Column("error", "text"),
    Column("cost", "double precision"),
    # Later columns: one line each, nullable (rows stored before them read NULL).
    Column("scope", "text", since=2),
    Column("cache_namespace", "text", since=2),
    Column("params", "text", since=2),
    # The call a row belongs to (the call_id of its first row): calls are counted by it.
    Column("root_call_id", "text", since=3),
)
"""The telemetry columns, in row order; ``created_at`` follows them."""

CREATED_AT = Column("created_at", "timestamptz", "NOT NULL DEFAULT now()")
_RECORD_FIELDS = frozenset(f.name for f in fields(TelemetryRecord))

Row = tuple[Any, ...]
"""One record as written: the columns' values in order, then ``created_at`` (epoch seconds)."""


@dataclass(frozen=True)
class Schema:
    """A telemetry table: its name and columns (``created_at`` implied, last)."""

    table: str = "pgw_calls"
    columns: tuple[Column, ...] = COLUMNS
    row_of: Callable[[TelemetryRecord], Row] = field(init=False, repr=False, compare=False)
    text_positions: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _IDENTIFIER.match(self.table):
            raise ValueError(f"table name {self.table!r} is not a plain lower-case identifier")
        names = [c.name for c in self.columns]
        if not names or names[0] != "call_id" or len(set(names)) != len(names):
            raise ValueError("columns must start with call_id and have unique names")
        if "created_at" in names:
            raise ValueError("created_at is implied (the last column); do not list it")
        wanted = [*names, "created_at"]
        row_of: Callable[[TelemetryRecord], Row] = attrgetter(*wanted)
        if not set(wanted) <= _RECORD_FIELDS:
            # A column the record type does not have (yet): written as NULL.
            present = [n for n in wanted if n in _RECORD_FIELDS]
            pick = attrgetter(*present)
            slots = [present.index(n) if n in _RECORD_FIELDS else -1 for n in wanted]

            def row_of(record: TelemetryRecord) -> Row:
                values = pick(record)
                return tuple(values[i] if i >= 0 else None for i in slots)

        object.__setattr__(self, "row_of", row_of)
        texts = tuple(i for i, c in enumerate(self.columns) if c.type == "text")
        object.__setattr__(self, "text_positions", texts)

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int:
        return max(c.since for c in self.columns)

    def at_version(self, version: int) -> Schema:
        """The table as version ``version`` made it (the columns it had)."""
        return Schema(self.table, tuple(c for c in self.columns if c.since <= version))

    def with_columns(self, *columns: Column) -> Schema:
        return Schema(self.table, (*self.columns, *columns))

    @property
    def names(self) -> tuple[str, ...]:
        return (*(c.name for c in self.columns), CREATED_AT.name)

    # ------------------------------------------------------------------ DDL

    def create_table(self) -> str:
        body = ",\n    ".join(c.definition() for c in (*self.columns, CREATED_AT))
        return f"CREATE TABLE IF NOT EXISTS {self.table} (\n    {body}\n)"

    def add_columns(self, after_version: int) -> list[str]:
        """``ALTER TABLE`` statements bringing a version ``after_version`` table up to date."""
        return [
            f"ALTER TABLE {self.table} ADD COLUMN IF NOT EXISTS {c.definition()}"
            for c in self.columns
            if c.since > after_version
        ]

    def create_indexes(self) -> list[str]:
        return [
            f"CREATE INDEX IF NOT EXISTS {self.table}_{name} ON {self.table} ({name})"
            for name in ("session_id", "created_at", "root_call_id")
            if name in self.names
        ]

    # ------------------------------------------------------------------ writes

    @property
    def stage(self) -> str:
        return f"{self.table}_stage"

    def create_stage(self) -> str:
        """A per-connection staging table for COPY (``created_at`` as epoch seconds)."""
        body = ", ".join(f"{c.name} {c.type}" for c in self.columns)
        return (
            f"CREATE TEMP TABLE IF NOT EXISTS {self.stage} ({body}, created_at double precision)"
            " ON COMMIT DELETE ROWS"
        )

    def merge_stage(self) -> str:
        """Staged rows into the table; a ``call_id`` already there is skipped."""
        names = ", ".join(c.name for c in self.columns)
        return (
            f"INSERT INTO {self.table} ({names}, created_at) SELECT {names}, {_TIMESTAMP} "
            f"FROM {self.stage} ON CONFLICT (call_id) DO NOTHING"
        )

    def insert_row(self) -> str:
        """One row (the fallback that isolates a bad row of a failed batch)."""
        count = len(self.columns)
        params = ", ".join(f"${i}" for i in range(1, count + 1))
        stamp = _TIMESTAMP.replace("created_at", f"${count + 1}::double precision")
        names = ", ".join(c.name for c in self.columns)
        return (
            f"INSERT INTO {self.table} ({names}, created_at) VALUES ({params}, {stamp}) "
            "ON CONFLICT (call_id) DO NOTHING"
        )


# A record made without a clock reading (created_at 0) is stamped by the server.
_TIMESTAMP = "COALESCE(to_timestamp(NULLIF(created_at, 0)), now())"

SCHEMA = Schema()


async def ensure_schema(conn: Any, schema: Schema, *, command_timeout_s: float) -> int | None:
    """Create or migrate the table in place; return the version found (``None``: none).

    One transaction under an advisory lock, so processes starting together do not race on
    ``CREATE TABLE``. A table at this version (or newer) costs one query.
    """
    timeout = command_timeout_s
    async with conn.transaction():
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1))", f"pgw:{schema.table}", timeout=timeout
        )
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {VERSIONS_TABLE} (table_name text PRIMARY KEY, "
            "version integer NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())",
            timeout=timeout,
        )
        found = await conn.fetchrow(
            f"SELECT (SELECT version FROM {VERSIONS_TABLE} WHERE table_name = $1) AS version, "
            "to_regclass($1) IS NOT NULL AS present",
            schema.table,
            timeout=timeout,
        )
        stored: int | None = found["version"] if found["present"] else None
        if stored is not None and stored >= schema.version:
            return stored
        statements = [
            schema.create_table(),
            # A table of unknown version (made before versions were kept) may lack any column
            # added after version 1.
            *schema.add_columns(stored if stored is not None else 1),
            *schema.create_indexes(),
        ]
        for statement in statements:
            await conn.execute(statement, timeout=timeout)
        await conn.execute(
            f"INSERT INTO {VERSIONS_TABLE} (table_name, version) VALUES ($1, $2) "
            "ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, "
            "updated_at = now()",
            schema.table,
            schema.version,
            timeout=timeout,
        )
        return stored


__all__ = ["COLUMNS", "SCHEMA", "VERSIONS_TABLE", "Column", "Row", "Schema", "ensure_schema"]
