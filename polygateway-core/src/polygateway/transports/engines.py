"""HTTP engines: the one thing the transport needs from an HTTP client, four ways.

``aiohttp`` (default: the fastest per call, see ``tools/bench/RESULTS.md``), ``httpx``,
``httpx-aiohttp`` (httpx's API over aiohttp's connection handling; optional package
``httpx-aiohttp``) and ``httpx2`` (the successor of httpx; optional package ``httpx2``). Each
engine holds one client/session per source, created lazily inside the running loop, with split
timeouts and a connection pool sized for high concurrency (the limiter, not the pool, governs
concurrency).

Engines translate their own failures: connection and read errors become
``TransientError(reason="network_error")``, engine timeouts ``TransientError(reason="timeout")``,
an unusable URL ``SourceDeadError``. Cancellation is never caught. A response must be closed
with ``aclose()`` (in ``finally``): a fully read response goes back to the pool, a partly read
one closes its connection.

Timeouts: ``connect_timeout_s`` bounds connecting (and waiting for a pooled connection);
``read_timeout_s`` bounds each socket read and is off by default because the transport always
runs the watchdog's total deadline (and for streams TTFT / inter-token), which also catches
servers that drip a byte at a time (a per-read timeout never does, encode/httpx#1450).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from polygateway.errors import ConfigError, SourceDeadError, TransientError
from polygateway.transports.errors import sanitize_message, wire_error

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

_AIOHTTP_FAILURES: tuple[type[Exception], ...] = (aiohttp.ClientError, OSError)

ENGINE_NAMES: tuple[str, ...] = ("aiohttp", "httpx", "httpx-aiohttp", "httpx2")
DEFAULT_ENGINE = "aiohttp"
"""The fastest engine that passes the whole transport suite (measured: tools/bench/RESULTS.md)."""

# Engines that need an optional distribution: engine name -> (module, pip extra).
_OPTIONAL: dict[str, tuple[str, str]] = {
    "httpx-aiohttp": ("httpx_aiohttp", "httpx-aiohttp"),
    "httpx2": ("httpx2", "httpx2"),
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Per-source client settings (from ``SourceConfig`` and its ``options``)."""

    source_name: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Sent with every request (incl. ``Authorization``: hence not in the repr)."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float | None = None
    max_connections: int = 1024
    """0 = unlimited."""
    keepalive_s: float = 15.0
    trust_env: bool = False
    """Honour proxy variables / netrc from the environment (opt-in per source)."""
    secret: str | None = field(default=None, repr=False)
    """The API key, only to mask it out of error messages."""
    plain_http: bool = False
    """The base URL is ``http://``: no TLS is involved unless a proxy says otherwise."""


