"""The telemetry recorder contract (``ports.TelemetryRecorder``), the same for every backend.

Subclass ``TelemetryRecorderContract`` and provide two fixtures on the same storage:

- ``make_recorder``: a factory (sync or async) returning a fresh recorder. Recorders made in one
  test write to the same table (idempotence across instances is tested); the storage must be
  empty at the start of each test.
- ``read_rows``: an async callable returning every stored row as a mapping with the 18 fields
  of ``TelemetryRecord`` plus ``created_at`` (any representation: epoch seconds or datetime).

::

    class TestSQLiteRecorderContract(TelemetryRecorderContract):
        @pytest.fixture
        def make_recorder(self, tmp_path):
            return lambda: SQLiteRecorder(str(tmp_path / "t.db"))

        @pytest.fixture
        def read_rows(self, tmp_path):
            async def read():
                return read_sqlite_rows(str(tmp_path / "t.db"))
            return read

A recorder that also implements ``ports.SupportsRecordNowait`` (a synchronous
``record_nowait``, which the telemetry layer then uses instead of a task per row) has it held
to the behaviour of ``record``, and one that implements ``ports.SupportsRecordValues`` has
``record_values_nowait`` held to ``record_nowait`` of the record; those tests skip for a
recorder without them.

Text may be stored without NUL characters (Postgres rejects them); every other character
must round-trip.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import astuple, fields, replace
from typing import Any

import pytest

from polygateway.ports import SupportsRecordNowait, SupportsRecordValues, TelemetryRecorder
from polygateway.types import ChatRequest, LLMResponse, TelemetryRecord

FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TelemetryRecord) if f.name != "created_at")
RowReader = Callable[[], Awaitable[Sequence[Mapping[str, Any]]]]


def sample_record(**overrides: Any) -> TelemetryRecord:
    """A fully populated row; ``overrides`` replace fields."""
    values: dict[str, Any] = {
        "call_id": uuid.uuid4().hex,
        "parent_call_id": "parent-1",
        "session_id": "session-1",
        "model": "model-a",
        "provider": "openai",
        "source_name": "openai-1",
        "messages": '[{"content":"héllo ✓ 你好","role":"user"}]',
        "response": "answer with 'quotes', \"double\", emoji 🚀",
        "thinking": "thought",
        "prompt_tokens": 12,
        "completion_tokens": 34,
        "usage_source": "measured",
        "latency_ms": 567,
        "ttft_ms": 12.5,
        "max_inter_token_ms": 3.25,
        "cache_hit": False,
        "error": None,
        "cost": 0.000123,
        "created_at": 1_700_000_000.25,
    }
    values.update(overrides)
    values.setdefault("root_call_id", values["call_id"])  # a call of one row
    return TelemetryRecord(**values)


def _text(value: Any) -> Any:
    return value.replace("\x00", "") if isinstance(value, str) else value


def assert_row_matches(row: Mapping[str, Any], record: TelemetryRecord) -> None:
    """Every one of the 18 fields equal (floats approximately, NULs may be stripped)."""
    for name in FIELDS:
        expected = getattr(record, name)
        actual = row[name]
        if name == "cache_hit":
            assert bool(actual) is expected, f"{name}: {actual!r} != {expected!r}"
        elif isinstance(expected, float):
            assert actual == pytest.approx(expected), f"{name}: {actual!r} != {expected!r}"
        else:
            assert _text(actual) == _text(expected), f"{name}: {actual!r} != {expected!r}"
    assert row.get("created_at") is not None


class TelemetryRecorderContract:
    """Behaviour every ``TelemetryRecorder`` shares (ARCHITECTURE §7.8, M2 §5)."""

    @pytest.fixture
    def make_recorder(self) -> Any:
        raise NotImplementedError(
            "subclass TelemetryRecorderContract and provide a make_recorder fixture"
        )

    @pytest.fixture
    def read_rows(self) -> RowReader:
        raise NotImplementedError(
            "subclass TelemetryRecorderContract and provide a read_rows fixture"
        )

    @pytest.fixture
    async def new_recorder(
        self, make_recorder: Any
    ) -> AsyncIterator[Callable[[], Awaitable[TelemetryRecorder]]]:
        made: list[TelemetryRecorder] = []

        async def new() -> TelemetryRecorder:
            result = make_recorder()
            recorder: TelemetryRecorder = await result if inspect.isawaitable(result) else result
            made.append(recorder)
            return recorder

        try:
            yield new
        finally:
            for recorder in made:
                await recorder.aclose()

    # ------------------------------------------------------------------ round trip

    async def test_all_fields_round_trip(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        full = sample_record()
        sparse = sample_record(
            parent_call_id=None,
            session_id=None,
            ttft_ms=None,
            max_inter_token_ms=None,
            cost=None,
            error="TransientError",
            cache_hit=True,
            usage_source="estimated",
            response="",
            thinking="",
            prompt_tokens=0,
            completion_tokens=0,
            latency_ms=0,
        )
        await recorder.record(full)
        await recorder.record(sparse)
        await recorder.flush()
        rows = {row["call_id"]: row for row in await read_rows()}
        assert set(rows) == {full.call_id, sparse.call_id}
        assert_row_matches(rows[full.call_id], full)
        assert_row_matches(rows[sparse.call_id], sparse)

    async def test_record_nowait_is_record_without_the_await(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        if not isinstance(recorder, SupportsRecordNowait):
            pytest.skip("this recorder does not implement ports.SupportsRecordNowait")
        records = [sample_record(call_id=uuid.uuid4().hex) for _ in range(5)]
        for record in records:
            assert recorder.record_nowait(record) is None  # type: ignore[func-returns-value]
        recorder.record_nowait(records[0])  # idempotent on call_id, like record()
        await recorder.record(records[1])
        await recorder.flush()
        rows = {row["call_id"]: row for row in await read_rows()}
        assert sorted(rows) == sorted(r.call_id for r in records)
        for record in records:
            assert_row_matches(rows[record.call_id], record)

    async def test_record_values_nowait_is_record_nowait_of_the_record(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        if not isinstance(recorder, SupportsRecordValues):
            pytest.skip("this recorder does not implement ports.SupportsRecordValues")
        full = sample_record()
        sparse = sample_record(
            parent_call_id=None,
            session_id=None,
            ttft_ms=None,
            max_inter_token_ms=None,
            cost=None,
            error="cancelled",
            cache_hit=True,
            created_at=0.0,  # stamped when recorded, as by record_nowait
        )
        for record in (full, sparse):
            assert recorder.record_values_nowait(astuple(record)) is None  # type: ignore[func-returns-value]
        recorder.record_values_nowait(astuple(replace(full, response="again")))
        await recorder.flush()
        rows = {row["call_id"]: row for row in await read_rows()}
        assert sorted(rows) == sorted((full.call_id, sparse.call_id))
        assert_row_matches(rows[full.call_id], full)  # idempotent on call_id, like record()
        assert_row_matches(rows[sparse.call_id], sparse)

    async def test_idempotent_on_call_id(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        first = sample_record(response="first")
        await recorder.record(first)
        await recorder.record(replace(first, response="second"))
        await recorder.flush()
        await recorder.record(replace(first, response="third"))
        await recorder.flush()
        # A second recorder (a restarted process) replaying the same row.
        other = await new_recorder()
        await other.record(replace(first, response="fourth"))
        await other.flush()
        rows = await read_rows()
        assert [r["call_id"] for r in rows] == [first.call_id]
        assert rows[0]["response"] == "first"

    # ------------------------------------------------------------------ nothing lost

    async def test_flush_writes_everything_recorded_before_it(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        records = [sample_record() for _ in range(300)]
        for record in records:
            await recorder.record(record)
        await recorder.flush()
        assert {r["call_id"] for r in await read_rows()} == {r.call_id for r in records}

    async def test_aclose_loses_nothing(self, make_recorder: Any, read_rows: RowReader) -> None:
        made = make_recorder()
        recorder: TelemetryRecorder = await made if inspect.isawaitable(made) else made
        records = [sample_record() for _ in range(1000)]
        for record in records:
            await recorder.record(record)
        await recorder.aclose()
        assert len(await read_rows()) == len(records)
        await recorder.aclose()  # idempotent
        await recorder.record(sample_record())  # after close: dropped, never raised

    async def test_concurrent_records_all_land(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        records = [sample_record() for _ in range(50)]
        await asyncio.gather(*(recorder.record(r) for r in records))
        await recorder.flush()
        assert len(await read_rows()) == 50

    async def test_flush_and_aclose_without_rows(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        await recorder.flush()
        await recorder.aclose()

    # ------------------------------------------------------------------ bad content

    async def test_a_nul_character_does_not_sink_the_batch(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        before = [sample_record() for _ in range(5)]
        poisoned = sample_record(
            response="nul \x00 inside", thinking="\x00", messages='[{"content":"a\\u0000b"}]'
        )
        after = [sample_record() for _ in range(5)]
        for record in [*before, poisoned, *after]:
            await recorder.record(record)
        await recorder.flush()
        rows = {row["call_id"]: row for row in await read_rows()}
        assert len(rows) == 11
        assert_row_matches(rows[poisoned.call_id], poisoned)

    async def test_odd_text_round_trips(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        recorder = await new_recorder()
        odd = sample_record(
            response="'; DROP TABLE pgw_calls; --" + "\u2028\ud7ff" + "x" * 200_000,
            session_id="s:{1}\n",
            model="模型/v1.5-32k",
        )
        await recorder.record(odd)
        await recorder.flush()
        rows = await read_rows()
        assert len(rows) == 1
        assert_row_matches(rows[0], odd)

    async def test_no_base64_is_stored_when_the_helper_digests_messages(
        self, new_recorder: Callable[[], Awaitable[TelemetryRecorder]], read_rows: RowReader
    ) -> None:
        from polygateway.middleware.telemetry import build_telemetry_record

        payload = base64.b64encode(bytes(range(256)) * 64).decode("ascii")
        request = ChatRequest(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is in this picture?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{payload}"},
                        },
                    ],
                }
            ]
        )
        response = LLMResponse(content="a cat", model="model-a", call_id="c1")
        record = build_telemetry_record(
            request, response, call_id=uuid.uuid4().hex, latency_ms=5, created_at=1.0
        )
        recorder = await new_recorder()
        await recorder.record(record)
        await recorder.flush()
        (row,) = await read_rows()
        stored = str(row["messages"])
        assert payload[:64] not in stored
        assert "what is in this picture?" in stored
        assert '"sha256"' in stored
        assert len(stored) < 1000


__all__ = ["FIELDS", "TelemetryRecorderContract", "assert_row_matches", "sample_record"]
