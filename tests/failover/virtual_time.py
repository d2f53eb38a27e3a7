"""An event loop on virtual time: when nothing is ready, time jumps to the next timer.

The stream watchdog's timers are the loop's own (``loop.call_at``), so a scenario that waits
30 s for a silent upstream runs in milliseconds here, and its durations are exact. Real I/O
still works: the fake upstream runs on the same loop over loopback, where a write is readable
at once, and time only jumps when a real poll found nothing to do and no executor job is
running.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_REAL_POLL_S = 0.01
"""How long a poll waits for real I/O before time may jump: loopback delivery is immediate,
but on a busy machine the kernel may take a few milliseconds to complete a connect."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return super().select(0)
        events = super().select(_REAL_POLL_S)
        if events or self._loop.busy_executor_jobs:
            return events
        if timeout is not None:
            self._loop.jump(max(0.0, timeout - _REAL_POLL_S))
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is real time plus every jump made while idle."""

    def __init__(self) -> None:
        super().__init__(_JumpingSelector(self))
        self._offset = 0.0
        self.busy_executor_jobs = 0

    def time(self) -> float:
        return super().time() + self._offset

    def jump(self, seconds: float) -> None:
        self._offset += seconds

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        # A job in a thread finishes in real time: never jump past it.
        self.busy_executor_jobs += 1
        future = super().run_in_executor(executor, func, *args)

        def done(_: asyncio.Future[T] | Future[T]) -> None:
            self.busy_executor_jobs -= 1

        future.add_done_callback(done)
        return future


class LoopClock:
    """``ports.Clock`` on the running loop's time (virtual on a ``VirtualTimeLoop``)."""

    __slots__ = ()

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
