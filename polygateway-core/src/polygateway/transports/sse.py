"""Server-sent events as a pure, incremental, I/O-free decoder.

``SSEDecoder`` turns arbitrary byte chunks into events (protocols §1.3): events end at a
blank line (``\\n\\n``, ``\\r\\n\\r\\n``, ``\\r\\r``, mixed), ``:`` comment lines (keep-alives) are
ignored, ``data:`` with or without the space, several ``data:`` lines join with ``\\n``. Bytes are
only split at line ends, never decoded here, so a UTF-8 character cut between two chunks is
reassembled before anything decodes it. What the events mean is the protocol's parser's
business (``openai_chunks`` for OpenAI chat completions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
"""An event larger than this is a protocol violation, not a reason to grow memory forever."""


class SSEProtocolError(ValueError):
    """The byte stream is not usable SSE (e.g. an event exceeds the size limit)."""


SSEEvent: TypeAlias = tuple[bytes, bytes | None]
"""``(data, event)``: the data lines joined by ``\\n`` (still bytes: the JSON parser decodes
them) and the ``event:`` field when one was sent (OpenAI sends none, except for errors).
A plain tuple: one is made per streamed chunk."""


class SSEDecoder:
    """Incremental SSE decoder: ``feed`` byte chunks, get completed events; ``flush`` at EOF."""

    __slots__ = ("_buf", "_max_event_bytes", "_scan_from")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self._scan_from = 0
        self._max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        scan_from = self._scan_from
        if b"\r" in buf:
            # Normalise line ends. A trailing \r may be the first half of \r\n: hold it back.
            held = buf.endswith(b"\r")
            if held:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            scan_from = 0
        else:
            held = False
        end = buf.find(b"\n\n", scan_from)
        if end < 0:
            if len(buf) > self._max_event_bytes:
                raise SSEProtocolError(f"SSE event larger than {self._max_event_bytes} bytes")
            self._buf = buf + b"\r" if held else buf
            # Next time only the tail can start a new blank line.
            self._scan_from = max(0, len(buf) - 1)
            return []
        cut = buf.rfind(b"\n\n")
        rest = buf[cut + 2 :]
        if len(rest) > self._max_event_bytes:
            raise SSEProtocolError(f"SSE event larger than {self._max_event_bytes} bytes")
        self._buf = rest + b"\r" if held else rest
        self._scan_from = max(0, len(rest) - 1)
        if buf.startswith(b"data: "):
            # The usual stream: nothing but single-line "data: ..." events. Then every line
            # end before ``cut`` belongs to an event separator: no data holds one (one join
            # and a memchr cost a third of counting the line ends).
            datas = buf[6:cut].split(b"\n\ndata: ")
            if b"\n" not in b"".join(datas):
                return [(data, None) for data in datas]
        return self._events(buf[:cut].split(b"\n\n"))

    def _events(self, parts: list[bytes]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        for raw in parts:
            # Fast path: the usual single-line event "data: {...}".
            if raw.startswith(b"data: ") and b"\n" not in raw:
                events.append((raw[6:], None))
            elif raw:
                event = _parse_event(raw.split(b"\n"))
                if event is not None:
                    events.append(event)
        return events

    def flush(self) -> list[SSEEvent]:
        """End of stream: dispatch a last event whose lines are complete but whose blank line
        never came (lenient, common with ``data: [DONE]\\n``); an unterminated line is dropped."""
        buf = self._buf
        self._buf = b""
        self._scan_from = 0
        if not buf:
            return []
        buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        lines.pop()  # the unterminated tail (b"" when the buffer ended with a line end)
        event = _parse_event(lines)
        return [event] if event is not None else []

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete event held back (non-zero at EOF means a cut event)."""
        return len(self._buf)


def _parse_event(lines: Sequence[bytes]) -> SSEEvent | None:
    data: list[bytes] = []
    event: bytes | None = None
    for line in lines:
        if not line or line[:1] == b":":
            continue
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
        # id:, retry: and unknown fields do not matter for chat completions.
    if not data:
        return None
    return (data[0] if len(data) == 1 else b"\n".join(data), event)


__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SSEDecoder", "SSEEvent", "SSEProtocolError"]
