"""Overhead of the governed client against raw HTTP clients, in one run, against one upstream.

    python tools/bench/overhead.py [--seconds 1.5] [--calls 20000] [--chunks 20] [--rounds 5]
                                   [--only aiohttp,governed-aiohttp] [--modes stream,json]
    python tools/bench/overhead.py --callgrind [--callgrind-calls 100]

Starts ``pgw fake-upstream`` in its own process, then for every client measures, at concurrency
1 and 64, streaming and not: calls/s (wall) and client CPU microseconds per call (process time
of this process, all its threads, divided by the calls). Clients:

- ``aiohttp``, ``httpx``, ``httpx2``: raw clients doing the minimal equivalent work: send the
  request, read the body to its end as it arrives (so the pooled connection is reused, as the
  library does), split the SSE events on blank lines and JSON-decode every ``data:`` frame
  (streaming), or JSON-decode the body (non-streaming). Headers are set once on the session,
  timeouts are the client's defaults. They decode with ``orjson``, like the library does, so
  the comparison measures governance, not JSON speed.
- ``governed-<engine>``: ``GatewayClient`` with the memory limiter and breaker, telemetry and
  cache off, on each HTTP engine (the default engine's row is marked).
- ``full-pipeline-sqlite``: the full default pipeline (telemetry on SQLite, memory cache,
  structured layer, retry) on the default engine, every call a cache miss; the telemetry rows
  written are counted against the calls made (warm-up included).
- ``cache-hit``: one repeated prompt answered from the memory cache.
- ``--otel-callgrind [--few 40 --many 240 --repeat 3] [--otel-modes none,otel,...]``:
  instructions per governed call under callgrind with telemetry off, ``otel`` (the default
  with an endpoint: OTLP/HTTP to a loopback collector in its own process answering 200),
  ``otel-exporter`` (an SDK span exporter), ``otel-sdk`` (an application's SDK providers),
  ``sqlite`` and ``sqlite+otel`` (the fan-out); the difference of two run lengths cancels
  start-up, children run with a fixed hash seed, and each mode is the median of ``--repeat``
  such pairs. Budget: otel at most 15% more per call.
- ``--otel-wall [--calls 200 --rounds 5]``: wall time per call with the default recorder
  against a healthy collector, one answering 500, and one that never answers, interleaved;
  median paired ratios against the healthy one.
- ``governed-openai-sdk``, ``governed-openai-sdk-aiohttp``: the governed client (as
  ``governed-<engine>``) on the ``openai-sdk`` transport (plugin pgw-openai-sdk), on the SDK's
  httpx2 and aiohttp HTTP clients; ``openai-sdk``: the bare ``AsyncOpenAI`` client (retries
  off), iterating its chunk objects or parsing its completion object.
- ``governed-anthropic``: the governed client on the ``anthropic`` transport (plugin
  pgw-anthropic, default engine) against the fake's Messages route; ``anthropic-sdk``: the bare
  ``AsyncAnthropic`` client on the same route (raw stream events, or the message object).
  Their "vs own raw" column compares ``governed-anthropic`` with ``anthropic-sdk``: below 1 the
  whole governed call costs less CPU than the SDK alone.

Each measurement builds its client, warms it up at the measured concurrency (a full connection
pool), times a short calibration batch, collects the set-up garbage, then times as many calls
as fit in about ``--seconds`` of wall time (at most ``--calls``; an eighth of that at
concurrency 1), so a slow client does not take minutes and a fast one is timed long enough.
Every point is measured ``--rounds`` times with the clients interleaved (the order rotates each
round) and the median is reported: these machines are shared and noisy, and interleaving
spreads load changes over every client alike. The budget ratios are paired: each round's
governed measurement is divided by the same round's raw aiohttp measurement (seconds apart),
and the median of those ratios is the verdict. The budgets are checked at the
end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

MESSAGES = [{"role": "user", "content": "Say hello in twenty small pieces."}]
MODEL = "bench-model"
WARMUP_CALLS = 20
ENGINES = ("aiohttp", "httpx", "httpx-aiohttp", "httpx2", "httptools")
RAW_CLIENTS = ("aiohttp", "httpx", "httpx2")

Measure = Callable[[], Awaitable[tuple[float, float, str]]]


@dataclass
class Row:
    client: str
    mode: str
    concurrency: int
    calls: int
    calls_per_s: float
    cpu_us_per_call: float
    note: str = ""
    spread: str = ""
    cpu_by_round: tuple[float | None, ...] = ()
    """CPU µs/call of each round (None: not measured in that round), for paired ratios."""
    rate_by_round: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class Load:
    """How much to measure at one point."""

    calls: int
    """At most this many timed calls."""
    concurrency: int
    target_s: float
    """Wall time the timed batch aims at."""


def default_engine() -> str:
    from polygateway.transports.engines import DEFAULT_ENGINE

    return DEFAULT_ENGINE


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_upstream(port: int, chunks: int, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """``pgw fake-upstream`` in its own process (``extra``: more of its arguments)."""
    cmd = [
        sys.executable,
        "-m",
        "polygateway",
        "fake-upstream",
        "--port",
        str(port),
        "--chunks",
        str(chunks),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_listening(proc, port)
    return proc


def wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    """Return once ``proc`` accepts connections on ``port``; its error if it exits first."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else "died"
                raise RuntimeError(err) from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the upstream on port {port} did not start")


