"""PolyGateway on Redis: ``redis`` limiter, breaker and cache (entry point ``polygateway: redis``).

Only hook implementations live here; the implementations are imported when a factory runs, so
loading the plugin costs nothing for a scope that does not select Redis.

Factory options (pipeline file ``[scope.limiter]`` / ``[scope.breaker]`` / ``[scope.cache]``
``options``): ``socket_timeout_s``, ``connect_timeout_s``, ``max_connections`` for all three;
``prefix`` for the cache; ``elide_clean_success`` for the breaker (a boolean: ``true``/
``false``, ``yes``/``no``, ``1``/``0`` as strings too). ``REDIS_URL`` (a ``redis+cluster://``
URL selects Redis Cluster) is required.
"""

from __future__ import annotations

from typing import Any

from polygateway.hookspecs import hookimpl
from polygateway.ports import BuildContext, Register


@hookimpl
def pgw_register_limiters(register: Register) -> None:
    def redis(ctx: BuildContext) -> Any:
        from pgw_redis.connection import connect_for
        from pgw_redis.limiter import RedisLimiter

        client = connect_for(ctx, "limiter")
        return RedisLimiter(
            client,
            scope=ctx.settings.scope,
            global_limits=ctx.settings.global_limits,
            lease_ttl_s=ctx.settings.lease_ttl_s,
            clock=ctx.clock,
            owns_client=True,
        )

    register("redis", redis)


@hookimpl
def pgw_register_breakers(register: Register) -> None:
    def redis(ctx: BuildContext) -> Any:
        from pgw_redis._options import parse_bool
        from pgw_redis.breaker import RedisGate
        from pgw_redis.connection import connect_for

        elide = parse_bool(
            ctx.options.get("elide_clean_success", True), "elide_clean_success", "breaker"
        )
        client = connect_for(ctx, "breaker", ("elide_clean_success",))
        breaker = ctx.settings.breaker
        return RedisGate(
            client,
            scope=ctx.settings.scope,
            fail_threshold=breaker.fail_threshold,
            cooldown_s=breaker.cooldown_s,
            probe_ttl_s=ctx.settings.probe_ttl_s,
            elide_clean_success=elide,
            owns_client=True,
        )

    register("redis", redis)


@hookimpl
def pgw_register_caches(register: Register) -> None:
    def redis(ctx: BuildContext) -> Any:
        from pgw_redis._options import parse_str
        from pgw_redis.cache import DEFAULT_PREFIX, RedisCache
        from pgw_redis.connection import connect_for

        prefix = parse_str(ctx.options.get("prefix", DEFAULT_PREFIX), "prefix", "cache")
        client = connect_for(ctx, "cache", ("prefix",))
        return RedisCache(client, prefix=prefix, owns_client=True)

    register("redis", redis)
