"""Fixtures of the pgw-postgres suite: fresh databases on the machine's PostgreSQL, and a
PostgreSQL server of the suite's own (stopped and restarted by the outage tests, with
password logins for the wrong-password tests; the machine's cluster is never touched)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pgw_postgres_test_helpers import (
    MACHINE_ADMIN,
    MACHINE_HOST,
    MACHINE_PORT,
    PostgresServer,
    drop_database,
    missing,
    new_database,
    reachable,
    with_database,
)

pytest.register_assert_rewrite("polygateway.testing.contracts")


@pytest.fixture
def postgres_dsn() -> Iterator[str]:
    """DSN of a fresh database of its own on the machine's PostgreSQL, dropped afterwards."""
    if not reachable(MACHINE_HOST, MACHINE_PORT):
        missing(f"PostgreSQL is not reachable on {MACHINE_HOST}:{MACHINE_PORT}")
    name = new_database(MACHINE_ADMIN)
    try:
        yield with_database(MACHINE_ADMIN, name)
    finally:
        drop_database(MACHINE_ADMIN, name)


@pytest.fixture(scope="session")
def own_postgres() -> Iterator[PostgresServer]:
    """The suite's own PostgreSQL on a spare port, for the whole session."""
    server = PostgresServer()
    try:
        try:
            server.init()
            server.start()
        except (RuntimeError, OSError) as exc:  # no runuser, no postgres user, ...
            missing(f"cannot run a PostgreSQL server of the suite's own: {exc}")
        yield server
    finally:
        server.destroy()


@pytest.fixture
def own_postgres_dsn(own_postgres: PostgresServer) -> Iterator[str]:
    """A fresh database on the suite's own server (running: a test that stops it restarts it)."""
    if not (own_postgres.data / "postmaster.pid").exists():
        own_postgres.start()
    name = new_database(own_postgres.admin_dsn)
    try:
        yield own_postgres.dsn(name)
    finally:
        if not (own_postgres.data / "postmaster.pid").exists():
            own_postgres.start()
        drop_database(own_postgres.admin_dsn, name)
