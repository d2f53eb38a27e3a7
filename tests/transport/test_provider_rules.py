"""Real providers' errors and stream shapes at the HTTP level, through the fake upstream: error
rules are data in the provider profiles, x-should-retry and 409 follow the OpenAI SDKs, a
deterministic error in a stream is not retried, and Mistral content parts, OpenRouter
reasoning_details and Groq x_groq.usage are read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from polygateway.client import GatewayClient
from polygateway.errors import (
    ContextWindowExceededError,
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    TransientError,
)
from polygateway.ports import ErrorRule, ProviderProfile
from polygateway.providers import builtin_profiles_by_name
from polygateway.settings import (
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    Secret,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import MESSAGES
from polygateway.testing.fake_upstream.openai import provider_error, provider_error_event
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest
from test_openai_compat import ENGINES

OpenSource = Callable[..., tuple[OpenAICompatTransport, SourceConfig]]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_source(engine: str, fake_upstream: FakeUpstream) -> AsyncIterator[OpenSource]:
    made: list[OpenAICompatTransport] = []

    def open_(
        provider: str = "generic",
        *,
        providers: dict[str, ProviderProfile] | None = None,
        **overrides: Any,
    ) -> tuple[OpenAICompatTransport, SourceConfig]:
        name = f"p{len(made)}"
        source = SourceConfig(
            name=name,
            provider=provider,
            base_url=fake_upstream.base_url(name),
            model="m1",
            api_key=Secret("sk-provider-rules-0123456789"),
            timeout_s=overrides.pop("timeout_s", 10.0),
            options={"engine": engine},
            **overrides,
        )
        transport = OpenAICompatTransport(source, providers=providers)
        made.append(transport)
        return transport, source

    yield open_
    for transport in made:
        await transport.aclose()


async def attempt(
    fake: FakeUpstream, open_source: OpenSource, reply: Reply, stream: bool, **kwargs: Any
) -> Any:
    transport, source = open_source(**kwargs)
    fake.script(source.name, reply)
    return await transport.send(ChatRequest(messages=MESSAGES, stream=stream), source, call_id="c1")


# --------------------------------------------------------------------------- error rules

PROVIDER_CASES: list[tuple[str, str, type[PolyGatewayError], int]] = [
    # (fake answer, provider profile, class, status)
    ("dashscope-arrearage", "qwen", SourceDeadError, 400),
    ("zhipu-1113", "zhipu", SourceDeadError, 429),
    ("deepseek-402", "deepseek", SourceDeadError, 402),
    ("deepseek-402", "generic", SourceDeadError, 402),
    ("openai-quota", "openai", SourceDeadError, 429),
    ("relay-quota-no-code", "generic", SourceDeadError, 429),
    ("rate-limit-null-code", "generic", TransientError, 429),
    ("rate-limit-null-code", "openai", TransientError, 429),
    ("groq-tool-use-failed", "generic", RequestRejectedError, 400),
    ("openai-context-length", "openai", ContextWindowExceededError, 400),
    ("openai-409", "openai", TransientError, 409),
    # Without the provider's profile its codes mean nothing: the status decides.
    ("dashscope-arrearage", "generic", RequestRejectedError, 400),
    ("zhipu-1113", "generic", TransientError, 429),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize(
    ("answer", "provider", "expected", "status"),
    PROVIDER_CASES,
    ids=[f"{a}-{p}" for a, p, _, _ in PROVIDER_CASES],
)
async def test_provider_error_answers_land_in_their_class(
    fake_upstream: FakeUpstream,
    open_source: OpenSource,
    answer: str,
    provider: str,
    expected: type[PolyGatewayError],
    status: int,
    stream: bool,
) -> None:
    with pytest.raises(PolyGatewayError) as info:
        await attempt(fake_upstream, open_source, provider_error(answer), stream, provider=provider)
    assert type(info.value) is expected
    assert getattr(info.value, "status", None) == status


async def test_a_plugin_profile_adds_its_own_rules(
    fake_upstream: FakeUpstream, open_source: OpenSource
) -> None:
    profile = ProviderProfile(
        name="myrelay",
        error_rules=(
            ErrorRule("source_dead", codes=("NO_CREDIT",)),
            ErrorRule("transient", statuses=(400,), messages=("try again later",)),
        ),
    )
    providers = {**builtin_profiles_by_name(), "myrelay": profile}
    with pytest.raises(SourceDeadError):
        await attempt(
            fake_upstream,
            open_source,
            Reply.error(400, code="NO_CREDIT", message="no credit left"),
            True,
            provider="myrelay",
            providers=providers,
        )
    with pytest.raises(TransientError):
        await attempt(
            fake_upstream,
            open_source,
            Reply.error(400, message="Busy, TRY AGAIN LATER."),
            False,
            provider="myrelay",
            providers=providers,
        )
    # The same answers from a source without that profile: the status decides.
    with pytest.raises(RequestRejectedError):
        await attempt(
            fake_upstream,
            open_source,
            Reply.error(400, code="NO_CREDIT"),
            True,
            providers=providers,
        )


def test_error_rules_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="verdict"):
        ErrorRule("fatal", codes=("x",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        ErrorRule("source_dead")
    with pytest.raises(ValueError, match="statuses"):
        ErrorRule("source_dead", statuses=(1000,))
    with pytest.raises(ValueError, match="codes"):
        ErrorRule("source_dead", codes="Arrearage")  # type: ignore[arg-type]
    # Messages match ignoring case.
    assert ErrorRule("rejected", messages=("Maximum Context",)).messages == ("maximum context",)


# --------------------------------------------------------------------------- x-should-retry

SHOULD_RETRY_CASES: list[tuple[Reply, type[PolyGatewayError], bool]] = [
    # (answer, class, whether the header changed the class the status gives)
    (Reply.error(503, headers={"x-should-retry": "false"}), RequestRejectedError, True),
    (Reply.error(429, headers={"X-Should-Retry": "false"}), RequestRejectedError, True),
    (Reply.error(400, headers={"x-should-retry": "true"}), TransientError, True),
    (Reply.error(503, headers={"x-should-retry": "true"}), TransientError, False),
    (Reply.error(400, headers={"x-should-retry": "maybe"}), RequestRejectedError, False),
    # An exhausted balance stays dead: repeating the request cannot cure it.
    (Reply.error(429, quota=True, headers={"x-should-retry": "true"}), SourceDeadError, False),
    (Reply.error(401, headers={"x-should-retry": "true"}), SourceDeadError, False),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize(("reply", "expected", "changed"), SHOULD_RETRY_CASES)
async def test_x_should_retry_overrides_the_status(
    fake_upstream: FakeUpstream,
    open_source: OpenSource,
    reply: Reply,
    expected: type[PolyGatewayError],
    changed: bool,
    stream: bool,
) -> None:
    with pytest.raises(PolyGatewayError) as info:
        await attempt(fake_upstream, open_source, reply, stream)
    assert type(info.value) is expected
    assert ("x-should-retry" in str(info.value)) is changed


def two_sources(fake: FakeUpstream, **retry: Any) -> ScopeSettings:
    sources = tuple(
        SourceConfig(
            name=name,
            provider="generic",
            base_url=fake.base_url(name),
            model="m1",
            api_key=Secret("sk-provider-rules-0123456789"),
            timeout_s=5.0,
        )
        for name in ("a", "b")
    )
    return ScopeSettings(
        scope="LLM",
        sources=sources,
        retry=RetrySettings(max_attempts=4, base_delay_s=0.001, max_delay_s=0.002, **retry),
        cache=CacheSettings(backend="none"),
        telemetry=TelemetrySettings(backend="none"),
    )


async def test_should_retry_false_raises_at_once(fake_upstream: FakeUpstream) -> None:
    for name in ("a", "b"):
        fake_upstream.script(name, Reply.error(503, headers={"x-should-retry": "false"}))
    async with GatewayClient(two_sources(fake_upstream)) as client:
        with pytest.raises(RequestRejectedError, match="x-should-retry"):
            await client.chat(MESSAGES)
    # Raised at once: the other source is never asked.
    assert fake_upstream.requests("a") + fake_upstream.requests("b") == 1


async def test_409_is_retried(fake_upstream: FakeUpstream) -> None:
    for name in ("a", "b"):
        fake_upstream.script(name, provider_error("openai-409"), Reply.ok("after conflict"))
    async with GatewayClient(two_sources(fake_upstream)) as client:
        response = await client.chat(MESSAGES)
    assert response.content == "after conflict"
    # Both sources answer 409 first: two retries, the third attempt is answered.
    assert fake_upstream.requests("a") + fake_upstream.requests("b") == 3


# --------------------------------------------------------------------------- mid-stream errors

EVENT_CASES: list[tuple[dict[str, Any], type[PolyGatewayError]]] = [
    (provider_error_event("groq-tool-use-failed"), RequestRejectedError),
    (provider_error_event("openai-context-length"), ContextWindowExceededError),
    (provider_error_event("openai-quota"), SourceDeadError),
    # OpenRouter: the integer code is the HTTP status of the failure.
    ({"code": 400, "message": "Provider returned error"}, RequestRejectedError),
    ({"code": 502, "message": "Provider returned error"}, TransientError),
    # The default event (an upstream disconnect) stays transient.
    (
        {"message": "Upstream provider disconnected", "type": "server_error", "code": None},
        TransientError,
    ),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize(
    ("event", "expected"), EVENT_CASES, ids=[str(e.get("code")) for e, _ in EVENT_CASES]
)
async def test_error_events_are_classified(
    fake_upstream: FakeUpstream,
    open_source: OpenSource,
    event: dict[str, Any],
    expected: type[PolyGatewayError],
    stream: bool,
) -> None:
    with pytest.raises(PolyGatewayError) as info:
        await attempt(fake_upstream, open_source, Reply.mid_stream_error(2, error=event), stream)
    assert type(info.value) is expected


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_deterministic_stream_error_is_not_retried_elsewhere(
    fake_upstream: FakeUpstream, stream: bool
) -> None:
    error = provider_error_event("groq-tool-use-failed")
    for name in ("a", "b"):
        fake_upstream.script(name, Reply.mid_stream_error(2, error=error), Reply.ok())
    async with GatewayClient(two_sources(fake_upstream)) as client:
        with pytest.raises(RequestRejectedError, match="tool_use_failed"):
            await client.chat(MESSAGES, stream=stream)
    asked = fake_upstream.requests("a") + fake_upstream.requests("b")
    assert asked == 1


# --------------------------------------------------------------------------- dialects

REASONING = "Let me think about this step by step, carefully, then answer. " * 3


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("dialect", ["mistral", "openrouter"])
async def test_reasoning_in_content_parts_and_reasoning_details(
    fake_upstream: FakeUpstream, open_source: OpenSource, dialect: Any, stream: bool
) -> None:
    reply = Reply.ok("The answer is 42.", reasoning=REASONING, dialect=dialect)
    result = await attempt(fake_upstream, open_source, reply, stream)
    assert result.content == "The answer is 42."
    assert result.thinking == REASONING
    assert result.usage_source == "measured"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_mistral_text_parts_without_reasoning(
    fake_upstream: FakeUpstream, open_source: OpenSource, stream: bool
) -> None:
    reply = Reply.ok("plain parts", dialect="mistral", chunks=4)
    result = await attempt(fake_upstream, open_source, reply, stream)
    assert (result.content, result.thinking) == ("plain parts", "")


@pytest.mark.parametrize("dialect", ["mistral", "openrouter"])
async def test_thinking_parts_keep_the_stream_alive(
    fake_upstream: FakeUpstream, open_source: OpenSource, dialect: Any
) -> None:
    # 20 reasoning pieces 0.06 s apart: the first answer text comes after ~1.2 s, far past
    # the TTFT deadline, which only thinking tokens can satisfy.
    reply = Reply.ok(
        "done",
        reasoning=REASONING,
        dialect=dialect,
        first_token_delay=0.05,
        inter_token_delay=0.06,
    )
    result = await attempt(
        fake_upstream,
        open_source,
        reply,
        True,
        ttft_timeout_s=0.4,
        inter_token_timeout_s=0.4,
    )
    assert result.content == "done"
    assert result.thinking == REASONING
    assert result.ttft_ms is not None and result.ttft_ms < 400


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_groq_usage_in_x_groq_is_measured(
    fake_upstream: FakeUpstream, open_source: OpenSource, stream: bool
) -> None:
    reply = Reply.ok("fast answer", prompt_tokens=17, completion_tokens=3, dialect="groq")
    result = await attempt(fake_upstream, open_source, reply, stream)
    assert result.content == "fast answer"
    assert (result.prompt_tokens, result.completion_tokens) == (17, 3)
    assert result.usage_source == "measured"
