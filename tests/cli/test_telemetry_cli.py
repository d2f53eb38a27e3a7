"""``pgw telemetry report`` through the real CLI (subprocess): counts, units, charts, the
database the configuration names, and totals equal to ``pgw demo``'s on the same database."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from polygateway.telemetry.report import read_sqlite_rows
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.types import TelemetryRecord

REPO = Path(__file__).resolve().parents[2]
CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*__|^(LLM|PGW)_|^REDIS_URL$")
START = 1_764_590_400.0  # 2025-12-01 12:00:00 UTC


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not CONFIG_KEY.search(k)}
    env["PGW_PLUGINS"] = ""
    env.update(extra)
    return env


def pgw(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polygateway", *args],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def record(i: int, **overrides: object) -> TelemetryRecord:
    fields: dict[str, object] = {
        "call_id": f"call-{i:04d}",
        "parent_call_id": None,
        "session_id": "s1",
        "model": "gpt-test",
        "provider": "openai",
        "source_name": "openai-1",
        "messages": '[{"role":"user","content":"hi"}]',
        "response": "ok",
        "thinking": "",
        "prompt_tokens": 1200,
        "completion_tokens": 800,
        "usage_source": "measured",
        "latency_ms": 1,
        "ttft_ms": 1.0,
        "max_inter_token_ms": 0.5,
        "cache_hit": False,
        "error": None,
        "cost": 0.0028,
        "created_at": START + i * 600.0,
    }
    fields.update(overrides)
    return TelemetryRecord(**fields)  # type: ignore[arg-type]


def write_db(path: Path, records: list[TelemetryRecord]) -> None:
    async def write() -> None:
        recorder = SQLiteRecorder(str(path))
        for item in records:
            await recorder.record(item)
        await recorder.aclose()

    asyncio.run(write())


@pytest.fixture
def small_db(tmp_path: Path) -> Path:
    """Six hours of rows, a few ms each: a small, narrow data set."""
    path = tmp_path / "small.db"
    rows = [record(i, latency_ms=1 + i % 2) for i in range(30)]
    # The last quarter hour holds only a row without a price.
    rows += [record(40, cost=None, model="unpriced-model", created_at=START + 5 * 3600 + 600)]
    rows += [record(41, cache_hit=True, latency_ms=0, cost=0.0, ttft_ms=None, created_at=START)]
    rows += [
        record(42, error="TransientError", prompt_tokens=0, completion_tokens=0, cost=None),
        record(43, error="QuotaExhaustedError", source_name="", provider="", cost=None),
    ]
    rows[-2:] = [
        dataclasses.replace(r, created_at=START + 60, prompt_tokens=0, completion_tokens=0)
        for r in rows[-2:]
    ]
    write_db(path, rows)
    return path


def test_counts_units_and_currency(tmp_path: Path, small_db: Path) -> None:
    prices = REPO / "docs" / "pricing.example.json"
    env = clean_env(PGW_PRICING_PATH=str(prices))
    result = pgw(tmp_path, "telemetry", "report", "--db", str(small_db), env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"{small_db}: 34 rows, 2025-12-01 12:00:00 UTC to 2025-12-01 17:10:00 UTC" in out
    assert "calls 34: 32 answered, 2 failed\n" in out  # a failed attempt, a refused call
    assert "answered calls 32 (31 by a source, 1 from the cache)" in out
    assert "attempts 32 (31 ok, 1 failed; 0 after a call's first)" in out
    assert "cache hits 1\n" in out and "refused before any attempt 1\n" in out
    assert "tokens 38,400 prompt + 25,600 completion" in out  # integers, never 8.0000
    assert "cost 0.084000 USD (1 attempt without a price)" in out
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert re.search(r"\b2 ms\b", total) and "0.084000 USD" in total
    assert not re.search(r"\d\.0000\b", out)


def test_the_html_page_names_the_db_and_range_and_never_draws_unpriced_as_zero(
    tmp_path: Path, small_db: Path
) -> None:
    page_path = tmp_path / "report.html"
    result = pgw(tmp_path, "telemetry", "report", "--db", str(small_db), "--html", str(page_path))
    assert result.returncode == 0, result.stderr
    page = page_path.read_text(encoding="utf-8")
    assert f"Database: <code>{small_db}</code>" in page
    assert "from 2025-12-01 12:00:00 UTC to 2025-12-01 17:10:00 UTC" in page
    assert "1-1 ms" not in page and "1 ms - 1 ms" not in page
    assert "1 ms - 2 ms" in page and "2 ms - 3 ms" in page
    # 5 h 10 min of rows: 15-minute buckets; the bucket holding only the unpriced row says so.
    assert "Cost over time (per 15 min, UTC)" in page
    assert "no price" in page
    assert "latency (ms)" in page and "cost (price-table units)" in page and "time (UTC)" in page
    assert "(none: refused)" in page  # the refused call's error, not a source named "-"


def test_the_report_finds_the_database_the_configuration_names(
    tmp_path: Path, small_db: Path
) -> None:
    target = tmp_path / "configured.db"
    shutil.copy(small_db, target)
    env = clean_env(PGW_TELEMETRY_SQLITE_PATH=str(target))
    result = pgw(tmp_path, "telemetry", "report", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{target}: 34 rows")
    (tmp_path / ".env").write_text(f"PGW_TELEMETRY_SQLITE_PATH={target}\n", encoding="utf-8")
    assert pgw(tmp_path, "telemetry", "report").stdout.startswith(f"{target}: 34 rows")
    (tmp_path / ".env").unlink()
    (tmp_path / "pgw.toml").write_text(
        f"[scopes.LLM.telemetry]\nsqlite_path = {json.dumps(str(target))}\n"
        "[[scopes.LLM.sources]]\nprovider = 'openai'\nbase_url = 'http://127.0.0.1:9/v1'\n"
        "model = 'm'\n",
        encoding="utf-8",
    )
    assert pgw(tmp_path, "telemetry", "report").stdout.startswith(f"{target}: 34 rows")
    (tmp_path / "pgw.toml").unlink()
    missing = pgw(tmp_path, "telemetry", "report")
    assert missing.returncode == 2
    assert "pgw_telemetry.db (from the default): no such file" in missing.stderr


def test_report_totals_match_the_demo_summary_on_the_same_database(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    demo = pgw(tmp_path, "demo", "--calls", "40", "--concurrency", "8", "--quiet", "--db", str(db))
    assert demo.returncode == 0, demo.stderr
    # The demo's price table is gone with it; one with the same currency label names it.
    env = clean_env(PGW_PRICING_PATH=str(REPO / "docs" / "pricing.example.json"))
    report = pgw(tmp_path, "telemetry", "report", "--db", str(db), "--by", "source", env=env)
    assert report.returncode == 0, report.stderr
    from_demo = demo.stdout.split("(what `pgw telemetry report` prints for it):\n", 1)[1]
    demo_lines = [line.strip() for line in from_demo.splitlines()[:7]]
    report_lines = report.stdout.splitlines()
    start = next(i for i, line in enumerate(report_lines) if line.startswith("calls "))
    assert demo_lines == report_lines[start : start + 7]
    # The calls the demo made and saw fail (counted by the demo itself, not from the rows) are
    # the calls and failed calls the report counts in the rows.
    made = re.search(r"^calls made (\d+): (\d+) answered, (\d+) failed", demo.stdout, re.M)
    assert made is not None, demo.stdout
    calls, answered, failed = made.groups()
    assert (calls, answered, failed) == ("41", "39", "2")
    assert f"calls {calls}: {answered} answered, {failed} failed" in report_lines
    # In the rows: 41 calls by root_call_id, two with every row an error.
    rows = read_sqlite_rows(str(db))
    by_call: dict[str, list[dict[str, object]]] = {}
    for row in rows:
        by_call.setdefault(str(row["root_call_id"]), []).append(row)
    failed_calls = [rs for rs in by_call.values() if all(r["error"] for r in rs)]
    assert len(by_call) == 41 and len(failed_calls) == 2
    total = next(line for line in report_lines if line.startswith("total"))
    assert total.split()[1:3] == ["41", "2"]  # calls, failed calls


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BAR = (0x4A, 0x78, 0xC2)  # the bars' fill in render_html


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit, non-interlaced RGB(A) PNG (what Chromium's
    screenshot is); enough to look at a page without an imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        if kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                near = min((abs(guess - left), 0), (abs(guess - up), 1), (abs(guess - corner), 2))
                line[i] = (line[i] + (left, up, corner)[near[1]]) & 0xFF
        previous = line
        rgb = line if channels == 3 else bytes(b for j, b in enumerate(line) if j % 4 != 3)
        rows.append(bytes(rgb))
    return width, height, rows


def test_the_page_renders_in_headless_chromium(tmp_path: Path, small_db: Path) -> None:
    """The page as a browser draws it: not blank, bars drawn, and an axis line under each of
    the four charts. Runs wherever Chromium is installed; CI installs it (``.ci/run``)."""
    if CHROMIUM is None:
        if os.environ.get("PGW_REQUIRE_SERVICES") == "1":
            pytest.fail("headless Chromium is not installed and PGW_REQUIRE_SERVICES=1")
        pytest.skip("headless Chromium is not installed")
    page_path = tmp_path / "report.html"
    made = pgw(tmp_path, "telemetry", "report", "--db", str(small_db), "--html", str(page_path))
    assert made.returncode == 0, made.stderr
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1000,1800",
            page_path.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    width, height, rows = read_png(shot.read_bytes())
    assert (width, height) == (1000, 1800)
    pixels = [row[i : i + 3] for row in rows for i in range(0, len(row), 3)]
    white = sum(1 for p in pixels if min(p) > 245)
    assert white < len(pixels) * 0.97, "the page is blank"
    bars = sum(1 for p in pixels if all(abs(a - b) <= 6 for a, b in zip(p, BAR, strict=True)))
    assert bars > 2000, f"only {bars} bar pixels"
    # The value axes: horizontal dark lines at least 300 px long (one per chart).
    axes = 0
    for row in rows:
        run = longest = 0
        for i in range(0, len(row), 3):
            r, g, b = row[i : i + 3]
            run = run + 1 if max(r, g, b) < 150 and max(r, g, b) - min(r, g, b) < 12 else 0
            longest = max(longest, run)
        axes += longest >= 300
    assert axes >= 4, f"{axes} axis lines"
