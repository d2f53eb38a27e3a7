"""The response cache through GatewayClient and the fake upstream (ARCHITECTURE §7.5, D4)."""

from __future__ import annotations

import gc
import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
from features_helpers import (  # make_rig_fixture provides the make_rig fixture
    MESSAGES,
    RigFactory,
    make_rig_fixture,  # noqa: F401
    scope,
    source,
)
from polygateway.backends.memory.cache import MemoryCache
from polygateway.client import GatewayClient
from polygateway.errors import ConfigError, ResultInvalidError
from polygateway.middleware.cache import (
    KEY_PREFIX,
    OBJECT_KEY_MAX,
    CacheMiddleware,
    encode_response,
)
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.testing import FakeClock, FakeUpstream, Reply
from polygateway.types import ChatRequest, LLMResponse
from pydantic import BaseModel


class City(BaseModel):
    name: str
    country: str


async def test_second_identical_call_is_a_hit(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", Reply.ok(content="Paris.", prompt_tokens=11, completion_tokens=2))
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        first = await client.chat(MESSAGES)
        second = await client.chat(MESSAGES)
    assert fake_upstream.requests("a") == 1
    assert not first.cache_hit
    assert second.cache_hit
    assert second.content == first.content == "Paris."
    assert second.latency_ms == 0
    assert second.cost == 0.0
    assert first.cost == pytest.approx(11 / 1e6 * 2.0 + 2 / 1e6 * 8.0)
    assert second.call_id and second.call_id != first.call_id
    assert (second.model, second.provider, second.source_name) == ("model-a", "generic", "a")
    assert (second.prompt_tokens, second.completion_tokens) == (11, 2)
    assert second.ttft_ms is None and second.max_inter_token_ms is None
    assert second.finish_reason == "stop"


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"cache_namespace": "tenant-1"}, {"cache_namespace": "tenant-2"}),
        ({}, {"cache_namespace": "tenant-2"}),
        ({}, {"cache_salt": "epoch-2"}),
        ({"cache_salt": "epoch-1"}, {"cache_salt": "epoch-2"}),
        (
            {"cache_namespace": "a:b", "cache_salt": "c"},
            {"cache_namespace": "a", "cache_salt": "b:c"},
        ),
        ({}, {"structured": "json"}),
        ({"structured": "json"}, {"structured": City}),
    ],
)
async def test_a_different_namespace_salt_or_structured_kind_is_a_miss(
    make_rig: RigFactory,
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    first: dict[str, Any],
    second: dict[str, Any],
) -> None:
    fake_upstream.set_default("a", Reply.ok(content='{"name": "Paris", "country": "FR"}'))
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(MESSAGES, **first)
        response = await client.chat(MESSAGES, **second)
        again = await client.chat(MESSAGES, **second)
    assert not response.cache_hit
    assert again.cache_hit
    assert fake_upstream.requests("a") == 2


async def test_the_default_namespace_passed_explicitly_is_the_same_entry(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="tenant-1"))
    async with rig.client as client:
        await client.chat(MESSAGES)
        hit = await client.chat(MESSAGES, cache_namespace="tenant-1")
    assert hit.cache_hit
    assert fake_upstream.requests("a") == 1


