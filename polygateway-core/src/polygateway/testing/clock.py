"""A deterministic clock for tests: time moves only when the test (or ``sleep``) moves it."""

from __future__ import annotations

import asyncio
import math


class FakeClock:
    """Implements ``polygateway.ports.Clock`` without ever waiting.

    ``monotonic()`` and ``time()`` advance together. ``time()`` starts at ``wall_start``
    (default: ``start``), so with the default ``start=1000.0`` the first per-minute window
    ends at 1020.0. ``sleep(s)`` advances the clock by ``s`` and yields to the event loop
    once, so code with backoff or polling runs instantly and deterministically.
    """

    __slots__ = ("_monotonic", "_wall_offset")

    def __init__(self, start: float = 1000.0, *, wall_start: float | None = None) -> None:
        if not math.isfinite(start):
            raise ValueError(f"FakeClock start must be finite, got {start!r}")
        if wall_start is not None and not math.isfinite(wall_start):
            raise ValueError(f"FakeClock wall_start must be finite, got {wall_start!r}")
        self._monotonic = float(start)
        self._wall_offset = 0.0 if wall_start is None else float(wall_start) - self._monotonic

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._monotonic + self._wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward. Going backwards is refused: ``monotonic`` never decreases."""
        if not seconds >= 0.0 or math.isinf(seconds):  # also rejects NaN
            raise ValueError(f"FakeClock.advance needs a finite duration >= 0, got {seconds!r}")
        self._monotonic += seconds

    async def sleep(self, seconds: float) -> None:
        """Advance by ``seconds`` (negative counts as 0, like ``asyncio.sleep``), yield once."""
        if seconds > 0.0:
            self.advance(seconds)
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"FakeClock(monotonic={self._monotonic!r}, time={self.time()!r})"
