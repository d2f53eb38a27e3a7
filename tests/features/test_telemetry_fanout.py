"""The telemetry fan-out: every row to each sink, each sink isolated, drops counted per sink."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from features_helpers import MESSAGES, read_rows, scope
from polygateway.client import GatewayClient
from polygateway.telemetry.fanout import FanoutRecorder, fanout
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeUpstream, Reply
from polygateway.types import TelemetryRecord


class _Broken:
    def record_nowait(self, record: TelemetryRecord) -> None:
        raise RuntimeError("sink broken")

    async def record(self, record: TelemetryRecord) -> None:
        raise RuntimeError("sink broken")

    async def flush(self) -> None:
        raise RuntimeError("flush broken")

    async def aclose(self) -> None:
        raise RuntimeError("close broken")


async def test_every_row_reaches_each_sink_whatever_a_broken_one_does(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.error(503), Reply.ok(content="fine"))
    first, second = SQLiteRecorder(str(tmp_path / "1.db")), SQLiteRecorder(str(tmp_path / "2.db"))
    recorder = fanout({"one": first, "broken": _Broken(), "two": second})
    assert not hasattr(recorder, "open_call")  # row sinks only: no per-call work
    async with GatewayClient(scope(fake_upstream), telemetry=recorder) as client:
        assert (await client.chat(MESSAGES)).content == "fine"
    await recorder.flush()
    for db in ("1.db", "2.db"):
        assert [r["error"] for r in read_rows(tmp_path / db)] == ["TransientError", None]
    assert recorder.drops == {"one": 0, "broken": 2, "two": 0}
    assert recorder.dropped == 2
    await recorder.aclose()  # the broken sink's aclose does not stop the others'
    assert repr(recorder) == "FanoutRecorder(sinks=[one, broken, two])"


def test_a_fanout_checks_its_sinks() -> None:
    with pytest.raises(ValueError, match="at least one sink"):
        FanoutRecorder({})
    with pytest.raises(TypeError, match="'x' is not a TelemetryRecorder"):
        FanoutRecorder({"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="max_pending"):
        FanoutRecorder({"b": _Broken()}, max_pending=0)


class _Hung:
    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def record(self, record: TelemetryRecord) -> None:
        self.started.set()
        await asyncio.Event().wait()  # never returns

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_a_hung_sink_cannot_hang_shutdown(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    hung = _Hung()
    sqlite = SQLiteRecorder(str(tmp_path / "t.db"))
    recorder = fanout({"hung": hung, "sqlite": sqlite}, timeout_s=0.2)
    async with GatewayClient(scope(fake_upstream), telemetry=recorder) as client:
        assert (await client.chat(MESSAGES)).content
        await hung.started.wait()
    await recorder.aclose()  # gives up on the hung sink's row, closes the other
    assert recorder.drops == {"hung": 1, "sqlite": 0}
    assert len(read_rows(tmp_path / "t.db")) == 1
    with pytest.raises(ValueError, match="timeout_s"):
        FanoutRecorder({"s": sqlite}, timeout_s=0)
