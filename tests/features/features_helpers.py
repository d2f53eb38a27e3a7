"""Builders shared by the cache / telemetry / structured feature tests.

Every test goes through ``GatewayClient`` and the fake upstream: what the library sends is
read back from the fake's counters and received bodies, what it records from the SQLite file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
from polygateway.client import GatewayClient
from polygateway.settings import (
    BackpressureSettings,
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
)
from polygateway.telemetry.pricing import PricingTable
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeUpstream

PRICES = {
    "model-a": {"input_per_1m": 2.0, "output_per_1m": 8.0},
    "model-b": {"input_per_1m": 1.0, "output_per_1m": 3.0},
}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def source(fake: FakeUpstream, name: str = "a", **overrides: Any) -> SourceConfig:
    values: dict[str, Any] = {
        "name": name,
        "provider": "generic",
        "base_url": fake.base_url(name),
        "model": f"model-{name}",
        "api_key": Secret(f"sk-test-{name}"),
        "timeout_s": 10.0,
        "est_tokens": 50,
    }
    values.update(overrides)
    return SourceConfig(**values)


def scope(
    fake: FakeUpstream,
    *sources: SourceConfig,
    cache: str = "memory",
    namespace: str | None = "tenant-1",
    ttl_s: float | None = 300.0,
    **overrides: Any,
) -> ScopeSettings:
    values: dict[str, Any] = {
        "scope": "LLM",
        "sources": sources or (source(fake),),
        "retry": RetrySettings(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0),
        "backpressure": BackpressureSettings(quota_full="fail_fast"),
        "cache": CacheSettings(backend=cache, namespace=namespace, ttl_s=ttl_s),
    }
    values.update(overrides)
    return ScopeSettings(**values)


@dataclass
class Rig:
    client: GatewayClient
    recorder: SQLiteRecorder
    db: Path

    async def rows(self) -> list[dict[str, Any]]:
        """Every telemetry row so far, oldest first."""
        await self.recorder.flush()
        return read_rows(self.db)


class RigFactory(Protocol):
    def __call__(
        self,
        tmp_path: Path,
        settings: ScopeSettings,
        *,
        prices: Mapping[str, Mapping[str, float]] | None = PRICES,
        **injected: Any,
    ) -> Rig: ...


@pytest.fixture(name="make_rig")
async def make_rig_fixture() -> AsyncIterator[RigFactory]:
    """Builds clients with an injected SQLite recorder; closes the recorders afterwards (a
    client never closes what it was given)."""
    recorders: list[SQLiteRecorder] = []

    def make(
        tmp_path: Path,
        settings: ScopeSettings,
        *,
        prices: Mapping[str, Mapping[str, float]] | None = PRICES,
        **injected: Any,
    ) -> Rig:
        tmp_path.mkdir(parents=True, exist_ok=True)
        db = tmp_path / "telemetry.db"
        recorder = SQLiteRecorder(str(db), flush_interval_s=0.05)
        recorders.append(recorder)
        client = GatewayClient(
            settings,
            telemetry=recorder,
            pricing=PricingTable(prices) if prices is not None else None,
            **injected,
        )
        return Rig(client, recorder, db)

    try:
        yield make
    finally:
        for recorder in recorders:
            await recorder.aclose()


def read_rows(db: Path) -> list[dict[str, Any]]:
    if not db.exists():
        return []
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        try:
            return [
                dict(r) for r in conn.execute("SELECT * FROM pgw_calls ORDER BY created_at, rowid")
            ]
        except sqlite3.OperationalError:  # not created yet: no row was ever written
            return []


def cost(
    prices: Mapping[str, Mapping[str, float]], model: str, prompt: int, completion: int
) -> float:
    price = prices[model]
    return prompt / 1e6 * price["input_per_1m"] + completion / 1e6 * price["output_per_1m"]
