"""In-process response cache: a bounded LRU with a mandatory TTL per entry.

Expiry runs on the injected clock (deterministic tests). Expired entries are dropped when read
and, as the least recently used, evicted first when the cache is full, so no sweeper task is
needed.
"""

from __future__ import annotations

from collections import OrderedDict

from polygateway.ports import Clock
from polygateway.validation import check_ttl

_UNCHECKED = object()


class MemoryCache:
    """``CacheBackend`` for one process. Never fails, so it never needs to degrade.

    ``get``/``set`` and ``get_nowait``/``set_nowait`` are the same operations on string
    entries, ``get_object``/``set_object`` (``ports.SupportsCacheObjects``) on entries of any
    value; the cache layer prefers the last pair, so a subclass that changes one pair must
    change all three.
    """

    __slots__ = (
        "_checked_ttl",
        "_checked_ttl_s",
        "_clock",
        "_deadlines",
        "_monotonic",
        "_values",
        "max_entries",
    )

    def __init__(self, *, clock: Clock, max_entries: int = 10000) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"MemoryCache max_entries must be an int >= 1, got {max_entries!r}")
        self._clock = clock
        self._monotonic = clock.monotonic  # bound once: read at every store and hit
        self.max_entries = max_entries
        # key -> value, in order of use (oldest first), and key -> monotonic deadline: two maps
        # of plain values, not one of (deadline, value) tuples. A tuple per entry is an object
        # the garbage collector counts until its next pass, and with every call a miss, one
        # more per call held: a young collection every few hundred calls, each walking every
        # call in flight.
        self._values: OrderedDict[str, object] = OrderedDict()
        self._deadlines: dict[str, float] = {}
        # The last TTL that passed ``check_ttl``: the cache layer stores with the same float
        # object every time, so it is checked once (a number's value cannot change).
        self._checked_ttl: object = _UNCHECKED
        self._checked_ttl_s = 0.0

    async def get(self, key: str) -> str | None:
        return self.get_nowait(key)

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        self.set_nowait(key, value, ttl_s)

    # The cache layer calls these directly when a backend has them: the memory cache never
    # waits, and a coroutine per lookup and per store is a measurable share of a call.

    def get_nowait(self, key: str) -> str | None:
        """``get`` without a coroutine."""
        value = self.get_object(key)
        return value if isinstance(value, str) else None

    def set_nowait(self, key: str, value: str, ttl_s: float) -> None:
        """``set`` without a coroutine."""
        if not isinstance(value, str):
            raise TypeError(f"MemoryCache.set stores str values, got {type(value).__name__}")
        self.set_object(key, value, ttl_s)

    # ``ports.SupportsCacheObjects``: in one process a value needs no encoding. The cache
    # layer stores what a hit is built from, and spares a JSON encoding per miss.

    def get_object(self, key: str) -> object | None:
        """The value stored under ``key``; ``None`` when absent or expired."""
        value = self._values.get(key)
        if value is None:
            return None
        if self._deadlines[key] <= self._monotonic():
            del self._values[key], self._deadlines[key]
            return None
        self._values.move_to_end(key)
        return value

    def set_object(self, key: str, value: object, ttl_s: float) -> None:
        """Store ``value`` itself under ``key`` for ``ttl_s`` seconds."""
        if ttl_s is not self._checked_ttl:
            self._checked_ttl_s = check_ttl(ttl_s)
            self._checked_ttl = ttl_s
        deadline = self._monotonic() + self._checked_ttl_s
        if not isinstance(key, str) or value is None:
            raise TypeError(
                f"MemoryCache stores str keys and values other than None, got "
                f"{type(key).__name__} -> {type(value).__name__}"
            )
        values = self._values
        if key in values:
            values.move_to_end(key)  # a new key is inserted last already
        values[key] = value
        deadlines = self._deadlines
        deadlines[key] = deadline
        while len(values) > self.max_entries:
            del deadlines[values.popitem(last=False)[0]]

    def remaining_ttl_s(self, key: str) -> float | None:
        """Seconds until ``key`` expires; ``None`` when absent or already expired."""
        deadline = self._deadlines.get(key)
        if deadline is None:
            return None
        remaining = deadline - self._monotonic()
        return remaining if remaining > 0 else None

    def __len__(self) -> int:
        """Entries held, including expired ones not yet dropped."""
        return len(self._values)

    async def aclose(self) -> None:
        self._values.clear()
        self._deadlines.clear()

    def __repr__(self) -> str:
        return f"MemoryCache(entries={len(self._values)}, max_entries={self.max_entries})"


__all__ = ["MemoryCache", "check_ttl"]
