"""The liveness watchdog on hand-made async iterators (real, short delays)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from polygateway.errors import StreamLivenessTimeout, TransientError
from polygateway.streaming import (
    CallDeadline,
    LivenessMonitor,
    LivenessWatchdog,
    StreamLiveness,
)

watch = LivenessWatchdog


class Scripted:
    """Yields after each delay in ``delays``; records whether it was closed."""

    def __init__(self, delays: list[float], *, fail: BaseException | None = None) -> None:
        self.delays = list(delays)
        self.fail = fail
        self.closed = False
        self.index = 0
        self.waiting = asyncio.Event()

    def __aiter__(self) -> Scripted:
        return self

    async def __anext__(self) -> int:
        if self.index >= len(self.delays):
            if self.fail is not None:
                raise self.fail
            raise StopAsyncIteration
        self.waiting.set()
        await asyncio.sleep(self.delays[self.index])
        self.index += 1
        return self.index

    async def aclose(self) -> None:
        self.closed = True


async def drain(wrapper: LivenessWatchdog[int]) -> list[int]:
    return [item async for item in wrapper]


async def test_passes_items_through_and_measures() -> None:
    source = Scripted([0.03, 0.0, 0.05, 0.01])
    wrapper = watch(source, ttft_s=1.0, inter_token_s=0.5, total_s=2.0)
    assert await drain(wrapper) == [1, 2, 3, 4]
    assert wrapper.tokens == 4
    assert wrapper.ttft_ms is not None and 25 <= wrapper.ttft_ms < 500
    assert wrapper.max_inter_token_ms is not None and 45 <= wrapper.max_inter_token_ms < 500
    assert source.closed  # exhausted: closed as well


async def test_single_item_has_no_gap() -> None:
    wrapper = watch(Scripted([0.0]), total_s=1.0)
    await drain(wrapper)
    assert wrapper.max_inter_token_ms is None


@pytest.mark.parametrize(
    ("delays", "limits", "kind"),
    [
        ([0.5], {"ttft_s": 0.05, "inter_token_s": 0.02, "total_s": 2.0}, "ttft"),
        ([0.0, 0.0, 0.5], {"ttft_s": 0.2, "inter_token_s": 0.05, "total_s": 2.0}, "inter_token"),
        ([0.02] * 50, {"ttft_s": 0.1, "inter_token_s": 0.08, "total_s": 0.15}, "total"),
        # The total deadline can be the first to bite before the first token too.
        ([0.5], {"ttft_s": 0.3, "total_s": 0.05}, "total"),
        ([0.0, 0.5], {"total_s": 0.08}, "total"),
    ],
)
async def test_deadlines(delays: list[float], limits: dict[str, float], kind: str) -> None:
    source = Scripted(delays)
    wrapper = watch(source, **limits)
    with pytest.raises(StreamLivenessTimeout) as caught:
        await drain(wrapper)
    assert caught.value.kind == kind
    assert isinstance(caught.value, TransientError)
    assert caught.value.reason == "timeout"
    assert source.closed


async def test_deadline_counts_from_started_at() -> None:
    loop = asyncio.get_running_loop()
    # The request was sent 1 s ago: the TTFT budget is already spent.
    wrapper = watch(Scripted([0.0]), ttft_s=0.5, started_at=loop.time() - 1.0)
    with pytest.raises(StreamLivenessTimeout) as caught:
        await drain(wrapper)
    assert caught.value.kind == "ttft"


async def test_steady_tokens_never_trip_the_inter_token_deadline() -> None:
    # Many gaps each below the limit, for longer than the limit in total: the lazily
    # re-armed timer must follow the moving deadline.
    wrapper = watch(Scripted([0.02] * 15), ttft_s=0.1, inter_token_s=0.06, total_s=5.0)
    assert len(await drain(wrapper)) == 15


async def test_upstream_timeout_error_passes_through_unchanged() -> None:
    upstream = TimeoutError("engine read timeout")
    source = Scripted([0.0], fail=upstream)
    with pytest.raises(TimeoutError) as caught:
        await drain(watch(source, ttft_s=1.0, inter_token_s=0.5, total_s=2.0))
    assert caught.value is upstream
    assert not isinstance(caught.value, StreamLivenessTimeout)
    assert source.closed


async def test_upstream_errors_pass_through_and_close() -> None:
    source = Scripted([0.0], fail=TransientError("boom"))
    with pytest.raises(TransientError, match="boom"):
        await drain(watch(source, total_s=1.0))
    assert source.closed


async def test_outer_cancellation_propagates_and_closes() -> None:
    source = Scripted([10.0])
    wrapper = watch(source, ttft_s=5.0, total_s=9.0)
    task = asyncio.create_task(drain(wrapper))
    await source.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed


async def test_outer_timeout_is_not_mistaken_for_ours() -> None:
    source = Scripted([10.0])
    with pytest.raises(TimeoutError) as caught:
        async with asyncio.timeout(0.05):
            await drain(watch(source, ttft_s=5.0, total_s=9.0))
    assert not isinstance(caught.value, StreamLivenessTimeout)
    assert source.closed


class SwallowsCancellation:
    """Answers its first item even when cancelled while waiting for it (a stubborn source)."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()

    def __aiter__(self) -> SwallowsCancellation:
        return self

    async def __anext__(self) -> int:
        self.waiting.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return 1
        return 2


