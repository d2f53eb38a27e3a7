"""``pgw logs`` through the real CLI (subprocess), over a database the SQLite recorder wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_telemetry_cli import clean_env, pgw, record, write_db


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "logs.db"
    write_db(
        path,
        [
            record(1, session_id="alpha", messages='[{"role":"user","content":"first question"}]'),
            record(2, session_id="beta", source_name="qwen-1", model="qwen-plus"),
            record(3, session_id="alpha", error="TransientError", response="", cost=None),
            # The retry of call 3, answered: one call of two attempts.
            record(4, session_id="alpha", response="the newest answer", root_call_id="call-0003"),
        ],
    )
    return path


def call_ids(stdout: str) -> list[str]:
    return [row["call_id"] for row in json.loads(stdout)]


def test_newest_rows_first_and_filters(tmp_path: Path, db: Path) -> None:
    base = ("logs", "--db", str(db), "--json")
    assert call_ids(pgw(tmp_path, *base).stdout) == ["call-0004", "call-0003", "call-0002"]
    assert call_ids(pgw(tmp_path, *base, "-n", "1").stdout) == ["call-0004"]
    assert call_ids(pgw(tmp_path, *base, "-n", "0").stdout) == [
        "call-0004",
        "call-0003",
        "call-0002",
        "call-0001",
    ]
    assert call_ids(pgw(tmp_path, *base, "--session", "beta").stdout) == ["call-0002"]
    assert call_ids(pgw(tmp_path, *base, "--source", "qwen-1").stdout) == ["call-0002"]
    assert call_ids(pgw(tmp_path, *base, "-m", "qwen-plus").stdout) == ["call-0002"]
    assert call_ids(pgw(tmp_path, *base, "--errors").stdout) == ["call-0003"]
    assert call_ids(pgw(tmp_path, *base, "--call", "call-0003").stdout) == [
        "call-0004",
        "call-0003",
    ]
    assert call_ids(pgw(tmp_path, *base, "--since", "2025-12-01T12:25:00").stdout) == [
        "call-0004",
        "call-0003",
    ]
    rows = json.loads(pgw(tmp_path, *base, "-n", "1").stdout)
    assert rows[0]["messages"] == [{"role": "user", "content": "hi"}]  # decoded, not a string
    assert rows[0]["cache_hit"] is False


def test_text_rows_and_show_one_in_full(tmp_path: Path, db: Path) -> None:
    text = pgw(tmp_path, "logs", "--db", str(db), "-n", "2").stdout
    assert text.startswith("## 2025-12-01 12:40:00 UTC  call-0004  ok  (call call-0003)\n")
    assert "### response\nthe newest answer" in text
    assert "call-0003  error TransientError" in text
    assert "latency 1 ms" in text and "cost 0.002800" in text
    shown = pgw(tmp_path, "logs", "show", "call-0001", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert "session_id: alpha" in shown.stdout and "user: first question" in shown.stdout
    as_json = json.loads(
        pgw(tmp_path, "logs", "show", "call-0001", "--db", str(db), "--json").stdout
    )
    assert as_json["call_id"] == "call-0001" and as_json["session_id"] == "alpha"
    ambiguous = pgw(tmp_path, "logs", "show", "call-000", "--db", str(db))
    assert ambiguous.returncode == 2
    assert "4 rows have a call_id starting with 'call-000'" in ambiguous.stderr


def test_the_database_the_configuration_names(tmp_path: Path, db: Path) -> None:
    env = clean_env(PGW_TELEMETRY_SQLITE_PATH=str(db))
    assert pgw(tmp_path, "logs", "path", env=env).stdout.strip() == str(db)
    assert call_ids(pgw(tmp_path, "logs", "--json", "-n", "1", env=env).stdout) == ["call-0004"]
    assert pgw(tmp_path, "logs", "path").stdout.strip() == str(tmp_path / "pgw_telemetry.db")
    missing = pgw(tmp_path, "logs")
    assert missing.returncode == 2 and "no such file" in missing.stderr


CHAT_ONCE = """
import asyncio
from polygateway import GatewayClient
from polygateway.testing import FakeUpstream, Reply


async def main():
    async with FakeUpstream() as fake:
        fake.set_default("a", Reply.ok(content="the secret answer"))
        env = {{
            "LLM__OPENAI__1__BASE_URL": fake.base_url("a"),
            "LLM__OPENAI__1__MODEL": "m",
            "PGW_PLUGINS": "",
            "PGW_TELEMETRY_SQLITE_PATH": {db!r},
            "PGW_TELEMETRY_CONTENT": {content!r},
        }}
        async with GatewayClient.from_env(env=env) as client:
            await client.chat([{{"role": "user", "content": "the private question"}}])


asyncio.run(main())
"""


@pytest.mark.parametrize("content", ["full", "digest", "none"])
def test_telemetry_content_setting(tmp_path: Path, content: str) -> None:
    import hashlib
    import subprocess
    import sys

    db = tmp_path / "c.db"
    done = subprocess.run(
        [sys.executable, "-c", CHAT_ONCE.format(db=str(db), content=content)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    env = clean_env(PGW_TELEMETRY_SQLITE_PATH=str(db))
    row = json.loads(pgw(tmp_path, "logs", "--json", "-n", "1", env=env).stdout)[0]
    stored = (json.dumps(row["messages"]), row["response"])
    if content == "full":
        assert row["messages"] == [{"role": "user", "content": "the private question"}]
        assert row["response"] == "the secret answer"
    elif content == "digest":
        expected = "sha256:" + hashlib.sha256(b"the secret answer").hexdigest()
        assert row["response"] == expected
        assert str(row["messages"]).startswith("sha256:")
        assert "private" not in stored[0]
    else:
        assert row["messages"] == [] or row["messages"] == ""
        assert row["response"] == ""
    assert row["prompt_tokens"] >= 0 and row["model"] == "m"  # the rest of the row stays
    check = pgw(
        tmp_path,
        "config",
        "check",
        env=clean_env(
            LLM__OPENAI__1__BASE_URL="http://127.0.0.1:9/v1",
            LLM__OPENAI__1__MODEL="m",
            PGW_TELEMETRY_CONTENT=content,
        ),
    )
    assert f"    content: {content}" in check.stdout


def test_a_bad_content_value_names_the_key(tmp_path: Path) -> None:
    env = clean_env(
        LLM__OPENAI__1__BASE_URL="http://127.0.0.1:9/v1",
        LLM__OPENAI__1__MODEL="m",
        PGW_TELEMETRY_CONTENT="secret",
    )
    result = pgw(tmp_path, "config", "check", env=env)
    assert result.returncode == 2
    assert "pgw: PGW_TELEMETRY_CONTENT: must be 'full', 'digest' or 'none', got 'secret'" in (
        result.stderr
    )
