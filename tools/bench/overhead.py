"""Overhead of the governed client against raw HTTP clients, in one run, against one upstream.

    python tools/bench/overhead.py [--calls 2000] [--chunks 20] [--only aiohttp,governed-aiohttp]

Starts ``pgw fake-upstream`` in its own process, then for every client (raw aiohttp, raw httpx,
the governed client on each HTTP engine, the full default pipeline with SQLite telemetry, the
cache-hit path) measures, at concurrency 1 and 64, streaming and not: calls/s (wall) and client
CPU microseconds per call (process time of this process / calls). Ratios are printed against
raw aiohttp measured in the same run: these machines are noisy, absolute numbers are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

MESSAGES = [{"role": "user", "content": "Say hello in twenty small pieces."}]
MODEL = "bench-model"


@dataclass
class Row:
    client: str
    mode: str
    concurrency: int
    calls: int
    calls_per_s: float
    cpu_us_per_call: float
    note: str = ""


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_upstream(port: int, chunks: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "polygateway",
        "fake-upstream",
        "--port",
        str(port),
        "--chunks",
        str(chunks),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else "died"
                raise RuntimeError(err) from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake upstream did not start")


def body(stream: bool) -> bytes:
    payload: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


def consume_sse_line(line: bytes, parts: list[str]) -> bool:
    """Minimal work a raw client must do: decode each data frame. True at [DONE]."""
    if not line.startswith(b"data:"):
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        return True
    chunk = json.loads(data)
    for choice in chunk.get("choices") or ():
        piece = choice.get("delta", {}).get("content")
        if piece:
            parts.append(piece)
    return False


async def run_calls(
    call: Callable[[], Awaitable[None]], calls: int, concurrency: int
) -> tuple[float, float]:
    queue = iter(range(calls))

    async def worker() -> None:
        for _ in queue:
            await call()

    for _ in range(min(20, calls)):  # warm connections and caches
        await call()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return calls / wall, cpu / calls * 1e6


async def bench_raw_aiohttp(url: str, stream: bool, calls: int, conc: int) -> tuple[float, float]:
    import aiohttp

    data = body(stream)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def call() -> None:
            async with session.post(f"{url}/chat/completions", data=data, headers=headers) as r:
                if stream:
                    parts: list[str] = []
                    async for line in r.content:
                        if consume_sse_line(line, parts):
                            break
                else:
                    await r.json()

        return await run_calls(call, calls, conc)


async def bench_raw_httpx(url: str, stream: bool, calls: int, conc: int) -> tuple[float, float]:
    import httpx

    data = body(stream)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=128)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def call() -> None:
            if stream:
                async with client.stream(
                    "POST", f"{url}/chat/completions", content=data, headers=headers
                ) as r:
                    parts: list[str] = []
                    async for line in r.aiter_lines():
                        if consume_sse_line(line.encode(), parts):
                            break
            else:
                r = await client.post(f"{url}/chat/completions", content=data, headers=headers)
                r.json()

        return await run_calls(call, calls, conc)


def governed_env(url: str, engine: str, *, telemetry: str, cache: str, db: str) -> dict[str, str]:
    return {
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
        "PGW_PLUGINS": "",
    }


async def bench_governed(
    url: str,
    stream: bool,
    calls: int,
    conc: int,
    *,
    engine: str,
    telemetry: str = "none",
    cache: str = "none",
    cache_hits: bool = False,
) -> tuple[float, float, str]:
    from polygateway import GatewayClient

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        env = governed_env(url, engine, telemetry=telemetry, cache=cache, db=db)
        client = GatewayClient.from_env(env=env)
        counter = iter(range(10**9))
        try:

            async def call() -> None:
                # Distinct prompts miss the cache; one fixed prompt hits it.
                n = 0 if cache_hits else next(counter)
                messages = [{"role": "user", "content": f"Say hello #{n}"}]
                await client.chat(messages, stream=stream)

            rate, cpu = await run_calls(call, calls, conc)
        finally:
            await client.aclose()
        note = ""
        if telemetry == "sqlite":
            import sqlite3

            with closing(sqlite3.connect(db)) as conn:
                rows = conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0]
            expected = calls + min(20, calls)
            note = f"telemetry rows {rows}/{expected}" + ("" if rows == expected else " LOST")
        return rate, cpu, note


def clients(url: str, stream: bool, calls: int, conc: int) -> list[tuple[str, Any]]:
    """(name, zero-arg coroutine factory) for every client measured at one point."""
    out: list[tuple[str, Any]] = [
        ("aiohttp", lambda: bench_raw_aiohttp(url, stream, calls, conc)),
        ("httpx", lambda: bench_raw_httpx(url, stream, calls, conc)),
    ]
    for engine in ("aiohttp", "httpx", "httpx-aiohttp"):
        out.append(
            (
                f"governed-{engine}",
                lambda e=engine: bench_governed(url, stream, calls, conc, engine=e),
            )
        )
    out.append(
        (
            "full-pipeline-sqlite",
            lambda: bench_governed(
                url, stream, calls, conc, engine="aiohttp", telemetry="sqlite", cache="memory"
            ),
        )
    )
    out.append(
        (
            "cache-hit",
            lambda: bench_governed(
                url, stream, calls, conc, engine="aiohttp", cache="memory", cache_hits=True
            ),
        )
    )
    return out


async def measure(name: str, factory: Any, mode: str, conc: int, calls: int) -> Row:
    try:
        rate, cpu, *rest = await factory()
    except Exception as exc:  # a failing engine is reported, not fatal
        return Row(name, mode, conc, calls, 0.0, 0.0, f"FAILED: {exc!r}")
    row = Row(name, mode, conc, calls, rate, cpu, rest[0] if rest else "")
    print(
        f"{name:22} {mode:6} c={conc:<3} {rate:9.0f} calls/s {cpu:8.0f} us CPU/call {row.note}",
        flush=True,
    )
    return row


async def main_async(args: argparse.Namespace) -> list[Row]:
    port = free_port()
    proc = start_upstream(port, args.chunks)
    url = f"http://127.0.0.1:{port}/v1"
    rows: list[Row] = []
    only = set(args.only.split(",")) if args.only else None
    try:
        for stream in (True, False):
            mode = "stream" if stream else "json"
            for conc in (1, 64):
                calls = args.calls if conc > 1 else max(50, args.calls // 8)
                for name, factory in clients(url, stream, calls, conc):
                    if only is None or name in only:
                        rows.append(await measure(name, factory, mode, conc, calls))
    finally:
        proc.terminate()
        proc.wait(10)
    return rows


def print_table(rows: list[Row]) -> None:
    base = {(r.mode, r.concurrency): r for r in rows if r.client == "aiohttp"}
    print()
    header = (
        "client",
        "mode",
        "conc",
        "calls/s",
        "CPU us/call",
        "vs aiohttp calls/s",
        "vs aiohttp CPU",
        "note",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get((r.mode, r.concurrency))
        rate = f"{r.calls_per_s / b.calls_per_s:.0%}" if b and b.calls_per_s else "-"
        cpu = f"{r.cpu_us_per_call / b.cpu_us_per_call:.2f}x" if b and b.cpu_us_per_call else "-"
        print(
            f"| {r.client} | {r.mode} | {r.concurrency} | {r.calls_per_s:.0f} | "
            f"{r.cpu_us_per_call:.0f} | {rate} | {cpu} | {r.note} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--only", default="", help="comma list of client names")
    args = parser.parse_args()
    print_table(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
