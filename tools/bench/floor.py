"""The governed call against the tightest floors, in memory and on Redis, in one run.

    python tools/bench/floor.py [--seconds 1.0] [--rounds 3] [--conc 1,64,1024]
                                [--modes stream,json] [--only name,name]
                                [--engines httptools,aiohttp] [--pin] [--upstream canned]
    python tools/bench/floor.py --callgrind [--calls-pair 200,600] [--only ...] [--global-limit N]
                                [--engines aiohttp,httptools]
    python tools/bench/floor.py --startup [--runs 9] [--callgrind]
    python tools/bench/floor.py --rss [--rss-calls 100000] [--conc 64] [--modes stream]

Starts ``pgw fake-upstream`` (its own process) and a ``redis-server`` of its own on a free port
(``--save '' --appendonly no``), then measures, interleaved over ``--rounds`` rounds at every
concurrency and mode (streaming, 20 chunks, and JSON), calls/s and client CPU µs per call:

- ``floor-aiohttp``: the cheapest correct streaming client on aiohttp (chunk reads, bytes split
  on blank lines, orjson per frame; ``overhead.bench_raw_aiohttp``);
- ``floor-httptools``: a lower floor on asyncio's ``Protocol`` with ``httptools`` (the parser
  uvicorn uses): keep-alive pool, one prebuilt request, body callbacks fed to the same SSE split;
- ``openai-sdk``, ``litellm-router``: the bare SDK and LiteLLM's Router (rows only when
  installed, and not at concurrency 1024);
- ``governed-memory`` / ``governed-redis``: ``GatewayClient.from_env`` (default engine),
  limiter and breaker in memory / on the Redis above; telemetry and cache off;
- ``full-memory`` / ``full-redis``: the full pipeline (SQLite telemetry, memory cache, every
  call a miss), limiter and breaker in memory / on Redis; rows written are counted.

``--pin`` (two CPUs or more) runs the measuring process, the clients' own, on the first CPU
and ``pgw fake-upstream`` and ``redis-server`` together on the second: the client's calls/s is
then bound by its own CPU rather than by how the scheduler shares two CPUs among three busy
processes (the Redis rows have one process more than the memory rows).

``--upstream canned`` answers with ``canned_upstream.py`` instead: the bytes ``pgw
fake-upstream`` sent for a JSON and for a streamed request (captured at start-up), written back
for every request of that kind. The fake upstream's generality (every fault of the error model)
costs it about as much CPU per answer as a governed call; the canned server a small share of
that, so with ``--pin`` the second CPU has room for ``redis-server`` as well and the client's
own CPU bounds its calls/s.

Redis rows carry ``script calls/call``: the script calls the server ran (``INFO commandstats`` after
a ``CONFIG RESETSTAT``; ``SCRIPT LOAD`` and the commands run inside scripts excluded) divided
by the calls made (warm-up included): the server-side count of round trips per call.

``--callgrind`` runs each selected client in a child process under ``valgrind --tool=callgrind``
twice, with two call counts, and reports instructions per call as the difference of the totals
over the difference of the counts (start-up and warm-up cancel out; concurrency 1 unless
``--conc`` says otherwise). Instruction counts do not move with the machine's load. At
concurrency 1024 use ``--calls-pair 4096,16384``: with a thousand calls in flight the
collector's full collection comes about once per 10,000 calls and costs some 20k instructions a
call of a 3,072-call window, so a short window holds one or none of them by chance (the
governed client: 662.3k with one in its 1024/4096 window, 653.5k over 4096/16384).

``--startup``: the median wall time of ``--runs`` fresh interpreters doing ``import
polygateway`` plus ``GatewayClient.from_env`` with the default configuration (one source, http
and https), minus the median of as many empty interpreters (wall and CPU); when the openai SDK
is installed, the same for ``openai.AsyncOpenAI`` in the same run, interleaved, and the ratio
(the budget's 300 ms was 0.24x of the SDK's 1.25 s on the machine of the day it was set); and
the median time each child measures itself from its first line to the ready client (an https
source's process also waits, at its exit, for the thread making its TLS context). Bytecode is
written and read as for an installed package (``PYTHONDONTWRITEBYTECODE`` is dropped for these
children, and one untimed run comes first), so sources are not compiled in the timed runs.
With ``--callgrind`` also the instructions of one start-up minus an empty interpreter's
(independent of the load; every thread counted), http, https and the SDK's.

``--rss``: the process's RSS every 5% of ``--rss-calls`` full-pipeline calls (SQLite telemetry,
every call a cache miss), the growth from the end of the warm-up (the first 10%) to the end,
and the telemetry rows written against the calls made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
from overhead import (
    HEADERS,
    MESSAGES,
    MODEL,
    Load,
    Measure,
    Row,
    SSEConsumer,
    bench_openai_sdk,
    bench_raw_aiohttp,
    body,
    callgrind_instructions,
    free_port,
    governed_env,
    measure_point,
    run_calls,
    start_upstream,
    wait_listening,
)

SCRIPT_COMMANDS = frozenset(("evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro"))
"""What the governed call sends: ``INFO commandstats`` also counts the commands a script runs
inside the server, which are not round trips."""


# --------------------------------------------------------------------------- redis-server


class RedisServer:
    """A ``redis-server`` of the benchmark's own, and the server-side command counter."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found on PATH")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.command("PING") == "+PONG":
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def command(self, *parts: str) -> str:
        """One command over a plain socket (no client library in the counted process)."""
        payload = f"*{len(parts)}\r\n" + "".join(f"${len(p)}\r\n{p}\r\n" for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(payload.encode())
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode().strip()

    def reset_stats(self) -> None:
        self.command("CONFIG", "RESETSTAT")

    def commands_run(self) -> int:
        """Script calls run since the last reset (``SCRIPT LOAD`` excluded)."""
        total = 0
        for line in self.command("INFO", "commandstats").splitlines():
            if not line.startswith("cmdstat_"):
                continue
            name, _, rest = line.removeprefix("cmdstat_").partition(":")
            if name in SCRIPT_COMMANDS:
                total += int(rest.split(",")[0].removeprefix("calls="))
        return total

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# --------------------------------------------------------------------------- floors


class _HttptoolsConnection(asyncio.Protocol):
    """One keep-alive connection: httptools parses, the body goes to the call's sink."""

    def __init__(self, httptools: Any) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.sink: Any = None
        self.keep = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status != 200:
            raise RuntimeError(f"status {status}")
        self.keep = self.parser.should_keep_alive()

    def on_body(self, chunk: bytes) -> None:
        self.sink(chunk)

    def on_message_complete(self) -> None:
        if self.done is not None:
            self.done.set_result(None)


def floor_httptools_call(
    host: str, port: int, stream: bool
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """One call of the httptools floor and the closer of its pool."""
    import httptools

    data = body(stream)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer sk-bench\r\n"
        b"Content-Length: %d\r\n\r\n" % (host.encode(), port, len(data))
    ) + data
    loop = asyncio.get_running_loop()
    idle: list[_HttptoolsConnection] = []
    made: list[_HttptoolsConnection] = []

    async def call() -> None:
        conn = None
        while idle:
            conn = idle.pop()
            if not conn.closed:
                break
            conn = None
        if conn is None:
            _, conn = await loop.create_connection(
                lambda: _HttptoolsConnection(httptools), host, port
            )
            made.append(conn)
        if stream:
            consumer = SSEConsumer()
            conn.sink = consumer.feed
        else:
            parts: list[bytes] = []
            conn.sink = parts.append
        conn.done = loop.create_future()
        assert conn.transport is not None
        conn.transport.write(request)
        await conn.done
        conn.done = None
        if not stream:
            orjson.loads(b"".join(parts))
        if conn.keep and not conn.closed:
            idle.append(conn)
        else:
            assert conn.transport is not None
            conn.transport.close()

    async def close() -> None:
        for conn in made:
            if conn.transport is not None:
                conn.transport.close()

    return call, close


async def bench_floor_httptools(
    host: str, port: int, stream: bool, load: Load
) -> tuple[float, float, str]:
    call, close = floor_httptools_call(host, port, stream)
    try:
        rate, cpu, _ = await run_calls(call, load)
    finally:
        await close()
    return rate, cpu, ""


async def bench_litellm_router(url: str, stream: bool, load: Load) -> tuple[float, float, str]:
    from litellm import Router

    router = Router(
        model_list=[
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": url,
                    "api_key": "sk-bench",
                },
            }
        ],
        num_retries=0,
    )

    async def call() -> None:
        if stream:
            chunks = await router.acompletion(model=MODEL, messages=MESSAGES, stream=True)
            async for _ in chunks:
                pass
        else:
            await router.acompletion(model=MODEL, messages=MESSAGES)

    rate, cpu, _ = await run_calls(call, load)
    return rate, cpu, ""


