"""The real clock. Tests inject ``polygateway.testing.FakeClock`` instead."""

from __future__ import annotations

import asyncio
import time


class SystemClock:
    """``time.monotonic`` / ``time.time`` / ``asyncio.sleep``."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