def body(stream: bool) -> bytes:
    payload: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return orjson.dumps(payload)


class SSEConsumer:
    """The minimal work a raw client does on a stream: split the events on blank lines,
    decode every ``data:`` frame, keep the content deltas. ``done`` turns true at ``[DONE]``."""

    __slots__ = ("_buf", "done", "parts")

    def __init__(self) -> None:
        self._buf = b""
        self.done = False
        self.parts: list[str] = []

    def feed(self, chunk: bytes) -> None:
        *events, self._buf = (self._buf + chunk).split(b"\n\n")
        for event in events:
            if self.done or not event.startswith(b"data:"):
                continue
            data = event[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            frame = orjson.loads(data)
            for choice in frame.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    self.parts.append(piece)


def warmup_calls(concurrency: int) -> int:
    """Calls made before the timing: enough to open ``concurrency`` pooled connections."""
    return max(WARMUP_CALLS, 2 * concurrency)


async def run_calls(call: Callable[[], Awaitable[None]], load: Load) -> tuple[float, float, int]:
    """Calls/s and CPU µs per call of a timed batch; also the calls made in all (warm-up
    and calibration included, for counting telemetry rows)."""

    async def worker(queue: Iterator[int]) -> None:
        for _ in queue:
            await call()

    async def batch(size: int) -> None:
        queue = iter(range(size))
        await asyncio.gather(*(worker(queue) for _ in range(load.concurrency)))

    # Warm up at the measured concurrency, so the timing sees the steady state (a full
    # connection pool, warm caches) for every client alike.
    warm = warmup_calls(load.concurrency)
    await batch(warm)
    # Calibrate: size the timed batch to about ``target_s`` of wall time.
    probe = max(load.concurrency, load.calls // 20)
    start = time.perf_counter()
    await batch(probe)
    rate = probe / max(time.perf_counter() - start, 1e-9)
    size = max(probe, min(load.calls, int(rate * load.target_s)))
    # Collect the garbage of the set-up (building a client allocates a lot) now, so that no
    # client pays a full collection of it inside its timing.
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await batch(size)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return size / wall, cpu / size * 1e6, warm + probe + size


HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}


async def bench_raw_aiohttp(url: str, stream: bool, load: Load) -> tuple[float, float, str]:
    import aiohttp

    data = body(stream)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=HEADERS) as session:

        async def call() -> None:
            async with session.post(f"{url}/chat/completions", data=data) as r:
                if stream:
                    # Read to the end of the body (like the library), so the connection is
                    # reused: stopping at [DONE] would discard it on some clients.
                    consumer = SSEConsumer()
                    async for chunk in r.content.iter_any():
                        consumer.feed(chunk)
                else:
                    orjson.loads(await r.read())

        rate, cpu, _ = await run_calls(call, load)
        return rate, cpu, ""


async def bench_raw_httpx_api(
    module_name: str, url: str, stream: bool, load: Load
) -> tuple[float, float, str]:
    import importlib

    api = importlib.import_module(module_name)
    data = body(stream)
    limits = api.Limits(max_connections=None, max_keepalive_connections=128)
    async with api.AsyncClient(limits=limits, timeout=60, headers=HEADERS) as client:

        async def call() -> None:
            if stream:
                async with client.stream("POST", f"{url}/chat/completions", content=data) as r:
                    consumer = SSEConsumer()
                    async for chunk in r.aiter_bytes():
                        consumer.feed(chunk)
            else:
                r = await client.post(f"{url}/chat/completions", content=data)
                orjson.loads(r.content)

        rate, cpu, _ = await run_calls(call, load)
        return rate, cpu, ""


