"""The plugin as users meet it: entry point, factories, configuration errors, the governed
client on Redis (round trips per call), and the response cache on Redis."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

import pgw_redis
import pytest
from pgw_redis.breaker import RedisGate
from pgw_redis.cache import RedisCache
from pgw_redis.connection import connect
from pgw_redis.limiter import RedisLimiter
from pgw_redis.testing import counting_client, make_governance_backend
from pgw_redis_test_helpers import RedisServer, free_port, gateway_settings, wait_until
from polygateway.errors import ConfigError
from polygateway.ports import BuildContext, CacheBackend, ProviderGate, RateLimiter
from polygateway.settings import CacheSettings, Limits, ScopeSettings, Secret
from polygateway.testing import Reply
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

pytestmark = pytest.mark.redis

MESSAGES = [{"role": "user", "content": "hello"}]


def _context(redis_url: str | None, **options: Any) -> BuildContext:
    """A factory's context with raw options (``url`` from ``redis_url`` unless ``None``)."""
    from polygateway.clock import SystemClock

    if redis_url is not None:
        options = {"url": redis_url, **options}
    return BuildContext(settings=_settings(), options=options, clock=SystemClock())


def _settings(scope: str = "S") -> ScopeSettings:
    settings: ScopeSettings = gateway_settings("http://127.0.0.1:1/v1", "redis://x:1/0", scope)
    return settings


def _factories() -> dict[str, Any]:
    """Each kind's ``redis`` factory as assembly calls it: options validated by the plugin's
    model, the product checked against the kind's Protocol."""
    from polygateway.plugins import load_registry

    registry = load_registry()
    return {
        kind: lambda ctx, kind=kind: registry.build(kind, "redis", ctx)
        for kind in ("limiter", "breaker", "cache")
    }


# --------------------------------------------------------------------------- registration


def test_the_entry_point_registers_redis_for_the_three_kinds() -> None:
    from polygateway.plugins import load_registry

    registry = load_registry()
    info = next(p for p in registry.plugins if p.name == "pgw-redis")
    assert info.status == "loaded", info.error
    assert info.entry_point == "redis"
    for kind in ("limiter", "breaker", "cache"):
        assert "redis" in info.provides[kind]
        assert registry.provider_of(kind, "redis") == "pgw-redis"


async def test_factories_build_the_redis_components(redis_url: str) -> None:
    factories = _factories()
    ctx = _context(redis_url)
    limiter = factories["limiter"](ctx)
    breaker = factories["breaker"](ctx)
    cache = factories["cache"](ctx)
    try:
        assert isinstance(limiter, RedisLimiter) and isinstance(limiter, RateLimiter)
        assert isinstance(breaker, RedisGate) and isinstance(breaker, ProviderGate)
        assert isinstance(cache, RedisCache) and isinstance(cache, CacheBackend)
        assert limiter.scope == breaker.scope == "S"
    finally:
        for made in (limiter, breaker, cache):
            await made.aclose()


@pytest.mark.parametrize("kind", ["limiter", "breaker", "cache"])
def test_a_missing_redis_url_is_a_config_error_naming_it(kind: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"{kind} 'redis' option url: required \(env REDIS_URL\)"
    ):
        _factories()[kind](_context(None))


def test_unknown_and_bad_options_are_config_errors() -> None:
    factories = _factories()
    url = "redis://127.0.0.1:6379/3"
    with pytest.raises(
        ConfigError,
        match=r"option sockettimeout: unknown key \(did you mean socket_timeout_s\?\); allowed: ",
    ):
        factories["limiter"](_context(url, sockettimeout=1))
    with pytest.raises(ConfigError, match="socket_timeout_s: must be > 0"):
        factories["breaker"](_context(url, socket_timeout_s=0))
    with pytest.raises(ConfigError, match=r"option prefix: unknown key"):
        factories["limiter"](_context(url, prefix="x"))


