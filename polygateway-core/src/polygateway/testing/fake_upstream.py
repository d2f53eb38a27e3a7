"""A real HTTP/1.1 server on loopback that speaks the OpenAI-compatible protocol byte for byte.

Tests (and benchmarks) point a client at it and script what each logical source answers:
normal completions, any error status, delays that trip each watchdog layer, streams cut before
``[DONE]``, malformed frames, resets and black holes. It counts what really reached the wire.

It is written directly on ``asyncio.Protocol`` with a minimal HTTP/1.1 parser so that it is never
the bottleneck of a benchmark and so that faults are exact at the byte level. A response is
planned as a list of steps (bytes to write, delays, terminal actions); a plan made of bytes only
is written synchronously from ``data_received`` without creating a task.

    async with FakeUpstream() as fake:
        fake.script("a", Reply.error(429, retry_after=2), Reply.ok(content="hi"))
        url = fake.base_url("a")          # http://127.0.0.1:PORT/a/v1

    with FakeUpstream.in_thread() as fake:  # own loop in a daemon thread
        ...
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http
import json
import logging
import math
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from polygateway.clock import SystemClock
from polygateway.ports import Clock

__all__ = ["DEFAULT_CONTENT", "FakeUpstream", "ReceivedRequest", "Reply", "estimate_tokens"]

logger = logging.getLogger(__name__)

DEFAULT_CONTENT: Final = "Hello from the fake upstream."
DEFAULT_SOURCE: Final = "default"
DEFAULT_MODEL: Final = "fake-model"
DEFAULT_EMBEDDING_DIM: Final = 8

_ROUTES: Final[frozenset[str]] = frozenset(("chat", "embeddings", "models", "other"))
_SCRIPTABLE_ROUTES: Final[frozenset[str]] = frozenset(("chat", "embeddings", "models"))
_ROUTE_BY_PATH: Final[dict[tuple[str, str], str]] = {
    ("POST", "/chat/completions"): "chat",
    ("POST", "/embeddings"): "embeddings",
    ("GET", "/models"): "models",
}

ReplyKind = Literal[
    "ok",
    "empty",
    "error",
    "cut",
    "early_eof",
    "malformed",
    "mid_stream_error",
    "reset",
    "black_hole",
]

_MAX_HEAD_BYTES: Final = 64 * 1024
_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
_MAX_DEFAULT_CHUNKS: Final = 20
_CHARS_PER_DEFAULT_CHUNK: Final = 4
_EVENT_TAIL_CACHE_LIMIT: Final = 256

_ERROR_DEFAULTS: Final[dict[int, tuple[str, str | None, str]]] = {
    400: ("invalid_request_error", None, "Invalid request (scripted by the fake upstream)."),
    401: (
        "invalid_request_error",
        "invalid_api_key",
        "Incorrect API key provided: sk-fa***ke. You can find your API key in your account.",
    ),
    403: (
        "request_forbidden",
        "unsupported_country_region_territory",
        "Country, region, or territory not supported",
    ),
    404: (
        "invalid_request_error",
        "model_not_found",
        "The model `{model}` does not exist or you do not have access to it.",
    ),
    429: (
        "requests",
        "rate_limit_exceeded",
        "Rate limit reached for {model} on requests per min (RPM): Limit 3, Used 3, "
        "Requested 1. Please try again in 1s.",
    ),
    500: ("server_error", None, "The server had an error processing your request."),
    502: ("server_error", None, "Bad gateway."),
    503: ("server_error", None, "That model is currently overloaded with other requests."),
    504: ("server_error", None, "Gateway timeout."),
}
_QUOTA_MESSAGE: Final = (
    "You exceeded your current quota, please check your plan and billing details."
)
_MID_STREAM_ERROR: Final = {
    "message": "Upstream provider disconnected",
    "type": "server_error",
    "param": None,
    "code": "server_error",
}


def estimate_tokens(text: str) -> int:
    """The fake's deterministic token estimate: ``len(text) // 4``, at least 1."""
    return max(1, len(text) // 4)


def _check_delay(name: str, value: float) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"Reply.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Reply:
    """What the fake upstream answers to one request. Build it with the class methods."""

    kind: ReplyKind
    content: str | Callable[[Any], str] = DEFAULT_CONTENT
    chunks: int | None = None
    reasoning: str | None = None
    think_inline: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = "stop"
    include_usage: bool | None = None
    headers_delay: float = 0.0
    first_token_delay: float = 0.0
    inter_token_delay: float = 0.0
    model: str | None = None
    status: int = 200
    error_code: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    retry_after: float | str | None = None
    quota: bool = False
    body: str | bytes | None = None
    after_chunks: int = 0
    after_headers: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.content, str) or callable(self.content)):
            raise TypeError(
                f"Reply content must be a str or a callable, got {type(self.content).__name__}"
            )
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"Reply.chunks must be >= 1 or None, got {self.chunks!r}")
        for name in ("headers_delay", "first_token_delay", "inter_token_delay"):
            value = getattr(self, name)
            _check_delay(name, value)
            # Plans tell delays from bytes by type: store ints as floats.
            object.__setattr__(self, name, float(value))
        if self.kind == "error" and not 400 <= self.status <= 599:
            raise ValueError(f"Reply.error status must be in 400..599, got {self.status!r}")
        if self.after_chunks < 0:
            raise ValueError(f"Reply after_chunks must be >= 0, got {self.after_chunks!r}")
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Reply.{name} must be >= 0 or None, got {value!r}")

    @classmethod
    def ok(
        cls,
        content: str | Callable[[Any], str] = DEFAULT_CONTENT,
        *,
        chunks: int | None = None,
        reasoning: str | None = None,
        think_inline: bool = False,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        finish_reason: str = "stop",
        include_usage: bool | None = None,
        headers_delay: float = 0.0,
        first_token_delay: float = 0.0,
        inter_token_delay: float = 0.0,
        model: str | None = None,
    ) -> Reply:
        """A normal completion (JSON or SSE, as the request asks).

        ``content`` may be a callable receiving the request JSON. Streaming splits content into
        ``chunks`` pieces (default: one per 4 characters, at most 20); ``reasoning`` streams first
        as ``reasoning_content`` deltas, or inline as ``<think>...</think>`` when
        ``think_inline``. ``include_usage=None`` follows the request's
        ``stream_options.include_usage``; True/False forces it (False also drops ``usage`` from
        a JSON answer). A JSON answer waits ``headers_delay + first_token_delay +
        inter_token_delay * (chunks - 1)`` before its status line (the generation time).
        """
        return cls(
            kind="ok",
            content=content,
            chunks=chunks,
            reasoning=reasoning,
            think_inline=think_inline,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            include_usage=include_usage,
            headers_delay=headers_delay,
            first_token_delay=first_token_delay,
            inter_token_delay=inter_token_delay,
            model=model,
        )

    @classmethod
    def error(
        cls,
        status: int,
        *,
        code: str | None = None,
        type: str | None = None,
        message: str | None = None,
        retry_after: float | str | None = None,
        quota: bool = False,
        body: str | bytes | None = None,
        headers_delay: float = 0.0,
    ) -> Reply:
        """An HTTP error with an OpenAI-style body ``{"error":{message,type,param,code}}``.

        Defaults per status follow the real API (429: ``requests``/``rate_limit_exceeded``;
        ``quota=True``: ``insufficient_quota`` for both). ``retry_after`` adds a
        ``Retry-After`` header (seconds; a string is sent verbatim). ``body`` replaces the body.
        """
        return cls(
            kind="error",
            status=status,
            error_code=code,
            error_type=type,
            error_message=message,
            retry_after=retry_after,
            quota=quota,
            body=body,
            headers_delay=headers_delay,
        )

    @classmethod
    def cut(cls, after_chunks: int = 3) -> Reply:
        """Stream ``after_chunks`` content chunks, then end the body cleanly without the finish
        chunk, the usage chunk and ``[DONE]``. A JSON answer is truncated mid-body instead (the
        connection closes before ``Content-Length`` bytes were sent)."""
        return cls(kind="cut", after_chunks=after_chunks)

    @classmethod
    def early_eof(cls) -> Reply:
        """200 headers, then the body ends with zero events (JSON: an empty body)."""
        return cls(kind="early_eof")

    @classmethod
    def malformed(cls, after_chunks: int = 1) -> Reply:
        """After ``after_chunks`` content chunks, a ``data:`` frame that is not valid JSON; the
        rest of the stream follows normally. A JSON answer is a 200 with an invalid JSON body."""
        return cls(kind="malformed", after_chunks=after_chunks)

    @classmethod
    def empty(cls) -> Reply:
        """A complete, well-formed answer whose content is empty (finish, usage, ``[DONE]``)."""
        return cls(kind="empty", content="")

    @classmethod
    def mid_stream_error(cls, after_chunks: int = 1) -> Reply:
        """After ``after_chunks`` content chunks, ``data: {"error":{...}}`` and the end of the
        body (no ``[DONE]``). A JSON answer is a 200 whose body is the error object."""
        return cls(kind="mid_stream_error", after_chunks=after_chunks)

    @classmethod
    def reset(cls, after_headers: bool = False) -> Reply:
        """Reset the TCP connection (RST) before, or right after, the response headers."""
        return cls(kind="reset", after_headers=after_headers)

    @classmethod
    def black_hole(cls) -> Reply:
        """Read the request and never answer (until the client leaves or the server stops)."""
        return cls(kind="black_hole")


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One request as it reached the server."""

    source: str
    route: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    raw_body: bytes = field(repr=False)


class _Action:
    """A terminal step of a response plan."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_RESET: Final = _Action("reset")
