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
from polygateway.options import OptionsRef
from polygateway.ports import ComponentContext, Register

if TYPE_CHECKING:
    from pgw_redis.options import RedisBreakerOptions, RedisCacheOptions, RedisOptions

# By reference: the models (and pydantic) are imported only when a scope uses Redis or
# REDIS_URL is set; the flat key is declared here for the unknown-key check.
_FLAT_KEYS = {"url": "REDIS_URL"}


@hookimpl
def pgw_register_limiters(register: Register) -> None:
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

    register(
        "redis", redis, options=OptionsRef("pgw_redis.options:RedisOptions", env_keys=_FLAT_KEYS)
    )


@hookimpl
def pgw_register_breakers(register: Register) -> None:
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

    options = OptionsRef("pgw_redis.options:RedisBreakerOptions", env_keys=_FLAT_KEYS)
    register("redis", redis, options=options)


@hookimpl
def pgw_register_caches(register: Register) -> None:
    def redis(ctx: ComponentContext[RedisCacheOptions]) -> Any:
        from pgw_redis.cache import RedisCache
        from pgw_redis.connection import connect_for

        client = connect_for(ctx.options, "cache")
        return RedisCache(client, prefix=ctx.options.prefix, owns_client=True)

    options = OptionsRef("pgw_redis.options:RedisCacheOptions", env_keys=_FLAT_KEYS)
    register("redis", redis, options=options)
