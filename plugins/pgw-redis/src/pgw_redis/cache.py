"""The Redis response cache backend (``ports.CacheBackend``; ARCHITECTURE §7.5).

The cache layer hands over complete keys, ``pgw:cache:<sha256>`` (the hash covers model,
messages digest, namespace, salt), so by default they are stored as given; ``prefix`` puts
another string in front of every key (e.g. to separate applications sharing one Redis).

Every entry is written with ``SET ... PX`` in one command, so no entry ever exists without a
TTL, and a TTL is required (finite, > 0). Redis trouble degrades silently: ``get`` answers
``None`` (a miss) and ``set`` drops the entry, each with one warning per outage. On Redis
Cluster each entry lives on the node of its own key (no hash tag: entries are independent).
"""

from __future__ import annotations

import asyncio
import logging
import math

from polygateway.validation import check_ttl

from pgw_redis._warn import WarnOnce
from pgw_redis.connection import BACKEND_ERRORS, RedisClient, as_text, initialize_cluster

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = ""


class RedisCache:
    """``CacheBackend`` on Redis. ``aclose()`` closes ``client`` only if ``owns_client``."""

    __slots__ = ("_client", "_closed", "_owns_client", "_prefix", "_ready", "_ready_lock", "_warn")

    def __init__(
        self, client: RedisClient, *, prefix: str = DEFAULT_PREFIX, owns_client: bool = False
    ) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"RedisCache prefix must be a str, got {type(prefix).__name__}")
        self._client = client
        self._prefix = prefix
        self._owns_client = owns_client
        self._closed = False
        self._ready = False
        self._ready_lock = asyncio.Lock()
        self._warn = WarnOnce(logger, "Redis cache")

    def redis_key(self, key: str) -> str:
        """The Redis key an entry of ``key`` is stored under."""
        return self._prefix + key

    async def get(self, key: str) -> str | None:
        try:
            if not self._ready:
                await self._get_ready()
            value = await self._client.get(self._prefix + key)
        except BACKEND_ERRORS as exc:
            self._warn.failed("get", exc, "treated as a miss")
            return None
        self._warn.succeeded()
        return None if value is None else as_text(value)

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        ttl_ms = _ttl_ms(ttl_s)
        try:
            if not self._ready:
                await self._get_ready()
            await self._client.set(self._prefix + key, value, px=ttl_ms)
        except BACKEND_ERRORS as exc:
            self._warn.failed("set", exc, "entry not cached")
            return
        self._warn.succeeded()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()

    async def _get_ready(self) -> None:
        async with self._ready_lock:
            if not self._ready:
                await initialize_cluster(self._client)
                self._ready = True

    def __repr__(self) -> str:
        return f"RedisCache(prefix={self._prefix!r})"


def _ttl_ms(ttl_s: object) -> int:
    """``ttl_s`` in whole milliseconds (at least 1); ``ValueError`` unless finite and > 0."""
    return max(1, math.ceil(check_ttl(ttl_s) * 1000.0))
