"""The soak harness: K worker processes on one Redis, against fault-injecting fake upstreams.

    python tools/soak/run_soak.py --scenario P6 --workers 4 --duration 600
        [--budget-calls N] [--budget-tokens M] [--concurrency 16]
        [--redis-url redis://127.0.0.1:6379/15 --i-own-this-db]  (default: its own redis-server)
        [--telemetry-db DIR | --dsn postgresql://.../pgw_soak]  (default: SQLite per worker)
        [--drills kill,redis,postgres] [--global-rpm 600] [--healthy-only] [--no-cache]
        [--count-redis] [--replay TELEMETRY.db]

Starts ``pgw fake-upstream`` with the fleet's fault mix (``fleet.py``) and its arrivals log,
the fake MonkeyOCR (``fake_ocr.py``), then K real worker processes (``worker.py``), each
running the library's own ``GatewayClient``/``EmbeddingClient``/``OcrClient`` over the shared
Redis limiter, breaker and cache. ``cache_namespace`` and ``cache_salt`` are the run id. The
run stops at the first of: ``--duration``, the call budget (split between the workers), the
token budget (input + output, summed from the workers' progress), Ctrl-C (no new calls; calls
in flight finish; clients close and flush their telemetry). A progress line per worker every
5 s. Then it snapshots Redis and the fakes' counters into the run directory and runs
``scoreboard.py``, which writes ``tests/outputs/soak/<run_id>.md`` (+ ``.html``); the exit
status is 1 when an invariant is broken.

Redis: by default the harness starts a ``redis-server`` of its own on a free port (the Redis
restart drill needs one). ``--redis-url`` uses another one, but only with a database number in
the URL and ``--i-own-this-db``: the run starts with ``FLUSHDB`` of that database.

Drills (``--drills``, at 15/50/70% of the duration): ``kill`` SIGKILLs one worker (its leases
must expire, the others continue); ``redis`` stops the harness's redis-server for 3 s and
starts it again (calls fail closed during the gap, recover after); ``postgres`` (with
``--dsn``) cuts the telemetry connection for 5 s through a TCP proxy the harness owns (calls
are unaffected, the recorders count the rows they drop); the machine's PostgreSQL is never
stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fleet  # noqa: E402
from proxy import TcpProxy  # noqa: E402

OUTPUTS = os.path.join(ROOT, "tests", "outputs", "soak")
REDIS_GAP_S = 3.0
POSTGRES_GAP_S = 5.0
# The kill comes early: once a saturated RPM gate has admitted a minute's worth, no lease is
# held until the next minute, and the victim should die holding some.
DRILL_AT = {"kill": 0.15, "redis": 0.5, "postgres": 0.7}
LEASE_TTL_S = 10.0 + 30.0  # the OCR scope's longest timeout + 30 (the library's default)


def write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


def log_file(path: str) -> Any:
    """An append-mode log for a child process (it outlives this call: the child owns it)."""
    return open(path, "ab")


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_redis_url(url: str, owned: bool) -> int:
    """The database number of ``url``; ``SystemExit`` unless the URL names one and the
    caller said it owns it (the run flushes it)."""
    parts = urllib.parse.urlsplit(url)
    db = parts.path.strip("/")
    if not db.isdigit():
        raise SystemExit(
            f"--redis-url must name a dedicated database (e.g. redis://host:6379/15): the run "
            f"starts with FLUSHDB; got the path {parts.path!r}"
        )
    if not owned:
        raise SystemExit(
            f"--redis-url names database {db}: the run starts with FLUSHDB of it; pass "
            "--i-own-this-db to confirm nothing else uses it"
        )
    return int(db)


def redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)


class OwnRedis:
    """A redis-server of the harness's own (no persistence), restartable on its port."""

    def __init__(self, run_dir: str) -> None:
        self.port = free_port()
        self.run_dir = run_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: pass --redis-url")
        log = open(os.path.join(self.run_dir, "redis.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.run_dir,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if redis_client(self.url).ping():
                    return
            time.sleep(0.05)
        raise SystemExit("the harness's redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def start_server(
    command: list[str], log_path: str, what: str
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process that prints its base URL first; returns it with that URL."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file(log_path))
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http://"):
        raise SystemExit(f"{what} did not start (see {log_path})")
    return proc, line


def start_fake_upstream(run_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    sources = os.path.join(run_dir, "sources.json")
    write_json(sources, fleet.sources_file())
    command = [sys.executable, "-m", "polygateway", "fake-upstream", "--port", str(free_port())]
    command += ["--sources", sources, "--arrivals-log", os.path.join(run_dir, "arrivals.jsonl")]
    proc, url = start_server(
        command, os.path.join(run_dir, "fake-upstream.log"), "pgw fake-upstream"
    )
    return proc, url.removesuffix("/v1")


def start_fake_ocr(run_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    command = [sys.executable, os.path.join(HERE, "fake_ocr.py"), "--port", str(free_port())]
    command += ["--counters", os.path.join(run_dir, "ocr-counters.json")]
    return start_server(command, os.path.join(run_dir, "fake-ocr.log"), "the fake MonkeyOCR")


def fetch_counters(upstream: str, restart_max: bool = False) -> dict[str, Any]:
    url = f"{upstream}/_fake/counters" + ("?restart_max=1" if restart_max else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.load(response)
    data["at"] = time.time()
    return data


def commandstats(url: str) -> dict[str, int]:
    info = redis_client(url).info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def live_leases(url: str) -> int:
    """Lease ZSET members not yet expired (server time)."""
    r = redis_client(url)
    seconds, micros = r.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return sum(
        int(r.zcount(key, now_ms + 1, "+inf")) for key in r.scan_iter(match="*:lease", count=1000)
    )


def snapshot_redis(url: str) -> dict[str, Any]:
    """Every key with its type and TTL, lease ZSETs with their members, breaker hashes."""
    r = redis_client(url)
    seconds, micros = r.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    keys: list[dict[str, Any]] = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        entry: dict[str, Any] = {"key": key, "type": kind, "pttl": r.pttl(key)}
        if kind == "zset":
            entry["members"] = [[m, s] for m, s in r.zrange(key, 0, -1, withscores=True)]
        elif kind == "hash":
            entry["hash"] = r.hgetall(key)
        keys.append(entry)
    return {"now_ms": now_ms, "keys": keys}


@dataclass
class WorkerProc:
    name: str
    proc: asyncio.subprocess.Process
    last: dict[str, Any] = field(default_factory=dict)
    killed_at: float | None = None


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.run_id = f"{args.scenario}-{stamp}-{secrets.token_hex(2)}"
        self.run_dir = os.path.join(args.out, self.run_id)
        os.makedirs(self.run_dir)
        self.timeline: list[dict[str, Any]] = []
        self.workers: list[WorkerProc] = []
        self.stopping = asyncio.Event()
        self.stop_reason = ""
        self.ok_at_kill: int | None = None
        """Ok calls of the surviving workers when the kill drill struck."""
        self.counters_phases: list[dict[str, Any]] = []
        self.redis_round_trips: int | None = None

    def event(self, what: str, **extra: Any) -> None:
        entry = {"t": time.time(), "event": what, **extra}
        self.timeline.append(entry)
        print(f"soak: {what} {extra if extra else ''}", flush=True)

    def _survivors_ok(self) -> int:
        """Calls finished ok so far by the workers not killed (their last progress lines)."""
        return sum(int(w.last.get("ok", 0)) for w in self.workers if w.killed_at is None)

    def stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            self.stop_reason = reason
            self.event("stop", reason=reason)
            self.stopping.set()

    async def run(self) -> None:
        args = self.args
        own_redis: OwnRedis | None = None
        if args.redis_url:
            check_redis_url(args.redis_url, args.i_own_this_db)
            redis_url = args.redis_url
            if "redis" in args.drills:
                raise SystemExit("the redis drill restarts Redis: it needs the harness's own")
        else:
            own_redis = OwnRedis(self.run_dir)
            own_redis.start()
            redis_url = own_redis.url
        redis_client(redis_url).flushdb()
        admin_redis_url = redis_url  # the harness's own commands bypass the counting proxy
        redis_proxy: TcpProxy | None = None
        if args.count_redis:
            parts_r = urllib.parse.urlsplit(redis_url)
            redis_proxy = TcpProxy(parts_r.hostname or "127.0.0.1", parts_r.port or 6379)
            await redis_proxy.start()
            netloc_r = parts_r.netloc.rsplit("@", 1)
            host_r = f"127.0.0.1:{redis_proxy.port}"
            redis_url = urllib.parse.urlunsplit(
                parts_r._replace(netloc=f"{netloc_r[0]}@{host_r}" if len(netloc_r) == 2 else host_r)
            )
        proxy: TcpProxy | None = None
        telemetry: dict[str, str]
        dsn = None
        if args.dsn:
            parts = urllib.parse.urlsplit(args.dsn)
            proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
            await proxy.start()
            netloc = parts.netloc.rsplit("@", 1)
            host = f"127.0.0.1:{proxy.port}"
            netloc_new = f"{netloc[0]}@{host}" if len(netloc) == 2 else host
            dsn = urllib.parse.urlunsplit(parts._replace(netloc=netloc_new))
            telemetry = {"PGW_TELEMETRY_BACKEND": "postgres", "PGW_TELEMETRY_PG_DSN": dsn}
        elif "postgres" in args.drills:
            raise SystemExit("the postgres drill needs --dsn")
        else:
            telemetry = {"PGW_TELEMETRY_BACKEND": "sqlite"}
        pricing = os.path.join(self.run_dir, "pricing.json")
        write_json(pricing, fleet.PRICES)
        upstream_proc, upstream = start_fake_upstream(self.run_dir)
        ocr_proc, ocr_upstream = start_fake_ocr(self.run_dir)
        stats_before = commandstats(admin_redis_url)
        self.event("started", upstream=upstream, ocr=ocr_upstream, redis=redis_url)
        try:
            await self._run_workers(
                redis_url,
                admin_redis_url,
                upstream,
                ocr_upstream,
                telemetry,
                dsn,
                pricing,
                own_redis,
                proxy,
            )
        finally:
            killed = [w.killed_at for w in self.workers if w.killed_at is not None]
            if killed:
                wait = max(killed) + LEASE_TTL_S + 1.0 - time.time()
                if wait > 0:
                    self.event("waiting for the killed worker's leases to expire", s=round(wait))
                    await asyncio.sleep(wait)
            redis_ok = True
            try:
                snapshot = snapshot_redis(admin_redis_url)
                stats_after = commandstats(admin_redis_url)
            except Exception as exc:  # reported: the scoreboard fails invariant 3 on it
                redis_ok = False
                snapshot = {"error": repr(exc), "keys": []}
                stats_after = {}
            self.counters_phases.append(
                {"phase": "final", "checked": True, **fetch_counters(upstream)}
            )
            upstream_proc.send_signal(signal.SIGTERM)
            ocr_proc.send_signal(signal.SIGTERM)
            upstream_proc.wait(30)
            ocr_proc.wait(30)
            if own_redis is not None:
                own_redis.stop()
            if proxy is not None:
                await proxy.stop()
            if redis_proxy is not None:
                self.redis_round_trips = redis_proxy.client_reads
                await redis_proxy.stop()
            self._write_run_json(snapshot, stats_before, stats_after, redis_ok, dsn)

    async def _run_workers(
        self,
        redis_url: str,
        admin_redis_url: str,
        upstream: str,
        ocr_upstream: str,
        telemetry: dict[str, str],
        dsn: str | None,
        pricing: str,
        own_redis: OwnRedis | None,
        proxy: TcpProxy | None,
    ) -> None:
        args = self.args
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop, "interrupted")
        k = args.workers
        for i in range(k):
            name = f"w{i}"
            worker_telemetry = dict(telemetry)
            if not dsn:
                worker_telemetry["PGW_TELEMETRY_SQLITE_PATH"] = os.path.join(
                    args.telemetry_db or self.run_dir, f"telemetry-{self.run_id}-{name}.db"
                )
            env = fleet.client_env(
                upstream=upstream,
                ocr_upstream=ocr_upstream,
                redis_url=redis_url,
                telemetry=worker_telemetry,
                pricing_path=pricing,
                run_id=self.run_id,
                global_rpm=args.global_rpm,
                cache=not args.no_cache,
                healthy_only=args.healthy_only,
            )
            budget = args.budget_calls // k + (1 if i < args.budget_calls % k else 0)
            spec = {
                "worker": name,
                "run_id": self.run_id,
                "out_dir": self.run_dir,
                "scenario": args.scenario,
                "seed": args.seed,
                "concurrency": args.concurrency,
                "budget_calls": budget,
                "call_deadline_s": fleet.CALL_DEADLINE_S,
                "ocr": args.scenario == "P6" and not args.healthy_only,
                "ocr_every": 0 if args.healthy_only else 20,
                "env": env,
                "dsn": dsn,
                "telemetry_path": worker_telemetry.get("PGW_TELEMETRY_SQLITE_PATH"),
                "replay": args.replay,
            }
            path = os.path.join(self.run_dir, f"spec-{name}.json")
            write_json(path, spec)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                os.path.join(HERE, "worker.py"),
                path,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file(os.path.join(self.run_dir, f"worker-{name}.log")),
                start_new_session=True,  # Ctrl-C reaches the harness, which stops them in order
            )
            self.workers.append(WorkerProc(name, proc))
        self.t0 = time.time()
        readers = [asyncio.create_task(self._read(w)) for w in self.workers]
        tasks = [
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._show()),
            asyncio.create_task(self._drills(own_redis, proxy, upstream, admin_redis_url)),
        ]
        all_done: asyncio.Future[Any] = asyncio.gather(*(w.proc.wait() for w in self.workers))
        stopping: asyncio.Future[Any] = asyncio.create_task(self.stopping.wait())
        await asyncio.wait([all_done, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not self.stopping.is_set():
            self.stop("call budget spent")
        for w in self.workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        await all_done
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own_redis is not None and own_redis.proc is None:
            # The run ended during the Redis drill's gap: bring it back for the snapshot.
            await asyncio.to_thread(own_redis.start)
        await asyncio.gather(*readers, *tasks, return_exceptions=True)
        self._show_once()
        self.event("workers finished", codes={w.name: w.proc.returncode for w in self.workers})

    async def _read(self, w: WorkerProc) -> None:
        assert w.proc.stdout is not None
        while line := await w.proc.stdout.readline():
            with contextlib.suppress(ValueError):
                w.last = json.loads(line)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if time.time() - self.t0 >= self.args.duration:
                self.stop("duration reached")
            tokens = sum(w.last.get("tokens", 0) for w in self.workers)
            if tokens >= self.args.budget_tokens:
                self.stop(f"token budget reached ({tokens} >= {self.args.budget_tokens})")

    def _show_once(self) -> None:
        for w in self.workers:
            last = w.last
            elapsed = max(last.get("elapsed", 0.0), 1e-9)
            state = "killed" if w.killed_at else ("done" if w.proc.returncode is not None else "")
            print(
                f"  [{w.name}] {last.get('done', 0):6d} calls {last.get('ok', 0):6d} ok "
                f"{last.get('errors', 0):5d} err {last.get('done', 0) / elapsed:7.1f}/s "
                f"{last.get('tokens', 0):9d} tok rss {last.get('rss_kib', 0) // 1024} MiB {state}",
                flush=True,
            )

    async def _show(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            load = os.getloadavg()[0]
            print(f"soak: t={time.time() - self.t0:5.0f}s load {load:.1f}", flush=True)
            self._show_once()

    async def _at(self, fraction: float) -> bool:
        """Sleep until ``fraction`` of the duration; False when the run stopped first."""
        delay = self.t0 + fraction * self.args.duration - time.time()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, delay)):
                await self.stopping.wait()
        return not self.stopping.is_set()

    async def _drills(
        self, own_redis: OwnRedis | None, proxy: TcpProxy | None, upstream: str, redis_url: str
    ) -> None:
        for drill in sorted(self.args.drills, key=DRILL_AT.__getitem__):
            if not await self._at(DRILL_AT[drill]):
                return
            if drill == "kill":
                victim = self.workers[-1]
                if victim.proc.returncode is None:
                    # Kill while leases are held. A saturated RPM gate holds none until the
                    # next minute window, which any 60 s of a run reaches: wait for it, up to
                    # 80% of the duration.
                    give_up = self.t0 + 0.8 * self.args.duration
                    before = 0
                    while not self.stopping.is_set():
                        before = await asyncio.to_thread(live_leases, redis_url)
                        if before or time.time() >= give_up:
                            break
                        await asyncio.sleep(0.25)
                    victim.proc.kill()
                    victim.killed_at = time.time()
                    self.ok_at_kill = self._survivors_ok()
                    await victim.proc.wait()
                    after = await asyncio.to_thread(live_leases, redis_url)
                    self.event(
                        "drill kill -9",
                        worker=victim.name,
                        live_leases_before=before,
                        live_leases_after=after,
                    )
            elif drill == "redis" and own_redis is not None:
                # A restart right after the kill would hide whether the others went on (a
                # saturated RPM gate admits again only in the next minute window): wait for a
                # call of theirs finished since, up to 80% of the duration.
                give_up = self.t0 + 0.8 * self.args.duration
                while self.ok_at_kill is not None and not self.stopping.is_set():
                    if self._survivors_ok() > self.ok_at_kill or time.time() >= give_up:
                        break
                    await asyncio.sleep(0.25)
                phase = await asyncio.to_thread(fetch_counters, upstream, True)
                self.counters_phases.append(
                    {"phase": "before redis restart", "checked": True, **phase}
                )
                own_redis.stop()
                self.event("drill redis down")
                await asyncio.sleep(REDIS_GAP_S)
                await asyncio.to_thread(own_redis.start)
                self.event("drill redis up")
                # Calls admitted before the restart still hold upstream slots while the empty
                # Redis admits new ones (the restart clears governance state by design): that
                # transition is reported, not checked.
                await asyncio.sleep(fleet.TIMEOUT_S + 1.0)
                phase = await asyncio.to_thread(fetch_counters, upstream, True)
                self.counters_phases.append(
                    {"phase": "redis restart transition", "checked": False, **phase}
                )
            elif drill == "postgres" and proxy is not None:
                await proxy.stop()
                self.event("drill postgres down")
                await asyncio.sleep(POSTGRES_GAP_S)
                await proxy.start()
                self.event("drill postgres up")

    def _write_run_json(
        self,
        snapshot: dict[str, Any],
        before: dict[str, int],
        after: dict[str, int],
        redis_ok: bool,
        dsn: str | None,
    ) -> None:
        args = self.args
        run = {
            "run_id": self.run_id,
            "scenario": args.scenario,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "budget_calls": args.budget_calls,
            "budget_tokens": args.budget_tokens,
            "stop_reason": self.stop_reason,
            "started": self.t0,
            "ended": time.time(),
            "drills": args.drills,
            "timeline": self.timeline,
            "killed": [w.name for w in self.workers if w.killed_at is not None],
            "sources": fleet.source_table(),
            "healthy_only": args.healthy_only,
            "cache": not args.no_cache,
            "limits": {
                "global_concurrency": fleet.GLOBAL_CONCURRENCY,
                "global_rpm": args.global_rpm,
                "cooldown_s": fleet.COOLDOWN_S,
                "fail_threshold": fleet.FAIL_THRESHOLD,
                "call_deadline_s": fleet.CALL_DEADLINE_S,
                "timeout_s": fleet.TIMEOUT_S,
                "ttft_timeout_s": min(fleet.TTFT_TIMEOUT_S, fleet.TIMEOUT_S),
            },
            "prices": fleet.PRICES,
            "telemetry": {"kind": "postgres" if dsn else "sqlite", "dsn": bool(dsn)},
            "counters": self.counters_phases,
            "redis_ok": redis_ok,
            "redis_round_trips": self.redis_round_trips,
            "commandstats_before": before,
            "commandstats_after": after,
            "load_average": os.getloadavg(),
        }
        with open(os.path.join(self.run_dir, "run.json"), "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1)
        with open(os.path.join(self.run_dir, "redis-snapshot.json"), "w", encoding="utf-8") as f:
            json.dump(snapshot, f)
        if dsn:
            # The scoreboard reads Postgres directly (not through the proxy).
            with open(os.path.join(self.run_dir, "dsn.txt"), "w", encoding="utf-8") as f:
                f.write(args.dsn)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="PolyGateway soak harness", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=("P1", "P2", "P3", "P4", "P5", "P6"), default="P6")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=16, help="calls in flight per worker")
    parser.add_argument("--budget-calls", type=int, default=8000, help="calls in all")
    parser.add_argument(
        "--budget-tokens", type=int, default=200_000_000, help="input+output tokens in all"
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--redis-url", help="an external Redis: must name a database, e.g. /15")
    parser.add_argument("--i-own-this-db", action="store_true", help="allow FLUSHDB of it")
    parser.add_argument("--telemetry-db", help="directory of the per-worker SQLite files")
    parser.add_argument("--dsn", help="PostgreSQL telemetry instead (postgresql://.../db)")
    parser.add_argument("--drills", default="", help="comma list of kill, redis, postgres")
    parser.add_argument("--global-rpm", type=int, default=fleet.GLOBAL_RPM)
    parser.add_argument("--healthy-only", action="store_true", help="no faulty sources")
    parser.add_argument("--no-cache", action="store_true", help="cache backend none")
    parser.add_argument(
        "--count-redis",
        action="store_true",
        help="route the workers' Redis through a counting proxy (round trips per call)",
    )
    parser.add_argument("--out", default=OUTPUTS, help="reports directory")
    parser.add_argument(
        "--replay",
        metavar="DB",
        help="P1 prompts from an earlier run's SQLite telemetry (cache_salt=run_id keeps them "
        "from hitting what that run cached)",
    )
    args = parser.parse_args(argv)
    drills = [d for d in args.drills.split(",") if d]
    unknown = set(drills) - set(DRILL_AT)
    if unknown:
        parser.error(f"unknown drills {sorted(unknown)} (kill, redis, postgres)")
    args.drills = drills
    for name in ("workers", "concurrency", "budget_calls", "budget_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.duration > 0:
        parser.error("--duration must be > 0")
    if "kill" in drills and args.workers < 2:
        parser.error("the kill drill needs --workers >= 2 (the others must continue)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    harness = Harness(args)
    asyncio.run(harness.run())
    import scoreboard

    return scoreboard.main([harness.run_dir])


if __name__ == "__main__":
    sys.exit(main())
