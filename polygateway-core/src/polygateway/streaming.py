"""Stream liveness (ARCHITECTURE §7.6): TTFT, inter-token and total deadlines.

``StreamLiveness`` holds the three deadlines of one stream. Every wait for the next piece of
the stream runs inside ``with liveness:``; ``liveness.token()`` says that a token (for chat: a
content, reasoning or tool-call delta) arrived. The deadline in force for a wait is

- before the first token: ``started_at + ttft_s`` (the time to first token includes connecting
  and waiting for headers when those waits run under it too);
- after it: ``last token + inter_token_s``;
- always: ``started_at + total_s``;

and the earliest applicable one fires ``StreamLivenessTimeout(kind)`` (or the error a
``timeout_error`` factory builds: the non-streaming path reports its total deadline in its own
words). It is enforced like
``asyncio.timeout`` (``polygateway.deadlines.TaskDeadline``): the waiting task is cancelled and
the cancellation becomes the timeout only when it was ours alone; an outside cancellation
propagates and a ``TimeoutError`` raised by the awaited code passes through unchanged.

``CallDeadline`` is the total deadline alone, for a call that does not stream: the same
protocol and monitor, without the phases and the token bookkeeping (it runs on every call).

``LivenessWatchdog`` applies the same deadlines to any async iterator whose items are tokens,
and closes the iterator whenever iteration ends other than by yielding an item.

Cost: this runs on every read of every streamed call, so neither a wait nor a stream schedules
anything of its own. A ``LivenessMonitor`` (one per transport and event loop) keeps the open
streams and one loop timer, armed at the earliest deadline any of them announced. When it fires
it checks them all: streams past their deadline are expired (the waiting task is cancelled),
the others have usually moved their deadline on (tokens arrived, or the stream ended), and the
timer is re-armed at the earliest one left. Deadlines are never enforced late.

All times are the event loop's clock (``loop.time()``): the timer runs on it, so an injected
``Clock`` could not make these deadlines fire anyway.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Generic, Literal, Protocol, TypeVar

from polygateway.deadlines import TaskDeadline
from polygateway.errors import StreamLivenessTimeout

T = TypeVar("T")

LivenessKind = Literal["ttft", "inter_token", "total"]

_INF = math.inf


class TimeoutFactory(Protocol):
    """Builds the error a passed deadline raises (``StreamLivenessTimeout`` by default)."""

    def __call__(
        self, kind: LivenessKind, limit_s: float, *, source_name: str | None
    ) -> Exception: ...


def _check_limit(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


class StreamLiveness:
    """The TTFT / inter-token / total deadlines of one stream (create it inside the loop).

    After the stream, ``ttft_ms`` is the time from ``started_at`` to the first token and
    ``max_inter_token_ms`` the largest gap between consecutive tokens (``None`` until known).
    Call ``close()`` when the stream is over (it stops the timer; idempotent).
    """

    __slots__ = (
        "_deadline",
        "_first_deadline",
        "_inter_s",
        "_last",
        "_loop",
        "_monitor",
        "_owns_monitor",
        "_started",
        "_timeout_error",
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
        *,
        ttft_s: float | None = None,
        inter_token_s: float | None = None,
        total_s: float | None = None,
        started_at: float | None = None,
        source_name: str | None = None,
        monitor: LivenessMonitor | None = None,
        timeout_error: TimeoutFactory = StreamLivenessTimeout,
    ) -> None:
        # Checked only when set: streams usually set one or two of the three.
        self.ttft_s = ttft_s if ttft_s is None else _check_limit("ttft_s", ttft_s)
        self._inter_s = (
            inter_token_s if inter_token_s is None else _check_limit("inter_token_s", inter_token_s)
        )
        self.total_s = total_s if total_s is None else _check_limit("total_s", total_s)
        self.source_name = source_name
        self._loop = loop = asyncio.get_running_loop()
        self._started = started = loop.time() if started_at is None else started_at
        self._first_deadline = started + self.ttft_s if self.ttft_s is not None else _INF
        self._total_deadline = started + self.total_s if self.total_s is not None else _INF
        self._last: float | None = None
        self._owns_monitor = monitor is None
        if monitor is None:
            monitor = LivenessMonitor()
        elif monitor.loop is not loop:
            raise RuntimeError("the liveness monitor belongs to another event loop")
        self._monitor = monitor
        self._deadline = TaskDeadline()
        self._timeout_error = timeout_error
        self.tokens = 0
        self.ttft_ms: float | None = None
        self.max_inter_token_ms: float | None = None

    @property
    def inter_token_s(self) -> float | None:
        return self._inter_s

    def _current(self) -> tuple[float, LivenessKind]:
        """The deadline in force for the next wait, and which limit it comes from."""
        kind: LivenessKind
        if self._last is None:
            phase, kind = self._first_deadline, "ttft"
        elif self._inter_s is not None:
            phase, kind = self._last + self._inter_s, "inter_token"
        else:
            phase, kind = _INF, "inter_token"
        if self._total_deadline <= phase:
            return self._total_deadline, "total"
        return phase, kind

    def _timeout(self, kind: LivenessKind) -> Exception:
        limit = {"ttft": self.ttft_s, "inter_token": self._inter_s, "total": self.total_s}[kind]
        return self._timeout_error(
            kind, limit if limit is not None else 0.0, source_name=self.source_name
        )

    def _expire_at(self, now: float) -> float:
        """The monitor's check: expire when the deadline has passed (``inf`` then, or when no
        deadline applies), else the deadline to check again at."""
        deadline, _ = self._current()
        if deadline <= now:
            # Cancel the wait in progress; ``__exit__`` turns the cancellation into the timeout.
            # When nobody is waiting, the next wait sees the passed deadline on entry.
            self._deadline.expire()
            return _INF
        return deadline

    def __enter__(self) -> StreamLiveness:
        """A wait starts under the deadline in force: ``with liveness: await ...``.

        Raises the timeout at once when that deadline has passed already. A plain (not async)
        context manager on purpose: it costs two method calls where a wrapping coroutine or
        ``async with`` would cost coroutine frames, and this runs on every chunk.
        """
        deadline, kind = self._current()
        if deadline != _INF:
            if self._loop.time() >= deadline:
                raise self._timeout(kind)
            self._monitor.watch(self, deadline)
        self._deadline.enter(self._loop)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """The wait ended: a cancellation that was the deadline's alone becomes the timeout;
        anything else passes through unchanged."""
        if self._deadline.exit(exc_type):
            raise self._timeout(self._current()[1]) from None

    def token(self) -> None:
        """A token arrived now."""
        now = self._loop.time()
        last = self._last
        if last is None:
            self.ttft_ms = (now - self._started) * 1000.0
        else:
            gap_ms = (now - last) * 1000.0
            if self.max_inter_token_ms is None or gap_ms > self.max_inter_token_ms:
                self.max_inter_token_ms = gap_ms
        self._last = now
        self.tokens += 1

    def close(self) -> None:
        """The stream is over: no deadline applies any more (idempotent)."""
        self._monitor.forget(self)
        if self._owns_monitor:
            self._monitor.close()


class CallDeadline(TaskDeadline):
    """The one (total) deadline of every wait of a call that does not stream: ``started_at +
    total_s``, enforced like ``StreamLiveness``'s by the transport's ``monitor`` (of the
    running loop). ``with deadline: await ...`` around each wait; ``close()`` at the end.
    A passed deadline raises what ``timeout_error`` builds (``kind`` ``"total"``)."""

    __slots__ = ("_at", "_loop", "_monitor", "_timeout_error", "source_name", "total_s")

    def __init__(
        self,
        total_s: float,
        started_at: float,
        monitor: LivenessMonitor,
        source_name: str | None = None,
        timeout_error: TimeoutFactory = StreamLivenessTimeout,
    ) -> None:
        super().__init__()
        if not total_s > 0:  # also refuses NaN
            raise ValueError(f"total_s must be a positive number of seconds, got {total_s!r}")
        loop = monitor.loop
        if loop is not asyncio.get_running_loop():
            raise RuntimeError("the liveness monitor belongs to another event loop")
        self.total_s = total_s
        self.source_name = source_name
        self._at = started_at + total_s
        self._loop = loop
        self._monitor = monitor
        self._timeout_error = timeout_error

    def _timeout(self) -> Exception:
        return self._timeout_error("total", self.total_s, source_name=self.source_name)

    def _expire_at(self, now: float) -> float:
        """As ``StreamLiveness._expire_at``."""
        if self._at <= now:
            self.expire()
            return _INF
        return self._at

    def __enter__(self) -> CallDeadline:
        if self._loop.time() >= self._at:
            raise self._timeout()
        self._monitor.watch(self, self._at)
        self.enter(self._loop)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.exit(exc_type):
            raise self._timeout() from None

    def close(self) -> None:
        """The call is over: the deadline no longer applies (idempotent)."""
        self._monitor.forget(self)


class _Watched(Protocol):
    """What a ``LivenessMonitor`` checks: ``StreamLiveness`` and ``CallDeadline``."""

    def _expire_at(self, now: float) -> float: ...


class LivenessMonitor:
    """Enforces the deadlines of the open streams of one event loop with one loop timer.

    Create it inside the loop; a transport keeps one and hands it to each ``StreamLiveness``.
    ``close()`` (when the owner closes) cancels the timer.
    """

    __slots__ = ("_open", "_timer", "armed_at", "loop")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._open: set[_Watched] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.armed_at = _INF
        """When the timer fires next (``inf``: not armed)."""

    def watch(self, liveness: _Watched, deadline: float) -> None:
        """Check ``liveness`` no later than ``deadline`` (its deadline in force now)."""
        self._open.add(liveness)
        if deadline < self.armed_at:
            if self._timer is not None:
                self._timer.cancel()
            self.armed_at = deadline
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def forget(self, liveness: _Watched) -> None:
        # The timer stays armed: when it fires with nothing open it simply stops. Cancelling
        # it here would cost a timer per call whenever calls run one at a time.
        self._open.discard(liveness)

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def _on_timer(self) -> None:
        self._timer = None
        self.armed_at = _INF
        now = self.loop.time()
        earliest = _INF
        for liveness in list(self._open):
            deadline = liveness._expire_at(now)
            if deadline < earliest:
                earliest = deadline
        if earliest < _INF:
            self.armed_at = earliest
            self._timer = self.loop.call_at(earliest, self._on_timer)

    def close(self) -> None:
        """Cancel the timer (idempotent); open streams are left to their own waits."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self.armed_at = _INF


