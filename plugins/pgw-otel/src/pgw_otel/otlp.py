"""Finished spans as OTLP protobuf bytes, written by hand, and posted over OTLP/HTTP.

``SpanData`` is what the recorder's batch thread makes of a call: plain values, no SDK span.
``TraceEncoder.request(spans)`` writes the ``ExportTraceServiceRequest`` bytes directly in the
protobuf wire format (tags, varints, length-delimited fields): the resource and scope block is
encoded once, every attribute key once, and the encoded bytes of repeated ``(key, value)``
pairs (source, scope, model, provider, booleans) are kept, so a span costs a few joins. The
SDK's encoder (``encode_spans`` over ``ReadableSpan`` objects, see ``pgw_otel.sinks``) is the
definition: the suite parses both and compares them attribute by attribute.

``OtlpHttp`` posts such bytes to one URL with a kept-alive ``http.client`` connection; it runs
in the batch thread only, so a slow or dead collector delays export, never a call.
"""

from __future__ import annotations

import http.client
import re
import struct
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pgw_otel.exchange import ANSWER_LIMIT, Budget, budgeted_connection, check_headers

__all__ = [
    "KIND_CLIENT",
    "KIND_INTERNAL",
    "PACK_DOUBLE",
    "SPAN_FLAGS_LOCAL",
    "SPAN_FLAGS_REMOTE",
    "SPAN_TIMES",
    "AttributeKey",
    "OtlpHttp",
    "SpanData",
    "TraceEncoder",
    "attribute_field",
    "double_attribute",
    "int_attribute",
    "key_field_of",
    "name_field",
    "span_field",
    "str_attribute",
    "wire_span",
]

_PATH = re.compile(r"[!-~]+")
"""A URL path ``http.client`` sends as it is: printable ASCII, no space."""

KIND_INTERNAL = 1
KIND_CLIENT = 3
STATUS_ERROR = 2
_FLAGS_HAS_IS_REMOTE = 0x100
_FLAGS_IS_REMOTE = 0x200

_CACHE_LIMIT = 4096
"""Encoded ``(key, value)`` pairs kept; beyond it pairs are encoded each time."""
_UNIQUE_KEYS = frozenset(
    {
        "pgw.call_id",
        "pgw.root_call_id",
        "pgw.session_id",
        "pgw.parent_call_id",
        "gen_ai.conversation.id",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
    }
)
"""Keys whose values rarely repeat: never cached."""


