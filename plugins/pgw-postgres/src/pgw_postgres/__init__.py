"""PolyGateway telemetry in PostgreSQL (entry point ``polygateway: postgres``).

Registers the ``postgres`` telemetry recorder (``PGW_TELEMETRY_BACKEND=postgres`` with
``PGW_TELEMETRY_PG_DSN``, or ``[scope.telemetry] backend = "postgres"`` in the pipeline file)
and the ``postgresql``/``postgres`` telemetry readers behind ``pgw telemetry report --dsn``.
Only hook implementations live here: asyncpg is imported when a factory or a reader runs.

Options (``PostgresOptions``): ``dsn`` (``PGW_TELEMETRY_PG_DSN``), ``batch_size``,
``queue_max``, ``flush_interval_s``, ``command_timeout_s``, ``acquire_timeout_s``,
``connect_timeout_s``, ``close_timeout_s``, ``pool_max_size`` (pipeline file
``[scopes.LLM.telemetry.options]``, env ``LLM__TELEMETRY__BATCH_SIZE``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.options import OptionsRef
from polygateway.ports import ComponentContext, Register, TelemetryRecorder

if TYPE_CHECKING:
    from pgw_postgres.options import PostgresOptions
    from pgw_postgres.recorder import PostgresRecorder

_LAZY = {
    "PostgresOptions": "pgw_postgres.options",
    "PostgresRecorder": "pgw_postgres.recorder",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pgw_postgres' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


@hookimpl
def pgw_register_telemetry(register: Register) -> None:
    # The options model by reference: imported when a scope picks postgres or
    # PGW_TELEMETRY_PG_DSN is set (the loader validates with it); asyncpg only at build.
    def postgres(ctx: ComponentContext[PostgresOptions]) -> TelemetryRecorder:
        from pgw_postgres.recorder import PostgresRecorder

        return PostgresRecorder.from_options(ctx.options)

    options = OptionsRef(
        "pgw_postgres.options:PostgresOptions", env_keys={"dsn": "PGW_TELEMETRY_PG_DSN"}
    )
    register("postgres", postgres, options=options)


@hookimpl
def pgw_register_telemetry_readers(register: Register) -> None:
    def postgres(target: str, *, since: float | None) -> list[dict[str, Any]]:
        from pgw_postgres.reader import read_postgres_rows

        return read_postgres_rows(target, since=since)

    register("postgresql", postgres)
    register("postgres", postgres)


__all__ = ["PostgresOptions", "PostgresRecorder"]
