"""Warnings of the degrade-and-continue paths: once per cause, never a password."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pgw_postgres.options import redact


class WarnOnce:
    """Logs the first failure of each (operation, error type) until the next success.

    An outage then costs one warning per kind of failure instead of one per batch, and a later
    outage (after a success) is reported again. Messages pass through ``redact`` with the DSN's
    password: asyncpg's texts do not hold it, but a DSN it could not parse may be echoed.
    """

    __slots__ = ("_logger", "_secrets", "_seen", "_what")

    def __init__(self, logger: logging.Logger, what: str, secrets: Sequence[str] = ()) -> None:
        self._logger = logger
        self._what = what
        self._secrets = tuple(secrets)
        self._seen: set[tuple[str, type[BaseException] | None]] = set()

    def failed(self, operation: str, exc: BaseException | None, consequence: str) -> None:
        cause = (operation, None if exc is None else type(exc))
        if cause in self._seen:
            return
        self._seen.add(cause)
        reason = "" if exc is None else f" ({self.describe(exc)})"
        self._logger.warning("%s: %s%s; %s", self._what, operation, reason, consequence)

    def succeeded(self) -> None:
        if self._seen:
            self._seen.clear()
            self._logger.info("%s: PostgreSQL accepts rows again", self._what)

    def describe(self, exc: BaseException) -> str:
        return redact(f"{type(exc).__name__}: {exc}", self._secrets)
