"""A test server on an event loop of its own, in a daemon thread.

So that one server serves sync tests and async tests on any event loop alike (the fake
upstream, plugins' fake services).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

__all__ = ["serve_in_thread"]


@contextmanager
def serve_in_thread(
    start: Callable[[], Awaitable[object]],
    stop: Callable[[], Awaitable[object]],
    *,
    name: str,
) -> Iterator[asyncio.AbstractEventLoop]:
    """Run ``start()`` on a new loop in a daemon thread named ``name`` and yield the loop once
    it returned (what it raised is raised here). Leaving the block runs ``stop()`` on that
    loop, cancels whatever still runs there, closes the loop and joins the thread."""
    loop = asyncio.new_event_loop()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    try:
        # .result() returns once the server listens, or raises why it could not.
        asyncio.run_coroutine_threadsafe(_awaited(start), loop).result()
        try:
            yield loop
        finally:
            asyncio.run_coroutine_threadsafe(_awaited(stop), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


async def _awaited(step: Callable[[], Awaitable[object]]) -> None:
    await step()
