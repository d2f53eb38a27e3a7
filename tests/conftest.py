"""Shared fixtures: real services, skipped on a laptop without them, required in CI."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
POSTGRES_HOST, POSTGRES_PORT = "127.0.0.1", 5432


def services_required() -> bool:
    return os.environ.get("PGW_REQUIRE_SERVICES") == "1"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip when the service is down, unless PGW_REQUIRE_SERVICES=1 (then fail)."""
    if _reachable(host, port):
        return
    message = f"{name} is not reachable on {host}:{port}"
    if services_required():
        pytest.fail(f"{message} and PGW_REQUIRE_SERVICES=1")
    pytest.skip(message)


@pytest.fixture
def redis_url() -> str:
    """URL of the machine's Redis (database 3, reserved for tests)."""
    require_service("Redis", REDIS_HOST, REDIS_PORT)
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/3"


@pytest.fixture
def postgres_dsn() -> Iterator[str]:
    """DSN of a fresh database of its own, dropped afterwards."""
    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    import asyncio

    import asyncpg

    name = f"pgw_test_{uuid.uuid4().hex[:12]}"
    admin = f"postgresql://postgres@{POSTGRES_HOST}:{POSTGRES_PORT}/postgres"

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(admin, timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@{POSTGRES_HOST}:{POSTGRES_PORT}/{name}"
    finally:
        asyncio.run(run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def unique_scope() -> str:
    """A scope name no other test uses (isolates shared Redis state)."""
    return f"T{uuid.uuid4().hex[:10]}"
