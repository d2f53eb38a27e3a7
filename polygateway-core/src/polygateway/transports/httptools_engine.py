"""The ``httptools`` engine: HTTP/1.1 on asyncio's ``Protocol``, parsed by ``httptools``.

The default engine (``engines.DEFAULT_ENGINE``). It does only what the transport asks of an
engine: ``POST`` with a ``Content-Length`` body, responses with ``Content-Length``, chunked or
ended by the server closing the connection, decoded (gzip, deflate) and capped by the shared
``BodyReader``. Plain TCP or TLS through asyncio (``ssl.create_default_context()`` of the CA
store, begun in a thread of its own when the engine of an ``https`` source is made and awaited
at the first TLS connection: certificates and host names verified; ``server_hostname`` is the
URL's host). No proxies (``trust_env`` is refused), no redirects, no HTTP/2.

Connections are pooled per (scheme, host, port) with keep-alive: a response read to its end goes
back to the pool unless the server said ``Connection: close``; an idle connection older than
``keepalive_s`` or closed by the server is dropped when next taken (``keepalive_s`` 0: none is
kept). ``max_connections`` bounds the connections in use (0: unlimited); waiting for one and
connecting share one ``connect_timeout_s``. Sending the request is bounded by ``read_timeout_s``
(the httpx engine's write timeout), as is each read. Reading pauses while more than ``_HIGH_WATER``
body bytes wait for the consumer and resumes once it has taken them all. Header names and the
values of ``Transfer-Encoding``, ``Connection`` and ``Content-Encoding`` are compared
case-insensitively (RFC 9110 sec. 5.1, 7.6.1, 8.4; RFC 9112 sec. 6.1): a chunked body the server
ends by closing the connection before its last chunk is a ``TransientError``, whatever its
spelling. Errors are the other engines' classes: connection, TLS, parse and read failures
``TransientError(reason="network_error")``, timeouts ``reason="timeout"``, an unusable URL or a
TLS context that could not be made from the CA store ``SourceDeadError``; a response closed
before its end, or a call cancelled anywhere, aborts its connection, which never returns to the
pool."""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import field
from urllib.parse import unquote, urlsplit

import httptools

from polygateway.errors import ConfigError, SourceDeadError, TransientError
from polygateway.frozen import frozen_dataclass
from polygateway.transports.engines import BodyReader, EngineConfig, EngineResponse
from polygateway.transports.errors import sanitize_message, wire_error

_HIGH_WATER = 256 * 1024
"""Body bytes buffered for the consumer before the connection stops reading from the socket."""

_MAX_HEADER_BYTES = 64 * 1024
"""A response head larger than this is refused (a server dripping headers forever)."""

_FORBIDDEN_IN_HEADERS = ("\r", "\n", "\0")

_JOIN_BYTES = 64 * 1024
"""A request body up to this size is joined to its head and written at once; a larger one is
written on its own rather than copied into one buffer with its head."""

_READ_BYTES = 64 * 1024
"""The most one read from the socket takes (asyncio reads up to 256 KiB for a plain
``Protocol``); also what the buffer of an event loop's connections holds in memory."""


def read_buffer() -> memoryview:
    """The buffer the connections of one event loop read into.

    asyncio reads for a plain ``Protocol`` into a new 256 KiB bytes object per read and shrinks
    it to what came; glibc serves an allocation that large by ``mmap`` (or by moving the
    heap's top), so every read of a small answer cost system calls and a page fault. A
    ``BufferedProtocol`` is handed a buffer instead, and one serves every connection of a loop:
    the loop runs one callback at a time, and ``buffer_updated`` parses what came before it
    returns (httptools hands the callbacks copies)."""
    return memoryview(bytearray(_READ_BYTES))


_MAX_TARGETS = 256
"""URLs whose request head is kept worked out; past this the cache starts afresh (URLs that
vary per call, by their query, would otherwise grow it without end)."""


