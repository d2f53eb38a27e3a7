"""Clients and script execution.

``connect(url)`` makes the asyncio client: ``redis://``, ``rediss://`` and ``unix://`` give a
``redis.asyncio.Redis``; ``redis+cluster://host:port`` (or ``rediss+cluster://``) gives a
``redis.asyncio.cluster.RedisCluster`` seeded from that node. The scheme is the one switch,
read per component: ``REDIS_URL`` (shared by the limiter, the breaker and the cache unless one
is given its own ``url`` option) selects Cluster for every component that uses it.

Clients are made with socket and connect timeouts (a black-holed Redis fails a call within
two socket timeouts instead of hanging it: queued accounting may ride ahead of the call's own
script) and with redis-py's automatic command retries turned off:
re-sending a script whose reply was lost could apply it twice (two RPM charges), and a failed
admission must surface as ``GovernanceBackendError`` promptly rather than after a retry ladder.

Scripts are called by SHA (``EVALSHA``) through ``ScriptClient``, which loads them once and
recovers from ``NOSCRIPT`` (server restart, failover, ``SCRIPT FLUSH``) by loading them again
and repeating the calls that missed. That works the same inside a pipeline, where redis-py's
own ``register_script`` would add a ``SCRIPT EXISTS`` round trip before every pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

from polygateway.errors import ConfigError
from polygateway.settings import Secret
from polygateway.validation import check_ttl
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from pgw_redis.options import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_SOCKET_TIMEOUT_S, RedisOptions
from pgw_redis.scripts import ALL_SCRIPTS, LuaScript

RedisClient: TypeAlias = "Redis | RedisCluster"

BACKEND_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
"""What a failing Redis raises through redis-py: refused/reset connections, timeouts, server
errors (OOM, READONLY, CLUSTERDOWN), and plain socket errors."""


class NotSentError(RedisError):
    """The commands were never written to Redis (no connection, no free slot, scripts not
    loaded, or the client closed): none of them ran, so there is nothing to undo."""


class NotConnectedError(NotSentError, RedisConnectionError):
    """``NotSentError`` because connecting failed: still a ``ConnectionError``, which callers
    may retry on a fresh connection as before."""


def _not_sent(what: str, exc: BaseException) -> NotSentError:
    kind = NotConnectedError if isinstance(exc, RedisConnectionError) else NotSentError
    return kind(f"{what}: {type(exc).__name__}: {exc}")


_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_CLUSTER_MAX_CONNECTIONS = 512


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One script invocation: what ``EVALSHA`` needs."""

    script: LuaScript
    keys: Sequence[str]
    args: Sequence[str | int]


@dataclass(frozen=True, slots=True)
class PackedCall:
    """A script invocation whose keys and arguments are encoded already: each a RESP bulk
    string (``bulk``), one after the other. The limiter's batches are made of operations
    encoded once each (most of their keys and limits once a minute), so sending a batch joins
    bytes instead of encoding a hundred values.

    ``keys`` and ``args`` decode them again (as bytes), for the Cluster pipeline, which takes
    values, and for whoever inspects a call."""

    script: LuaScript
    key_count: int
    packed_keys: bytes
    arg_count: int
    packed_args: bytes

    @property
    def keys(self) -> list[bytes]:
        return _unbulk(self.packed_keys)

    @property
    def args(self) -> list[bytes]:
        return _unbulk(self.packed_args)


AnyCall: TypeAlias = "ScriptCall | PackedCall"


def bulk(value: str | int) -> bytes:
    """``value`` as a RESP bulk string, as a command's argument goes on the wire."""
    raw = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%b\r\n" % (len(raw), raw)


class EncodedInts(dict[int, bytes]):
    """Integers as RESP bulk strings (``bulk``), each encoded once: ``encoded[n]``. Holds
    ``_MEMO_MAX`` at most, then starts afresh."""

    __slots__ = ()

    def __missing__(self, value: int) -> bytes:
        if len(self) >= _MEMO_MAX:
            self.clear()
        encoded = self[value] = bulk(value)
        return encoded


