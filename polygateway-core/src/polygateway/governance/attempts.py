"""What a call kind hands the governor and what it gets back.

A call kind (chat, embeddings, OCR, ...) writes one coroutine function, ``attempt(source,
call_id) -> Attempted[T]``: send one request to ``source`` and return the result with its
measured token usage. Everything around it (which source, whether it may go, what an error
means, when to try again) is the governor's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeAlias, TypeVar, runtime_checkable

from polygateway.frozen import frozen_dataclass
from polygateway.settings import SourceConfig
from polygateway.types import GovernanceEvent

__all__ = ["Attempt", "AttemptObserver", "Attempted", "GovernanceEvents", "Outcome"]

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


@frozen_dataclass(slots=True)
class Attempted(Generic[T]):
    """The result of one successful attempt.

    ``tokens`` is the usage the upstream measured (prompt + completion, or the input tokens of
    an embedding batch); the limiter's TPM charge is settled on it. ``None`` keeps the
    estimate charged at admission (the upstream reported nothing usable).
    """

    value: T
    tokens: int | None = None


Attempt: TypeAlias = Callable[[SourceConfig, str], Awaitable[Attempted[T]]]
"""``attempt(source, call_id)``: one request to ``source``, tagged ``call_id``.

It raises the error classes of ``polygateway.errors`` (``TransientError``,
``SourceDeadError``, ``RequestRejectedError``, ``ResultInvalidError``); what each one means for
the call is decided by the governor. It must let ``asyncio.CancelledError`` through.
"""


@frozen_dataclass
class Outcome(Generic[T]):
    """What one governed call produced: the value of its successful attempt and where from."""

    value: T
    source: SourceConfig
    """The source that answered."""
    call_id: str
    """The id of the successful attempt (each attempt has its own)."""
    attempts: int
    """Attempts that reached ``attempt`` (1 when the first one succeeded)."""


GovernanceEvents: TypeAlias = Callable[[GovernanceEvent], None]
"""Told about the governor's admission decisions of one call (``Governor.run(events=...)``):
called synchronously, must not block; what it raises is logged and ignored."""


@runtime_checkable
class AttemptObserver(Protocol[T_contra]):
    """Told about every attempt that reached ``attempt``, success or not (incl. cancellation).

    Called synchronously from the attempt loop: it must not block, and whatever it raises is
    logged and ignored (an observer never changes a call's outcome).
    """

    def on_attempt(
        self,
        source: SourceConfig,
        call_id: str,
        outcome: T_contra | BaseException,
        latency_ms: int,
    ) -> None: ...
