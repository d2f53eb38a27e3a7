"""MemoryCache: the cache contract on a fake clock, plus its LRU bound."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
from polygateway.backends.memory.cache import MemoryCache
from polygateway.ports import CacheBackend
from polygateway.testing import FakeClock
from polygateway.testing.contracts.cache import CacheContract


class TestMemoryCacheContract(CacheContract):
    @pytest.fixture
    def make_cache(self, cache_clock: FakeClock) -> Callable[[], MemoryCache]:
        return lambda: MemoryCache(clock=cache_clock)

    async def key_ttl_s(self, cache: CacheBackend, key: str) -> float | None:
        assert isinstance(cache, MemoryCache)
        return cache.remaining_ttl_s(key)


async def test_least_recently_used_entry_is_evicted_first() -> None:
    cache = MemoryCache(clock=FakeClock(), max_entries=3)
    for key in ("a", "b", "c"):
        await cache.set(key, key, 60.0)
    assert await cache.get("a") == "a"  # "b" is now the least recently used
    await cache.set("d", "d", 60.0)
    assert len(cache) == 3
    assert await cache.get("b") is None
    assert [await cache.get(k) for k in ("a", "c", "d")] == ["a", "c", "d"]


async def test_overwriting_does_not_grow_the_cache() -> None:
    cache = MemoryCache(clock=FakeClock(), max_entries=2)
    for _ in range(10):
        await cache.set("same", "v", 60.0)
    assert len(cache) == 1


async def test_expired_entries_are_dropped_when_read() -> None:
    clock = FakeClock()
    cache = MemoryCache(clock=clock)
    await cache.set("k", "v", 1.0)
    clock.advance(1.0)  # the deadline itself is already expired
    assert await cache.get("k") is None
    assert len(cache) == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_max_entries_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MemoryCache(clock=FakeClock(), max_entries=bad)  # type: ignore[arg-type]


async def test_non_string_values_are_refused() -> None:
    cache = MemoryCache(clock=FakeClock())
    with pytest.raises(TypeError, match="str"):
        await cache.set("k", b"bytes", 1.0)  # type: ignore[arg-type]


def test_entries_hold_no_object_the_garbage_collector_tracks(collector_paused: None) -> None:
    # Every miss of a busy client stores an entry: an object per entry that the collector
    # tracks would set off a young collection every few hundred calls.
    cache = MemoryCache(clock=FakeClock(), max_entries=100)
    keys = [f"key-{i}" for i in range(1000)]
    values = [f"value-{i}" for i in range(1000)]
    gc.collect()
    before = gc.get_count()[0]
    for key, value in zip(keys, values, strict=True):
        cache.set_nowait(key, value, 60.0)  # evicting past 100 entries, too
        assert cache.get_nowait(key) == value
    grown = gc.get_count()[0] - before
    assert grown < 10, f"{grown} tracked objects allocated and kept by 1000 stores"
    assert len(cache) == 100
    assert cache.get_nowait("key-899") is None and cache.get_nowait("key-999") == "value-999"


async def test_an_expired_entry_is_gone_from_both_maps_and_can_be_stored_again() -> None:
    clock = FakeClock()
    cache = MemoryCache(clock=clock, max_entries=2)
    await cache.set("a", "old", 5.0)
    clock.advance(5.0)
    assert cache.remaining_ttl_s("a") is None
    assert await cache.get("a") is None and len(cache) == 0
    await cache.set("a", "new", 5.0)
    await cache.set("b", "b", 5.0)
    await cache.set("c", "c", 5.0)  # evicts "a", its deadline with it
    assert len(cache) == 2 and cache.remaining_ttl_s("a") is None
    assert await cache.get("a") is None


async def test_object_and_string_entries_share_one_bound() -> None:
    cache = MemoryCache(clock=FakeClock(), max_entries=2)
    cache.set_object("a", {"content": "x"}, 60.0)
    await cache.set("b", "b", 60.0)
    assert cache.get_object("a") == {"content": "x"}  # "b" is now the least recently used
    cache.set_object("c", ("c",), 60.0)
    assert len(cache) == 2
    assert await cache.get("b") is None
    assert cache.get_object("c") == ("c",)