def governed_env(
    url: str, engine: str, *, telemetry: str, cache: str, db: str, transport: str = ""
) -> dict[str, str]:
    plugin = {"openai-sdk": "pgw-openai-sdk", "anthropic": "pgw-anthropic"}.get(transport, "")
    # openai-sdk: ENGINE picks the SDK's own HTTP client (httpx2 or aiohttp).
    extra = {"LLM__OPENAI__1__TRANSPORT": transport} if transport else {}
    return extra | {
        "LLM__OPENAI__1__BASE_URL": url,
        "LLM__OPENAI__1__API_KEY": "sk-bench",
        "LLM__OPENAI__1__MODEL": MODEL,
        "LLM__OPENAI__1__ENGINE": engine,
        "LLM__OPENAI__1__TIMEOUT_S": "60",
        "LLM__GLOBAL__MAX_CONCURRENCY": "1000",
        "PGW_TELEMETRY_BACKEND": telemetry,
        "PGW_TELEMETRY_SQLITE_PATH": db,
        "PGW_CACHE_BACKEND": cache,
        "PGW_CACHE_NAMESPACE": "bench",
        "PGW_CACHE_TTL_S": "3600",
        "PGW_PLUGINS": plugin,
    }


async def bench_governed(
    url: str,
    stream: bool,
    load: Load,
    *,
    engine: str,
    telemetry: str = "none",
    cache: str = "none",
    cache_hits: bool = False,
    transport: str = "",
    deltas: bool = False,
) -> tuple[float, float, str]:
    from polygateway import GatewayClient

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        env = governed_env(
            url, engine, telemetry=telemetry, cache=cache, db=db, transport=transport
        )
        client = GatewayClient.from_env(env=env)
        counter = iter(range(10**9))
        try:

            async def call() -> None:
                # Distinct prompts miss the cache; one fixed prompt hits it.
                n = 0 if cache_hits else next(counter)
                messages = [{"role": "user", "content": f"Say hello #{n}"}]
                if deltas:  # client.stream: every delta handed to the caller
                    async with client.stream(messages) as deltas_of:
                        async for _ in deltas_of:
                            pass
                    return
                await client.chat(messages, stream=stream)

            rate, cpu, made = await run_calls(call, load)
        finally:
            await client.aclose()  # flushes the telemetry buffer (outside the timing)
        note = ""
        if telemetry == "sqlite":
            import sqlite3

            with closing(sqlite3.connect(db)) as conn:
                rows = conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0]
            note = f"telemetry rows {rows}/{made}" + ("" if rows == made else " LOST")
        return rate, cpu, note


async def bench_openai_sdk(url: str, stream: bool, load: Load) -> tuple[float, float, str]:
    import openai

    client = openai.AsyncOpenAI(api_key="sk-bench", base_url=url, max_retries=0, timeout=60)
    try:

        async def call() -> None:
            if stream:
                chunks = await client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for _ in chunks:
                    pass
            else:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]

        rate, cpu, _ = await run_calls(call, load)
        return rate, cpu, ""
    finally:
        await client.close()


async def bench_anthropic_sdk(url: str, stream: bool, load: Load) -> tuple[float, float, str]:
    import anthropic

    client = anthropic.AsyncAnthropic(
        api_key="sk-bench", base_url=url.removesuffix("/v1"), max_retries=0, timeout=60
    )
    try:

        async def call() -> None:
            if stream:
                events = await client.messages.create(
                    model=MODEL,
                    max_tokens=1024,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    stream=True,
                )
                async for _ in events:
                    pass
            else:
                await client.messages.create(model=MODEL, max_tokens=1024, messages=MESSAGES)  # type: ignore[arg-type]

        rate, cpu, _ = await run_calls(call, load)
        return rate, cpu, ""
    finally:
        await client.close()


def clients(url: str, stream: bool, load: Load) -> list[tuple[str, Measure]]:
    """(name, zero-arg coroutine factory) for every client measured at one point."""
    default = default_engine()
    out: list[tuple[str, Measure]] = [("aiohttp", partial(bench_raw_aiohttp, url, stream, load))]
    for module in RAW_CLIENTS[1:]:
        out.append((module, partial(bench_raw_httpx_api, module, url, stream, load)))
    for engine in ENGINES:
        governed = partial(bench_governed, url, stream, load, engine=engine)
        out.append((f"governed-{engine}", governed))
    full = partial(
        bench_governed, url, stream, load, engine=default, telemetry="sqlite", cache="memory"
    )
    out.append(("full-pipeline-sqlite", full))
    hit = partial(
        bench_governed, url, stream, load, engine=default, cache="memory", cache_hits=True
    )
    out.append(("cache-hit", hit))
    if stream:  # the caller-facing stream API against chat() on the same engine
        deltas = partial(bench_governed, url, stream, load, engine=default, deltas=True)
        out.append(("client-stream", deltas))
    # Plugin transports (rows appear when their distribution and SDK are installed).
    import importlib.util

    if importlib.util.find_spec("pgw_openai_sdk") is not None:
        out.append(("openai-sdk", partial(bench_openai_sdk, url, stream, load)))
        for http_client, name in (("httpx2", ""), ("aiohttp", "-aiohttp")):
            sdk = partial(
                bench_governed, url, stream, load, engine=http_client, transport="openai-sdk"
            )
            out.append((f"governed-openai-sdk{name}", sdk))
    if importlib.util.find_spec("pgw_anthropic") is not None:
        native = partial(bench_governed, url, stream, load, engine=default, transport="anthropic")
        out.append(("governed-anthropic", native))
        if importlib.util.find_spec("anthropic") is not None:
            out.append(("anthropic-sdk", partial(bench_anthropic_sdk, url, stream, load)))
    return out


