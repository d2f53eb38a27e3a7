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

Lengths are ``str.__len__`` and prefixes ``str.startswith``: a ``str`` subclass's own methods
have no say in the digest, which the characters alone define (as the stdlib encoder reads them).
Text that is not Unicode (a lone surrogate, which JSON's ``"\ud800"`` decodes to) has no UTF-8
form: the digests raise ``RequestRejectedError`` naming the message and part that hold it.

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

from polygateway.errors import RequestRejectedError
from polygateway.types import Message

_STDLIB_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
"""The definition of canonical JSON, the encoder built once (``json.dumps`` builds one per
call)."""
_STDLIB_CANONICAL = _STDLIB_ENCODER.encode

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


_LONG = 1
"""``_shape``: the value holds a string of ``STREAMED_MIN_CHARS`` or more."""
_DEEP = 2
"""``_shape``: the value nests deeper than ``_MAX_FAST_DEPTH``: the plain form."""


def _shape(value: Any, depth: int = 0) -> int:
    """``_LONG`` and ``_DEEP`` as they apply to ``value`` (the whole of it is looked at, so
    that a deep part is known before a long string of it is copied)."""
    if isinstance(value, str):
        return _LONG if str.__len__(value) >= STREAMED_MIN_CHARS else 0
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return 0
    if depth >= _MAX_FAST_DEPTH:
        return _DEEP
    shape = 0
    for item in items:
        shape |= _shape(item, depth + 1)
        if shape & _DEEP:
            break
    return shape


def _skeleton(value: Any, streamed: list[str | bytes]) -> Any:
    """``value`` with its long strings moved to ``streamed``, in the order canonical JSON
    writes them (dicts walked by sorted key, as the encoder sorts them)."""
    if isinstance(value, str):
        length = str.__len__(value)
        if length >= STREAMED_MIN_CHARS:
            if str.isascii(value):  # base64: its UTF-8 length is its length, known for free
                # A subclass's own methods have no say in the digest: its plain str.
                streamed.append(value if type(value) is str else str.__str__(value))
                return f"{_PLACEHOLDER}{length}"
            data = str.encode(value, "utf-8")
            streamed.append(data)
            return f"{_PLACEHOLDER}{len(data)}"
        if str.startswith(value, _ESCAPE):
            return _ESCAPE + str.__str__(value)
        return value
    if not isinstance(value, (dict, list, tuple)):
        return value
    # No deeper than _MAX_FAST_DEPTH: ``_shape`` saw to it.
    if isinstance(value, dict):
        return {key: _skeleton(value[key], streamed) for key in sorted(value)}
    return [_skeleton(item, streamed) for item in value]


def part_sha256(part: Any) -> str:
    """The ``sha256`` of a non-text part, in the form the module docstring defines."""
    shape = _shape(part)
    if shape == _LONG:
        streamed: list[str | bytes] = []
        skeleton = canonical_json_bytes(_skeleton(part, streamed))
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
    if shape & _DEEP:
        try:
            return _plain_form_in_pieces(part)
        except RecursionError:
            pass  # deeper than the pure-Python encoder goes: the one-shot encoder below
    return hashlib.sha256(canonical_json_bytes(part)).hexdigest()


def _plain_form_in_pieces(part: Any) -> str:
    """The plain form's sha256 of a part too deep for the streamed form, hashed as the
    encoder writes it: ``iterencode`` gives the one-shot encoder's text in pieces, so neither
    the whole JSON nor its UTF-8 is ever made (only a long string's escaped form, once).
    Code points are never split, so the pieces' UTF-8 is the whole's."""
    digest = hashlib.sha256()
    for piece in _STDLIB_ENCODER.iterencode(part):
        if len(piece) <= HASH_PIECE_CHARS:
            digest.update(piece.encode("utf-8"))
            continue
        for start in range(0, len(piece), HASH_PIECE_CHARS):
            digest.update(piece[start : start + HASH_PIECE_CHARS].encode("utf-8"))
    return digest.hexdigest()


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
    """A list (or tuple) of plain dicts with ``str`` or ``None`` values, the usual request:
    digesting changes nothing and orjson's sorted output, when it gives one, is canonical.
    Keys are left to orjson, which refuses any key that is not exactly a ``str`` (the plain
    path then runs). One pass instead of ``digest_messages`` then ``_orjson_exact``, as this
    runs on every call."""
    if type(messages) is not list and type(messages) is not tuple:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        for value in message.values():
            if type(value) is not str and value is not None:
                return False
    return True


def _canonical_messages_bytes(messages: Sequence[Message]) -> bytes:
    try:
        fast = _orjson_sorted(messages) if _text_only(messages) else None
        return fast if fast is not None else canonical_json_bytes(digest_messages(messages))
    except UnicodeEncodeError:
        reject_lone_surrogates(messages)
        raise  # not text of the messages (a str subclass's own encoding): as before


def _lone_surrogate(value: Any, path: str, depth: int = 0) -> str | None:
    """Where in ``value`` (named ``path``) the first text that is not Unicode is, or None."""
    if isinstance(value, str):
        try:
            str.encode(value, "utf-8")
        except UnicodeEncodeError as exc:
            code = ord(str.__getitem__(value, exc.start))
            return f"{path}: a lone surrogate U+{code:04X} at character {exc.start}"
        return None
    if depth > _MAX_SEARCH_DEPTH:
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and str.isidentifier(key):
                name = f"{path}.{str.__str__(key)}"
            else:
                name = f"{path}[{repr(key)[:40]}]"
            found = _lone_surrogate(key, f"{path} (a key)", depth + 1) or _lone_surrogate(
                item, name, depth + 1
            )
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{index}]", depth + 1)
            if found is not None:
                return found
    return None


