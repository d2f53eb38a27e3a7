"""Enforcing a deadline on the task that awaits, the way ``asyncio.timeout`` does, but reusable.

``asyncio.timeout`` costs two coroutines and a timer per ``async with``; the transports wait
under a deadline on every read of every call, so ``streaming.StreamLiveness`` uses
``TaskDeadline`` instead: it owns no timer (a shared ``LivenessMonitor`` calls ``expire``) and
brackets each wait with ``enter`` / ``exit``.

The protocol is the one of ``asyncio.timeout``: on ``enter`` the task's cancellation count is
read; when the deadline fires the task is cancelled; on ``exit`` that cancellation is taken
back with ``Task.uncancel``, and a ``CancelledError`` is the deadline's own only when that brings
the count back to what it was on ``enter``. So an outside cancellation that races the deadline
still propagates, and a task is never left with a pending cancellation request.
"""

from __future__ import annotations

import asyncio
from typing import Any


class TaskDeadline:
    """Cancels the task waiting between ``enter`` and ``exit`` when ``expire`` is called."""

    __slots__ = ("_cancelling", "_expired", "_task")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._expired = False

    def enter(self, loop: asyncio.AbstractEventLoop) -> None:
        """The current task starts waiting under the deadline."""
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a deadline can only be enforced inside an asyncio task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False

    def expire(self) -> None:
        """The deadline passed: cancel the waiting task, once. Nothing happens when no task is
        waiting (the next wait must check the deadline itself)."""
        task = self._task
        if task is None or self._expired:
            return
        self._expired = True
        task.cancel()

    def exit(self, exc_type: type[BaseException] | None = None) -> bool:
        """The wait ended (idempotent), raising ``exc_type`` (``None``: it did not), as a
        ``with`` block's ``__exit__`` is told. ``True`` when it raised ``CancelledError`` and
        that cancellation was this deadline's alone: the caller raises its timeout instead."""
        task = self._task
        if task is None:
            return False
        self._task = None
        if not self._expired:
            return False
        self._expired = False
        return (
            task.uncancel() <= self._cancelling
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
        )


__all__ = ["TaskDeadline"]
