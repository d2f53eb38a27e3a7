"""Test support: the Redis backend of the governance contract suites, and a round-trip counter.

``polygateway.testing.contracts`` runs its limiter and breaker suites against the object
``make_governance_backend(redis_url, scope)`` returns. Time there is the server's, which no
test can move: ``supports_fake_time`` is false and the time-dependent cases are covered by
real-wait variants in this plugin's own tests.

``counting_client(url)`` is a client like ``connect`` makes that counts its round trips (what
a governed call costs in Redis traffic; the tests and ``tools/bench/redis_limiter.py`` use it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polygateway.settings import Limits
from polygateway.testing.contracts import UninjectableClock

from pgw_redis.breaker import RedisGate
from pgw_redis.connection import DEFAULT_MAX_CONNECTIONS, RedisClient, connect
from pgw_redis.keys import GATE_PREFIX, LIMIT_PREFIX, scope_tag
from pgw_redis.limiter import RedisLimiter


@dataclass
class RoundTrips:
    """Writes to the socket: one per command, one per pipeline (connection setup excluded)."""

    count: int = 0


def counting_client(url: str) -> tuple[Any, RoundTrips]:
    """A standalone-Redis client set up like ``connect`` makes it, counting its round trips."""
    from redis.asyncio import BlockingConnectionPool, Connection, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    trips = RoundTrips()

    class CountingConnection(Connection):
        handshaking = False

        async def on_connect_check_health(self, check_health: bool = True) -> None:
            # The connection's own setup (HELLO, CLIENT SETINFO) is not a command's round trip.
            self.handshaking = True
            try:
                await super().on_connect_check_health(check_health)
            finally:
                self.handshaking = False

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if not self.handshaking:
                trips.count += 1
            await super().send_packed_command(command, check_health)

    pool = BlockingConnectionPool.from_url(
        url,
        connection_class=CountingConnection,
        max_connections=DEFAULT_MAX_CONNECTIONS,
        timeout=2.0,
        decode_responses=True,
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
        retry=Retry(NoBackoff(), 0),
    )
    return Redis.from_pool(pool), trips


class RedisGovernanceBackend:
    """Limiters and breakers of one scope on one Redis (or Redis Cluster) URL.

    Each instance it makes gets its own client (as separate processes would); ``cleanup()``
    closes them and deletes every key of the scope.
    """

    supports_fake_time = False

    def __init__(self, redis_url: str, scope: str) -> None:
        self.redis_url = redis_url
        self.scope = scope
        self.clock = UninjectableClock(
            "time-dependent: the Redis backend runs on the server's clock; covered by the "
            "real-wait variants in plugins/pgw-redis/tests"
        )
        self._made: list[RedisLimiter | RedisGate] = []
        self._admin: RedisClient | None = None

    def make_limiter(self, *, global_limits: Limits, lease_ttl_s: float) -> RedisLimiter:
        limiter = RedisLimiter(
            connect(self.redis_url),
            scope=self.scope,
            global_limits=global_limits,
            lease_ttl_s=lease_ttl_s,
            owns_client=True,
        )
        self._made.append(limiter)
        return limiter

    def make_breaker(
        self,
        *,
        fail_threshold: int,
        cooldown_s: float,
        probe_ttl_s: float,
        max_cooldown_s: float | None = None,
    ) -> RedisGate:
        gate = RedisGate(
            connect(self.redis_url),
            scope=self.scope,
            fail_threshold=fail_threshold,
            cooldown_s=cooldown_s,
            probe_ttl_s=probe_ttl_s,
            owns_client=True,
            max_cooldown_s=max_cooldown_s,
        )
        self._made.append(gate)
        return gate

    async def window_time(self) -> float:
        """The server's time in seconds: what keys the RPM/TPM windows."""
        seconds, micros = await self._admin_client().time()
        return float(seconds) + float(micros) / 1e6

    async def scope_keys(self) -> list[str]:
        """Every key of the scope (SCAN, never KEYS)."""
        return await scope_keys(self._admin_client(), self.scope)

    async def cleanup(self) -> None:
        try:
            for made in self._made:
                await made.aclose()
            keys = await self.scope_keys()
            if keys:
                admin = self._admin_client()
                # One slot (the scope's hash tag): a single DEL works on Cluster too.
                await admin.delete(*keys)
        finally:
            self._made.clear()
            if self._admin is not None:
                await self._admin.aclose()
                self._admin = None

    def _admin_client(self) -> RedisClient:
        if self._admin is None:
            self._admin = connect(self.redis_url)
        return self._admin


async def scope_keys(client: RedisClient, scope: str) -> list[str]:
    """Every limiter and breaker key of ``scope`` on ``client``'s server(s)."""
    tag = scope_tag(scope)
    found: list[str] = []
    for prefix in (LIMIT_PREFIX, GATE_PREFIX):
        pattern = _glob_escape(f"{prefix}{tag}") + "*"
        found.extend([str(key) async for key in client.scan_iter(match=pattern, count=1000)])
    return found


def _glob_escape(text: str) -> str:
    out: list[str] = []
    for char in text:
        if char in "*?[]\\":
            out.append("\\")
        out.append(char)
    return "".join(out)


def make_governance_backend(redis_url: str, scope: str) -> Any:
    """The ``governance_backend`` of the contract suites for Redis (see the module docstring)."""
    return RedisGovernanceBackend(redis_url, scope)