async def test_timeout_lost_to_a_late_item_leaves_the_task_uncancelled() -> None:
    wrapper = watch(SwallowsCancellation(), ttft_s=0.02)
    assert await wrapper.__anext__() == 1
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # our cancellation request was taken back
    await wrapper.aclose()


async def test_outer_cancellation_racing_our_deadline_still_propagates() -> None:
    source = Scripted([10.0])
    wrapper = watch(source, ttft_s=0.05)

    async def step() -> int:
        return await wrapper.__anext__()

    task = asyncio.create_task(step())
    await source.waiting.wait()
    loop = asyncio.get_running_loop()
    # Cancel from outside in the same loop iteration as our deadline fires.
    loop.call_at(wrapper.liveness._first_deadline, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed


async def test_the_task_is_not_left_cancelling_after_a_timeout() -> None:
    source = Scripted([10.0])
    with pytest.raises(StreamLivenessTimeout):
        await drain(watch(source, ttft_s=0.02))
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # no cancellation is pending either


async def test_works_on_async_generators_and_closes_them() -> None:
    closed = asyncio.Event()

    async def gen() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(10)
            yield 2
        finally:
            closed.set()

    wrapper = watch(gen(), inter_token_s=0.05, ttft_s=1.0, total_s=5.0)
    with pytest.raises(StreamLivenessTimeout):
        await drain(wrapper)
    assert closed.is_set()


async def test_aclose_is_idempotent_and_stops_iteration() -> None:
    source = Scripted([0.0, 0.0])
    wrapper = watch(source, total_s=1.0)
    assert await wrapper.__anext__() == 1
    await wrapper.aclose()
    await wrapper.aclose()
    assert source.closed
    with pytest.raises(StopAsyncIteration):
        await wrapper.__anext__()


async def test_no_limits_is_a_plain_pass_through() -> None:
    assert await drain(watch(Scripted([0.0, 0.01]))) == [1, 2]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
async def test_bad_limits_are_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="ttft_s"):
        LivenessWatchdog(Scripted([]), ttft_s=bad)


# --------------------------------------------------------------------------- shared monitor


async def _stream_through(liveness: StreamLiveness, delays: list[float]) -> tuple[str, float]:
    """Wait for each delay under ``liveness``; how it ended and when (loop time)."""
    loop = asyncio.get_running_loop()
    try:
        for delay in delays:
            with liveness:
                await asyncio.sleep(delay)
            liveness.token()
        return "done", loop.time()
    except StreamLivenessTimeout as exc:
        return exc.kind, loop.time()
    finally:
        liveness.close()


