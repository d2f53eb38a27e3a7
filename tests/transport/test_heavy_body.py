"""A non-streamed body made mostly of structure (megabytes of small objects) never stops the
event loop: it is parsed in a worker thread that gives the GIL back (transports/json_body.py).

The long-string path (a 10 MB ``content``) is covered in tests/features/test_structured_hostile.py;
this is the other shape a hostile or verbose server can send: logprobs-like lists of objects.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from polygateway.client import GatewayClient
from polygateway.settings import (
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.transports.json_body import JsonBodyParser

TOKENS = 60_000
"""Logprob entries in the body: about 5 MB of structure, ~100 ms of one orjson parse."""

# A server in a process of its own, so making the body never competes with the test's loop.
SERVE_HEAVY = f"""
import asyncio, json
from aiohttp import web

top = [{{"token": "b", "logprob": -2.5}}]
entry = {{"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": top}}
body = json.dumps({{
    "id": "chatcmpl-heavy", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{{"index": 0, "finish_reason": "stop",
                 "message": {{"role": "assistant", "content": "heavy answer"}},
                 "logprobs": {{"content": [entry] * {TOKENS}}}}}],
    "usage": {{"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
}}).encode()

async def completions(request):
    await request.read()
    return web.Response(body=body, content_type="application/json")

async def main():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{{port}}/v1", flush=True)
    await asyncio.get_running_loop().create_future()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def heavy_url() -> Iterator[str]:
    with subprocess.Popen(
        [sys.executable, "-c", SERVE_HEAVY], stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None
        try:
            yield server.stdout.readline().strip()
        finally:
            server.terminate()
            server.wait(10)


def scope(base_url: str) -> ScopeSettings:
    source = SourceConfig(
        name="heavy", provider="generic", base_url=base_url, model="m", timeout_s=60.0
    )
    return ScopeSettings(
        scope="LLM",
        sources=(source,),
        retry=RetrySettings(max_attempts=1),
        cache=CacheSettings(backend="none"),
        telemetry=TelemetrySettings(backend="none"),
    )


async def test_a_body_of_megabytes_of_structure_never_blocks_the_loop(heavy_url: str) -> None:
    busy: list[float] = []

    async def tick() -> None:
        # The loop thread's own CPU time between ticks: a parse on the loop is one long gap of
        # it whatever the machine's load; a parse in a thread leaves each gap tiny.
        last = time.thread_time()
        while True:
            await asyncio.sleep(0.002)
            now = time.thread_time()
            busy.append(now - last)
            last = now

    async with GatewayClient(scope(heavy_url)) as client:
        ticker = asyncio.get_running_loop().create_task(tick())
        try:
            resp = await client.chat([{"role": "user", "content": "hi"}], stream=False)
        finally:
            ticker.cancel()
    assert resp.content == "heavy answer"
    assert resp.completion_tokens == 2
    # One orjson parse of this body on the loop costs ~100 ms of the loop thread's CPU.
    assert max(busy) < 0.030, f"the loop ran {1000 * max(busy):.0f} ms without a tick"


def test_the_parser_gives_the_same_document_on_both_paths() -> None:
    entry = b'{"token":"a","logprob":-0.25,"bytes":[97],"s":"' + b"\\u00e9\\n" * 3 + b'"}'
    body = b'{"choices":[{"logprobs":[' + b",".join([entry] * 8000) + b'],"x":"' + b"y" * 40_000
    body += b'"}]}'
    parser = JsonBodyParser()
    for start in range(0, len(body), 65536):
        parser.feed(body[start : start + 65536])
    assert parser.heavy
    parser.finish()
    import json

    assert parser.result() == json.loads(body)


def test_a_deeply_nested_heavy_body_is_a_value_error() -> None:
    body = b'{"pad":"' + b"p" * 300_000 + b'","deep":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    parser = JsonBodyParser()
    for start in range(0, len(body), 65536):
        parser.feed(body[start : start + 65536])
    assert parser.heavy
    parser.finish()
    with pytest.raises(ValueError, match=r"nested too deeply|recursion"):
        parser.result()
