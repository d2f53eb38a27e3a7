"""Key layout. Every key of one scope carries the scope as its Redis Cluster hash tag.

    pgw:limit:{<scope>}:global:lease              ZSET  lease id -> expiry (server ms)
    pgw:limit:{<scope>}:global:rpm:<window>       STRING requests in that minute
    pgw:limit:{<scope>}:global:tpm:<window>       STRING tokens in that minute
    pgw:limit:{<scope>}:global:progress_ms        STRING server ms of the last completed call
    pgw:limit:{<scope>}:global:abandoned          ZSET  lease ids given up before admission
    pgw:limit:{<scope>}:global:settled:<window>   SET   lease ids whose TPM correction ran
    pgw:limit:{<scope>}:global:hold_ms            STRING typical lease hold time (moving average)
    pgw:limit:{<scope>}:source:<source>:lease     ZSET
    pgw:limit:{<scope>}:source:<source>:rpm:<window>
    pgw:limit:{<scope>}:source:<source>:tpm:<window>
    pgw:limit:{<scope>}:source:<source>:hold_ms
    pgw:gate:{<scope>}:<source>                   HASH  breaker state of one source

A breaker handed to another scope's client keeps that scope's sources under that scope's tag
(``RedisGate.for_scope``); a shared limiter keys another scope's sources ``<scope>:<name>``
under its own tag (``RedisLimiter.claim_scope``).

``<window>`` is ``floor(server_seconds / 60)``. All keys of a scope hash to one slot, so every
script (which touches one scope only) runs unchanged on Redis Cluster; the price is that one
scope lives on one node.

Names are percent-encoded (UTF-8, everything but ``A-Z a-z 0-9 _ . - ~``) before they enter a
key: a ``{`` or ``}`` in a name cannot move the hash tag, a ``:`` cannot forge another key's
segments, and since ``%`` itself is encoded two different names never share a key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

LIMIT_PREFIX = "pgw:limit:"
GATE_PREFIX = "pgw:gate:"


def encode_name(name: str, what: str) -> str:
    """The key-safe, injective form of a scope or source name; ``ValueError`` if unusable."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty string, got {name!r}")
    return quote(name, safe="")


def scope_tag(scope: str) -> str:
    """``{<encoded scope>}``: the hash tag shared by every key of the scope."""
    return "{" + encode_name(scope, "scope") + "}"


@dataclass(frozen=True, slots=True)
class SourceKeys:
    """The limiter keys of one source (window keys are built per call from the bases)."""

    lease: str
    rpm_base: str
    """Append the window id to get the key."""
    tpm_base: str
    hold: str
    """Typical hold time of the source's leases (ms), the concurrency gate's wait hint."""


@dataclass(frozen=True, slots=True)
class LimiterKeys:
    """The scope-wide limiter keys of one scope."""

    tag: str
    lease: str
    rpm_base: str
    tpm_base: str
    progress: str
    abandoned: str
    settled_base: str
    """Append the acquire-time window id to get the key."""
    hold: str
    """Typical hold time of the scope's leases (ms)."""

    @classmethod
    def for_scope(cls, scope: str) -> LimiterKeys:
        base = f"{LIMIT_PREFIX}{scope_tag(scope)}:"
        return cls(
            tag=scope_tag(scope),
            lease=base + "global:lease",
            rpm_base=base + "global:rpm:",
            tpm_base=base + "global:tpm:",
            progress=base + "global:progress_ms",
            abandoned=base + "global:abandoned",
            settled_base=base + "global:settled:",
            hold=base + "global:hold_ms",
        )

    def source(self, source: str) -> SourceKeys:
        base = f"{LIMIT_PREFIX}{self.tag}:source:{encode_name(source, 'source name')}:"
        return SourceKeys(
            lease=base + "lease",
            rpm_base=base + "rpm:",
            tpm_base=base + "tpm:",
            hold=base + "hold_ms",
        )


def gate_key(scope_tag_: str, source: str) -> str:
    """The breaker HASH of one source of the scope whose tag is ``scope_tag_``."""
    return f"{GATE_PREFIX}{scope_tag_}:{encode_name(source, 'source name')}"


def new_id() -> str:
    """A fresh probe id: 128 random bits as 32 hex digits, unique across processes
    (``uuid.uuid4().hex``, which adds only version bits, costs eight times the CPU)."""
    return os.urandom(16).hex()


LEASE_ID_LENGTH: Final = 65
"""One more than Redis's default ``zset-max-listpack-value`` (64 bytes). A member that long
keeps a sorted set in its skiplist encoding, so the lease sets are found, added to and removed
from in O(log n): in their compact listpack encoding every ZSCORE, ZADD and ZREM scans and
decodes the whole set, which costs the server about a quarter more per governed call with 64
calls in flight (``tools/bench/RESULTS.md``)."""


def new_lease_id() -> str:
    """A fresh lease id: 260 random bits as ``LEASE_ID_LENGTH`` hex digits."""
    return os.urandom(33).hex()[1:]
