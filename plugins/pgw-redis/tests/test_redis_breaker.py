"""The Redis breaker beyond the contract: state shared across pools, fencing across
processes, the elided success write-back, probe hand-back on cancellation, TTLs, outages."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pgw_redis.breaker import RedisGate
from pgw_redis.connection import connect
from pgw_redis.keys import gate_key, scope_tag
from pgw_redis.testing import RedisGovernanceBackend, counting_client, make_governance_backend
from pgw_redis_test_helpers import RedisServer, wait_until
from polygateway.errors import GovernanceBackendError
from redis.asyncio import Redis

pytestmark = pytest.mark.redis


@pytest.fixture
async def backend(redis_url: str, unique_scope: str) -> AsyncIterator[RedisGovernanceBackend]:
    made = make_governance_backend(redis_url, unique_scope)
    try:
        yield made
    finally:
        await made.cleanup()


def _gate(backend: RedisGovernanceBackend, cooldown_s: float = 30.0) -> RedisGate:
    return backend.make_breaker(fail_threshold=3, cooldown_s=cooldown_s, probe_ttl_s=60.0)


async def test_state_opened_through_one_pool_is_seen_by_another(
    backend: RedisGovernanceBackend,
) -> None:
    one, two = _gate(backend), _gate(backend)  # two connection pools, as two processes
    for _ in range(3):
        await one.record_failure(await one.try_enter("a"))
    assert await two.state("a") == "open"
    refused = await two.try_enter("a")
    assert not refused.allowed
    assert 0.0 < refused.retry_after_s <= 30.0
    assert await two.retry_after_s(["a"]) > 0.0
    assert (await two.try_enter("b")).allowed  # per source


async def test_failures_from_two_pools_add_up(backend: RedisGovernanceBackend) -> None:
    one, two = _gate(backend), _gate(backend)
    await one.record_failure(await one.try_enter("a"))
    await two.record_failure(await two.try_enter("a"))
    update = await one.record_failure(await one.try_enter("a"))
    assert (update.state, update.failures) == ("open", 3)


async def test_a_stale_write_back_from_another_process_is_fenced(
    backend: RedisGovernanceBackend,
) -> None:
    one, two = _gate(backend), _gate(backend)
    stale = await one.try_enter("a")
    opened = await two.force_open("a")
    update = await one.record_failure(stale)
    assert not update.applied
    assert (update.state, update.epoch) == ("open", opened.epoch)
    update = await one.record_failure(stale, force_open=True)
    assert not update.applied
    assert await two.state("a") == "open"
    assert (await two.try_enter("a")).epoch == opened.epoch  # nothing was written


async def test_a_clean_success_is_answered_without_a_round_trip(
    redis_url: str, unique_scope: str, backend: RedisGovernanceBackend
) -> None:
    client, trips = counting_client(redis_url)
    gate = RedisGate(
        client, scope=unique_scope, fail_threshold=3, cooldown_s=30.0, probe_ttl_s=60.0,
        owns_client=True,
    )  # fmt: skip
    try:
        decision = await gate.try_enter("a")
        trips.count = 0
        update = await gate.record_success(decision)
        assert trips.count == 0
        assert (update.applied, update.state, update.failures) == (True, "closed", 0)
        # With failures on record the write-back is real: it resets them.
        await gate.record_failure(decision)
        decision = await gate.try_enter("a")
        trips.count = 0
        update = await gate.record_success(decision)
        assert trips.count == 1
        assert (update.applied, update.failures) == (True, 0)
        # Another process opened the breaker meanwhile: the elided answer is this instance's
        # view (applied), but nothing is written from the stale decision.
        stale = await gate.try_enter("a")
        opened = await _gate(backend).force_open("a")
        assert (await gate.record_success(stale)).applied
        assert await gate.state("a") == "open"
        assert (await gate.try_enter("a")).epoch == opened.epoch
    finally:
        await gate.aclose()


async def test_an_elided_success_answers_with_the_decisions_epoch(
    backend: RedisGovernanceBackend,
) -> None:
    gate = _gate(backend, cooldown_s=0.0)
    first = await gate.try_enter("a")
    update = await gate.record_success(first)
    assert (update.source, update.epoch) == ("a", first.epoch)
    await gate.force_open("a")
    probe = await gate.try_enter("a")  # no cooldown: the probe at once
    assert probe.probe_owner is not None
    await gate.record_success(probe)  # closed again, in the epoch the opening began
    again = await gate.try_enter("a")
    assert again.epoch > first.epoch
    update = await gate.record_success(again)
    assert (update.applied, update.state, update.epoch, update.failures) == (
        True,
        "closed",
        again.epoch,
        0,
    )
    assert (await gate.record_success(again)) == update


async def test_without_elision_a_stale_success_from_another_process_is_fenced(
    redis_url: str, unique_scope: str, backend: RedisGovernanceBackend
) -> None:
    gate = RedisGate(
        connect(redis_url), scope=unique_scope, fail_threshold=3, cooldown_s=30.0,
        probe_ttl_s=60.0, elide_clean_success=False, owns_client=True,
    )  # fmt: skip
    try:
        stale = await gate.try_enter("a")
        opened = await _gate(backend).force_open("a")
        update = await gate.record_success(stale)
        assert not update.applied
        assert (update.state, update.epoch) == ("open", opened.epoch)
    finally:
        await gate.aclose()


async def test_every_gate_hash_has_a_ttl(backend: RedisGovernanceBackend, raw_redis: Any) -> None:
    gate = _gate(backend, cooldown_s=0.0)
    await gate.record_failure(await gate.try_enter("a"))
    await gate.force_open("b")
    probe = await gate.try_enter("b")
    await gate.release_probe(probe)
    probe = await gate.try_enter("b")
    await gate.record_success(probe)
    await gate.force_open("c")
    await gate.record_failure(await gate.try_enter("c"))
    keys = await backend.scope_keys()
    assert sorted(keys) == sorted(gate_key(scope_tag(backend.scope), s) for s in "abc")
    for key in keys:
        ttl = await raw_redis.ttl(key)
        assert 3600 - 5 <= ttl <= 3600, f"{key} has TTL {ttl}"


async def _blocked_clients(admin: Any) -> int:
    info = await admin.info("clients")
    return int(info["blocked_clients"])


async def test_a_try_enter_cancelled_after_sending_hands_the_probe_back(
    spare_redis: RedisServer,
) -> None:
    admin = Redis.from_url(spare_redis.url, decode_responses=True)
    gate = RedisGate(
        connect(spare_redis.url), scope="S", fail_threshold=3, cooldown_s=0.0, probe_ttl_s=60.0,
        owns_client=True,
    )  # fmt: skip
    try:
        await gate.force_open("a")  # cooldown 0: the next try_enter is the probe
        await admin.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
        try:
            task = asyncio.create_task(gate.try_enter("a"))
            await wait_until(lambda: _blocked_clients(admin))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        # Whether the cancelled script ran before or after the hand-back, the probe is free.
        await wait_until(lambda: _probe_taken(gate), timeout_s=5.0)
    finally:
        await gate.aclose()
        await admin.aclose()


async def _probe_taken(gate: RedisGate) -> bool:
    decision = await gate.try_enter("a")
    return decision.allowed and decision.is_probe


async def test_admission_fails_closed_and_write_backs_raise_when_redis_is_gone(
    spare_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gate = RedisGate(
        connect(spare_redis.url, socket_timeout_s=1.0, connect_timeout_s=1.0), scope="S",
        fail_threshold=3, cooldown_s=0.0, probe_ttl_s=60.0, owns_client=True,
    )  # fmt: skip
    try:
        await gate.force_open("a")
        probe = await gate.try_enter("a")
        assert probe.is_probe
        spare_redis.stop()
        with pytest.raises(GovernanceBackendError, match="try_enter"):
            await gate.try_enter("b")
        with pytest.raises(GovernanceBackendError, match="state"):
            await gate.state("a")
        with pytest.raises(GovernanceBackendError, match="record_failure"):
            await gate.record_failure(probe)
        with caplog.at_level(logging.WARNING, logger="pgw_redis"):
            await gate.release_probe(probe)  # release side: a warning only
        assert any("release_probe failed" in r.getMessage() for r in caplog.records)
    finally:
        await gate.aclose()


@pytest.mark.parametrize("bad", [[], ()])
async def test_retry_after_of_no_source_raises_before_any_io(
    backend: RedisGovernanceBackend, bad: Any
) -> None:
    with pytest.raises(ValueError):
        await _gate(backend).retry_after_s(bad)


async def test_retry_after_of_one_string_is_refused(backend: RedisGovernanceBackend) -> None:
    with pytest.raises(ValueError, match="not one string"):
        await _gate(backend).retry_after_s("ab")


async def test_many_concurrent_first_callers_after_a_cooldown_get_one_probe(
    backend: RedisGovernanceBackend,
) -> None:
    gates = [_gate(backend, cooldown_s=0.0) for _ in range(4)]
    await gates[0].force_open("a")
    decisions = await asyncio.gather(*(g.try_enter("a") for g in gates for _ in range(25)))
    assert sum(d.allowed for d in decisions) == 1


async def test_the_default_breaker_settings_grow_the_cooldown_on_redis_too(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    """The client built from default ``BreakerSettings`` on the Redis breaker: the first
    cooldown is 5 s and a failed probe doubles it (the cap is 60 s), as in memory."""
    import dataclasses

    from pgw_redis_test_helpers import gateway_settings
    from polygateway import GatewayClient
    from polygateway.errors import ScopeUnavailableError
    from polygateway.settings import BreakerSettings, RetrySettings
    from polygateway.testing import Reply

    fake_upstream.set_default("a", Reply.error(503))
    settings = gateway_settings(fake_upstream.base_url("a"), redis_url, unique_scope)
    # One attempt per call: the call is the probe alone.
    settings = dataclasses.replace(
        settings, breaker=BreakerSettings(), retry=RetrySettings(max_attempts=1)
    )
    assert (settings.breaker.cooldown_s, settings.breaker.cooldown_cap_s) == (5.0, 60.0)
    client = GatewayClient(settings)
    try:
        await client.breaker.force_open("a")
        first = await client.breaker.retry_after_s(["a"])
        assert 4.5 < first <= 5.0
        await asyncio.sleep(first)  # server time: the cooldown itself
        with pytest.raises(ScopeUnavailableError):
            await client.chat([{"role": "user", "content": "hi"}])
        assert fake_upstream.requests("a") == 1  # the probe, failed
        assert 9.0 < await client.breaker.retry_after_s(["a"]) <= 10.0  # doubled
    finally:
        await client.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()
