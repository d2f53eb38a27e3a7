"""Builders shared by the pgw-embedding tests."""

from __future__ import annotations

import asyncio
import base64
import sqlite3
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.clock import SystemClock
from polygateway.ports import Clock, GateDecision, GateState, GateUpdate
from polygateway.settings import (
    BackpressureSettings,
    CacheSettings,
    Limits,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.testing import FakeUpstream

API_KEY = "sk-embedtest-0123456789abcdefghij"


def embed_source(
    fake: FakeUpstream | None, name: str, *, base_url: str | None = None, **overrides: Any
) -> SourceConfig:
    """A source of the ``EMBED`` scope pointing at ``fake``'s ``/<name>/v1``."""
    values: dict[str, Any] = {
        "name": name,
        "provider": "openai",
        "base_url": base_url if base_url is not None else fake.base_url(name) if fake else "",
        "model": "text-embedding-3-small",
        "api_key": Secret(API_KEY),
        "scope": "EMBED",
        "timeout_s": 5.0,
        "est_tokens": 10,
    }
    values.update(overrides)
    return SourceConfig(**values)


def b64_floats(values: list[float]) -> str:
    """Little-endian float32 base64, as ``encoding_format="base64"`` answers."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Yield to the loop until ``predicate()`` holds (no fixed sleeps)."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (yields only; the condition lives in another thread)
            await asyncio.sleep(0)


@asynccontextmanager
async def http_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A loopback server answering every POST with ``handler``; yields ``http://.../v1``.

    For answers the fake upstream is not meant to give (redirects, hand-made bodies)."""
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- clients


def registry() -> Any:
    """The builtin plugin and this one only (fast, independent of what else is installed)."""
    import pgw_embedding
    from polygateway.plugins import load_registry

    return load_registry(autoload=False, extra_plugins=[("pgw-embedding", pgw_embedding)])


def embed_settings(
    fake: FakeUpstream | None,
    names: Sequence[str] = ("a", "b"),
    *,
    batch_size: int = 3,
    batch_concurrency: int = 1,
    max_attempts: int = 3,
    same_source_attempts: int = 1,
    quota_full: Literal["wait", "fail_fast"] = "wait",
    stall_window_s: float = 300.0,
    global_limits: Limits | None = None,
    base_url: str | None = None,
    **source_overrides: Any,
) -> ScopeSettings:
    """An ``EMBED`` scope over ``fake``'s sources ``names``, no backoff, telemetry off."""
    return ScopeSettings(
        scope="EMBED",
        sources=tuple(
            embed_source(fake, name, base_url=base_url, **source_overrides) for name in names
        ),
        retry=RetrySettings(
            max_attempts=max_attempts,
            base_delay_s=0.0,
            max_delay_s=0.0,
            same_source_attempts=same_source_attempts,
        ),
        backpressure=BackpressureSettings(
            quota_full=quota_full, stall_window_s=stall_window_s, poll_interval_s=0.5
        ),
        global_limits=global_limits or Limits(),
        cache=CacheSettings(backend="none"),
        telemetry=TelemetrySettings(backend="none"),
        batch_size=batch_size,
        batch_concurrency=batch_concurrency,
    )


class FirstSelector:
    """``SourceSelector`` that always takes the first runnable source (a primary and spares)."""

    def choose(self, sources: Sequence[SourceConfig], inflight: Mapping[str, int]) -> SourceConfig:
        return sources[0]


@dataclass
class RecordingGate:
    """``ProviderGate`` over an ``InMemoryGate`` that remembers every write-back."""

    inner: InMemoryGate
    writes: list[tuple[str, str]] = field(default_factory=list)
    """(method, source) in call order."""

    async def try_enter(self, source: str) -> GateDecision:
        return await self.inner.try_enter(source)

    async def record_success(self, decision: GateDecision) -> GateUpdate:
        self.writes.append(("success", decision.source))
        return await self.inner.record_success(decision)

    async def record_failure(
        self, decision: GateDecision, *, threshold: int | None = None, force_open: bool = False
    ) -> GateUpdate:
        self.writes.append(("force_open" if force_open else "failure", decision.source))
        return await self.inner.record_failure(decision, threshold=threshold, force_open=force_open)

    async def release_probe(self, decision: GateDecision) -> None:
        self.writes.append(("release_probe", decision.source))
        await self.inner.release_probe(decision)

    async def force_open(self, source: str) -> GateUpdate:
        self.writes.append(("force_open", source))
        return await self.inner.force_open(source)

    async def state(self, source: str) -> GateState:
        return await self.inner.state(source)

    async def retry_after_s(self, sources: Sequence[str]) -> float:
        return await self.inner.retry_after_s(sources)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def failures(self, source: str) -> int:
        return sum(1 for method, name in self.writes if name == source and method != "success")


def memory_gate(clock: Clock | None = None) -> RecordingGate:
    return RecordingGate(
        InMemoryGate(
            fail_threshold=5, cooldown_s=30.0, probe_ttl_s=60.0, clock=clock or SystemClock()
        )
    )


def memory_limiter(
    global_limits: Limits | None = None, clock: Clock | None = None
) -> InMemoryLimiter:
    return InMemoryLimiter(
        global_limits=global_limits or Limits(), lease_ttl_s=60.0, clock=clock or SystemClock()
    )


def read_rows(db: Path) -> list[dict[str, Any]]:
    """The telemetry rows of a SQLite database, oldest first."""
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM pgw_calls ORDER BY created_at, rowid")]
