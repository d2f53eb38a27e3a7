"""A JSON response body parsed while it arrives, in steps bounded by the chunk size.

``orjson.loads`` (and ``json.loads``) hold the GIL: parsing a 10 MB body in one call stops the
event loop for tens of milliseconds, and a worker thread does not help. ``JsonBodyParser`` is
fed the body chunk by chunk (``BodyReader`` hands out at most 64 KiB at a time) and does
bounded work per chunk:

- a body of at most ``INLINE_BYTES`` is parsed in one call at the end (the common case,
  well under a millisecond);
- a larger one is scanned as it arrives (one regular-expression match per chunk copies the
  structure and the strings the chunk closes): string literals longer than ``LONG_STRING_BYTES``
  (a huge ``content``, a huge tool-call argument) are decoded piece by piece and replaced by a
  placeholder, so that what is left for one parse at the end is the body's structure (ids,
  usage, short strings), not its text.

The structure left over is parsed at the end; it stays small for chat completions. A body made
mostly of structure (megabytes of logprobs, or a hostile server's millions of small objects) is
parsed by ``finish()`` in a worker thread with the standard library's pure-Python scanner:
slower, but it gives the GIL back between values, so the loop keeps running (orjson in a
thread would hold the GIL for the whole parse).
"""

from __future__ import annotations

import json
import json.scanner
import re
import secrets
from collections.abc import Callable
from typing import Any, Final

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional speed-up
    _orjson = None  # type: ignore[assignment]

_loads: Callable[[bytes], Any] = _orjson.loads if _orjson is not None else json.loads

INLINE_BYTES: Final = 256 * 1024
"""Bodies up to this size are parsed in one call once complete (about a millisecond at most)."""

LONG_STRING_BYTES: Final = 16 * 1024
"""String literals longer than this are decoded in pieces as they arrive."""

THREAD_STRUCTURE_BYTES: Final = 128 * 1024
"""A large body whose structure (what is left without its long strings) exceeds this is parsed
in a worker thread (``read_json_body`` calls ``finish()`` there)."""

_MAX_CUT_BACK: Final = 16
"""How far a piece's end may move back to land between two characters: an escape is at most
12 bytes (a surrogate pair, ``\\ud83d\\ude00``), a UTF-8 character 4."""

_FIND_ESCAPES: Final = 4096
"""Escapes skipped one ``find`` at a time in one chunk (fast for text); past them the regular
expression takes the rest (slower per byte, but bounded whatever the content)."""

# The inside of a string literal: plain bytes and escapes, up to a closing quote, a lone
# backslash at the end of the data, or the end of the data.
_STRING_INSIDE: Final = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)