async def test_one_monitor_enforces_every_streams_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    monitor = LivenessMonitor()
    start = loop.time()
    # The late deadline registers first, so the timer is armed late, then pulled earlier.
    slow = StreamLiveness(ttft_s=0.25, monitor=monitor)
    fast = StreamLiveness(ttft_s=0.05, monitor=monitor)
    # Registers after an earlier deadline armed the timer: it must still be checked.
    later = StreamLiveness(ttft_s=0.15, monitor=monitor)
    steady = StreamLiveness(ttft_s=0.1, inter_token_s=0.1, total_s=5.0, monitor=monitor)
    results = await asyncio.gather(
        _stream_through(slow, [1.0]),
        _stream_through(fast, [1.0]),
        _stream_through(later, [1.0]),
        _stream_through(steady, [0.03] * 12),
    )
    (slow_kind, slow_at), (fast_kind, fast_at), (later_kind, later_at), (steady_kind, _) = results
    assert (slow_kind, fast_kind, later_kind, steady_kind) == ("ttft", "ttft", "ttft", "done")
    assert 0.15 <= later_at - start < 0.5
    # Never early; each fired at its own deadline, not at the other's.
    assert 0.05 <= fast_at - start < 0.2
    assert 0.25 <= slow_at - start < 0.6
    assert monitor.open_streams == 0
    monitor.close()


async def test_a_deadline_that_moves_earlier_is_still_enforced_on_time() -> None:
    # TTFT is long, the inter-token limit short: after the first token the deadline in force
    # moves earlier than the one the timer was armed for.
    loop = asyncio.get_running_loop()
    monitor = LivenessMonitor()
    liveness = StreamLiveness(ttft_s=5.0, inter_token_s=0.05, monitor=monitor)
    start = loop.time()
    kind, ended = await _stream_through(liveness, [0.0, 2.0])
    assert kind == "inter_token"
    assert ended - start < 1.0
    monitor.close()


async def test_a_monitor_of_another_event_loop_is_refused() -> None:
    monitor = LivenessMonitor()

    def other_loop() -> None:
        async def make() -> None:
            StreamLiveness(total_s=1.0, monitor=monitor)

        asyncio.run(make())

    with pytest.raises(RuntimeError, match="another event loop"):
        await asyncio.to_thread(other_loop)
    monitor.close()


# --------------------------------------------------------------------------- CallDeadline


def _total_only(kind: str, limit_s: float, *, source_name: str | None) -> Exception:
    return TransientError(f"{kind} {limit_s:g} {source_name}", source_name=source_name)


async def test_a_call_deadline_bounds_every_wait_of_the_call_by_its_total() -> None:
    loop = asyncio.get_running_loop()
    monitor = LivenessMonitor()
    start = loop.time()
    deadline = CallDeadline(0.1, start, monitor, "src", _total_only)
    with deadline:
        await asyncio.sleep(0.01)  # a first wait within the deadline ends normally
    with pytest.raises(TransientError, match=r"total 0\.1 src") as caught, deadline:
        await asyncio.sleep(5)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert 0.1 <= loop.time() - start < 1.0  # never early
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    # A passed deadline refuses the next wait at once.
    with pytest.raises(TransientError, match="total"), deadline:
        pass
    deadline.close()
    assert monitor.open_streams == 0
    monitor.close()


async def test_a_call_deadline_shares_the_monitor_with_streams() -> None:
    monitor = LivenessMonitor()
    loop = asyncio.get_running_loop()
    stream = StreamLiveness(ttft_s=5.0, monitor=monitor)
    call = CallDeadline(0.05, loop.time(), monitor)
    with stream:  # the stream armed the timer late; the call's deadline pulls it earlier
        pass
    with pytest.raises(StreamLivenessTimeout) as caught, call:
        await asyncio.sleep(5)
    assert caught.value.kind == "total"
    call.close()
    stream.close()
    assert monitor.open_streams == 0
    monitor.close()


async def test_an_outside_cancellation_passes_a_call_deadline_unchanged() -> None:
    monitor = LivenessMonitor()
    started = asyncio.Event()

    async def wait() -> None:
        with CallDeadline(5.0, asyncio.get_running_loop().time(), monitor):
            started.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(wait())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monitor.close()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
async def test_a_call_deadline_refuses_a_total_that_is_not_positive(bad: float) -> None:
    monitor = LivenessMonitor()
    with pytest.raises(ValueError, match="total_s must be a positive number"):
        CallDeadline(bad, 0.0, monitor)
    monitor.close()


async def test_a_call_deadline_refuses_a_monitor_of_another_loop() -> None:
    monitor = LivenessMonitor()

    def other_loop() -> None:
        async def make() -> None:
            CallDeadline(1.0, 0.0, monitor)

        asyncio.run(make())

    with pytest.raises(RuntimeError, match="another event loop"):
        await asyncio.to_thread(other_loop)
    monitor.close()
