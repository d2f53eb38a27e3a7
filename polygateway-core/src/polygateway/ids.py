"""Identifiers. One generator for every ``call_id`` so they all have the same form."""

from __future__ import annotations

import os


def new_call_id() -> str:
    """A random UUID4 as 32 hex digits (the form of ``uuid.uuid4().hex``).

    The bits come from ``os.urandom``, never from the ``random`` module: a user's
    ``random.seed(42)`` would repeat ids, and telemetry's ``INSERT OR IGNORE`` would then drop
    rows silently. Setting the version and variant bits on a bytearray costs about what
    ``random.getrandbits`` did (~1 µs) and a fifth of ``uuid.uuid4().hex``.
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    return raw.hex()


def elapsed_ms(start_s: float, now_s: float) -> int:
    """Whole milliseconds between two monotonic readings, never negative."""
    return max(0, int((now_s - start_s) * 1000.0))
