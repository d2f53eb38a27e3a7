"""The core's contract suites, unchanged, on Redis and on a 3-master Redis Cluster.

Time-dependent cases skip here (the server's clock cannot be moved); each has a real-wait
variant in ``test_redis_time.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pgw_redis.cache import RedisCache
from pgw_redis.connection import connect
from pgw_redis.testing import RedisGovernanceBackend, make_governance_backend
from polygateway.ports import CacheBackend
from polygateway.testing.contracts import BreakerContract, LimiterContract
from polygateway.testing.contracts.cache import CacheContract

pytestmark = pytest.mark.redis


@pytest.fixture
async def governance_backend(
    any_redis_url: str, unique_scope: str
) -> AsyncIterator[RedisGovernanceBackend]:
    backend = make_governance_backend(any_redis_url, unique_scope)
    try:
        yield backend
    finally:
        await backend.cleanup()


class TestRedisLimiterContract(LimiterContract):
    pass


class TestRedisBreakerContract(BreakerContract):
    pass


class TestRedisCacheContract(CacheContract):
    supports_fake_time = False

    @pytest.fixture
    def make_cache(self, any_redis_url: str) -> Any:
        return lambda: RedisCache(connect(any_redis_url), owns_client=True)

    async def key_ttl_s(self, cache: CacheBackend, key: str) -> float | None:
        assert isinstance(cache, RedisCache)
        ttl_ms = await cache._client.pttl(cache.redis_key(key))
        assert ttl_ms != -2, f"{key!r} does not exist"
        return float("inf") if ttl_ms == -1 else ttl_ms / 1000.0
