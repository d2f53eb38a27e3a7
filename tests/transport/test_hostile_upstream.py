"""Hostile upstreams at the HTTP level, on every engine, through the fake upstream: redirects are
never followed, no secret reaches an exception chain, response bytes are capped (gzip bombs
included), deep nesting is classified."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from polygateway.errors import SourceDeadError
from polygateway.settings import Secret, SourceConfig
from polygateway.testing import FakeUpstream, Reply
from polygateway.testing.contracts.transport import MESSAGES
from polygateway.transports.openai_compat import OpenAICompatTransport
from polygateway.types import ChatRequest
from test_openai_compat import ENGINES

API_KEY = "sk-hostile-test-0123456789abcdef"
TOKEN = "tok-credential-9876543210"
HEADERS = {"X-Api-Token": TOKEN}

OpenSource = Callable[..., tuple[OpenAICompatTransport, SourceConfig]]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_source(engine: str, fake_upstream: FakeUpstream) -> AsyncIterator[OpenSource]:
    made: list[OpenAICompatTransport] = []

    def open_(name: str = "h", **overrides: Any) -> tuple[OpenAICompatTransport, SourceConfig]:
        options = {"engine": engine, "headers": HEADERS, **overrides.pop("options", {})}
        source = SourceConfig(
            name=name,
            provider="generic",
            base_url=fake_upstream.base_url(name),
            model="m1",
            api_key=Secret(API_KEY),
            timeout_s=overrides.pop("timeout_s", 10.0),
            options=options,
            **overrides,
        )
        transport = OpenAICompatTransport(source)
        made.append(transport)
        return transport, source

    yield open_
    for transport in made:
        await transport.aclose()


def chat(stream: bool) -> ChatRequest:
    return ChatRequest(messages=MESSAGES, stream=stream)


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_no_engine_follows_a_redirect(
    open_source: OpenSource, fake_upstream: FakeUpstream, status: int, stream: bool
) -> None:
    async with FakeUpstream() as elsewhere:
        target = elsewhere.base_url("stolen") + "/chat/completions"
        transport, source = open_source()
        fake_upstream.script(source.name, Reply.redirect(target, status))
        with pytest.raises(SourceDeadError) as info:
            await transport.send(chat(stream), source, call_id="c")
        assert info.value.status == status
        # Nothing reached the other host: no prompt, no Authorization, no credential header.
        assert elsewhere.requests(None) == 0
        assert elsewhere.requests(None, "other") == 0
        assert fake_upstream.requests(source.name) == 1
        [received] = fake_upstream.received(source.name)
        assert received.headers["x-api-token"] == TOKEN  # the header was set: a real check


# --------------------------------------------------------------------------- error messages

FOREIGN_KEY = "AIzaSyD-0123456789abcdefABCDEF_ghijklmn"  # key-like, not this source's key


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_error_codes_stay_readable_while_keys_are_masked(
    open_source: OpenSource, fake_upstream: FakeUpstream, stream: bool
) -> None:
    transport, source = open_source()
    fake_upstream.script(
        source.name,
        Reply.error(403),  # the real API's body: code unsupported_country_region_territory
        Reply.error(
            403,
            code="organization_usage_limit_exceeded_for_region",
            message=f"Key {FOREIGN_KEY} and {API_KEY} are not allowed here",
        ),
    )
    with pytest.raises(SourceDeadError) as info:
        await transport.send(chat(stream), source, call_id="c")
    assert "request_forbidden/unsupported_country_region_territory" in str(info.value)
    with pytest.raises(SourceDeadError) as info:
        await transport.send(chat(stream), source, call_id="c")
    text = str(info.value)
    assert "organization_usage_limit_exceeded_for_region" in text
    assert FOREIGN_KEY not in text and API_KEY not in text
    assert "Key *** and *** are not allowed" in text
