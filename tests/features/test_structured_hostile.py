"""Hostile structured output through GatewayClient and the fake upstream: huge or deeply nested
answers end in ``ResultInvalidError`` without blocking the event loop."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from polygateway.client import GatewayClient
from polygateway.errors import ResultInvalidError
from polygateway.middleware.structured import MAX_STRUCTURED_CHARS
from polygateway.settings import (
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.structured.json_repair import MAX_REPAIR_CHARS
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import LLMResponse
from pydantic import BaseModel

MESSAGES = [{"role": "user", "content": "Give me JSON."}]


class Answer(BaseModel):
    city: str


def scope(base_url: str, name: str) -> ScopeSettings:
    source = SourceConfig(
        name=name, provider="generic", base_url=base_url, model="m", timeout_s=30.0
    )
    return ScopeSettings(
        scope="LLM",
        sources=(source,),
        retry=RetrySettings(max_attempts=1),
        cache=CacheSettings(backend="none"),
        telemetry=TelemetrySettings(backend="none"),
        max_structured_retries=0,
    )


@pytest.fixture
async def client(fake_upstream: FakeUpstream) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(scope(fake_upstream.base_url("s"), "s")) as gateway:
        yield gateway


# A fake upstream in a process of its own: the bytes of a 10 MB answer are made without
# competing with the test's event loop for the interpreter.
SERVE_HOSTILE = """
import asyncio
from polygateway.testing import FakeUpstream, Reply

async def main():
    async with FakeUpstream(default_reply=Reply.flood(10_000_000, fill="{")) as fake:
        print(fake.base_url("huge"), flush=True)
        await asyncio.get_running_loop().create_future()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def hostile_url() -> Iterator[str]:
    with subprocess.Popen(
        [sys.executable, "-c", SERVE_HOSTILE], stdout=subprocess.PIPE, text=True
    ) as server:
        assert server.stdout is not None
        try:
            yield server.stdout.readline().strip()
        finally:
            server.terminate()
            server.wait(10)


def weighted_p99_ms(gaps: list[float], period_s: float) -> float:
    """p99 of the gaps, each gap of g seconds counted g / period times: a loop blocked for a
    second cannot hide in one sample."""
    samples: list[float] = []
    for gap in gaps:
        samples += [gap] * max(1, round(gap / period_s))
    samples.sort()
    return 1000 * samples[int(0.99 * (len(samples) - 1))]


