"""The cache key is exactly the documented formula, whatever path computes it."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.backends.memory.cache import MemoryCache
from polygateway.context import CallContext, with_context
from polygateway.digest import (
    canonical_json,
    canonical_messages_json,
    digest_messages,
    messages_digest,
)
from polygateway.errors import ConfigError
from polygateway.middleware.cache import KEY_PREFIX, CacheMiddleware
from polygateway.params import ChatParams
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.testing import FakeClock
from polygateway.types import ChatRequest
from pydantic import BaseModel, create_model

text = st.text(max_size=40)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}
    ),
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={
        "content": st.one_of(text, st.none(), st.lists(part, max_size=3)),
        "name": text,
        "tool_calls": st.lists(st.dictionaries(text, text, max_size=2), max_size=2),
    },
)
messages = st.lists(message, min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(messages)
def test_fast_messages_json_is_the_canonical_digest_json(msgs: list[dict[str, Any]]) -> None:
    assert canonical_messages_json(msgs) == canonical_json(digest_messages(msgs))
    assert canonical_messages_json(tuple(msgs)) == canonical_json(digest_messages(msgs))


class Answer(BaseModel):
    value: int


def layer(model_identity: str = "model-a,model-b") -> CacheMiddleware:
    return CacheMiddleware(
        MemoryCache(clock=FakeClock()),
        namespace="default-ns",
        ttl_s=10.0,
        model_identity=model_identity,
        strategy=JsonRepairStrategy(),
    )


def expected_key(cache: CacheMiddleware, request: ChatRequest, model: str) -> str:
    parts: dict[str, Any] = {
        "model": model,
        "messages_digest": messages_digest(request.messages),
        "namespace": request.cache_namespace or cache.namespace,
        "salt": request.cache_salt or "",
        "structured": None
        if request.structured is None
        else cache._structured_id(request.structured),
    }
    if request.extra_body:
        parts["extra"] = request.extra_body
    return KEY_PREFIX + hashlib.sha256(canonical_json(parts).encode("utf-8")).hexdigest()


@settings(max_examples=100, deadline=None)
@given(
    msgs=messages,
    namespace=st.one_of(st.none(), text),
    salt=st.one_of(st.none(), text),
    structured=st.sampled_from([None, "json", Answer]),
    extra=st.dictionaries(text, st.one_of(st.integers(), text), max_size=2),
    model=st.text(min_size=1, max_size=20),
)
def test_key_is_sha256_of_the_canonical_parts(
    msgs: list[dict[str, Any]],
    namespace: str | None,
    salt: str | None,
    structured: Any,
    extra: dict[str, Any],
    model: str,
) -> None:
    cache = layer(model)
    request = ChatRequest(
        messages=msgs,
        cache_namespace=namespace,
        cache_salt=salt,
        structured=structured,
        extra_body=extra,
    )
    assert cache.key(request) == expected_key(cache, request, model)


@settings(max_examples=100, deadline=None)
@given(
    msgs=messages,
    namespace=st.one_of(st.none(), text),
    salt=st.one_of(st.none(), text),
    structured=st.sampled_from([None, "json"]),
    extra=st.one_of(st.none(), st.dictionaries(text, text, max_size=2)),
    params=st.sampled_from([None, ChatParams(), ChatParams(temperature=0.5)]),
)
def test_a_call_with_its_context_gets_the_same_key(
    msgs: list[dict[str, Any]],
    namespace: str | None,
    salt: str | None,
    structured: Any,
    extra: dict[str, Any] | None,
    params: ChatParams | None,
) -> None:
    """The usual call's key (taken from the call's shared encoding, assembled apart from the
    general path) is the one every other path computes."""
    cache = layer()
    request = ChatRequest(
        messages=msgs,
        cache_namespace=namespace,
        cache_salt=salt,
        structured=structured,
        extra_body=extra,
        params=params,
    )
    with_its_context = with_context(request, CallContext())
    assert cache.key(with_its_context) == cache.key(request)
    if params is None:
        assert cache.key(with_its_context) == expected_key(cache, request, "model-a,model-b")


def test_a_model_schema_change_changes_the_key() -> None:
    """An edited model (same module and name, another shape) must not read old entries."""
    before = create_model("Report", __module__="app.models", value=(int, ...))
    after = create_model("Report", __module__="app.models", value=(str, ...))
    assert (before.__module__, before.__qualname__) == (after.__module__, after.__qualname__)
    cache = layer()
    msgs = [{"role": "user", "content": "x"}]
    assert cache.key(ChatRequest(messages=msgs, structured=before)) != cache.key(
        ChatRequest(messages=msgs, structured=after)
    )


async def test_a_request_without_a_key_is_sent_uncached_and_its_errors_stand_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Content that cannot be canonicalised: the call goes on uncached (one warning), and an
    # error of the call itself is not chained to the key's (raised outside that handler).
    request = ChatRequest(
        messages=[{"role": "user", "content": [{"type": "image_url", "url": object()}]}]
    )
    failure = RuntimeError("upstream failed")

    async def fail(_: ChatRequest) -> Any:
        raise failure

    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as caught:
        await layer()(request, fail)
    assert caught.value is failure
    assert caught.value.__context__ is None
    assert "its cache key cannot be computed" in caplog.text


def test_the_layers_namespace_is_a_plain_string() -> None:
    # A str subclass would be taken for a bad namespace by the key's check on every call.
    class Name(str):
        pass

    with pytest.raises(ConfigError, match="namespace"):
        CacheMiddleware(
            MemoryCache(clock=FakeClock()),
            namespace=Name("tenant"),
            ttl_s=10.0,
            model_identity="m",
            strategy=JsonRepairStrategy(),
        )
