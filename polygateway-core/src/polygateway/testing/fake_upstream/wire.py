"""HTTP/1.1 byte framing of the fake upstream's answers, and the steps a response plan is made
of: bytes to write, delays (floats), holds and terminal actions (reset, black hole, close).

Protocol-neutral: a protocol's answers (``openai.py``, ...) build plans from these pieces.
"""

from __future__ import annotations

import http
import json
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

from polygateway.testing.fake_upstream.replies import Reply

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 64 * 1024 * 1024


class Action:
    """A terminal step of a response plan."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


RESET: Final = Action("reset")
BLACK_HOLE: Final = Action("black_hole")
CLOSE: Final = Action("close")


@dataclass(frozen=True, slots=True)
class Hold:
    """A step of a response plan that waits for ``until()`` before the next one."""

    until: Callable[[], Awaitable[None]]


Step = bytes | float | Action | Hold | Iterator[bytes]
"""One step of a response plan (a float is a delay in seconds; an iterator's bytes are made
while they are written, under the connection's flow control)."""


@dataclass(slots=True)
class HttpRequest:
    """One parsed HTTP/1.1 request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to answer, as a protocol's answers see it."""

    route: str
    reply: Reply
    body: dict[str, Any]
    """The request JSON (empty for a request without a body)."""
    model: str
    close: bool
    """The connection closes after this answer (``Connection: close``)."""
    serial: int
    """The request's number on this server (answer ids)."""
    models: tuple[str, ...]
    embedding_dim: int
    shuffle_embeddings: bool = True
    """List embeddings ``data[]`` out of input order (``FakeUpstream.shuffle_embeddings``)."""


class Answers(Protocol):
    """A protocol's answers: a response plan for every route it serves (``ROUTES`` of its
    module), the scripted errors included; the wire faults (reset, black hole) are the
    server's."""

    def plan(self, ask: Ask) -> list[Step]: ...


class BadRequest(Exception):
    """The bytes on the wire are not an HTTP/1.1 request this server understands."""


def status_line(status: int) -> str:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n"


_JSON_200_HEAD: Final = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
_SSE_200_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
)
CONNECTION_CLOSE: Final = b"Connection: close\r\n"
CHUNKED_END: Final = b"0\r\n\r\n"
DONE_FRAME: Final = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # then the end of the body


def json_head(length: int, close: bool, status: int = 200, extra: str = "") -> bytes:
    if status == 200 and not extra:
        head = f"{_JSON_200_HEAD}{length}\r\n"
    else:
        head = (
            f"{status_line(status)}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}"
        )
    return head.encode("latin-1") + (CONNECTION_CLOSE + b"\r\n" if close else b"\r\n")


def sse_head(close: bool) -> bytes:
    return _SSE_200_HEAD + (CONNECTION_CLOSE + b"\r\n" if close else b"\r\n")


def frame(event: bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    return b"%x\r\n%b\r\n" % (len(event), event)


_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``'s encoder, made once."""


def dumps(value: Any) -> str:
    return _ENCODER.encode(value)


def chunked_head(status: int, content_type: str, close: bool, extra: str = "") -> bytes:
    """The head of a chunked answer (``extra``: more header lines, each ending in CRLF)."""
    head = (
        f"{status_line(status)}Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n"
        f"{extra}"
    )
    return head.encode("latin-1") + (CONNECTION_CLOSE + b"\r\n" if close else b"\r\n")


def chunked_body(pieces: Iterable[bytes], *, gzip: bool = False) -> Iterator[bytes]:
    """``pieces`` as HTTP chunks (gzip-compressed first when asked), then the end of the body."""
    compressor = zlib.compressobj(wbits=31) if gzip else None
    for piece in pieces:
        # A sync flush per piece: every piece reaches the wire (the writer can notice a client
        # that left) for a few bytes of ratio (64 KiB of one byte still make ~100 bytes).
        data = (
            compressor.compress(piece) + compressor.flush(zlib.Z_SYNC_FLUSH)
            if compressor is not None
            else piece
        )
        if data:
            yield b"%x\r\n%b\r\n" % (len(data), data)
    if compressor is not None:
        data = compressor.flush()
        yield b"%x\r\n%b\r\n" % (len(data), data)
    yield CHUNKED_END


def json_plan(reply: Reply, data: bytes, error: bytes, close: bool, pieces: int = 1) -> list[Step]:
    """A 200 JSON answer with the non-stream shape of each fault (``error`` is the body of a
    ``mid_stream_error``)."""
    kind = reply.kind
    steps: list[Step] = []
    wait = reply.headers_delay + reply.first_token_delay
    wait += reply.inter_token_delay * max(0, pieces - 1)
    if wait:
        steps.append(wait)
    if kind == "cut":
        # Content-Length promises the whole body; the connection closes halfway.
        steps += [json_head(len(data), close) + data[: len(data) // 2], CLOSE]
    elif kind == "early_eof":
        steps.append(json_head(0, close))
    elif kind == "malformed":
        broken = data[: max(1, len(data) // 2)]
        steps.append(json_head(len(broken), close) + broken)
    elif kind == "mid_stream_error":
        steps.append(json_head(len(error), close) + error)
    else:
        steps.append(json_head(len(data), close) + data)
    return steps


def decode_chunked(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body at ``start``: (body, end offset), or None when incomplete."""
    body = bytearray()
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        try:
            size = int(bytes(buffer[position:line_end]).split(b";", 1)[0], 16)
        except ValueError:
            raise BadRequest("bad chunk size") from None
        position = line_end + 2
        if size == 0:
            # Skip trailers up to the blank line.
            while True:
                line_end = buffer.find(b"\r\n", position)
                if line_end < 0:
                    return None
                if line_end == position:
                    return bytes(body), line_end + 2
                position = line_end + 2
        if len(buffer) < position + size + 2:
            return None
        body += buffer[position : position + size]
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest("request body too large")
        position += size + 2


_FRAMING_FIELDS: Final = (b"content-length:", b"transfer-encoding:")


def truncated_plan(plan: list[Step], stream: bool) -> list[Step]:
    """A complete answer's ``plan`` re-framed as one chunk under ``TRANSFER-ENCODING: Chunked``
    (odd case, as RFC 9110 allows), then closed before the last chunk; a stream loses its last
    event first. Delays in ``plan`` are kept in front."""
    delays: list[Step] = [step for step in plan if isinstance(step, float)]
    data = b"".join(step for step in plan if isinstance(step, bytes))
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if any(line.lower().startswith(b"transfer-encoding:") for line in lines):
        decoded = decode_chunked(bytearray(body), 0)
        assert decoded is not None, "a complete answer's chunked body"
        body = decoded[0]
    kept = [line for line in lines if not line.lower().startswith(_FRAMING_FIELDS)]
    if stream:
        body = body[: body.rstrip(b"\n").rfind(b"\n\n") + 2]
    new_head = b"\r\n".join([*kept, b"TRANSFER-ENCODING: Chunked"]) + b"\r\n\r\n"
    return [*delays, new_head + b"%x\r\n%b\r\n" % (len(body), body), CLOSE]
