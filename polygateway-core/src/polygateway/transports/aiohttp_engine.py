"""The ``aiohttp`` engine: one ``aiohttp.ClientSession`` per source.

Chosen with ``engine = "aiohttp"``, and for a source with ``trust_env = true`` that names no
engine (proxy variables and netrc from the environment, which the default engine does not
read). A module of its own so that aiohttp, whose import builds two SSL contexts from the CA
store, is imported only by a client that uses it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from polygateway.errors import SourceDeadError
from polygateway.transports.engines import (
    BodyReader,
    EngineConfig,
    EngineResponse,
    wire_failure,
)
from polygateway.transports.errors import sanitize_message

logger = logging.getLogger(__name__)

_AIOHTTP_FAILURES: tuple[type[Exception], ...] = (aiohttp.ClientError, OSError)


class _AiohttpResponse:
    __slots__ = ("_body", "_config", "_response", "read", "read_chunk")

    def __init__(self, response: aiohttp.ClientResponse, config: EngineConfig) -> None:
        self._response = response
        self._config = config
        # aiohttp's own read, its failures translated by the reader (outside the handler:
        # aiohttp's exception, whose request info holds the request headers and the API key
        # among them, stays out of the chain).
        body = self._body = BodyReader(
            response.content.readany,
            response.headers.get("Content-Encoding"),
            config,
            _AIOHTTP_FAILURES,
        )
        self.read_chunk = body.read_chunk
        self.read = body.read

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    def at_eof(self) -> bool:
        return self._response.content.at_eof() and self._body.raw_ended()

    async def aclose(self) -> None:
        self._body.detach()
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
            auto_decompress=False,  # BodyReader decodes, under the byte cap
        )
        return self._session

    async def post(self, url: str, body: bytes) -> EngineResponse:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is None or self._loop is not loop or session.closed:
            session = self._new_session(loop)
        config = self._config
        try:
            # Never follow a redirect: it would send the prompt and the credential headers to
            # another host. A 3xx is a misconfigured base_url (SourceDeadError).
            response = await session.post(url, data=body, allow_redirects=False)
        except aiohttp.InvalidURL:
            error: Exception = SourceDeadError(
                sanitize_message(f"source {config.source_name!r}: invalid URL {url!r}"),
                source_name=config.source_name,
            )
        except _AIOHTTP_FAILURES as exc:
            error = wire_failure(exc, config)
        else:
            return _AiohttpResponse(response, config)
        raise error  # outside the handler: no aiohttp exception (request headers) in the chain

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


__all__ = ["AiohttpEngine"]
