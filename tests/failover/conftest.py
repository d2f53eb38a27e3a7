"""Fixtures of the failover tests: no stray config files, a ``FakeClock`` shared by the client
and the fake upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from polygateway.testing import FakeClock, FakeUpstream


@pytest.fixture(autouse=True)
def _no_stray_config_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def fake(clock: FakeClock) -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(clock=clock) as server:
        yield server