_BLACK_HOLE: Final = _Action("black_hole")
_CLOSE: Final = _Action("close")

_Step = bytes | float | _Action


@dataclass(slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class _BadRequest(Exception):
    """The bytes on the wire are not an HTTP/1.1 request this server understands."""


def _status_line(status: int) -> str:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n"


_JSON_200_HEAD: Final = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
_SSE_200_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
)
_CONNECTION_CLOSE: Final = b"Connection: close\r\n"
_CHUNKED_END: Final = b"0\r\n\r\n"
_DONE_FRAME: Final = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # then the end of the body


def _json_head(length: int, close: bool, status: int = 200, extra: str = "") -> bytes:
    if status == 200 and not extra:
        head = f"{_JSON_200_HEAD}{length}\r\n"
    else:
        head = (
            f"{_status_line(status)}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}"
        )
    return head.encode("latin-1") + (_CONNECTION_CLOSE + b"\r\n" if close else b"\r\n")


def _sse_head(close: bool) -> bytes:
    return _SSE_200_HEAD + (_CONNECTION_CLOSE + b"\r\n" if close else b"\r\n")


def _frame(event: bytes) -> bytes:
    """One SSE event as one HTTP chunk."""
    return b"%x\r\n%b\r\n" % (len(event), event)


def _event_tail(delta: str, finish_reason: str, include_usage: bool) -> bytes:
    """A chunk event after ``..."delta":``: the delta, the finish reason and the usage key
    (present as ``null`` only when the request asked for the usage chunk)."""
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    return f'{delta},"logprobs":null,"finish_reason":{finish_reason}}}]{tail}'.encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _split(text: str, pieces: int | None) -> list[str]:
    if not text:
        return []
    if pieces is None:
        pieces = min(_MAX_DEFAULT_CHUNKS, -(-len(text) // _CHARS_PER_DEFAULT_CHUNK))
    pieces = min(pieces, len(text))
    size = len(text)
    return [text[i * size // pieces : (i + 1) * size // pieces] for i in range(pieces)]


def _message_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return "".join(parts)


def _embedding(text: str, dim: int) -> list[float]:
    """A deterministic unit vector derived from ``text``, exactly representable in float32."""
    seed = text.encode("utf-8")
    raw = bytearray()
    block = 0
    while len(raw) < dim * 4:
        raw += hashlib.blake2b(seed, digest_size=64, salt=block.to_bytes(8, "little")).digest()
        block += 1
    values = [(word / 0xFFFFFFFF) * 2.0 - 1.0 for word in struct.unpack(f"<{dim}I", raw[: dim * 4])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return list(struct.unpack(f"<{dim}f", struct.pack(f"<{dim}f", *(v / norm for v in values))))


@dataclass(slots=True)
class _Waiter:
    ready: Callable[[], bool]
    notify: Callable[[], object]


class FakeUpstream:
    """An OpenAI-compatible HTTP server on loopback with scripted behaviour per source.

    Several logical sources share the server, each under its own path prefix
    (``/<source>/v1/...``; plain ``/v1/...`` is the source ``"default"``). Each source has a FIFO
    script of :class:`Reply` per route, consumed one per request, then a default reply.
    Counters are thread-safe, so a server run :meth:`in_thread` can be inspected from any thread.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_reply: Reply | None = None,
        embedding_dim: int = DEFAULT_EMBEDDING_DIM,
        models: Sequence[str] = (DEFAULT_MODEL,),
        keep_received: bool = True,
        clock: Clock | None = None,
    ) -> None:
        """
        :param port: 0 picks a free port (see :attr:`port`).
        :param default_reply: answer of every source without a script or default of its own
            (``Reply.ok()`` when None); restored by :meth:`reset`.
        :param embedding_dim: vector size of ``/v1/embeddings`` unless the request asks
            ``dimensions`` (the attribute of the same name can be changed; reset restores it).
        :param models: ids listed by ``/v1/models`` (attribute ``models``).
        :param keep_received: record every request for :meth:`received` (turn off for long
            benchmark runs, where it would grow without bound).
        :param clock: source of delays and ``created`` timestamps.
        """
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim!r}")
        self.host = host
        self._requested_port = port
        self._initial_default = default_reply if default_reply is not None else Reply.ok()
        self._initial_embedding_dim = embedding_dim
        self._initial_models = tuple(models)
        self.embedding_dim = embedding_dim
        self.models: list[str] = list(models)
        self._keep_received = keep_received
        self._clock: Clock = clock if clock is not None else SystemClock()

        self._lock = threading.Lock()
        self._scripts: dict[tuple[str, str], deque[Reply]] = {}
        self._defaults: dict[tuple[str, str], Reply] = {}
        self._requests: dict[tuple[str | None, str], int] = {}
        self._inflight: dict[tuple[str | None, str], int] = {}
        self._max_inflight: dict[tuple[str | None, str], int] = {}
        self._received: list[ReceivedRequest] = []
        self._waiters: list[_Waiter] = []
        self._generation = 0
        self._next_id = 0

        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._connections: set[_Connection] = set()
        self._port: int | None = None
        self._event_tail_cache: dict[tuple[str, int | None, str | None, bool], list[bytes]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the server must be started)."""
        if self._port is None:
            raise RuntimeError("FakeUpstream is not started")
        return self._port

    def base_url(self, source: str | None = None) -> str:
        """``http://HOST:PORT/<source>/v1``, or ``http://HOST:PORT/v1`` for the default source."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if source is None:
            return f"http://{host}:{self.port}/v1"
        _check_source(source)
        return f"http://{host}:{self.port}/{source}/v1"

    async def start(self) -> None:
        """Bind and start listening on the running loop."""
        if self._server is not None:
            raise RuntimeError("FakeUpstream is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.host, self._requested_port, backlog=1024
        )
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and close every connection, black-holed or delayed ones included."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = [c.task for c in self._connections if c.task is not None]
        for connection in list(self._connections):
            connection.abort()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
        self._port = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @classmethod
    @contextmanager
    def in_thread(cls, **kwargs: Any) -> Iterator[FakeUpstream]:
        """Run a server on its own event loop in a daemon thread (for sync code and benchmarks).

        Returns once it listens; leaving the block stops it and joins the thread.
        """
        fake = cls(**kwargs)
        loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_forever()
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        thread = threading.Thread(target=serve, name="pgw-fake-upstream", daemon=True)
        thread.start()
        try:
            # .result() returns once the server listens, or raises why it could not.
            asyncio.run_coroutine_threadsafe(fake.start(), loop).result()
            try:
                yield fake
            finally:
                asyncio.run_coroutine_threadsafe(fake.stop(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()

    # -- scripting -------------------------------------------------------------------------

    def script(self, source: str, *replies: Reply, route: str = "chat") -> None:
        """Append replies to the FIFO script of ``source`` (consumed one per request)."""
        _check_source(source)
        _check_route(route, scriptable=True)
        for reply in replies:
            if not isinstance(reply, Reply):
                raise TypeError(f"script() takes Reply objects, got {type(reply).__name__}")
        with self._lock:
            self._scripts.setdefault((source, route), deque()).extend(replies)

    def set_default(self, source: str, reply: Reply, *, route: str = "chat") -> None:
        """The reply of ``source`` once its script is used up."""
        _check_source(source)
        _check_route(route, scriptable=True)
        if not isinstance(reply, Reply):
            raise TypeError(f"set_default() takes a Reply, got {type(reply).__name__}")
        with self._lock:
            self._defaults[(source, route)] = reply

    def reset(self) -> None:
        """Clear scripts, defaults, counters and recorded requests; close connections that are
        still answering (black holes, delayed replies) so nothing leaks into the next test."""
        with self._lock:
            self._scripts.clear()
            self._defaults.clear()
            self._requests.clear()
            self._inflight.clear()
            self._max_inflight.clear()
            self._received.clear()
            self._generation += 1
        self.embedding_dim = self._initial_embedding_dim
        self.models = list(self._initial_models)
        loop = self._loop
        if loop is None or self._server is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._abort_busy_connections()
        elif loop.is_running():
            done = threading.Event()

            def abort_then_signal() -> None:
                try:
                    self._abort_busy_connections()
                finally:
                    done.set()

            loop.call_soon_threadsafe(abort_then_signal)
            done.wait(5.0)

    def _abort_busy_connections(self) -> None:
        for connection in list(self._connections):
            if connection.busy:
                connection.abort()

    # -- counters --------------------------------------------------------------------------

    def requests(self, source: str | None = None, route: str = "chat") -> int:
        """How many requests reached ``source`` on ``route`` (None: all sources)."""
        _check_route(route)
        with self._lock:
            return self._requests.get((source, route), 0)

    def inflight(self, source: str | None = None, route: str = "chat") -> int:
        """Requests being answered right now."""
        _check_route(route)
        with self._lock:
            return self._inflight.get((source, route), 0)

    def max_inflight(self, source: str | None = None, route: str = "chat") -> int:
        """High-water mark of concurrent requests since the last reset."""
        _check_route(route)
        with self._lock:
            return self._max_inflight.get((source, route), 0)

    def received(self, source: str | None = None, route: str = "chat") -> list[ReceivedRequest]:
        """The requests received, in arrival order (empty when ``keep_received=False``)."""
        _check_route(route)
        with self._lock:
            return [
                r
                for r in self._received
                if r.route == route and (source is None or r.source == source)
            ]

    async def wait_for_requests(
        self,
        n: int,
        source: str | None = None,
        route: str = "chat",
        timeout: float = 5.0,  # noqa: ASYNC109 (a test helper: bounding the wait is its purpose)
    ) -> None:
        """Wait until ``requests(source, route) >= n``; ``TimeoutError`` after ``timeout``."""
        _check_route(route)
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not arrived.done():
                arrived.set_result(None)

        waiter = _Waiter(
            ready=lambda: self._requests.get((source, route), 0) >= n,
            notify=lambda: loop.call_soon_threadsafe(resolve),
        )
        with self._lock:
            if waiter.ready():
                return
            self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await arrived
        except TimeoutError:
            raise TimeoutError(
                f"waited {timeout}s for {n} {route} requests to source {source!r}, "
                f"saw {self.requests(source, route)}"
            ) from None
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def wait_for_requests_sync(
        self, n: int, source: str | None = None, route: str = "chat", timeout: float = 5.0
    ) -> None:
        """Blocking :meth:`wait_for_requests` for sync code (not on the server's own loop)."""
        _check_route(route)
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("wait_for_requests_sync would block the server's own loop")
        arrived = threading.Event()
        waiter = _Waiter(
            ready=lambda: self._requests.get((source, route), 0) >= n, notify=arrived.set
        )
        with self._lock:
            if waiter.ready():
                return
            self._waiters.append(waiter)
        try:
            if not arrived.wait(timeout):
                raise TimeoutError(
                    f"waited {timeout}s for {n} {route} requests to source {source!r}, "
                    f"saw {self.requests(source, route)}"
                )
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    # -- request handling (server loop) ----------------------------------------------------

    def _begin(
        self, source: str, route: str, received: ReceivedRequest | None, consume: bool
    ) -> tuple[int, Reply | None]:
        """Count the request and take its reply from the script (one critical section)."""
        with self._lock:
            for key in ((source, route), (None, route)):
                self._requests[key] = self._requests.get(key, 0) + 1
                now = self._inflight.get(key, 0) + 1
                self._inflight[key] = now
                if now > self._max_inflight.get(key, 0):
                    self._max_inflight[key] = now
            if received is not None:
                self._received.append(received)
            for waiter in self._waiters:
                if waiter.ready():
                    waiter.notify()
            reply: Reply | None = None
            if consume:
                script = self._scripts.get((source, route))
                if script:
                    reply = script.popleft()
                else:
                    reply = self._defaults.get((source, route))
                    if reply is None:
                        reply = self._initial_default if route == "chat" else Reply.ok()
            self._next_id += 1
            return self._generation, reply

    def _end(self, source: str, route: str, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return  # counted before a reset
            for key in ((source, route), (None, route)):
                self._inflight[key] -= 1

    def _handle(self, request: _Request) -> tuple[list[_Step], Callable[[], None]]:
        """Plan the response to one request; returns the plan and its completion callback."""
        path = request.path.split("?", 1)[0]
        source, rest = _split_source(path)
        route = _ROUTE_BY_PATH.get((request.method, rest.rstrip("/")), "other")
        body: Any = None
        parse_failed = False
        if request.body:
            try:
                body = json.loads(request.body)
            except ValueError:
                parse_failed = True
        received = (
            ReceivedRequest(
                source=source,
                route=route,
                method=request.method,
                path=request.path,
                headers=request.headers,
                body=body,
                raw_body=request.body,
            )
            if self._keep_received
            else None
        )
        malformed = route != "models" and (parse_failed or not isinstance(body, dict))
        consume = route != "other" and not malformed
        generation, reply = self._begin(source, route, received, consume)
        close = not request.keep_alive

        def done() -> None:
            self._end(source, route, generation)

        if route == "other":
            message = f"Invalid URL ({request.method} {path})"
            return self._error_plan(404, "invalid_request_error", None, message, close), done
        if malformed:
            message = (
                "We could not parse the JSON body of your request. The body must be a JSON object."
            )
            return self._error_plan(400, "invalid_request_error", None, message, close), done
        assert reply is not None
        request_json: dict[str, Any] = body if isinstance(body, dict) else {}
        model = reply.model or str(request_json.get("model") or DEFAULT_MODEL)
        try:
            plan = self._plan(reply, route, request_json, model, close)
        except Exception as exc:  # a test's content callable failed: answer 500 and log it
            logger.exception("fake upstream could not build its reply")
            message = f"fake upstream reply failed: {type(exc).__name__}: {exc}"
            plan = self._error_plan(500, "server_error", None, message, close)
        return plan, done

    def _plan(
        self, reply: Reply, route: str, request_json: dict[str, Any], model: str, close: bool
    ) -> list[_Step]:
        kind = reply.kind
        if kind == "reset":
            if not reply.after_headers:
                return [_RESET]
            if route == "chat" and request_json.get("stream"):
                return [_sse_head(close), _RESET]
            return [_json_head(1024, close), _RESET]
        if kind == "black_hole":
            return [_BLACK_HOLE]
        if kind == "error":
            return self._scripted_error_plan(reply, model, close)
        if route == "chat":
            if request_json.get("stream"):
                return self._chat_stream_plan(reply, request_json, model, close)
            return self._chat_json_plan(reply, request_json, model, close)
        if route == "embeddings":
            answer = self._embeddings_answer(reply, request_json, model, close)
            if isinstance(answer, list):
                return answer
            return self._json_plan(reply, answer, _dumps(answer).encode(), close)
        answer = {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake-upstream"}
                for m in self.models
            ],
        }
        return self._json_plan(reply, answer, _dumps(answer).encode(), close)

    # -- plans -----------------------------------------------------------------------------

    def _error_plan(
        self,
        status: int,
        type_: str,
        code: str | None,
        message: str,
        close: bool,
        extra_headers: str = "",
    ) -> list[_Step]:
        payload = {"error": {"message": message, "type": type_, "param": None, "code": code}}
        data = _dumps(payload).encode()
        return [_json_head(len(data), close, status, extra_headers) + data]

    def _scripted_error_plan(self, reply: Reply, model: str, close: bool) -> list[_Step]:
        status = reply.status
        default_type, default_code, default_message = _ERROR_DEFAULTS.get(
            status, ("server_error" if status >= 500 else "invalid_request_error", None, "Error.")
        )
        if reply.quota:
            default_type = default_code = "insufficient_quota"
            default_message = _QUOTA_MESSAGE
        extra = ""
        if reply.retry_after is not None:
            value = reply.retry_after
            text = value if isinstance(value, str) else f"{value:g}"
            extra = f"Retry-After: {text}\r\n"
        if reply.body is not None:
            data = reply.body.encode() if isinstance(reply.body, str) else reply.body
            steps: list[_Step] = [_json_head(len(data), close, status, extra) + data]
        else:
            steps = self._error_plan(
                status,
                reply.error_type or default_type,
                reply.error_code or default_code,
                reply.error_message or default_message.format(model=model),
                close,
                extra,
            )
        if reply.headers_delay:
            steps.insert(0, reply.headers_delay)
        return steps

    def _json_plan(
        self, reply: Reply, answer: dict[str, Any], data: bytes, close: bool, pieces: int = 1
    ) -> list[_Step]:
        """A 200 JSON answer with the non-stream shape of each fault."""
        kind = reply.kind
        steps: list[_Step] = []
        wait = reply.headers_delay + reply.first_token_delay
        wait += reply.inter_token_delay * max(0, pieces - 1)
        if wait:
            steps.append(wait)
        if kind == "cut":
            # Content-Length promises the whole body; the connection closes halfway.
            steps += [_json_head(len(data), close) + data[: len(data) // 2], _CLOSE]
        elif kind == "early_eof":
            steps.append(_json_head(0, close))
        elif kind == "malformed":
            broken = data[: max(1, len(data) // 2)]
            steps.append(_json_head(len(broken), close) + broken)
        elif kind == "mid_stream_error":
            error = _dumps({"error": _MID_STREAM_ERROR}).encode()
            steps.append(_json_head(len(error), close) + error)
        else:
            steps.append(_json_head(len(data), close) + data)
        return steps

    def _completion_parts(
        self, reply: Reply, request_json: dict[str, Any]
    ) -> tuple[str, str | None]:
        content = reply.content
        text = content(request_json) if callable(content) else content
        if not isinstance(text, str):
            raise TypeError(f"Reply content callable must return str, got {type(text).__name__}")
        if reply.reasoning is not None and reply.think_inline:
            return f"<think>{reply.reasoning}</think>{text}", None
        return text, reply.reasoning

    def _usage(
        self,
        reply: Reply,
        request_json: dict[str, Any],
        content: str,
        reasoning: str | None,
    ) -> dict[str, Any]:
        prompt = reply.prompt_tokens
        if prompt is None:
            prompt = estimate_tokens(_message_text(request_json.get("messages")))
        reasoning_tokens = estimate_tokens(reasoning) if reasoning else 0
        completion = reply.completion_tokens
        if completion is None:
            completion = estimate_tokens(content) + reasoning_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def _new_id(self) -> str:
        return f"chatcmpl-fake{self._next_id}"

    def _chat_json_plan(
        self, reply: Reply, request_json: dict[str, Any], model: str, close: bool
    ) -> list[_Step]:
        content, reasoning = self._completion_parts(reply, request_json)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        answer: dict[str, Any] = {
            "id": self._new_id(),
            "object": "chat.completion",
            "created": int(self._clock.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": reply.finish_reason,
                }
            ],
        }
        if reply.include_usage is not False:
            answer["usage"] = self._usage(reply, request_json, content, reasoning)
        pieces = len(_split(content, reply.chunks)) + len(_split(reasoning or "", None))
        return self._json_plan(reply, answer, _dumps(answer).encode(), close, pieces)

    def _token_event_tails(
        self, content: str, reply: Reply, reasoning: str | None, include_usage: bool
    ) -> list[bytes]:
        """Each token chunk's bytes after the per-request prefix (reasoning first), cached:
        only ``id``, ``created`` and ``model`` vary between requests."""
        key = (content, reply.chunks, reasoning, include_usage)
        cached = self._event_tail_cache.get(key)
        if cached is not None:
            return cached
        if reasoning is None:
            deltas = [_dumps({"content": piece}) for piece in _split(content, reply.chunks)]
        else:
            deltas = [
                _dumps({"content": None, "reasoning_content": piece})
                for piece in _split(reasoning, None)
            ]
            deltas += [
                _dumps({"content": piece, "reasoning_content": None})
                for piece in _split(content, reply.chunks)
            ]
        tails = [_event_tail(delta, "null", include_usage) for delta in deltas]
        if len(self._event_tail_cache) >= _EVENT_TAIL_CACHE_LIMIT:
            self._event_tail_cache.clear()
        self._event_tail_cache[key] = tails
        return tails

    def _chat_stream_plan(
        self, reply: Reply, request_json: dict[str, Any], model: str, close: bool
    ) -> list[_Step]:
        content, reasoning = self._completion_parts(reply, request_json)
        include_usage = reply.include_usage
        if include_usage is None:
            options = request_json.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        base = (
            f'{{"id":"{self._new_id()}","object":"chat.completion.chunk",'
            f'"created":{int(self._clock.time())},"model":{_dumps(model)},'
        )
        prefix = f'data: {base}"choices":[{{"index":0,"delta":'.encode()
        prefix_length = len(prefix)

        def event(tail: bytes) -> bytes:
            return b"%x\r\n%b%b\r\n" % (prefix_length + len(tail), prefix, tail)

        role = (
            '{"role":"assistant","content":""}'
            if reasoning is None
            else '{"role":"assistant","content":null,"reasoning_content":""}'
        )
        kind = reply.kind
        steps: list[_Step] = []
        if reply.headers_delay:
            steps.append(reply.headers_delay)
        if kind == "early_eof":
            steps.append(_sse_head(close) + _CHUNKED_END)
            return steps
        pending = bytearray(_sse_head(close))
        pending += event(_event_tail(role, "null", include_usage))
        tails = self._token_event_tails(content, reply, reasoning, include_usage)
        faulty = kind in ("cut", "malformed", "mid_stream_error")
        sent = tails[: reply.after_chunks] if faulty else tails
        if reply.first_token_delay or reply.inter_token_delay:
            for index, tail in enumerate(sent):
                delay = reply.first_token_delay if index == 0 else reply.inter_token_delay
                if delay:
                    steps += [bytes(pending), delay]
                    pending.clear()
                pending += event(tail)
        else:
            pending += b"".join([event(tail) for tail in sent])
        if kind == "cut":
            pending += _CHUNKED_END
            steps.append(bytes(pending))
            return steps
        if kind == "mid_stream_error":
            pending += _frame(b"data: " + _dumps({"error": _MID_STREAM_ERROR}).encode() + b"\n\n")
            pending += _CHUNKED_END
            steps.append(bytes(pending))
            return steps
        if kind == "malformed":
            pending += event(b'{"content":"unterminated\n\n')
            for tail in tails[reply.after_chunks :]:
                pending += event(tail)
        pending += event(_event_tail("{}", _dumps(reply.finish_reason), include_usage))
        if include_usage:
            usage = _dumps(self._usage(reply, request_json, content, reasoning))
            pending += _frame(f'data: {base}"choices":[],"usage":{usage}}}\n\n'.encode())
        pending += _DONE_FRAME
        steps.append(bytes(pending))
        return steps

    def _embeddings_answer(
        self, reply: Reply, request_json: dict[str, Any], model: str, close: bool
    ) -> dict[str, Any] | list[_Step]:
        """The embeddings answer, or an error plan for input the real API rejects."""
        raw_input = request_json.get("input")
        items: list[Any]
        if isinstance(raw_input, str):
            items = [raw_input]
        elif isinstance(raw_input, list) and raw_input and isinstance(raw_input[0], int):
            items = [raw_input]  # one token array
        elif isinstance(raw_input, list):
            items = raw_input
        else:
            items = []
        if not items or any(not item or not isinstance(item, str | list) for item in items):
            return self._error_plan(
                400,
                "invalid_request_error",
                None,
                "'$.input' is invalid: it must be a non-empty string or array.",
                close,
            )
        dimensions = request_json.get("dimensions")
        dim = dimensions if isinstance(dimensions, int) and dimensions > 0 else self.embedding_dim
        as_base64 = request_json.get("encoding_format") == "base64"
        data: list[dict[str, Any]] = []
        prompt_tokens = 0
        if reply.kind != "empty":
            for index, item in enumerate(items):
                if isinstance(item, str):
                    text = item
                    prompt_tokens += estimate_tokens(item)
                else:
                    text = _dumps(item)
                    prompt_tokens += len(item)
                vector = _embedding(text, dim)
                encoded: list[float] | str = (
                    base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode("ascii")
                    if as_base64
                    else vector
                )
                data.append({"object": "embedding", "index": index, "embedding": encoded})
        if reply.prompt_tokens is not None:
            prompt_tokens = reply.prompt_tokens
        return {
            "object": "list",
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }


def _check_source(source: str) -> None:
    if not isinstance(source, str) or not source or "/" in source or source == "v1":
        raise ValueError(
            f"source name must be a non-empty path segment other than 'v1': {source!r}"
        )


def _check_route(route: str, *, scriptable: bool = False) -> None:
    allowed = _SCRIPTABLE_ROUTES if scriptable else _ROUTES
    if route not in allowed:
        raise ValueError(f"route must be one of {sorted(allowed)}, got {route!r}")


def _split_source(path: str) -> tuple[str, str]:
    """``/a/v1/chat/completions`` -> ("a", "/chat/completions"); no prefix -> "default"."""
    if path.startswith("/v1/"):
        return DEFAULT_SOURCE, path[3:]
    slash = path.find("/", 1)
    if slash > 1 and path.startswith("/v1/", slash):
        return path[1:slash], path[slash + 3 :]
    return DEFAULT_SOURCE, path


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their response plans in order."""

    def __init__(self, server: FakeUpstream) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._head: tuple[str, str, dict[str, str], bool] | None = None
        self._head_end = 0
        self.task: asyncio.Task[None] | None = None
        self._closed = False
        self._write_ready: asyncio.Future[None] | None = None
        self.busy = False

    # asyncio.Protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self.busy:
            self._serve_buffered()

    def eof_received(self) -> bool:
        # A half-closed client gets no more answers: close our side as well.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connections.discard(self)
        if self.task is not None:
            self.task.cancel()
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    # control

    def abort(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.abort()

    def _reset(self) -> None:
        """Close with RST: SO_LINGER 0 makes close() send a reset instead of a FIN."""
        assert self._transport is not None
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()
        self._closed = True

    # request loop

    def _serve_buffered(self) -> None:
        while not self.busy and not self._closed:
            try:
                request = self._parse()
            except _BadRequest as exc:
                self._reject(str(exc))
                return
            if request is None:
                return
            plan, done = self._server._handle(request)
            if all(isinstance(step, bytes) for step in plan):
                # Fast path: the whole answer is known now.
                try:
                    for step in plan:
                        assert isinstance(step, bytes)
                        self._write(step)
                finally:
                    done()
                if not request.keep_alive:
                    self._close()
                continue
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(
                self._run_plan(plan, done, request.keep_alive)
            )

    async def _run_plan(self, plan: list[_Step], done: Callable[[], None], keep: bool) -> None:
        try:
            for step in plan:
                if self._closed:
                    return
                if isinstance(step, bytes):
                    self._write(step)
                    if self._write_ready is not None and not self._write_ready.done():
                        await self._write_ready
                elif isinstance(step, float):
                    await self._server._clock.sleep(step)
                elif step is _RESET:
                    self._reset()
                    return
                elif step is _CLOSE:
                    self._close()
                    return
                elif step is _BLACK_HOLE:
                    # Never answer; connection_lost (client left or server stopped) cancels us.
                    await asyncio.get_running_loop().create_future()
        finally:
            done()
            self.task = None
            self.busy = False
        if not keep:
            self._close()
        elif not self._closed:
            self._serve_buffered()

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._closed:
            self._transport.write(data)

    def _close(self) -> None:
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()

    def _reject(self, reason: str) -> None:
        data = _dumps(
            {
                "error": {
                    "message": reason,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode()
        self._write(_json_head(len(data), True, 400) + data)
        self._close()

    def _parse(self) -> _Request | None:
        buffer = self._buffer
        if self._head is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD_BYTES:
                    raise _BadRequest("request head too large")
                return None
            lines = buffer[:end].decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ")
            except ValueError:
                raise _BadRequest(f"bad request line: {lines[0][:100]!r}") from None
            if not version.startswith("HTTP/1."):
                raise _BadRequest(f"unsupported protocol {version[:20]!r}")
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise _BadRequest(f"bad header line: {line[:100]!r}")
                headers[name.strip().lower()] = value.strip()
            connection = headers.get("connection", "").lower()
            keep_alive = (
                "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
            )
            self._head = (method, target, headers, keep_alive)
            self._head_end = end + 4
            if headers.get("expect", "").lower() == "100-continue":
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        method, target, headers, keep_alive = self._head
        start = self._head_end
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoded = _decode_chunked(buffer, start)
            if decoded is None:
                return None
            body, consumed = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                raise _BadRequest("bad Content-Length") from None
            if not 0 <= length <= _MAX_BODY_BYTES:
                raise _BadRequest("bad Content-Length")
            if len(buffer) - start < length:
                return None
            body = bytes(buffer[start : start + length])
            consumed = start + length
        del buffer[:consumed]
        self._head = None
        return _Request(method, target, headers, body, keep_alive)


def _decode_chunked(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body at ``start``: (body, end offset), or None when incomplete."""
    body = bytearray()
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        try:
            size = int(bytes(buffer[position:line_end]).split(b";", 1)[0], 16)
        except ValueError:
            raise _BadRequest("bad chunk size") from None
        position = line_end + 2
        if size == 0:
            # Skip trailers up to the blank line.
            while True:
                line_end = buffer.find(b"\r\n", position)
                if line_end < 0:
                    return None
                if line_end == position:
                    return bytes(body), line_end + 2
                position = line_end + 2
        if len(buffer) < position + size + 2:
            return None
        body += buffer[position : position + size]
        if len(body) > _MAX_BODY_BYTES:
            raise _BadRequest("request body too large")
        position += size + 2
