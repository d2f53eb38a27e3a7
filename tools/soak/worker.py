"""One soak worker process (started by run_soak.py; not meant to be run by hand).

    python tools/soak/worker.py SPEC.json

Builds the library's own clients from the spec's environment (``GatewayClient`` for LLM,
``EmbeddingClient`` for EMBED, ``OcrClient`` for OCR, all on the shared Redis limiter, breaker
and cache), runs ``concurrency`` call loops over the scenario's calls until its call budget is
spent or it is told to stop (SIGTERM/SIGINT: no new calls, in-flight ones finish), then closes
the clients (telemetry flushed) and writes:

- ``calls-<worker>.jsonl``: one line per finished call: tag, scenario, kind, start (wall),
  duration, outcome ``ok``/``error``, the error class, whether it is one of the library's
  classified errors, whether it ran past its deadline, tokens, cache hit, transport latency;
- ``worker-<worker>.json``: totals, CPU time, RSS samples, the telemetry recorder's counts;
- progress on stdout, one JSON line a second (the parent renders it).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
import time
from typing import Any

from corpus import Message, replay_messages
from pydantic import BaseModel
from scenarios import CallSpec, calls

HANG_SLACK_S = 10.0
BACKEND_DOWN_PAUSE_S = 0.2
"""How long a call loop waits after a call failed closed (GovernanceBackendError)."""


class Invoice(BaseModel):
    number: str
    total: float


def _rss_kib() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    return pages * (os.sysconf("SC_PAGE_SIZE") // 1024)


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name: str = spec["worker"]
        self.out_dir: str = spec["out_dir"]
        self.run_id: str = spec["run_id"]
        self.deadline_s: float = spec["call_deadline_s"]
        self.stop = asyncio.Event()
        self.budget = spec["budget_calls"]
        self.started = 0
        self.done = 0
        self.ok = 0
        self.errors = 0
        self.tokens = 0
        self.unclassified = 0
        self.hangs = 0
        self.rss: list[tuple[float, int]] = []
        self._calls_file = open(  # noqa: SIM115 (closed in run())
            os.path.join(self.out_dir, f"calls-{self.name}.jsonl"), "w", encoding="utf-8"
        )

    async def run(self) -> None:
        from pgw_embedding import EmbeddingClient
        from pgw_monkeyocr import OcrClient
        from pgw_monkeyocr.testing import make_png
        from polygateway import GatewayClient
        from polygateway.errors import PolyGatewayError

        self._classified: tuple[type[BaseException], ...] = (PolyGatewayError,)
        env = self.spec["env"]
        # One recorder of this worker's own for every client, so its drop count is readable.
        self.recorder: Any = None
        parts: dict[str, Any] = {}
        if self.spec.get("dsn"):
            from pgw_postgres.recorder import PostgresRecorder

            self.recorder = PostgresRecorder(
                self.spec["dsn"],
                command_timeout_s=2.0,
                acquire_timeout_s=2.0,
                connect_timeout_s=2.0,
                flush_interval_s=0.2,
            )
            parts["telemetry"] = self.recorder
        self.llm = GatewayClient.from_env("LLM", env=env, **parts)
        self.embed = EmbeddingClient.from_env("EMBED", env=env, **parts)
        self.ocr = OcrClient.from_env("OCR", env=env, **parts) if self.spec["ocr"] else None
        self.image = make_png(64, 48)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.stop.set)
        replay = replay_messages(self.spec["replay"]) if self.spec.get("replay") else None
        source = calls(
            self.spec["scenario"],
            self.name,
            self.spec["seed"],
            ocr_every=self.spec["ocr_every"],
            replay=replay,
        )
        t0 = time.monotonic()
        cpu0 = os.times()
        progress = asyncio.create_task(self._progress(t0))
        try:
            loops = [
                asyncio.create_task(self._loop(source)) for _ in range(self.spec["concurrency"])
            ]
            await asyncio.gather(*loops)
        finally:
            progress.cancel()
            elapsed = time.monotonic() - t0
            cpu1 = os.times()
            await self.llm.aclose()
            await self.embed.aclose()
            if self.ocr is not None:
                await self.ocr.aclose()
            if self.recorder is not None:
                await self.recorder.aclose()
            self._calls_file.close()
            self._summary(elapsed, (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system))

    async def _loop(self, source: Any) -> None:
        while not self.stop.is_set() and self.started < self.budget:
            self.started += 1
            spec: CallSpec = next(source)
            if await self._one(spec) == "GovernanceBackendError":
                # An application backs off while its governance backend is down; without the
                # pause a loop spends the whole call budget in the seconds of a Redis restart.
                await asyncio.sleep(BACKEND_DOWN_PAUSE_S)

    async def _one(self, spec: CallSpec) -> str | None:
        """One call, written to the calls file; its error class name, or None when ok."""
        start_wall = time.time()
        start = time.monotonic()
        record: dict[str, Any] = {
            "tag": spec.tag,
            "scenario": spec.scenario,
            "kind": spec.kind,
            "t": round(start_wall, 6),
            "tenant": spec.tenant if spec.repeat else None,
        }
        try:
            async with asyncio.timeout(self.deadline_s + HANG_SLACK_S):
                record |= await self._send(spec)
            record["outcome"] = "ok"
            self.ok += 1
        except TimeoutError as exc:
            if time.monotonic() - start >= self.deadline_s + HANG_SLACK_S - 0.01:
                record |= {"outcome": "error", "error": "hang", "classified": False, "hang": True}
                self.hangs += 1
            else:
                self._error(record, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._error(record, exc)
        record["dur"] = round(time.monotonic() - start, 6)
        self.done += 1
        self._calls_file.write(json.dumps(record) + "\n")
        error: str | None = record.get("error")
        return error

    def _error(self, record: dict[str, Any], exc: BaseException) -> None:
        classified = isinstance(exc, self._classified)
        record |= {
            "outcome": "error",
            "error": type(exc).__name__,
            "classified": classified,
            "reason": getattr(exc, "reason", None),
        }
        self.errors += 1
        if not classified:
            self.unclassified += 1
            record["detail"] = str(exc)[:300]

    async def _send(self, spec: CallSpec) -> dict[str, Any]:
        session = f"{self.run_id}:{self.name}"
        if spec.kind == "embed":
            vectors = await self.embed.embed(list(spec.texts), session_id=session)
            self.tokens += vectors.prompt_tokens
            return {"tokens": vectors.prompt_tokens, "source": vectors.source_name}
        if spec.kind == "ocr":
            assert self.ocr is not None
            await self.ocr.recognize_text(self.image, session_id=session)
            return {}
        namespace = f"{self.run_id}-{spec.tenant}" if spec.repeat else self.run_id
        messages: list[Message] = list(spec.messages)
        common: dict[str, Any] = {
            "session_id": session,
            "cache_namespace": namespace,
            "cache_salt": self.run_id,
            "max_tokens": spec.max_tokens,
        }
        if spec.kind == "stream":
            async with self.llm.stream(messages, **common) as deltas:
                async for _ in deltas:
                    pass
            resp = deltas.response
        else:
            resp = await self.llm.chat(
                messages, structured=Invoice if spec.structured else None, **common
            )
        tokens = resp.prompt_tokens + resp.completion_tokens
        if not resp.cache_hit:
            self.tokens += tokens
        return {
            "tokens": tokens,
            "source": resp.source_name,
            "cache_hit": resp.cache_hit,
            "latency_ms": resp.latency_ms,
        }

    async def _progress(self, t0: float) -> None:
        last = 0.0
        while True:
            now = time.monotonic()
            if now - last >= 5.0 or not self.rss:
                self.rss.append((round(now - t0, 1), _rss_kib()))
                last = now
            line = {
                "worker": self.name,
                "elapsed": round(now - t0, 1),
                "done": self.done,
                "ok": self.ok,
                "errors": self.errors,
                "tokens": self.tokens,
                "rss_kib": self.rss[-1][1],
            }
            print(json.dumps(line), flush=True)
            await asyncio.sleep(1.0)

    def _summary(self, elapsed: float, cpu_s: float) -> None:
        dropped = self.recorder.dropped if self.recorder is not None else None
        written = self.recorder.written if self.recorder is not None else None
        summary = {
            "worker": self.name,
            "pid": os.getpid(),
            "elapsed_s": elapsed,
            "cpu_s": cpu_s,
            "calls": self.done,
            "ok": self.ok,
            "errors": self.errors,
            "unclassified": self.unclassified,
            "hangs": self.hangs,
            "tokens": self.tokens,
            "rss_kib": self.rss,
            "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "telemetry_dropped": dropped,
            "telemetry_written": written,
        }
        path = os.path.join(self.out_dir, f"worker-{self.name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f)


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    asyncio.run(Worker(spec).run())


if __name__ == "__main__":
    main()