def _unbulk(data: bytes) -> list[bytes]:
    """The values of consecutive RESP bulk strings (``bulk``'s output, joined)."""
    values: list[bytes] = []
    at = 0
    while at < len(data):
        end = data.index(b"\r\n", at)
        start = end + 2
        stop = start + int(data[at + 1 : end])
        values.append(data[start:stop])
        at = stop + 2
    return values


def as_text(value: object) -> str:
    """A reply field as ``str`` (clients made without ``decode_responses`` answer bytes)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def connect(
    url: str | Secret,
    *,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_connections: int | None = None,
) -> RedisClient:
    """A new asyncio client for ``url`` (see the module docstring for the schemes).

    No I/O happens here: the first command connects.
    """
    raw = url.reveal() if isinstance(url, Secret) else url
    socket_timeout_s = check_ttl(socket_timeout_s, "socket_timeout_s")
    connect_timeout_s = check_ttl(connect_timeout_s, "connect_timeout_s")
    if max_connections is not None and (type(max_connections) is not int or max_connections < 1):
        raise ValueError(f"max_connections must be an integer >= 1, got {max_connections!r}")
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "decode_responses": True,
        "retry": Retry(NoBackoff(), 0),
    }
    if scheme in _CLUSTER_SCHEMES:
        plain = urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES[scheme]))
        # Per node; the Cluster client refuses (rather than waits) beyond it.
        common["max_connections"] = max_connections or DEFAULT_CLUSTER_MAX_CONNECTIONS
        return RedisCluster.from_url(plain, **common)
    if scheme not in ("redis", "rediss", "unix"):
        # The URL may hold a password: name the scheme only.
        raise ValueError(
            f"unsupported Redis URL scheme {parts.scheme!r}; use redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster://"
        )
    # A blocking pool: beyond max_connections a command waits for a free connection (at most
    # socket_timeout_s) instead of failing at once under a burst of concurrent calls.
    pool = BlockingConnectionPool.from_url(
        raw,
        max_connections=max_connections or DEFAULT_MAX_CONNECTIONS,
        timeout=socket_timeout_s,
        **common,
    )
    return Redis.from_pool(pool)


def connect_for(options: RedisOptions, component: str) -> RedisClient:
    """The client of one Redis-backed component, from its validated options.

    ``ConfigError`` naming the component when the URL cannot make a client.
    """
    try:
        return connect(
            options.url,
            socket_timeout_s=options.socket_timeout_s,
            connect_timeout_s=options.connect_timeout_s,
            max_connections=options.max_connections,
        )
    except ValueError as exc:
        raise ConfigError(f"{component} 'redis': {exc}") from None


async def initialize_cluster(client: RedisClient) -> None:
    """Learn a Cluster's topology before the first command (a no-op for plain Redis).

    redis-py initializes a Cluster client on its first command; several first commands in
    flight at once each start that initialization and close each other's connections. Doing
    it once, up front, under the caller's lock, avoids the spurious connection errors.
    """
    if isinstance(client, RedisCluster):
        await client.initialize()


class ScriptClient:
    """A client plus what scripts need: every script loaded once, ``NOSCRIPT`` recovered.

    All scripts are loaded (``SCRIPT LOAD``, on every primary of a Cluster) before the first
    call, so that a pipeline never finds some of its scripts cached and others not: a
    ``NOSCRIPT`` call is repeated after the ones behind it, which would reorder the pipeline.
    After a restart, failover or ``SCRIPT FLUSH`` every call of a pipeline misses alike; the
    scripts are loaded again and the missed calls repeated in their order.

    On plain Redis the scripts travel on connections of its own, made like the client's (same
    address, credentials, TLS, connection class) but without redis-py's per-operation socket
    timeouts: one ``asyncio.timeout`` of the client's ``socket_timeout`` bounds each whole
    exchange instead (waiting for a connection, connecting, writing, reading every reply),
    which halves the client CPU of a round trip. A failed or cancelled exchange disconnects
    its connection (redis-py does so on every error), so none is ever reused a reply behind.

    A failure before the commands were written raises ``NotSentError``. After
    ``disconnect()`` every call raises it, and a connection still busy then is closed when its
    exchange ends instead of being kept.
    """

    __slots__ = (
        "_closed",
        "_idle",
        "_load_lock",
        "_loaded",
        "_made",
        "_make",
        "_memo",
        "_slots",
        "_timeout_s",
        "client",
    )

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._closed = False
        self._loaded = False
        self._load_lock = asyncio.Lock()
        self._idle: list[AbstractConnection] = []
        self._made: list[AbstractConnection] = []
        self._memo: dict[str | int, bytes] = {}
        self._timeout_s: float | None = None
        if isinstance(client, RedisCluster):
            self._slots = asyncio.Semaphore(1)  # unused: the Cluster client routes and pools
            self._make: Callable[[], AbstractConnection] | None = None
        else:
            pool = client.connection_pool
            kwargs = dict(pool.connection_kwargs)
            self._timeout_s = kwargs.get("socket_timeout")
            kwargs["socket_timeout"] = None
            connection_class = pool.connection_class
            self._make = lambda: connection_class(**kwargs)
            self._slots = asyncio.Semaphore(getattr(pool, "max_connections", None) or 64)

    async def run(self, call: ScriptCall) -> Any:
        """One script, one round trip; errors raise."""
        (result,) = await self.run_many((call,))
        if isinstance(result, ResponseError):
            raise result
        return result

    async def run_many(self, calls: Sequence[AnyCall]) -> list[Any]:
        """Run ``calls`` in order in one round trip (pipelined).

        Returns one entry per call: its reply, or the ``ResponseError`` it answered (the
        caller decides what an error means on its side). Connection failures raise.
        """
        if self._closed:
            raise NotSentError("the script client is closed")
        if not self._loaded:
            try:
                await self._load_once()
            except BACKEND_ERRORS as exc:
                raise _not_sent("scripts not loaded", exc) from exc
        results = await self._send(calls)
        missed = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missed:
            await self.load()
            again = await self._send([calls[i] for i in missed])
            for i, result in zip(missed, again, strict=True):
                results[i] = result
        return results

    async def load(self) -> None:
        """Put every script into the server's cache (all primaries on Cluster)."""
        client = self.client
        if isinstance(client, RedisCluster):
            await initialize_cluster(client)
            for script in ALL_SCRIPTS:
                await client.script_load(script.source)
        else:
            pipe = client.pipeline(transaction=False)
            for script in ALL_SCRIPTS:
                pipe.script_load(script.source)
            await pipe.execute()
        self._loaded = True

    async def disconnect(self) -> None:
        """Close the connections this object made (not the client's own); later calls raise
        ``NotSentError``."""
        self._closed = True
        made, self._made, self._idle = self._made, [], []
        for connection in made:
            await connection.disconnect()

    async def _load_once(self) -> None:
        async with self._load_lock:
            if not self._loaded:
                await self.load()

    async def _send(self, calls: Sequence[AnyCall]) -> list[Any]:
        client = self.client
        if isinstance(client, RedisCluster):
            pipe = client.pipeline(transaction=False)
            for call in calls:
                # execute_command: the Cluster pipeline blocks its ``evalsha`` method (a script
                # may touch keys of several slots) but routes the command by its keys; ours
                # all carry one hash tag.
                keys = call.keys
                pipe.execute_command("EVALSHA", call.script.sha, len(keys), *keys, *call.args)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results
        # Plain Redis: the commands are written on one connection in one write and their
        # replies read back in order: what redis-py's pipeline does, without its per-command
        # bookkeeping, which costs more client CPU than the scripts cost the server.
        memo = self._memo
        data = b"".join([_pack(call, memo) for call in calls])
        writing = False
        try:
            async with asyncio.timeout(self._timeout_s), self._slots:
                connection = self._idle.pop() if self._idle else self._new_connection()
                try:
                    if not connection.is_connected:
                        await _connect(connection)
                    writing = True
                    await connection.send_packed_command(data, check_health=False)
                    replies: list[Any] = []
                    for _ in calls:
                        try:
                            replies.append(await connection.read_response())
                        except ResponseError as exc:
                            replies.append(exc)
                    return replies
                finally:
                    if self._closed:  # disconnect() ran meanwhile: nobody would close it
                        await connection.disconnect(nowait=True)
                    else:
                        self._idle.append(connection)
        except BACKEND_ERRORS as exc:
            if writing or isinstance(exc, NotSentError):
                raise
            # Waiting for a slot or connecting: nothing was written.
            raise _not_sent("not sent", exc) from exc

    def _new_connection(self) -> AbstractConnection:
        if self._closed:  # disconnect() ran while this call waited for a slot
            raise NotSentError("the script client is closed")
        assert self._make is not None
        connection = self._make()
        self._made.append(connection)
        return connection


