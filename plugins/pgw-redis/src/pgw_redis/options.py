"""The options of the Redis-backed limiter, breaker and cache, declared for the loader.

All three share ``REDIS_URL`` (the flat env key of option ``url``; a ``redis+cluster://`` URL
selects Redis Cluster) and the connection options; the breaker adds ``elide_clean_success`` and
the cache ``prefix``. Values go through the core's vocabulary (``polygateway.options``), so
``LLM__BREAKER__ELIDE_CLEAN_SUCCESS=no`` and ``socket_timeout_s = "500ms"`` mean what they say.
"""

from __future__ import annotations

from typing import Annotated

from polygateway.options import Bool, ComponentOptions, EnvKey, PositiveDuration, PositiveInt
from polygateway.options import SecretText as _SecretText
from polygateway.settings import Secret
from pydantic import AfterValidator

URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
"""``+cluster`` selects a Redis Cluster client."""

DEFAULT_SOCKET_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 2.0


def _redis_url(value: Secret) -> Secret:
    if not value.reveal().lower().startswith(URL_SCHEMES):
        # The URL may hold a password: never in the message.
        raise ValueError(
            f"must start with {', '.join(URL_SCHEMES)} (value not shown: it may hold a password)"
        )
    return value


RedisUrl = Annotated[_SecretText, EnvKey("REDIS_URL"), AfterValidator(_redis_url)]


class RedisOptions(ComponentOptions):
    """Options of the ``redis`` limiter (and the base of the breaker's and the cache's)."""

    url: RedisUrl
    socket_timeout_s: PositiveDuration = DEFAULT_SOCKET_TIMEOUT_S
    connect_timeout_s: PositiveDuration = DEFAULT_CONNECT_TIMEOUT_S
    max_connections: PositiveInt | None = None
    """``None``: 64 per client, 512 per node for Cluster."""


class RedisBreakerOptions(RedisOptions):
    elide_clean_success: Bool = True
    """Answer a clean success from the last view instead of asking Redis (one round trip less)."""


class RedisCacheOptions(RedisOptions):
    prefix: str = ""
    """Prepended to every cache key (share a database with other data without clashes)."""