# Everything outside strings and every string literal that closes: what the scan copies to the
# skeleton as is. Strings are at most a chunk long here; longer ones span chunks and take the
# piece-by-piece path.
_SKIP_CLOSED: Final = re.compile(rb'(?:[^"]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)


def _string_end(chunk: bytes, pos: int) -> int:
    """Where the string literal whose inside starts at ``pos`` stops in ``chunk``: at its
    closing quote, at a backslash that ends the chunk (its escaped byte is in the next one),
    or at the end of the chunk."""
    end = len(chunk)
    quote = chunk.find(b'"', pos)
    for _ in range(_FIND_ESCAPES):
        backslash = chunk.find(b"\\", pos, end if quote < 0 else quote)
        if backslash < 0:
            return end if quote < 0 else quote
        if backslash + 1 >= end:
            return backslash
        pos = backslash + 2  # past the escaped byte (a \\uXXXX's digits are plain bytes)
        if quote >= 0 and pos > quote:  # that quote was escaped
            quote = chunk.find(b'"', pos)
    match = _STRING_INSIDE.match(chunk, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()


class JsonBodyParser:
    """Feed the body with ``feed(chunk)``, get the document with ``result()``.

    ``result()`` raises ``ValueError`` when the body is not one JSON document.
    """

    __slots__ = (
        "_broken",
        "_carry",
        "_chunks",
        "_done",
        "_error",
        "_head",
        "_in_string",
        "_long",
        "_marker",
        "_pending",
        "_raw",
        "_raw_size",
        "_scanning",
        "_size",
        "_skeleton",
        "_skeleton_size",
        "_strings",
        "_value",
    )

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._head = b""
        self._scanning = False
        self._broken = False
        self._done = False
        self._value: Any = None
        self._error: ValueError | None = None
        # The scanner's state is set by ``_start_scanning``, for a large body only: a usual
        # body (every non-streaming call) is joined and parsed at the end, nothing more.

    def _start_scanning(self) -> None:
        self._scanning = True
        self._skeleton: list[bytes] = []
        self._skeleton_size = 0
        self._in_string = False
        self._pending = b""
        """A backslash that ended the previous chunk (its escaped byte is in the next)."""
        self._raw: list[bytes] = []
        """The current string literal's bytes so far (while it is short)."""
        self._raw_size = 0
        self._long: list[str] | None = None
        """The current string literal's decoded pieces, once it is long."""
        self._carry = b""
        """Bytes of the current long string not decoded yet (less than one piece)."""
        self._strings: list[str] = []
        self._marker = b"\\u0000pgw-" + secrets.token_hex(8).encode() + b":"

    @property
    def head(self) -> bytes:
        """The first bytes of the body (for error messages)."""
        return self._head

    @property
    def size(self) -> int:
        return self._size

    @property
    def heavy(self) -> bool:
        """A large body whose structure is large too: call ``finish()`` in a worker thread
        before ``result()``."""
        return self._scanning and not self._broken and self._skeleton_size > THREAD_STRUCTURE_BYTES

    def finish(self) -> None:
        """Parse the complete body now and keep the outcome for ``result()``. Meant for a
        worker thread when ``heavy``: it then uses the pure-Python decoder, which lets other
        threads (the event loop) run while it works."""
        if self._done:
            return
        try:
            self._value = self._parse(yielding=self.heavy)
        except ValueError as exc:
            self._error = exc
        self._done = True

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if not self._head:
            self._head = chunk[:80]
        self._size += len(chunk)
        if self._broken:
            return
        try:
            if self._scanning:
                self._scan(chunk)
                return
            self._chunks.append(chunk)
            if self._size > INLINE_BYTES:
                # Large: scan what came so far (at most INLINE_BYTES plus one chunk), then each
                # chunk as it arrives.
                self._start_scanning()
                chunks, self._chunks = self._chunks, []
                for piece in chunks:
                    self._scan(piece)
        except ValueError:
            # Reported by result(); the rest of the body is still read (the connection).
            self._broken = True
            self._skeleton, self._strings, self._raw, self._long = [], [], [], None

    def result(self) -> Any:
        """The parsed document (the body must be complete)."""
        if self._done:
            if self._error is not None:
                raise self._error
            return self._value
        return self._parse(yielding=False)

    def _parse(self, *, yielding: bool) -> Any:
        """The document; ``yielding``: with the pure-Python scanner (only worth it off the
        loop, in ``finish()``: on the loop it would block it longer than orjson)."""
        if self._broken:
            raise ValueError("invalid string literal in the body")
        if not self._scanning:
            return _loads(b"".join(self._chunks))
        if self._in_string or self._pending:
            raise ValueError("unterminated string at the end of the body")
        skeleton = b"".join(self._skeleton)
        if yielding:
            try:
                value = _yielding_loads(skeleton)
            except RecursionError:
                raise ValueError("the body is nested too deeply") from None
        else:
            value = _loads(skeleton)
        return self._substitute(value) if self._strings else value

    # ------------------------------------------------------------------ scanning

    def _scan(self, chunk: bytes) -> None:
        if self._pending:
            chunk, self._pending = self._pending + chunk, b""
        end = len(chunk)
        pos = 0
        skeleton = self._skeleton
        while pos < end:
            if not self._in_string:
                # Structure and the strings that close in this chunk, in one C-speed match
                # (a Python step per string would cost milliseconds per chunk of small
                # objects); it stops at a string this chunk does not close.
                stop = _SKIP_CLOSED.match(chunk, pos).end()  # type: ignore[union-attr]
                if stop > pos:
                    skeleton.append(chunk[pos:stop] if pos or stop < end else chunk)
                    self._skeleton_size += stop - pos
                if stop >= end:
                    return
                self._in_string = True
                pos = stop + 1
                continue
            stop = _string_end(chunk, pos)
            if stop < end and chunk[stop] == 0x22:  # the closing quote
                self._close_string(chunk[pos:stop])
                pos = stop + 1
                continue
            self._string_part(chunk[pos:stop])
            # Either the end of the chunk, or a backslash whose escaped byte comes next.
            self._pending = chunk[stop:]
            return

    def _string_part(self, part: bytes) -> None:
        if self._long is None:
            self._raw.append(part)
            self._raw_size += len(part)
            if self._raw_size <= LONG_STRING_BYTES:
                return
            self._long = []
            part, self._raw, self._raw_size = b"".join(self._raw), [], 0
        carry = self._carry + part if self._carry else part
        self._carry = self._decode_prefix(carry)

    def _close_string(self, part: bytes) -> None:
        self._in_string = False
        decoded = self._long
        if decoded is None:
            raw = self._raw
            if raw:
                raw.append(part)
                part = b"".join(raw)
                self._raw, self._raw_size = [], 0
            self._skeleton.append(b'"' + part + b'"')
            self._skeleton_size += len(part) + 2
            return
        rest = self._carry + part
        self._carry = b""
        decoded.append(_loads(b'"' + rest + b'"'))
        self._long = None
        placeholder = b'"' + self._marker + str(len(self._strings)).encode() + b'"'
        self._skeleton.append(placeholder)
        self._skeleton_size += len(placeholder)
        self._strings.append("".join(decoded))

    def _decode_prefix(self, data: bytes) -> bytes:
        """Decode the longest prefix of ``data`` that ends between two characters (one that
        decodes on its own: a cut inside an escape or a UTF-8 sequence does not); the rest."""
        assert self._long is not None
        size = len(data)
        for cut in range(size, max(0, size - _MAX_CUT_BACK) - 1, -1):
            try:
                text = _loads(b'"' + data[:cut] + b'"')
            except ValueError:
                continue
            self._long.append(text)
            return data[cut:]
        raise ValueError("invalid string literal in the body")

    def _substitute(self, value: Any) -> Any:
        """Put the long strings back in place of their placeholders (iteratively: the
        document may be as deep as the parser allows)."""
        marker = json.loads(b'"' + self._marker + b'"')
        strings = self._strings

        def real(item: Any) -> Any:
            if type(item) is str and item.startswith(marker):
                return strings[int(item[len(marker) :])]
            return item

        top = real(value)
        stack = [top]
        while stack:
            node = stack.pop()
            if type(node) is dict:
                if any(type(k) is str and k.startswith(marker) for k in node):
                    items = [(real(k), v) for k, v in node.items()]
                    node.clear()
                    node.update(items)
                for key, item in node.items():
                    if type(item) is str:
                        node[key] = real(item)
                    elif type(item) in (dict, list):
                        stack.append(item)
            elif type(node) is list:
                for index, item in enumerate(node):
                    if type(item) is str:
                        node[index] = real(item)
                    elif type(item) in (dict, list):
                        stack.append(item)
        return top


class _YieldingDecoder(json.JSONDecoder):
    """The standard decoder with its pure-Python scanner: it runs bytecode between values, so a
    thread running it lets the event loop's thread take the GIL at every switch interval. Each
    string is still decoded in C (at most a chunk long: longer ones were taken out)."""

    def __init__(self) -> None:
        super().__init__()
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]


def _yielding_loads(data: bytes) -> Any:
    return _YieldingDecoder().decode(data.decode("utf-8"))


__all__ = ["INLINE_BYTES", "LONG_STRING_BYTES", "THREAD_STRUCTURE_BYTES", "JsonBodyParser"]
