"""The telemetry fan-out: every row to each sink, each sink isolated, drops counted per sink."""

from __future__ import annotations

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
