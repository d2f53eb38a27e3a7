"""Embedding answers -> vectors: decoding, ordering, shape checks, L2 normalisation.

Pure functions (no I/O), shared by every transport and by the client. Content that cannot be
used (empty ``data``, a vector per text missing or twice, vectors of different lengths, values
that are not finite numbers, a dimension other than the expected one) is a
``ResultInvalidError``: the source answered, the answer is unusable, the breaker is not told of
a failure.
"""

from __future__ import annotations

import binascii
import math
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from polygateway.errors import ResultInvalidError

NORM_FLOOR = 1e-12
"""``normalize`` divides by ``max(norm, NORM_FLOOR)``: a zero vector stays zero."""

_BIG_ENDIAN = sys.byteorder == "big"

# A little-endian float32 is NaN or infinite when its exponent bits are all ones: the low 7
# bits of its 4th byte and the high bit of its 3rd. Looking at the bytes (translate, C speed)
# costs about half of summing the decoded floats.
_EXPONENT_HIGH_FULL = bytes(1 if b & 0x7F == 0x7F else 0 for b in range(256))
_EXPONENT_LOW_SET = bytes(1 if b & 0x80 else 0 for b in range(256))


def _float32_nonfinite(raw: bytes) -> bool:
    high = raw[3::4].translate(_EXPONENT_HIGH_FULL)
    if 1 not in high:
        return False  # every value is below 2**127 in magnitude: the usual case
    low = raw[2::4].translate(_EXPONENT_LOW_SET)
    return any(hi and lo for hi, lo in zip(high, low, strict=True))


def _where(source_name: str | None) -> str:
    return f"source {source_name!r}: " if source_name else ""


def decode_base64_floats(text: str, *, source_name: str | None = None) -> list[float]:
    """A base64 string of little-endian float32 values (what ``encoding_format="base64"``
    returns, as the official SDK decodes it) as Python floats."""
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ResultInvalidError(
            f"{_where(source_name)}embedding is not valid base64: {exc}"
        ) from None
    if len(raw) % 4:
        raise ResultInvalidError(
            f"{_where(source_name)}base64 embedding has {len(raw)} bytes, not a whole number of "
            "float32 values"
        )
    if _float32_nonfinite(raw):
        raise ResultInvalidError(
            f"{_where(source_name)}base64 embedding holds values that are not finite numbers"
        )
    values = array("f")
    values.frombytes(raw)
    if _BIG_ENDIAN:  # pragma: no cover - the wire format is little-endian
        values.byteswap()
    return values.tolist()


def _vector(value: Any, position: int, source_name: str | None) -> list[float]:
    if isinstance(value, str):
        return decode_base64_floats(value, source_name=source_name)
    if isinstance(value, list):
        try:
            vector = array("d", value).tolist()
        except (TypeError, OverflowError):
            pass
        else:
            # NaN or infinity anywhere (or numbers too large for a float) makes the sum
            # non-finite: one pass in C.
            if not math.isfinite(sum(vector)):
                raise ResultInvalidError(
                    f"{_where(source_name)}data[{position}].embedding holds values that are "
                    "not finite numbers"
                )
            return vector
    raise ResultInvalidError(
        f"{_where(source_name)}data[{position}].embedding is neither a list of numbers nor a "
        f"base64 string (got {type(value).__name__})"
    )


def vectors_from_data(
    data: Any, count: int, *, source_name: str | None = None
) -> tuple[list[list[float]], int]:
    """The vectors of an embeddings answer's ``data`` in input order (sorted by ``index``:
    providers and proxies do not promise input order), and their common dimension.

    Exactly one item per input index ``0..count-1`` is required.
    """
    where = _where(source_name)
    if not isinstance(data, list):
        raise ResultInvalidError(
            f"{where}embeddings answer has no data list (got {type(data).__name__})"
        )
    if not data:
        raise ResultInvalidError(f"{where}embeddings answer has empty data for {count} texts")
    if len(data) != count:
        raise ResultInvalidError(
            f"{where}embeddings answer has {len(data)} vectors for {count} texts"
        )
    ordered: list[list[float] | None] = [None] * count
    for position, item in enumerate(data):
        index = item.get("index") if isinstance(item, dict) else None
        if type(index) is not int or not 0 <= index < count:
            raise ResultInvalidError(
                f"{where}data[{position}] has no valid index in 0..{count - 1} (got {index!r})"
            )
        if ordered[index] is not None:
            raise ResultInvalidError(f"{where}data has index {index} twice")
        ordered[index] = _vector(item.get("embedding"), position, source_name)
    vectors: list[list[float]] = ordered  # type: ignore[assignment]  # every slot was filled
    dim = len(vectors[0])
    if dim == 0:
        raise ResultInvalidError(f"{where}embeddings answer has an empty vector")
    for index, vector in enumerate(vectors):
        if len(vector) != dim:
            raise ResultInvalidError(
                f"{where}vectors of mixed length: index 0 has {dim} values, index {index} has "
                f"{len(vector)}"
            )
    return vectors, dim


def check_dimension(dim: int, expected_dim: int | None, *, source_name: str | None = None) -> None:
    """``ResultInvalidError`` when ``expected_dim`` is set and differs from ``dim``."""
    if expected_dim is not None and dim != expected_dim:
        raise ResultInvalidError(
            f"{_where(source_name)}vectors have dimension {dim}, expected {expected_dim}"
        )


def l2_normalize(vectors: Sequence[list[float]]) -> list[list[float]]:
    """Each vector divided by ``max(its L2 norm, NORM_FLOOR)`` (new lists)."""
    result: list[list[float]] = []
    for vector in vectors:
        norm = max(math.hypot(*vector), NORM_FLOOR)
        result.append([x / norm for x in vector])
    return result


__all__ = [
    "NORM_FLOOR",
    "check_dimension",
    "decode_base64_floats",
    "l2_normalize",
    "vectors_from_data",
]