@pytest.mark.parametrize(
    ("value", "elide"),
    [
        ("false", False), ("False", False), (" NO ", False), ("0", False), (False, False),
        (0, False), ("true", True), ("Yes", True), ("1", True), (True, True), (1, True),
    ],
)  # fmt: skip
async def test_elide_clean_success_is_read_by_meaning_not_truthiness(
    redis_url: str, unique_scope: str, value: Any, elide: bool
) -> None:
    gate = _factories()["breaker"](
        dataclasses.replace(
            _context(redis_url, elide_clean_success=value), settings=_settings(unique_scope)
        )
    )
    other = RedisGate(
        connect(redis_url), scope=unique_scope, fail_threshold=3, cooldown_s=30.0,
        probe_ttl_s=10.0, owns_client=True,
    )  # fmt: skip
    try:
        decision = await gate.try_enter("a")
        await other.force_open("a")
        # Elided, the clean success is answered from the gate's last view (closed: applied);
        # asked, Redis fences it (the breaker opened since).
        assert (await gate.record_success(decision)).applied is elide
    finally:
        await gate.aclose()
        await other.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()


@pytest.mark.parametrize(
    ("kind", "option", "value", "expected"),
    [
        ("breaker", "elide_clean_success", "maybe", "true or false"),
        ("breaker", "elide_clean_success", "", "true or false"),
        ("breaker", "elide_clean_success", 2, "true or false"),
        ("breaker", "elide_clean_success", None, "true or false"),
        ("limiter", "socket_timeout_s", "soon", "a number"),
        ("limiter", "socket_timeout_s", True, "a number"),
        ("cache", "connect_timeout_s", [1], "a number"),
        ("breaker", "max_connections", "8.5", "an integer"),
        ("limiter", "max_connections", 8.0, "an integer"),
        ("cache", "prefix", 5, "a string"),
    ],
)
def test_options_of_the_wrong_type_are_config_errors_naming_them(
    kind: str, option: str, value: Any, expected: str
) -> None:
    context = _context("redis://127.0.0.1:6379/3", **{option: value})
    message = f"{kind} 'redis' option {option}: must be {expected}"
    with pytest.raises(ConfigError, match=message):
        _factories()[kind](context)


async def test_numeric_options_may_be_strings() -> None:
    context = _context(
        "redis://127.0.0.1:6379/3", socket_timeout_s=" 0.5", connect_timeout_s="1",
        max_connections="3",
    )  # fmt: skip
    limiter = _factories()["limiter"](context)
    try:
        pool = limiter._client.connection_pool
        assert pool.max_connections == 3
        assert pool.connection_kwargs["socket_timeout"] == 0.5
        assert pool.connection_kwargs["socket_connect_timeout"] == 1.0
    finally:
        await limiter.aclose()
    with pytest.raises(ConfigError, match="socket_timeout_s: must be a finite number"):
        _factories()["limiter"](_context("redis://x:1/0", socket_timeout_s="nan"))


def test_the_url_never_shows_in_errors_or_reprs() -> None:
    factories = _factories()
    context = _context("ftp://user:s3cret@example.invalid/0")
    with pytest.raises(ConfigError) as caught:
        factories["limiter"](context)
    assert "must start with redis://" in str(caught.value)
    assert "s3cret" not in str(caught.value)
    assert "s3cret" not in repr(context.settings)
    from polygateway.plugins import load_registry

    validated = load_registry().resolve_options("limiter", "redis", {"url": "redis://:s3cret@h/0"})
    assert "s3cret" not in repr(validated) and "s3cret" not in str(validated)


async def test_a_password_is_never_in_a_backend_error() -> None:
    from polygateway.errors import GovernanceBackendError

    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    limiter = RedisLimiter(
        connect(Secret(url)), scope="S", global_limits=Limits(), lease_ttl_s=30.0,
        owns_client=True,
    )  # fmt: skip
    try:
        with pytest.raises(GovernanceBackendError) as caught:
            await limiter.try_acquire("a", 1, Limits())
        assert "s3cret" not in str(caught.value)
        assert "s3cret" not in repr(limiter)
    finally:
        await limiter.aclose()


def test_a_cluster_url_makes_a_cluster_client() -> None:
    client = connect("redis+cluster://127.0.0.1:7000")
    assert isinstance(client, RedisCluster)
    plain = connect("redis://127.0.0.1:6379/3")
    assert isinstance(plain, Redis)


