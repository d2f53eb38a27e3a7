"""``OcrClient``: OCR calls governed by the core's ``Governor`` over real HTTP to the fake."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from pgw_monkeyocr import OcrClient
from pgw_monkeyocr.testing import FakeMonkeyOcr, Reply, make_pdf, make_png
from pgw_monkeyocr.transport import MonkeyOcrTransport
from polygateway.errors import (
    AllSourcesExhausted,
    CircuitOpenError,
    ConfigError,
    RequestRejectedError,
    ResultInvalidError,
)
from polygateway.plugins import load_registry
from polygateway.telemetry.report import read_sqlite_rows

MakeClient = Callable[..., OcrClient]


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "ocr_telemetry.db")


@pytest.fixture
async def make_client(fake_monkeyocr: FakeMonkeyOcr, db: str) -> AsyncIterator[MakeClient]:
    """``make_client(*base_urls, **extra_env)``: an ``OcrClient.from_env`` with one source per
    URL (``OCR__MONKEY__{i}__BASE_URL``), SQLite telemetry in ``db``, no backoff delay."""
    made: list[OcrClient] = []

    def make(*urls: str, **extra: str) -> OcrClient:
        env = {
            "PGW_TELEMETRY_BACKEND": "sqlite",
            "PGW_TELEMETRY_SQLITE_PATH": db,
            "OCR__RETRY__BASE_DELAY_S": "0",
            "OCR__RETRY__MAX_DELAY_S": "0",
        }
        for index, url in enumerate(urls or (fake_monkeyocr.base_url("a"),), start=1):
            env[f"OCR__MONKEY__{index}__BASE_URL"] = url
        env.update(extra)
        client = OcrClient.from_env(env=env)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.aclose()


async def _rows(client: OcrClient, db: str) -> list[dict[str, Any]]:
    await client.aclose()  # flushes every row
    return sorted(read_sqlite_rows(db), key=lambda r: r["created_at"])


def test_the_plugin_registers_the_monkeyocr_ocr_transport(fake_monkeyocr: FakeMonkeyOcr) -> None:
    registry = load_registry()
    assert "monkeyocr" in registry.names("ocr_transport")
    assert registry.provider_of("ocr_transport", "monkeyocr") == "pgw-monkeyocr"


async def test_from_env_builds_one_transport_per_source(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient
) -> None:
    client = make_client(
        fake_monkeyocr.base_url("a"),
        fake_monkeyocr.base_url("b"),
        OCR__MONKEY__2__MODE="split",
        OCR__MONKEY__2__TRUST_ENV="true",
        OCR__MONKEY__1__MAX_CONCURRENCY="1",
    )
    assert [s.name for s in client.settings.sources] == ["monkey-1", "monkey-2"]
    assert [s.model for s in client.settings.sources] == ["monkeyocr", "monkeyocr"]
    first, second = (client.transports[n] for n in ("monkey-1", "monkey-2"))
    assert isinstance(first, MonkeyOcrTransport) and isinstance(second, MonkeyOcrTransport)
    assert (first.options.mode, second.options.mode) == ("standard", "split")
    assert (first.options.trust_env, second.options.trust_env) == (False, True)
    assert client.settings.sources[0].limits.max_concurrency == 1
    # Leases and probes outlive the longest OCR call, not only timeout_s.
    assert client.settings.lease_ttl_s >= first.max_deadline_s + 30
    assert client.settings.probe_ttl_s >= first.max_deadline_s + 5
    assert await client.source_health() == {"monkey-1": True, "monkey-2": True}


async def test_text_and_layout_round_trips_write_a_row_with_the_digest(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    client = make_client()
    image = make_png(800, 600)
    text = await client.recognize_text(image, session_id="s-1")
    layout = await client.parse_layout(make_pdf([(595, 842)] * 3), parent_call_id="p-1")
    assert text.text and text.source_name == "monkey-1"
    assert layout.page_sizes == ((595.0, 842.0),) * 3
    first, second = await _rows(client, db)
    request = json.loads(first["messages"])
    assert request == {
        "ocr": "text",
        "image": f"sha256:{hashlib.sha256(image).hexdigest()}",
        "bytes": len(image),
        "kind": "png",
        "pages": 1,
    }
    assert first["session_id"] == "s-1" and first["error"] is None
    assert first["response"] == text.text
    assert first["source_name"] == "monkey-1" and first["model"] == "monkeyocr"
    assert first["prompt_tokens"] == 0 and first["completion_tokens"] == 0
    assert first["latency_ms"] >= 0 and first["latency_ms"] == text.usage.elapsed_ms
    assert json.loads(second["messages"])["ocr"] == "layout"
    assert json.loads(second["messages"])["pages"] == 3
    assert json.loads(second["response"]) == {
        "elements": len(layout.elements),
        "pages": 3,
        "bbox_issues": 0,
    }
    assert second["parent_call_id"] == "p-1"
    # Never the bytes: the PNG's signature appears in no column.
    assert all("PNG" not in str(value) for row in (first, second) for value in row.values())


@pytest.mark.parametrize("how", ["connection-refused", "503"])
async def test_a_source_down_switches_to_the_next(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str, how: str
) -> None:
    if how == "503":
        down = fake_monkeyocr.base_url("down")
        fake_monkeyocr.script("down", Reply.with_status(503, "Service Unavailable"))
    else:
        down = _dead_url()
    # No same-source retry (on by default for 5xx and wire faults): the switch is the point.
    client = make_client(
        down,
        fake_monkeyocr.base_url("b"),
        OCR__SELECTOR="round_robin",
        OCR__RETRY__SAME_SOURCE_ATTEMPTS="0",
    )
    result = await client.parse_layout(make_png(800, 600))
    assert result.source_name == "monkey-2" and len(result.elements) == 7
    failed, answered = await _rows(client, db)
    assert (failed["source_name"], failed["error"]) == ("monkey-1", "TransientError")
    assert (answered["source_name"], answered["error"]) == ("monkey-2", None)
    assert failed["messages"] == answered["messages"]  # the same image digest on every attempt
    assert answered["latency_ms"] >= 0


async def test_a_dead_source_is_left_at_once_and_its_breaker_opened(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient
) -> None:
    fake_monkeyocr.script("a", Reply.with_status(401, {"detail": "Not authenticated"}))
    client = make_client(fake_monkeyocr.base_url("a"), fake_monkeyocr.base_url("b"))
    result = await client.recognize_text(make_png())
    assert result.source_name == "monkey-2"
    assert await client.breaker.state("monkey-1") == "open"


async def test_bad_requests_and_bad_results_are_not_retried(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    client = make_client(fake_monkeyocr.base_url("a"), fake_monkeyocr.base_url("b"))
    # Whichever source a call goes to, it fails the same way; one attempt, no retry or switch.
    for source in ("a", "b"):
        fake_monkeyocr.script(source, Reply.ocr_failed("400: Unsupported file type: .bmp."))
    with pytest.raises(RequestRejectedError):
        await client.recognize_text(make_png())
    assert len(fake_monkeyocr.uploads()) == 1
    fake_monkeyocr.reset()
    for source in ("a", "b"):
        fake_monkeyocr.script(source, Reply.zip("no_middle"))
    with pytest.raises(ResultInvalidError):
        await client.parse_layout(make_png())
    assert len(fake_monkeyocr.uploads()) == 1
    assert await client.breaker.state("monkey-1") == "closed"
    assert await client.breaker.state("monkey-2") == "closed"
    rows = await _rows(client, db)
    assert [r["error"] for r in rows] == ["RequestRejectedError", "ResultInvalidError"]


async def test_unusable_bytes_never_reach_the_governor(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    client = make_client()
    with pytest.raises(RequestRejectedError, match="PDF, PNG and JPEG"):
        await client.recognize_text(b"GIF89a....")
    assert fake_monkeyocr.uploads() == []
    await client.aclose()
    # No row was written: the database was never even created.
    assert not await asyncio.to_thread(Path(db).exists)


async def test_retries_are_bounded(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    fake_monkeyocr.script("a", *(Reply.parse_failed("CUDA out of memory") for _ in range(5)))
    client = make_client(OCR__RETRY__MAX_ATTEMPTS="3")
    with pytest.raises(AllSourcesExhausted) as caught:
        await client.parse_layout(make_png())
    assert caught.value.reason == "retry_exhausted"
    assert len(fake_monkeyocr.uploads("a")) == 3
    assert [r["error"] for r in await _rows(client, db)] == ["TransientError"] * 3


async def test_ocr_charges_no_tokens(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient
) -> None:
    # A TPM of 1 admits OCR calls: they are charged 0 tokens, before and after.
    client = make_client(OCR__MONKEY__1__TPM="1")
    for _ in range(3):
        await client.recognize_text(make_png())
    stats = await client.limiter.source_stats("monkey-1")
    assert stats.tpm_used == 0 and stats.rpm_used == 3


async def test_max_concurrency_one_queues_on_the_client(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient
) -> None:
    fake_monkeyocr.configure("a", serial=False)
    fake_monkeyocr.script("a", *(Reply.ok(delay_s=0.1) for _ in range(3)))
    client = make_client(OCR__MONKEY__1__MAX_CONCURRENCY="1")
    results = await asyncio.gather(*(client.recognize_text(make_png()) for _ in range(3)))
    assert len(results) == 3
    assert fake_monkeyocr.max_inflight("a") == 1


async def test_cancelling_a_governed_call_releases_everything(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    fake_monkeyocr.script("a", Reply.zip(download="stall", padding=512 * 1024))
    client = make_client(OCR__MONKEY__1__MAX_CONCURRENCY="1")
    task = asyncio.create_task(client.parse_layout(make_png()))
    await fake_monkeyocr.wait_until_async(lambda f: f.stalled_downloads == 1)
    assert await client.limiter.inflight() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await client.limiter.inflight() == 0
    await fake_monkeyocr.wait_until_async(lambda f: f.open_connections == 0)
    # The permit came back: the next call is admitted and answered.
    assert (await client.recognize_text(make_png())).text
    rows = await _rows(client, db)
    assert [r["error"] for r in rows] == ["cancelled", None]


async def test_health_of_every_source(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient
) -> None:
    fake_monkeyocr.configure("b", model_loaded=False)
    client = make_client(fake_monkeyocr.base_url("a"), fake_monkeyocr.base_url("b"), _dead_url())
    assert await client.source_health() == {
        "monkey-1": True,
        "monkey-2": False,
        "monkey-3": False,
    }
    assert await client.check_health() is True


def test_an_unknown_ocr_transport_is_named_at_its_key(fake_monkeyocr: FakeMonkeyOcr) -> None:
    env = {
        "OCR__MONKEY__1__BASE_URL": fake_monkeyocr.base_url("a"),
        "OCR__MONKEY__1__TRANSPORT": "tesseract",
        "PGW_TELEMETRY_BACKEND": "none",
    }
    with pytest.raises(ConfigError) as caught:
        OcrClient.from_env(env=env)
    assert caught.value.problems == (
        "OCR__MONKEY__1__TRANSPORT: ocr_transport 'tesseract' is not registered; registered "
        "ocr_transport names: monkeyocr",
    )


def test_no_sources_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="OCR__"):
        OcrClient.from_env(env={"PGW_TELEMETRY_BACKEND": "none"})


async def test_a_call_refused_before_any_attempt_still_leaves_a_row(
    fake_monkeyocr: FakeMonkeyOcr, make_client: MakeClient, db: str
) -> None:
    client = make_client(OCR__BACKPRESSURE__QUOTA_FULL="fail_fast")
    await client.breaker.force_open("monkey-1")
    with pytest.raises(CircuitOpenError):
        await client.recognize_text(make_png())
    assert fake_monkeyocr.uploads() == []
    (row,) = await _rows(client, db)
    assert row["error"] == "CircuitOpenError" and row["source_name"] == ""
    assert json.loads(row["messages"])["ocr"] == "text"


def test_transport_options_for_an_unknown_source_are_a_config_error(
    fake_monkeyocr: FakeMonkeyOcr,
) -> None:
    env = {
        "OCR__MONKEY__1__BASE_URL": fake_monkeyocr.base_url("a"),
        "OCR__MONKEY__2__MODE": "split",
        "PGW_TELEMETRY_BACKEND": "none",
    }
    with pytest.raises(ConfigError) as caught:
        OcrClient.from_env(env=env)
    assert caught.value.problems == ("OCR__MONKEY__2__BASE_URL: required (source monkey-2)",)


def test_an_unknown_source_field_names_the_transport_options_too() -> None:
    env = {"OCR__MONKEY__1__BASE_URL": "http://127.0.0.1:1", "OCR__MONKEY__1__MOD": "split"}
    with pytest.raises(ConfigError) as caught:
        OcrClient.from_env(env=env)
    [problem] = caught.value.problems
    assert problem.startswith("OCR__MONKEY__1__MOD: unknown source field MOD (did you mean MODE?)")
    assert "PER_PAGE_TIMEOUT_S" in problem
