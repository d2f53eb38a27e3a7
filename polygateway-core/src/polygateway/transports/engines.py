"""HTTP engines: the one thing the transport needs from an HTTP client, five ways.

``httptools`` (default: asyncio's Protocol with the httptools parser, the cheapest per call and
to import, no proxies; ``polygateway.transports.httptools_engine``), ``aiohttp`` (the default of
a source with ``trust_env = true``: proxies and netrc from the environment;
``polygateway.transports.aiohttp_engine``), and on the httpx API
(``polygateway.transports.httpx_engine``) ``httpx``, ``httpx-aiohttp`` (httpx's API over
aiohttp's connection handling; optional package ``httpx-aiohttp``) and ``httpx2`` (the successor
of httpx; optional package ``httpx2``). This module holds what they share; each engine's module
is imported when a source picks it, so a client imports only the HTTP client it uses. Each
engine holds one client/session per source, created lazily inside the running loop, with split
timeouts and a connection pool sized for high concurrency (the limiter, not the pool, governs
concurrency).

Engines translate their own failures: connection and read errors become
``TransientError(reason="network_error")``, engine timeouts ``TransientError(reason="timeout")``,
an unusable URL ``SourceDeadError``; the translation is raised outside the handler, so the
engine's exception (aiohttp's holds the request headers, the key among them) is never in the
chain. Cancellation is never caught. No engine follows a redirect. Bodies are read raw and
decoded by ``BodyReader`` (gzip, deflate), which counts the bytes on the wire and decoded against
``max_response_bytes`` and hands them out in slices of at most 64 KiB. A response must be closed
with ``aclose()`` (in ``finally``): a fully read response goes back to the pool, a partly read
one closes its connection; reading it after that is a ``ResponseClosedError`` unless its body
was read to the end (then it reads ``b""``).

Timeouts: ``connect_timeout_s`` bounds connecting (and waiting for a pooled connection);
``read_timeout_s`` bounds each socket read and is off by default because the transport always
runs the watchdog's total deadline (and for streams TTFT / inter-token), which also catches
servers that drip a byte at a time (a per-read timeout never does, encode/httpx#1450).
"""

from __future__ import annotations

import asyncio
import importlib
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import field
from typing import Protocol

from polygateway.errors import ConfigError, ResponseClosedError, TransientError
from polygateway.frozen import frozen_dataclass
from polygateway.transports.errors import sanitize_message, wire_error

ENGINE_NAMES: tuple[str, ...] = ("httptools", "aiohttp", "httpx", "httpx-aiohttp", "httpx2")
DEFAULT_ENGINE = "httptools"
"""The cheapest engine that passes the whole transport suite, per call and to import (measured:
tools/bench/RESULTS.md, sections "httptools engine" and "httptools as the default")."""

PROXY_ENGINE = "aiohttp"
"""The engine of a source with ``trust_env = true`` and no ``engine`` of its own: the default
engine reads no proxy variables."""

# Engines that need an optional distribution: engine name -> (module, pip extra).
_OPTIONAL: dict[str, tuple[str, str]] = {
    "httpx-aiohttp": ("httpx_aiohttp", "httpx-aiohttp>=0.1"),
    "httpx2": ("httpx2", "httpx2>=2"),
}


def default_engine(*, trust_env: bool) -> str:
    """The engine of a source that names none: ``PROXY_ENGINE`` when it reads proxies from the
    environment, else ``DEFAULT_ENGINE``."""
    return PROXY_ENGINE if trust_env else DEFAULT_ENGINE


@frozen_dataclass(slots=True)
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
    secret: str | tuple[str, ...] | None = field(default=None, repr=False)
    """The API key and the values of extra headers, only to mask them out of error messages."""
    max_response_bytes: int | None = None
    """Cap on a response body, counted both on the wire and decoded (gzip, deflate); ``None``
    or 0: unlimited. Exceeding it is a ``TransientError`` naming the cap."""
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
        """The next body bytes as they arrive; ``b""`` at the end of the body. After
        ``aclose()``: ``b""`` if the body was read to its end, else ``ResponseClosedError``."""
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
    if name == "httptools":
        from polygateway.transports.httptools_engine import HttptoolsEngine

        return HttptoolsEngine(config)
    if name == "aiohttp":
        from polygateway.transports.aiohttp_engine import AiohttpEngine

        return AiohttpEngine(config)
    if name == "httpx":
        from polygateway.transports.httpx_engine import HttpxEngine

        return HttpxEngine(config)
    if name in _OPTIONAL:
        module_name, requirement = _OPTIONAL[name]
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            # The package itself (on PyPI), as the core's extra of the same name lists it.
            raise ConfigError(
                f"source {config.source_name!r}: engine {name!r} needs the optional package: "
                f"pip install '{requirement}'"
            ) from exc
        from polygateway.transports.httpx_engine import HttpxEngine

        if name == "httpx2":
            return HttpxEngine(config, api="httpx2")
        return HttpxEngine(config, over_aiohttp=True)
    raise ConfigError(
        f"source {config.source_name!r}: unknown transport engine {name!r}; "
        f"choose one of {', '.join(ENGINE_NAMES)}"
    )


