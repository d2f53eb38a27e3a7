"""Limits on one OTLP/HTTP exchange, so a hostile or stuck collector cannot stretch them.

``OtlpHttp`` (``pgw_otel.otlp``) sends each export through an ``http.client`` connection made
by ``budgeted_connection``: its socket keeps every write and read to the ``Budget`` of the
exchange in progress, one deadline over the whole exchange (connect, request, status line,
headers, body: a collector dripping one byte at a time gets no more time than a silent one)
and a cap on the bytes read (OTLP answers are a few bytes; a huge or endless answer stops
there). ``check_headers`` refuses, when the exporter is made, header values ``http.client``
would refuse at send time with the value in its message: errors here name a header, never
its value.
"""

from __future__ import annotations

import http.client
import io
import re
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ANSWER_LIMIT",
    "READ_LIMIT",
    "AnswerTooLarge",
    "Budget",
    "budgeted_connection",
    "check_headers",
]

ANSWER_LIMIT = 64 * 1024
"""Bytes of an answer's body read at most; beyond it the rest is not read (the connection is
dropped) and the status alone decides."""
READ_LIMIT = 2 * ANSWER_LIMIT
"""Bytes read from the socket per exchange at most: status line, headers, the body up to
``ANSWER_LIMIT`` and the buffered reader's read-ahead."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 token)."""
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
"""Characters a header value cannot hold (a tab can)."""


class AnswerTooLarge(http.client.HTTPException):
    """The collector sent more than ``READ_LIMIT`` bytes in one answer."""


class Budget:
    """The deadline and the bytes left to read of the exchange in progress (``arm`` starts
    one). One per exporter, used by its one thread."""

    __slots__ = ("clock", "deadline", "read_left", "timeout_s")

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.deadline = 0.0
        self.read_left = 0

    def arm(self) -> None:
        self.deadline = self.clock() + self.timeout_s
        self.read_left = READ_LIMIT

    def remaining(self) -> float:
        """Seconds left; ``TimeoutError`` once the deadline passed."""
        left = self.deadline - self.clock()
        if left <= 0:
            raise TimeoutError(f"OTLP export took longer than {self.timeout_s:g} s")
        return left


class _BudgetedReader(io.RawIOBase):
    """Reads of the socket, each with the time left as its timeout, up to the bytes left.
    Over the socket's own raw file, so the socket stays open while an answer is read after
    the connection let go of it (``Connection: close``), as with ``socket.makefile``."""

    def __init__(self, sock: socket.socket, budget: Budget) -> None:
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._budget = budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        budget = self._budget
        if budget.read_left <= 0:
            raise AnswerTooLarge(f"OTLP answer longer than {READ_LIMIT} bytes")
        self._sock.settimeout(budget.remaining())
        read = self._raw.readinto(memoryview(buffer)[: budget.read_left]) or 0
        budget.read_left -= read
        return read

    def close(self) -> None:
        self._raw.close()
        super().close()


class BudgetedSocket:
    """A connected socket as ``http.client`` uses it (``sendall``, ``makefile``, ``close``),
    each write and read kept to the ``Budget``."""

    def __init__(self, sock: socket.socket, budget: Budget) -> None:
        self._sock = sock
        self._budget = budget

    def sendall(self, data: Any) -> None:
        # One sendall's timeout bounds the whole send (not each chunk the peer accepts).
        self._sock.settimeout(self._budget.remaining())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError(f"only reads go through the budget, not mode {mode!r}")
        return io.BufferedReader(_BudgetedReader(self._sock, self._budget))

    def close(self) -> None:
        self._sock.close()


class _Connection(http.client.HTTPConnection):
    budget: Budget

    def connect(self) -> None:
        self.timeout = self.budget.remaining()
        super().connect()
        self.sock = BudgetedSocket(self.sock, self.budget)


class _TlsConnection(http.client.HTTPSConnection):
    budget: Budget

    def connect(self) -> None:
        self.timeout = self.budget.remaining()
        super().connect()
        self.sock = BudgetedSocket(self.sock, self.budget)


def budgeted_connection(
    https: bool, host: str, port: int | None, budget: Budget
) -> http.client.HTTPConnection:
    """A connection (opened on first use, and again after a close) whose socket keeps to
    ``budget``."""
    conn = _TlsConnection(host, port) if https else _Connection(host, port)
    conn.budget = budget
    return conn


def check_headers(headers: Mapping[str, str]) -> None:
    """``ValueError`` (naming the header, never showing a value) for a header ``http.client``
    could not send: a name that is no HTTP token, a value with a character outside latin-1
    (a pasted en dash) or a control character (CR, LF)."""
    for position, (name, value) in enumerate(headers.items(), 1):
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"header {position}: the name is not an HTTP token (not shown)")
        try:
            value.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(
                f"header {name!r}: the value has a character headers cannot carry "
                "(outside latin-1, e.g. a typographic dash; value not shown)"
            ) from None
        if _CONTROL.search(value):
            raise ValueError(
                f"header {name!r}: the value has a control character (CR, LF; value not shown)"
            )
