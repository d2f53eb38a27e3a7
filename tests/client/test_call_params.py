"""Per-call generation parameters, through the fake upstream: what reaches the wire, the source
defaults under them, validation before any request, and the cache key."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from client_helpers import MESSAGES, http_client
from polygateway.config import load_scope
from polygateway.errors import ConfigError, RequestRejectedError
from polygateway.params import ChatParams
from polygateway.settings import CacheSettings
from polygateway.testing import FakeUpstream

TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}

EVERY_PARAM: dict[str, Any] = {
    "model": "other-model",
    "temperature": 0.3,
    "top_p": 0.9,
    "max_tokens": 77,
    "stop": ["END", "STOP"],
    "seed": 42,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "tools": [TOOL],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "response_format": {"type": "json_object"},
    "user": "tenant-7",
    "extra_body": {"top_k": 5},
}


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as server:
        yield server


@pytest.mark.parametrize(
    ("provider", "cap_field"), [("openai", "max_completion_tokens"), ("generic", "max_tokens")]
)
async def test_every_parameter_reaches_the_wire(
    fake: FakeUpstream, provider: str, cap_field: str
) -> None:
    async with http_client(fake, ["a"], source_overrides={"a": {"provider": provider}}) as client:
        response = await client.chat(MESSAGES, **EVERY_PARAM)
    assert response.content
    (received,) = fake.received("a")
    body = received.body
    assert body["model"] == "other-model"
    assert body[cap_field] == 77
    other = {"max_completion_tokens", "max_tokens"} - {cap_field}
    assert not other & set(body)
    for name in (
        "temperature",
        "top_p",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "user",
    ):
        assert body[name] == EVERY_PARAM[name], name
    assert body["top_k"] == 5
    assert body["stream"] is True


async def test_no_parameters_leave_the_body_as_before(fake: FakeUpstream) -> None:
    async with http_client(fake, ["a"]) as client:
        await client.chat(MESSAGES)
    body = fake.received("a")[0].body
    assert set(body) == {"model", "messages", "stream", "stream_options"}


async def test_source_defaults_apply_and_a_call_wins(fake: FakeUpstream) -> None:
    defaults = ChatParams(temperature=0.1, max_tokens=10, extra_body={"top_k": 1, "x": 1})
    overrides = {"a": {"provider": "generic", "params": defaults}}
    async with http_client(fake, ["a"], source_overrides=overrides) as client:
        await client.chat(MESSAGES)
        await client.chat(MESSAGES, temperature=0.9, extra_body={"top_k": 2})
    first, second = (r.body for r in fake.received("a"))
    assert (first["temperature"], first["max_tokens"], first["top_k"], first["x"]) == (
        0.1,
        10,
        1,
        1,
    )
    assert (second["temperature"], second["max_tokens"], second["top_k"], second["x"]) == (
        0.9,
        10,
        2,
        1,
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code"}]}, "tools[0]"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"schema": {}}}, "response_format"),
        ({"user": 7}, "user"),
        ({"extra_body": {1: 2}}, "extra_body"),
        ({"model": ""}, "model"),
    ],
)
async def test_bad_parameters_are_refused_before_any_request(
    fake: FakeUpstream, kwargs: dict[str, Any], field: str
) -> None:
    async with http_client(fake, ["a"]) as client:
        with pytest.raises(RequestRejectedError, match=re.escape(f"{field}: ")):
            await client.chat(MESSAGES, **kwargs)
    assert fake.requests() == 0


async def test_parameters_are_part_of_the_cache_key(fake: FakeUpstream) -> None:
    cache = CacheSettings(backend="memory", namespace="t", ttl_s=60.0)
    async with http_client(fake, ["a"], cache=cache) as client:
        first = await client.chat(MESSAGES, temperature=0.2)
        again = await client.chat(MESSAGES, temperature=0.2)
        other = await client.chat(MESSAGES, temperature=0.7)
        tools = await client.chat(MESSAGES, temperature=0.7, tools=[TOOL])
        model = await client.chat(MESSAGES, temperature=0.7, model="m2")
        plain = await client.chat(MESSAGES)
    assert not first.cache_hit and again.cache_hit
    assert not other.cache_hit and not tools.cache_hit and not model.cache_hit
    assert not plain.cache_hit
    assert fake.requests("a") == 5


def test_source_defaults_from_env() -> None:
    prefix = "LLM__QWEN__1"
    env = {
        f"{prefix}__BASE_URL": "http://127.0.0.1:8400/q/v1",
        f"{prefix}__MODEL": "qwen-model",
        f"{prefix}__TEMPERATURE": "0.4",
        f"{prefix}__TOP_P": "0.8",
        f"{prefix}__MAX_TOKENS": "512",
        f"{prefix}__SEED": "7",
        f"{prefix}__PRESENCE_PENALTY": "0.1",
        f"{prefix}__FREQUENCY_PENALTY": "0.2",
        f"{prefix}__STOP": "###",
        f"{prefix}__USER": "svc",
        f"{prefix}__PARALLEL_TOOL_CALLS": "false",
    }
    (source,) = load_scope("LLM", env).sources
    assert source.params == ChatParams(
        temperature=0.4,
        top_p=0.8,
        max_tokens=512,
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        stop="###",
        user="svc",
        parallel_tool_calls=False,
    )
    with pytest.raises(ConfigError, match="TEMPERATURE"):
        load_scope("LLM", {**env, f"{prefix}__TEMPERATURE": "9"})
