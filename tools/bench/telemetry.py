"""Telemetry into PostgreSQL: rows/s through the recorder, and what it costs a governed call.

    python tools/bench/telemetry.py [--dsn URL] [--rows 50000] [--rounds 5] [--seconds 1.5]
                                    [--only rows,calls]

Needs pgw-postgres installed and a PostgreSQL server. Without ``--dsn`` it makes a database
of its own on the machine's server (``--admin-dsn``, default the local ``postgres`` user) and
drops it at the end. Two parts:

- ``rows``: ``--rows`` records written as fast as they come, measured from the first record
  to the end of ``flush()``, on an emptied table each time, every method ``--rounds`` times
  interleaved (medians): ``recorder`` (``PostgresRecorder``, batched: COPY into a temporary
  table + ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``), ``executemany`` (raw asyncpg,
  the same batches as one ``executemany`` of ``INSERT ... ON CONFLICT DO NOTHING`` each: the
  write path the recorder did not take), ``one-insert-per-row`` (raw asyncpg, one autocommit
  ``INSERT`` a row; a tenth of the rows). Besides rows/s: this process's CPU per row, and the
  server backend's CPU per row where ``/proc`` shows it (same host).
- ``calls``: governed streaming calls at concurrency 64 against ``pgw fake-upstream`` (as in
  ``overhead.py``), telemetry ``none`` vs ``postgres`` (cache off), with ``sqlite`` for
  reference (what the telemetry layer costs with the builtin recorder), interleaved rounds;
  the verdict is the median of the paired per-round ratios postgres/none. Rows written are
  counted against the calls made.

Budgets: the recorder sustains >= 10,000 rows/s; governed calls/s with PostgreSQL
telemetry >= 90% of telemetry off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import closing

import asyncpg
from overhead import Load, default_engine, free_port, governed_env, run_calls, start_upstream
from pgw_postgres import PostgresRecorder
from pgw_postgres.recorder import APPLICATION_NAME
from pgw_postgres.schema import SCHEMA, ensure_schema
from polygateway.testing.contracts.telemetry import sample_record

ROWS_BUDGET = 10_000
CALLS_BUDGET = 0.90
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu_s(pids: list[int]) -> float | None:
    """utime + stime of server processes (None when /proc does not show them)."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return None
    return total


async def backend_pids(conn: asyncpg.Connection, application: str | None) -> list[int]:
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND ($1::text IS NULL OR application_name = $1)",
        application,
    )
    return [r["pid"] for r in rows]


Result = tuple[float, float, float | None]  # rows/s, client us/row, server us/row


async def rows_recorder(dsn: str, rows: int) -> Result:
    recorder = PostgresRecorder(dsn)
    try:
        recorder.record_nowait(sample_record())  # open the pool and check the table first
        await recorder.flush()
        records = [sample_record() for _ in range(rows)]
        admin = await asyncpg.connect(dsn)
        try:
            pids = await backend_pids(admin, APPLICATION_NAME)
        finally:
            await admin.close()
        server0, cpu0, wall0 = backend_cpu_s(pids), time.process_time(), time.perf_counter()
        for start in range(0, rows, 500):
            for record in records[start : start + 500]:
                recorder.record_nowait(record)
            await asyncio.sleep(0)  # a producer that lets the writer run, like calls do
        await recorder.flush()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        server1 = backend_cpu_s(pids)
        assert recorder.written == rows + 1 and recorder.dropped == 0, recorder
    finally:
        await recorder.aclose()
    server = None if server0 is None or server1 is None else (server1 - server0) / rows * 1e6
    return rows / wall, cpu / rows * 1e6, server


