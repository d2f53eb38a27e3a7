"""Shared fixtures: real services, skipped on a laptop without them, required in CI."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator

import pytest
from polygateway.testing.services import require_service as shared_require_service

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
POSTGRES_HOST, POSTGRES_PORT = "127.0.0.1", 5432


def services_required() -> bool:
    return os.environ.get("PGW_REQUIRE_SERVICES") == "1"


def require_service(name: str, host: str, port: int) -> None:
    """Skip when the service is down, unless PGW_REQUIRE_SERVICES=1 (then fail)."""
    shared_require_service(name, host, port, required=services_required())


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


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """The collector off (so nothing is freed behind the test's back), on again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