class LagProbe:
    """Ticks every ``period_s`` on the loop and keeps each gap between ticks twice: in wall
    time (the lag other calls see) and in the loop thread's CPU time (how long the loop ran
    without letting anything else run, whatever else the machine is doing)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.gaps: list[float] = []
        self.busy: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(self.period_s)
            now, cpu = time.perf_counter(), time.thread_time()
            self.gaps.append(now - last)
            self.busy.append(cpu - last_cpu)
            last, last_cpu = now, cpu

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def max_gap_ms(self) -> float:
        return 1000 * max(self.gaps)

    def p99_ms(self) -> float:
        return weighted_p99_ms(self.gaps, self.period_s)

    def busy_p99_ms(self) -> float:
        return weighted_p99_ms(self.busy, self.period_s)


async def other_calls(client: GatewayClient, until: Callable[[], bool]) -> list[LLMResponse]:
    """Small structured calls one after the other until ``until()`` (at least five): the load
    every phase of a lag measurement carries."""
    answers: list[LLMResponse] = []
    while not until() or len(answers) < 5:
        answers.append(await client.chat(MESSAGES, structured=Answer))
    return answers


async def measured(work: Awaitable[list[LLMResponse]]) -> tuple[LagProbe, float]:
    """The lag probe over ``work`` (with a tick's worth of margin on both sides: the gap a
    last long step leaves is only seen by the tick after it) and how long it took."""
    with LagProbe() as probe:
        await asyncio.sleep(0.02)
        started = time.perf_counter()
        answers = await work
        elapsed = time.perf_counter() - started
        await asyncio.sleep(0.02)
    assert all(a.structured_data == Answer(city="Paris") for a in answers)
    return probe, elapsed


ADDED_P99_MS = 20.0
"""What a hostile call may add to the loop lag p99 of the same load without it."""
ABSOLUTE_P99_MS = 250.0
"""A bound no busy machine reaches while the loop really runs (one parse of the whole body on
the loop took tens of milliseconds; a synchronous repair of it, minutes)."""


TRIES = 3
"""A step that blocks the loop does so on every try; a machine busy with other work delays the
loop at random moments, seldom on every try: the best try is the one to judge."""


async def hostile_phase(
    client: GatewayClient, hostile: GatewayClient, stream: bool, structured: str | None
) -> tuple[asyncio.Task[LLMResponse], float, str]:
    """One try: the same load before, during and after a hostile call; what the call added to
    the loop lag p99 over the worse of the two phases around it, and the measurements."""
    deadline = time.perf_counter() + 0.4
    before, _ = await measured(other_calls(client, lambda: time.perf_counter() > deadline))
    # 10 MB of "{" in one answer: one parse of the body on the loop would stall it for tens
    # of milliseconds, a repair of it (json_repair) for minutes.
    huge = asyncio.create_task(
        hostile.chat(MESSAGES, structured=structured, stream=stream)  # type: ignore[call-overload]
    )
    during, elapsed = await measured(other_calls(client, huge.done))
    deadline = time.perf_counter() + elapsed
    after, _ = await measured(other_calls(client, lambda: time.perf_counter() > deadline))
    added = during.p99_ms() - max(before.p99_ms(), after.p99_ms())
    report = (
        f"loop lag p99 {during.p99_ms():.1f} ms (around it {before.p99_ms():.1f} / "
        f"{after.p99_ms():.1f} ms), CPU-time p99 {during.busy_p99_ms():.1f} ms, max gap "
        f"{during.max_gap_ms():.1f} ms over {elapsed:.2f} s, load {os.getloadavg()[0]:.1f}"
    )
    assert during.busy_p99_ms() < ADDED_P99_MS, report
    assert during.p99_ms() < ABSOLUTE_P99_MS, report
    return huge, added, report


@pytest.mark.parametrize("structured", ["json", None], ids=["json", "plain"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json-body"])
async def test_a_huge_hostile_answer_never_blocks_the_loop(
    client: GatewayClient,
    fake_upstream: FakeUpstream,
    hostile_url: str,
    stream: bool,
    structured: str | None,
) -> None:
    fake_upstream.set_default("s", Reply.ok('{"city": "Paris"}'))
    reports = []
    # What the suite has allocated so far is left out of the collector's full passes: late in
    # a long run one such pass over the whole test process took 0.4 s of the loop's CPU, which
    # says nothing of this call. Collections of what the calls allocate still count.
    gc.collect()
    gc.freeze()
    try:
        async with GatewayClient(scope(hostile_url, "huge")) as hostile:
            for _ in range(TRIES):
                huge, added, report = await hostile_phase(client, hostile, stream, structured)
                reports.append(report)
                if added < ADDED_P99_MS:
                    break
    finally:
        gc.unfreeze()
    assert added < ADDED_P99_MS, "; ".join(reports)
    if structured is None:
        answer = huge.result()
        assert len(answer.content) > 8_000_000
        assert set(answer.content) == {"{"}
    else:
        with pytest.raises(ResultInvalidError) as info:
            huge.result()
        assert f"> {MAX_STRUCTURED_CHARS}" in str(info.value)
        assert len(info.value.raw_text) > 8 * MAX_STRUCTURED_CHARS
        assert set(info.value.raw_text) == {"{"}


async def test_a_large_repair_runs_off_the_loop(
    client: GatewayClient, fake_upstream: FakeUpstream
) -> None:
    # Unterminated, just under the repair cap: json_repair takes a good fraction of a second.
    broken = '{"a": [1, 2, {"b": "' + "x" * (MAX_REPAIR_CHARS - 100)
    fake_upstream.script("s", Reply.ok(broken, chunks=4))
    with LagProbe() as probe:
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        repaired = await client.chat(MESSAGES, structured="json")
        elapsed = time.perf_counter() - started
    assert repaired.structured_data["a"][:2] == [1, 2]
    # On the loop the whole repair would be one gap of the loop thread's own CPU time; in a
    # worker thread the loop keeps ticking (between interpreter switches) and spends almost
    # no CPU per tick. CPU time, not wall time: a loaded machine stretches wall gaps anyway.
    busy_ms = 1000 * max(probe.busy)
    assert busy_ms < 100.0, f"the loop ran {busy_ms:.0f} ms without a tick in {elapsed:.2f} s"


def test_repairs_are_capped(fake_upstream: FakeUpstream) -> None:
    from polygateway.structured.json_repair import extract_json

    value, errors = extract_json('{"a": "' + "x" * MAX_REPAIR_CHARS)
    assert value is None
    assert (
        f"too large to repair ({MAX_REPAIR_CHARS + 7} characters > {MAX_REPAIR_CHARS})"
        in (errors[0])
    )


@pytest.mark.parametrize("schema", ["json", Answer], ids=["json", "model"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json-body"])
@pytest.mark.parametrize(
    "content",
    ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 5_000],
    ids=["deep-array", "deep-object", "deep-unclosed"],
)
async def test_deeply_nested_output_is_a_result_invalid_error(
    client: GatewayClient, fake_upstream: FakeUpstream, schema: object, stream: bool, content: str
) -> None:
    fake_upstream.script("s", Reply.ok(content))
    with pytest.raises(ResultInvalidError) as info:
        await client.chat(MESSAGES, structured=schema, stream=stream)  # type: ignore[arg-type]
    assert info.value.raw_text == content
    assert "nested too deeply" in str(info.value) or "repair" in str(info.value)
