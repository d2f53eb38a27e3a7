"""A plugin-made call kind on the public governor, through real HTTP (the fake upstream).

The test plugin below is what a third party writes for a new kind of call: an embedding
transport registered through ``pgw_register_embedding_transports``, and a tiny client that
runs each batch through ``polygateway.governance.Governor`` and writes one telemetry row per
attempt through ``polygateway.records`` (the row builder of the chat telemetry layer too).
It contains no attempt loop of its own: selection, cooldowns, the breaker, the limiter,
retries and cancellation are the governor's.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from polygateway import hookimpl
from polygateway.backends.memory.breaker import InMemoryGate
from polygateway.backends.memory.limiter import InMemoryLimiter
from polygateway.errors import AllSourcesExhausted
from polygateway.governance import Attempted, Governor, Outcome
from polygateway.plugins import Registry, load_registry
from polygateway.ports import EmbeddingTransport
from polygateway.records import AttemptRows, AttemptSummary, RowWriter
from polygateway.selectors import RoundRobinSelector
from polygateway.settings import (
    BackpressureSettings,
    BreakerSettings,
    Limits,
    RetrySettings,
    Secret,
    SourceConfig,
)
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeClock, FakeUpstream, Reply
from polygateway.transports.errors import error_for_status, wire_error
from polygateway.types import EmbeddingTransportResult

ROUTE = "embeddings"
TEXTS = ["alpha", "beta", "gamma"]

# --------------------------------------------------------------------------- the test plugin


class TinyEmbeddingTransport:
    """One batch to one source over HTTP; failures become the core's four error classes."""

    def __init__(self, source: SourceConfig) -> None:
        self._client = httpx.AsyncClient(timeout=source.timeout_s)

    async def embed(
        self, *, texts: list[str], source: SourceConfig, call_id: str
    ) -> EmbeddingTransportResult:
        try:
            response = await self._client.post(
                f"{source.base_url}/embeddings",
                json={"model": source.model, "input": texts},
                headers={"Authorization": f"Bearer {source.api_key.reveal()}"},
            )
        except httpx.TransportError as exc:
            raise wire_error(exc, timeout=False, source_name=source.name) from exc
        if response.status_code != 200:
            raise error_for_status(
                response.status_code, response.content, response.headers, source_name=source.name
            )
        data = response.json()
        vectors = [item["embedding"] for item in data["data"]]
        return EmbeddingTransportResult(
            vectors=vectors,
            dim=len(vectors[0]),
            prompt_tokens=int(data["usage"]["prompt_tokens"]),
            model=str(data.get("model", "")),
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class TinyEmbeddingPlugin:
    """What the plugin's entry point would name."""

    @hookimpl
    def pgw_register_embedding_transports(self, register: Any) -> None:
        register("tiny-embeddings", TinyEmbeddingTransport)


def summarise(result: EmbeddingTransportResult) -> AttemptSummary:
    """What a row says of a successful batch (its ``response`` column and usage)."""
    return AttemptSummary(
        content=f"{len(result.vectors)} vectors x {result.dim}",
        model=result.model,
        prompt_tokens=result.prompt_tokens,
    )


class TinyEmbeddings:
    """The call kind's client: transports from the registry, every batch governed."""

    def __init__(
        self,
        registry: Registry,
        sources: Sequence[SourceConfig],
        *,
        governor: Governor,
        rows: RowWriter,
    ) -> None:
        self.transports: dict[str, EmbeddingTransport] = {
            s.name: registry.get("embedding_transport", s.transport)(s) for s in sources
        }
        self.governor = governor
        self.rows = rows

    async def embed(self, texts: list[str]) -> Outcome[EmbeddingTransportResult]:
        async def attempt(source: SourceConfig, call_id: str) -> Attempted[Any]:
            result = await self.transports[source.name].embed(
                texts=texts, source=source, call_id=call_id
            )
            return Attempted(result, tokens=result.prompt_tokens)

        rows = AttemptRows(
            self.rows, messages=json.dumps([{"texts": len(texts)}]), summarise=summarise
        )
        return await self.governor.run(attempt, est_tokens=8 * len(texts), observer=rows)

    async def aclose(self) -> None:
        for transport in self.transports.values():
            await transport.aclose()


# --------------------------------------------------------------------------- the rig


class Rig:
    def __init__(self, fake: FakeUpstream, db: Path, names: Sequence[str]) -> None:
        self.fake = fake
        self.db = db
        self.clock = FakeClock()
        self.sources = [
            SourceConfig(
                name=name,
                provider="openai",
                base_url=fake.base_url(name),
                model="embed-model",
                api_key=Secret(f"sk-{name}"),
                timeout_s=10.0,
                transport="tiny-embeddings",
                est_tokens=10,
            )
            for name in names
        ]
        self.limiter = InMemoryLimiter(global_limits=Limits(), lease_ttl_s=60.0, clock=self.clock)
        self.breaker = InMemoryGate(
            fail_threshold=3, cooldown_s=30.0, probe_ttl_s=60.0, clock=self.clock
        )
        self.recorder = SQLiteRecorder(str(db))
        self.registry = load_registry(
            autoload=False, extra_plugins=[("pgw-tiny-embeddings", TinyEmbeddingPlugin())]
        )
        governor = Governor(
            sources=self.sources,
            limiter=self.limiter,
            breaker=self.breaker,
            selector=RoundRobinSelector(),
            retry=RetrySettings(max_attempts=3, base_delay_s=1.0, max_delay_s=10.0),
            breaker_settings=BreakerSettings(fail_threshold=3, cooldown_s=30.0),
            backpressure=BackpressureSettings(quota_full="fail_fast"),
            clock=self.clock,
        )
        self.client = TinyEmbeddings(
            self.registry,
            self.sources,
            governor=governor,
            rows=RowWriter(self.recorder, clock=self.clock),
        )

    async def rows(self) -> list[dict[str, Any]]:
        await self.recorder.flush()
        with closing(sqlite3.connect(self.db)) as conn:
            conn.row_factory = sqlite3.Row
            found = conn.execute("SELECT * FROM pgw_calls ORDER BY created_at, rowid").fetchall()
        return [dict(row) for row in found]

    def governor_cooling(self) -> dict[str, str]:
        """Source -> reason of what the governor's cooldown memo holds now."""
        cooling = self.client.governor.cooldowns.cooling([s.name for s in self.sources])
        return {name: reason for name, (_, reason) in cooling.items()}

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.recorder.aclose()


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


@pytest.fixture
async def rig(fake: FakeUpstream, tmp_path: Path) -> AsyncIterator[Rig]:
    made = Rig(fake, tmp_path / "rows.db", ["a", "b"])
    yield made
    await made.aclose()


def sources_of(rows: Sequence[dict[str, Any]]) -> Iterator[tuple[str, str | None]]:
    return ((row["source_name"], row["error"]) for row in rows)


# --------------------------------------------------------------------------- the tests


def test_the_plugin_registers_the_new_kind(rig: Rig) -> None:
    assert rig.registry.names("embedding_transport") == ["tiny-embeddings"]
    assert rig.registry.provider_of("embedding_transport", "tiny-embeddings") == (
        "pgw-tiny-embeddings"
    )
    [info] = [p for p in rig.registry.plugins if p.name == "pgw-tiny-embeddings"]
    assert info.provides == {"embedding_transport": ("tiny-embeddings",)}
    assert info.status == "loaded"


async def test_a_clean_call_settles_the_measured_tokens_and_writes_one_row(rig: Rig) -> None:
    outcome = await rig.client.embed(TEXTS)
    assert len(outcome.value.vectors) == 3 and outcome.attempts == 1
    assert rig.fake.received(outcome.source.name, route=ROUTE)[0].body["input"] == TEXTS
    stats = await rig.limiter.source_stats(outcome.source.name)
    assert stats.tpm_used == outcome.value.prompt_tokens != 8 * len(TEXTS)
    [row] = await rig.rows()
    assert (row["call_id"], row["source_name"], row["error"]) == (
        outcome.call_id,
        outcome.source.name,
        None,
    )
    assert row["response"] == f"3 vectors x {outcome.value.dim}"
    assert row["prompt_tokens"] == outcome.value.prompt_tokens
    assert row["model"] == "embed-model" and row["provider"] == "openai"


async def test_a_429_switches_source(rig: Rig) -> None:
    rig.fake.script("a", Reply.error(429, retry_after=5), route=ROUTE)
    outcome = await rig.client.embed(TEXTS)
    assert outcome.source.name == "b" and outcome.attempts == 2
    assert rig.fake.requests("a", route=ROUTE) == 1 and rig.fake.requests("b", route=ROUTE) == 1
    # Retry-After cooled "a" down for this client, with the reason kept.
    assert rig.governor_cooling() == {"a": "rate_limited"}
    assert await rig.breaker.state("a") == "closed"  # one failure, threshold 3
    rows = await rig.rows()
    assert list(sources_of(rows)) == [("a", "TransientError"), ("b", None)]
    assert rows[1]["call_id"] == outcome.call_id != rows[0]["call_id"]
    assert rows[0]["usage_source"] == "estimated" and rows[0]["prompt_tokens"] == 0


async def test_a_401_force_opens_the_breaker_and_switches_at_once(rig: Rig) -> None:
    rig.fake.script("a", Reply.error(401), route=ROUTE)
    started = rig.clock.monotonic()
    outcome = await rig.client.embed(TEXTS)
    assert outcome.source.name == "b" and outcome.attempts == 2
    assert rig.clock.monotonic() == started  # a dead source is switched at once, no backoff
    assert await rig.breaker.state("a") == "open"
    await rig.client.embed(TEXTS)  # the next call never asks the dead source
    assert rig.fake.requests("a", route=ROUTE) == 1 and rig.fake.requests("b", route=ROUTE) == 2
    rows = await rig.rows()
    assert list(sources_of(rows)) == [("a", "SourceDeadError"), ("b", None), ("b", None)]


async def test_every_source_failing_raises_with_the_reasons(rig: Rig) -> None:
    for name in ("a", "b"):
        rig.fake.set_default(name, Reply.error(503), route=ROUTE)
    with pytest.raises(AllSourcesExhausted) as info:
        await rig.client.embed(TEXTS)
    assert info.value.reason == "retry_exhausted"
    assert set(info.value.per_source_reasons) == {"a", "b"}
    rows = await rig.rows()
    assert len(rows) == 3 and all(row["error"] == "TransientError" for row in rows)
    assert await rig.limiter.inflight() == 0


async def test_a_cancelled_call_leaks_no_permit_and_no_probe(rig: Rig) -> None:
    await rig.breaker.force_open("a")
    rig.clock.advance(30.0)  # half-open: the next attempt on "a" is the probe
    rig.fake.script("a", Reply.black_hole(), route=ROUTE)
    task = asyncio.create_task(rig.client.embed(TEXTS))
    async with asyncio.timeout(5):
        while rig.fake.inflight("a", route=ROUTE) == 0:
            await asyncio.sleep(0)
    assert await rig.limiter.inflight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await rig.limiter.inflight() == 0  # the permit was released
    assert rig.client.governor.inflight == {"a": 0, "b": 0}
    decision = await rig.breaker.try_enter("a")  # the probe was handed back, not leaked
    assert decision.allowed and decision.is_probe
    await rig.breaker.release_probe(decision)
    [row] = await rig.rows()
    assert (row["source_name"], row["error"]) == ("a", "cancelled")