_MAX_SEARCH_DEPTH = 256
"""How deep ``reject_lone_surrogates`` looks (deeper text fails the encoders as it did)."""


def reject_lone_surrogates(messages: Sequence[Message]) -> None:
    """``RequestRejectedError`` naming the message and part whose text is not Unicode (a lone
    surrogate has no UTF-8 form: it can be neither hashed nor sent); nothing when all is text.

    Called once encoding failed: the search costs nothing on the usual path."""
    for index, message in enumerate(messages):
        found = _lone_surrogate(message, f"messages[{index}]")
        if found is not None:
            raise RequestRejectedError(
                f"{found} is not valid Unicode text (no UTF-8 form): pair it or remove it"
            )


def canonical_messages_json(messages: Sequence[Message]) -> str:
    """``canonical_json(digest_messages(messages))``, the same string, faster: the telemetry
    ``messages`` column, and what the cache key's ``messages_digest`` hashes.
    ``RequestRejectedError`` when a text is not Unicode (``reject_lone_surrogates``)."""
    return canonical_messages_utf8(messages).decode("utf-8")


def canonical_messages_utf8(messages: Sequence[Message]) -> bytes:
    """``canonical_messages_json(messages).encode("utf-8")``, without the detour through
    ``str``: what the cache key's ``messages_digest`` hashes.
    ``RequestRejectedError`` when a text is not Unicode (``reject_lone_surrogates``)."""
    if _text_only(messages):  # the usual request, here without two more calls
        try:
            return orjson.dumps(messages, option=_SORTED)
        except orjson.JSONEncodeError:
            pass  # the plain path gives the verdict
    return _canonical_messages_bytes(messages)


def messages_digest(messages: Sequence[Message]) -> str:
    """sha256 of the digested messages: the ``messages_digest`` of the cache key formula.
    ``RequestRejectedError`` when a text is not Unicode (``reject_lone_surrogates``)."""
    return hashlib.sha256(_canonical_messages_bytes(messages)).hexdigest()
