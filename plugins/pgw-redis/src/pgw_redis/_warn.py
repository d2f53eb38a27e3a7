"""Warnings for the degrade-and-continue paths, once per cause."""

from __future__ import annotations

import logging


class WarnOnce:
    """Logs the first failure of each (operation, error type) until the next success.

    A Redis outage then costs one warning per kind of failure instead of one per call, and a
    later outage (after a success) is reported again.
    """

    __slots__ = ("_logger", "_seen", "_what")

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._seen: set[tuple[str, type[BaseException]]] = set()

    def failed(self, operation: str, exc: BaseException, consequence: str) -> None:
        cause = (operation, type(exc))
        if cause in self._seen:
            return
        self._seen.add(cause)
        # The exception text is redis-py's (host:port, server error); it never holds the URL.
        self._logger.warning(
            "%s: %s failed (%s: %s); %s",
            self._what,
            operation,
            type(exc).__name__,
            exc,
            consequence,
        )

    def succeeded(self) -> None:
        if self._seen:
            self._seen.clear()
            self._logger.info("%s: Redis answers again", self._what)