ACCEPT_ENCODING = "gzip, deflate"
"""What the transport asks for: the encodings ``BodyReader`` decodes (and caps) itself."""

_INFLATE_STEP = 64 * 1024
"""At most this many decoded bytes per step: a gzip bomb never expands at once."""

_MAX_CHUNK = 64 * 1024
"""The largest chunk ``BodyReader.read_chunk`` returns; after each one of this size it lets the
loop run once. Reads of buffered data do not suspend, and an engine may hand over a quarter of
a megabyte at once: parsed in one stretch, a large answer would make every other call wait."""


class _Inflater:
    """Incremental gzip (several members allowed) or deflate (zlib-wrapped or raw) decoding,
    at most ``_INFLATE_STEP`` bytes of output per call."""

    __slots__ = ("_gzip", "_obj", "_started", "pending")

    def __init__(self, gzip: bool) -> None:
        self._gzip = gzip
        self._obj = zlib.decompressobj(wbits=31 if gzip else 15)
        self._started = False
        self.pending = b""
        """Input not decoded yet (the output limit stopped short of it)."""

    def step(self, data: bytes) -> bytes:
        data = self.pending + data if self.pending else data
        obj = self._obj
        try:
            out = obj.decompress(data, _INFLATE_STEP)
        except zlib.error:
            if self._gzip or self._started:
                raise
            # ``deflate`` without the zlib wrapper (some servers send it raw).
            obj = self._obj = zlib.decompressobj(wbits=-15)
            out = obj.decompress(data, _INFLATE_STEP)
        self._started = True
        self.pending = obj.unconsumed_tail
        if obj.eof and obj.unused_data:
            rest = obj.unused_data
            if self._gzip and rest.lstrip(b"\0"):  # another gzip member follows
                self._obj = zlib.decompressobj(wbits=31)
                self.pending = rest + self.pending
            # Otherwise padding after the end of the stream: ignored.
        return out

    def finish(self) -> bytes:
        return self._obj.flush()


async def _end_of_body() -> bytes:
    return b""


def _closed_body(source_name: str) -> Callable[[], Awaitable[bytes]]:
    """The raw reader of a response closed before the end of its body: every read fails.
    It holds the source's name only, never the reader (no cycle back to it)."""

    async def closed() -> bytes:
        raise ResponseClosedError(
            f"source {source_name!r}: the response was read after aclose(), before the end of "
            "its body (the rest of it is gone with the connection)"
        )

    return closed


def wire_failure(exc: Exception, config: EngineConfig) -> TransientError:
    """A client or socket failure as the error class the transport raises (timeouts are
    ``TimeoutError`` subclasses, aiohttp's own included)."""
    return wire_error(
        exc,
        timeout=isinstance(exc, TimeoutError),
        source_name=config.source_name,
        secret=config.secret,
    )


