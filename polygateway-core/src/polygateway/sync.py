"""A synchronous facade for legacy code: ``SyncGatewayClient`` runs a ``GatewayClient`` on a
private event loop in a background thread.

::

    from polygateway.sync import SyncGatewayClient

    with SyncGatewayClient.from_env() as client:
        print(client.chat([{"role": "user", "content": "Hello"}]).content)

The client (its HTTP sessions, limiter, telemetry) lives on the private loop; each call is
handed to it and the calling thread waits for the result. Several threads may call at once
(the calls run concurrently on the loop, under the same governance). ``close()`` closes the
client and stops the loop; a client left open is closed when it is garbage-collected or at
interpreter exit, so no "Unclosed client session" warning is left behind. An interrupt
(``KeyboardInterrupt``) while waiting cancels the call on the loop.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar, Unpack

from polygateway.client import ChatOptions, GatewayClient, ModelT, StructuredArg
from polygateway.errors import ClientClosedError
from polygateway.types import LLMResponse, Message

__all__ = ["SyncGatewayClient"]

T = TypeVar("T")


class _Runner:
    """The private loop and its thread (kept apart from the facade so that the finalizer
    does not keep the facade alive)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.client: GatewayClient | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="polygateway-sync", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        if self.closed:
            raise ClientClosedError("this SyncGatewayClient is closed")

        async def call() -> T:
            return await make()

        future: Future[T] = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result()
        finally:
            if not future.done():  # interrupted while waiting: cancel the call on the loop
                future.cancel()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        client = self.client
        try:
            if client is not None and self.thread.is_alive():
                asyncio.run_coroutine_threadsafe(client.aclose(), self.loop).result()
        finally:
            if self.thread.is_alive():
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join()
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


class SyncGatewayClient:
    """``GatewayClient`` with blocking methods (see the module docstring)."""

    __slots__ = ("__weakref__", "_finalizer", "_runner")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The arguments of ``GatewayClient(...)``; the client is built on the private loop."""
        self._start(lambda: GatewayClient(*args, **kwargs))

    @classmethod
    def from_env(cls, **kwargs: Any) -> SyncGatewayClient:
        """``GatewayClient.from_env(**kwargs)`` on the private loop."""
        made = cls.__new__(cls)
        made._start(lambda: GatewayClient.from_env(**kwargs))
        return made

    def _start(self, factory: Callable[[], GatewayClient]) -> None:
        self._runner = _Runner()
        self._finalizer = weakref.finalize(self, self._runner.close)

        async def build() -> GatewayClient:  # on the loop: sessions bind to it
            return factory()

        try:
            self._runner.client = self._runner.run(build)
        except Exception:
            self._finalizer()
            raise

    @property
    def client(self) -> GatewayClient:
        """The asynchronous client (use it only on its own loop)."""
        client = self._runner.client
        if client is None:  # pragma: no cover - set by the constructors
            raise ClientClosedError("this SyncGatewayClient has no client")
        return client

    def chat(
        self,
        messages: Sequence[Message],
        *,
        structured: StructuredArg[ModelT] = None,
        stream: bool = True,
        **options: Unpack[ChatOptions],
    ) -> LLMResponse[ModelT]:
        """``GatewayClient.chat`` (same keywords, typed the same), waiting for the result."""
        client = self.client
        return self._runner.run(
            lambda: client.chat(messages, structured=structured, stream=stream, **options)
        )

    def close(self) -> None:
        """Close the client and stop the private loop. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._runner.closed

    def __enter__(self) -> SyncGatewayClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncGatewayClient {'closed' if self.closed else 'open'}>"
