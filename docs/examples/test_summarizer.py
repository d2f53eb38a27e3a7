"""A downstream project's test: its own code (``summarize``) against the fake upstream.

Run it with ``python -m pytest docs/examples/test_summarizer.py``: the ``fake_upstream``
fixture comes from the library's pytest plugin (installed with ``polygateway-core``).
"""

from __future__ import annotations

import pytest
from polygateway import GatewayClient
from polygateway.testing import FakeUpstream, Reply


async def summarize(client: GatewayClient, text: str) -> str:
    """The application's code under test."""
    response = await client.chat([{"role": "user", "content": f"Summarize: {text}"}])
    return response.content.strip()


def env_for(fake: FakeUpstream, *sources: str) -> dict[str, str]:
    env = {
        "PGW_PLUGINS": "",
        "PGW_TELEMETRY_BACKEND": "none",
        "PGW_CACHE_BACKEND": "none",
        "LLM__RETRY__BASE_DELAY_S": "0.01",
    }
    for n, source in enumerate(sources, 1):
        env[f"LLM__OPENAI__{n}__BASE_URL"] = fake.base_url(source)
        env[f"LLM__OPENAI__{n}__MODEL"] = "gpt-test"
        env[f"LLM__OPENAI__{n}__API_KEY"] = f"sk-test-{n}"
    return env


async def test_summarize_returns_the_answer(fake_upstream: FakeUpstream) -> None:
    fake_upstream.set_default("main", Reply.ok(content="A short summary."))
    async with GatewayClient.from_env(env=env_for(fake_upstream, "main")) as client:
        assert await summarize(client, "a long text") == "A short summary."
    [request] = fake_upstream.received("main")
    assert request.body["messages"][0]["content"] == "Summarize: a long text"


async def test_a_rate_limited_source_is_retried_elsewhere(fake_upstream: FakeUpstream) -> None:
    # A Retry-After longer than the scope's WAIT_RETRY_AFTER_UP_TO_S (3 s) cools the source
    # and the call switches; a shorter one would be waited out on the same source.
    fake_upstream.script("busy", Reply.error(429, retry_after=30))
    fake_upstream.set_default("spare", Reply.ok(content="From the spare."))
    env = {**env_for(fake_upstream, "busy", "spare"), "LLM__SELECTOR": "round_robin"}
    async with GatewayClient.from_env(env=env) as client:
        assert await summarize(client, "text") == "From the spare."
    assert fake_upstream.requests("busy") == 1 and fake_upstream.requests("spare") == 1


async def test_a_revoked_key_is_a_clear_error(fake_upstream: FakeUpstream) -> None:
    from polygateway import AllSourcesExhausted

    fake_upstream.set_default("main", Reply.error(401))
    async with GatewayClient.from_env(env=env_for(fake_upstream, "main")) as client:
        with pytest.raises(AllSourcesExhausted) as caught:
            await summarize(client, "text")
    assert caught.value.per_source_reasons == {"openai-1": "source_dead"}