def merge_notes(notes: list[str]) -> str:
    """One note for a row: telemetry row counts summed over the rounds, others once each."""
    written = expected = 0
    others: list[str] = []
    for note in notes:
        if note.startswith("telemetry rows "):
            counts = note.removeprefix("telemetry rows ").split()[0]
            got, _, want = counts.partition("/")
            written += int(got)
            expected += int(want)
        elif note and note not in others:
            others.append(note)
    if expected:
        lost = "" if written == expected else " LOST"
        others.insert(0, f"telemetry rows {written}/{expected}{lost}")
    return "; ".join(others)


async def measure_point(
    points: list[tuple[str, Measure]], mode: str, load: Load, rounds: int
) -> list[Row]:
    """Every client ``rounds`` times, interleaved (rotating the order each round); medians."""
    samples: dict[str, list[tuple[float, float, str] | None]] = {name: [] for name, _ in points}
    failed: dict[str, str] = {}
    for round_no in range(rounds):
        shift = round_no % len(points)
        for name, factory in points[shift:] + points[:shift]:
            if name in failed:
                samples[name].append(None)
                continue
            try:
                samples[name].append(await factory())
            except Exception as exc:  # a failing client is reported, not fatal
                failed[name] = f"FAILED: {exc!r}"[:200]
                samples[name].append(None)
    rows: list[Row] = []
    conc = load.concurrency
    for name, _ in points:
        got = [g for g in samples[name] if g is not None]
        if not got:
            rows.append(Row(name, mode, conc, load.calls, 0.0, 0.0, failed.get(name, "")))
            continue
        rates = [g[0] for g in got]
        cpus = [g[1] for g in got]
        note = merge_notes([g[2] for g in got] + ([failed[name]] if name in failed else []))
        row = Row(
            name,
            mode,
            conc,
            load.calls,
            statistics.median(rates),
            statistics.median(cpus),
            note,
            spread=f"{min(cpus):.0f}-{max(cpus):.0f}",
            cpu_by_round=tuple(g[1] if g else None for g in samples[name]),
            rate_by_round=tuple(g[0] if g else None for g in samples[name]),
        )
        print(
            f"{name:22} {mode:6} c={conc:<3} {row.calls_per_s:9.0f} calls/s "
            f"{row.cpu_us_per_call:8.0f} us CPU/call (CPU range {row.spread}) {row.note}",
            flush=True,
        )
        rows.append(row)
    return rows


