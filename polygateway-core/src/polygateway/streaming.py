"""Stream liveness watchdog (ARCHITECTURE §7.6): TTFT, inter-token and total deadlines.

``LivenessWatchdog`` wraps any async iterator whose items are tokens (for chat: "a content or
reasoning delta arrived") and bounds each ``__anext__``:

- before the first item: ``started_at + ttft_s`` (the time to first token includes connecting
  and waiting for headers when the wrapped iterator does that on its first step);
- after it: ``last_item + inter_token_s``;
- always: ``started_at + total_s``.

The earliest applicable deadline fires ``StreamLivenessTimeout(kind)``. The cancellation that
enforces it comes from ``asyncio.timeout``; ``expired()`` tells our deadline apart from a
``TimeoutError`` raised upstream, which passes through unchanged. Outside cancellation always
propagates. Whenever iteration ends other than by yielding an item (exhaustion, timeout,
error, cancellation) the wrapped iterator is closed, so the HTTP response behind it is released.

Cost: a stream yields many items, so the wrapper does not schedule a timer per item. Each
``__anext__`` enters ``asyncio.timeout(None)`` (no timer) and one loop timer per stream is armed
at the current deadline; when it fires it re-checks (tokens may have moved the deadline) and
either re-arms or expires the active ``asyncio.timeout`` through ``reschedule``.

All times are the event loop's clock (``loop.time()``): ``asyncio.timeout`` runs on it, so an
injected ``Clock`` could not make these deadlines fire anyway.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Generic, Literal, TypeVar

from polygateway.errors import StreamLivenessTimeout

T = TypeVar("T")

LivenessKind = Literal["ttft", "inter_token", "total"]


def _check_limit(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not value > 0 or math.isnan(value):
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


class LivenessWatchdog(Generic[T]):
    """An async iterator that forwards ``source`` under TTFT / inter-token / total deadlines.

    After iteration, ``ttft_ms`` is the time from ``started_at`` to the first item and
    ``max_inter_token_ms`` the largest gap between consecutive items (``None`` until known).
    Always ``await aclose()`` (or exhaust the iterator) when done early.
    """

    __slots__ = (
        "_active",
        "_closed",
        "_first_deadline",
        "_inter_s",
        "_last",
        "_loop",
        "_source",
        "_started",
        "_timer",
        "_timer_when",
        "_total_deadline",
        "max_inter_token_ms",
        "source_name",
        "tokens",
        "total_s",
        "ttft_ms",
        "ttft_s",
    )

    def __init__(
        self,
        source: AsyncIterator[T],
        *,
        ttft_s: float | None = None,
        inter_token_s: float | None = None,
        total_s: float | None = None,
        started_at: float | None = None,
        source_name: str | None = None,
    ) -> None:
        self._source = source
        self.ttft_s = _check_limit("ttft_s", ttft_s)
        self._inter_s = _check_limit("inter_token_s", inter_token_s)
        self.total_s = _check_limit("total_s", total_s)
        self.source_name = source_name
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time() if started_at is None else started_at
        inf = math.inf
        self._first_deadline = self._started + self.ttft_s if self.ttft_s is not None else inf
        self._total_deadline = self._started + self.total_s if self.total_s is not None else inf
        self._last: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = inf
        self._active: asyncio.Timeout | None = None
        self._closed = False
        self.tokens = 0
        self.ttft_ms: float | None = None
        self.max_inter_token_ms: float | None = None

    @property
    def inter_token_s(self) -> float | None:
        return self._inter_s

    def _deadline(self) -> tuple[float, LivenessKind]:
        """The deadline in force for the next item, and which limit it comes from."""
        kind: LivenessKind
        if self._last is None:
            phase, kind = self._first_deadline, "ttft"
        elif self._inter_s is not None:
            phase, kind = self._last + self._inter_s, "inter_token"
        else:
            phase, kind = math.inf, "inter_token"
        if self._total_deadline <= phase:
            return self._total_deadline, "total"
        return phase, kind

    def _limit_s(self, kind: LivenessKind) -> float:
        limit = {"ttft": self.ttft_s, "inter_token": self._inter_s, "total": self.total_s}[kind]
        return limit if limit is not None else 0.0

    def _timeout(self, kind: LivenessKind) -> StreamLivenessTimeout:
        return StreamLivenessTimeout(kind, self._limit_s(kind), source_name=self.source_name)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_when = math.inf
        deadline, _ = self._deadline()
        if deadline == math.inf:
            return
        if self._loop.time() < deadline:
            # Items arrived since the timer was armed: the deadline moved on.
            self._arm(deadline)
            return
        active = self._active
        if active is not None:
            # Expire the active asyncio.timeout now: it cancels the waiting task and turns the
            # cancellation into TimeoutError with expired() set. When nobody is waiting the next
            # __anext__ sees the passed deadline itself.
            active.reschedule(self._loop.time())

    def __aiter__(self) -> LivenessWatchdog[T]:
        return self

    async def __anext__(self) -> T:
        completed = False
        try:
            if self._closed:
                raise StopAsyncIteration
            loop = self._loop
            deadline, kind = self._deadline()
            if deadline != math.inf:
                if loop.time() >= deadline:
                    raise self._timeout(kind)
                if deadline < self._timer_when:
                    self._arm(deadline)
            timeout = asyncio.timeout(None)
            try:
                async with timeout:
                    self._active = timeout
                    try:
                        item = await self._source.__anext__()
                    finally:
                        self._active = None
            except TimeoutError:
                if timeout.expired():
                    raise self._timeout(self._deadline()[1]) from None
                raise
            now = loop.time()
            last = self._last
            if last is None:
                self.ttft_ms = (now - self._started) * 1000.0
            else:
                gap_ms = (now - last) * 1000.0
                if self.max_inter_token_ms is None or gap_ms > self.max_inter_token_ms:
                    self.max_inter_token_ms = gap_ms
            self._last = now
            self.tokens += 1
            completed = True
            return item
        finally:
            if not completed:
                # Exhausted, timed out, failed or cancelled: release what the source holds.
                await self.aclose()

    async def aclose(self) -> None:
        """Stop the timer and close the wrapped iterator (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_when = math.inf
        if self._closed:
            return
        self._closed = True
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def watch(
    source: AsyncIterator[T],
    *,
    ttft_s: float | None = None,
    inter_token_s: float | None = None,
    total_s: float | None = None,
    started_at: float | None = None,
    source_name: str | None = None,
) -> LivenessWatchdog[T]:
    """Wrap ``source`` in a ``LivenessWatchdog`` (must be called inside a running loop)."""
    return LivenessWatchdog(
        source,
        ttft_s=ttft_s,
        inter_token_s=inter_token_s,
        total_s=total_s,
        started_at=started_at,
        source_name=source_name,
    )


__all__ = ["LivenessKind", "LivenessWatchdog", "watch"]
