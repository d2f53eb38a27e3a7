"""Message digests shared by the cache key and telemetry (ARCHITECTURE §7.5, §7.8).

Text parts are kept verbatim, every field of them; every non-text content part (base64 images,
audio, files) is replaced by ``{"type", "sha256"}``, so keys stay stable and databases hold no
base64. The part's ``sha256`` is defined in one of two forms:

- the *plain form*: the sha256 of the part's canonical JSON (UTF-8);
- the *streamed form* (``STREAMED_DIGEST_VERSION`` 2, ``part_sha256``), for a part holding at
  least one ``str`` of ``STREAMED_MIN_CHARS`` characters or more (a base64 image, say) as a
  value of a ``dict`` or an item of a ``list``/``tuple``, and nesting those no deeper than
  ``_MAX_FAST_DEPTH`` levels: the sha256 of ``STREAMED_PREFIX + canonical_json(skeleton) +
  b"\n"`` followed by the UTF-8 bytes of each such long string, in the order they appear in
  the skeleton's JSON. The
  skeleton is the part with each long string replaced by ``"\x00#<its UTF-8 length>"`` and
  every other string value starting with ``"\x00"`` prefixed with one more ``"\x00"``.

The streamed form hashes the image's bytes as they are, instead of first building (copying)
a JSON string of several megabytes; an ASCII string (base64) is encoded and hashed in pieces
that stay in the CPU cache, so no multi-megabyte buffer is made at all. It is unambiguous:
canonical JSON holds no raw newline, so the skeleton ends at the first one; placeholders and
escaped strings cannot be mistaken for each other; the lengths in the placeholders split the
rest. Its prefix is not JSON, so no
plain-form input equals a streamed-form one. Parts without a long string keep the plain form;
the cache keys of parts with one changed once, when version 2 was introduced.

Canonical JSON is defined by the stdlib encoder (sorted keys, no whitespace, UTF-8 kept). It
runs on every call (cache key, telemetry row), so values made only of types whose orjson
output is byte-identical are encoded by orjson instead; anything else (floats, whose
formatting differs, str or dict subclasses, non-str keys...) takes the stdlib path, which
stays the definition. Cache keys therefore do not depend on which path ran.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from polygateway.types import Message

_STDLIB_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False
).encode
"""The definition of canonical JSON, the encoder built once (``json.dumps`` builds one per
call)."""

_SORTED = orjson.OPT_SORT_KEYS
# Leaf types orjson encodes exactly as the stdlib does (every code point of str checked by
# the tests; ints beyond 64 bits and lone surrogates make orjson raise: stdlib then).
_EXACT_LEAVES = frozenset({str, int, bool, type(None)})
# Deeper values take the stdlib path, which also reports circular references as before.
_MAX_FAST_DEPTH = 32


def _orjson_exact(value: Any, depth: int = 0) -> bool:
    """Whether orjson's sorted output for ``value`` is the stdlib canonical JSON, byte for byte:
    exact ``dict`` (``str`` keys), ``list``, ``tuple`` and the leaves above, nothing else."""
    kind = type(value)
    if kind in _EXACT_LEAVES:
        return True
    if depth >= _MAX_FAST_DEPTH:
        return False
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return False
            if type(item) not in _EXACT_LEAVES and not _orjson_exact(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        for item in value:
            if type(item) not in _EXACT_LEAVES and not _orjson_exact(item, depth + 1):
                return False
        return True
    return False


def _orjson_sorted(value: Any) -> bytes | None:
    try:
        return orjson.dumps(value, option=_SORTED)
    except orjson.JSONEncodeError:
        return None  # an int beyond 64 bits, a lone surrogate: the stdlib's verdict stands


def _fast_canonical(value: Any) -> bytes | None:
    """The canonical JSON of ``value`` as UTF-8 by orjson, or ``None`` when only the stdlib
    path gives the canonical form (or raises the error the caller has always seen)."""
    return _orjson_sorted(value) if _orjson_exact(value) else None


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 kept."""
    fast = _fast_canonical(value)
    return fast.decode("utf-8") if fast is not None else _STDLIB_CANONICAL(value)


def canonical_json_bytes(value: Any) -> bytes:
    """``canonical_json(value).encode("utf-8")``, without the detour through ``str`` when
    possible (what gets hashed)."""
    fast = _fast_canonical(value)
    return fast if fast is not None else _STDLIB_CANONICAL(value).encode("utf-8")


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


STREAMED_DIGEST_VERSION = 2
STREAMED_PREFIX = b"pgw-part-digest/2\n"
"""Starts every streamed-form input; not JSON, so never the start of a plain-form one."""
STREAMED_MIN_CHARS = 1024
"""Strings this long (or longer) are hashed as they are, outside the skeleton's JSON."""
HASH_PIECE_CHARS = 65536
"""Pieces in which a long ASCII string is encoded and hashed (fits in a core's L2 cache)."""
_PLACEHOLDER = "\x00#"
_ESCAPE = "\x00"


