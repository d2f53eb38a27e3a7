"""Wire behaviour: large uploads streamed without a copy, cancellation that leaks no
connection, deadlines that grow with the input, a server that serialises requests."""

from __future__ import annotations

import asyncio
import hashlib
import tracemalloc

import pytest
from pgw_monkeyocr.options import MIB
from pgw_monkeyocr.testing import FakeMonkeyOcr, Reply, make_pdf, make_png
from pgw_monkeyocr.transport import MonkeyOcrTransport
from pgw_monkeyocr_test_helpers import MakeTransport, monkey_source


async def test_a_large_image_is_streamed_without_a_second_copy(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    image = make_png(64, 64, size=12 * MIB)
    transport = make_transport("a")
    assert await transport.check_health()  # the session exists before measuring
    tracemalloc.start()
    try:
        result = await transport.recognize_text(image)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.text
    (upload,) = fake_monkeyocr.uploads("a")
    assert upload.size == len(image)
    assert upload.sha256 == hashlib.sha256(image).hexdigest()
    # Client and (in-process) server together: a single copy of the image would be 12 MiB.
    assert peak < 3 * MIB, f"peak {peak / MIB:.1f} MiB while sending a 12 MiB image"


async def test_cancelling_mid_download_leaves_no_connection_open(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.zip(download="stall", padding=512 * 1024))
    transport = make_transport("a")
    task = asyncio.create_task(transport.parse_layout(make_png()))
    await fake_monkeyocr.wait_until_async(lambda f: f.stalled_downloads == 1)
    assert fake_monkeyocr.open_connections >= 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The half-read response closed its connection; nothing is kept in the pool either.
    await fake_monkeyocr.wait_until_async(
        lambda f: f.open_connections == 0 and f.stalled_downloads == 0
    )
    # The transport is still usable afterwards.
    result = await transport.parse_layout(make_png(800, 600))
    assert result.page_sizes == ((800.0, 600.0),)


async def test_cancelling_while_the_server_works_leaves_no_connection_open(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    fake_monkeyocr.script("a", Reply.ok(delay_s=30.0))
    transport = make_transport("a")
    task = asyncio.create_task(transport.recognize_text(make_png()))
    await fake_monkeyocr.wait_until_async(lambda f: len(f.uploads("a")) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fake_monkeyocr.wait_until_async(lambda f: f.open_connections == 0)


def test_the_deadline_grows_with_pages_and_megabytes(make_transport: MakeTransport) -> None:
    transport = make_transport(
        "a", fields={"timeout_s": 10.0}, per_page_timeout_s=2.0, per_mb_timeout_s=1.0
    )
    one_page = make_pdf([(595, 842)])
    ten_pages = make_pdf([(595, 842)] * 10)
    assert transport.timeout_for(one_page) == pytest.approx(12.0, abs=0.01)
    assert transport.timeout_for(ten_pages) == pytest.approx(30.0, abs=0.01)
    big = make_png(8, 8, size=5 * MIB)
    assert transport.timeout_for(big) == pytest.approx(10.0 + 2.0 + 5.0, abs=0.01)
    capped = make_transport("b", fields={"timeout_s": 10.0}, max_timeout_s=60)
    assert capped.timeout_for(make_pdf([(595, 842)] * 500)) == 60.0
    assert capped.max_deadline_s == 60.0


async def test_the_allowance_lets_a_long_document_finish(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport
) -> None:
    # 0.2 s base would time out; the 4 pages' allowance covers the 0.5 s of "inference".
    fake_monkeyocr.script("a", Reply.ok(delay_s=0.5))
    transport = make_transport(
        "a", fields={"timeout_s": 0.2}, per_page_timeout_s=1.0, per_mb_timeout_s=0
    )
    result = await transport.parse_layout(make_pdf([(595, 842)] * 4))
    assert len(result.page_sizes) == 4


@pytest.mark.parametrize("serial", [True, False])
async def test_a_serialising_server_runs_one_request_at_a_time(
    fake_monkeyocr: FakeMonkeyOcr, make_transport: MakeTransport, serial: bool
) -> None:
    fake_monkeyocr.configure("a", serial=serial)
    fake_monkeyocr.script("a", *(Reply.ok(delay_s=0.2) for _ in range(3)))
    transport = make_transport("a")
    results = await asyncio.gather(*(transport.recognize_text(make_png()) for _ in range(3)))
    assert all(r.text for r in results)
    assert fake_monkeyocr.max_inflight("a") == (1 if serial else 3)


async def test_the_fake_also_runs_on_the_callers_loop() -> None:
    async with FakeMonkeyOcr() as fake:
        fake.script("x", Reply.ok("on this loop"))
        transport = MonkeyOcrTransport(monkey_source(fake.base_url("x")))
        try:
            assert (await transport.recognize_text(make_png())).text == "on this loop"
        finally:
            await transport.aclose()
        await fake.wait_until_async(lambda f: f.open_connections == 0)


def test_a_taken_port_is_reported_by_in_thread() -> None:
    with FakeMonkeyOcr.in_thread() as first:
        busy = first.port
        with pytest.raises(OSError):  # noqa: SIM117 - the error comes from entering the second
            with FakeMonkeyOcr.in_thread(port=busy):
                pass
