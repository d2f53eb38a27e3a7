"""The README's injection sample runs as written (its imports included) against real Redis."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _sample() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1
    return blocks[0]


async def test_the_injection_sample_runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    code = _sample()
    assert 'url = "redis://127.0.0.1:6379/0"' in code
    for key, value in {
        "LLM__OPENAI__1__BASE_URL": "http://127.0.0.1:9/v1",
        "LLM__OPENAI__1__MODEL": "m",
        "PGW_PLUGINS": "",
        "PGW_TELEMETRY_BACKEND": "none",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(README.parent)  # no ./.env or ./pgw.toml of the repository's
    namespace: dict[str, object] = {}
    exec(
        compile(code.replace("redis://127.0.0.1:6379/0", redis_url), str(README), "exec"), namespace
    )
    client = namespace["client"]
    try:
        limiter = namespace["limiter"]
        permit = await limiter.try_acquire("openai-1", 1, namespace["Limits"]())  # type: ignore[attr-defined]
        await permit.release()
    finally:
        await client.aclose()  # type: ignore[attr-defined]