# --------------------------------------------------------------------------- governed


def state_env(redis_url: str | None) -> dict[str, str]:
    if redis_url is None:
        return {}
    return {
        "PGW_LIMITER_BACKEND": "redis",
        "PGW_BREAKER_BACKEND": "redis",
        "REDIS_URL": redis_url,
        "PGW_PLUGINS": "pgw-redis",
    }


WORKER_TIMEOUT_S = 3600.0
"""The governed clients' attempt, connect, stream (TTFT, inter-token), keep-alive and Redis
socket timeouts in the callgrind children, and
the floor's connect timeout and keep-alive there: under callgrind a round of 1024 calls takes
longer than the default 15 s keep-alive (connections re-opened inside the counted batch would be
counted) and a loop turn can outlast aiohttp's 30 s socket connect timeout."""

WORKER_FLUSH_INTERVAL_S = 10.0
"""The SQLite recorder's flush interval in the callgrind children (the default is 0.2 s). Under
valgrind a call takes about 50 times as long, so 0.2 s of wall time gathers a few rows per
commit where the same calls at full speed gather several hundred (thousands of calls/s at
concurrency 64): the per-commit work would be charged to a handful of rows. 50 times the
interval gives the batches of full speed."""

WORKER_OPENING = 64
"""Calls of the callgrind children's warm-up that open a connection at the same time."""


