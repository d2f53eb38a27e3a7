"""The OCR scope and a chat scope sharing one breaker: state is per scope and source, so a
failing chat ``openai-1`` leaves the OCR scope's ``openai-1`` serving (through the fake
upstream and the fake MonkeyOCR server)."""

from __future__ import annotations

import pytest
from pgw_monkeyocr import OcrClient
from pgw_monkeyocr.testing import FakeMonkeyOcr, make_png
from polygateway import GatewayClient
from polygateway.errors import AllSourcesExhausted
from polygateway.testing import FakeUpstream, Reply

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_a_failing_chat_source_leaves_the_same_named_ocr_source_serving(
    fake_upstream: FakeUpstream, fake_monkeyocr: FakeMonkeyOcr
) -> None:
    env = {
        "LLM__OPENAI__1__BASE_URL": fake_upstream.base_url("chat"),
        "LLM__OPENAI__1__MODEL": "chat-model",
        "LLM__OPENAI__1__API_KEY": "sk-test",
        "OCR__OPENAI__1__BASE_URL": fake_monkeyocr.base_url("a"),
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
    }
    for scope in ("LLM", "OCR"):
        env[f"{scope}__BREAKER__FAIL_THRESHOLD"] = "1"
        env[f"{scope}__RETRY__MAX_ATTEMPTS"] = "1"
        env[f"{scope}__BACKPRESSURE__QUOTA_FULL"] = "fail_fast"
    fake_upstream.set_default("chat", Reply.error(503))
    llm = GatewayClient.from_env(env=env, pipeline_path=None)
    async with llm, OcrClient.from_env(env=env, breaker=llm.breaker) as ocr:
        assert [s.name for s in ocr.settings.sources] == ["openai-1"]
        with pytest.raises(AllSourcesExhausted):
            await llm.chat(MESSAGES)
        assert await llm.breaker.state("openai-1") == "open"
        result = await ocr.recognize_text(make_png())
        assert result.source_name == "openai-1"
        assert await ocr.breaker.state("openai-1") == "closed"
