"""The httpx-API engines: ``httpx``, ``httpx2`` and ``httpx-aiohttp`` (httpx over aiohttp's
connection handling), one ``AsyncClient`` per source."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from polygateway.errors import SourceDeadError, TransientError
from polygateway.transports.engines import BodyReader, EngineConfig, EngineResponse
from polygateway.transports.errors import sanitize_message, wire_error

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)


def _aiohttp_errors(over_aiohttp: bool) -> tuple[type[Exception], ...]:
    """aiohttp's error class when httpx runs over aiohttp (imported only then), else none."""
    if not over_aiohttp:
        return ()
    import aiohttp

    return (aiohttp.ClientError,)


def _httpx_error(
    exc: Exception,
    config: EngineConfig,
    api: ModuleType,
    aiohttp_errors: tuple[type[Exception], ...],
) -> TransientError | SourceDeadError:
    cause = exc.__cause__
    if isinstance(exc, (api.UnsupportedProtocol, api.InvalidURL)):
        return SourceDeadError(
            sanitize_message(f"source {config.source_name!r}: unusable URL: {exc}", config.secret),
            source_name=config.source_name,
        )
    # httpx-aiohttp maps every aiohttp connection error to ConnectTimeout: trust the cause.
    if cause is not None and aiohttp_errors and isinstance(cause, aiohttp_errors):
        timed_out = isinstance(cause, TimeoutError)
    else:
        timed_out = isinstance(exc, (api.TimeoutException, TimeoutError))
    return wire_error(exc, timeout=timed_out, source_name=config.source_name, secret=config.secret)


def _httpx_failures(
    api: ModuleType, aiohttp_errors: tuple[type[Exception], ...]
) -> tuple[type[Exception], ...]:
    # Errors httpx-aiohttp does not map (and its stream's aclose) surface as aiohttp's own.
    return (api.TransportError, api.InvalidURL, OSError, *aiohttp_errors)


class _HttpxResponse:
    """A response of httpx or httpx2 (same API)."""

    __slots__ = (
        "_aiohttp_errors",
        "_api",
        "_body",
        "_chunks",
        "_config",
        "_failures",
        "_response",
        "read",
        "read_chunk",
    )

    def __init__(
        self,
        response: httpx.Response,
        config: EngineConfig,
        failures: tuple[type[Exception], ...],
        api: ModuleType,
        aiohttp_errors: tuple[type[Exception], ...],
    ) -> None:
        self._response = response
        self._config = config
        self._failures = failures
        self._api = api
        self._aiohttp_errors = aiohttp_errors
        self._chunks: AsyncIterator[bytes] | None = None
        body = self._body = BodyReader(
            self._raw_chunk, response.headers.get("Content-Encoding"), config
        )
        self.read_chunk = body.read_chunk
        self.read = body.read

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def _raw_chunk(self) -> bytes:
        chunks = self._chunks
        if chunks is None:
            # Raw: BodyReader decodes (httpx would expand a gzip bomb a whole read at once).
            chunks = self._chunks = self._response.aiter_raw()
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return b""
        except TimeoutError as exc:
            error = _httpx_error(exc, self._config, self._api, self._aiohttp_errors)
        except self._failures as exc:
            error = _httpx_error(exc, self._config, self._api, self._aiohttp_errors)
        raise error  # outside the handler: the engine's exception stays out of the chain

    def at_eof(self) -> bool:
        # httpx closes the response itself once its byte iterator is exhausted.
        return self._response.is_closed and self._body.exhausted

    async def aclose(self) -> None:
        self._body.detach()
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
                "source %r: error while closing a response: %s",
                self._config.source_name,
                type(exc).__name__,
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
        self._aiohttp_errors = _aiohttp_errors(over_aiohttp)
        self._failures = _httpx_failures(self._api, self._aiohttp_errors)

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
            "follow_redirects": False,  # never: see AiohttpEngine.post
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
            response = await client.send(request, stream=True, follow_redirects=False)
        except TimeoutError as exc:
            error = _httpx_error(exc, self._config, self._api, self._aiohttp_errors)
        except self._failures as exc:
            error = _httpx_error(exc, self._config, self._api, self._aiohttp_errors)
        else:
            return _HttpxResponse(
                response, self._config, self._failures, self._api, self._aiohttp_errors
            )
        raise error  # outside the handler: the engine's exception stays out of the chain

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is None or client.is_closed:
            return
        if asyncio.get_running_loop() is self._loop:
            await client.aclose()


__all__ = ["HttpxEngine"]