class _TooDeep(Exception):
    """The part nests deeper than the streamed form goes: it takes the plain form."""


def _has_long_string(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return len(value) >= STREAMED_MIN_CHARS
    if depth >= _MAX_FAST_DEPTH:
        return False
    if isinstance(value, dict):
        return any(_has_long_string(item, depth + 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_long_string(item, depth + 1) for item in value)
    return False


def _skeleton(value: Any, streamed: list[str | bytes], depth: int = 0) -> Any:
    """``value`` with its long strings moved to ``streamed``, in the order canonical JSON
    writes them (dicts walked by sorted key, as the encoder sorts them)."""
    if isinstance(value, str):
        if len(value) >= STREAMED_MIN_CHARS:
            if str.isascii(value):  # base64: its UTF-8 length is its length, known for free
                # A subclass's own methods have no say in the digest: its plain str.
                streamed.append(value if type(value) is str else str.__str__(value))
                return f"{_PLACEHOLDER}{len(value)}"
            data = str.encode(value, "utf-8")
            streamed.append(data)
            return f"{_PLACEHOLDER}{len(data)}"
        return _ESCAPE + value if value.startswith(_ESCAPE) else value
    if not isinstance(value, (dict, list, tuple)):
        return value
    if depth >= _MAX_FAST_DEPTH:
        raise _TooDeep
    if isinstance(value, dict):
        return {key: _skeleton(value[key], streamed, depth + 1) for key in sorted(value)}
    return [_skeleton(item, streamed, depth + 1) for item in value]


def part_sha256(part: Any) -> str:
    """The ``sha256`` of a non-text part, in the form the module docstring defines."""
    if _has_long_string(part):
        streamed: list[str | bytes] = []
        try:
            skeleton = canonical_json_bytes(_skeleton(part, streamed))
        except _TooDeep:
            pass
        else:
            digest = hashlib.sha256(STREAMED_PREFIX)
            digest.update(skeleton)
            digest.update(b"\n")
            for data in streamed:
                if isinstance(data, bytes):
                    digest.update(data)
                    continue
                # An ASCII string is fed a piece at a time: each piece's bytes stay in the CPU
                # cache from encoding to hashing, and the whole image is never copied into
                # one fresh multi-megabyte buffer (page faults and memory traffic cost more
                # than the hash itself once the pipeline has evicted the image from cache).
                for start in range(0, len(data), HASH_PIECE_CHARS):
                    digest.update(data[start : start + HASH_PIECE_CHARS].encode("ascii"))
            return digest.hexdigest()
    return hashlib.sha256(canonical_json_bytes(part)).hexdigest()


def _digest_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text":
        # Every field as sent (``cache_control``, a missing ``text``...): all of it reaches the
        # wire, so all of it is part of the key. ``{"type", "text"}`` parts are unchanged.
        return dict(part)
    kind = part.get("type", "part") if isinstance(part, Mapping) else type(part).__name__
    return {"type": kind, "sha256": part_sha256(part)}


def digest_message(message: Message) -> dict[str, Any]:
    """One message with multimodal parts replaced by ``{"type", "sha256"}``."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str):
        out["content"] = [_digest_part(p) for p in content]
    return out


def digest_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [digest_message(m) for m in messages]


def _text_only(messages: Any) -> bool:
    """A list (or tuple) of plain dicts with ``str`` keys and ``str`` or ``None`` values, the
    usual request: digesting changes nothing and orjson's output is canonical. One pass
    instead of ``digest_messages`` then ``_orjson_exact``, as this runs on every call."""
    if type(messages) is not list and type(messages) is not tuple:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        for key, value in message.items():
            if type(key) is not str or (type(value) is not str and value is not None):
                return False
    return True


def _canonical_messages_bytes(messages: Sequence[Message]) -> bytes:
    fast = _orjson_sorted(messages) if _text_only(messages) else None
    return fast if fast is not None else canonical_json_bytes(digest_messages(messages))


def canonical_messages_json(messages: Sequence[Message]) -> str:
    """``canonical_json(digest_messages(messages))``, the same string, faster: the telemetry
    ``messages`` column, and what the cache key's ``messages_digest`` hashes."""
    return _canonical_messages_bytes(messages).decode("utf-8")


def messages_digest(messages: Sequence[Message]) -> str:
    """sha256 of the digested messages: the ``messages_digest`` of the cache key formula."""
    return hashlib.sha256(_canonical_messages_bytes(messages)).hexdigest()
