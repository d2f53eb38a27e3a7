"""The fake upstream server: lifecycle, scripting, counters, and routing of each request to
the answers of its protocol."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from polygateway.clock import SystemClock
from polygateway.ports import Clock
from polygateway.testing.fake_upstream import anthropic, openai
from polygateway.testing.fake_upstream.connection import Connection
from polygateway.testing.fake_upstream.embeddings import DEFAULT_EMBEDDING_DIM
from polygateway.testing.fake_upstream.openai import DEFAULT_MODEL
from polygateway.testing.fake_upstream.replies import ReceivedRequest, Reply, check_delay
from polygateway.testing.fake_upstream.wire import (
    BLACK_HOLE,
    CLOSE,
    RESET,
    Answers,
    Ask,
    Hold,
    HttpRequest,
    Step,
    json_head,
    sse_head,
    truncated_plan,
)
from polygateway.testing.threads import serve_in_thread

logger = logging.getLogger("polygateway.testing.fake_upstream")

DEFAULT_SOURCE: Final = "default"

COUNTERS_PATH: Final = "/_fake/counters"
"""``GET`` answers the server's counters as JSON (see :meth:`FakeUpstream.counters`); it is
not a route of any protocol and is itself never counted."""

# (method, path after /v1) -> route, of every protocol served. A new protocol adds its module's
# ROUTES here and its answers in FakeUpstream.__init__.
_ROUTE_BY_PATH: Final[dict[tuple[str, str], str]] = {**openai.ROUTES, **anthropic.ROUTES}
_SCRIPTABLE_ROUTES: Final[frozenset[str]] = frozenset(_ROUTE_BY_PATH.values())
_ROUTES: Final[frozenset[str]] = _SCRIPTABLE_ROUTES | {"other"}


@dataclass(slots=True)
class _Waiter:
    ready: Callable[[], bool]
    notify: Callable[[], object]


class _Group:
    """Requests held until ``size`` of them wait, then answered together (a barrier)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._waiting: list[asyncio.Future[None]] = []

    async def join(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        if len(self._waiting) >= self.size:
            self.release()
        try:
            await future
        finally:
            if future.cancelled() and future in self._waiting:
                self._waiting.remove(future)  # a client that left no longer counts

    def release(self) -> None:
        """Answer the requests held so far without waiting for the group to fill."""
        waiting, self._waiting = self._waiting, []
        for member in waiting:
            if not member.done():
                member.set_result(None)


@dataclass(frozen=True, slots=True)
class _Flap:
    since: float
    down: Reply
    up: Reply
    down_s: float
    up_s: float

    def reply(self, now: float) -> Reply:
        phase = (now - self.since) % (self.down_s + self.up_s)
        return self.down if phase < self.down_s else self.up


@dataclass(slots=True)
class _Mix:
    replies: tuple[Reply, ...]
    cumulative: tuple[float, ...]
    rng: random.Random

    def reply(self) -> Reply:
        point = self.rng.random() * self.cumulative[-1]
        for reply, edge in zip(self.replies, self.cumulative, strict=True):
            if point < edge:
                return reply
        return self.replies[-1]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as :class:`FakeUpstream`'s ``on_arrival`` hook sees it (before it is
    answered): the wall-clock time, where it went, its JSON body and the reply chosen."""

    at: float
    source: str
    route: str
    body: Any
    reply: Reply | None


class FakeUpstream:
    """An OpenAI-compatible (and Anthropic Messages) HTTP server on loopback with scripted
    behaviour per source.

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
        shuffle_embeddings: bool = True,
        models: Sequence[str] = (DEFAULT_MODEL,),
        keep_received: bool = True,
        clock: Clock | None = None,
        on_arrival: Callable[[Arrival], object] | None = None,
    ) -> None:
        """
        :param port: 0 picks a free port (see :attr:`port`).
        :param default_reply: answer of every source without a script or default of its own
            (``Reply.ok()`` when None); restored by :meth:`reset`.
        :param embedding_dim: vector size of ``/v1/embeddings`` unless the request asks
            ``dimensions`` (the attribute of the same name can be changed; reset restores it).
        :param shuffle_embeddings: list ``data[]`` of ``/v1/embeddings`` out of input order (a
            permutation fixed per request, never the identity), as proxies may; clients must
            sort by ``index`` (attribute of the same name; reset restores it).
        :param models: ids listed by ``/v1/models`` (attribute ``models``).
        :param keep_received: record every request for :meth:`received` (turn off for long
            benchmark runs, where it would grow without bound).
        :param clock: source of delays and ``created`` timestamps.
        :param on_arrival: called on the server's loop with every request that reached a
            route, before it is answered (logs of long runs; it must not block).
        """
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim!r}")
        self.host = host
        self._requested_port = port
        self._initial_default = default_reply if default_reply is not None else Reply.ok()
        self._initial_embedding_dim = embedding_dim
        self._initial_models = tuple(models)
        self.embedding_dim = embedding_dim
        self._initial_shuffle_embeddings = shuffle_embeddings
        self.shuffle_embeddings = shuffle_embeddings
        self.models: list[str] = list(models)
        self._keep_received = keep_received
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._on_arrival = on_arrival

        self._lock = threading.Lock()
        self._scripts: dict[tuple[str, str], deque[Reply]] = {}
        self._defaults: dict[tuple[str, str], Reply] = {}
        self._flaps: dict[tuple[str, str], _Flap] = {}
        self._mixes: dict[tuple[str, str], _Mix] = {}
        self._groups: dict[tuple[str, str], _Group] = {}
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
        self._connections: set[Connection] = set()
        self._accepted = 0
        self._port: int | None = None
        # The answers of each route's protocol.
        self._openai = openai.OpenAIAnswers(self._clock)
        self._anthropic = anthropic.AnthropicAnswers(self._clock)
        self._answers: dict[str, Answers] = dict.fromkeys(openai.ROUTES.values(), self._openai)
        self._answers.update(dict.fromkeys(anthropic.ROUTES.values(), self._anthropic))

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
            self._new_connection,
            self.host,
            self._requested_port,
            backlog=1024,
        )
        self._port = int(self._server.sockets[0].getsockname()[1])

    def _new_connection(self) -> Connection:
        self._accepted += 1
        return Connection(self._handle, self._clock, self._connections)

    @property
    def accepted_connections(self) -> int:
        """TCP connections accepted since the start (or the last ``reset()``): how many a
        client opened, e.g. to check that it reuses them (keep-alive)."""
        return self._accepted

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
        with serve_in_thread(fake.start, fake.stop, name="pgw-fake-upstream"):
            yield fake

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
            self._flaps.pop((source, route), None)
            self._mixes.pop((source, route), None)

    def flap(
        self,
        source: str,
        *,
        down: Reply,
        up: Reply | None = None,
        down_s: float,
        up_s: float,
        route: str = "chat",
    ) -> None:
        """From now on (once its script is used up) ``source`` alternates: ``down`` for
        ``down_s`` seconds, then ``up`` (default ``Reply.ok()``) for ``up_s``, and again; by the
        server clock. ``reset`` or ``set_default`` ends it."""
        _check_source(source)
        _check_route(route, scriptable=True)
        check_delay("down_s", down_s)
        check_delay("up_s", up_s)
        if down_s + up_s <= 0:
            raise ValueError("flap() needs down_s + up_s > 0")
        with self._lock:
            self._defaults.pop((source, route), None)
            self._mixes.pop((source, route), None)
            self._flaps[(source, route)] = _Flap(
                self._clock.monotonic(), down, up if up is not None else Reply.ok(), down_s, up_s
            )

    def mix(
        self,
        source: str,
        weighted: Sequence[tuple[float, Reply]],
        *,
        seed: int = 0,
        route: str = "chat",
    ) -> None:
        """From now on (once its script is used up) ``source`` answers each request with one of
        ``weighted``'s replies, drawn with probability proportional to its weight (a seeded,
        reproducible sequence): a flaky source. ``reset`` or ``set_default`` ends it."""
        _check_source(source)
        _check_route(route, scriptable=True)
        if not weighted:
            raise ValueError("mix() needs at least one (weight, Reply)")
        total = 0.0
        cumulative: list[float] = []
        for weight, reply in weighted:
            if not isinstance(reply, Reply):
                raise TypeError(f"mix() takes (weight, Reply) pairs, got {type(reply).__name__}")
            if not (weight >= 0.0 and weight < float("inf")):
                raise ValueError(f"mix() weights must be finite and >= 0, got {weight!r}")
            total += weight
            cumulative.append(total)
        if total <= 0.0:
            raise ValueError("mix() needs a weight > 0")
        with self._lock:
            self._defaults.pop((source, route), None)
            self._flaps.pop((source, route), None)
            self._mixes[(source, route)] = _Mix(
                tuple(reply for _, reply in weighted), tuple(cumulative), random.Random(seed)
            )

    def answer_together(self, source: str, size: int, *, route: str = "chat") -> None:
        """From now on requests to ``source`` are held until ``size`` of them wait, then all
        answered at once, group after group (a client that leaves drops out of its group):
        concurrency made exact. ``size`` 1 ends it and answers the requests held until then,
        as another size does; ``reset`` closes them, as it closes every busy connection."""
        _check_source(source)
        _check_route(route, scriptable=True)
        if type(size) is not int or size < 1:
            raise ValueError(f"answer_together() size must be an int >= 1, got {size!r}")
        with self._lock:
            ended = self._groups.pop((source, route), None)
            if size > 1:
                self._groups[(source, route)] = _Group(size)
        loop = self._loop
        if ended is None or loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            ended.release()
        else:
            loop.call_soon_threadsafe(ended.release)

    def reset(self) -> None:
        """Clear scripts, defaults, counters and recorded requests; close connections that are
        still answering (black holes, delayed replies) so nothing leaks into the next test."""
        with self._lock:
            self._scripts.clear()
            self._defaults.clear()
            self._flaps.clear()
            self._mixes.clear()
            self._groups.clear()
            self._requests.clear()
            self._inflight.clear()
            self._max_inflight.clear()
            self._received.clear()
            self._accepted = 0
            self._generation += 1
            self._anthropic.reset()
        self.embedding_dim = self._initial_embedding_dim
        self.shuffle_embeddings = self._initial_shuffle_embeddings
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

    def counters(self, *, restart_max: bool = False) -> dict[str, Any]:
        """Every counter at once (also served as JSON at ``GET /_fake/counters``, and with
        ``?restart_max=1``): ``{"requests": {route: {source: n}}, "inflight": ...,
        "max_inflight": ...}``, the source ``"*"`` being all sources of the route together.
        ``restart_max`` starts the high-water marks again from what is in flight now (after
        reading them), so a long run can be checked in phases."""
        with self._lock:
            tables = {
                "requests": dict(self._requests),
                "inflight": dict(self._inflight),
                "max_inflight": dict(self._max_inflight),
            }
            if restart_max:
                self._max_inflight = dict(self._inflight)
        out: dict[str, Any] = {}
        for name, table in tables.items():
            by_route: dict[str, dict[str, int]] = {}
            for (source, route), value in sorted(
                table.items(), key=lambda item: (item[0][1], item[0][0] or "")
            ):
                by_route.setdefault(route, {})["*" if source is None else source] = value
            out[name] = by_route
        return out

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
    ) -> tuple[int, int, Reply | None]:
        """Count the request and take its reply from the script (one critical section).
        Returns the generation, the request's serial number and the reply."""
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
                    flap = self._flaps.get((source, route))
                    mix = self._mixes.get((source, route))
                    if flap is not None:
                        reply = flap.reply(self._clock.monotonic())
                    elif mix is not None:
                        reply = mix.reply()
                    else:
                        reply = self._defaults.get((source, route))
                    if reply is None:
                        reply = (
                            self._initial_default if route in ("chat", "messages") else Reply.ok()
                        )
            self._next_id += 1
            return self._generation, self._next_id, reply

    def _end(self, source: str, route: str, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return  # counted before a reset
            for key in ((source, route), (None, route)):
                self._inflight[key] -= 1

    def _handle(self, request: HttpRequest) -> tuple[list[Step], Callable[[], None]]:
        """Plan the response to one request; returns the plan and its completion callback."""
        path, _, query = request.path.partition("?")
        if path == COUNTERS_PATH and request.method == "GET":
            data = json.dumps(self.counters(restart_max="restart_max=1" in query)).encode()
            return [json_head(len(data), not request.keep_alive) + data], _nothing
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
                at=self._clock.monotonic(),
            )
            if self._keep_received
            else None
        )
        # Only the routes read with GET (the model list) take no JSON body.
        malformed = request.method != "GET" and (parse_failed or not isinstance(body, dict))
        consume = route != "other" and not malformed
        generation, serial, reply = self._begin(source, route, received, consume)
        close = not request.keep_alive
        if self._on_arrival is not None and route != "other":
            try:
                self._on_arrival(Arrival(self._clock.time(), source, route, body, reply))
            except Exception:  # a broken log must not take the server down
                logger.exception("fake upstream on_arrival hook failed")

        def done() -> None:
            self._end(source, route, generation)

        if route == "other":
            message = f"Invalid URL ({request.method} {path})"
            return self._openai.error(404, "invalid_request_error", None, message, close), done
        if malformed:
            message = (
                "We could not parse the JSON body of your request. The body must be a JSON object."
            )
            return self._openai.error(400, "invalid_request_error", None, message, close), done
        assert reply is not None
        request_json: dict[str, Any] = body if isinstance(body, dict) else {}
        ask = Ask(
            route=route,
            reply=reply,
            body=request_json,
            model=reply.model or str(request_json.get("model") or DEFAULT_MODEL),
            close=close,
            serial=serial,
            models=tuple(self.models),
            embedding_dim=self.embedding_dim,
            shuffle_embeddings=self.shuffle_embeddings,
        )
        try:
            plan = self._plan(ask)
        except Exception as exc:  # a test's content callable failed: answer 500 and log it
            logger.exception("fake upstream could not build its reply")
            message = f"fake upstream reply failed: {type(exc).__name__}: {exc}"
            plan = self._openai.error(500, "server_error", None, message, close)
        with self._lock:
            group = self._groups.get((source, route))
        if group is not None:
            plan = [Hold(group.join), *plan]  # a new list: a plan may be shared
        return plan, done

    def _plan(self, ask: Ask) -> list[Step]:
        """The wire faults are the same for every protocol; the rest is the route's answers."""
        reply = ask.reply
        if reply.kind == "reset":
            if not reply.after_headers:
                return [RESET]
            if ask.route in ("chat", "messages") and ask.body.get("stream"):
                return [sse_head(ask.close), RESET]
            return [json_head(1024, ask.close), RESET]
        if reply.kind == "black_hole" or (reply.kind == "stall" and not ask.body.get("stream")):
            return [BLACK_HOLE]
        if reply.reject_prefill and _is_prefill(ask.body):
            message = "This model does not support assistant message prefill."
            return self._openai.error(400, "invalid_request_error", None, message, ask.close)
        if reply.kind == "garbage":
            return [b"SPEAK FRIEND AND ENTER\r\n\r\n", CLOSE]
        if reply.kind == "redirect":
            return [json_head(0, ask.close, reply.status, f"Location: {reply.location}\r\n")]
        if reply.kind == "truncated":
            whole = dataclasses.replace(ask, reply=dataclasses.replace(reply, kind="ok"))
            return truncated_plan(
                self._answers[ask.route].plan(whole), bool(ask.body.get("stream"))
            )
        return self._answers[ask.route].plan(ask)


def _nothing() -> None:
    return None


def _is_prefill(body: Mapping[str, Any]) -> bool:
    messages = body.get("messages")
    return (
        isinstance(messages, list)
        and bool(messages)
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    )


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
