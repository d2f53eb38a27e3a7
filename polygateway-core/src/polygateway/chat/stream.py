"""``GatewayClient.stream``: the deltas of one governed chat call as they arrive.

The call is the same ``chat()`` call (the same onion: telemetry, cache, structured, the
governor's selection, breaker, permit, watchdog, settle on the real usage), run as a task;
the transport hands each parsed delta to this object through ``CallContext.stream`` and the
consumer iterates them. Rules:

- before the first delta reaches the consumer, a failed attempt retries / switches sources as
  ``chat()`` does (nothing was shown);
- after it, a failed attempt ends the stream with ``TransientError`` (the caller already showed
  text), unless ``restart_on_cut=True``: then the next attempt starts from scratch after a
  ``StreamDelta("restart")`` marker;
- an answer that arrived without deltas (a cache hit, a transport that does not stream) is
  replayed as one delta per kind; text the transport held back (an unfinished think tag) is
  delivered before the end;
- leaving the ``async with`` block early (``break``, an exception, cancellation) cancels the
  call: the governor releases the permit and the probe, the transport its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Generic

from typing_extensions import TypeVar

from polygateway.context import CallContext
from polygateway.errors import TransientError
from polygateway.settings import SourceConfig
from polygateway.types import ChatRequest, LLMResponse, StreamDelta

__all__ = ["ChatStream"]

DataT = TypeVar("DataT", default=Any)
Start = Callable[[CallContext], Coroutine[Any, Any, LLMResponse[Any]]]


class ChatStream(Generic[DataT]):
    """``async with client.stream(messages) as stream: async for delta in stream: ...``;
    then ``stream.response`` (the full ``LLMResponse``, typed after ``structured=``)."""

    __slots__ = (
        "_attempt",
        "_cut",
        "_deltas",
        "_ended",
        "_pending",
        "_restart",
        "_shown",
        "_shown_content",
        "_start",
        "_task",
        "_waiter",
        "context",
    )

    def __init__(self, start: Start, *, restart_on_cut: bool = False) -> None:
        self._start: Start | None = start
        self._restart = restart_on_cut
        self._task: asyncio.Task[LLMResponse[Any]] | None = None
        self._pending: deque[StreamDelta] = deque()
        # The consumer's wake-up: a bare future it awaits when nothing is pending (cheaper
        # than an Event: no waiter list, no coroutine per wait).
        self._waiter: asyncio.Future[None] | None = None
        self._attempt = ""  # the call id whose deltas are being shown
        self._shown = 0  # deltas handed to the consumer since the last restart
        self._deltas = 0  # deltas received from the current attempt
        self._shown_content: list[str] = []
        self._cut: TransientError | None = None
        self._ended = False
        self.context = CallContext()
        """The call's context (deltas and attempts come back here once entered); ``start``
        gets it."""

    # ------------------------------------------------------------------ the call's side

    def on_delta(self, call_id: str, delta: StreamDelta) -> None:
        """``ports.DeltaSink``: a delta parsed by the transport of attempt ``call_id``."""
        if self._cut is not None:
            return
        if call_id != self._attempt:
            if self._deltas and self._restart:
                self._push(StreamDelta("restart"))
                self._shown_content.clear()
            self._attempt = call_id
            self._deltas = 0
        self._deltas += 1
        if delta.kind == "content":
            self._shown_content.append(delta.text)
        self._push(delta)

    def on_attempt(
        self,
        request: ChatRequest,
        source: SourceConfig,
        call_id: str,
        outcome: LLMResponse | BaseException,
        latency_ms: int,
    ) -> None:
        """``ports.CallObserver``: an attempt that already produced deltas failed."""
        if not isinstance(outcome, Exception) or call_id != self._attempt or not self._deltas:
            return
        if self._restart:
            return  # the governor's next attempt starts over after a restart marker
        self._cut = TransientError(
            f"stream cut after {self._deltas} deltas ({type(outcome).__name__}: {outcome}); "
            "not retried because text was already delivered (restart_on_cut=True allows it)",
            source_name=source.name,
        )
        self._cut.__cause__ = outcome
        if self._task is not None:
            self._task.cancel()  # the governor stops: permit, probe and connection released
        self._wake()

    def on_result_invalid(self, call_id: str, error: BaseException) -> None:
        return None

    def _push(self, delta: StreamDelta) -> None:
        self._pending.append(delta)
        self._wake()

    def _wake(self, _: object = None) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self, response: LLMResponse) -> None:
        """What the consumer has not seen of ``response`` yet, as deltas."""
        shown = "".join(self._shown_content) if self._attempt == response.call_id else None
        if shown is None:  # no delta came from the answering attempt: replay it whole
            if self._deltas and self._restart:
                self._push(StreamDelta("restart"))
            if response.thinking:
                self._push(StreamDelta("thinking", response.thinking))
            if response.content:
                self._push(StreamDelta("content", response.content))
            for index, call in enumerate(response.tool_calls):
                self._push(StreamDelta("tool_call", call.arguments, index, call.id, call.name))
        elif len(response.content) > len(shown) and response.content.startswith(shown):
            self._push(StreamDelta("content", response.content[len(shown) :]))

    # ------------------------------------------------------------------ the consumer's side

    async def __aenter__(self) -> ChatStream[DataT]:
        # Taken here, not kept: the start closure holds the request, which holds the context,
        # which holds this stream (a reference cycle per call for the garbage collector).
        start, self._start = self._start, None
        if start is None:
            raise TypeError("a stream is entered once: call client.stream(...) again")
        # Linked to the context only now: a stream never entered (its closure holds the
        # context through the request) is then freed by reference counting, not in a cycle.
        context = self.context
        context.stream = self
        context.add_observer(self)
        self._task = asyncio.get_running_loop().create_task(self._run(start, context))
        # A call that ends by cancellation never reaches _run's own wake-up.
        self._task.add_done_callback(self._wake)
        return self

    async def _run(self, start: Start, context: CallContext) -> LLMResponse[Any]:
        try:
            return await start(context)
        finally:
            # Wakes the consumer from inside the call's task, one loop turn before a done
            # callback would: the task is done by the time the consumer runs.
            self._wake()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
            # Wait for the call to unwind (releases happen in its finally blocks); the
            # consumer's own cancellation, if any, is already being raised.
            await asyncio.wait([task])
        # The call is over: its context stops pointing back at this stream, so the two are
        # freed by reference counting, not left in a cycle for the garbage collector.
        self.context.detach(self)
        if task.cancelled():
            # The task keeps its CancelledError, whose traceback holds _run's frame and so
            # this stream, until someone takes it: taken (and dropped) here.
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        else:
            task.exception()  # retrieved: never "exception was never retrieved"

    def __aiter__(self) -> ChatStream[DataT]:
        return self

    async def __anext__(self) -> StreamDelta:
        task = self._task
        if task is None:
            raise TypeError("iterate inside 'async with client.stream(...) as stream:'")
        while True:
            if self._pending:
                self._shown += 1
                return self._pending.popleft()
            if self._cut is not None:
                raise self._cut
            if task.done():
                if self._ended:
                    raise StopAsyncIteration
                self._ended = True
                self._finish(task.result())  # raises the call's error
                continue
            waiter = self._waiter = task.get_loop().create_future()
            await waiter
            self._waiter = None

    @property
    def response(self) -> LLMResponse[DataT]:
        """The full response, once the stream is consumed (``TransientError`` if cut)."""
        if self._cut is not None:
            raise self._cut
        task = self._task
        if task is None or not task.done():
            raise TypeError("stream.response is available once the stream has ended")
        result: LLMResponse[DataT] = task.result()
        return result

    def __repr__(self) -> str:
        state = "cut" if self._cut else ("ended" if self._ended else "open")
        return f"<ChatStream {state} shown={self._shown}>"