def make_client(
    url: str,
    db: str,
    *,
    redis_url: str | None,
    full: bool,
    engine: str = "",
    timeout_s: float | None = None,
    global_limit: int | None = None,
    flush_interval_s: float | None = None,
) -> Any:
    """The governed (or ``full``) client on ``engine`` (empty: the default engine);
    ``global_limit``: its global concurrency limit (``None``: the benchmarks' 1000);
    ``flush_interval_s``: the SQLite recorder's (``None``: its default)."""
    from polygateway import GatewayClient
    from polygateway.transports.engines import DEFAULT_ENGINE

    env = governed_env(
        url,
        engine or DEFAULT_ENGINE,
        telemetry="sqlite" if full else "none",
        cache="memory" if full else "none",
        db=db,
    )
    if flush_interval_s is not None:
        env["LLM__TELEMETRY__FLUSH_INTERVAL_S"] = f"{flush_interval_s:g}"
    if global_limit is not None:
        env["LLM__GLOBAL__MAX_CONCURRENCY"] = str(global_limit)
    if timeout_s is not None:
        env["LLM__OPENAI__1__TIMEOUT_S"] = f"{timeout_s:g}"
        env["LLM__OPENAI__1__CONNECT_TIMEOUT_S"] = f"{timeout_s:g}"
        env["LLM__OPENAI__1__KEEPALIVE_S"] = f"{timeout_s:g}"
        # The configuration's rule: 0 < inter-token < TTFT < attempt <= stall window.
        env["LLM__OPENAI__1__TTFT_TIMEOUT_S"] = f"{timeout_s / 2:g}"
        env["LLM__OPENAI__1__INTER_TOKEN_TIMEOUT_S"] = f"{timeout_s / 4:g}"
        env["LLM__BACKPRESSURE__STALL_WINDOW_S"] = f"{timeout_s:g}"
        if redis_url is not None:
            # At valgrind's speed a script call can outlast the default socket timeout, and
            # the backends would fail closed.
            for kind in ("LIMITER", "BREAKER"):
                env[f"LLM__{kind}__SOCKET_TIMEOUT_S"] = f"{timeout_s:g}"
                env[f"LLM__{kind}__CONNECT_TIMEOUT_S"] = f"{timeout_s:g}"
    return GatewayClient.from_env(env=env | state_env(redis_url))


async def bench_governed_on(
    url: str,
    stream: bool,
    load: Load,
    *,
    server: RedisServer | None,
    full: bool,
    engine: str = "",
    name: str = "",
) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        client = make_client(
            url, db, redis_url=server.url if server else None, full=full, engine=engine
        )
        counter = iter(range(10**9))
        if server is not None:
            server.reset_stats()
        try:

            async def call() -> None:
                messages = [{"role": "user", "content": f"Say hello #{next(counter)}"}]
                await client.chat(messages, stream=stream)

            rate, cpu, made = await run_calls(call, load)
        finally:
            await client.aclose()
        if server is not None:
            key = (
                name or ("full-redis" if full else "governed-redis"),
                "stream" if stream else "json",
            )
            SCRIPT_CALLS.setdefault((*key, load.concurrency), []).append(
                server.commands_run() / made
            )
        if full:
            import sqlite3

            with closing(sqlite3.connect(db)) as conn:
                rows = conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0]
            return rate, cpu, f"telemetry rows {rows}/{made}" + ("" if rows == made else " LOST")
        return rate, cpu, ""


SCRIPT_CALLS: dict[tuple[str, str, int], list[float]] = {}
"""Script calls per governed call of every Redis round, by (client, mode, concurrency)."""


