"""Several real processes sharing one Redis: exact admission, one probe, the governed client."""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import queue
import time
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


async def _flap_from_the_first_call(fake: Any, down_s: float) -> float:
    """The primary is down; its outage window starts with the fleet's first call (spawned
    processes take a while to start on a busy machine). Returns that start (server clock)."""
    fake.set_default("primary", Reply.error(503))
    await fake.wait_for_requests(1, "primary", timeout=120.0)
    fake.flap("primary", down=Reply.error(503), down_s=down_s, up_s=3600.0)
    return float(time.monotonic())  # the fake upstream runs on this process's system clock


@pytest.mark.slow
async def test_three_processes_probe_a_flapping_primary_once_per_cooldown(
    backend: RedisGovernanceBackend, fake_upstream: Any
) -> None:
    """The flapping scenario across a fleet: while the primary is down, the Redis breaker lets
    one probe through per cooldown for the whole scope, whichever process holds it; after it
    recovers every process is back on it within one cooldown."""
    cooldown_s, down_s, run_s = 1.0, 8.0, 11.0
    flapping = asyncio.create_task(_flap_from_the_first_call(fake_upstream, down_s))
    served = await asyncio.to_thread(
        _run_processes, 3, workers.chat_through_a_flap, fake_upstream.base_url("primary"),
        fake_upstream.base_url("fallback"), backend.redis_url, backend.scope, cooldown_s, run_s,
        cooldown_s * 2,  # grows once: the 8 s outage still sees several probes
        timeout_s=90.0,
    )  # fmt: skip
    flap_start = await flapping
    down = [r.at for r in fake_upstream.received("primary") if r.at < flap_start + down_s]
    assert down, "the primary was never tried while down"
    # The first calls of the processes race the breaker's opening (at most one each); after
    # that only probes reach the down primary, one per cooldown for the whole fleet.
    burst = [t for t in down if t < down[0] + 0.5]
    probes = down[len(burst) :]
    assert len(burst) <= 3, burst
    assert probes, "no probe while the primary was down"
    gaps = [b - a for a, b in itertools.pairwise([burst[-1], *probes])]
    assert all(gap >= cooldown_s * 0.9 for gap in gaps), gaps
    assert len(probes) <= down_s / cooldown_s + 1
    # Recovered: every process is back on the primary.
    assert all(worker[-1] == "primary" for worker in served), [w[-3:] for w in served]


@pytest.mark.slow
async def test_three_idle_processes_send_one_health_probe_per_growing_cooldown(
    backend: RedisGovernanceBackend, fake_upstream: Any
) -> None:
    """Background health probes across a fleet: the processes stop calling once the primary's
    breaker is open; only their health probes reach it, one per cooldown (doubling) for the
    whole scope, and the one after the recovery closes the breaker for every process before
    any of them calls again."""
    cooldown_s, max_cooldown_s, down_s, calls_s, run_s = 0.5, 2.0, 5.0, 0.6, 9.0
    flapping = asyncio.create_task(_flap_from_the_first_call(fake_upstream, down_s))
    served = await asyncio.to_thread(
        _run_processes, 3, workers.chat_through_a_flap, fake_upstream.base_url("primary"),
        fake_upstream.base_url("fallback"), backend.redis_url, backend.scope, cooldown_s, run_s,
        max_cooldown_s, True, calls_s,
        timeout_s=90.0,
    )  # fmt: skip
    flap_start = await flapping
    received = fake_upstream.received("primary")
    probes = [r.at for r in received if r.body.get("max_completion_tokens") == 1]
    calls = [r.at for r in received if r.body.get("max_completion_tokens") != 1]
    assert probes, "no health probe reached the primary"
    # While the processes idle, nothing but the probes reaches the primary, and the fleet's
    # probes are one per cooldown in force: 0.5 s doubling to 2 s.
    idle = [t for t in calls if flap_start + calls_s + 0.5 < t < flap_start + run_s - 0.2]
    assert idle == [], idle
    # The probes up to the first after the recovery, which closes the breaker. Another
    # process's probe loop that found the breaker not yet closed just before may still send
    # its request (through the closed breaker, an ordinary call to a primary that serves):
    # no probe of the breaker's, and not one of the cooldown's.
    recovery = next((t for t in probes if t >= flap_start + down_s), math.inf)
    gaps = [b - a for a, b in itertools.pairwise(t for t in probes if t <= recovery)]
    assert all(gap >= cooldown_s * 0.9 for gap in gaps), gaps
    assert all(gap <= max_cooldown_s + 1.0 for gap in gaps), gaps
    assert len(probes) <= 2 + (run_s - 1.5) / max_cooldown_s + 1, probes
    # The probe after the recovery closed the breaker with no call; every process then sees
    # it closed and is served by the primary.
    assert any(t >= flap_start + down_s for t in probes), probes
    for worker in served:
        assert worker[-2:] == ["closed", "primary"], worker[-3:]
