"""``CallContext``: what one chat call carries down the middleware chain, declared and typed.

``GatewayClient.chat`` makes one per call and puts it on ``ChatRequest.context``; layers that
derive a request (``dataclasses.replace``, a structured re-ask) keep it, so every layer and
the dispatcher see the same context for the whole call. It replaces attributes probed on the
request (``getattr(request.observer, ...)``):

- ``observers``: the ``ports.CallObserver`` s told about every attempt (the telemetry layer
  adds one); the dispatcher hands them to the governor;
- ``canonical_messages(messages)``: the canonical JSON of the messages, encoded once per call
  and shared by the telemetry rows and the cache key (which hashes its UTF-8,
  ``canonical_messages_utf8``);
- ``result_invalid(call_id, error)``: a wrapping layer (the structured ladder) reports that an
  attempt's output was rejected after the attempt was reported as a success.

A context belongs to one call: it is not a value type and never shared between calls.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from operator import attrgetter

from polygateway.digest import canonical_messages_utf8
from polygateway.ports import CallObserver, DeltaSink
from polygateway.types import ChatRequest, GovernanceEvent, Message

__all__ = ["CallContext", "with_context"]

logger = logging.getLogger(__name__)


class CallContext:
    """The per-call side channels of a chat call (see the module docstring)."""

    __slots__ = (
        "_messages_for",
        "_messages_json",
        "_messages_utf8",
        "deadline_at",
        "events",
        "observers",
        "stream",
    )

    def __init__(self, stream: DeltaSink | None = None) -> None:
        self.observers: tuple[CallObserver, ...] = ()
        self.stream = stream
        """Where a streaming transport sends the deltas it parses (``GatewayClient.stream``);
        ``None`` for ``chat()``."""
        self.deadline_at: float | None = None
        """Monotonic end of the call's deadline, set by its first dispatch: re-asks share it."""
        self.events: Callable[[GovernanceEvent], None] | None = None
        """Told about the governor's admissions, refusals and waits of this call (the
        dispatcher hands it to ``Governor.run(events=...)``); ``None``: nobody listens."""
        self._messages_for: object = None
        self._messages_json = ""
        self._messages_utf8 = b""

    def listen(self, events: Callable[[GovernanceEvent], None]) -> None:
        """Tell ``events`` about the governor's decisions of this call, besides any listener
        already there."""
        previous = self.events
        if previous is None:
            self.events = events
            return

        def both(event: GovernanceEvent) -> None:
            try:
                previous(event)
            finally:
                events(event)

        self.events = both

    def add_observer(self, observer: CallObserver) -> None:
        """Tell ``observer`` about every attempt of this call from now on."""
        # A concatenation, not ``(*observers, observer)``: no list made on the way.
        self.observers += (observer,)

    def detach(self, party: object) -> None:
        """The call is over for ``party`` (an observer, the stream sink, or both): it is told
        nothing more, and the context no longer refers to it."""
        self.observers = tuple(o for o in self.observers if o is not party)
        if self.stream is party:
            self.stream = None

    def canonical_messages(self, messages: Sequence[Message]) -> str:
        """``canonical_messages_json(messages)``, computed once per messages list.

        The attempts of one call share one messages list (re-asks aside), and the cache layer
        hashes the same string the telemetry rows store: neither encodes it again.
        """
        if messages is not self._messages_for:
            self._encode_messages(messages)
        return self._messages_json

    def canonical_messages_utf8(self, messages: Sequence[Message]) -> bytes:
        """``canonical_messages(messages)`` as UTF-8, what the cache key hashes: the bytes the
        string was decoded from, not an encoding of it again."""
        if messages is not self._messages_for:
            self._encode_messages(messages)
        return self._messages_utf8

    def _encode_messages(self, messages: Sequence[Message]) -> None:
        utf8 = self._messages_utf8 = canonical_messages_utf8(messages)
        self._messages_json = utf8.decode("utf-8")
        self._messages_for = messages

    def result_invalid(self, call_id: str, error: BaseException) -> None:
        """Tell the observers that the output of attempt ``call_id`` was rejected."""
        for observer in self.observers:
            try:
                observer.on_result_invalid(call_id, error)
            except Exception as exc:  # noqa: BLE001 - an observer never changes the outcome
                logger.debug("call observer failed on a rejected result: %r", exc)

    def __repr__(self) -> str:
        return f"<CallContext observers={len(self.observers)}>"


_REQUEST_VALUES = attrgetter(
    *[f.name for f in dataclasses.fields(ChatRequest) if f.name != "context"]
)
"""Every field of a request but ``context``, in order."""


def with_context(request: ChatRequest, context: CallContext) -> ChatRequest:
    """``dataclasses.replace(request, context=context)`` at half the cost.

    The other fields go positionally, so ``context`` must stay the last field of
    ``ChatRequest``: any other layout makes this a ``TypeError`` (tested), never a mix-up.
    """
    # mypy cannot see that the values stop before ``context``.
    return ChatRequest(*_REQUEST_VALUES(request), context=context)  # type: ignore[misc]