def tls_context() -> Future[ssl.SSLContext]:
    """The verifying client context (``ssl.create_default_context()``) of the CA store OpenSSL
    would read now (``ssl.get_default_verify_paths()``: ``SSL_CERT_FILE``, ``SSL_CERT_DIR``,
    else its defaults), being made in a thread of its own: one per store, shared by every
    engine, as aiohttp shares the one it makes at import. Nothing changes a context after it
    is made; a store that could not be read is tried again by the next caller.

    Reading the store takes about a quarter of a billion instructions (OpenSSL 3), about
    100 ms: in a thread it is off the event loop, and off the start-up's path until the first
    TLS connection. CPython releases the GIL while OpenSSL loads verify locations (since
    3.11.0, gh-94637). A process forked meanwhile has no such thread: it makes its own."""
    paths = ssl.get_default_verify_paths()
    return tls_context_of(paths.cafile, paths.capath)


def tls_context_of(cafile: str | None, capath: str | None) -> Future[ssl.SSLContext]:
    """``tls_context()`` of the CA store named (``ssl.get_default_verify_paths()``'s parts)."""
    pid = os.getpid()
    made = _tls_context_for(cafile, capath, pid)
    if made.done() and made.exception() is not None:
        # Only the callers that held it see that failure: this one reads the store again.
        _tls_context_for.cache_clear()
        made = _tls_context_for(cafile, capath, pid)
    return made


@functools.lru_cache(maxsize=4)
def _tls_context_for(cafile: str | None, capath: str | None, pid: int) -> Future[ssl.SSLContext]:
    # ``pid``: a thread is not forked with its process, nor is what it would have finished.
    made: Future[ssl.SSLContext] = Future()
    # Running from now on: a caller that stops waiting (a cancelled call) cannot cancel it.
    made.set_running_or_notify_cancel()

    def make() -> None:
        try:
            # The store of the cache key, named: the environment may change before this runs.
            context = ssl.create_default_context(cafile=cafile, capath=capath)
        except Exception as exc:  # noqa: BLE001 - kept for the first TLS connection
            made.set_exception(exc)
        else:
            made.set_result(context)
        finally:
            if not made.done():  # the thread stopped by something else: no caller waits forever
                made.set_exception(RuntimeError("the TLS context was not made"))

    try:
        threading.Thread(target=make, name="polygateway-tls-context").start()
    except RuntimeError as exc:  # no thread to be had (interpreter exit, resource limits)
        made.set_exception(exc)
    return made


def _is_chunked(transfer_encoding: str) -> bool:
    """Whether the body is chunked: ``chunked`` is the last transfer coding, in any case, as
    llhttp (which decodes the chunks) reads it (RFC 9112 sec. 6.1, sec. 6.3)."""
    return transfer_encoding.rsplit(",", 1)[-1].strip().lower() == "chunked"


class _Closed(ConnectionError):
    """The server closed the connection before the response was complete."""


class _HeadersTooLarge(ConnectionError):
    """The response head exceeded ``_MAX_HEADER_BYTES``."""


class _Unsolicited(ConnectionError):
    """The server sent bytes after the end of the response asked for."""