class LivenessWatchdog(Generic[T]):
    """An async iterator that forwards ``source`` under ``StreamLiveness`` deadlines, every
    item counting as a token. ``ttft_ms``, ``max_inter_token_ms`` and ``tokens`` as there.
    Always ``await aclose()`` (or exhaust the iterator) when done early.
    """

    __slots__ = ("_closed", "_source", "liveness")

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
        self.liveness = StreamLiveness(
            ttft_s=ttft_s,
            inter_token_s=inter_token_s,
            total_s=total_s,
            started_at=started_at,
            source_name=source_name,
        )
        self._source = source
        self._closed = False

    @property
    def ttft_ms(self) -> float | None:
        return self.liveness.ttft_ms

    @property
    def max_inter_token_ms(self) -> float | None:
        return self.liveness.max_inter_token_ms

    @property
    def tokens(self) -> int:
        return self.liveness.tokens

    def __aiter__(self) -> LivenessWatchdog[T]:
        return self

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        completed = False
        try:
            with self.liveness:
                item = await self._source.__anext__()
            self.liveness.token()
            completed = True
            return item
        finally:
            if not completed:
                # Exhausted, timed out, failed or cancelled: release what the source holds.
                await self.aclose()

    async def aclose(self) -> None:
        """Stop the timer and close the wrapped iterator (idempotent)."""
        self.liveness.close()
        if self._closed:
            return
        self._closed = True
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


__all__ = [
    "CallDeadline",
    "LivenessKind",
    "LivenessMonitor",
    "LivenessWatchdog",
    "StreamLiveness",
    "TimeoutFactory",
]
