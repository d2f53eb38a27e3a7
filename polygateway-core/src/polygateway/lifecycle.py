"""Closing a client: one order for every call kind's client (chat, embeddings, OCR, ...).

What the client built is closed first, then the telemetry rows still in flight are handed
over, then the recorder is flushed (and closed when the client built it), so a graceful
shutdown loses no row. One part failing to close never stops the others: it is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from polygateway.ports import TelemetryRecorder

__all__ = ["close_client_parts", "close_quietly"]

logger = logging.getLogger(__name__)


async def close_quietly(what: str, close: Callable[[], Awaitable[None]]) -> None:
    """Await ``close()``; a failure is a warning naming ``what``, never an exception."""
    try:
        await close()
    except Exception as exc:  # noqa: BLE001 - one part failing to close must not stop the rest
        logger.warning("closing %s failed: %s: %s", what, type(exc).__name__, exc)


async def close_client_parts(
    *,
    owned: Iterable[tuple[str, Any]],
    drains: Iterable[Callable[[], Awaitable[None]]] = (),
    telemetry: TelemetryRecorder | None = None,
    owns_telemetry: bool = False,
) -> None:
    """Close a client's parts in order.

    :param owned: ``(label, part)`` for each part the client built (each has ``aclose()``).
    :param drains: hand over the telemetry rows still in flight (``RowWriter.drain``, ...).
    :param telemetry: the recorder, flushed last, once nothing can produce rows any more.
    :param owns_telemetry: close the recorder too (an injected recorder is only flushed).
    """
    for what, part in owned:
        await close_quietly(what, part.aclose)
    for drain in drains:
        await close_quietly("telemetry rows in flight", drain)
    if telemetry is not None:
        await close_quietly("telemetry flush", telemetry.flush)
        if owns_telemetry:
            await close_quietly("telemetry", telemetry.aclose)
