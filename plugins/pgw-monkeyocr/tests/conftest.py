"""Fixtures of the pgw-monkeyocr suite: transports pointed at the fake MonkeyOCR server.

``fake_monkeyocr`` comes from the package's own pytest plugin (entry point ``pytest11``), the
same fixture downstream projects use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pgw_monkeyocr.testing import FakeMonkeyOcr
from pgw_monkeyocr.transport import MonkeyOcrTransport
from pgw_monkeyocr_test_helpers import MakeTransport, monkey_source


@pytest.fixture
async def make_transport(fake_monkeyocr: FakeMonkeyOcr) -> AsyncIterator[MakeTransport]:
    """``make_transport(source="a", **options)``: a transport on fake source ``source``,
    closed after the test. ``timeout_s=`` and other ``SourceConfig`` fields go in ``fields``."""
    made: list[MonkeyOcrTransport] = []

    def make(
        source: str = "a", *, fields: dict[str, Any] | None = None, **options: Any
    ) -> MonkeyOcrTransport:
        transport = MonkeyOcrTransport(
            monkey_source(
                fake_monkeyocr.base_url(source),
                name=f"monkey-{source}",
                options=options,
                **(fields or {}),
            )
        )
        made.append(transport)
        return transport

    yield make
    for transport in made:
        await transport.aclose()
