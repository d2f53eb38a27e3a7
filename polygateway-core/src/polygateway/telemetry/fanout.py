"""Telemetry fan-out: every row to each of several recorders (``PGW_TELEMETRY_BACKEND=a,b``).

Each sink is isolated: a sink that raises, hangs or is slow never affects the others or the
call. Sinks with ``record_nowait`` get each row synchronously; the others get a task per row,
at most ``max_pending`` of them in flight per sink (beyond that the row is dropped for that
sink). Every row a sink could not take is counted for that sink (``drops``, which adds the
sink's own ``dropped`` counter when it keeps one). ``flush``/``aclose`` run every sink's at
once, each failure a warning, so one stuck sink cannot keep the others' rows unwritten, and
each for at most ``timeout_s`` (what a hung sink still holds then is cancelled and counted).

Sinks that take whole calls (``ports.SupportsCallTraces``, a tracing exporter) get them: the
fan-out then offers ``open_call`` itself, and a call's rows reach every other sink one by one
as usual.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType

from polygateway.ports import (
    CallTrace,
    SupportsCallTraces,
    SupportsGovernanceEvents,
    SupportsRecordNowait,
    TelemetryRecorder,
)
from polygateway.types import CallStart, GovernanceEvent, TelemetryRecord

__all__ = ["DEFAULT_MAX_PENDING", "DEFAULT_TIMEOUT_S", "FanoutRecorder", "fanout"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 10_000
"""Rows in flight at most per sink without ``record_nowait`` (a hung sink stays bounded)."""
DEFAULT_TIMEOUT_S = 10.0
"""``flush``/``aclose`` wait this long at most per sink (a hung sink cannot hang shutdown)."""


class _Sink:
    """One recorder of a fan-out with its own failure accounting."""

    __slots__ = ("failed", "max_pending", "name", "recorder", "submit", "tasks", "warned")

    def __init__(self, name: str, recorder: TelemetryRecorder, max_pending: int) -> None:
        self.name = name
        self.recorder = recorder
        self.max_pending = max_pending
        self.failed = 0
        self.warned: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.submit: Callable[[TelemetryRecord], None] = (
            recorder.record_nowait
            if isinstance(recorder, SupportsRecordNowait)
            else self._submit_as_task
        )

    def take(self, record: TelemetryRecord) -> None:
        try:
            self.submit(record)
        except Exception as exc:  # noqa: BLE001 - one sink never affects another or the call
            self.fail("record", exc)

    def fail(self, what: str, exc: BaseException | None, rows: int = 1) -> None:
        self.failed += rows
        cause = f"{what}:{type(exc).__name__}"
        if cause not in self.warned:
            self.warned.add(cause)
            logger.warning(
                "telemetry sink %r: %s failed (%r); its rows are dropped and counted",
                self.name,
                what,
                exc,
            )

    def _submit_as_task(self, record: TelemetryRecord) -> None:
        if len(self.tasks) >= self.max_pending:
            self.fail("record (too many rows in flight)", None)
            return
        task = asyncio.get_running_loop().create_task(self._record(record))
        self.tasks.add(task)  # a strong reference until done
        task.add_done_callback(self.tasks.discard)

    async def _record(self, record: TelemetryRecord) -> None:
        try:
            await self.recorder.record(record)
        except asyncio.CancelledError:
            self.failed += 1  # given up on (shutdown timeout): the row is lost
            raise
        except Exception as exc:  # noqa: BLE001 - counted, never raised
            self.fail("record", exc)

    async def finish(
        self, what: str, step: Callable[[], Awaitable[None]], timeout_s: float
    ) -> None:
        """Wait for the rows in flight, then ``step`` (flush or aclose), for at most
        ``timeout_s`` in all: a hung sink's rows still in flight are cancelled and counted."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.tasks:
                    await asyncio.gather(*tuple(self.tasks), return_exceptions=True)
                await step()
        except TimeoutError as exc:
            for task in tuple(self.tasks):
                task.cancel()  # each cancelled row counts itself as lost
            self.fail(f"{what} (gave up after {timeout_s:g}s)", exc, rows=0)
        except Exception as exc:  # noqa: BLE001 - one sink's shutdown never stops another's
            self.fail(what, exc, rows=0)

    @property
    def dropped(self) -> int:
        own = getattr(self.recorder, "dropped", 0)
        return self.failed + (own if type(own) is int else 0)


