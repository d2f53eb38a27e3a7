"""The real clock. Tests inject ``polygateway.testing.FakeClock`` instead."""

from __future__ import annotations

import asyncio
import time


class SystemClock:
    """``time.monotonic`` / ``time.time`` / ``asyncio.sleep``."""

    __slots__ = ()

    # The C functions themselves, not Python methods wrapping them: every call reads the clock
    # several times.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
