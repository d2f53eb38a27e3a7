"""An embedding scope and a chat scope sharing one breaker, through the fake upstream: breaker
state is per scope and source, so a failing ``openai-1`` of LLM leaves EMBED's ``openai-1``
serving, and the other way round."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from pgw_embedding import EmbeddingClient
from pgw_embedding_test_helpers import registry
from polygateway import GatewayClient
from polygateway.errors import AllSourcesExhausted
from polygateway.testing import FakeUpstream, Reply

MESSAGES = [{"role": "user", "content": "hello"}]
# One attempt per call, the first failure opens the breaker, an open breaker fails at once.
STRICT = {
    "BREAKER__FAIL_THRESHOLD": "1",
    "BREAKER__COOLDOWN_S": "60",
    "RETRY__MAX_ATTEMPTS": "1",
    "BACKPRESSURE__QUOTA_FULL": "fail_fast",
}


def _env(fake: FakeUpstream) -> dict[str, str]:
    env = {
        "LLM__OPENAI__1__BASE_URL": fake.base_url("chat"),
        "LLM__OPENAI__1__MODEL": "chat-model",
        "LLM__OPENAI__1__API_KEY": "sk-test",
        "EMBED__OPENAI__1__BASE_URL": fake.base_url("vectors"),
        "EMBED__OPENAI__1__MODEL": "text-embedding-3-small",
        "EMBED__OPENAI__1__API_KEY": "sk-test",
        "EMBED__BATCH_SIZE": "8",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
    }
    for scope in ("LLM", "EMBED"):
        env.update({f"{scope}__{key}": value for key, value in STRICT.items()})
    return env


@pytest.fixture
async def clients(
    fake_upstream: FakeUpstream,
) -> AsyncIterator[tuple[GatewayClient, EmbeddingClient]]:
    env = _env(fake_upstream)
    llm = GatewayClient.from_env(env=env, pipeline_path=None, registry=registry())
    embed = EmbeddingClient.from_env(env=env, registry=registry(), breaker=llm.breaker)
    try:
        yield llm, embed
    finally:
        await embed.aclose()
        await llm.aclose()


async def test_a_failing_chat_source_leaves_the_same_named_embedding_source_serving(
    fake_upstream: FakeUpstream, clients: tuple[GatewayClient, EmbeddingClient]
) -> None:
    llm, embed = clients
    fake_upstream.set_default("chat", Reply.error(503))
    with pytest.raises(AllSourcesExhausted):
        await llm.chat(MESSAGES)
    assert await llm.breaker.state("openai-1") == "open"
    response = await embed.embed(["hello"])
    assert response.source_name == "openai-1"
    assert fake_upstream.requests("vectors", route="embeddings") == 1
    assert await embed.breaker.state("openai-1") == "closed"


async def test_a_failing_embedding_source_leaves_the_same_named_chat_source_serving(
    fake_upstream: FakeUpstream, clients: tuple[GatewayClient, EmbeddingClient]
) -> None:
    llm, embed = clients
    fake_upstream.set_default("vectors", Reply.error(503), route="embeddings")
    with pytest.raises(AllSourcesExhausted):
        await embed.embed(["hello"])
    assert await embed.breaker.state("openai-1") == "open"
    assert (await llm.chat(MESSAGES)).source_name == "openai-1"
    assert await llm.breaker.state("openai-1") == "closed"