class FanoutRecorder:
    """A ``TelemetryRecorder`` that hands every row to each of ``sinks`` (name -> recorder)."""

    __slots__ = ("_sinks", "_timeout_s")

    def __init__(
        self,
        sinks: Mapping[str, TelemetryRecorder],
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not sinks:
            raise ValueError("FanoutRecorder needs at least one sink")
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"FanoutRecorder max_pending must be an int >= 1, got {max_pending!r}")
        for name, recorder in sinks.items():
            if not isinstance(recorder, TelemetryRecorder):
                raise TypeError(
                    f"FanoutRecorder sink {name!r} is not a TelemetryRecorder: {recorder!r}"
                )
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"FanoutRecorder timeout_s must be > 0 seconds, got {timeout_s!r}")
        self._timeout_s = timeout_s
        self._sinks = tuple(_Sink(name, rec, max_pending) for name, rec in sinks.items())

    @property
    def sinks(self) -> Mapping[str, TelemetryRecorder]:
        return MappingProxyType({sink.name: sink.recorder for sink in self._sinks})

    @property
    def drops(self) -> Mapping[str, int]:
        """Sink name -> rows it lost: rows it raised on or could not take in time, plus its own
        ``dropped`` counter when it keeps one."""
        return MappingProxyType({sink.name: sink.dropped for sink in self._sinks})

    @property
    def dropped(self) -> int:
        """Rows lost, summed over the sinks."""
        return sum(sink.dropped for sink in self._sinks)

    def record_nowait(self, record: TelemetryRecord) -> None:
        for sink in self._sinks:
            sink.take(record)

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    async def flush(self) -> None:
        timeout_s = self._timeout_s
        await asyncio.gather(
            *(sink.finish("flush", sink.recorder.flush, timeout_s) for sink in self._sinks)
        )

    async def aclose(self) -> None:
        timeout_s = self._timeout_s
        await asyncio.gather(
            *(sink.finish("aclose", sink.recorder.aclose, timeout_s) for sink in self._sinks)
        )

    def __repr__(self) -> str:
        names = ", ".join(sink.name for sink in self._sinks)
        return f"FanoutRecorder(sinks=[{names}])"


class _TracingFanout(FanoutRecorder):
    """A fan-out with at least one sink that takes whole calls."""

    __slots__ = ()

    def open_call(self, start: CallStart) -> CallTrace:
        traces: list[tuple[_Sink, CallTrace]] = []
        plain: list[_Sink] = []
        for sink in self._sinks:
            recorder = sink.recorder
            if isinstance(recorder, SupportsCallTraces):
                try:
                    traces.append((sink, recorder.open_call(start)))
                    continue
                except Exception as exc:  # noqa: BLE001 - this sink takes rows one by one
                    sink.fail("open_call", exc, rows=0)
            plain.append(sink)
        return _FanoutTrace(tuple(traces), tuple(plain))


class _FanoutTrace:
    __slots__ = ("_plain", "_traces")

    def on_governance(self, event: GovernanceEvent) -> None:
        for sink, trace in self._traces:
            if isinstance(trace, SupportsGovernanceEvents):
                try:
                    trace.on_governance(event)
                except Exception as exc:  # noqa: BLE001 - one sink never affects another
                    sink.fail("call trace", exc, rows=0)

    def __init__(
        self, traces: tuple[tuple[_Sink, CallTrace], ...], plain: tuple[_Sink, ...]
    ) -> None:
        self._traces = traces
        self._plain = plain

    def attempt(self, record: TelemetryRecord, outcome: object) -> None:
        for sink, trace in self._traces:
            try:
                trace.attempt(record, outcome)
            except Exception as exc:  # noqa: BLE001 - one sink never affects another
                sink.fail("call trace", exc)
        for sink in self._plain:
            sink.take(record)

    def close(self, ended_at: float, error: BaseException | None) -> None:
        for sink, trace in self._traces:
            try:
                trace.close(ended_at, error)
            except Exception as exc:  # noqa: BLE001 - one sink never affects another
                sink.fail("call trace", exc, rows=0)


def fanout(
    sinks: Mapping[str, TelemetryRecorder],
    *,
    max_pending: int = DEFAULT_MAX_PENDING,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> FanoutRecorder:
    """The fan-out of ``sinks``; it takes whole calls (``open_call``) only when a sink does,
    so a fan-out of row sinks costs the telemetry layer nothing more."""
    tracing = any(isinstance(rec, SupportsCallTraces) for rec in sinks.values())
    cls = _TracingFanout if tracing else FanoutRecorder
    return cls(sinks, max_pending=max_pending, timeout_s=timeout_s)
