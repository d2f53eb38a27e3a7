"""Builders shared by the pgw-embedding tests."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from polygateway.settings import Secret, SourceConfig
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
