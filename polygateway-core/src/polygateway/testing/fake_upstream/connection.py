"""The fake upstream's server side of one TCP connection: a minimal HTTP/1.1 parser on
``asyncio.Protocol`` that runs the response plans of its requests in order (a plan made of bytes
only is written synchronously from ``data_received`` without creating a task)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Iterator

from polygateway.ports import Clock
from polygateway.testing.fake_upstream.wire import (
    BLACK_HOLE,
    CLOSE,
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    RESET,
    BadRequest,
    Hold,
    HttpRequest,
    Step,
    decode_chunked,
    dumps,
    json_head,
)


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their response plans in order."""

    def __init__(
        self,
        handle: Callable[[HttpRequest], tuple[list[Step], Callable[[], None]]],
        clock: Clock,
        connections: set[Connection],
    ) -> None:
        self._handle = handle
        self._clock = clock
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: tuple[str, str, dict[str, str], bool] | None = None
        self._head_end = 0
        self.task: asyncio.Task[None] | None = None
        self._closed = False
        self._write_ready: asyncio.Future[None] | None = None
        self.busy = False

    # asyncio.Protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self.busy:
            self._serve_buffered()

    def eof_received(self) -> bool:
        # A half-closed client gets no more answers: close our side as well.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._connections.discard(self)
        if self.task is not None:
            self.task.cancel()
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    # control

    def abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()

    def _reset(self) -> None:
        """Close with RST: SO_LINGER 0 makes close() send a reset instead of a FIN."""
        assert self._transport is not None
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()
        self._closed = True

    # request loop

    def _serve_buffered(self) -> None:
        while not self.busy and not self._closed:
            try:
                request = self._parse()
            except BadRequest as exc:
                self._reject(str(exc))
                return
            if request is None:
                return
            plan, done = self._handle(request)
            if all(isinstance(step, bytes) for step in plan):
                # Fast path: the whole answer is known now.
                try:
                    for step in plan:
                        assert isinstance(step, bytes)
                        self._write(step)
                finally:
                    done()
                if not request.keep_alive:
                    self._close()
                continue
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(
                self._run_plan(plan, done, request.keep_alive)
            )

    async def _run_plan(self, plan: list[Step], done: Callable[[], None], keep: bool) -> None:
        try:
            for step in plan:
                if self._closed:
                    return
                if isinstance(step, bytes):
                    self._write(step)
                    if self._write_ready is not None and not self._write_ready.done():
                        await self._write_ready
                elif isinstance(step, float):
                    await self._clock.sleep(step)
                elif isinstance(step, Hold):
                    await step.until()
                elif step is RESET:
                    self._reset()
                    return
                elif step is CLOSE:
                    self._close()
                    return
                elif step is BLACK_HOLE:
                    # Never answer; connection_lost (client left or server stopped) cancels us.
                    await asyncio.get_running_loop().create_future()
                elif isinstance(step, Iterator):
                    await self._write_all(step)
        finally:
            done()
            self.task = None
            self.busy = False
        if not keep:
            self._close()
        elif not self._closed:
            self._serve_buffered()

    async def _write_all(self, pieces: Iterator[bytes]) -> None:
        """Write bytes made on the fly, waiting whenever the client reads slower."""
        for data in pieces:
            if self._closed or self._transport is None or self._transport.is_closing():
                return  # the client left: stop making the rest
            self._write(data)
            if self._write_ready is not None and not self._write_ready.done():
                await self._write_ready
            else:
                # The kernel took it all: let the loop run, or a client that left (and the
                # server's other connections) would wait until the whole answer was made.
                await asyncio.sleep(0)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._closed:
            self._transport.write(data)

    def _close(self) -> None:
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()

    def _reject(self, reason: str) -> None:
        data = dumps(
            {
                "error": {
                    "message": reason,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode()
        self._write(json_head(len(data), True, 400) + data)
        self._close()

    def _parse(self) -> HttpRequest | None:
        buffer = self._buffer
        if self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise BadRequest("request head too large")
                return None
            lines = buffer[:end].decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ")
            except ValueError:
                raise BadRequest(f"bad request line: {lines[0][:100]!r}") from None
            if not version.startswith("HTTP/1."):
                raise BadRequest(f"unsupported protocol {version[:20]!r}")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise BadRequest(f"bad header line: {line[:100]!r}")
                headers[name.strip().lower()] = value.strip()
            connection = headers.get("connection", "").lower()
            keep_alive = (
                "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
            )
            self._head = (method, target, headers, keep_alive)
            self._head_end = end + 4
            if headers.get("expect", "").lower() == "100-continue":
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        method, target, headers, keep_alive = self._head
        start = self._head_end
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoded = decode_chunked(buffer, start)
            if decoded is None:
                return None
            body, consumed = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise BadRequest("bad Content-Length") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                raise BadRequest("bad Content-Length")
            if len(buffer) - start < length:
                return None
            body = bytes(buffer[start : start + length])
            consumed = start + length
        del buffer[:consumed]
        self._head = None
        return HttpRequest(method, target, headers, body, keep_alive)
