"""A bounded buffer drained in batches by a thread of its own, like the SDK's batch processor.

The call path only ``offer``s an item: one ``deque`` append, refused (``False``, the caller
counts the drop) when ``max_queue`` items wait, and a wake-up only when a full batch waits.
The thread hands batches of at most ``batch_size`` items to ``handle`` every ``delay_s`` (or
sooner when a batch is full), calls ``tick`` every ``tick_s`` (periodic metric export), and
on ``flush`` drains everything, calls ``tick`` and answers. ``handle`` and ``tick`` must
not raise (the recorder guards them); a slow one only lets items wait or be dropped.
"""

from __future__ import annotations

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
        name: str = "pgw-otel-export",
    ) -> None:
        self._handle = handle
        self._tick = tick
        self._items: deque[Item] = deque()
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._delay_s = delay_s
        self._tick_s = tick_s
        self._wake = threading.Event()
        self._flushes: deque[threading.Event] = deque()
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
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._flushes.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        next_tick = time.monotonic() + self._tick_s
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            flushes = []
            while self._flushes:
                flushes.append(self._flushes.popleft())
            self._drain()
            now = time.monotonic()
            if flushes or self._stopping or now >= next_tick:
                self._tick()
                next_tick = now + self._tick_s
            for done in flushes:
                done.set()
            if self._stopping:
                return

    def _drain(self) -> None:
        items = self._items
        while items:
            batch: list[Item] = []
            while items and len(batch) < self._batch_size:
                batch.append(items.popleft())
            self._handle(batch)
