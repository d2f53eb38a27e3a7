"""A bounded buffer drained in batches by a thread of its own, like the SDK's batch processor.

The call path only ``offer``s an item: one ``deque`` append, refused (``False``, the caller
counts the drop) when ``max_queue`` items wait, and a wake-up only when a full batch waits.
The thread hands batches of at most ``batch_size`` items to ``handle`` every ``delay_s`` (or
sooner when a batch is full), calls ``tick`` every ``tick_s`` (periodic metric export), and
on ``flush`` drains what was offered before, calls ``tick`` and answers. Each turn hands on at
most the items that waited when it began, so under steady load (items offered while
``handle`` runs) the thread still ticks and answers flushes every turn. ``handle`` and
``tick`` must not raise (the recorder guards them); a slow one only lets items wait or be
dropped. On ``shutdown`` the thread refuses new items, drains, ticks, then calls ``close``
itself, so what ``handle`` and ``tick`` use is only ever touched from the thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BatchThread"]

Item = TypeVar("Item")


class BatchThread(Generic[Item]):
    """See the module docstring. ``start()`` once; ``shutdown()`` drains, ticks and joins."""

    def __init__(
        self,
        handle: Callable[[list[Item]], None],
        tick: Callable[[], None],
        *,
        max_queue: int = 4096,
        batch_size: int = 256,
        delay_s: float = 1.0,
        tick_s: float = 30.0,
        close: Callable[[], None] | None = None,
        name: str = "pgw-otel-export",
    ) -> None:
        self._handle = handle
        self._tick = tick
        self._close = close
        self._items: deque[Item] = deque()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._delay_s = delay_s
        self._tick_s = tick_s
        self._wake = threading.Event()
        self._flushes: deque[Callable[[], None]] = deque()
        """What to call once the turn that answers a flush is done."""
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, item: Item) -> bool:
        items = self._items
        if len(items) >= self._max_queue:
            return False
        items.append(item)
        if len(items) == self._batch_size:
            self._wake.set()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait (blocking) until what was offered before is handled and ``tick`` ran."""
        done = threading.Event()
        return self.request_flush(done.set) and done.wait(timeout_s)

    def request_flush(self, done: Callable[[], None]) -> bool:
        """``flush`` without waiting: the thread calls ``done`` (it must not block) once what
        was offered before is handled and ``tick`` ran. ``False``: the thread is not running
        and ``done`` will not be called."""
        if not self._thread.is_alive():
            return False
        self._flushes.append(done)
        self._wake.set()
        return True

    def stop_intake(self) -> None:
        """``offer`` refuses from now on. Call it from the thread that offers, so that no item
        lands after the last drain; ``shutdown`` calls it too."""
        self._max_queue = 0  # offer's own bound: no extra check on the call path

    def shutdown(self, timeout_s: float) -> bool:
        """Refuse new items, drain, tick, ``close``, and wait up to ``timeout_s`` for that.
        ``False``: the thread still runs (a slow ``handle``) and finishes on its own."""
        self.stop_intake()
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        next_tick = time.monotonic() + self._tick_s
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            stopping = self._stopping
            flushes = []
            while self._flushes:
                flushes.append(self._flushes.popleft())
            # Intake is closed once stopping: the whole queue is finite.
            self._drain(len(self._items) if not stopping else None)
            now = time.monotonic()
            if flushes or stopping or now >= next_tick:
                self._tick()
                next_tick = now + self._tick_s
            if stopping:
                if self._close is not None:
                    self._close()
                while self._flushes:  # asked while the last turn ran: answered, not lost
                    flushes.append(self._flushes.popleft())
            for done in flushes:
                with contextlib.suppress(Exception):  # a waiter gone (its loop closed)
                    done()
            if stopping:
                return

    def _drain(self, limit: int | None) -> None:
        """Hand on ``limit`` items (those waiting when the turn began), or all (``None``)."""
        items = self._items
        left = limit
        while items and (left is None or left > 0):
            size = min(self._batch_size, len(items), self._batch_size if left is None else left)
            batch = [items.popleft() for _ in range(size)]
            if left is not None:
                left -= size
            self._handle(batch)