def clients(
    url: str, stream: bool, load: Load, server: RedisServer, engines: Sequence[str] = ()
) -> list[tuple[str, Measure]]:
    """Every row's client; the governed and full ones once per engine of ``engines``, named
    ``client[engine]`` (none given: once, on the default engine)."""
    import importlib.util

    host, port = url.removeprefix("http://").split("/")[0].split(":")
    out: list[tuple[str, Measure]] = [
        ("floor-aiohttp", partial(bench_raw_aiohttp, url, stream, load))
    ]
    if importlib.util.find_spec("httptools") is not None:
        out.append(
            ("floor-httptools", partial(bench_floor_httptools, host, int(port), stream, load))
        )
    # The SDK rows cost milliseconds a call: at concurrency 1024 a round would take minutes.
    sdk_rows = load.concurrency <= 64
    if sdk_rows and importlib.util.find_spec("openai") is not None:
        out.append(("openai-sdk", partial(bench_openai_sdk, url, stream, load)))
    if sdk_rows and importlib.util.find_spec("litellm") is not None:
        out.append(("litellm-router", partial(bench_litellm_router, url, stream, load)))
    for base, srv, full in (
        ("governed-memory", None, False),
        ("governed-redis", server, False),
        ("full-memory", None, True),
        ("full-redis", server, True),
    ):
        for engine in engines or ("",):
            name = f"{base}[{engine}]" if engine else base
            out.append(
                (
                    name,
                    partial(
                        bench_governed_on,
                        url,
                        stream,
                        load,
                        server=srv,
                        full=full,
                        engine=engine,
                        name=name,
                    ),
                )
            )
    return out


# --------------------------------------------------------------------------- reporting


def ratio(
    rows: dict[tuple[str, str, int], Row], top: str, bottom: str, mode: str, conc: int, field: str
) -> str:
    a, b = rows.get((top, mode, conc)), rows.get((bottom, mode, conc))
    if a is None or b is None:
        return "-"
    pairs = [t / u for t, u in zip(getattr(a, field), getattr(b, field), strict=False) if t and u]
    if not pairs:
        return "-"
    med = statistics.median(pairs)
    return f"{med:.0%}" if field == "rate_by_round" else f"{med:.2f}x"