class _Headers(Mapping[str, str]):
    """Response headers, looked up case-insensitively (repeated fields joined with ``", "``)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields  # keys lower-case

    def __getitem__(self, name: str) -> str:
        return self._fields[name.lower()]

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._fields.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"_Headers({self._fields!r})"


class _Connection(asyncio.BufferedProtocol):
    """One HTTP/1.1 connection, one request at a time. The socket is read into ``buffer``
    (``read_buffer``: shared by the connections of one event loop); httptools calls the
    ``on_*`` methods from ``buffer_updated``; the response's reader waits on ``_waiter``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, buffer: memoryview) -> None:
        self._loop = loop
        self._buffer = buffer
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.pool_key: tuple[str, str, int] = ("", "", 0)
        self._keep_alive = True
        self._active = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.fields: dict[str, str] = {}
        self._head_bytes = 0
        self.headers_done = False
        self._informational = False
        self.complete = False
        self.error: BaseException | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self._until_eof = False

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        parser = self._parser
        if not self._active or parser is None:
            # Bytes nobody asked for (on an idle connection): it cannot be trusted any more.
            self.abort()
            return
        try:
            parser.feed_data(self._buffer[:nbytes])
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, ConnectionError) else exc)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # The parser holds this protocol's callbacks: a reference cycle that would keep a
        # closed connection (and its buffered body) for the garbage collector.
        self._parser = None
        if self._active and not self.complete and self.error is None:
            if self._until_eof and exc is None:
                self.complete = True  # a body without length ends with the connection
            else:
                self.error = exc or _Closed(
                    "the server closed the connection before the response was complete"
                )
        self._wake()
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            # A second response behind the one asked for (a buggy or hostile server): never
            # parsed into it; the connection is dropped, the answer already read stands.
            raise _Unsolicited("bytes after the end of the response")

    def on_status(self, status: bytes) -> None:
        self._count_head(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools calls this once per field, with its whole name and value.
        if self.headers_done:
            return  # a trailer of a chunked body: not kept (it would be held in no cap)
        self._count_head(name, value)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = self.fields.get(key)
        self.fields[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser is None:  # pragma: no cover - only called from feed_data, before the loss
            return
        status = parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (103 Early Hints): the real one follows on the same connection.
            self._informational = True
            self.fields = {}
            self._head_bytes = 0
            return
        self.status = status
        self.headers_done = True
        fields = self.fields
        # Neither chunked nor of a given length: the body ends with the connection.
        transfer_encoding = fields.get("transfer-encoding")
        if transfer_encoding is not None:
            self._until_eof = not _is_chunked(transfer_encoding)
        else:
            self._until_eof = "content-length" not in fields
        if not parser.should_keep_alive():
            self._keep_alive = False
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # ------------------------------------------------------------------ requests

    def _count_head(self, *parts: bytes) -> None:
        self._head_bytes += sum(len(part) for part in parts)
        if self._head_bytes > _MAX_HEADER_BYTES:
            raise _HeadersTooLarge(f"response head over {_MAX_HEADER_BYTES} bytes")

    def _fail(self, exc: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = exc
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def send(self, head: bytes, body: bytes) -> bool:
        """Write one request; ``True`` when the socket has not taken it all yet (then await
        ``drain``). The response is read with ``wait_headers`` and ``read``.

        A body up to ``_JOIN_BYTES`` goes out with its head in one write (one system call); a
        larger one is written as it is, not copied to be joined to its head (an image's
        megabytes; asyncio still buffers what the socket does not take at once)."""
        self._reset()
        self._keep_alive = True
        self._active = True
        transport = self.transport
        assert transport is not None
        if len(body) <= _JOIN_BYTES:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)
        if self._write_paused and not self.closed:
            return True
        self._check_sent()
        return False

    async def drain(self) -> None:
        """Wait until the socket has taken the request (its buffer is bounded)."""
        self._drain = self._loop.create_future()
        await self._drain
        self._check_sent()

    def _check_sent(self) -> None:
        if self.closed and self.error is None and not self.headers_done:
            self.error = _Closed("the server closed the connection while the request was sent")

    async def wait_headers(self) -> None:
        while not self.headers_done and self.error is None:
            if self.closed:
                self.error = self.error or _Closed("the server closed the connection")
                break
            await self._wait()
        if not self.headers_done and self.error is not None:
            raise self.error

    async def read(self) -> bytes:
        """The next body bytes as they arrive; ``b""`` at the end of the body."""
        body = self.body
        while not body:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()
        if len(body) == 1:
            data = body.popleft()
        else:
            data = b"".join(body)
            body.clear()
        self.buffered = 0
        if self._read_paused and self.transport is not None and not self.closed:
            self._read_paused = False
            self.transport.resume_reading()
        return data

    @property
    def reading_paused(self) -> bool:
        return self._read_paused

    @property
    def reusable(self) -> bool:
        # Paused reading would never resume on a pooled connection: its next answer would hang.
        return (
            self.complete
            and self._keep_alive
            and not self.closed
            and self.error is None
            and not self._read_paused
        )

    def finish(self) -> None:
        self._active = False


def _wire_error(exc: Exception, config: EngineConfig) -> TransientError:
    """A socket, TLS, parse or read failure, or a timeout (``TimeoutError``), as the transport's
    error class."""
    return wire_error(
        exc,
        timeout=isinstance(exc, TimeoutError),
        source_name=config.source_name,
        secret=config.secret,
    )


@frozen_dataclass(slots=True)
class _Target:
    """What one URL resolves to, worked out once per URL."""

    key: tuple[str, str, int]
    host: str
    port: int
    tls: bool
    head: bytes = field(repr=False)
    """The request line and every fixed header, up to ``Content-Length: ``: it holds the
    ``Authorization`` header (the key, or the URL's Basic credentials), so it is no part of the
    repr."""


class _Targets(dict[str, _Target]):
    """The per-URL cache; its repr names no URL (one may carry a user and password)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{len(self)} cached request targets>"


class _HttptoolsResponse:
    __slots__ = (
        "_body",
        "_config",
        "_connection",
        "_engine",
        "headers",
        "read",
        "read_chunk",
        "status",
    )

    def __init__(
        self, connection: _Connection, engine: HttptoolsEngine, config: EngineConfig
    ) -> None:
        self._connection: _Connection | None = connection
        self._engine = engine
        self._config = config
        self.status = connection.status
        self.headers: Mapping[str, str] = _Headers(connection.fields)
        body = self._body = BodyReader(
            self._raw_chunk, connection.fields.get("content-encoding"), config
        )
        self.read_chunk = body.read_chunk
        self.read = body.read

    async def _raw_chunk(self) -> bytes:
        connection = self._connection
        if connection is None:
            return b""
        try:
            timeout = self._config.read_timeout_s
            if timeout:
                async with asyncio.timeout(timeout):
                    return await connection.read()
            return await connection.read()
        except (OSError, httptools.HttpParserError) as exc:  # TimeoutError included
            error = _wire_error(exc, self._config)
        raise error

    @property
    def buffered_bytes(self) -> int:
        """Body bytes received and not yet taken by the reader."""
        return 0 if self._connection is None else self._connection.buffered

    @property
    def reading_paused(self) -> bool:
        """Whether the connection stopped reading because the reader is behind."""
        return self._connection is not None and self._connection.reading_paused

    def at_eof(self) -> bool:
        connection = self._connection
        complete = connection is None or (connection.complete and not connection.body)
        return complete and self._body.raw_ended()

    async def aclose(self) -> None:
        self._body.detach()
        connection, self._connection = self._connection, None
        if connection is not None:
            self._engine._release(connection)


class HttptoolsEngine:
    """A keep-alive connection pool per (scheme, host, port), per event loop."""

    name = "httptools"

    def __init__(self, config: EngineConfig) -> None:
        if config.trust_env:
            raise ConfigError(
                f"source {config.source_name!r}: engine 'httptools' does not use proxies "
                "(trust_env); use the aiohttp or httpx engine"
            )
        fixed: list[str] = []
        for name, value in config.headers.items():
            if any(c in name or c in value for c in _FORBIDDEN_IN_HEADERS) or ":" in name:
                raise ConfigError(
                    f"source {config.source_name!r}: header "
                    f"{sanitize_message(name, limit=40)!r} has a line break or NUL"
                )
            if name.lower() not in ("host", "content-length", "transfer-encoding", "connection"):
                fixed.append(f"{name}: {value}\r\n")
        self._config = config
        self._fixed_headers = "".join(fixed)
        self._has_authorization = any(k.lower() == "authorization" for k in config.headers)
        self._targets = _Targets()
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_buffer = memoryview(bytearray())  # one per event loop, made in ``_on_loop``
        self._permits: asyncio.Semaphore | None = None
        # Begun with the engine, when the client is built, in a thread (``tls_context``): made
        # at the first https connection on the event loop, the CA store's read would stall
        # every call in flight. One context serves every engine that reads the same store.
        self._tls: Future[ssl.SSLContext] | None = None
        self._tls_pid = 0
        self._ca_store = ""
        self._ssl: ssl.SSLContext | None = None
        if not config.plain_http:
            self._tls = self._begin_tls()

    @property
    def idle_connections(self) -> int:
        """Open keep-alive connections waiting in the pool."""
        return sum(
            1 for pool in self._idle.values() for connection in pool if not connection.closed
        )

    @property
    def busy_connections(self) -> int:
        """Connections carrying a request or a response not closed yet."""
        return len(self._busy)

    # ------------------------------------------------------------------ set-up

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is not None:
            return target
        config = self._config
        try:
            parts = urlsplit(url)
            port = parts.port
            host = parts.hostname
        except ValueError:
            host = None
        scheme = parts.scheme.lower() if host else ""
        if not host or scheme not in ("http", "https"):
            raise SourceDeadError(
                sanitize_message(
                    f"source {config.source_name!r}: invalid URL {url!r}", config.secret
                ),
                source_name=config.source_name,
            )
        tls = scheme == "https"
        port = port or (443 if tls else 80)
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        host_header = f"[{host}]" if ":" in host else host
        if port != (443 if tls else 80):
            host_header = f"{host_header}:{port}"
        extra = ""
        if parts.username is not None and not self._has_authorization:
            # Credentials in the URL: Basic auth, as aiohttp and httpx send them.
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            extra = f"Authorization: Basic {base64.b64encode(pair.encode()).decode()}\r\n"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\n{self._fixed_headers}{extra}"
            "Content-Length: "
        )
        target = _Target((scheme, host, port), host, port, tls, head.encode("utf-8"))
        targets = self._targets
        if len(targets) >= _MAX_TARGETS:
            targets.clear()
        targets[url] = target
        return target

    def _on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Connections belong to one event loop: a new loop starts an empty pool."""
        for connections in self._idle.values():
            for connection in connections:
                connection.closed = True  # their transports went with the old loop
        self._idle = {}
        self._busy = set()
        # An old loop's connections keep reading into their buffer; this loop's get their own.
        self._read_buffer = read_buffer()
        self._loop = loop
        limit = self._config.max_connections
        self._permits = asyncio.Semaphore(limit) if limit > 0 else None

    async def _ssl_context(self) -> ssl.SSLContext:
        """The TLS context, waiting (off the event loop) for the thread making it if it has
        not finished yet; a context that could not be made is a ``SourceDeadError``."""
        context = self._ssl
        if context is not None:
            return context
        made = self._tls
        # The pid first: a future begun before a fork is not touched in the child (its lock
        # may have been held by the parent's thread at the fork).
        if made is None or self._tls_pid != os.getpid():
            # None yet (an https URL on an engine for plain http), a retry, or begun before
            # this process was forked (the thread making it stayed in the parent).
            made = self._tls = self._begin_tls()
        try:
            context = made.result() if made.done() else await asyncio.wrap_future(made)
        except Exception as exc:  # noqa: BLE001 - whatever OpenSSL raised, the source's error
            self._tls = None  # the next connection asks for the store again
            error = self._tls_error(exc)
        else:
            self._ssl = context
            return context
        raise error  # outside the handler: no OpenSSL exception in the chain

    def _begin_tls(self) -> Future[ssl.SSLContext]:
        """The context of the CA store OpenSSL would read now, remembered by name for an
        error message."""
        paths = ssl.get_default_verify_paths()
        self._ca_store = " and ".join(p for p in (paths.cafile, paths.capath) if p) or "none"
        self._tls_pid = os.getpid()
        return tls_context_of(paths.cafile, paths.capath)

    def _tls_error(self, exc: Exception) -> SourceDeadError:
        config = self._config
        return SourceDeadError(
            sanitize_message(
                f"source {config.source_name!r}: no TLS context could be made from the CA "
                f"store ({self._ca_store}): {type(exc).__name__}: {exc}",
                config.secret,
            ),
            source_name=config.source_name,
        )

    # ------------------------------------------------------------------ pool

    def _pooled(self, key: tuple[str, str, int], now: float) -> _Connection | None:
        idle = self._idle.get(key)
        keepalive = self._config.keepalive_s
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < keepalive:
                return connection
            connection.abort()
        return None

    async def _connect(self, target: _Target, loop: asyncio.AbstractEventLoop) -> _Connection:
        buffer = self._read_buffer
        _, connection = await loop.create_connection(
            lambda: _Connection(loop, buffer),
            target.host,
            target.port,
            ssl=await self._ssl_context() if target.tls else None,
            server_hostname=target.host if target.tls else None,
        )
        return connection

    async def _acquire(self, target: _Target, loop: asyncio.AbstractEventLoop) -> _Connection:
        """A connection for ``target``: waiting for a permit and connecting end together by
        ``connect_timeout_s`` after the call began (a pooled one with a free permit: at once,
        with no timer)."""
        permits = self._permits
        deadline: float | None = None
        if permits is not None and permits.locked():
            deadline = loop.time() + self._config.connect_timeout_s
            async with asyncio.timeout_at(deadline):
                await permits.acquire()
        elif permits is not None:
            await permits.acquire()  # free: returns without suspending
        try:
            connection = self._pooled(target.key, time.monotonic())
            if connection is None:
                if deadline is None:
                    deadline = loop.time() + self._config.connect_timeout_s
                async with asyncio.timeout_at(deadline):
                    connection = await self._connect(target, loop)
        except BaseException:
            if permits is not None:
                permits.release()
            raise
        self._busy.add(connection)
        return connection

    def _release(self, connection: _Connection) -> None:
        if connection not in self._busy:
            return  # from a pool of an earlier loop, already discarded
        self._busy.discard(connection)
        connection.finish()
        if connection.reusable and self._config.keepalive_s:  # keepalive_s 0: none kept
            connection.idle_since = time.monotonic()
            self._idle.setdefault(connection.pool_key, []).append(connection)
        else:
            connection.abort()  # mid-body or broken: never reused
        if self._permits is not None:
            self._permits.release()

    # ------------------------------------------------------------------ the port

    async def post(self, url: str, body: bytes) -> EngineResponse:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._on_loop(loop)
        target = self._target(url)
        config = self._config
        head = b"%b%d\r\n\r\n" % (target.head, len(body))
        connection: _Connection | None = None
        try:
            connection = await self._acquire(target, loop)
            connection.pool_key = target.key
            timeout = config.read_timeout_s
            if connection.send(head, body):
                # A large body the socket takes slowly: bounded like the httpx engine's
                # write timeout.
                if timeout:
                    async with asyncio.timeout(timeout):
                        await connection.drain()
                else:
                    await connection.drain()
            if timeout:
                async with asyncio.timeout(timeout):
                    await connection.wait_headers()
            else:
                await connection.wait_headers()
        except (OSError, httptools.HttpParserError) as exc:  # TimeoutError included
            error = _wire_error(exc, config)
        except BaseException:
            if connection is not None:
                connection.abort()
                self._release(connection)
            raise
        else:
            return _HttptoolsResponse(connection, self, config)
        if connection is not None:
            connection.abort()
            self._release(connection)
        raise error  # outside the handler: no engine exception in the chain

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.abort()
        for connection in list(self._busy):
            connection.abort()


__all__ = ["HttptoolsEngine"]