async def test_different_messages_and_different_models_miss(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    shared = MemoryCache(clock=FakeClock())
    rig_a = make_rig(tmp_path / "a", scope(fake_upstream, source(fake_upstream, "a")), cache=shared)
    rig_b = make_rig(tmp_path / "b", scope(fake_upstream, source(fake_upstream, "b")), cache=shared)
    async with rig_a.client as a, rig_b.client as b:
        await a.chat(MESSAGES)
        other_text = await a.chat([{"role": "user", "content": "What is the capital of Spain?"}])
        other_model = await b.chat(MESSAGES)
    assert not other_text.cache_hit and not other_model.cache_hit
    assert fake_upstream.requests("a") == 2
    assert fake_upstream.requests("b") == 1


async def test_a_hit_consumes_no_quota(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(MESSAGES)
        before = await client.limiter.source_stats("a")
        for _ in range(5):
            assert (await client.chat(MESSAGES)).cache_hit
        after = await client.limiter.source_stats("a")
    assert before.rpm_used == after.rpm_used == 1
    assert before.tpm_used == after.tpm_used


async def test_a_hit_does_not_reach_an_open_breaker(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(MESSAGES)
        await client.breaker.force_open("a")
        assert (await client.chat(MESSAGES)).cache_hit


async def test_entries_expire_after_the_ttl(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    clock = FakeClock()
    rig = make_rig(tmp_path, scope(fake_upstream, ttl_s=60.0), clock=clock)
    async with rig.client as client:
        await client.chat(MESSAGES)
        clock.advance(59.0)
        assert (await client.chat(MESSAGES)).cache_hit
        clock.advance(1.5)
        assert not (await client.chat(MESSAGES)).cache_hit
    assert fake_upstream.requests("a") == 2


@pytest.mark.parametrize(
    "reply",
    [
        Reply.ok(content="cut off in the midd", finish_reason="length"),
        Reply.ok(content="   \n"),
    ],
    ids=["truncated", "whitespace-only"],
)
async def test_truncated_and_empty_completions_are_not_cached(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path, reply: Reply
) -> None:
    fake_upstream.set_default("a", reply)
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        responses = [await client.chat(MESSAGES) for _ in range(2)]
    assert [r.cache_hit for r in responses] == [False, False]
    assert fake_upstream.requests("a") == 2


async def test_a_salvaged_stream_is_returned_but_never_cached(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.cut(after_chunks=2))
    salvaging = source(fake_upstream, missing_done="salvage")
    rig = make_rig(tmp_path, scope(fake_upstream, salvaging))
    async with rig.client as client:
        responses = [await client.chat(MESSAGES) for _ in range(2)]
    assert all(r.salvaged and r.usage_source == "estimated" for r in responses)
    assert [r.cache_hit for r in responses] == [False, False]
    assert fake_upstream.requests("a") == 2


async def test_failed_calls_are_not_cached(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.script("a", *[Reply.error(500)] * 3)
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        with pytest.raises(Exception):  # noqa: B017 - which scope error does not matter here
            await client.chat(MESSAGES)
        response = await client.chat(MESSAGES)
    assert not response.cache_hit
    assert fake_upstream.requests("a") == 4


async def test_a_ladder_failure_is_not_cached(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default("a", Reply.ok(content="Paris, France"))
    rig = make_rig(tmp_path, scope(fake_upstream, max_structured_retries=0))
    async with rig.client as client:
        for _ in range(2):
            with pytest.raises(ResultInvalidError):
                await client.chat(MESSAGES, structured=City)
    assert fake_upstream.requests("a") == 2


async def test_structured_data_is_rebuilt_on_a_hit_without_network(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    fake_upstream.set_default(
        "a", Reply.ok(content='```json\n{"name": "Paris", "country": "FR"}\n```')
    )
    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        first = await client.chat(MESSAGES, structured=City)
        hit = await client.chat(MESSAGES, structured=City)
        json_first = await client.chat(MESSAGES, structured="json")
        json_hit = await client.chat(MESSAGES, structured="json")
    assert fake_upstream.requests("a") == 2
    assert hit.cache_hit and json_hit.cache_hit and not json_first.cache_hit
    assert hit.structured_data == first.structured_data == City(name="Paris", country="FR")
    assert hit.structured_data is not first.structured_data
    assert json_hit.structured_data == {"name": "Paris", "country": "FR"}


async def test_multimodal_parts_are_keyed_by_digest(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    def image(data: str) -> list[dict[str, Any]]:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                ],
            }
        ]

    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        await client.chat(image("AAAA"))
        same = await client.chat(image("AAAA"))
        other = await client.chat(image("BBBB"))
    assert same.cache_hit and not other.cache_hit


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"type": "text"}, {"type": "text", "text": ""}),
        (
            {"type": "text", "text": "long context"},
            {"type": "text", "text": "long context", "cache_control": {"type": "ephemeral"}},
        ),
        (
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ),
    ],
    ids=["missing-vs-empty-text", "cache-control", "cache-control-ttl"],
)
async def test_every_field_of_a_text_part_is_in_the_key(
    make_rig: RigFactory,
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    one: dict[str, Any],
    other: dict[str, Any],
) -> None:
    def ask(part: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": "q"}, part]}]

    rig = make_rig(tmp_path, scope(fake_upstream))
    async with rig.client as client:
        first = await client.chat(ask(one))
        second = await client.chat(ask(other))
        again = await client.chat(ask(other))
    # Both reached the wire as sent, so they are two questions; the repeat is a hit.
    assert [r.cache_hit for r in (first, second, again)] == [False, False, True]
    assert fake_upstream.requests("a") == 2
    assert [r.body["messages"][0]["content"][1] for r in fake_upstream.received("a")] == [
        one,
        other,
    ]


# Keys of the common shapes, as computed before text parts kept their every field: entries
# already cached under them stay reachable.
GOLDEN_KEYS = {
    "plain": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "e0924f4ebaba5039292113b9db77758d204d1ed6e56cc2a70924b8e8223f38d3",
    ),
    "text-parts": (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
            }
        ],
        "07825e41547c14cdf0d11d552b599d3fadc3dc746153a22603adeb615dfc767b",
    ),
    "image": (
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ],
        "4b9090e13c2357da50607ce0dbc549dd0739d012a0b1babd0417d66e8c5da05f",
    ),
    "tool-call": (
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "5e1941334a1f2c59d13ae60b1e5bb2af771d073f49151927f8170f1df9dce76d",
    ),
}