async def _connect(connection: AbstractConnection) -> None:
    """Connect (and authenticate) apart from the first write, so that a failure here is known
    to have sent nothing."""
    connect: Callable[[], Awaitable[None]] = connection.connect
    await connect()


_MEMO_MAX = 4096
"""Encoded keys and integers kept per client at most (then the memo starts afresh)."""


def _pack(call: AnyCall, memo: dict[str | int, bytes]) -> bytes:
    """``EVALSHA sha numkeys keys... args...`` in the Redis protocol (RESP).

    A ``PackedCall`` is encoded already: its parts are joined.
    Otherwise keys and integer arguments repeat from call to call (the same keys, TTLs and
    limits): their encoded form is taken from ``memo``, all of them in one ``map``. String
    arguments (lease and probe ids) are new each time: encoded directly, not kept.
    """
    if isinstance(call, PackedCall):
        return b"*%d\r\n$7\r\nEVALSHA\r\n%b%b%b%b" % (
            call.key_count + call.arg_count + 3,
            call.script.sha_resp,
            _bulk(call.key_count, memo),
            call.packed_keys,
            call.packed_args,
        )
    keys, args = call.keys, call.args
    if len(memo) > _MEMO_MAX:
        memo.clear()
    get = memo.get
    out = [
        b"*%d\r\n$7\r\nEVALSHA\r\n" % (len(keys) + len(args) + 3),
        call.script.sha_resp,
        _bulk(len(keys), memo),
    ]
    found = list(map(get, keys))
    if None in found:
        out += [_key(key, memo) for key in keys]
    else:
        out += found  # type: ignore[arg-type]  # no None in it: checked above
    found = list(map(get, args))
    # The misses (the new ids, a few of a batch's hundred arguments) are found by
    # ``list.index``, one scan in C, and encoded in place.
    missing = 0
    while True:
        try:
            missing = found.index(None, missing)
        except ValueError:  # no miss left
            break
        found[missing] = _arg(args[missing], memo)
        missing += 1
    out += found  # type: ignore[arg-type]  # no None left in it
    return b"".join(out)


def _key(key: str, memo: dict[str | int, bytes]) -> bytes:
    encoded = memo.get(key)
    if encoded is None:
        raw = key.encode()
        encoded = memo[key] = b"$%d\r\n%s\r\n" % (len(raw), raw)
    return encoded


def _arg(arg: str | int, memo: dict[str | int, bytes]) -> bytes:
    if isinstance(arg, str):
        raw = arg.encode()
        return b"$%d\r\n%s\r\n" % (len(raw), raw)
    return _bulk(arg, memo)


def _bulk(value: int, memo: dict[str | int, bytes]) -> bytes:
    encoded = memo.get(value)
    if encoded is None:
        raw = b"%d" % value
        encoded = memo[value] = b"$%d\r\n%s\r\n" % (len(raw), raw)
    return encoded
