"""Message digests shared by the cache key and telemetry (ARCHITECTURE §7.5, §7.8).

Text parts are kept verbatim, every field of them; every non-text content part (base64 images,
audio, files) is replaced by the sha256 of its canonical JSON, so keys stay stable and databases
hold no base64.

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


def _digest_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text":
        # Every field as sent (``cache_control``, a missing ``text``...): all of it reaches the
        # wire, so all of it is part of the key. ``{"type", "text"}`` parts are unchanged.
        return dict(part)
    kind = part.get("type", "part") if isinstance(part, Mapping) else type(part).__name__
    return {"type": kind, "sha256": hashlib.sha256(canonical_json_bytes(part)).hexdigest()}


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
