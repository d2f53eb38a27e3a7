"""Several real processes sharing one Redis: exact admission, one probe, the governed client."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
from collections.abc import AsyncIterator, Callable
from typing import Any

import pgw_redis_test_workers as workers
import pytest
from pgw_redis.keys import scope_tag
from pgw_redis.testing import RedisGovernanceBackend, make_governance_backend
from polygateway.testing import Reply

pytestmark = pytest.mark.redis

_SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
async def backend(redis_url: str, unique_scope: str) -> AsyncIterator[RedisGovernanceBackend]:
    made = make_governance_backend(redis_url, unique_scope)
    try:
        yield made
    finally:
        await made.cleanup()


def _run_processes(
    count: int, target: Callable[..., None], *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Start ``count`` processes on ``target(barrier, results, *args)``; collect one result each."""
    barrier = _SPAWN.Barrier(count)
    results = _SPAWN.Queue()
    processes = [
        _SPAWN.Process(target=target, args=(barrier, results, *args)) for _ in range(count)
    ]
    for process in processes:
        process.start()
    try:
        collected = [results.get(timeout=timeout_s) for _ in range(count)]
    except queue.Empty:
        pytest.fail("a worker process did not report in time")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    return collected


async def _window_headroom(backend: RedisGovernanceBackend, need_s: float) -> None:
    now = await backend.window_time()
    left = 60.0 - now % 60.0
    if left < need_s:
        await asyncio.sleep(left + 0.05)


async def test_four_processes_of_fifty_tasks_admit_exactly_the_rpm(
    backend: RedisGovernanceBackend,
) -> None:
    await _window_headroom(backend, 10.0)
    admitted = await asyncio.to_thread(
        _run_processes, 4, workers.admit_many, backend.redis_url, backend.scope, 50
    )
    assert sum(admitted) == 5


@pytest.mark.slow
def test_twenty_processes_racing_open_to_half_open_get_one_probe_owner(
    redis_url: str, unique_scope: str
) -> None:
    from pgw_redis.breaker import RedisGate
    from pgw_redis.connection import connect

    async def open_gate() -> None:
        gate = RedisGate(
            connect(redis_url), scope=unique_scope, fail_threshold=3, cooldown_s=0.0,
            probe_ttl_s=60.0, owns_client=True,
        )  # fmt: skip
        await gate.force_open("a")
        await gate.aclose()

    asyncio.run(open_gate())
    decisions = _run_processes(20, workers.race_for_the_probe, redis_url, unique_scope)
    owners = [owner for allowed, owner in decisions if allowed]
    assert len(owners) == 1 and owners[0]
    assert sum(1 for allowed, _ in decisions if not allowed) == 19
    asyncio.run(_cleanup(redis_url, unique_scope))


async def _cleanup(redis_url: str, scope: str) -> None:
    await make_governance_backend(redis_url, scope).cleanup()


@pytest.mark.slow
async def test_four_worker_processes_share_concurrency_and_rpm_through_the_client(
    backend: RedisGovernanceBackend, fake_upstream: Any
) -> None:
    """4 x 50 concurrent chats, global concurrency 8, global RPM 150: the RPM makes the last
    calls wait for the next minute, the concurrency cap holds at the upstream, and nothing is
    left behind."""
    fake_upstream.set_default("a", Reply.ok(content="pong", first_token_delay=0.05))
    rpm = 150
    url = fake_upstream.base_url("a")
    outcomes = await asyncio.to_thread(
        _run_processes, 4, workers.chat_many, url, backend.redis_url, backend.scope, 50, 8, rpm,
        timeout_s=150.0,
    )  # fmt: skip
    flat = [o for worker in outcomes for o in worker]
    assert flat == ["pong"] * 200, [o for o in flat if o != "pong"][:3]
    assert fake_upstream.requests("a") == 200
    assert fake_upstream.max_inflight("a") == 8
    admin = backend._admin_client()
    tag = scope_tag(backend.scope)
    windows = {}
    async for key in admin.scan_iter(match=f"pgw:limit:{tag}:global:rpm:*"):
        windows[key] = int(await admin.get(key))
    assert sum(windows.values()) == 200
    assert all(count <= rpm for count in windows.values()), windows
    assert len(windows) >= 2  # the limit made the run span a minute boundary
    assert await admin.zcard(f"pgw:limit:{tag}:global:lease") == 0