@pytest.mark.parametrize("shape", sorted(GOLDEN_KEYS))
def test_the_keys_of_common_shapes_are_stable(shape: str) -> None:
    messages, digest = GOLDEN_KEYS[shape]
    cache = CacheMiddleware(
        MemoryCache(clock=FakeClock()),
        namespace="ns",
        ttl_s=10.0,
        model_identity="model-a",
        strategy=JsonRepairStrategy(),
    )
    assert cache.key(ChatRequest(messages=messages)) == KEY_PREFIX + digest


class FailingCache:
    """A backend whose every operation fails (a cache server that went away)."""

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, key: str) -> str | None:
        self.calls += 1
        raise ConnectionError("cache server unreachable")

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        self.calls += 1
        raise ConnectionError("cache server unreachable")

    async def aclose(self) -> None:
        pass


async def test_backend_failure_degrades_to_one_warning(
    make_rig: RigFactory,
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = FailingCache()
    rig = make_rig(tmp_path, scope(fake_upstream), cache=backend)
    with caplog.at_level(logging.WARNING, logger="polygateway.middleware.cache"):
        async with rig.client as client:
            responses = [await client.chat(MESSAGES) for _ in range(3)]
    assert [r.cache_hit for r in responses] == [False, False, False]
    assert fake_upstream.requests("a") == 3
    assert backend.calls == 6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cache backend get failed" in warnings[0].getMessage()


def _key_of_messages(backend: MemoryCache) -> str:
    """Where ``backend`` files the entry of ``MESSAGES`` for the scope the tests below make
    (namespace "n")."""
    layer = CacheMiddleware(
        backend, namespace="n", ttl_s=60.0, model_identity="model-a", strategy=JsonRepairStrategy()
    )
    return layer.entry_key(ChatRequest(messages=MESSAGES))


async def test_an_unreadable_entry_is_a_miss(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    clock = FakeClock()
    backend = MemoryCache(clock=clock)
    await backend.set(_key_of_messages(backend), "{not json", 60.0)
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
    async with rig.client as client:
        assert not (await client.chat(MESSAGES)).cache_hit
        assert (await client.chat(MESSAGES)).cache_hit  # the bad entry was replaced


class StringOnlyCache:
    """A backend with the plain port only (strings, coroutines), over a memory cache."""

    def __init__(self, clock: FakeClock) -> None:
        self.inner = MemoryCache(clock=clock)

    async def get(self, key: str) -> str | None:
        return await self.inner.get(key)

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        await self.inner.set(key, value, ttl_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _hit_view(response: Any) -> dict[str, Any]:
    fields = dict(vars(response))
    del fields["call_id"]
    return fields


async def test_a_hit_is_the_same_whether_the_entry_is_kept_as_an_object_or_as_json(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    reply = Reply.ok(content="Paris ✓", prompt_tokens=11, completion_tokens=2)
    fake_upstream.script("a", reply, reply)
    clock = FakeClock()
    hits = []
    for backend in (MemoryCache(clock=clock), StringOnlyCache(clock)):
        rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
        async with rig.client as client:
            first = await client.chat(MESSAGES)
            hits.append(await client.chat(MESSAGES))
        assert not first.cache_hit and hits[-1].cache_hit
        assert hits[-1].call_id and hits[-1].call_id != first.call_id
    assert fake_upstream.requests("a") == 2
    assert _hit_view(hits[0]) == _hit_view(hits[1])
    assert hits[0].content == "Paris ✓" and hits[0].cost == 0.0


async def test_the_memory_cache_keeps_a_hits_fields_not_their_json(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    clock = FakeClock()
    backend = MemoryCache(clock=clock)
    key = _key_of_messages(backend)
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
    async with rig.client as client:
        first = await client.chat(MESSAGES)
    kept = backend.get_object(key)
    assert isinstance(kept, dict) and kept["content"] == first.content
    assert kept["call_id"] == first.call_id and kept["cache_hit"] is False  # as it was
    assert not gc.is_tracked(kept)  # no work for the garbage collector's passes
    assert backend.get_nowait(key) is None  # no string entry: nothing was encoded


def test_an_in_process_backend_files_a_short_key_json_as_it_is() -> None:
    def layer(backend: Any) -> CacheMiddleware:
        return CacheMiddleware(
            backend, namespace="n", ttl_s=60.0, model_identity="m", strategy=JsonRepairStrategy()
        )

    # A backend of strings only (as a shared one is): its entries go under the hashed key.
    in_process, shared = layer(MemoryCache(clock=FakeClock())), layer(StringOnlyCache(FakeClock()))
    usual = ChatRequest(messages=MESSAGES)
    key_json = in_process.key_json(usual)
    assert key_json.startswith('{"messages_digest":"') and len(key_json) <= OBJECT_KEY_MAX
    assert in_process.entry_key(usual) == key_json
    assert in_process.key(usual) == KEY_PREFIX + hashlib.sha256(key_json.encode()).hexdigest()
    assert shared.entry_key(usual) == shared.key(usual) == in_process.key(usual)
    # A key JSON past the bound (a large extra_body) goes under its hash in any backend.
    large = ChatRequest(messages=MESSAGES, extra_body={"tools": ["x" * OBJECT_KEY_MAX]})
    assert len(in_process.key_json(large)) > OBJECT_KEY_MAX
    assert in_process.entry_key(large) == in_process.key(large) == shared.entry_key(large)


async def test_short_and_long_key_jsons_both_hit_in_the_memory_cache(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    clock = FakeClock()
    backend = MemoryCache(clock=clock)
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
    large = {"extra_body": {"metadata": {"note": "y" * OBJECT_KEY_MAX}}}
    async with rig.client as client:
        for kwargs in ({}, large):
            assert not (await client.chat(MESSAGES, **kwargs)).cache_hit
            assert (await client.chat(MESSAGES, **kwargs)).cache_hit
    assert fake_upstream.requests("a") == 2 and len(backend) == 2


@pytest.mark.parametrize(
    "foreign",
    [42, ("content", "x"), {"text": "no content"}, {"content": 7}, {"content": "x", "oops": 1}],
    ids=repr,
)
async def test_an_object_entry_of_another_kind_is_a_miss(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path, foreign: object
) -> None:
    clock = FakeClock()
    backend = MemoryCache(clock=clock)
    backend.set_object(_key_of_messages(backend), foreign, 60.0)
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
    async with rig.client as client:
        assert not (await client.chat(MESSAGES)).cache_hit
        assert (await client.chat(MESSAGES)).cache_hit  # the foreign entry was replaced
    assert fake_upstream.requests("a") == 1


async def test_a_json_entry_in_the_memory_cache_is_still_a_hit(
    make_rig: RigFactory, fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    # An entry written through the string form (``set``) reads back as before.
    clock = FakeClock()
    backend = MemoryCache(clock=clock)
    stored = encode_response(LLMResponse(content="from json", model="model-a", call_id="old"))
    await backend.set(_key_of_messages(backend), stored, 60.0)
    rig = make_rig(tmp_path, scope(fake_upstream, namespace="n"), cache=backend, clock=clock)
    async with rig.client as client:
        hit = await client.chat(MESSAGES)
    assert hit.cache_hit and hit.content == "from json" and hit.call_id != "old"
    assert fake_upstream.requests("a") == 0


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("namespace", "ttl_s", "expected"),
    [
        (None, 60.0, "namespace"),
        ("", 60.0, "namespace"),
        ("n", None, "TTL"),
        ("n", 0.0, "TTL"),
        ("n", -5.0, "TTL"),
    ],
)
def test_cache_without_namespace_or_positive_ttl_fails_assembly(
    fake_upstream: FakeUpstream,
    tmp_path: Path,
    namespace: str | None,
    ttl_s: float | None,
    expected: str,
) -> None:
    with pytest.raises(ConfigError, match=expected):
        GatewayClient(scope(fake_upstream, namespace=namespace, ttl_s=ttl_s))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"namespace": "", "ttl_s": 1.0}, "namespace is required"),
        ({"namespace": "n", "ttl_s": 0}, "TTL is required"),
        ({"namespace": "n", "ttl_s": float("inf")}, "TTL is required"),
        ({"namespace": "n", "ttl_s": float("nan")}, "TTL is required"),
    ],
)
def test_cache_layer_refuses_bad_settings(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        CacheMiddleware(
            MemoryCache(clock=FakeClock()),
            model_identity="m",
            strategy=JsonRepairStrategy(),
            **kwargs,
        )


def test_keys_are_prefixed_sha256_and_delimiters_cannot_collide() -> None:
    layer = CacheMiddleware(
        MemoryCache(clock=FakeClock()),
        namespace="default",
        ttl_s=1.0,
        model_identity="model-a",
        strategy=JsonRepairStrategy(),
    )

    def key(**kwargs: Any) -> str:
        return layer.key(ChatRequest(messages=MESSAGES, **kwargs))

    keys = {
        key(),
        key(cache_namespace="a:b", cache_salt="c"),
        key(cache_namespace="a", cache_salt="b:c"),
        key(cache_namespace='a","salt":"', cache_salt=""),
        key(extra_body={"temperature": 0.1}),
        key(structured="json"),
    }
    assert len(keys) == 6
    for k in keys:
        assert k.startswith(KEY_PREFIX)
        assert len(k) == len(KEY_PREFIX) + 64
    assert key() == key(cache_namespace="default", cache_salt="")
