"""Helpers of the pgw-redis suite (imported by its tests and conftest)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from polygateway.testing.services import free_port, reachable
from polygateway.testing.services import missing as shared_missing

__all__ = ["free_port", "reachable"]


def services_required() -> bool:
    return os.environ.get("PGW_REQUIRE_SERVICES") == "1"


def missing(message: str) -> NoReturn:
    shared_missing(message, required=services_required())


# --------------------------------------------------------------------------- own servers


def binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        missing("redis-server/redis-cli binaries are not installed")
    return server, cli


def _wait_for_port(port: int, process: subprocess.Popen[bytes], deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not reachable("127.0.0.1", port):
        if process.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on port {port} did not start")
        time.sleep(0.02)


@dataclass
class RedisServer:
    """A ``redis-server`` this suite runs itself: no persistence, stoppable, restartable."""

    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server, _ = binaries()
        self.process = subprocess.Popen(
            [
                server,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--enable-debug-command", "yes",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_for_port(self.port, self.process)

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        process.kill()
        process.wait(timeout=10)
        self.process = None
        # The port is closed once the process is gone (wait above): nothing else to wait on.


async def wait_until(
    condition: Callable[[], Awaitable[bool] | bool], timeout_s: float = 10.0, every_s: float = 0.02
) -> None:
    """Poll an async predicate until it holds (real expiry has no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(every_s)


async def scope_snapshot(client: Any, keys: list[str]) -> dict[str, Any]:
    """Type and content of each key (not its TTL, which moves by itself)."""
    snapshot: dict[str, Any] = {}
    for key in sorted(keys):
        kind = await client.type(key)
        if kind == "zset":
            snapshot[key] = ("zset", await client.zrange(key, 0, -1, withscores=True))
        elif kind == "hash":
            snapshot[key] = ("hash", await client.hgetall(key))
        elif kind == "string":
            snapshot[key] = ("string", await client.get(key))
        else:
            snapshot[key] = (kind, None)
    return snapshot


def gateway_settings(
    source_url: str,
    redis_url: str,
    scope: str,
    *,
    global_limits: Any = None,
    source_name: str = "a",
    **overrides: Any,
) -> Any:
    """One source on ``source_url``; limiter and breaker on Redis; cache and telemetry off."""
    from polygateway.settings import (
        BreakerSettings,
        CacheSettings,
        ComponentChoice,
        Limits,
        ScopeSettings,
        Secret,
        SourceConfig,
        TelemetrySettings,
    )

    values: dict[str, Any] = {
        "scope": scope,
        "sources": (
            SourceConfig(
                name=source_name,
                provider="openai",
                base_url=source_url,
                model="fake-model",
                api_key=Secret("sk-test"),
                scope=scope,
                timeout_s=30.0,
                est_tokens=10,
            ),
        ),
        "global_limits": global_limits if global_limits is not None else Limits(),
        "limiter": ComponentChoice("redis", {"url": redis_url}),
        "breaker_backend": ComponentChoice("redis", {"url": redis_url}),
        "breaker": BreakerSettings(fail_threshold=3, cooldown_s=30.0),
        "cache": CacheSettings(backend="none"),
        "telemetry": TelemetrySettings(backend="none"),
    }
    values.update(overrides)
    return ScopeSettings(**values)


class RedisProxy:
    """A TCP proxy in front of a real Redis, to put network faults between a client and it.

    Commands always reach Redis (and run there); what comes back can be held (a slow network:
    the client keeps its connection busy), dropped (the commands ran, the client never learns
    it), or cut (every open connection closed, as by a failover; ``refuse`` also closes new
    ones at once).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drop_replies = False
        self.refuse = False
        self.replies_dropped = asyncio.Event()
        self.replies_held = asyncio.Event()
        self._forwarding = asyncio.Event()
        self._forwarding.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def url(self, db: int = 0) -> str:
        assert self._server is not None
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/{db}"

    def hold_replies(self) -> None:
        self.replies_held.clear()
        self._forwarding.clear()

    def forward_replies(self) -> None:
        self._forwarding.set()

    def cut_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def aclose(self) -> None:
        self._forwarding.set()
        self.cut_connections()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, replies=False),
                self._pump(up_reader, writer, replies=True),
                return_exceptions=True,
            )
        finally:
            self._writers.difference_update((writer, up_writer))

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        try:
            while data := await source.read(65536):
                if replies and self.drop_replies:
                    self.replies_dropped.set()
                    continue
                if replies and not self._forwarding.is_set():
                    self.replies_held.set()
                    await self._forwarding.wait()
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()
