"""Fixtures of the pgw-otel suite."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from otel_test_helpers import OtlpReceiver, Sdk


@pytest.fixture
def sdk() -> Sdk:
    return Sdk()


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    found = OtlpReceiver()
    await found.start()
    try:
        yield found
    finally:
        await found.stop()