async def rows_raw(dsn: str, rows: int, *, batched: bool) -> Result:
    count = rows if batched else max(500, rows // 10)
    values = [SCHEMA.row_of(sample_record()) for _ in range(count)]
    insert = SCHEMA.insert_row()
    conn = await asyncpg.connect(dsn)
    try:
        pids = [await conn.fetchval("SELECT pg_backend_pid()")]
        server0, cpu0, wall0 = backend_cpu_s(pids), time.process_time(), time.perf_counter()
        if batched:
            size = PostgresRecorder(dsn).options.batch_size
            for start in range(0, count, size):
                async with conn.transaction():
                    await conn.executemany(insert, values[start : start + size])
        else:
            for row in values:
                await conn.execute(insert, *row)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        server1 = backend_cpu_s(pids)
    finally:
        await conn.close()
    server = None if server0 is None or server1 is None else (server1 - server0) / count * 1e6
    return count / wall, cpu / count * 1e6, server


async def bench_rows(dsn: str, rows: int, rounds: int) -> dict[str, list[Result]]:
    methods: list[tuple[str, Callable[[], Awaitable[Result]]]] = [
        ("recorder", lambda: rows_recorder(dsn, rows)),
        ("executemany", lambda: rows_raw(dsn, rows, batched=True)),
        ("one-insert-per-row", lambda: rows_raw(dsn, rows, batched=False)),
    ]
    results: dict[str, list[Result]] = {name: [] for name, _ in methods}
    for round_no in range(rounds):
        shift = round_no % len(methods)
        for name, run in methods[shift:] + methods[:shift]:
            await truncate(dsn)
            results[name].append(await run())
            rate, cpu, server = results[name][-1]
            shown = "-" if server is None else f"{server:.1f}"
            print(
                f"  round {round_no + 1} {name:20} {rate:9.0f} rows/s  client {cpu:5.1f} us/row"
                f"  server {shown} us/row",
                flush=True,
            )
    return results


async def truncate(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await ensure_schema(conn, SCHEMA, command_timeout_s=60)
        await conn.execute(f"TRUNCATE {SCHEMA.table}")
    finally:
        await conn.close()


async def governed(url: str, dsn: str, telemetry: str, load: Load) -> tuple[float, float, str]:
    from polygateway import GatewayClient

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        env = governed_env(url, default_engine(), telemetry=telemetry, cache="none", db=db)
        if telemetry == "postgres":
            env.update(PGW_TELEMETRY_PG_DSN=dsn, PGW_PLUGINS="pgw-postgres")
            await truncate(dsn)
        client = GatewayClient.from_env(env=env)
        counter = iter(range(10**9))
        try:

            async def call() -> None:
                messages = [{"role": "user", "content": f"Say hello #{next(counter)}"}]
                await client.chat(messages, stream=True)

            rate, cpu, made = await run_calls(call, load)
        finally:
            await client.aclose()
        if telemetry == "none":
            return rate, cpu, ""
        stored = await count_stored(telemetry, dsn, db)
    return rate, cpu, f"rows {stored}/{made}" + ("" if stored == made else " LOST")


async def count_stored(telemetry: str, dsn: str, db: str) -> int:
    if telemetry == "sqlite":
        with closing(sqlite3.connect(db)) as sqlite:
            return int(sqlite.execute("SELECT count(*) FROM pgw_calls").fetchone()[0])
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(f"SELECT count(*) FROM {SCHEMA.table}"))
    finally:
        await conn.close()


VARIANTS = ("none", "sqlite", "postgres")
"""Telemetry off, the builtin SQLite recorder (for reference: what the telemetry layer itself
costs), the PostgreSQL recorder."""


async def bench_calls(dsn: str, args: argparse.Namespace) -> list[float]:
    port = free_port()
    proc = start_upstream(port, 20)
    url = f"http://127.0.0.1:{port}/v1"
    load = Load(args.calls, 64, args.seconds)
    ratios: list[float] = []
    added: list[float] = []  # this process's CPU per call, postgres minus off
    try:
        for round_no in range(args.rounds):
            shift = round_no % len(VARIANTS)
            got: dict[str, tuple[float, float, str]] = {}
            for telemetry in VARIANTS[shift:] + VARIANTS[:shift]:
                got[telemetry] = await governed(url, dsn, telemetry, load)
            ratios.append(got["postgres"][0] / got["none"][0])
            added.append(got["postgres"][1] - got["none"][1])
            shown = " | ".join(
                f"{name} {rate:6.0f} calls/s {cpu:4.0f} us CPU/call {note}".rstrip()
                for name, (rate, cpu, note) in got.items()
            )
            print(
                f"  round {round_no + 1}: {shown} | postgres/off {ratios[-1]:.0%}, "
                f"{added[-1]:+.0f} us CPU/call",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"  added CPU per call (this process): median {statistics.median(added):+.0f} us")
    return ratios


async def main_async(args: argparse.Namespace) -> int:
    dsn, made = args.dsn, None
    if dsn is None:
        made = f"pgw_bench_{uuid.uuid4().hex[:8]}"
        admin = await asyncpg.connect(args.admin_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{made}"')
        finally:
            await admin.close()
        dsn = f"{args.admin_dsn.rsplit('/', 1)[0]}/{made}"
    parts = set(args.only.split(","))
    verdicts = []
    try:
        if "rows" in parts:
            print(f"rows: {args.rows} records per method, {args.rounds} rounds", flush=True)
            results = await bench_rows(dsn, args.rows, args.rounds)
            print("\n| method | rows/s | client µs/row | server µs/row |\n|---|---|---|---|")
            for name, got in results.items():
                servers = [g[2] for g in got if g[2] is not None]
                server = f"{statistics.median(servers):.1f}" if servers else "-"
                print(
                    f"| {name} | {statistics.median(g[0] for g in got):.0f} | "
                    f"{statistics.median(g[1] for g in got):.1f} | {server} |"
                )
            rate = statistics.median(g[0] for g in results["recorder"])
            verdicts.append(
                f"recorder rows/s >= {ROWS_BUDGET}: {rate:.0f} "
                + ("ok" if rate >= ROWS_BUDGET else "MISSED")
            )
        if "calls" in parts:
            print(f"\ncalls: governed, streaming, c=64, {args.rounds} rounds", flush=True)
            ratios = await bench_calls(dsn, args)
            ratio = statistics.median(ratios)
            shown = " / ".join(f"{r:.0%}" for r in ratios)
            verdicts.append(
                f"governed calls/s with postgres telemetry >= {CALLS_BUDGET:.0%} of off: "
                f"{ratio:.0%} (per round {shown}) " + ("ok" if ratio >= CALLS_BUDGET else "MISSED")
            )
    finally:
        if made is not None:
            admin = await asyncpg.connect(args.admin_dsn)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{made}" WITH (FORCE)')
            finally:
                await admin.close()
    print("\nbudgets:")
    for line in verdicts:
        print(f"  {line}")
    return 0 if all(line.endswith("ok") for line in verdicts) else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dsn", help="a database to write into (default: a temporary one)")
    parser.add_argument("--admin-dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=50_000, help="records per rows method")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=1.5, help="timed batch of calls")
    parser.add_argument("--calls", type=int, default=20_000, help="at most, per timed batch")
    parser.add_argument("--only", default="rows,calls", help="rows,calls or one of them")
    args = parser.parse_args()
    print(f"nproc {os.cpu_count()}, load average {os.getloadavg()}", flush=True)
    code = asyncio.run(main_async(args))
    print(f"load average after: {os.getloadavg()}")
    sys.exit(code)


if __name__ == "__main__":
    main()