async def main_async(args: argparse.Namespace) -> list[Row]:
    port = free_port()
    proc = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    rows: list[Row] = []
    only = set(args.only.split(",")) if args.only else None
    modes = args.modes.split(",")
    try:
        for stream in (True, False):
            mode = "stream" if stream else "json"
            if mode not in modes:
                continue
            for conc in (1, 64):
                calls = args.calls if conc > 1 else max(50, args.calls // 8)
                load = Load(calls, conc, args.seconds)
                points = [
                    (name, factory)
                    for name, factory in clients(url, stream, load)
                    if only is None or name in only
                ]
                rows += await measure_point(points, mode, load, args.rounds)
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


RAW_OF_ENGINE = {
    "aiohttp": "aiohttp",
    "httpx": "httpx",
    "httpx2": "httpx2",
    "openai-sdk": "openai-sdk",
    "openai-sdk-aiohttp": "openai-sdk",
    "anthropic": "anthropic-sdk",
}


def print_table(rows: list[Row]) -> None:
    base = {(r.mode, r.concurrency): r for r in rows if r.client == "aiohttp"}
    by_key = {(r.client, r.mode, r.concurrency): r for r in rows}
    default = default_engine()
    print()
    print(
        "| client | mode | conc | calls/s | CPU us/call | vs aiohttp calls/s | vs aiohttp CPU "
        "| vs own raw CPU | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get((r.mode, r.concurrency))
        rate = f"{r.calls_per_s / b.calls_per_s:.0%}" if b and b.calls_per_s else "-"
        cpu = f"{r.cpu_us_per_call / b.cpu_us_per_call:.2f}x" if b and b.cpu_us_per_call else "-"
        own = "-"
        engine = r.client.removeprefix("governed-")
        if r.client.startswith("governed-") and engine in RAW_OF_ENGINE:
            raw = by_key.get((RAW_OF_ENGINE[engine], r.mode, r.concurrency))
            if raw and raw.cpu_us_per_call:
                own = f"{r.cpu_us_per_call / raw.cpu_us_per_call:.2f}x"
        name = r.client + (" (default)" if r.client == f"governed-{default}" else "")
        print(
            f"| {name} | {r.mode} | {r.concurrency} | {r.calls_per_s:.0f} | "
            f"{r.cpu_us_per_call:.0f} | {rate} | {cpu} | {own} | {r.note} |"
        )


def paired(numerator: Row, denominator: Row, field: str) -> list[float]:
    """Per-round ratios of two clients measured in the same rounds (seconds apart)."""
    tops = getattr(numerator, field)
    bottoms = getattr(denominator, field)
    return [t / b for t, b in zip(tops, bottoms, strict=False) if t and b]


def describe(ratios: list[float], percent: bool) -> str:
    shown = [f"{r:.0%}" if percent else f"{r:.2f}x" for r in ratios]
    median = statistics.median(ratios)
    head = f"{median:.0%}" if percent else f"{median:.2f}x"
    return f"{head} (per round {' / '.join(shown)})"


def print_budgets(rows: list[Row]) -> None:
    """The governed and full-pipeline budgets on the default engine, against raw aiohttp: medians of
    the per-round paired ratios."""
    by_key = {(r.client, r.mode, r.concurrency): r for r in rows}
    governed = f"governed-{default_engine()}"
    print()
    print("Budgets (median of per-round paired ratios; default engine):")
    for mode in ("stream", "json"):
        raw = by_key.get(("aiohttp", mode, 64))
        gov = by_key.get((governed, mode, 64))
        full = by_key.get(("full-pipeline-sqlite", mode, 64))
        if raw and gov and (rates := paired(gov, raw, "rate_by_round")):
            verdict = "ok" if statistics.median(rates) >= 0.5 else "OVER BUDGET"
            text = describe(rates, percent=True)
            print(f"  {mode:6} c=64 governed calls/s >= 50% of raw aiohttp: {text} {verdict}")
        if raw and gov and (cpus := paired(gov, raw, "cpu_by_round")):
            verdict = "ok" if statistics.median(cpus) <= 1.5 else "OVER BUDGET"
            text = describe(cpus, percent=False)
            print(f"  {mode:6} c=64 governed CPU/call <= 1.5x raw aiohttp: {text} {verdict}")
        if raw and full and (rates := paired(full, raw, "rate_by_round")):
            ok = statistics.median(rates) >= 0.4 and "LOST" not in full.note
            print(
                f"  {mode:6} c=64 full pipeline calls/s >= 40% of raw aiohttp, no row lost: "
                f"{describe(rates, percent=True)} ({full.note}) {'ok' if ok else 'OVER BUDGET'}"
            )
        deltas = by_key.get(("client-stream", mode, 64))
        chat = by_key.get((f"governed-{default_engine()}", mode, 64))
        if deltas and chat and (cpus := paired(deltas, chat, "cpu_by_round")):
            verdict = "ok" if statistics.median(cpus) <= 1.10 else "OVER BUDGET"
            print(
                f"  {mode:6} c=64 client.stream CPU/call <= 1.10x chat(): "
                f"{describe(cpus, percent=False)} {verdict}"
            )
        for conc in (1, 64):
            hit = by_key.get(("cache-hit", mode, conc))
            if hit and hit.cpu_us_per_call:
                verdict = "ok" if hit.cpu_us_per_call < 50 else "OVER BUDGET"
                print(
                    f"  {mode:6} c={conc:<2} cache hit CPU < 50 us/call: "
                    f"{hit.cpu_us_per_call:.0f} us {verdict}"
                )


# --------------------------------------------------------------------------- otel on vs off

OTEL_BUDGET = 0.15
"""CPU (instructions) per governed call with the ``otel`` recorder, at most this much more."""


OTEL_MODES = (
    "none",
    "otel",
    "otel-exporter",
    "otel-sdk",
    "otel-failing",
    "otel-blackhole",
    "otel-null",
    "sqlite",
    "sqlite+otel",
)
"""``otel``: the default with an endpoint (the recorder's own OTLP/HTTP export of spans and
metrics to a loopback collector answering 200); ``otel-exporter``: spans to the SDK's
``OTLPSpanExporter`` (same collector) as ``ReadableSpan`` objects, metrics as ``otel``;
``otel-sdk``: an application's SDK providers (tracer with a batch span processor encoding
every batch, meter with a reader): the SDK's span and metric machinery on the call path;
``otel-failing``: the default against a collector answering 500; ``otel-blackhole``: against
one that never answers; ``otel-null``: the core's side alone (a recorder taking whole calls,
rows and governor decisions, that does nothing with them); ``sqlite``; ``sqlite+otel``: the
fan-out of ``sqlite`` and ``otel``."""


def _blackhole() -> tuple[socket.socket, str]:
    """A loopback server that accepts connections and never answers (a hung collector)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)  # kept open, never read from or answered

    import threading

    threading.Thread(target=accept, daemon=True).start()
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def collector_child(port: int) -> None:
    """An OTLP/HTTP collector on loopback: reads every POST, answers 200 (500 under
    ``/fail``); ``GET /stats``: requests and bytes received per path, as JSON."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    stats: dict[str, list[int]] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(size)
            seen = stats.setdefault(self.path, [0, 0])
            seen[0] += 1
            seen[1] += size
            self.send_response(500 if self.path.startswith("/fail") else 200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            payload = json.dumps(stats).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def start_collector() -> tuple[subprocess.Popen[bytes], str]:
    """``collector_child`` in its own process (its CPU is not the client's)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--collector-child", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("collector died") from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("collector did not start")


def collector_stats(collector: str) -> dict[str, list[int]]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{collector}/stats", timeout=10) as answer:
        found: dict[str, list[int]] = json.loads(answer.read())
        return found


def _otel_recorder(mode: str, sources: Any, collector: str) -> tuple[Any, list[Any]]:
    """The ``otel`` recorder of ``mode`` (see ``OTEL_MODES``) and SDK providers to shut down."""
    from pgw_otel import OtelOptions, OtelRecorder

    if mode == "otel-null":

        class Null(OtelRecorder):
            def ended(self, *args: Any, **kwargs: Any) -> None:
                pass

        return Null(), []
    if mode in ("otel", "sqlite+otel", "otel-failing", "otel-blackhole"):
        base = f"{collector}/fail" if mode == "otel-failing" else collector
        options = OtelOptions(endpoint=base, export_timeout_s=30.0)
        return OtelRecorder.from_options(options, sources=sources), []
    if mode == "otel-exporter":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from pgw_otel.otlp import OtlpHttp

        exporter = OTLPSpanExporter(endpoint=f"{collector}/v1/traces", timeout=30)
        metrics = OtlpHttp(f"{collector}/v1/metrics", {}, 30.0)
        resource = Resource.create({"service.name": "polygateway"})
        recorder = OtelRecorder(
            span_exporter=exporter, metric_exporter=metrics, resource=resource, sources=sources
        )
        return recorder, []
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Encoding(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(Encoding()))
    meter_provider = MeterProvider(
        metric_readers=[InMemoryMetricReader()], exemplar_filter=AlwaysOffExemplarFilter()
    )
    recorder = OtelRecorder(
        tracer_provider=tracer_provider, meter_provider=meter_provider, sources=sources
    )
    return recorder, [tracer_provider, meter_provider]


async def _otel_calls(mode: str, calls: int, url: str, collector: str = "") -> float:
    """``calls`` sequential governed calls (non-streaming and streaming alternately) with
    telemetry ``mode`` (see ``OTEL_MODES``); returns their wall seconds (set-up and shut-down
    excluded; under callgrind the shut-down's export is counted: it is the recorder's work)."""
    from polygateway import GatewayClient

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        sqlite_on = mode.startswith("sqlite")
        env = governed_env(
            url, default_engine(), telemetry="sqlite" if sqlite_on else "none", cache="none", db=db
        )
        injected: dict[str, Any] = {}
        owned: list[Any] = []
        otel: Any = None
        if "otel" in mode:
            probe = GatewayClient.from_env(env=env)
            sources = probe.settings.sources
            await probe.aclose()
            otel, owned = _otel_recorder(mode, sources, collector)
            if sqlite_on:
                from polygateway.telemetry.fanout import fanout
                from polygateway.telemetry.sqlite import SQLiteRecorder

                injected["telemetry"] = fanout({"sqlite": SQLiteRecorder(db), "otel": otel})
            else:
                injected["telemetry"] = otel
        client = GatewayClient.from_env(env=env, **injected)
        try:
            for n in range(3):  # connections up, code paths warm
                await client.chat([{"role": "user", "content": f"warm #{n}"}], stream=n % 2 == 1)
            started = time.perf_counter()
            for n in range(calls):
                messages = [{"role": "user", "content": f"Say hello #{n}"}]
                await client.chat(messages, stream=n % 2 == 1)
            elapsed = time.perf_counter() - started
        finally:
            await client.aclose()
            if mode != "otel-blackhole":  # closing waits for the hung export: not the call path
                if injected:
                    await injected["telemetry"].aclose()
                for provider in owned:
                    provider.shutdown()
        return elapsed


def otel_wall(calls: int, rounds: int) -> None:
    """Wall time per governed call with the default recorder against a healthy collector, one
    answering 500 and one that never answers, interleaved (the order rotates each round); the
    verdict is the median of each round's paired ratio against the healthy collector."""
    port = free_port()
    upstream = start_upstream(port, 20)
    url = f"http://127.0.0.1:{port}/v1"
    collector_proc, collector = start_collector()
    hole, hole_url = _blackhole()
    modes = ["otel", "otel-failing", "otel-blackhole"]
    per_call: dict[str, list[float]] = {mode: [] for mode in modes}
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    try:
        for round_ in range(rounds):
            order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
            for mode in order:
                target = hole_url if mode == "otel-blackhole" else collector
                seconds = asyncio.run(_otel_calls(mode, calls, url, target))
                per_call[mode].append(seconds / calls * 1e6)
    finally:
        upstream.kill()
        collector_proc.kill()
        hole.close()
    print(f"load average after: {os.getloadavg()}")
    for mode in modes:
        print(f"{mode:15s} wall us/call per round: " + " ".join(f"{v:.0f}" for v in per_call[mode]))
    for mode in modes[1:]:
        ratios = [a / b for a, b in zip(per_call[mode], per_call["otel"], strict=True)]
        print(
            f"{mode} vs otel: median ratio {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})"
        )


def _otel_instructions(mode: str, calls: int, url: str, collector: str) -> int:
    return callgrind_instructions(
        "--otel-child", mode, "--calls", str(calls), "--url", url, "--collector", collector
    )


def otel_callgrind(few: int, many: int, modes: Sequence[str], repeat: int) -> None:
    """Instructions per governed call under callgrind: (Ir(many) - Ir(few)) / (many - few), so
    start-up and imports cancel out; every mode against the same fake upstream and collector
    (callgrind counts every thread: the batch thread's encoding and HTTP export are in).
    Each mode is the median of ``repeat`` such pairs (children run with a fixed hash seed).
    Also what the collector received per mode (requests and bytes, all runs)."""
    port = free_port()
    upstream = start_upstream(port, 20)
    url = f"http://127.0.0.1:{port}/v1"
    collector_proc, collector = start_collector()
    per_call: dict[str, float] = {}
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    try:
        for mode in modes:
            before = collector_stats(collector)
            runs = []
            for _ in range(repeat):
                low = _otel_instructions(mode, few, url, collector)
                high = _otel_instructions(mode, many, url, collector)
                runs.append((high - low) / (many - few))
            after = collector_stats(collector)
            per_call[mode] = statistics.median(runs)
            received = {
                path: (seen[0] - before.get(path, [0, 0])[0], seen[1] - before.get(path, [0, 0])[1])
                for path, seen in after.items()
                if seen != before.get(path)
            }
            print(
                f"{mode:14s} per call {per_call[mode]:.0f} (median of "
                + ", ".join(f"{run:.0f}" for run in runs)
                + ")"
                + (f"  collector (requests, bytes): {received}" if received else ""),
                flush=True,
            )
    finally:
        upstream.kill()
        collector_proc.kill()
    print(f"load average after: {os.getloadavg()}")
    for on, off in (
        ("otel", "none"),
        ("otel-exporter", "none"),
        ("otel-sdk", "none"),
        ("sqlite+otel", "sqlite"),
    ):
        if on in per_call and off in per_call:
            extra = per_call[on] / per_call[off] - 1
            verdict = "ok" if extra <= OTEL_BUDGET else "OVER BUDGET"
            print(f"{on} vs {off}: {extra:+.1%} instructions per call ({verdict}, budget +15%)")


# --------------------------------------------------------------------------- callgrind mode

CALLGRIND_CLIENTS = ("chat", "client-stream")
"""``chat``: ``await client.chat(messages)`` (streamed from the upstream); ``client-stream``:
``async with client.stream(messages)`` with every delta handed to the caller. Both on the
default engine, telemetry and cache off (the ``governed-<engine>`` set-up)."""


async def callgrind_child(url: str, client_name: str, calls: int) -> None:
    """The measured process: warm-up, then ``calls`` sequential calls of one client."""
    from polygateway import GatewayClient

    env = governed_env(url, default_engine(), telemetry="none", cache="none", db="")
    client = GatewayClient.from_env(env=env)
    try:
        for n in range(WARMUP_CALLS + calls):
            if n == WARMUP_CALLS:
                # Start-up objects out of the collector's sight: an occasional full collection
                # over them would land in one run and not the other, swamping the difference.
                gc.collect()
                gc.freeze()
            messages = [{"role": "user", "content": f"Say hello #{n}"}]
            if client_name == "chat":
                await client.chat(messages)
                continue
            async with client.stream(messages) as deltas:
                async for _ in deltas:
                    pass
    finally:
        await client.aclose()


def callgrind_instructions(
    *child_args: str, script: str = __file__, env: Mapping[str, str] | None = None
) -> int:
    """Instructions (Ir) of one whole run of ``script`` (this one unless told; ``-c`` and code
    work too) with ``child_args`` under callgrind: the one runner of every callgrind mode here
    and in ``floor.py``. ``env`` defaults to this process's environment."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable,
                script,
                *child_args,
            ],
            capture_output=True,
            text=True,
            check=False,
            # A fixed hash seed: set and dict layouts (and so the instructions spent) are then the
            # same in every run, and two runs of one mode differ by noise, not by seed.
            env={**(os.environ if env is None else env), "PYTHONHASHSEED": "0"},
        )
    if done.returncode != 0:
        # The child's own output (its traceback), without valgrind's "==pid==" lines.
        # Short lines only: an unclosed aiohttp connector's repr lists every connection.
        own = "\n".join(
            line
            for line in done.stderr.splitlines()
            if not line.startswith("==") and len(line) < 400
        )
        raise RuntimeError(f"callgrind run failed (exit {done.returncode}): {own[-2000:]}")
    for line in done.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1].strip())
    raise RuntimeError(f"no callgrind total in: {done.stderr[-2000:]}")


def callgrind_main(args: argparse.Namespace) -> None:
    """Instructions per call of ``chat`` and ``client-stream``: each client runs in two
    processes under callgrind, with ``n`` and ``3n`` timed calls; the difference divided by
    ``2n`` is the per-call count, free of start-up and warm-up. Deterministic up to a few
    tenths of a percent (hash seeds, timers), unlike CPU time on a shared machine."""
    port = free_port()
    proc = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    n = args.callgrind_calls
    per_call: dict[str, float] = {}
    only = set(args.only.split(",")) if args.only else set(CALLGRIND_CLIENTS)
    try:
        for name in (name for name in CALLGRIND_CLIENTS if name in only):
            small = callgrind_instructions("--callgrind-child", f"{url},{name},{n}")
            large = callgrind_instructions("--callgrind-child", f"{url},{name},{3 * n}")
            per_call[name] = (large - small) / (2 * n)
            print(f"{name:14} {per_call[name]:12,.0f} instructions/call ({small:,} / {large:,})")
    finally:
        proc.terminate()
        proc.wait(10)
    if len(per_call) < len(CALLGRIND_CLIENTS):
        return
    ratio = per_call["client-stream"] / per_call["chat"]
    verdict = "within" if ratio <= 1.10 else "OVER"
    print(f"client.stream / chat: {ratio:.3f}x ({verdict} the 1.10x budget)")


def main() -> None:
    if "--collector-child" in sys.argv:
        collector_child(int(sys.argv[sys.argv.index("--collector-child") + 1]))
        return
    if {"--otel-child", "--otel-callgrind", "--otel-wall"} & set(sys.argv):
        otel = argparse.ArgumentParser()
        otel.add_argument("--otel-child", default="")
        otel.add_argument("--otel-callgrind", action="store_true")
        otel.add_argument("--calls", type=int, default=0)
        otel.add_argument("--url", default="")
        otel.add_argument("--collector", default="")
        otel.add_argument("--few", type=int, default=40)
        otel.add_argument("--many", type=int, default=240)
        otel.add_argument("--repeat", type=int, default=3)
        otel.add_argument(
            "--otel-modes", default="none,otel,otel-exporter,otel-sdk,sqlite,sqlite+otel"
        )
        otel.add_argument("--otel-wall", action="store_true")
        otel.add_argument("--rounds", type=int, default=5)
        found = otel.parse_args()
        if found.otel_child:
            asyncio.run(_otel_calls(found.otel_child, found.calls, found.url, found.collector))
        elif found.otel_wall:
            otel_wall(found.calls or 200, found.rounds)
        else:
            otel_callgrind(found.few, found.many, found.otel_modes.split(","), found.repeat)
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="wall time of each timed batch (about)"
    )
    parser.add_argument("--calls", type=int, default=20000, help="at most, per batch at c=64")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per stream")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point")
    parser.add_argument("--only", default="", help="comma list of client names")
    parser.add_argument("--modes", default="stream,json", help="stream,json or one of them")
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="instructions per call of chat() and client.stream under valgrind's callgrind",
    )
    parser.add_argument("--callgrind-calls", type=int, default=100, help="n (callgrind mode)")
    parser.add_argument("--callgrind-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.callgrind_child:
        url, name, calls = args.callgrind_child.rsplit(",", 2)
        asyncio.run(callgrind_child(url, name, int(calls)))
        return
    if args.callgrind:
        callgrind_main(args)
        return
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    rows = asyncio.run(main_async(args))
    print(f"load average after: {os.getloadavg()}")
    print_table(rows)
    print_budgets(rows)


if __name__ == "__main__":
    main()