def test_the_package_root_holds_only_hook_implementations() -> None:
    import types

    public = {
        name
        for name, value in vars(pgw_redis).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public <= {
        "annotations", "Any", "TYPE_CHECKING", "ComponentContext", "OptionsRef", "Register",
        "hookimpl", "pgw_register_limiters", "pgw_register_breakers", "pgw_register_caches",
    }  # fmt: skip


# --------------------------------------------------------------------------- the governed client


async def test_a_governed_call_costs_at_most_three_round_trips(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    from polygateway import GatewayClient

    fake_upstream.set_default("a", Reply.ok(content="pong"))
    limiter_client, limiter_trips = counting_client(redis_url)
    gate_client, gate_trips = counting_client(redis_url)
    settings = gateway_settings(
        fake_upstream.base_url("a"), redis_url, unique_scope,
        global_limits=Limits(max_concurrency=8, rpm=10_000, tpm=10_000_000),
    )  # fmt: skip
    limiter = RedisLimiter(
        limiter_client, scope=unique_scope, global_limits=settings.global_limits,
        lease_ttl_s=settings.lease_ttl_s, owns_client=True,
    )  # fmt: skip
    gate = RedisGate(
        gate_client, scope=unique_scope, fail_threshold=3, cooldown_s=30.0,
        probe_ttl_s=settings.probe_ttl_s, owns_client=True,
    )  # fmt: skip
    client = GatewayClient(settings, limiter=limiter, breaker=gate)
    try:
        for _ in range(3):  # warm: connections open, scripts loaded
            await client.chat(MESSAGES)
        await limiter.flush()
        limiter_trips.count = gate_trips.count = 0
        calls = 20
        for _ in range(calls):
            assert (await client.chat(MESSAGES)).content == "pong"
        await limiter.flush()
        per_call = (limiter_trips.count + gate_trips.count) / calls
        assert per_call <= 3.0, per_call
        assert gate_trips.count == calls  # try_enter only: the clean success is elided
        assert await limiter.inflight() == 0
        assert await limiter.progress_age_s() < 5.0
    finally:
        await client.aclose()
        await limiter.aclose()
        await gate.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()


async def test_the_client_built_from_settings_runs_on_redis(
    redis_url: str, unique_scope: str, fake_upstream: Any, raw_redis: Any
) -> None:
    from polygateway import GatewayClient

    fake_upstream.set_default("a", Reply.ok(content="pong"))
    settings = gateway_settings(
        fake_upstream.base_url("a"), redis_url, unique_scope,
        global_limits=Limits(max_concurrency=2, rpm=100),
    )  # fmt: skip
    try:
        async with GatewayClient(settings) as client:
            responses = [await client.chat(MESSAGES) for _ in range(3)]
        assert [r.content for r in responses] == ["pong"] * 3
        backend = make_governance_backend(redis_url, unique_scope)
        keys = await backend.scope_keys()
        rpm_keys = [k for k in keys if ":global:rpm:" in k]
        assert [await raw_redis.get(k) for k in rpm_keys] == ["3"]
        assert await raw_redis.zcard(f"pgw:limit:{{{unique_scope}}}:global:lease") == 0
    finally:
        await make_governance_backend(redis_url, unique_scope).cleanup()


async def test_same_named_sources_of_two_roles_sharing_a_redis_limiter_keep_their_own_gates(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    """ARCHITECTURE §7.7: gates are per scope and source. JUDGE handed LLM's Redis limiter
    shares its global gates but keys its own ``qwen-1`` apart from LLM's ``qwen-1``."""
    import asyncio

    from polygateway import GatewayClient

    judge_scope = f"{unique_scope}J"

    def role(scope: str, route: str) -> ScopeSettings:
        settings = gateway_settings(
            fake_upstream.base_url(route), redis_url, scope, source_name="qwen-1",
            global_limits=Limits(max_concurrency=10),
        )  # fmt: skip
        qwen = dataclasses.replace(
            settings.sources[0], model=f"qwen-{route}", limits=Limits(max_concurrency=2)
        )
        return dataclasses.replace(settings, sources=(qwen,))

    fake_upstream.set_default("llm", Reply.black_hole())
    fake_upstream.set_default("judge", Reply.black_hole())
    llm = GatewayClient(role(unique_scope, "llm"))
    judge = GatewayClient(role(judge_scope, "judge"), limiter=llm.limiter)
    tasks = [
        asyncio.create_task(client.chat(MESSAGES)) for client in (llm, judge) for _ in range(5)
    ]
    try:
        await wait_until(
            lambda: fake_upstream.inflight("llm") == 2 and fake_upstream.inflight("judge") == 2
        )
        assert (fake_upstream.max_inflight("llm"), fake_upstream.max_inflight("judge")) == (2, 2)
        assert await llm.limiter.inflight() == 4  # one limiter, one scope-wide lease set
        assert (await llm.limiter.source_stats(f"{judge_scope}:qwen-1")).inflight == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await judge.aclose()
        await llm.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()
        await make_governance_backend(redis_url, judge_scope).cleanup()


async def test_same_named_sources_of_two_roles_sharing_a_redis_breaker_keep_their_own_state(
    redis_url: str, unique_scope: str, fake_upstream: Any, raw_redis: Any
) -> None:
    """Breaker state is per scope and source: JUDGE handed LLM's Redis breaker keeps its
    ``openai-1`` under its own key (the one JUDGE's own gate uses in any other process), so
    LLM's failing ``openai-1`` does not shut JUDGE's."""
    from polygateway import GatewayClient
    from polygateway.errors import AllSourcesExhausted
    from polygateway.settings import BackpressureSettings, BreakerSettings, RetrySettings

    judge_scope = f"{unique_scope}J"

    def role(scope: str, route: str) -> ScopeSettings:
        return gateway_settings(
            fake_upstream.base_url(route), redis_url, scope, source_name="openai-1",
            breaker=BreakerSettings(fail_threshold=1, cooldown_s=60.0),
            retry=RetrySettings(max_attempts=1, base_delay_s=0.0, max_delay_s=0.0),
            backpressure=BackpressureSettings(quota_full="fail_fast"),
        )  # fmt: skip

    fake_upstream.set_default("llm", Reply.error(503))
    fake_upstream.set_default("judge", Reply.ok("judged"))
    llm = GatewayClient(role(unique_scope, "llm"))
    judge = GatewayClient(role(judge_scope, "judge"), breaker=llm.breaker)
    elsewhere = RedisGate(
        connect(redis_url), scope=judge_scope, fail_threshold=1, cooldown_s=60.0,
        probe_ttl_s=30.0, owns_client=True,
    )  # fmt: skip
    try:
        with pytest.raises(AllSourcesExhausted):
            await llm.chat(MESSAGES)
        assert (await judge.chat(MESSAGES)).content == "judged"
        assert await raw_redis.hget(f"pgw:gate:{{{unique_scope}}}:openai-1", "state") == "open"
        assert await judge.breaker.state("openai-1") == "closed"
        # JUDGE's own gate in another process reads the same state, under JUDGE's key.
        await judge.breaker.force_open("openai-1")
        assert await elsewhere.state("openai-1") == "open"
        assert await raw_redis.hget(f"pgw:gate:{{{judge_scope}}}:openai-1", "state") == "open"
    finally:
        await elsewhere.aclose()
        await judge.aclose()
        await llm.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()
        await make_governance_backend(redis_url, judge_scope).cleanup()


async def test_own_global_limits_a_shared_redis_limiter_would_ignore_are_refused(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    from polygateway import GatewayClient

    url = fake_upstream.base_url("a")
    limits = Limits(max_concurrency=3)
    llm = GatewayClient(gateway_settings(url, redis_url, unique_scope, global_limits=limits))
    try:
        other = gateway_settings(url, redis_url, f"{unique_scope}J", global_limits=Limits(rpm=9))
        with pytest.raises(ConfigError, match=r"global limits \(max_concurrency=0, rpm=9"):
            GatewayClient(other, limiter=llm.limiter)
    finally:
        await llm.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()


# --------------------------------------------------------------------------- the cache


async def test_the_response_cache_on_redis_keys_by_namespace_with_a_ttl(
    redis_url: str, unique_scope: str, fake_upstream: Any, raw_redis: Any
) -> None:
    import dataclasses

    from polygateway import GatewayClient

    fake_upstream.set_default("a", Reply.ok(content="cached answer"))
    prefix = f"test-{uuid.uuid4().hex}:"
    settings = dataclasses.replace(
        gateway_settings(fake_upstream.base_url("a"), redis_url, unique_scope),
        cache=CacheSettings(backend="redis", namespace="tenant-a", ttl_s=60.0,
                            options={"prefix": prefix, "url": redis_url}),
    )  # fmt: skip
    try:
        async with GatewayClient(settings) as client:
            first = await client.chat(MESSAGES)
            again = await client.chat(MESSAGES)
            other_tenant = await client.chat(MESSAGES, cache_namespace="tenant-b")
            # Delimiters cannot make two (namespace, salt) pairs meet.
            await client.chat(MESSAGES, cache_namespace="a:b", cache_salt="c")
            await client.chat(MESSAGES, cache_namespace="a", cache_salt="b:c")
        assert (first.cache_hit, again.cache_hit, other_tenant.cache_hit) == (False, True, False)
        assert fake_upstream.requests("a") == 4
        keys = [k async for k in raw_redis.scan_iter(match=prefix + "*")]
        assert len(keys) == 4
        for key in keys:
            assert key.startswith(prefix + "pgw:cache:")
            assert 0 < await raw_redis.ttl(key) <= 60
    finally:
        keys = [k async for k in raw_redis.scan_iter(match=prefix + "*")]
        if keys:
            await raw_redis.delete(*keys)
        await make_governance_backend(redis_url, unique_scope).cleanup()


async def test_a_dead_cache_degrades_silently_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = RedisCache(connect(f"redis://127.0.0.1:{free_port()}/0"), owns_client=True)
    try:
        with caplog.at_level(logging.WARNING, logger="pgw_redis"):
            for _ in range(3):
                assert await cache.get("pgw:cache:k") is None
                await cache.set("pgw:cache:k", "v", 10.0)
        warnings = [r for r in caplog.records if r.name == "pgw_redis.cache"]
        assert len(warnings) == 2, [r.getMessage() for r in warnings]  # one per operation
        with pytest.raises(ValueError, match="ttl"):
            await cache.set("pgw:cache:k", "v", 0)  # a missing TTL is a bug, not an outage
    finally:
        await cache.aclose()


async def test_calls_go_on_when_the_cache_redis_is_down(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    import dataclasses

    from polygateway import GatewayClient

    fake_upstream.set_default("a", Reply.ok(content="pong"))
    settings = dataclasses.replace(
        gateway_settings(fake_upstream.base_url("a"), redis_url, unique_scope),
        cache=CacheSettings(backend="redis", namespace="t", ttl_s=60.0),
    )
    dead = RedisCache(connect(f"redis://127.0.0.1:{free_port()}/0"), owns_client=True)
    try:
        async with GatewayClient(settings, cache=dead) as client:
            assert (await client.chat(MESSAGES)).content == "pong"
            assert (await client.chat(MESSAGES)).cache_hit is False
    finally:
        await dead.aclose()
        await make_governance_backend(redis_url, unique_scope).cleanup()


async def test_one_env_line_selects_redis_for_all_three(
    redis_url: str, unique_scope: str, fake_upstream: Any
) -> None:
    from polygateway import GatewayClient

    fake_upstream.set_default("a", Reply.ok(content="pong"))
    scope = unique_scope.upper()
    env = {
        "PGW_STATE_BACKEND": "redis",
        "REDIS_URL": redis_url,
        "PGW_CACHE_NAMESPACE": f"test-{uuid.uuid4().hex}",
        "PGW_CACHE_TTL_S": "30",
        "PGW_TELEMETRY_BACKEND": "none",
        f"{scope}__OPENAI__1__BASE_URL": fake_upstream.base_url("a"),
        f"{scope}__OPENAI__1__MODEL": "fake-model",
        f"{scope}__OPENAI__1__API_KEY": "sk-test",
    }
    client = GatewayClient.from_env(scope, env=env)
    try:
        components = client._components
        assert isinstance(components.limiter, RedisLimiter)
        assert isinstance(components.breaker, RedisGate)
        assert isinstance(components.cache, RedisCache)
        assert (await client.chat(MESSAGES)).content == "pong"
        assert (await client.chat(MESSAGES)).cache_hit
    finally:
        await client.aclose()
        await make_governance_backend(redis_url, scope).cleanup()


async def test_governed_calls_fail_closed_while_redis_is_down_and_resume_after_a_restart(
    spare_redis: RedisServer, fake_upstream: Any
) -> None:
    from polygateway import GatewayClient
    from polygateway.errors import GovernanceBackendError

    fake_upstream.set_default("a", Reply.ok(content="pong"))
    settings = gateway_settings(
        fake_upstream.base_url("a"), spare_redis.url, "S", global_limits=Limits(max_concurrency=4)
    )
    async with GatewayClient(settings) as client:
        assert (await client.chat(MESSAGES)).content == "pong"
        spare_redis.stop()
        for _ in range(3):
            with pytest.raises(GovernanceBackendError):
                await client.chat(MESSAGES)
        assert fake_upstream.requests("a") == 1  # nothing went through ungoverned
        spare_redis.start()  # empty: no scripts, no state
        assert (await client.chat(MESSAGES)).content == "pong"
        assert fake_upstream.requests("a") == 2
