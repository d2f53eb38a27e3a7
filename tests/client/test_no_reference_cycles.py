"""A finished call leaves no reference cycles behind: everything it made is freed by reference
counting at once, not kept (with the engine's response, its headers and the call's context) for
the cyclic garbage collector. A cycle per call made the collector run every few dozen calls,
and each run walked all the calls in flight: about a tenth of a governed call's CPU."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from polygateway import GatewayClient
from polygateway.testing import FakeUpstream, Reply

# Not httpx: httpcore's own response stream and pool request refer to each other (40 objects a
# call, none of them this library's).
ENGINES = ["aiohttp", "httptools"]


def env_for(fake: FakeUpstream, engine: str, *, full: bool, db: Path) -> dict[str, str]:
    return {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("a"),
        "LLM__OPENAI__1__MODEL": "m",
        "LLM__OPENAI__1__ENGINE": engine,
        "PGW_PLUGINS": "",
        "PGW_TELEMETRY_BACKEND": "sqlite" if full else "none",
        "PGW_TELEMETRY_SQLITE_PATH": str(db),
        "PGW_CACHE_BACKEND": "memory" if full else "none",
        "PGW_CACHE_NAMESPACE": "cycles",
        "PGW_CACHE_TTL_S": "600",
    }


def closed_transports_parts(garbage: list[object]) -> set[int]:
    """The ids of the objects of ``garbage`` reachable from a closed asyncio socket transport.

    CPython's selector transport refers to itself (``_read_ready_cb`` is its own bound method),
    so every connection that is closed rather than pooled is one cycle of the standard
    library's; its protocol and buffers are already let go by then. A call left early closes
    its connection: those cycles are not this library's to break."""
    by_id = {id(obj): obj for obj in garbage}
    todo = [obj for obj in garbage if isinstance(obj, asyncio.Transport) and obj.is_closing()]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        todo.extend(by_id[id(ref)] for ref in gc.get_referents(obj) if id(ref) in by_id)
    return seen


async def left_in_cycles(
    call: Callable[[int], Awaitable[None]], counted: int, *, closes_connections: bool = False
) -> int:
    """Objects that ``counted`` calls (after 3 warm-up calls: connections, lazy imports,
    first-use caches) left for the cycle collector; ``closes_connections``: not counting the
    standard library's cycle of each closed connection (``closed_transports_parts``)."""
    for n in range(3):
        await call(n)
    gc.collect()
    for n in range(3, 3 + counted):
        await call(n)
    if not closes_connections:
        return gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    garbage, gc.garbage[:] = list(gc.garbage), []
    transports = closed_transports_parts(garbage)
    assert transports, "no connection was closed: the calls did not leave their streams early"
    left = sum(1 for obj in garbage if id(obj) not in transports)
    del garbage
    gc.collect()  # the saved cycles, freed now
    return left


@pytest.mark.parametrize("full", [False, True], ids=["governed", "full-pipeline"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_finished_calls_leave_nothing_for_the_cycle_collector(
    fake_upstream: FakeUpstream,
    collector_paused: None,
    tmp_path: Path,
    engine: str,
    stream: bool,
    full: bool,
) -> None:
    env = env_for(fake_upstream, engine, full=full, db=tmp_path / "t.db")
    async with GatewayClient.from_env(env=env) as client:

        async def call(n: int) -> None:
            # A new question each time: with the cache on, every call is a miss.
            resp = await client.chat([{"role": "user", "content": f"hello #{n}"}], stream=stream)
            assert resp.content

        left = await left_in_cycles(call, 20)
    assert left == 0, f"20 calls left {left} objects in reference cycles"


@pytest.mark.parametrize("engine", ENGINES)
async def test_finished_client_streams_leave_nothing_for_the_cycle_collector(
    fake_upstream: FakeUpstream, collector_paused: None, tmp_path: Path, engine: str
) -> None:
    env = env_for(fake_upstream, engine, full=True, db=tmp_path / "t.db")
    async with GatewayClient.from_env(env=env) as client:

        async def call(n: int) -> None:
            async with client.stream([{"role": "user", "content": f"hello #{n}"}]) as stream:
                texts = [delta.text async for delta in stream]
            assert "".join(texts) == stream.response.content

        left = await left_in_cycles(call, 20)
    assert left == 0, f"20 streams left {left} objects in reference cycles"


@pytest.mark.parametrize("deadline", [False, True], ids=["no-deadline", "call-deadline"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_call_retried_after_a_500_leaves_nothing_for_the_cycle_collector(
    fake_upstream: FakeUpstream, collector_paused: None, tmp_path: Path, engine: str, deadline: bool
) -> None:
    env = env_for(fake_upstream, engine, full=True, db=tmp_path / "t.db")
    env["LLM__RETRY__BASE_DELAY_S"] = "0.001"
    if deadline:
        env["LLM__RETRY__CALL_DEADLINE_S"] = "60"
    async with GatewayClient.from_env(env=env) as client:

        async def call(n: int) -> None:
            fake_upstream.script("a", Reply.error(500))  # then the default answer
            resp = await client.chat([{"role": "user", "content": f"hello #{n}"}])
            assert resp.content

        left = await left_in_cycles(call, 10)
    assert left == 0, f"10 retried calls left {left} objects in reference cycles"


class Boom(Exception):
    """The consumer's own failure, raised inside the stream's block."""


@pytest.mark.parametrize("leave", ["exception", "break", "cancelled"])
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stream_left_early_leaves_nothing_for_the_cycle_collector(
    fake_upstream: FakeUpstream, collector_paused: None, tmp_path: Path, engine: str, leave: str
) -> None:
    env = env_for(fake_upstream, engine, full=True, db=tmp_path / "t.db")
    async with GatewayClient.from_env(env=env) as client:

        async def consume(n: int, seen: list[str], first: asyncio.Event) -> None:
            async with client.stream([{"role": "user", "content": f"hello #{n}"}]) as stream:
                async for delta in stream:
                    seen.append(delta.text)
                    first.set()
                    if leave == "exception":
                        raise Boom
                    if leave == "break":
                        break

        async def call(n: int) -> None:
            # One chunk, then nothing: the call is still running when the consumer leaves.
            fake_upstream.script("a", Reply.stall(after_chunks=1))
            seen: list[str] = []
            first = asyncio.Event()
            if leave == "cancelled":
                consumer = asyncio.create_task(consume(n, seen, first))
                await first.wait()
                consumer.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await consumer
            else:
                with pytest.raises(Boom) if leave == "exception" else contextlib.nullcontext():
                    await consume(n, seen, first)
            assert seen == [seen[0]] and seen[0]

        left = await left_in_cycles(call, 20, closes_connections=True)
    assert left == 0, f"20 streams left early ({leave}) left {left} objects in reference cycles"


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stream_never_entered_leaves_nothing_for_the_cycle_collector(
    fake_upstream: FakeUpstream, collector_paused: None, tmp_path: Path, engine: str
) -> None:
    env = env_for(fake_upstream, engine, full=True, db=tmp_path / "t.db")
    async with GatewayClient.from_env(env=env) as client:

        async def call(n: int) -> None:
            stream = client.stream([{"role": "user", "content": f"hello #{n}"}])
            assert repr(stream) == "<ChatStream open shown=0>"
            del stream  # dropped without ``async with``: no call was made

        left = await left_in_cycles(call, 20)
        assert fake_upstream.requests("a") == 0
    assert left == 0, f"20 streams never entered left {left} objects in reference cycles"
