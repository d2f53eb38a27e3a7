"""The OpenAI embeddings answers: a deterministic vector per text, as floats or as base64
little-endian float32 (``encoding_format``), ``dimensions`` honoured, and ``data[]`` out of input
order by default, as proxies and compatible providers may answer (clients must sort by
``index``)."""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
from typing import Any, Final

from polygateway.testing.fake_upstream.replies import estimate_tokens
from polygateway.testing.fake_upstream.wire import Ask, dumps

DEFAULT_EMBEDDING_DIM: Final = 8
INVALID_INPUT_MESSAGE: Final = "'$.input' is invalid: it must be a non-empty string or array."


def embedding_vector(text: str, dim: int) -> list[float]:
    """A deterministic unit vector derived from ``text``, exactly representable in float32."""
    seed = text.encode("utf-8")
    raw = bytearray()
    block = 0
    while len(raw) < dim * 4:
        raw += hashlib.blake2b(seed, digest_size=64, salt=block.to_bytes(8, "little")).digest()
        block += 1
    values = [(word / 0xFFFFFFFF) * 2.0 - 1.0 for word in struct.unpack(f"<{dim}I", raw[: dim * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return list(struct.unpack(f"<{dim}f", struct.pack(f"<{dim}f", *(v / norm for v in values))))


def shuffled_order(count: int, serial: int) -> list[int]:
    """The order ``data[]`` lists the input indices in: a permutation that is the same for the
    same request serial and never the input order (for two items or more)."""
    order = list(range(count))
    random.Random(serial).shuffle(order)
    if count > 1 and order == sorted(order):
        order.reverse()
    return order


def _items(raw_input: Any) -> list[Any]:
    if isinstance(raw_input, str):
        return [raw_input]
    if isinstance(raw_input, list) and raw_input and isinstance(raw_input[0], int):
        return [raw_input]  # one token array
    if isinstance(raw_input, list):
        return raw_input
    return []


def embeddings_answer(ask: Ask) -> dict[str, Any] | None:
    """The answer body, or ``None`` for input the real API rejects (400, see
    ``INVALID_INPUT_MESSAGE``). ``Reply.empty()`` answers an empty ``data``;
    ``Reply.prompt_tokens`` overrides the usage."""
    reply, request_json = ask.reply, ask.body
    items = _items(request_json.get("input"))
    if not items or any(not item or not isinstance(item, str | list) for item in items):
        return None
    dimensions = request_json.get("dimensions")
    dim = dimensions if isinstance(dimensions, int) and dimensions > 0 else ask.embedding_dim
    as_base64 = request_json.get("encoding_format") == "base64"
    data: list[dict[str, Any]] = []
    prompt_tokens = 0
    if reply.kind != "empty":
        for index, item in enumerate(items):
            if isinstance(item, str):
                text = item
                prompt_tokens += estimate_tokens(item)
            else:
                text = dumps(item)
                prompt_tokens += len(item)
            vector = embedding_vector(text, dim)
            encoded: list[float] | str = (
                base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode("ascii")
                if as_base64
                else vector
            )
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        if ask.shuffle_embeddings:
            data = [data[index] for index in shuffled_order(len(data), ask.serial)]
    if reply.prompt_tokens is not None:
        prompt_tokens = reply.prompt_tokens
    return {
        "object": "list",
        "model": ask.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


__all__ = [
    "DEFAULT_EMBEDDING_DIM",
    "INVALID_INPUT_MESSAGE",
    "embedding_vector",
    "embeddings_answer",
    "shuffled_order",
]
