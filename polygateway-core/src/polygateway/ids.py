"""Identifiers. One generator for every ``call_id`` so they all have the same form."""

from __future__ import annotations

import random

# Version 4 and the RFC 4122 variant, set over 128 random bits.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def new_call_id() -> str:
    """A random UUID4 as 32 hex digits (the form of ``uuid.uuid4().hex``).

    The bits come from ``random``, not ``os.urandom``: a call id must be unique, not secret,
    and this runs on every attempt (a third of the cost, no system call). The ``random``
    module seeds itself from the OS and again in every forked child, so processes never share
    a sequence.
    """
    return f"{(random.getrandbits(128) & _UUID4_CLEAR) | _UUID4_SET:032x}"


def elapsed_ms(start_s: float, now_s: float) -> int:
    """Whole milliseconds between two monotonic readings, never negative."""
    return max(0, int((now_s - start_s) * 1000.0))