@dataclass(frozen=True, slots=True)
class SpanData:
    """One finished span: ids as ints, times in ns since the epoch, attributes in order."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int
    """0: a root span."""
    parent_is_remote: bool
    kind: int
    """``KIND_CLIENT`` or ``KIND_INTERNAL`` (the OTLP enum)."""
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    error: str | None
    """The status description of an ``ERROR`` status; ``None``: status unset."""


SPAN_TIMES = struct.Struct("<BBBQBQ").pack
"""The kind, start and end fields of a span (kinds are one-byte varints)."""
SPAN_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", _FLAGS_HAS_IS_REMOTE)
"""The ``flags`` field of a span whose parent (if any) is local."""
SPAN_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", _FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)
"""The ``flags`` field of a span whose parent is remote."""
_BYTES_2 = struct.Struct("BB").pack
_BYTES_3 = struct.Struct("BBB").pack
_BYTES_4 = struct.Struct("BBBB").pack
"""Two, three and four bytes from ints: cheaper than ``bytes((...))``, which goes through a
tuple and the buffer protocol (it showed in the per-call profile)."""
_DOUBLE = struct.Struct("<Bd").pack
PACK_DOUBLE = struct.Struct("<d").pack
"""A ``double_value`` field: its tag byte and the little-endian double (``PACK_DOUBLE``: the
double alone, after ``AttributeKey.double_prefix``)."""


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,)) if value >= 0 else _varint(value + (1 << 64))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: int, payload: bytes) -> bytes:
    """Field ``tag`` (already shifted, wire type 2) with ``payload``."""
    size = len(payload)
    if size < 0x80:
        return _BYTES_2(tag, size) + payload
    return bytes((tag,)) + _varint(size) + payload


def _any_value(value: Any) -> bytes:
    """The ``AnyValue`` message of ``value`` (as the SDK's ``_encode_value`` types it)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _delimited(0x0A, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, bytes):
        return _delimited(0x3A, value)
    if isinstance(value, Sequence):
        return _delimited(0x2A, b"".join(_delimited(0x0A, _any_value(v)) for v in value))
    raise TypeError(f"attribute value of type {type(value).__name__} is not encodable")


class TraceEncoder:
    """``ExportTraceServiceRequest`` bytes for one resource and instrumentation scope."""

    def __init__(
        self, resource: Mapping[str, Any], scope_name: str, scope_version: str | None
    ) -> None:
        self._keys: dict[str, bytes] = {}
        self._pairs: dict[tuple[str, Any], bytes] = {}
        resource_block = _delimited(0x0A, self._attributes(resource, 0x0A))
        scope = _delimited(0x0A, scope_name.encode())
        if scope_version:
            scope += _delimited(0x12, scope_version.encode())
        self._resource_block = resource_block
        self._scope_block = _delimited(0x0A, scope)

    def request(self, spans: Sequence[SpanData]) -> bytes:
        """The serialized request holding ``spans``."""
        return self.request_of([self.span(span) for span in spans])

    def request_of(self, encoded: Sequence[bytes]) -> bytes:
        """The serialized request holding spans already encoded by ``span``/``wire_span``:
        ``_delimited(0x0A, resource_block + _delimited(0x12, scope_block + b"".join(encoded)))``
        in one join (the spans' bytes copied once, not at every level)."""
        scope_size = len(self._scope_block) + sum(map(len, encoded))
        scope_head = b"\x12" + _varint(scope_size)
        size = len(self._resource_block) + len(scope_head) + scope_size
        return b"".join(
            (b"\x0a", _varint(size), self._resource_block, scope_head, self._scope_block, *encoded)
        )

    def span(self, span: SpanData) -> bytes:
        """One ``Span`` message as a field of ``ScopeSpans``."""
        return wire_span(
            span.trace_id,
            span.span_id,
            span.parent_span_id,
            span.parent_is_remote,
            _delimited(0x2A, span.name.encode()),
            span.kind,
            span.start_ns,
            span.end_ns,
            self.attributes(span.attributes),
            span.error,
        )

    def attributes(self, attributes: Mapping[str, Any]) -> bytes:
        """``attributes`` as the ``attributes`` fields of a span."""
        return self._attributes(attributes, 0x4A)

    def _attributes(self, attributes: Mapping[str, Any], tag: int) -> bytes:
        """Each attribute as a ``KeyValue`` field ``tag``; cached per ``(key, value)``."""
        pairs = self._pairs
        keys = self._keys
        out = []
        for key, value in attributes.items():
            kind = type(value)
            if kind is int or kind is float or key in _UNIQUE_KEYS:
                # A value that rarely repeats: written around the key's bytes, kept once.
                encoded_key = keys.get(key)
                if encoded_key is None:
                    encoded_key = keys[key] = _delimited(0x0A, key.encode())
                if kind is int and 0 <= value < 0x80:
                    any_value = _BYTES_2(0x18, value)
                elif kind is float:
                    any_value = _DOUBLE(0x21, value)
                else:
                    any_value = _any_value(value)
                out.append(_delimited(tag, encoded_key + _delimited(0x12, any_value)))
                continue
            found = pairs.get((key, value)) if kind is str or kind is bool else None
            if found is None:
                found = self._pair(key, value, tag)
                if (kind is str or kind is bool) and tag == 0x4A and len(pairs) < _CACHE_LIMIT:
                    pairs[key, value] = found
            out.append(found)
        return b"".join(out)

    def _pair(self, key: str, value: Any, tag: int) -> bytes:
        encoded_key = self._keys.get(key)
        if encoded_key is None:
            encoded_key = self._keys[key] = _delimited(0x0A, key.encode())
        return _delimited(tag, encoded_key + _delimited(0x12, _any_value(value)))


def wire_span(
    trace_id: int,
    span_id: int,
    parent_span_id: int,
    parent_is_remote: bool,
    name_field: bytes,
    kind: int,
    start_ns: int,
    end_ns: int,
    attribute_fields: bytes,
    error: str | None,
) -> bytes:
    """One ``Span`` message as a field of ``ScopeSpans``, its fields in field-number order as
    the SDK writes them; ``name_field`` and ``attribute_fields`` already encoded."""
    parts = [b"\x0a\x10", trace_id.to_bytes(16, "big"), b"\x12\x08", span_id.to_bytes(8, "big")]
    if parent_span_id:
        parts += (b"\x22\x08", parent_span_id.to_bytes(8, "big"))
    parts += (name_field, SPAN_TIMES(0x30, kind, 0x39, start_ns, 0x41, end_ns), attribute_fields)
    if error is None:
        parts.append(b"\x7a\x00")
    else:
        message = _delimited(0x12, error.encode()) if error else b""
        parts.append(_delimited(0x7A, message + b"\x18\x02"))
    parts.append(SPAN_FLAGS_REMOTE if parent_is_remote else SPAN_FLAGS_LOCAL)
    return span_field(b"".join(parts))


def span_field(span: bytes) -> bytes:
    """An encoded ``Span`` message as a field of ``ScopeSpans`` (``_delimited(0x12, span)``,
    the one- and two-byte lengths of nearly every span written without ``_varint``)."""
    size = len(span)
    if size < 0x80:
        return _BYTES_2(0x12, size) + span
    if size < 0x4000:
        return _BYTES_3(0x12, (size & 0x7F) | 0x80, size >> 7) + span
    return _delimited(0x12, span)


def name_field(name: str) -> bytes:
    """A span's ``name`` field."""
    return _delimited(0x2A, name.encode())


def attribute_field(key_field: bytes, value: Any) -> bytes:
    """One span attribute field; ``key_field``: ``key_field_of(key)``."""
    return _delimited(0x4A, key_field + _delimited(0x12, _any_value(value)))


def key_field_of(key: str) -> bytes:
    """The ``key`` field of a ``KeyValue``."""
    return _delimited(0x0A, key.encode())


class AttributeKey:
    """A span attribute key with the bytes before its value pre-encoded, per value type."""

    __slots__ = ("double_prefix", "int_prefixes", "key_field", "str_prefixes")

    def __init__(self, key: str) -> None:
        field = key_field_of(key)
        if len(field) > 100:
            raise ValueError("attribute key too long for a one-byte length")
        self.key_field = field
        # An int's AnyValue is its tag and 1..10 varint bytes; a double's, its tag and 8 bytes.
        self.int_prefixes = [b""] + [
            bytes((0x4A, len(field) + 3 + size)) + field + bytes((0x12, size + 1, 0x18))
            for size in range(1, 11)
        ]
        self.double_prefix = bytes((0x4A, len(field) + 11)) + field + b"\x12\x09\x21"
        # A string's, per encoded length while every length fits in one byte.
        self.str_prefixes = [
            _BYTES_2(0x4A, len(field) + size + 4) + field + _BYTES_4(0x12, size + 2, 0x0A, size)
            for size in range(120 - len(field))
        ]


def int_attribute(key: AttributeKey, value: int) -> bytes:
    """A span attribute field holding the int ``value``."""
    if 0 <= value < 0x80:
        return key.int_prefixes[1] + bytes((value,))
    encoded = _varint(value)
    return key.int_prefixes[len(encoded)] + encoded


def double_attribute(key: AttributeKey, value: float) -> bytes:
    """A span attribute field holding the double ``value``."""
    return key.double_prefix + PACK_DOUBLE(value)


def str_attribute(key: AttributeKey, value: str) -> bytes:
    """A span attribute field holding the string ``value``."""
    encoded = value.encode()
    prefixes = key.str_prefixes
    if len(encoded) < len(prefixes):  # every length fits in one byte
        return prefixes[len(encoded)] + encoded
    return attribute_field(key.key_field, value)


class OtlpHttp:
    """POSTs protobuf bodies to one OTLP/HTTP URL (``.../v1/traces`` or ``.../v1/metrics``).

    One connection, kept alive and reopened after a failure. Not thread-safe: one batch
    thread owns it. ``post`` raises ``OSError`` / ``http.client.HTTPException`` on a failed
    export or a non-2xx answer (the status only: the URL and headers may hold secrets); a
    redirect is not followed (the headers never go to another host). ``timeout_s`` bounds the
    whole export and an answer is read up to ``pgw_otel.exchange.ANSWER_LIMIT`` bytes
    (``pgw_otel.exchange``). Headers are checked here (``check_headers``): a value
    ``http.client`` would refuse later, with the value in its message, is refused now with
    the header's name only.
    """

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise ValueError("credentials in the URL are never sent: put them in a header")
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port
        self._path = parts.path or "/"
        if not _PATH.fullmatch(self._path):
            raise ValueError("the URL path has a space, a control or a non-ASCII character")
        self._target = f"{self._path}?{parts.query}" if parts.query else self._path
        check_headers(headers)
        self._headers = {"Content-Type": "application/x-protobuf", **headers}
        self._budget = Budget(timeout_s, clock)
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes) -> None:
        self._budget.arm()
        conn = self._conn
        if conn is None:
            conn = self._conn = budgeted_connection(
                self._https, self._host, self._port, self._budget
            )
        try:
            conn.request("POST", self._target, body, self._headers)
            answer = conn.getresponse()
            answer.read(ANSWER_LIMIT)
            if not answer.isclosed():  # a longer answer: the rest is not read
                self.shutdown()
        except ValueError as exc:  # UnicodeEncodeError among them
            # Their messages may quote a header value or the URL's query: only the type.
            self.shutdown()
            raise http.client.HTTPException(
                f"OTLP export request could not be written ({type(exc).__name__})"
            ) from None
        except BaseException:
            self.shutdown()
            raise
        if not 200 <= answer.status < 300:
            raise http.client.HTTPException(f"OTLP export answered HTTP {answer.status}")

    def shutdown(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __repr__(self) -> str:
        return f"OtlpHttp(path={self._path!r})"  # never the query: it may hold a key
