"""Throughput of ``EmbeddingClient`` against raw aiohttp posting the same batches, one upstream.

    python tools/bench/embedding.py [--texts 10000] [--batch 64] [--dim 384]
                                    [--concurrency 1,8] [--rounds 5]

Starts ``pgw fake-upstream`` in its own process, then measures texts/s (wall) and client CPU
microseconds per text of embedding ``--texts`` short texts in batches of ``--batch``:

- ``raw-aiohttp``: one ``aiohttp.ClientSession``; posts each batch as the official SDK does
  (``encoding_format="base64"``), JSON-decodes the answer with ``orjson``, puts ``data[]`` back
  in input order by ``index`` and decodes each base64 vector into a list of floats: the
  minimal equivalent work, so the comparison measures governance, not decoding;
- ``governed``: ``EmbeddingClient.from_env`` (memory limiter and breaker, telemetry off, the
  default engine): input checks, one governed call per batch, the same decoding plus the
  vector checks;
- ``governed-sqlite``: the same with telemetry rows on SQLite (one row per batch; rows
  written are counted).

At each batch concurrency (``--concurrency``: 1 is the default, serial batches), every client
runs ``--rounds`` times, interleaved (the order rotates each round), each after a warm-up
call; medians are reported, and the budget (governed >= 85% of raw texts/s) is judged
on the median of the per-round paired ratios, as ``overhead.py`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import os
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import free_port, start_upstream

MODEL = "bench-embed"
BUDGET = 0.85

Run = Callable[[list[str]], Awaitable[str]]


@dataclass
class Sample:
    texts_per_s: float
    cpu_us_per_text: float
    note: str


def corpus(count: int) -> list[str]:
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota")
    return [f"{words[i % 9]} {words[(i * 7) % 9]} sentence {i}" for i in range(count)]


def start_embedding_upstream(port: int, dim: int) -> Any:
    return start_upstream(port, chunks=1, extra=("--embedding-dim", str(dim)))


# --------------------------------------------------------------------------- clients


async def raw_aiohttp(url: str, batch: int, concurrency: int) -> tuple[Run, Callable[[], Any]]:
    import aiohttp

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-bench"},
    )
    endpoint = f"{url}/embeddings"

    async def one(texts: list[str]) -> list[list[float]]:
        body = orjson.dumps({"model": MODEL, "input": texts, "encoding_format": "base64"})
        async with session.post(endpoint, data=body) as response:
            payload = orjson.loads(await response.read())
        out: list[list[float]] = [[]] * len(texts)
        for item in payload["data"]:
            values = array("f")
            values.frombytes(base64.b64decode(item["embedding"]))
            out[item["index"]] = values.tolist()
        return out

    async def run(texts: list[str]) -> str:
        batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded(chunk: list[str]) -> list[list[float]]:
            async with semaphore:
                return await one(chunk)

        results = await asyncio.gather(*(bounded(chunk) for chunk in batches))
        assert sum(map(len, results)) == len(texts)
        return ""

    return run, session.close


async def governed(
    url: str, batch: int, concurrency: int, *, db: str | None
) -> tuple[Run, Callable[[], Any]]:
    from pgw_embedding import EmbeddingClient

    env = {
        "EMBED__OPENAI__1__BASE_URL": url,
        "EMBED__OPENAI__1__API_KEY": "sk-bench",
        "EMBED__OPENAI__1__MODEL": MODEL,
        "EMBED__OPENAI__1__TIMEOUT_S": "60",
        "EMBED__BATCH_SIZE": str(batch),
        "EMBED__BATCH_CONCURRENCY": str(concurrency),
        "PGW_TELEMETRY_BACKEND": "sqlite" if db else "none",
        "PGW_TELEMETRY_SQLITE_PATH": db or "unused.db",
        "PGW_CACHE_BACKEND": "none",
    }
    client = EmbeddingClient.from_env(env=env)
    calls = 0

    async def run(texts: list[str]) -> str:
        nonlocal calls
        response = await client.embed(texts)
        assert len(response.vectors) == len(texts)
        calls += -(-len(texts) // batch)
        return ""

    async def close() -> str:
        await client.aclose()
        if not db:
            return ""
        import sqlite3

        with closing(sqlite3.connect(db)) as conn:
            rows = conn.execute("SELECT COUNT(*) FROM pgw_calls").fetchone()[0]
        return f"telemetry rows {rows}/{calls}" + ("" if rows == calls else " LOST")

    return run, close


Make = Callable[[], Awaitable[tuple[Run, Callable[[], Any]]]]


def clients_at(url: str, batch: int, concurrency: int, tmp: str) -> list[tuple[str, Make]]:
    """(name, client factory) of every client measured at one batch concurrency."""
    databases = (os.path.join(tmp, f"bench{n}.db") for n in range(10**6))
    return [
        ("raw-aiohttp", partial(raw_aiohttp, url, batch, concurrency)),
        ("governed", partial(governed, url, batch, concurrency, db=None)),
        ("governed-sqlite", lambda: governed(url, batch, concurrency, db=next(databases))),
    ]


# --------------------------------------------------------------------------- timing


async def measure(make: Make, texts: list[str]) -> Sample:
    run, close = await make()
    try:
        await run(texts[: max(64, len(texts) // 20)])  # warm up: connections, imports, caches
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await run(texts)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        note = await close()
    return Sample(len(texts) / wall, cpu / len(texts) * 1e6, note or "")


async def main_async(args: argparse.Namespace) -> bool:
    port = free_port()
    proc = start_embedding_upstream(port, args.dim)
    url = f"http://127.0.0.1:{port}/v1"
    texts = corpus(args.texts)
    ok = True
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                clients = clients_at(url, args.batch, concurrency, tmp)
                samples: dict[str, list[Sample]] = {name: [] for name, _ in clients}
                for round_no in range(args.rounds):
                    shift = round_no % len(clients)
                    for name, make in clients[shift:] + clients[:shift]:
                        samples[name].append(await measure(make, texts))
            raw = samples["raw-aiohttp"]
            for name, _ in clients:
                got = samples[name]
                rate = statistics.median(s.texts_per_s for s in got)
                cpu = statistics.median(s.cpu_us_per_text for s in got)
                ratios = [s.texts_per_s / r.texts_per_s for s, r in zip(got, raw, strict=True)]
                ratio = statistics.median(ratios)
                notes = sorted({s.note for s in got if s.note})
                print(
                    f"{name:16} batch={args.batch} conc={concurrency:<2} {rate:9.0f} texts/s "
                    f"{cpu:7.1f} us CPU/text  vs raw {ratio:6.1%} "
                    f"(rounds {min(ratios):.0%}-{max(ratios):.0%}) {'; '.join(notes)}",
                    flush=True,
                )
                if name == "governed":
                    verdict = "PASS" if ratio >= BUDGET else "FAIL"
                    ok = ok and ratio >= BUDGET
                    print(
                        f"budget: governed >= {BUDGET:.0%} of raw texts/s at concurrency "
                        f"{concurrency}: {ratio:.1%} {verdict}",
                        flush=True,
                    )
    finally:
        proc.terminate()
        proc.wait(10)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{args.texts} texts, batch {args.batch}, dim {args.dim}, rounds {args.rounds}; "
        f"Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return 0 if asyncio.run(main_async(args)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
