"""The cache backend contract (``ports.CacheBackend``), the same for every backend.

Subclass ``CacheContract`` in a test module and provide a ``make_cache`` fixture returning a
factory (sync or async) for a fresh backend::

    class TestMemoryCacheContract(CacheContract):
        @pytest.fixture
        def make_cache(self, cache_clock):
            return lambda: MemoryCache(clock=cache_clock)

``cache_clock`` is a ``FakeClock`` (override the fixture to share another). A backend whose
time is not injectable (Redis expires keys on the server's clock) sets
``supports_fake_time = False``: the expiry tests then use a short real TTL and wait for the
entry to disappear (about a second). A backend that can report a key's remaining TTL
overrides ``key_ttl_s`` so that "every entry expires" is checked directly (Redis: no key may
have ``TTL -1``).

A backend that also implements ``ports.SupportsCacheNowait`` (synchronous ``get_nowait`` /
``set_nowait``, which the cache layer then uses instead of a coroutine per lookup) has both
forms held to the same behaviour; the nowait tests skip for a backend without them. So has a
backend that implements ``ports.SupportsCacheObjects`` (entries kept as Python objects, in the
caller's process): its object entries expire, are refused a bad TTL and are told from string
entries as the port says.

Keys used here are unique per test run (``pgw:cache:contract:<uuid>:...``), so a shared
server needs no cleanup between tests; entries expire on their own.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from polygateway.ports import CacheBackend, SupportsCacheNowait, SupportsCacheObjects
from polygateway.testing.clock import FakeClock

REAL_TTL_S = 0.5
REAL_EXPIRY_DEADLINE_S = 5.0
ODD_KEY_PARTS = ("a", "a:b", "a:b:c", "{a}", "a}", "{", "a b", "line\nbreak", "源-1", "", ":")
BAD_TTLS: tuple[Any, ...] = (0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, None, "10", True)


class CacheContract:
    """Behaviour every ``CacheBackend`` shares (ARCHITECTURE §7.5)."""

    supports_fake_time: bool = True

    @pytest.fixture
    def cache_clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def make_cache(self) -> Any:
        raise NotImplementedError("subclass CacheContract and provide a make_cache fixture")

    @pytest.fixture
    async def cache(self, make_cache: Any) -> AsyncIterator[CacheBackend]:
        made = make_cache()
        backend: CacheBackend = await made if inspect.isawaitable(made) else made
        try:
            yield backend
        finally:
            await backend.aclose()

    @pytest.fixture
    def key_prefix(self) -> str:
        return f"pgw:cache:contract:{uuid.uuid4().hex}:"

    async def key_ttl_s(self, cache: CacheBackend, key: str) -> float | None:
        """Remaining TTL of ``key`` in seconds (``math.inf`` for "never expires").

        ``None`` means the backend cannot tell; the direct TTL check then skips.
        """
        return None

    # ------------------------------------------------------------------ basics

    async def test_missing_key_is_none(self, cache: CacheBackend, key_prefix: str) -> None:
        assert await cache.get(key_prefix + "missing") is None

    async def test_set_then_get_returns_the_value(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        value = '{"content":"héllo ✓","n":1}'
        await cache.set(key_prefix + "k", value, 60.0)
        assert await cache.get(key_prefix + "k") == value

    async def test_set_overwrites(self, cache: CacheBackend, key_prefix: str) -> None:
        await cache.set(key_prefix + "k", "first", 60.0)
        await cache.set(key_prefix + "k", "second", 60.0)
        assert await cache.get(key_prefix + "k") == "second"

    async def test_large_and_empty_values_round_trip(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        large = "x" * 1_000_000
        await cache.set(key_prefix + "large", large, 60.0)
        await cache.set(key_prefix + "empty", "", 60.0)
        assert await cache.get(key_prefix + "large") == large
        assert await cache.get(key_prefix + "empty") == ""

    async def test_keys_with_delimiters_do_not_collide(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        keys = [key_prefix + part for part in ODD_KEY_PARTS]
        keys += [key_prefix + "a:" + part for part in ODD_KEY_PARTS]
        assert len(set(keys)) == len(keys)
        for index, key in enumerate(keys):
            await cache.set(key, f"value-{index}", 60.0)
        for index, key in enumerate(keys):
            assert await cache.get(key) == f"value-{index}", f"key {key!r} was overwritten"

    async def test_concurrent_writers_and_readers(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        async def write(i: int) -> None:
            await cache.set(f"{key_prefix}c{i}", str(i), 60.0)

        await asyncio.gather(*(write(i) for i in range(50)))
        values = await asyncio.gather(*(cache.get(f"{key_prefix}c{i}") for i in range(50)))
        assert values == [str(i) for i in range(50)]

    # ------------------------------------------------------------------ TTL

    @pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
    async def test_ttl_is_required_and_positive(
        self, cache: CacheBackend, key_prefix: str, ttl: Any
    ) -> None:
        with pytest.raises(ValueError, match="ttl"):
            await cache.set(key_prefix + "k", "v", ttl)
        assert await cache.get(key_prefix + "k") is None

    async def test_entries_expire_after_their_ttl(
        self, cache: CacheBackend, cache_clock: FakeClock, key_prefix: str
    ) -> None:
        key = key_prefix + "expiring"
        if not self.supports_fake_time:
            await cache.set(key, "v", REAL_TTL_S)
            assert await cache.get(key) == "v"
            await _wait_until_gone(cache, key)
            return
        await cache.set(key, "v", 10.0)
        cache_clock.advance(9.9)
        assert await cache.get(key) == "v"
        cache_clock.advance(0.2)
        assert await cache.get(key) is None

    async def test_overwrite_restarts_the_ttl(
        self, cache: CacheBackend, cache_clock: FakeClock, key_prefix: str
    ) -> None:
        if not self.supports_fake_time:
            pytest.skip("needs an injectable clock")
        key = key_prefix + "renewed"
        await cache.set(key, "old", 10.0)
        cache_clock.advance(8.0)
        await cache.set(key, "new", 10.0)
        cache_clock.advance(8.0)
        assert await cache.get(key) == "new"
        cache_clock.advance(2.1)
        assert await cache.get(key) is None

    async def test_every_entry_has_a_finite_ttl(self, cache: CacheBackend, key_prefix: str) -> None:
        keys = [key_prefix + "ttl-a", key_prefix + "ttl:b"]
        await cache.set(keys[0], "v", 30.0)
        await cache.set(keys[1], "v", 30.0)
        await cache.set(keys[1], "v2", 30.0)  # an overwrite must keep an expiry too
        for key in keys:
            remaining = await self.key_ttl_s(cache, key)
            if remaining is None:
                pytest.skip("this backend cannot report a key's TTL")
            assert 0 < remaining <= 30.0, f"{key!r} has TTL {remaining!r}"

    # ------------------------------------------------------------------ SupportsCacheNowait

    async def test_nowait_forms_share_the_entries_of_the_async_ones(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        if not isinstance(cache, SupportsCacheNowait):
            pytest.skip("this backend does not implement ports.SupportsCacheNowait")
        assert cache.get_nowait(key_prefix + "missing") is None
        cache.set_nowait(key_prefix + "sync", "from set_nowait", 60.0)
        assert await cache.get(key_prefix + "sync") == "from set_nowait"
        await cache.set(key_prefix + "async", "from set", 60.0)
        assert cache.get_nowait(key_prefix + "async") == "from set"
        cache.set_nowait(key_prefix + "async", "overwritten", 60.0)
        assert await cache.get(key_prefix + "async") == "overwritten"

    @pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
    async def test_set_nowait_requires_a_positive_ttl(
        self, cache: CacheBackend, key_prefix: str, ttl: Any
    ) -> None:
        if not isinstance(cache, SupportsCacheNowait):
            pytest.skip("this backend does not implement ports.SupportsCacheNowait")
        with pytest.raises(ValueError, match="ttl"):
            cache.set_nowait(key_prefix + "k", "v", ttl)
        assert cache.get_nowait(key_prefix + "k") is None

    async def test_nowait_entries_expire_after_their_ttl(
        self, cache: CacheBackend, cache_clock: FakeClock, key_prefix: str
    ) -> None:
        if not isinstance(cache, SupportsCacheNowait):
            pytest.skip("this backend does not implement ports.SupportsCacheNowait")
        if not self.supports_fake_time:
            pytest.skip("needs an injectable clock")
        cache.set_nowait(key_prefix + "expiring", "v", 10.0)
        cache_clock.advance(9.9)
        assert cache.get_nowait(key_prefix + "expiring") == "v"
        cache_clock.advance(0.2)
        assert cache.get_nowait(key_prefix + "expiring") is None
        assert await cache.get(key_prefix + "expiring") is None

    # ------------------------------------------------------------------ SupportsCacheObjects

    async def test_object_entries_are_kept_as_they_are(
        self, cache: CacheBackend, key_prefix: str
    ) -> None:
        if not isinstance(cache, SupportsCacheObjects):
            pytest.skip("this backend does not implement ports.SupportsCacheObjects")
        kept = {"content": "héllo ✓", "prompt_tokens": 3}
        assert cache.get_object(key_prefix + "missing") is None
        cache.set_object(key_prefix + "object", kept, 60.0)
        assert cache.get_object(key_prefix + "object") is kept
        # An entry holds what was stored in it: the string forms read only strings.
        assert await cache.get(key_prefix + "object") is None
        if isinstance(cache, SupportsCacheNowait):
            assert cache.get_nowait(key_prefix + "object") is None
        await cache.set(key_prefix + "text", "a string", 60.0)
        assert cache.get_object(key_prefix + "text") == "a string"
        cache.set_object(key_prefix + "text", 42, 60.0)  # an overwrite changes the kind
        assert cache.get_object(key_prefix + "text") == 42
        assert await cache.get(key_prefix + "text") is None

    @pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
    async def test_set_object_requires_a_positive_ttl(
        self, cache: CacheBackend, key_prefix: str, ttl: Any
    ) -> None:
        if not isinstance(cache, SupportsCacheObjects):
            pytest.skip("this backend does not implement ports.SupportsCacheObjects")
        with pytest.raises(ValueError, match="ttl"):
            cache.set_object(key_prefix + "k", {"v": 1}, ttl)
        assert cache.get_object(key_prefix + "k") is None

    async def test_set_object_refuses_none(self, cache: CacheBackend, key_prefix: str) -> None:
        if not isinstance(cache, SupportsCacheObjects):
            pytest.skip("this backend does not implement ports.SupportsCacheObjects")
        with pytest.raises(TypeError):
            cache.set_object(key_prefix + "k", None, 60.0)
        assert cache.get_object(key_prefix + "k") is None

    async def test_object_entries_expire_after_their_ttl(
        self, cache: CacheBackend, cache_clock: FakeClock, key_prefix: str
    ) -> None:
        if not isinstance(cache, SupportsCacheObjects):
            pytest.skip("this backend does not implement ports.SupportsCacheObjects")
        if not self.supports_fake_time:
            pytest.skip("needs an injectable clock")
        cache.set_object(key_prefix + "expiring", ("v",), 10.0)
        cache_clock.advance(9.9)
        assert cache.get_object(key_prefix + "expiring") == ("v",)
        cache_clock.advance(0.2)
        assert cache.get_object(key_prefix + "expiring") is None

    async def test_aclose_is_idempotent(self, make_cache: Any) -> None:
        made = make_cache()
        backend: CacheBackend = await made if inspect.isawaitable(made) else made
        await backend.aclose()
        await backend.aclose()


async def _wait_until_gone(cache: CacheBackend, key: str) -> None:
    # Polls a condition with a deadline: real expiry has no event to wait on.
    deadline = time.monotonic() + REAL_EXPIRY_DEADLINE_S
    while await cache.get(key) is not None:
        assert time.monotonic() < deadline, f"{key!r} did not expire within the deadline"
        await asyncio.sleep(0.05)


__all__ = ["CacheContract"]
