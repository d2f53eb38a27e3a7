"""`pgw chat` makes one governed call with the sources configured in the environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from polygateway.cli import main
from polygateway.testing import FakeUpstream, Reply


@pytest.fixture
def configured(
    fake_upstream: FakeUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> FakeUpstream:
    monkeypatch.chdir(tmp_path)  # no stray .env or pgw.toml
    monkeypatch.setenv("LLM__OPENAI__1__BASE_URL", fake_upstream.base_url("a"))
    monkeypatch.setenv("LLM__OPENAI__1__MODEL", "gpt-test")
    monkeypatch.setenv("LLM__OPENAI__1__API_KEY", "sk-secret-value-123")
    monkeypatch.setenv("PGW_TELEMETRY_BACKEND", "none")
    monkeypatch.setenv("PGW_PLUGINS", "")
    return fake_upstream


def test_chat_prints_the_answer(
    configured: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    configured.script("a", Reply.ok(content="pong"))
    assert main(["chat", "ping"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "pong"
    assert "openai-1" in captured.err
    body = configured.received("a")[0].body
    assert body["messages"] == [{"role": "user", "content": "ping"}]


def test_chat_json_output(configured: FakeUpstream, capsys: pytest.CaptureFixture[str]) -> None:
    configured.script("a", Reply.ok(content="pong", prompt_tokens=7, completion_tokens=1))
    assert main(["chat", "ping", "--json", "--system", "be brief"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["content"] == "pong"
    assert data["source_name"] == "openai-1"
    assert (data["prompt_tokens"], data["completion_tokens"]) == (7, 1)
    assert configured.received("a")[0].body["messages"][0] == {
        "role": "system",
        "content": "be brief",
    }


def test_chat_reports_a_failed_call_without_leaking_the_key(
    configured: FakeUpstream, capsys: pytest.CaptureFixture[str]
) -> None:
    configured.set_default("a", Reply.error(401))
    assert main(["chat", "ping"]) == 1
    err = capsys.readouterr().err
    assert "AllSourcesExhausted" in err
    assert "sk-secret-value-123" not in err


def test_chat_reports_config_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("LLM__", "LLM_", "PGW_")):
            monkeypatch.delenv(key)
    assert main(["chat", "ping"]) == 2
    assert "LLM__<PROVIDER>__<N>__BASE_URL" in capsys.readouterr().err


def test_chat_prints_tokens_as_they_arrive(
    configured: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.pieces: list[str] = []

        def write(self, text: str) -> int:
            self.pieces.append(text)
            return super().write(text)

    out = Writes()
    monkeypatch.setattr("sys.stdout", out)
    configured.script("a", Reply.ok("one two three four", chunks=4, inter_token_delay=0.02))
    assert main(["chat", "ping"]) == 0
    assert out.getvalue().strip() == "one two three four"
    assert len([p for p in out.pieces if p.strip()]) >= 3  # written piece by piece
