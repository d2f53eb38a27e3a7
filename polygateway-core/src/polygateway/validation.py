"""Argument checks every backend shares, the Redis plugin included.

Bad input is refused the same way everywhere (``ValueError`` naming the argument), before any
state is touched. We refuse rather than clamp: a bad estimate or limit is a caller bug, and
clamping would silently charge the wrong amount of quota.
"""

from __future__ import annotations

import math
import operator
from typing import SupportsIndex

from polygateway.settings import Limits

MAX_TOKENS = 2**31 - 1
"""Largest token count a limiter accepts for ``est_tokens`` / ``settle``.

Far above any real request, and exact both as a Python int and as a Lua double (Redis).
"""


def check_token_count(value: object, what: str) -> int:
    """``value`` as an int in ``[0, MAX_TOKENS]``; otherwise ``ValueError`` naming ``what``.

    Refused: negatives, NaN/inf and other floats, bools, anything beyond ``MAX_TOKENS``.
    """
    if type(value) is int:
        if 0 <= value <= MAX_TOKENS:
            return value
    elif not isinstance(value, bool) and isinstance(value, SupportsIndex):
        as_int = operator.index(value)  # numpy integers and the like; never floats
        if 0 <= as_int <= MAX_TOKENS:
            return as_int
    raise ValueError(f"{what} must be an integer in [0, {MAX_TOKENS}], got {value!r}")


def check_limits(limits: Limits, what: str) -> None:
    """Every gate of ``limits`` is an int >= 0 (0 disables the gate)."""
    for field_name in ("max_concurrency", "rpm", "tpm"):
        value = getattr(limits, field_name)
        if type(value) is not int or value < 0:
            raise ValueError(
                f"{what}.{field_name} must be an integer >= 0 (0 disables the gate), got {value!r}"
            )


def check_threshold(value: object, what: str) -> int:
    """A breaker failure threshold: an int >= 1."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def check_max_cooldown(cooldown_s: float, max_cooldown_s: float | None) -> float:
    """The cap of a growing breaker cooldown: ``None`` means no growth (``cooldown_s``)."""
    if max_cooldown_s is None:
        return float(cooldown_s)
    if not (math.isfinite(max_cooldown_s) and max_cooldown_s >= cooldown_s):
        raise ValueError(
            f"max_cooldown_s must be a finite number >= cooldown_s ({cooldown_s:g}), "
            f"got {max_cooldown_s!r}"
        )
    return float(max_cooldown_s)


def grown_cooldown(cooldown_s: float, max_cooldown_s: float, streak: int) -> float:
    """The cooldown after ``streak`` failed probes in a row: doubling, capped."""
    return min(cooldown_s * 2.0 ** min(streak, 64), max_cooldown_s)


def check_ttl(ttl_s: object, what: str = "cache ttl_s") -> float:
    """``ttl_s`` as a float if it is a finite number > 0; else ``ValueError``.

    Entries that never expire are refused (ARCHITECTURE §7.5): a cache without expiry keeps
    serving an answer long after the model or prompt behind it changed.
    """
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not math.isfinite(ttl_s)
        or ttl_s <= 0
    ):
        raise ValueError(f"{what} must be a finite number > 0, got {ttl_s!r}")
    return float(ttl_s)