def report(rows: list[Row]) -> None:
    by_key = {(r.client, r.mode, r.concurrency): r for r in rows}
    print()
    print(
        "| client | mode | conc | calls/s | CPU µs/call | vs floor-aiohttp calls/s "
        "| vs floor-aiohttp CPU | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        calls = SCRIPT_CALLS.get((r.client, r.mode, r.concurrency))
        note = "; ".join(
            ([f"script calls/call {statistics.median(calls):.2f}"] if calls else [])
            + ([r.note] if r.note else [])
        )
        print(
            f"| {r.client} | {r.mode} | {r.concurrency} | {r.calls_per_s:.0f} | "
            f"{r.cpu_us_per_call:.0f} | "
            f"{ratio(by_key, r.client, 'floor-aiohttp', r.mode, r.concurrency, 'rate_by_round')} | "
            f"{ratio(by_key, r.client, 'floor-aiohttp', r.mode, r.concurrency, 'cpu_by_round')} | "
            f"{note} |"
        )
    print()
    print("Goals (medians of per-round paired ratios):")
    suffixes = sorted({r.client.partition("[")[2] for r in rows if r.client.startswith("gov")})
    for suffix in suffixes or [""]:
        if suffix:
            print(f"  engine {suffix.rstrip(']')}:")
        goals(by_key, rows, f"[{suffix}" if suffix else "")


def goals(by_key: dict[tuple[str, str, int], Row], rows: list[Row], tag: str) -> None:
    """The goal lines of the governed and full rows named ``...{tag}``."""
    for mode in ("stream", "json"):
        for conc in sorted({r.concurrency for r in rows}):

            def line(
                text: str, top: str, bottom: str, field: str, k: tuple[str, int] = (mode, conc)
            ) -> None:
                print(f"  {k[0]:6} c={k[1]:<4} {text}: {ratio(by_key, top, bottom, *k, field)}")

            memory, redis = f"governed-memory{tag}", f"governed-redis{tag}"
            if (redis, mode, conc) not in by_key:
                continue
            line("redis calls/s vs memory (>= 75%)", redis, memory, "rate_by_round")
            line("redis CPU vs memory (<= 1.5x)", redis, memory, "cpu_by_round")
            line("governed-memory CPU vs floor", memory, "floor-aiohttp", "cpu_by_round")
            line(
                "full-memory CPU vs governed-memory (<= 1.25x)",
                f"full-memory{tag}",
                memory,
                "cpu_by_round",
            )
            line("full-redis CPU vs governed-redis", f"full-redis{tag}", redis, "cpu_by_round")


# --------------------------------------------------------------------------- modes


def pin_processes(*others: int) -> None:
    """This process on the first CPU it may use, ``others`` together on the second."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs two CPUs")
    os.sched_setaffinity(0, {cpus[0]})  # threads started later inherit it
    for pid in others:
        for thread in os.listdir(f"/proc/{pid}/task"):  # every thread of theirs
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(thread), {cpus[1]})


def start_bench_upstream(port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """``--upstream``: ``pgw fake-upstream`` on ``port``, or (``canned``) a server sending the
    bytes the fake upstream sent for a JSON and for a streamed request (``canned_upstream``)."""
    if args.upstream == "fake":
        return start_upstream(port, args.chunks)
    from canned_upstream import capture

    fake_port = free_port()
    fake = start_upstream(fake_port, args.chunks)
    try:
        answers = {
            kind: capture(fake_port, body(kind == "stream"), HEADERS) for kind in ("json", "stream")
        }
    finally:
        fake.terminate()
        fake.wait(10)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for kind, raw in answers.items():
            paths[kind] = os.path.join(tmp, f"{kind}.http")
            Path(paths[kind]).write_bytes(raw)
        script = str(Path(__file__).resolve().parent / "canned_upstream.py")
        command = [sys.executable, script, "--port", str(port)]
        command += ["--json", paths["json"], "--stream", paths["stream"]]
        proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_listening(proc, port)  # it has read both files once it listens
    return proc


async def bench_async(args: argparse.Namespace) -> list[Row]:
    port = free_port()
    upstream = start_bench_upstream(port, args)
    server = RedisServer()
    url = f"http://127.0.0.1:{port}/v1"
    only = set(args.only.split(",")) if args.only else None
    engines = [e for e in args.engines.split(",") if e]
    rows: list[Row] = []
    try:
        if args.pin:
            pin_processes(upstream.pid, server.proc.pid)
        for mode in args.modes.split(","):
            stream = mode == "stream"
            for conc in (int(c) for c in args.conc.split(",")):
                calls = args.calls if conc > 1 else max(50, args.calls // 8)
                load = Load(max(calls, 2 * conc), conc, args.seconds)
                points = [
                    (name, factory)
                    for name, factory in clients(url, stream, load, server, engines)
                    if only is None or name.partition("[")[0] in only
                ]
                rows += await measure_point(points, mode, load, args.rounds)
    finally:
        upstream.terminate()
        upstream.wait(10)
        server.stop()
    return rows


def _terminate_on_sigterm() -> None:
    # SIGTERM runs the ``finally`` blocks too: the upstream and redis-server are stopped.
    import signal

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)


async def worker_async(args: argparse.Namespace) -> None:
    """One client, exactly ``--worker-calls`` calls after a fixed warm-up (callgrind child)."""
    url, name, stream, conc = args.url, args.worker, args.modes == "stream", int(args.conc)
    redis_url = args.redis_url or None
    calls = args.worker_calls
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        closer: Any = None
        if name.startswith(("governed-", "full-")):
            client = make_client(
                url,
                db,
                redis_url=redis_url if name.endswith("redis") else None,
                full=name.startswith("full-"),
                engine=args.engine,
                # Under callgrind a round of 1024 concurrent calls takes minutes of wall time:
                # an attempt timing out there would retry and count another call's work.
                timeout_s=WORKER_TIMEOUT_S,
                global_limit=args.global_limit,
                flush_interval_s=WORKER_FLUSH_INTERVAL_S,
            )
            counter = iter(range(10**9))
            closer = client.aclose

            async def call() -> None:
                messages = [{"role": "user", "content": f"Say hello #{next(counter)}"}]
                await client.chat(messages, stream=stream)
        elif name == "floor-aiohttp":
            import aiohttp

            data = body(stream)
            session = aiohttp.ClientSession(
                # Idle connections live as long as the governed clients' (a round of 1024
                # calls under callgrind can outlast aiohttp's 15 s keep-alive).
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=WORKER_TIMEOUT_S),
                headers=HEADERS,
                # As for the governed clients: a loop turn of 1024 calls under callgrind can
                # outlast aiohttp's 30 s socket connect timeout. The total stays aiohttp's
                # default (its timer per request is part of the floor's cost).
                timeout=aiohttp.ClientTimeout(total=300, sock_connect=WORKER_TIMEOUT_S),
            )
            closer = session.close

            async def call() -> None:
                async with session.post(f"{url}/chat/completions", data=data) as r:
                    if stream:
                        consumer = SSEConsumer()
                        async for chunk in r.content.iter_any():
                            consumer.feed(chunk)
                    else:
                        orjson.loads(await r.read())
        elif name == "engine":
            # The engine alone, as the transport drives it: post, raw reads to the end, close.
            from polygateway.transports.engines import (
                ACCEPT_ENCODING,
                DEFAULT_ENGINE,
                EngineConfig,
                make_engine,
            )

            data = body(stream)
            engine = make_engine(
                args.engine or DEFAULT_ENGINE,
                EngineConfig(
                    source_name="bench",
                    headers={"Accept-Encoding": ACCEPT_ENCODING, **HEADERS},
                    plain_http=True,
                ),
            )
            closer = engine.aclose

            async def call() -> None:
                response = await engine.post(f"{url}/chat/completions", data)
                try:
                    while await response.read_chunk():
                        pass
                finally:
                    await response.aclose()
        elif name == "floor-httptools":
            host, port = url.removeprefix("http://").split("/")[0].split(":")
            call, closer = floor_httptools_call(host, int(port), stream)
        else:
            raise SystemExit(f"--callgrind: no worker for {name!r}")

        async def batch(size: int, opening: asyncio.Semaphore | None = None) -> None:
            queue = iter(range(size))

            async def loop_() -> None:
                if opening is not None:
                    if next(queue, None) is None:
                        return
                    async with opening:  # each loop's first call opens its connection
                        await call()
                for _ in queue:
                    await call()

            await asyncio.gather(*(loop_() for _ in range(conc)))

        # The warm-up opens the connections WORKER_OPENING at a time: a thousand connects at
        # once, slowed by callgrind on a loaded machine, outlast aiohttp's connect timeout.
        # Every client gets the same warm-up; the counted batch runs at full concurrency.
        await batch(max(20, 2 * conc), asyncio.Semaphore(WORKER_OPENING))
        await batch(calls)
        await closer()


def run_callgrind(args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found")
    low, high = (int(n) for n in args.calls_pair.split(","))
    names = (
        args.only.split(",")
        if args.only
        else ["floor-aiohttp", "governed-memory", "governed-redis", "full-memory", "full-redis"]
    )
    port = free_port()
    upstream = start_bench_upstream(port, args)
    server = RedisServer()
    url = f"http://127.0.0.1:{port}/v1"
    results: dict[tuple[str, str], float] = {}
    # Governed and full clients, and ``engine`` (the bare engine: post, reads, close), run once
    # per engine of --engines, named "client[engine]".
    engines = [e for e in args.engines.split(",") if e]
    runs = [
        (name, engine)
        for name in names
        for engine in (
            engines if name.startswith(("governed-", "full-", "engine")) and engines else [""]
        )
    ]
    try:
        for mode in args.modes.split(","):
            for base_name, engine in runs:
                name = f"{base_name}[{engine}]" if engine else base_name
                totals = []
                for n in (low, high):
                    try:
                        totals.append(
                            callgrind_instructions(
                                "--worker",
                                base_name,
                                "--engine",
                                engine,
                                "--url",
                                url,
                                "--redis-url",
                                server.url,
                                "--modes",
                                mode,
                                "--conc",
                                args.conc.split(",")[0],
                                "--worker-calls",
                                str(n),
                                *(
                                    ("--global-limit", str(args.global_limit))
                                    if args.global_limit is not None
                                    else ()
                                ),
                                script=__file__,
                            )
                        )
                    except RuntimeError as exc:
                        tail = str(exc).strip().splitlines()[-3:]
                        print(f"{name} {mode} {n} calls FAILED: {' | '.join(tail)}")
                        break
                if len(totals) < 2:
                    continue
                per_call = (totals[1] - totals[0]) / (high - low)
                results[(name, mode)] = per_call
                print(
                    f"{name:27} {mode:6} {per_call / 1000:9.1f} k instructions/call",
                    flush=True,
                )
    finally:
        upstream.terminate()
        upstream.wait(10)
        server.stop()
    print()
    print(
        "| client | mode | k instructions/call | vs floor-aiohttp | vs governed-memory "
        "| vs same client on aiohttp |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for (name, mode), value in results.items():
        floor = results.get(("floor-aiohttp", mode))
        mem = results.get(("governed-memory", mode)) or results.get(
            ("governed-memory[aiohttp]", mode)
        )
        base_name, _, engine = name.partition("[")
        on_aiohttp = results.get((f"{base_name}[aiohttp]", mode)) if engine else None
        print(
            f"| {name} | {mode} | {value / 1000:.1f} | "
            f"{f'{value / floor:.2f}x' if floor else '-'} | "
            f"{f'{value / mem:.2f}x' if mem else '-'} | "
            f"{f'{value / on_aiohttp:.2f}x' if on_aiohttp else '-'} |"
        )


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


async def rss_async(args: argparse.Namespace) -> None:
    """``--rss``: RSS over ``--rss-calls`` full-pipeline calls (SQLite telemetry, cache miss)."""
    import sqlite3

    port = free_port()
    upstream = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    conc = int(args.conc.split(",")[0])
    total = args.rss_calls
    warm = total // 10
    try:
        with tempfile.TemporaryDirectory() as tmp:
            db = os.path.join(tmp, "bench.db")
            client = make_client(url, db, redis_url=None, full=True)
            counter = iter(range(total))
            samples: list[tuple[int, float]] = []
            done = 0

            async def worker() -> None:
                nonlocal done
                for n in counter:
                    messages = [{"role": "user", "content": f"Say hello #{n}"}]
                    await client.chat(messages, stream=args.modes.split(",")[0] == "stream")
                    done += 1
                    if done % (total // 20) == 0:
                        samples.append((done, rss_mb()))

            await asyncio.gather(*(worker() for _ in range(conc)))
            await client.aclose()
            with closing(sqlite3.connect(db)) as conn:
                rows = conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0]
    finally:
        upstream.terminate()
        upstream.wait(10)
    after_warm = next(mb for n, mb in samples if n >= warm)
    end = samples[-1][1]
    print("calls -> RSS MB: " + ", ".join(f"{n}: {mb:.1f}" for n, mb in samples))
    print(
        f"RSS after warm-up ({warm} calls) {after_warm:.1f} MB -> after {total} calls "
        f"{end:.1f} MB: {end / after_warm - 1:+.1%} (budget +10%); telemetry rows "
        f"{rows}/{total}{'' if rows == total else ' LOST'}"
    )


STARTUP_CODE = """
import time
began = time.perf_counter()
from polygateway import GatewayClient
client = GatewayClient.from_env(env={
    "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
    "LLM__OPENAI__1__API_KEY": "sk-bench",
    "LLM__OPENAI__1__MODEL": "bench-model",
})
print(time.perf_counter() - began)
"""

STARTUP_CODE_HTTPS = STARTUP_CODE.replace("http://127.0.0.1:9", "https://127.0.0.1:9")
"""The same with an https source: its TLS context (the CA store's read, ~250 M instructions
under OpenSSL 3) is begun in a thread at client build, so the client is ready before it is
made, and the process waits for that thread when it exits (callgrind counts every thread)."""


OPENAI_STARTUP_CODE = """
import time
began = time.perf_counter()
import openai
client = openai.AsyncOpenAI(api_key="sk-bench", base_url="http://127.0.0.1:9/v1")
print(time.perf_counter() - began)
"""
"""The reference of the same run: the openai SDK to a ready client (the issue's budget was set
as 300 ms against the SDK's 1.25 s on the machine of its day: 0.24x)."""

EMPTY_CODE = "print(0.0)"

BUDGET_VS_SDK = 0.300 / 1.25


def run_startup(args: argparse.Namespace) -> None:
    # Interleave the kinds so load changes touch them alike. Wall time is the budget's
    # measure; CPU time (user + system of the child) moves less with the machine's load.
    import importlib.util

    env = _startup_env()
    kinds = {"empty": EMPTY_CODE, "ready": STARTUP_CODE, "ready-https": STARTUP_CODE_HTTPS}
    if importlib.util.find_spec("openai") is not None:
        kinds["openai-sdk"] = OPENAI_STARTUP_CODE
    # One untimed run first: it writes the bytecode of any module that has none yet (what
    # ``pip install`` does for an installed package), so the timed runs measure importing,
    # not compiling sources, and the files are in the page cache.
    for code in kinds.values():
        _time_once(code, env)
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}")
    times: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind, code in kinds.items():
            times[kind].append(_time_once(code, env))
    for label, index in (("wall", 0), ("CPU", 1)):
        median = {kind: statistics.median(t[index] for t in runs) for kind, runs in times.items()}
        e = median["empty"]
        print(
            f"{label}: empty interpreter median {e * 1000:.0f} ms "
            f"(runs {_ms([t[index] for t in times['empty']])})"
        )
        sdk = median["openai-sdk"] - e if "openai-sdk" in median else None
        for kind, source in (("ready", "http"), ("ready-https", "https")):
            r = median[kind]
            print(
                f"{label}: {source} source, import + from_env median {r * 1000:.0f} ms "
                f"(runs {_ms([t[index] for t in times[kind]])}): start-up to a ready client "
                f"{(r - e) * 1000:.0f} ms (budget 300 ms)"
                + ("" if sdk is None else f", {(r - e) / sdk:.3f}x of the openai SDK")
            )
        if sdk is not None:
            print(
                f"{label}: openai SDK to a ready client {sdk * 1000:.0f} ms "
                f"(runs {_ms([t[index] for t in times['openai-sdk']])}, empty included; "
                f"budget {BUDGET_VS_SDK:.2f}x)"
            )
    # Timed inside the process, from its first line to the ready client: the process's own
    # wall time also holds its exit, which waits for the TLS context's thread.
    inside = {kind: statistics.median(t[2] for t in runs) for kind, runs in times.items()}
    print(
        "in-process to a ready client (medians): "
        + ", ".join(f"{kind} {inside[kind] * 1000:.0f} ms" for kind in kinds if kind != "empty")
    )
    print(f"load average after: {os.getloadavg()}")
    if args.callgrind:
        _startup_instructions(env, sdk="openai-sdk" in kinds)


def _startup_instructions(env: dict[str, str], *, sdk: bool) -> None:
    """Instructions of one start-up under callgrind, minus an empty interpreter's (no load
    dependence; one run each, the count is deterministic to well under 1%); with ``sdk``, the
    openai SDK's too."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found")
    codes = {
        "empty": EMPTY_CODE,
        "http": STARTUP_CODE,
        "https": STARTUP_CODE_HTTPS,
        **({"sdk": OPENAI_STARTUP_CODE} if sdk else {}),
    }
    counts = {
        kind: callgrind_instructions(code, script="-c", env=env) for kind, code in codes.items()
    }
    empty = counts["empty"]
    print(f"callgrind: empty interpreter {empty / 1e6:.1f} M instructions")
    openai_sdk = counts["sdk"] - empty if sdk else None
    for source in ("http", "https"):
        ready = counts[source] - empty
        print(
            f"callgrind: {source} source, import + from_env {counts[source] / 1e6:.1f} M: "
            f"start-up to a ready client {ready / 1e6:.1f} M"
            + (
                ""
                if openai_sdk is None
                else f", {ready / openai_sdk:.3f}x of the openai SDK (budget {BUDGET_VS_SDK:.2f}x)"
            )
        )
    if openai_sdk is not None:
        print(f"callgrind: openai SDK to a ready client {openai_sdk / 1e6:.1f} M")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PGW_", "LLM__", "REDIS"))}


def _startup_env() -> dict[str, str]:
    # Bytecode may be written (see run_startup): an installed package has it.
    env = _clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _time_once(code: str, env: dict[str, str]) -> tuple[float, float, float]:
    """Wall and CPU seconds of one fresh interpreter running ``code``, and the seconds it
    printed (its own timing)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, float(done.stdout.split()[-1])


def _ms(values: Sequence[float]) -> str:
    return " ".join(f"{v * 1000:.0f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=20000, help="at most, per batch at c>1")
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conc", default="1,64,1024")
    parser.add_argument("--modes", default="stream,json")
    parser.add_argument("--only", default="")
    parser.add_argument(
        "--pin", action="store_true", help="clients on one CPU, upstream and Redis on another"
    )
    parser.add_argument(
        "--upstream",
        choices=("fake", "canned"),
        default="fake",
        help="what answers: pgw fake-upstream, or a server sending the bytes it sent "
        "(canned_upstream.py: a small share of a CPU per call)",
    )
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--calls-pair", default="200,600", help="--callgrind call counts")
    parser.add_argument(
        "--global-limit",
        type=int,
        default=None,
        help="--callgrind: the governed clients' global concurrency limit (default 1000; "
        "below --conc, calls wait in the limiter's line)",
    )
    parser.add_argument("--startup", action="store_true")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--rss", action="store_true", help="RSS over many full-pipeline calls")
    parser.add_argument("--rss-calls", type=int, default=100_000)
    parser.add_argument(
        "--engines",
        default="",
        help="run the governed and full clients on each of these engines (default: once, on "
        "the default engine)",
    )
    parser.add_argument("--engine", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker-calls", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker_async(args))
        return
    if args.startup:
        run_startup(args)
        return
    _terminate_on_sigterm()
    if args.callgrind:
        run_callgrind(args)
        return
    if args.rss:
        asyncio.run(rss_async(args))
        return
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    rows = asyncio.run(bench_async(args))
    print(f"load average after: {os.getloadavg()}")
    report(rows)


if __name__ == "__main__":
    main()