class EngineResponse(Protocol):
    """A response whose headers have arrived; the body is read incrementally."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive."""
        ...

    async def read_chunk(self) -> bytes:
        """The next body bytes as they arrive; ``b""`` at the end of the body."""
        ...

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body (at most about ``limit`` bytes when given)."""
        ...

    def at_eof(self) -> bool:
        """Whether the body is known to be completely read (best effort)."""
        ...

    async def aclose(self) -> None:
        """Release the connection (back to the pool when the body was fully read). Idempotent."""
        ...


class HttpEngine(Protocol):
    name: str

    async def post(self, url: str, body: bytes) -> EngineResponse:
        """Send ``body`` and wait for the response headers."""
        ...

    async def aclose(self) -> None: ...


def make_engine(name: str, config: EngineConfig) -> HttpEngine:
    """The engine called ``name``; ``ConfigError`` naming the choices when unknown, or the
    pip command when its optional package is missing."""
    if name == "aiohttp":
        return AiohttpEngine(config)
    if name == "httpx":
        return HttpxEngine(config)
    if name in _OPTIONAL:
        module_name, extra = _OPTIONAL[name]
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f"source {config.source_name!r}: engine {name!r} needs the optional package: "
                f"pip install 'polygateway-core[{extra}]'"
            ) from exc
        if name == "httpx2":
            return HttpxEngine(config, api="httpx2")
        return HttpxEngine(config, over_aiohttp=True)
    raise ConfigError(
        f"source {config.source_name!r}: unknown transport engine {name!r}; "
        f"choose one of {', '.join(ENGINE_NAMES)}"
    )


async def _read_capped(response: EngineResponse, limit: int | None) -> bytes:
    parts: list[bytes] = []
    size = 0
    while limit is None or size < limit:
        chunk = await response.read_chunk()
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


# --------------------------------------------------------------------------- aiohttp


def _aiohttp_error(exc: Exception, config: EngineConfig) -> TransientError:
    """An aiohttp or socket failure as the error class the transport raises (timeouts are
    ``TimeoutError`` subclasses, aiohttp's own included)."""
    return wire_error(
        exc,
        timeout=isinstance(exc, TimeoutError),
        source_name=config.source_name,
        secret=config.secret,
    )


class _AiohttpResponse:
    __slots__ = ("_config", "_response")

    def __init__(self, response: aiohttp.ClientResponse, config: EngineConfig) -> None:
        self._response = response
        self._config = config

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def read_chunk(self) -> bytes:
        try:
            return await self._response.content.readany()
        except _AIOHTTP_FAILURES as exc:
            raise _aiohttp_error(exc, self._config) from exc

    async def read(self, limit: int | None = None) -> bytes:
        if limit is not None:
            return await _read_capped(self, limit)
        try:
            return await self._response.read()
        except _AIOHTTP_FAILURES as exc:
            raise _aiohttp_error(exc, self._config) from exc

    def at_eof(self) -> bool:
        return self._response.content.at_eof()

    async def aclose(self) -> None:
        response = self._response
        if response.content.at_eof():
            response.release()  # body complete: the connection goes back to the pool
        else:
            response.close()  # mid-body: the connection cannot be reused


class AiohttpEngine:
    """One ``aiohttp.ClientSession`` per source (created on first use, per event loop)."""

    name = "aiohttp"

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The live session, if one was created (tests inspect its connector)."""
        return self._session

    def _new_session(self, loop: asyncio.AbstractEventLoop) -> aiohttp.ClientSession:
        config = self._config
        connector = aiohttp.TCPConnector(
            limit=config.max_connections,
            limit_per_host=0,
            keepalive_timeout=config.keepalive_s,
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=config.connect_timeout_s,
            sock_connect=config.connect_timeout_s,
            sock_read=config.read_timeout_s,
        )
        if self._session is not None:
            logger.debug(
                "source %r: event loop changed; opening a new HTTP session", config.source_name
            )
        self._loop = loop
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers=dict(config.headers),
            trust_env=config.trust_env,
        )
        return self._session

    async def post(self, url: str, body: bytes) -> EngineResponse:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or self._loop is not loop or session.closed:
            session = self._new_session(loop)
        config = self._config
        try:
            # Never follow a redirect: it means base_url is wrong (a 3xx is SourceDeadError),
            # and following one would re-send the key and the body somewhere else.
            response = await session.post(url, data=body, allow_redirects=False)
        except aiohttp.InvalidURL as exc:
            raise SourceDeadError(
                sanitize_message(f"source {config.source_name!r}: invalid URL {url!r}"),
                source_name=config.source_name,
            ) from exc
        except _AIOHTTP_FAILURES as exc:
            raise _aiohttp_error(exc, config) from exc
        return _AiohttpResponse(response, config)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - aclose is async, a loop is running
            running = None
        if running is self._loop:
            await session.close()
        # A session of a loop that is gone cannot be closed from here; its sockets went with it.


# --------------------------------------------------------------------------- httpx, httpx2


def _httpx_error(
    exc: Exception, config: EngineConfig, api: ModuleType
) -> TransientError | SourceDeadError:
    cause = exc.__cause__
    if isinstance(exc, (api.UnsupportedProtocol, api.InvalidURL)):
        return SourceDeadError(
            sanitize_message(f"source {config.source_name!r}: unusable URL: {exc}", config.secret),
            source_name=config.source_name,
        )
    # httpx-aiohttp maps every aiohttp connection error to ConnectTimeout: trust the cause.
    if cause is not None and isinstance(cause, aiohttp.ClientError):
        timed_out = isinstance(cause, TimeoutError)
    else:
        timed_out = isinstance(exc, (api.TimeoutException, TimeoutError))
    return wire_error(exc, timeout=timed_out, source_name=config.source_name, secret=config.secret)


def _httpx_failures(api: ModuleType) -> tuple[type[Exception], ...]:
    # Errors httpx-aiohttp does not map (and its stream's aclose) surface as aiohttp's own.
    return (api.TransportError, api.InvalidURL, OSError, aiohttp.ClientError)


class _HttpxResponse:
    """A response of httpx or httpx2 (same API)."""

    __slots__ = ("_api", "_chunks", "_config", "_failures", "_response")

    def __init__(
        self,
        response: httpx.Response,
        config: EngineConfig,
        failures: tuple[type[Exception], ...],
        api: ModuleType,
    ) -> None:
        self._response = response
        self._config = config
        self._failures = failures
        self._api = api
        self._chunks: AsyncIterator[bytes] | None = None

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def read_chunk(self) -> bytes:
        chunks = self._chunks
        if chunks is None:
            chunks = self._chunks = self._response.aiter_bytes()
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return b""
        except TimeoutError as exc:
            raise _httpx_error(exc, self._config, self._api) from exc
        except self._failures as exc:
            raise _httpx_error(exc, self._config, self._api) from exc

    async def read(self, limit: int | None = None) -> bytes:
        return await _read_capped(self, limit)

    def at_eof(self) -> bool:
        # httpx closes the response itself once its byte iterator is exhausted.
        return self._response.is_closed

    async def aclose(self) -> None:
        chunks, self._chunks = self._chunks, None
        try:
            if chunks is not None:
                close = getattr(chunks, "aclose", None)
                if close is not None:
                    await close()
            await self._response.aclose()
        except self._failures as exc:
            # Closing a broken connection may fail; the connection is gone either way.
            logger.debug(
                "source %r: error while closing a response: %r", self._config.source_name, exc
            )


class HttpxEngine:
    """One ``AsyncClient`` per source on the httpx API: ``httpx`` (default), ``httpx2``
    (``api="httpx2"``), or httpx with its I/O on aiohttp (``over_aiohttp``)."""

    def __init__(
        self, config: EngineConfig, *, over_aiohttp: bool = False, api: str = "httpx"
    ) -> None:
        if over_aiohttp and api != "httpx":
            raise ValueError("over_aiohttp runs on the httpx API only")
        self._config = config
        self._over_aiohttp = over_aiohttp
        self._api: ModuleType = importlib.import_module(api)
        self.name = "httpx-aiohttp" if over_aiohttp else api
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failures = _httpx_failures(self._api)

    def _new_client(self, loop: asyncio.AbstractEventLoop) -> httpx.AsyncClient:
        api = self._api
        config = self._config
        limit = config.max_connections or None
        limits = api.Limits(
            max_connections=limit,
            max_keepalive_connections=limit,
            keepalive_expiry=config.keepalive_s,
        )
        timeout = api.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.read_timeout_s,
            pool=config.connect_timeout_s,
        )
        kwargs: dict[str, Any] = {
            "headers": dict(config.headers),
            "timeout": timeout,
            "limits": limits,
            "trust_env": config.trust_env,
        }
        if config.plain_http and not config.trust_env:
            # No TLS on the way (plain http, no proxy from the environment): skip building a
            # verifying SSL context, which costs ~0.3 s per client (it loads the CA bundle).
            kwargs["verify"] = False
        client: httpx.AsyncClient
        if self._over_aiohttp:
            from httpx_aiohttp import HttpxAiohttpClient

            client = HttpxAiohttpClient(**kwargs)
        else:
            client = api.AsyncClient(**kwargs)
        self._loop = loop
        self._client = client
        return client

    async def post(self, url: str, body: bytes) -> EngineResponse:
        loop = asyncio.get_running_loop()
        client = self._client
        if client is None or self._loop is not loop or client.is_closed:
            client = self._new_client(loop)
        try:
            request = client.build_request("POST", url, content=body)
            response = await client.send(request, stream=True)
        except TimeoutError as exc:
            raise _httpx_error(exc, self._config, self._api) from exc
        except self._failures as exc:
            raise _httpx_error(exc, self._config, self._api) from exc
        return _HttpxResponse(response, self._config, self._failures, self._api)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is None or client.is_closed:
            return
        if asyncio.get_running_loop() is self._loop:
            await client.aclose()


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINE_NAMES",
    "AiohttpEngine",
    "EngineConfig",
    "EngineResponse",
    "HttpEngine",
    "HttpxEngine",
    "make_engine",
]
