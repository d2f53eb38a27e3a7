"""PolyGateway on Redis: ``redis`` limiter, breaker and cache (entry point ``polygateway: redis``).

Only hook implementations live here; the implementations are imported when a factory runs, so
loading the plugin costs nothing for a scope that does not select Redis.

Options (``pgw_redis.options``, validated by the core's loader like any component's): ``url``
(env ``REDIS_URL``, required; a ``redis+cluster://`` URL selects Redis Cluster),
``socket_timeout_s``, ``connect_timeout_s``, ``max_connections`` for all three;
``elide_clean_success`` for the breaker; ``prefix`` for the cache. Set them in
``[scopes.X.limiter.options]`` (``breaker``, ``cache``) or ``{SCOPE}__LIMITER__{OPTION}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import ComponentContext, Register

if TYPE_CHECKING:
    from pgw_redis.options import RedisBreakerOptions, RedisCacheOptions, RedisOptions


@hookimpl
def pgw_register_limiters(register: Register) -> None:
    from pgw_redis.options import RedisOptions

    def redis(ctx: ComponentContext[RedisOptions]) -> Any:
        from pgw_redis.connection import connect_for
        from pgw_redis.limiter import RedisLimiter

        client = connect_for(ctx.options, "limiter")
        return RedisLimiter(
            client,
            scope=ctx.settings.scope,
            global_limits=ctx.settings.global_limits,
            lease_ttl_s=ctx.settings.lease_ttl_s,
            clock=ctx.clock,
            owns_client=True,
        )

    register("redis", redis, options=RedisOptions)


@hookimpl
def pgw_register_breakers(register: Register) -> None:
    from pgw_redis.options import RedisBreakerOptions

    def redis(ctx: ComponentContext[RedisBreakerOptions]) -> Any:
        from pgw_redis.breaker import RedisGate
        from pgw_redis.connection import connect_for

        client = connect_for(ctx.options, "breaker")
        breaker = ctx.settings.breaker
        return RedisGate(
            client,
            scope=ctx.settings.scope,
            fail_threshold=breaker.fail_threshold,
            cooldown_s=breaker.cooldown_s,
            probe_ttl_s=ctx.settings.probe_ttl_s,
            max_cooldown_s=breaker.cooldown_cap_s,
            elide_clean_success=ctx.options.elide_clean_success,
            owns_client=True,
        )

    register("redis", redis, options=RedisBreakerOptions)


@hookimpl
def pgw_register_caches(register: Register) -> None:
    from pgw_redis.options import RedisCacheOptions

    def redis(ctx: ComponentContext[RedisCacheOptions]) -> Any:
        from pgw_redis.cache import RedisCache
        from pgw_redis.connection import connect_for

        client = connect_for(ctx.options, "cache")
        return RedisCache(client, prefix=ctx.options.prefix, owns_client=True)

    register("redis", redis, options=RedisCacheOptions)
