"""Telemetry through GatewayClient and the fake upstream: one row per attempt, cache hit and
pre-attempt failure, all built by the single helper (ARCHITECTURE §7.8, D8; M2 §6)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
from features_helpers import (  # make_rig_fixture provides the make_rig fixture
    MESSAGES,
    PRICES,
    RigFactory,
    cost,
    make_rig_fixture,  # noqa: F401
    scope,
    source,
)
from polygateway.client import GatewayClient
from polygateway.errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    RequestRejectedError,
    StreamLivenessTimeout,
    TransientError,
)
from polygateway.middleware.telemetry import TelemetryMiddleware, build_telemetry_record
from polygateway.settings import BackpressureSettings, Limits, TelemetryContent, TelemetrySettings
from polygateway.testing import FakeClock, FakeUpstream, Reply
from polygateway.types import ChatRequest, LLMResponse, TelemetryRecord

FIELDS_18 = (
    "call_id", "parent_call_id", "session_id", "model", "provider", "source_name", "messages",
    "response", "thinking", "prompt_tokens", "completion_tokens", "usage_source", "latency_ms",
    "ttft_ms", "max_inter_token_ms", "cache_hit", "error", "cost",
)  # fmt: skip


async def test_success_row_has_every_field(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a",
        Reply.ok(
            content="Paris.",
            reasoning="The capital is Paris.",
            prompt_tokens=21,
            completion_tokens=5,
        ),
    )
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        response = await client.chat(MESSAGES, session_id="s-1", parent_call_id="step-7")
        (row,) = await rig.rows()
    extra = {"created_at", "scope", "cache_namespace", "params", "root_call_id"}
    assert set(FIELDS_18) | extra == set(row)
    assert (row["scope"], row["params"]) == ("LLM", "")
    assert row["root_call_id"] == row["call_id"]  # a call of one attempt
    assert row["call_id"] == response.call_id
    assert (row["session_id"], row["parent_call_id"]) == ("s-1", "step-7")
    assert (row["model"], row["provider"], row["source_name"]) == ("model-a", "generic", "a")
    assert json.loads(row["messages"]) == MESSAGES
    assert (row["response"], row["thinking"]) == ("Paris.", "The capital is Paris.")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (21, 5)
    assert row["usage_source"] == "measured"
    assert row["latency_ms"] == response.latency_ms
    assert row["ttft_ms"] == pytest.approx(response.ttft_ms)
    assert row["cache_hit"] == 0
    assert row["error"] is None
    assert row["cost"] == pytest.approx(cost(PRICES, "model-a", 21, 5))
    assert response.cost == pytest.approx(row["cost"])
    assert row["created_at"] > 1_600_000_000


async def test_each_attempt_is_a_row_with_its_error_class(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script(
        "a",
        Reply.error(503),
        Reply.reset(),
        Reply.ok(content="third time lucky", prompt_tokens=7, completion_tokens=3),
    )
    rig = make_rig(tmp_path, scope(fake_upstream, retry=_retries(3)))
    async with rig.client as client:
        response = await client.chat(MESSAGES, session_id="s-2")
        rows = await rig.rows()
    assert [r["error"] for r in rows] == ["TransientError", "TransientError", None]
    assert len({r["call_id"] for r in rows}) == 3
    assert rows[-1]["call_id"] == response.call_id
    # One call: every attempt names its first as the call's root.
    assert [r["root_call_id"] for r in rows] == [rows[0]["call_id"]] * 3
    for row in rows:
        assert (row["session_id"], row["source_name"], row["model"]) == ("s-2", "a", "model-a")
    for row in rows[:2]:
        # A failed attempt: no usage known, priced at zero tokens for a known model.
        assert (row["prompt_tokens"], row["completion_tokens"]) == (0, 0)
        assert row["usage_source"] == "estimated"
        assert row["response"] == ""
        assert row["cost"] == 0.0
    assert rows[-1]["cost"] == pytest.approx(cost(PRICES, "model-a", 7, 3))
    assert response.cost == pytest.approx(rows[-1]["cost"])


async def test_stream_liveness_timeout_is_recorded_by_its_class(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content="slow", first_token_delay=2.0))
    settings = scope(
        fake_upstream,
        source(fake_upstream, "a", ttft_timeout_s=0.1, inter_token_timeout_s=0.05),
        retry=_retries(1),
    )
    rig = make_rig(tmp_path, settings)
    async with rig.client as client:
        with pytest.raises(AllSourcesExhausted) as caught:
            await client.chat(MESSAGES)
        rows = await rig.rows()
    assert isinstance(caught.value.last_error, StreamLivenessTimeout)
    assert [r["error"] for r in rows] == ["StreamLivenessTimeout"]
    assert rows[0]["latency_ms"] >= 100


@pytest.mark.parametrize(
    ("reply", "raised", "recorded"),
    [
        (Reply.error(400), RequestRejectedError, "RequestRejectedError"),
        (Reply.error(401), AllSourcesExhausted, "SourceDeadError"),
        (Reply.error(500), AllSourcesExhausted, "TransientError"),
    ],
)
async def test_failed_calls_record_the_attempt_error(
    make_rig: RigFactory,
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    reply: Reply,
    raised: type[Exception],
    recorded: str,
) -> None:
    fake_upstream.set_default("a", reply)
    rig = make_rig(tmp_path, scope(fake_upstream, retry=_retries(1)))
    async with rig.client as client:
        with pytest.raises(raised):
            await client.chat(MESSAGES)
        rows = await rig.rows()
    assert [(r["error"], r["source_name"], r["model"]) for r in rows] == [
        (recorded, "a", "model-a")
    ]


async def test_error_before_any_attempt_is_one_row(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.breaker.force_open("a")
        with pytest.raises(CircuitOpenError):
            await client.chat(MESSAGES, session_id="s-3")
        with pytest.raises(RequestRejectedError):
            await client.chat([{"role": "user"}], session_id="s-3")  # no content
        rows = await rig.rows()
    assert fake_upstream.requests() == 0
    assert [r["error"] for r in rows] == ["CircuitOpenError", "RequestRejectedError"]
    for row in rows:
        assert (row["source_name"], row["provider"], row["model"]) == ("", "", "")
        assert row["session_id"] == "s-3"
        assert row["cost"] is None
        assert len(row["call_id"]) == 32
        assert row["root_call_id"] == row["call_id"]  # each refused call is a call of its own


async def test_cache_hit_row(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(content="Paris.", prompt_tokens=11, completion_tokens=2))
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        first = await client.chat(MESSAGES)
        hit = await client.chat(MESSAGES, session_id="s-4")
        rows = await rig.rows()
    assert [r["call_id"] for r in rows] == [first.call_id, hit.call_id]
    row = rows[1]
    assert row["cache_hit"] == 1
    assert row["latency_ms"] == 0
    assert row["cost"] == 0.0
    assert row["error"] is None
    assert row["session_id"] == "s-4"
    assert row["response"] == "Paris."
    assert (row["source_name"], row["model"]) == ("a", "model-a")
    assert row["ttft_ms"] is None


async def test_cancelled_attempt_is_recorded_as_cancelled(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.black_hole())
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        call = asyncio.ensure_future(client.chat(MESSAGES, session_id="s-5"))
        await fake_upstream.wait_for_requests(1, "a")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        rows = await rig.rows()
    assert [(r["error"], r["source_name"], r["session_id"]) for r in rows] == [
        ("cancelled", "a", "s-5")
    ]
    assert rows[0]["cost"] == 0.0


async def test_cancelled_before_any_attempt_is_recorded(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    """A call waiting for quota is cancelled: one row, no source, error="cancelled"."""
    fake_upstream.set_default("a", Reply.black_hole())
    settings = scope(
        fake_upstream,
        source(fake_upstream, "a", limits=Limits(max_concurrency=1)),
        backpressure=BackpressureSettings(quota_full="wait", poll_interval_s=0.01),
    )
    rig = make_rig(tmp_path, settings)
    async with rig.client as client:
        holder = asyncio.ensure_future(client.chat(MESSAGES, session_id="holder"))
        await fake_upstream.wait_for_requests(1, "a")
        waiter = asyncio.ensure_future(client.chat(MESSAGES, session_id="waiter"))
        for _ in range(20):  # let the waiter reach the quota wait
            await asyncio.sleep(0)
        for call in (waiter, holder):
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        rows = {r["session_id"]: r for r in await rig.rows()}
    assert fake_upstream.requests("a") == 1
    assert (rows["waiter"]["error"], rows["waiter"]["source_name"]) == ("cancelled", "")
    assert (rows["holder"]["error"], rows["holder"]["source_name"]) == ("cancelled", "a")


async def test_unknown_model_costs_none_with_one_warning(
    make_rig: RigFactory,
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream, source(fake_upstream, "a", model="unpriced")))
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry.pricing"):
        async with rig.client as client:
            responses = [await client.chat(MESSAGES, cache_salt=str(i)) for i in range(3)]
            rows = await rig.rows()
    assert [r["cost"] for r in rows] == [None, None, None]
    assert [r.cost for r in responses] == [None, None, None]
    assert len([r for r in caplog.records if "unpriced" in r.getMessage()]) == 1


async def test_without_pricing_cost_is_none_except_cache_hits(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream), prices=None)
    async with rig.client as client:
        await client.chat(MESSAGES)
        await client.chat(MESSAGES)
        rows = await rig.rows()
    assert [r["cost"] for r in rows] == [None, 0.0]


async def test_multimodal_messages_are_stored_as_digests(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    payload = "iVBORw0KGgo" + "A" * 50_000
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}},
            ],
        }
    ]
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(messages)
        (row,) = await rig.rows()
    stored = json.loads(row["messages"])
    assert stored[0]["content"][0] == {"type": "text", "text": "What is in this picture?"}
    assert set(stored[0]["content"][1]) == {"type", "sha256"}
    assert "AAAAAAAA" not in row["messages"]
    # The request the upstream received still carried the image.
    assert payload in json.dumps(fake_upstream.received("a")[0].body)


async def test_aclose_flushes_every_row(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream, cache="none"))
    async with rig.client as client:
        await asyncio.gather(*(client.chat(MESSAGES) for _ in range(40)))
    await rig.recorder.aclose()
    from features_helpers import read_rows

    assert len(read_rows(rig.db)) == 40


async def test_a_seeded_random_module_never_repeats_a_call_id(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    # A user seeding ``random`` (tests, simulations) must not make two attempts share an id:
    # the recorder's INSERT OR IGNORE would silently drop the second row.
    for _ in range(3):
        fake_upstream.script("a", Reply.error(503), Reply.ok(content="ok"))
    rig = make_rig(tmp_path, scope(fake_upstream, cache="none", retry=_retries(2)))
    responses = []
    async with rig.client as client:
        for _ in range(3):
            random.seed(42)
            responses.append(await client.chat(MESSAGES))
        rows = await rig.rows()
    assert fake_upstream.requests("a") == 6
    assert len(rows) == 6
    assert [r["error"] for r in rows] == ["TransientError", None] * 3
    assert len({r["call_id"] for r in rows}) == 6
    assert {r.call_id for r in responses} <= {r["call_id"] for r in rows}


# --------------------------------------------------------------------------- the layer alone


class ListRecorder:
    """A recorder with only the async port (no ``record_nowait``): the task path."""

    def __init__(self, fail: bool = False) -> None:
        self.records: list[TelemetryRecord] = []
        self.fail = fail

    async def record(self, record: TelemetryRecord) -> None:
        if self.fail:
            raise OSError("disk full")
        await asyncio.sleep(0)
        self.records.append(record)

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def _answer(request: ChatRequest) -> LLMResponse:
    return LLMResponse(content="ok", model="m", call_id="c-1", cache_hit=True)


async def test_recorders_with_only_the_async_port_get_every_row() -> None:
    recorder = ListRecorder()
    layer = TelemetryMiddleware(recorder, pricing=None, clock=FakeClock(wall_start=5000.0))
    await layer(ChatRequest(messages=MESSAGES), _answer)
    for _ in range(5):
        await asyncio.sleep(0)
    assert [r.call_id for r in recorder.records] == ["c-1"]
    assert recorder.records[0].created_at == 5000.0


async def test_a_failing_recorder_never_breaks_the_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layer = TelemetryMiddleware(ListRecorder(fail=True), pricing=None, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger="polygateway.middleware.telemetry"):
        for _ in range(3):
            response = await layer(ChatRequest(messages=MESSAGES), _answer)
            assert response.content == "ok"
        for _ in range(5):
            await asyncio.sleep(0)
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1


async def test_the_callers_error_passes_through_unchanged() -> None:
    error = TransientError("boom")

    async def fail(request: ChatRequest) -> LLMResponse:
        raise error

    recorder = ListRecorder()
    layer = TelemetryMiddleware(recorder, pricing=None, clock=FakeClock())
    with pytest.raises(TransientError) as caught:
        await layer(ChatRequest(messages=MESSAGES), fail)
    assert caught.value is error
    for _ in range(5):
        await asyncio.sleep(0)
    assert [r.error for r in recorder.records] == ["TransientError"]


def test_the_helper_marks_cancellation_and_cache_hits() -> None:
    request = ChatRequest(messages=MESSAGES, session_id="s")
    cancelled = build_telemetry_record(
        request, asyncio.CancelledError(), call_id="x", latency_ms=3, created_at=1.0
    )
    assert (cancelled.error, cancelled.cache_hit, cancelled.cost) == ("cancelled", False, None)
    hit = build_telemetry_record(
        request,
        LLMResponse(content="c", cache_hit=True, latency_ms=99, ttft_ms=5.0, prompt_tokens=3),
        call_id="y",
        latency_ms=99,
        created_at=1.0,
    )
    assert (hit.cache_hit, hit.latency_ms, hit.cost, hit.ttft_ms) == (True, 0, 0.0, None)


def _retries(n: int) -> Any:
    from polygateway.settings import RetrySettings

    return RetrySettings(max_attempts=n, base_delay_s=0.0, max_delay_s=0.0)


def _delete_database(db: Path) -> None:
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_database_deleted_mid_run_is_reopened_and_no_row_is_lost(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path, how: str
) -> None:
    import sqlite3

    from features_helpers import read_rows

    rig = make_rig(tmp_path, scope(fake_upstream, cache="none"))
    async with rig.client as client:
        await asyncio.gather(*(client.chat(MESSAGES) for _ in range(5)))
        assert len(await rig.rows()) == 5
        _delete_database(rig.db)  # log rotation, a cleanup script...
        if how == "replaced":
            sqlite3.connect(rig.db).close()  # another, empty file at the same path
        responses = await asyncio.gather(*(client.chat(MESSAGES) for _ in range(7)))
        await rig.recorder.flush()
    rows = read_rows(rig.db)
    assert {r["call_id"] for r in rows} == {r.call_id for r in responses}
    assert rig.recorder.dropped == 0


async def test_rows_carry_scope_namespace_and_the_call_parameters(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(MESSAGES, cache_namespace="tenant-9", temperature=0.25, seed=3)
        (row,) = await rig.rows()
    assert (row["scope"], row["cache_namespace"]) == ("LLM", "tenant-9")
    assert json.loads(row["params"]) == {"temperature": 0.25, "seed": 3}


class _ContentChoosingRecorder:
    """A synchronous recorder declaring whether it reads content (``ports.DeclaresContentUse``)."""

    def __init__(self, wants_content: bool) -> None:
        self.wants_content = wants_content
        self.records: list[TelemetryRecord] = []

    def record_nowait(self, record: TelemetryRecord) -> None:
        self.records.append(record)

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_a_recorder_reading_no_content_gets_the_same_rows_without_the_prompt(
    fake_upstream: FakeUpstream,
) -> None:
    rows: dict[bool, list[TelemetryRecord]] = {}
    for wants in (True, False):
        fake_upstream.script("a", Reply.error(503), Reply.ok(content="fine"))
        recorder = _ContentChoosingRecorder(wants)
        async with GatewayClient(scope(fake_upstream), telemetry=recorder) as client:
            assert (await client.chat(MESSAGES)).content == "fine"
        rows[wants] = recorder.records
    assert all("capital of France" in r.messages for r in rows[True]) and len(rows[True]) == 2
    assert [r.messages for r in rows[False]] == ["", ""]
    varying = ("call_id", "root_call_id", "created_at", "latency_ms", "ttft_ms", "messages")
    for full, plain in zip(rows[True], rows[False], strict=True):
        keep = {f: getattr(full, f) for f in (*FIELDS_18, "scope", "params") if f not in varying}
        assert {f: getattr(plain, f) for f in keep} == keep


@pytest.mark.parametrize("content", ["digest", "none"])
async def test_a_recorder_reading_no_content_still_holds_none_under_a_content_policy(
    fake_upstream: FakeUpstream, content: TelemetryContent
) -> None:
    fake_upstream.script("a", Reply.ok(content="the secret answer"))
    recorder = _ContentChoosingRecorder(False)
    settings = scope(fake_upstream, telemetry=TelemetrySettings(content=content))
    async with GatewayClient(settings, telemetry=recorder) as client:
        assert (await client.chat(MESSAGES)).content == "the secret answer"
    (row,) = recorder.records
    # It reads no content, so nothing of it is kept for it (empty is as strict as a digest).
    assert (row.messages, row.response, row.thinking) == ("", "", "")
    assert row.completion_tokens and row.source_name == "a"
