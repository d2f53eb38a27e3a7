"""Governance and cache backends shipped with the core (``memory``).

Helpers here are shared by every backend (the Redis plugin included) so that bad input is
refused the same way everywhere, before any state is touched.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex

MAX_TOKENS = 2**31 - 1
"""Largest token count a limiter accepts for ``est_tokens`` / ``settle``.

Far above any real request, and exact both as a Python int and as a Lua double (Redis).
"""


def check_token_count(value: object, what: str) -> int:
    """Return ``value`` as an int in ``[0, MAX_TOKENS]``; otherwise ``ValueError`` naming ``what``.

    Refused: negatives, NaN/inf and other floats, bools, anything beyond ``MAX_TOKENS``. We
    refuse rather than clamp: a bad estimate is a caller bug, and clamping would silently
    pre-charge the wrong amount of TPM quota.
    """
    if type(value) is int:
        if 0 <= value <= MAX_TOKENS:
            return value
    elif not isinstance(value, bool) and isinstance(value, SupportsIndex):
        as_int = operator.index(value)  # numpy integers and the like; never floats
        if 0 <= as_int <= MAX_TOKENS:
            return as_int
    raise ValueError(f"{what} must be an integer in [0, {MAX_TOKENS}], got {value!r}")