class BodyReader:
    """A response body as the transport reads it, through the engine's raw (undecoded) reads.

    Decoding happens here rather than in the engine so that the bytes on the wire and the
    decoded bytes both count against ``max_response_bytes`` while they arrive, one bounded
    step at a time (a gzip bomb never expands beyond one step past the cap)."""

    __slots__ = (
        "_cap",
        "_config",
        "_decoded",
        "_detached",
        "_eof",
        "_failures",
        "_held",
        "_inflater",
        "_raw",
        "_translate",
        "_wire",
    )

    def __init__(
        self,
        raw: Callable[[], Awaitable[bytes]],
        content_encoding: str | None,
        config: EngineConfig,
        failures: tuple[type[Exception], ...] = (),
        translate: Callable[[Exception, EngineConfig], Exception] = wire_failure,
    ) -> None:
        """``raw``: the engine's read of the next raw bytes (``b""`` at the end). The
        engine's own ``failures`` it raises become ``translate(exc, config)``, raised outside
        the handler: the engine can hand over its client's read as it is, without a
        coroutine of its own around every read."""
        self._raw = raw
        self._config = config
        self._failures = failures
        self._translate = translate
        self._cap = config.max_response_bytes or None
        self._wire = 0
        self._decoded = 0
        self._held = b""
        """Raw bytes read but not handed out yet (beyond ``_MAX_CHUNK``)."""
        self._eof = False
        self._detached = False
        encoding = "" if content_encoding is None else content_encoding.strip().lower()
        if not encoding or encoding == "identity":
            self._inflater: _Inflater | None = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            self._inflater = _Inflater(gzip=encoding != "deflate")
        else:
            # Raised by the first read, so that the caller's ``finally`` closes the response.
            self._raw = self._unsupported(encoding)
            self._inflater = None

    def detach(self) -> None:
        """The response is closed: once the body was read to its end, later reads see the end
        of the body (``b""``); before that, every later read raises ``ResponseClosedError``
        (what was not read is gone with the connection) and the body is never ``exhausted``.

        Drops the raw reader, which is the response wrapper's own method: the wrapper holds
        this reader too, and the cycle would keep both (with the engine's response and its
        headers) alive until a garbage collection, one per call. The decoder goes too."""
        self._detached = True
        if self.exhausted:
            self._raw = _end_of_body
        else:
            self._raw = _closed_body(self._config.source_name)
            self._eof = False  # bytes held back or still encoded were not handed out
        self._held = b""
        self._inflater = None

    def raw_ended(self) -> bool:
        """The engine knows its raw body is over: ``exhausted`` from now on once nothing is
        held back or left to decode, without the read of ``b""`` that would say so (a
        decoder still gets its end from that read)."""
        if self._inflater is None and not self._held and not self._detached:
            self._eof = True
        return self.exhausted

    @property
    def exhausted(self) -> bool:
        """The raw body ended and everything of it was handed out."""
        return (
            self._eof and not self._held and (self._inflater is None or not self._inflater.pending)
        )

    def _unsupported(self, encoding: str) -> Callable[[], Awaitable[bytes]]:
        async def fail() -> bytes:
            raise TransientError(
                f"source {self._config.source_name!r}: unsupported Content-Encoding "
                f"{sanitize_message(encoding, limit=40)!r} (asked for {ACCEPT_ENCODING})",
                source_name=self._config.source_name,
            )

        return fail

    def _over(self, what: str) -> TransientError:
        name = self._config.source_name
        return TransientError(
            f"source {name!r}: response body exceeds max_response_bytes={self._cap} ({what})",
            source_name=name,
        )

    async def read_chunk(self) -> bytes:
        inflater = self._inflater
        if inflater is None and self._held:
            data, self._held = self._held[:_MAX_CHUNK], self._held[_MAX_CHUNK:]
            await asyncio.sleep(0)  # the previous slice was handed out without a pause
            return data
        while True:
            if inflater is not None and inflater.pending:
                data = b""
                await asyncio.sleep(0)  # the previous step's output was handed out, no pause
            elif self._eof:
                return b""
            else:
                # The engine's own read, its failures translated here, raised outside the
                # handler (the engine's exception stays out of the chain).
                failure = None
                try:
                    data = await self._raw()
                except self._failures as exc:
                    failure = self._translate(exc, self._config)
                if failure is not None:
                    raise failure
                if not data:
                    self._eof = True
                    if inflater is None:
                        return data
                    out = self._inflate(lambda _: inflater.finish(), b"")
                    self._count(out)
                    return out
                self._wire += len(data)
                if self._cap is not None and self._wire > self._cap:
                    raise self._over("on the wire")
                if inflater is None:
                    if len(data) > _MAX_CHUNK:
                        data, self._held = data[:_MAX_CHUNK], data[_MAX_CHUNK:]
                    return data
            out = self._inflate(inflater.step, data)
            if out:
                self._count(out)
                return out

    def _inflate(self, step: Callable[[bytes], bytes], data: bytes) -> bytes:
        try:
            return step(data)
        except zlib.error as exc:
            name = self._config.source_name
            error = TransientError(
                f"source {name!r}: corrupt compressed body: {exc}", source_name=name
            )
        raise error

    def _count(self, out: bytes) -> None:
        self._decoded += len(out)
        if self._cap is not None and self._decoded > self._cap:
            raise self._over("decoded")

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body (at most about ``limit`` bytes when given)."""
        parts: list[bytes] = []
        size = 0
        while limit is None or size < limit:
            chunk = await self.read_chunk()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)


__all__ = [
    "ACCEPT_ENCODING",
    "DEFAULT_ENGINE",
    "ENGINE_NAMES",
    "PROXY_ENGINE",
    "BodyReader",
    "EngineConfig",
    "EngineResponse",
    "HttpEngine",
    "default_engine",
    "make_engine",
    "wire_failure",
]
