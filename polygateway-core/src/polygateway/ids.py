"""Identifiers. One generator for every ``call_id`` so they all have the same form."""

from __future__ import annotations

import os
import time


def new_call_id() -> str:
    """A UUIDv7 (RFC 9562) as 32 hex digits: the Unix time in milliseconds, then 74 random bits.

    Time first, because ``call_id`` is the telemetry table's primary key: ids made in order
    land at the end of its index, where random ids spread every batch over most of its pages
    (SQLite's writer at 150,000-200,000 rows: about 9 µs a row against 32 µs; see
    ``tools/bench/sqlite_rows.py``). The random bits come from ``os.urandom``, never from the
    ``random`` module: a user's ``random.seed(42)`` would repeat ids, a forked child would
    repeat its parent's, and telemetry's ``INSERT OR IGNORE`` would then drop rows silently.
    """
    raw = bytearray((time.time_ns() // 1_000_000).to_bytes(6, "big") + os.urandom(10))
    raw[6] = (raw[6] & 0x0F) | 0x70  # version 7
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 9562 variant
    return raw.hex()


def elapsed_ms(start_s: float, now_s: float) -> int:
    """Whole milliseconds between two monotonic readings, never negative."""
    # A comparison, not ``max(0, ...)``: the builtin's generic argument handling costs more
    # than the rest of this function (measured: 0.7k instructions a call).
    ms = int((now_s - start_s) * 1000.0)
    return ms if ms > 0 else 0
