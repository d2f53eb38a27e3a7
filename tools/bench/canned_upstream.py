"""A benchmark upstream that answers every request with the bytes ``pgw fake-upstream`` sent.

    python tools/bench/canned_upstream.py --port P --json FILE --stream FILE

``pgw fake-upstream`` speaks the wire protocol with every fault the error model names, and
that generality costs it about as much CPU per answer as the governed client spends on the
call. On a machine of two CPUs its process, the client's and ``redis-server`` then share what
there is, and calls/s measures how the scheduler splits the CPUs rather than the client. This
server sends, for each request, the exact bytes the fake upstream sent for a request of the
same kind (``capture``): the JSON answer, or the streamed one when the body asks for
``"stream": true``. It parses each request with ``httptools`` (keep-alive, ``Content-Length``
bodies) and writes the canned answer at once: a small share of a CPU per call, so a client
pinned to a CPU of its own is bound by that CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httptools
import orjson


def capture(
    port: int, body: bytes, headers: Mapping[str, str], path: str = "/v1/chat/completions"
) -> bytes:
    """The raw bytes (head and body, as sent) of the answer of the server on ``port`` to a
    POST of ``body`` with ``headers`` (the benchmark clients' own)."""
    done: list[bool] = []

    class Collector:
        def on_message_complete(self) -> None:
            done.append(True)

    parser = httptools.HttpResponseParser(Collector())
    fields = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{fields}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    raw = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        while not done:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError("the upstream closed the connection mid-answer")
            raw += data
            parser.feed_data(data)
    return bytes(raw)


class _Connection(asyncio.Protocol):
    def __init__(self, json_answer: bytes, stream_answer: bytes) -> None:
        self._json = json_answer
        self._stream = stream_answer
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = orjson.loads(b"".join(self._body))
        self._body.clear()
        answer = self._stream if request.get("stream") is True else self._json
        if self._transport is not None:
            self._transport.write(answer)


async def serve(port: int, json_answer: bytes, stream_answer: bytes) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(json_answer, stream_answer), "127.0.0.1", port, backlog=2048
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--json", type=Path, required=True, help="the JSON answer's raw bytes")
    parser.add_argument("--stream", type=Path, required=True, help="the streamed answer's")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.json.read_bytes(), args.stream.read_bytes()))


if __name__ == "__main__":
    main()
