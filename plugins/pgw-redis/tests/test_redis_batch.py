"""Batched admissions and the joint gate + admission step, on a real Redis.

Admissions of one limiter queued in the same loop turn go in one script call (with the queued
accounting in front); a breaker and a limiter of one scope on one server are asked in one step
(``RedisLimiter.joint_with``). Counts are the server's (``INFO commandstats``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pgw_redis.breaker import RedisGate
from pgw_redis.connection import connect
from pgw_redis.limiter import (
    MAX_BATCH_ACCOUNTING,
    SMALL_BATCH_ADMISSIONS,
    RedisLimiter,
    same_server,
)
from pgw_redis_test_helpers import RedisServer, gateway_settings, wait_until
from polygateway.backends.memory import InMemoryGate
from polygateway.clock import SystemClock
from polygateway.errors import GovernanceBackendError
from polygateway.ports import Denial, GateDecision, JointAdmission, Permit
from polygateway.settings import Limits
from redis.asyncio import Redis

pytestmark = pytest.mark.redis

NO_LIMITS = Limits()


async def _script_calls(admin: Any) -> int:
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture
async def admin(spare_redis: RedisServer) -> AsyncIterator[Any]:
    client = Redis.from_url(spare_redis.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


def _limiter(url: str, limits: Limits, scope: str = "S", **kwargs: Any) -> RedisLimiter:
    return RedisLimiter(
        connect(url), scope=scope, global_limits=limits, lease_ttl_s=30.0, owns_client=True,
        **kwargs,
    )  # fmt: skip


def _gate(url: str, scope: str = "S", cooldown_s: float = 30.0) -> RedisGate:
    return RedisGate(
        connect(url), scope=scope, fail_threshold=1, cooldown_s=cooldown_s, probe_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip


async def _admit_together(limiter: RedisLimiter, admin: Any, count: int) -> list[Any]:
    """``count`` admissions queued in one turn, once the scripts are loaded and the server's
    command counts reset."""
    await (await limiter.try_acquire("a", 1, NO_LIMITS)).release()  # type: ignore[union-attr]
    await limiter.flush()
    await admin.config_resetstat()
    return list(
        await asyncio.gather(*(limiter.try_acquire("a", 1, NO_LIMITS) for _ in range(count)))
    )


@pytest.mark.parametrize(
    ("waiting", "limit", "script_calls"),
    [
        # SMALL_BATCH_ADMISSIONS a call (the callers of one batch resume together), two
        # batches in flight, the rest when one lands: 8 + 8 + 4.
        (SMALL_BATCH_ADMISSIONS * 2 + 4, 15, 3),
        (SMALL_BATCH_ADMISSIONS * 5, 30, 5),
        # A burst: an eighth of what waits a call (128, 112, 98, ...), then
        # SMALL_BATCH_ADMISSIONS; about 15 round trips with two in flight.
        (1024, 1000, 30),
    ],
)
async def test_admissions_of_one_turn_go_in_batches(
    spare_redis: RedisServer, admin: Any, waiting: int, limit: int, script_calls: int
) -> None:
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=limit))
    try:
        results = await _admit_together(limiter, admin, waiting)
        assert await _script_calls(admin) == script_calls
        permits = [r for r in results if not isinstance(r, Denial)]
        denials = [r for r in results if isinstance(r, Denial)]
        # Exact across script calls as in one (of two in flight, the server runs either first).
        assert len(permits) == limit
        assert {d.gate for d in denials} == {"global_concurrency"}
        assert await limiter.inflight() == limit
        for permit in permits:
            await permit.release()
        await limiter.flush()
        assert await limiter.inflight() == 0
        # + two inflight reads and the releases, MAX_BATCH_ACCOUNTING a call
        releases = -(-limit // MAX_BATCH_ACCOUNTING)
        assert await _script_calls(admin) == script_calls + 2 + releases
    finally:
        await limiter.aclose()


async def test_two_limiters_batching_concurrently_admit_exactly_the_limit(
    spare_redis: RedisServer,
) -> None:
    limiters = [_limiter(spare_redis.url, Limits(max_concurrency=25)) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(lim.try_acquire(f"s{i % 3}", 1, NO_LIMITS) for lim in limiters for i in range(20))
        )
        permits = [r for r in results if isinstance(r, Permit)]
        assert len(permits) == 25
        assert await limiters[0].inflight() == 25
    finally:
        for lim in limiters:
            await lim.aclose()


async def test_joint_admission_needs_the_same_server_and_scope(
    spare_redis: RedisServer, redis_url: str
) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    same = _gate(spare_redis.url)
    other_scope = _gate(spare_redis.url, scope="T")
    other_server = _gate(redis_url)
    try:
        assert isinstance(limiter, JointAdmission)
        assert limiter.joint_with(same) is not None
        assert limiter.joint_with(other_scope) is None
        assert limiter.joint_with(other_server) is None
        assert (
            limiter.joint_with(
                InMemoryGate(fail_threshold=1, cooldown_s=1.0, probe_ttl_s=1.0, clock=SystemClock())
            )
            is None
        )
        assert not same_server(connect(spare_redis.url), connect(spare_redis.url + "1"))
    finally:
        for part in (limiter, same, other_scope, other_server):
            await part.aclose()


async def test_joint_admission_through_the_gate_states(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=1))
    gate = _gate(spare_redis.url, cooldown_s=0.0)
    try:
        decision, permit = await limiter.enter_and_acquire(gate, "a", 5, NO_LIMITS)
        assert decision.allowed and decision.state == "closed"
        assert isinstance(permit, Permit)
        # The limiter refuses: the gate's decision still comes back (the caller ends it).
        decision, denial = await limiter.enter_and_acquire(gate, "a", 5, NO_LIMITS)
        assert decision.allowed and isinstance(denial, Denial)
        await permit.release()
        await limiter.flush()
        # Open: refused by the gate, no lease taken, no RPM counted.
        await gate.record_failure(decision)
        before = (await limiter.source_stats("a")).rpm_used
        await gate.force_open("a")
        gate_long = _gate(spare_redis.url, cooldown_s=30.0)
        await gate_long.force_open("a")
        decision, nothing = await limiter.enter_and_acquire(gate_long, "a", 5, NO_LIMITS)
        assert not decision.allowed and decision.state == "open" and nothing is None
        assert (await limiter.source_stats("a")).rpm_used == before
        assert await limiter.inflight() == 0
        await gate_long.aclose()
    finally:
        await limiter.aclose()
        await gate.aclose()


async def test_joint_admission_hands_out_one_probe_and_fences_like_try_enter(
    spare_redis: RedisServer,
) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    gate = _gate(spare_redis.url, cooldown_s=0.0)
    try:
        first = await gate.try_enter("a")
        await gate.record_failure(first)  # threshold 1: open, cooldown 0
        probe, permit = await limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS)
        assert probe.allowed and probe.probe_owner is not None and isinstance(permit, Permit)
        other, none = await limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS)
        assert not other.allowed and other.state == "half_open" and none is None
        update = await gate.record_success(probe)
        assert update.applied and update.state == "closed"
        stale = await gate.record_failure(first)  # the old epoch is fenced
        assert not stale.applied
        await permit.release()
    finally:
        await limiter.aclose()
        await gate.aclose()


async def _blocked_clients(admin: Any) -> int:
    info = await admin.info("clients")
    return int(info["blocked_clients"])


async def test_a_joint_admission_cancelled_after_sending_leaves_no_lease_and_no_probe(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=1))
    gate = _gate(spare_redis.url, cooldown_s=0.0)
    try:
        first = await gate.try_enter("a")
        await gate.record_failure(first)  # open with no cooldown: the next caller probes
        await limiter.flush()
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            task = asyncio.create_task(limiter.enter_and_acquire(gate, "a", 10, NO_LIMITS))
            await wait_until(lambda: _blocked_clients(admin))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        await limiter.flush()
        await gate.aclose()  # waits for the probe hand-back
        gate = _gate(spare_redis.url, cooldown_s=0.0)
        assert await admin.zcard("pgw:limit:{S}:global:lease") == 0
        assert (await limiter.source_stats("a")).tpm_used == 0
        # The probe went back: the next caller is the probe at once, and the slot is free.
        decision, permit = await limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS)
        assert decision.allowed and decision.probe_owner is not None
        assert isinstance(permit, Permit)
        await permit.release()
    finally:
        await limiter.aclose()
        await gate.aclose()


async def test_an_admission_cancelled_before_sending_writes_nothing(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    try:
        await (await limiter.try_acquire("a", 1, NO_LIMITS)).release()  # type: ignore[union-attr]
        await limiter.flush()
        await admin.config_resetstat()
        task = asyncio.create_task(limiter.try_acquire("a", 1, NO_LIMITS))
        await asyncio.sleep(0)  # queued, not yet sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await limiter.flush()
        assert await _script_calls(admin) == 0
    finally:
        await limiter.aclose()


async def test_batched_admissions_fail_closed_when_redis_is_gone(
    spare_redis: RedisServer,
) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    gate = _gate(spare_redis.url)
    try:
        await (await limiter.try_acquire("a", 1, NO_LIMITS)).release()  # type: ignore[union-attr]
        await limiter.flush()
        spare_redis.stop()
        results = await asyncio.gather(
            *(limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS) for _ in range(5)),
            limiter.try_acquire("a", 1, NO_LIMITS),
            return_exceptions=True,
        )
        assert all(isinstance(r, GovernanceBackendError) for r in results), results
    finally:
        await limiter.aclose()
        await gate.aclose()


async def test_script_flush_then_the_next_joint_admission_succeeds(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    gate = _gate(spare_redis.url)
    try:
        decision, permit = await limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS)
        assert isinstance(permit, Permit)
        await permit.release()  # queued: rides with the next admission
        await admin.script_flush()
        decision, permit = await limiter.enter_and_acquire(gate, "a", 1, NO_LIMITS)
        assert decision.allowed and isinstance(permit, Permit)
        await permit.release()
        await limiter.flush()
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()
        await gate.aclose()


async def test_governed_calls_cost_one_script_call_each_and_fewer_when_concurrent(
    spare_redis: RedisServer, admin: Any, fake_upstream: Any
) -> None:
    from polygateway import GatewayClient

    settings = gateway_settings(fake_upstream.base_url("a"), spare_redis.url, "S")
    client = GatewayClient(settings)
    try:
        await client.chat([{"role": "user", "content": "warm"}])

        async def warm_call_settled() -> bool:  # its admission, then its release alone
            return await _script_calls(admin) >= 2

        await wait_until(warm_call_settled)
        await admin.config_resetstat()
        for i in range(20):
            await client.chat([{"role": "user", "content": f"one {i}"}])
    finally:
        await client.aclose()
    # Gate + admission + the previous call's release: one script call per call, and the
    # last call's release, sent by aclose().
    assert await _script_calls(admin) == 21
    client = GatewayClient(settings)
    try:
        await client.chat([{"role": "user", "content": "warm"}])
        await admin.config_resetstat()
        # Made exact, however slow the machine: the 40 are admitted together, answered together
        # (with a 41st request of the test's own), and return while Redis takes no script call,
        # so that all their releases are queued when it takes them again.
        fake_upstream.answer_together("a", 41)
        sent = fake_upstream.requests("a")
        calls = asyncio.gather(
            *(client.chat([{"role": "user", "content": f"many {i}"}]) for i in range(40))
        )
        async with asyncio.timeout(60):
            await fake_upstream.wait_for_requests(sent + 40, "a", timeout=60)
            await admin.client_pause(60_000, all=False)  # writes (every script call) wait
            try:
                async with httpx.AsyncClient() as raw:
                    url = fake_upstream.base_url("a") + "/chat/completions"
                    body = {"model": "m", "messages": [{"role": "user", "content": "41st"}]}
                    assert (await raw.post(url, json=body)).status_code == 200
                await calls
            finally:
                await admin.client_unpause()
    finally:
        await client.aclose()
    # 5 script calls admit the 40 (8 a call); their releases take 2 at most (one that went
    # alone while Redis paused, and the rest); and perhaps the warm call's release.
    assert await _script_calls(admin) <= 8


async def test_decisions_from_the_joint_step_are_the_gates_own(spare_redis: RedisServer) -> None:
    limiter = _limiter(spare_redis.url, NO_LIMITS)
    gate = _gate(spare_redis.url)
    try:
        joint = limiter.joint_with(gate)
        assert joint is not None
        decision, permit = await joint("a", 1, NO_LIMITS)
        assert isinstance(decision, GateDecision) and decision == await gate.try_enter("a")
        # A clean success is answered from the view the joint step left (no round trip).
        assert (await gate.record_success(decision)).applied
        assert isinstance(permit, Permit)
        await permit.release()
    finally:
        await limiter.aclose()
        await gate.aclose()


async def _blocked_clients(admin: Any) -> int:
    return int((await admin.info("clients")).get("blocked_clients", 0))


async def test_an_admission_does_not_wait_for_the_reply_of_a_batch_it_missed(
    spare_redis: RedisServer, admin: Any
) -> None:
    limiter = _limiter(spare_redis.url, Limits(max_concurrency=1))
    try:
        await (await limiter.try_acquire("a", 1, NO_LIMITS)).release()  # type: ignore[union-attr]
        await limiter.flush()
        # Writes paused on the server: a batch sent stays there, unanswered, until unpaused.
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            first = asyncio.create_task(limiter.try_acquire("a", 1, NO_LIMITS))
            await wait_until(lambda: _at_least_blocked(admin, 1))
            second = asyncio.create_task(limiter.try_acquire("a", 1, NO_LIMITS))
            # Sent while the first batch waits for its reply, on a connection of its own.
            await wait_until(lambda: _at_least_blocked(admin, 2))
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        results = await asyncio.gather(first, second)
        # Still exact: the server ran the two batches one after the other.
        assert sorted(type(r).__name__ for r in results) == ["Denial", "RedisPermit"]
        for result in results:
            if isinstance(result, Permit):
                await result.release()
        await limiter.flush()
        assert await limiter.inflight() == 0
    finally:
        await limiter.aclose()


async def _at_least_blocked(admin: Any, count: int) -> bool:
    return await _blocked_clients(admin) >= count
