"""The telemetry recorder contract suite, unchanged, on PostgreSQL: through a DSN and a pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import asyncpg
import pytest
from pgw_postgres import PostgresRecorder
from pgw_postgres_test_helpers import fetch_rows
from polygateway.testing.contracts.telemetry import TelemetryRecorderContract

pytestmark = pytest.mark.postgres

RowReader = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


def _reader(dsn: str) -> RowReader:
    async def read() -> Sequence[Mapping[str, Any]]:
        return await fetch_rows(dsn)

    return read


class TestPostgresRecorderContract(TelemetryRecorderContract):
    @pytest.fixture
    def make_recorder(self, postgres_dsn: str) -> Callable[[], PostgresRecorder]:
        # Small batches and a short interval keep the batching honest without slowing tests.
        return lambda: PostgresRecorder(postgres_dsn, batch_size=64, flush_interval_s=0.05)

    @pytest.fixture
    def read_rows(self, postgres_dsn: str) -> RowReader:
        return _reader(postgres_dsn)


class TestPostgresRecorderOnAPoolContract(TelemetryRecorderContract):
    @pytest.fixture
    async def pool(self, postgres_dsn: str) -> AsyncIterator[asyncpg.Pool]:
        pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=2)
        try:
            yield pool
        finally:
            await pool.close()

    @pytest.fixture
    def make_recorder(self, pool: asyncpg.Pool) -> Callable[[], PostgresRecorder]:
        return lambda: PostgresRecorder(pool=pool, batch_size=64, flush_interval_s=0.05)

    @pytest.fixture
    def read_rows(self, postgres_dsn: str) -> RowReader:
        return _reader(postgres_dsn)
