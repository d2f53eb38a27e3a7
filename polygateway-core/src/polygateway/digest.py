"""Message digests shared by the cache key and telemetry (ARCHITECTURE §7.5, §7.8).

Text is kept verbatim; every non-text content part (base64 images, audio, files) is replaced
by the sha256 of its canonical JSON, so keys stay stable and databases hold no base64.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from polygateway.types import Message


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _digest_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text":
        return {"type": "text", "text": part.get("text", "")}
    kind = part.get("type", "part") if isinstance(part, Mapping) else type(part).__name__
    return {"type": kind, "sha256": sha256_hex(canonical_json(part))}


def digest_message(message: Message) -> dict[str, Any]:
    """One message with multimodal parts replaced by ``{"type", "sha256"}``."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, Sequence) and not isinstance(content, str):
        out["content"] = [_digest_part(p) for p in content]
    return out


def digest_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [digest_message(m) for m in messages]


def messages_digest(messages: Sequence[Message]) -> str:
    """sha256 of the digested messages: the ``messages_digest`` of the cache key formula."""
    return sha256_hex(canonical_json(digest_messages(messages)))
