"""The per-call fast paths of the telemetry and cache layers give exactly what the plain
implementations gave: canonical JSON and cache keys byte for byte (orjson only where it is
provably identical to the stdlib), cached values that read back equal, the same rows."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import json
import math
import sqlite3
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.assembly import _layer_call
from polygateway.backends.memory.cache import MemoryCache
from polygateway.context import CallContext, with_context
from polygateway.digest import (
    canonical_json,
    canonical_json_bytes,
    canonical_messages_json,
    canonical_messages_utf8,
    messages_digest,
)
from polygateway.ids import elapsed_ms
from polygateway.middleware.cache import (
    _HIT_OVERRIDES,
    _STORED_FIELDS,
    CacheMiddleware,
    _hit_fields_by_name,
    _hit_response_by_name,
    decode_fields,
    encode_response,
    hit_fields,
    hit_response,
    is_cacheable,
)
from polygateway.middleware.telemetry import TelemetryMiddleware, build_telemetry_record
from polygateway.params import ChatParams
from polygateway.records import AttemptSummary, build_record
from polygateway.settings import Secret, SourceConfig
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.telemetry.sqlite import SQLiteRecorder
from polygateway.testing import FakeClock
from polygateway.types import (
    CallStart,
    ChatRequest,
    GovernanceEvent,
    LLMResponse,
    TelemetryRecord,
    TelemetryValues,
    ToolCall,
    admitted_event,
)
from test_frozen_dataclass import definition

# --------------------------------------------------------------------------- the references


def reference_json(value: Any) -> str:
    """Canonical JSON as it has always been defined: the stdlib, sorted, compact, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def reference_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") == "text":
        return {"type": "text", "text": part.get("text", "")}
    kind = part.get("type", "part") if isinstance(part, Mapping) else type(part).__name__
    digest = hashlib.sha256(reference_json(part).encode("utf-8")).hexdigest()
    return {"type": kind, "sha256": digest}


def reference_messages_json(messages: Any) -> str:
    digested = []
    for message in messages:
        out = dict(message)
        content = message.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            out["content"] = [reference_part(p) for p in content]
        digested.append(out)
    return reference_json(digested)


def outcome(function: Any, *args: Any) -> tuple[str, Any]:
    """What a call returned, or the class of what it raised (both paths must agree)."""
    try:
        return ("value", function(*args))
    except Exception as exc:  # the comparison is the point
        return ("raised", type(exc))


# --------------------------------------------------------------------------- canonical JSON

texts = st.text(max_size=12) | st.sampled_from(
    ["", "é", "日本語", "\U0001f600", '"', "\\", "\n\t\r\b\f", "\x00\x1f\x7f", "\u2028\ufeff"]
)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.1, -0.0, 1e-05, 1e16, 1.5e300, 5e-324, 123456.789, 1e22]
)
ints = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1]
)
leaves = st.none() | st.booleans() | ints | floats | texts
keys = texts | st.integers(-5, 5) | st.booleans() | st.none() | st.floats(-2.0, 2.0)
json_values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(texts, inner, max_size=4)
        | st.dictionaries(keys, inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_canonical_json_is_the_stdlib_canonical_form(value: Any) -> None:
    assert outcome(canonical_json, value) == outcome(reference_json, value)
    assert outcome(canonical_json_bytes, value) == outcome(
        lambda v: reference_json(v).encode("utf-8"), value
    )


class Label(str):
    pass


class Record(dict[str, Any]):
    pass


@pytest.mark.parametrize(
    "value",
    [
        {"b": 1, "a": [1, 2, {"d": None, "c": True}]},
        [
            "every code point",
            "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, 0x10000))),
        ],
        {"\U0001f600": 1, "\uffff": 2, "z": 3, "é": 4, "": 5},
        {"x": float("nan"), "y": float("inf"), "z": -float("inf")},
        {"n": 2**64, "m": -(2**63) - 1, "k": 2**64 - 1},
        {1: "int key", "1.5": "str key"},
        {True: "bool key", None: "none key"},
        {"s": Label("a str subclass")},
        Record(a=1),
        ("a", ("tuple", 1)),
        "\ud800 a lone surrogate",
        {
            "deep": [
                [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["bottom"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
            ]
        },
        MappingProxyType({"a": 1}),
        {"a": object()},
    ],
)
def test_canonical_json_matches_the_stdlib_on_the_awkward_cases(value: Any) -> None:
    assert outcome(canonical_json, value) == outcome(reference_json, value)


def test_a_circular_value_still_fails_like_the_stdlib() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert outcome(canonical_json, loop) == outcome(reference_json, loop)


# --------------------------------------------------------------------------- messages and keys

part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.fixed_dictionaries(
                {"url": texts.map(lambda t: "data:image/png;base64," + t)},
                optional={"detail": st.sampled_from(["low", "high"])},
            ),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("input_audio"), "input_audio": st.dictionaries(texts, json_values)}
    ),
    texts,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={
        "content": st.one_of(texts, st.none(), st.lists(part, max_size=3)),
        "name": texts,
        "weight": floats,
        "tool_calls": st.lists(st.dictionaries(texts, json_values, max_size=2), max_size=2),
    },
)
message_lists = st.lists(message, min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(message_lists)
def test_messages_json_and_digest_are_unchanged(messages: list[dict[str, Any]]) -> None:
    expected = outcome(reference_messages_json, messages)
    assert outcome(canonical_messages_json, messages) == expected
    assert outcome(canonical_messages_json, tuple(messages)) == expected
    utf8 = ("value", expected[1].encode("utf-8")) if expected[0] == "value" else expected
    assert outcome(canonical_messages_utf8, messages) == utf8
    context = CallContext()  # the bytes first, then the string, as a call asks for them
    assert outcome(context.canonical_messages_utf8, messages) == utf8
    assert outcome(context.canonical_messages, messages) == expected
    digest = outcome(
        lambda m: hashlib.sha256(reference_messages_json(m).encode("utf-8")).hexdigest(),
        messages,
    )
    assert outcome(messages_digest, messages) == digest


class Backwards(str):
    """A key that sorts the other way round: the stdlib's sort asks it, orjson does not."""

    def __lt__(self, other: object) -> bool:
        return str.__gt__(self, other)  # type: ignore[operator]


@pytest.mark.parametrize(
    "message",
    [
        {Backwards("role"): "user", Backwards("content"): "hi", Backwards("name"): "n"},
        {Label("role"): "user", "content": "hi"},
        {1: "one", "role": "user", "content": "hi"},
        {None: "none", "role": "user"},
    ],
    ids=["ordered-subclass", "str-subclass", "int-key", "none-key"],
)
def test_text_messages_with_keys_that_are_no_plain_str_take_the_plain_path(
    message: dict[Any, Any],
) -> None:
    """The text-only fast path leaves keys to orjson, which refuses all of these."""
    assert outcome(canonical_messages_json, [message]) == outcome(
        reference_messages_json, [message]
    )


def test_messages_that_are_not_plain_dicts_take_the_same_digest() -> None:
    plain = [{"role": "user", "content": "hi"}]
    assert canonical_messages_json([MappingProxyType(plain[0])]) == reference_json(plain)
    assert messages_digest([MappingProxyType(plain[0])]) == messages_digest(plain)


def key_layer() -> CacheMiddleware:
    return CacheMiddleware(
        MemoryCache(clock=FakeClock()),
        namespace="tenant-1",
        ttl_s=60.0,
        model_identity="model-a,model-b",
        strategy=JsonRepairStrategy(),
    )


# Keys computed by the implementation before the fast paths: an entry written by an older
# process must still be found.
GOLDEN_KEYS = {
    "text": "pgw:cache:c04a470509a21835a1509be48207e40f81a93887bd6ddb281caa7f3c8dea26b0",
    "unicode": "pgw:cache:e4804daec4f1f6c83d948c5fcfd01f8e21d8b85cbae34938718169c49bd51d7c",
    "image": "pgw:cache:7071187de558b80d7be2ebb240c2c38a086e0630594624ba34a0b1243db0bee1",
    "salted": "pgw:cache:1d22996c33503a7b8fd9c095e55ea4e323194bc28e1e79478fc60b30b2499c30",
    "extra": "pgw:cache:69eeacef0193e2f1fdd4c998c37173a6ee80f770f5d88616434de73d13b3e0ba",
    "floats": "pgw:cache:ce9626706c7e31cd54f628afa5d2ca81c1de5dc45dc7e030f118b352db8c9c9b",
}
GOLDEN_REQUESTS = {
    "text": ChatRequest(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    "unicode": ChatRequest(
        messages=[
            {"role": "system", "content": 'Réponds en français \u2603 \U0001f600 "q" \\ \n\t\x01'},
            {"role": "user", "content": "日本語"},
        ]
    ),
    "image": ChatRequest(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"},
                    },
                ],
            }
        ]
    ),
    "salted": ChatRequest(
        messages=[{"role": "user", "content": "hi"}],
        cache_salt="epoch-2",
        cache_namespace="tenant-2",
        structured="json",
    ),
    "extra": ChatRequest(
        messages=[
            {"role": "user", "content": "hi", "name": "bob"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "t1", "function": {"name": "f", "arguments": "{}"}}],
            },
        ],
        extra_body={
            "temperature": 0.7,
            "top_p": 1e-05,
            "seed": 12345678901234567890123,
            "stop": ["\n"],
        },
    ),
    "floats": ChatRequest(
        messages=[{"role": "user", "content": "x", "weight": 1e16, "scores": [0.1, -0.0, 1.5e300]}]
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_KEYS))
def test_cache_keys_are_those_of_the_previous_implementation(name: str) -> None:
    request = GOLDEN_REQUESTS[name]
    layer = key_layer()
    assert layer.key(request) == GOLDEN_KEYS[name]
    # The same key when the call's context supplies the encoded messages (as on every call
    # made through GatewayClient.chat; the telemetry rows store the same string).
    context = CallContext()
    assert layer.key(dataclasses.replace(request, context=context)) == GOLDEN_KEYS[name]
    assert context.canonical_messages(request.messages) == canonical_messages_json(request.messages)
    assert context.canonical_messages_utf8(request.messages) == canonical_messages_json(
        request.messages
    ).encode("utf-8")


@settings(max_examples=150, deadline=None)
@given(
    msgs=message_lists,
    namespace=st.one_of(st.none(), texts),
    salt=st.one_of(st.none(), texts),
    structured=st.sampled_from([None, "json"]),
    extra=st.dictionaries(texts, json_values, max_size=3),
)
def test_cache_keys_follow_the_formula_with_the_stdlib_encoder(
    msgs: list[dict[str, Any]],
    namespace: str | None,
    salt: str | None,
    structured: Any,
    extra: dict[str, Any],
) -> None:
    layer = key_layer()
    request = ChatRequest(
        messages=msgs,
        cache_namespace=namespace,
        cache_salt=salt,
        structured=structured,
        extra_body=extra,
    )

    def expected(_: Any) -> str:
        parts: dict[str, Any] = {
            "model": "model-a,model-b",
            "messages_digest": hashlib.sha256(
                reference_messages_json(msgs).encode("utf-8")
            ).hexdigest(),
            "namespace": namespace or "tenant-1",
            "salt": salt or "",
            "structured": structured,
        }
        if extra:
            parts["extra"] = extra
        return "pgw:cache:" + hashlib.sha256(reference_json(parts).encode("utf-8")).hexdigest()

    assert outcome(layer.key, request) == outcome(expected, None)


# --------------------------------------------------------------------------- cached values


def reference_encode(response: LLMResponse) -> str:
    fields = {name: getattr(response, name) for name in _STORED_FIELDS}
    # Tool calls are stored as [id, name, arguments] triples, none as null.
    fields["tool_calls"] = [[c.id, c.name, c.arguments] for c in response.tool_calls] or None
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def test_the_stored_field_list_is_the_response_minus_structured_data() -> None:
    response = LLMResponse(content="c")
    names = [f.name for f in dataclasses.fields(LLMResponse) if f.name != "structured_data"]
    assert list(_STORED_FIELDS) == names
    assert list(json.loads(encode_response(response))) == names


responses = st.builds(
    LLMResponse,
    content=texts,
    thinking=texts,
    model=texts,
    provider=texts,
    prompt_tokens=ints,
    completion_tokens=st.integers(0, 10**6),
    latency_ms=st.integers(0, 10**6),
    ttft_ms=st.none() | floats,
    max_inter_token_ms=st.none() | floats | st.integers(0, 10),
    cache_hit=st.booleans(),
    call_id=texts,
    source_name=texts,
    cost=st.none() | floats,
    finish_reason=st.none() | texts,
    salvaged=st.booleans(),
    cached_prompt_tokens=st.integers(0, 10**6),
    cache_write_tokens=st.integers(0, 10**6),
    tool_calls=st.lists(st.builds(ToolCall, texts, texts, texts), max_size=2).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(responses)
def test_cached_values_read_back_as_the_stdlib_encoding_did(response: LLMResponse) -> None:
    ours = outcome(encode_response, response)
    theirs = outcome(reference_encode, response)
    if theirs[0] == "raised":
        assert ours == theirs  # NaN, infinity: refused as before (the call is not cached)
        return
    assert ours[0] == "value"
    assert decode_fields(ours[1]) == decode_fields(theirs[1])
    assert json.loads(ours[1]) == json.loads(theirs[1])


@pytest.mark.parametrize(
    "changes",
    [
        {"cost": float("nan")},
        {"ttft_ms": float("inf")},
        {"prompt_tokens": float("nan")},  # a float where none belongs is still checked
        {"model": object()},
        {"call_id": Label("a str subclass")},
        {"prompt_tokens": 2**80},
        {"content": "\ud800 lone surrogate"},
        {"provider": ["a", 1.5]},
    ],
)
def test_unusual_field_values_are_encoded_or_refused_as_before(changes: dict[str, Any]) -> None:
    response = dataclasses.replace(LLMResponse(content="ok", ttft_ms=1.5, cost=0.25), **changes)
    assert outcome(encode_response, response) == outcome(reference_encode, response)


class Colour(enum.Enum):
    RED = "red"


class Count(enum.IntEnum):
    ONE = 1


_ODD_VALUES: list[Any] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    1.5,
    2,
    True,
    None,
    "text",
    Label("a str subclass"),
    Colour.RED,
    Count.ONE,
    uuid.UUID(int=7),
    2**80,
    ["a", 1.5],
    {"k": float("nan")},
]


@pytest.mark.parametrize("name", [n for n in _STORED_FIELDS if n != "tool_calls"])
@pytest.mark.parametrize("value", _ODD_VALUES, ids=repr)
def test_any_value_of_any_field_is_encoded_or_refused_as_the_stdlib_does(
    name: str, value: Any
) -> None:
    # The usual response is checked field by field against the declared types; any value of
    # another type in any field takes the general check: what orjson stores reads back as
    # the stdlib's encoding, and what the stdlib refuses is refused.
    base = LLMResponse(content="ok", model="m", call_id="c", ttft_ms=1.5, finish_reason="stop")
    response = dataclasses.replace(base, **{name: value})
    ours = outcome(encode_response, response)
    theirs = outcome(reference_encode, response)
    if theirs[0] == "raised" or ours[0] == "raised":
        assert ours == theirs
        return
    assert json.loads(ours[1]) == json.loads(theirs[1])
    assert outcome(decode_fields, ours[1]) == outcome(decode_fields, theirs[1])


def test_the_field_by_field_check_names_the_stored_fields_in_order() -> None:
    # encode_response unpacks the stored values into one name per field, in field order.
    names = [n for n in encode_response.__code__.co_varnames if n in _STORED_FIELDS]
    assert names == list(_STORED_FIELDS)


def test_a_response_holding_more_than_its_fields_is_stored_by_name() -> None:
    # An instance attribute that is no field (set past the frozen guard) is not stored.
    response = LLMResponse(content="ok", cost=0.5, tool_calls=(ToolCall("i", "n", "{}"),))
    object.__setattr__(response, "note", "not a field")
    assert encode_response(response) == reference_encode(response)
    assert decode_fields(encode_response(response))["tool_calls"] == response.tool_calls


@settings(max_examples=300, deadline=None)
@given(responses, st.booleans())
def test_a_hit_kept_as_an_object_is_the_hit_read_back_from_json(
    response: LLMResponse, structured: bool
) -> None:
    # A backend of the caller's process keeps hit_fields(response); any other backend keeps
    # encode_response(response), decoded on a hit. Both build the same hit.
    if structured:
        response = dataclasses.replace(response, structured_data={"parsed": True})
    kept = hit_fields(response)
    assert kept == _hit_fields_by_name(response)
    assert type(kept) is dict and kept["structured_data"] is None
    data = object()
    hit = hit_response(kept, "hit", data)
    assert hit == _hit_response_by_name(kept, "hit", data)
    assert hit == dataclasses.replace(
        response, **_HIT_OVERRIDES, call_id="hit", structured_data=data
    )
    if outcome(reference_encode, response)[0] == "raised":
        return  # NaN, infinity: not JSON; an object entry keeps them as they are
    decoded = decode_fields(encode_response(response))
    # (No tool calls are stored as null and decoded as the default, an empty tuple.)
    assert hit_response(decoded, "hit", data) == hit


def test_a_hit_takes_every_field_from_its_place() -> None:
    # Every field its own value: a field read from the wrong place would show.
    names = [f.name for f in dataclasses.fields(LLMResponse)]
    fields: dict[str, Any] = {name: f"value of {name}" for name in names}
    assert hit_response(fields, "hit", "data") == _hit_response_by_name(fields, "hit", "data")
    assert len(fields) == len(names)  # the positional path, not the definition


def test_a_kept_hit_holds_the_fields_as_they_were_and_the_hit_its_overrides() -> None:
    response = LLMResponse(
        content="ok", call_id="c1", cost=0.5, latency_ms=9, ttft_ms=1.0, cache_hit=False
    )
    kept = hit_fields(response)
    # The response's fields, in a dict of the entry's own: the entry shares no state with it.
    assert kept == vars(response) and kept is not vars(response)
    hit = hit_response(kept, "c2", None)
    assert {name: getattr(hit, name) for name in _HIT_OVERRIDES} == _HIT_OVERRIDES
    assert hit.content == "ok" and hit.call_id == "c2" and hit.cost == 0.0


def test_fields_that_are_not_a_responses_are_refused() -> None:
    names = [f.name for f in dataclasses.fields(LLMResponse)]
    foreign = {name: "x" for name in names[:-1]} | {"oops": 1}  # as many keys, one foreign
    for build in (hit_response, _hit_response_by_name):
        with pytest.raises((TypeError, KeyError)):
            build(foreign, "hit", None)
        with pytest.raises(TypeError):
            build({"content": "x", "oops": 1}, "hit", None)


def test_a_response_holding_more_than_its_fields_is_kept_by_name() -> None:
    response = LLMResponse(content="ok", tool_calls=(ToolCall("i", "n", "{}"),))
    object.__setattr__(response, "note", "not a field")
    assert hit_fields(response) == _hit_fields_by_name(response)
    assert "note" not in hit_fields(response)


# --------------------------------------------------------------------------- telemetry


def test_the_context_is_installed_on_an_otherwise_identical_request() -> None:
    names = [f.name for f in dataclasses.fields(ChatRequest)]
    assert names[-1] == "context"  # the positional copy relies on it
    request = ChatRequest(
        messages=[{"role": "user", "content": "x"}],
        session_id="s",
        parent_call_id="p",
        cache_salt="salt",
        cache_namespace="ns",
        structured="json",
        stream=False,
        response_format={"type": "json_object"},
        extra_body={"seed": 1},
    )
    marker = CallContext()
    copy = with_context(request, marker)
    assert copy == dataclasses.replace(request, context=marker)
    assert copy.context is marker
    assert all(getattr(copy, name) is getattr(request, name) for name in names if name != "context")


def test_a_success_row_carries_every_field_in_its_place() -> None:
    request = ChatRequest(
        messages=[{"role": "user", "content": "x"}], session_id="s", parent_call_id="p"
    )
    source = SourceConfig(
        name="src",
        provider="prov",
        base_url="http://127.0.0.1:9/v1",
        model="model-x",
        api_key=Secret("sk-never-recorded"),
    )
    response = LLMResponse(
        content="answer",
        thinking="why",
        model="model-y",
        provider="",
        prompt_tokens=7,
        completion_tokens=3,
        latency_ms=41,
        ttft_ms=1.5,
        max_inter_token_ms=0.5,
        usage_source="estimated",
    )
    record = build_telemetry_record(
        request, response, call_id="c", latency_ms=99, created_at=12.0, source=source
    )
    assert record == TelemetryRecord(
        call_id="c",
        parent_call_id="p",
        session_id="s",
        model="model-y",
        provider="prov",
        source_name="src",
        messages='[{"content":"x","role":"user"}]',
        response="answer",
        thinking="why",
        prompt_tokens=7,
        completion_tokens=3,
        usage_source="estimated",
        latency_ms=41,
        ttft_ms=1.5,
        max_inter_token_ms=0.5,
        cache_hit=False,
        error=None,
        cost=None,
        created_at=12.0,
        scope="LLM",  # the source's
        root_call_id="c",  # a row built alone is a call of its own
    )
    assert "sk-never-recorded" not in repr(record)


class ListRecorder:
    def __init__(self) -> None:
        self.records: list[TelemetryRecord] = []

    def record_nowait(self, record: TelemetryRecord) -> None:
        self.records.append(record)

    async def record(self, record: TelemetryRecord) -> None:
        self.record_nowait(record)

    async def flush(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class ValuesRecorder(ListRecorder):
    """Takes rows as values too (``ports.SupportsRecordValues``), keeping them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.from_values: list[TelemetryRecord] = []

    def record_values_nowait(self, values: TelemetryValues) -> None:
        self.from_values.append(TelemetryRecord(*values))


class _ContentFree:
    """A recorder that reads no content (``ports.DeclaresContentUse``)."""

    wants_content = False


class ListRecorderReadingNoContent(_ContentFree, ListRecorder):
    pass


class ValuesRecorderReadingNoContent(_ContentFree, ValuesRecorder):
    pass


class FixedPricing:
    def cost(
        self,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> float | None:
        if model == "unpriced":
            return None
        return prompt_tokens * 0.5 + completion_tokens + cached_tokens * 0.25 + cache_write_tokens


def _rows_of(
    recorder: ListRecorder,
    request: ChatRequest,
    attempts: Sequence[tuple[SourceConfig, str, LLMResponse | BaseException, int]],
    *,
    pricing: FixedPricing | None,
) -> None:
    """Run one call through a telemetry layer whose dispatcher reports ``attempts``."""
    clock = FakeClock()
    clock.advance(1234.5)
    layer = TelemetryMiddleware(
        recorder, pricing=pricing, clock=clock, scope="SCOPE", namespace="layer-ns"
    )

    async def dispatch(sent: ChatRequest) -> LLMResponse:
        assert sent.context is not None
        for source, call_id, outcome_, latency_ms in attempts:
            for observer in sent.context.observers:
                observer.on_attempt(sent, source, call_id, outcome_, latency_ms)
        last = attempts[-1][2]
        if isinstance(last, BaseException):
            raise last
        return last

    asyncio.run(layer(with_context(request, CallContext()), dispatch))


def _source(name: str, model: str) -> SourceConfig:
    return SourceConfig(
        name=name,
        provider="prov-" + name,
        base_url="http://127.0.0.1:9/v1",
        model=model,
        api_key=Secret("sk-x"),
        scope="" if name == "bare" else "SRC",
    )


usual_responses = st.builds(
    LLMResponse,
    content=texts,
    thinking=texts,
    model=st.sampled_from(["", "model-r", "unpriced"]),
    provider=st.sampled_from(["", "prov-r"]),
    prompt_tokens=st.integers(0, 10**6),
    completion_tokens=st.integers(0, 10**6),
    latency_ms=st.integers(0, 10**6),
    ttft_ms=st.none() | st.floats(0, 1e6),
    max_inter_token_ms=st.none() | st.floats(0, 1e6),
    cache_hit=st.booleans(),
    source_name=st.sampled_from(["", "named"]),
    usage_source=st.sampled_from(["measured", "estimated"]),
    cached_prompt_tokens=st.integers(0, 5),
    cache_write_tokens=st.integers(0, 5),
)


@settings(max_examples=200, deadline=None)
@given(
    responses=st.lists(usual_responses, min_size=1, max_size=3),
    failure=st.booleans(),
    source_model=st.sampled_from(["", "model-s", "unpriced"]),
    bare=st.booleans(),
    priced=st.booleans(),
    request_fields=st.fixed_dictionaries(
        {
            "session_id": st.none() | texts,
            "parent_call_id": st.none() | texts,
            "cache_namespace": st.none() | st.just("") | texts,
            "params": st.none() | st.just(ChatParams(temperature=0.5, max_tokens=7)),
        }
    ),
    content=texts,
    reads_content=st.booleans(),
)
def test_the_usual_row_handed_over_as_values_is_build_records(
    responses: list[LLMResponse],
    failure: bool,
    source_model: str,
    bare: bool,
    priced: bool,
    request_fields: dict[str, Any],
    content: str,
    reads_content: bool,
) -> None:
    """Attempts reported as successes (and a failed one among them) give the same rows
    through ``record_values_nowait`` as through ``build_record`` and ``record_nowait``."""
    request = ChatRequest(messages=[{"role": "user", "content": content}], **request_fields)
    source = _source("bare" if bare else "main", source_model)
    attempts: list[tuple[SourceConfig, str, LLMResponse | BaseException, int]] = [
        (source, f"call-{i}", response, 10 + i) for i, response in enumerate(responses)
    ]
    if failure:
        attempts.insert(0, (source, "call-failed", TimeoutError("slow"), 5))
    pricing = FixedPricing() if priced else None
    plain, fast = (
        (ListRecorder(), ValuesRecorder())
        if reads_content
        else (ListRecorderReadingNoContent(), ValuesRecorderReadingNoContent())
    )
    _rows_of(plain, request, attempts, pricing=pricing)
    _rows_of(fast, request, attempts, pricing=pricing)
    assert len(fast.from_values) == len(responses)  # every success went as values
    assert fast.records + fast.from_values == plain.records
    assert [r.root_call_id for r in plain.records] == [attempts[0][1]] * len(attempts)


def test_a_sub_millisecond_attempt_keeps_its_zero_latency_in_the_row() -> None:
    """The row holds the latency the caller saw, 0 included, on both ways a row is built;
    only a summary that gives none (``AttemptSummary``) takes the governor's measure."""
    request = ChatRequest(messages=[{"role": "user", "content": "x"}])
    attempts: list[tuple[SourceConfig, str, LLMResponse | BaseException, int]] = [
        (_source("main", "m"), "c", LLMResponse(content="ok", latency_ms=0), 3)
    ]
    plain, fast = ListRecorder(), ValuesRecorder()
    _rows_of(plain, request, attempts, pricing=None)
    _rows_of(fast, request, attempts, pricing=None)
    assert [r.latency_ms for r in plain.records + fast.from_values] == [0, 0]
    source = _source("main", "m")
    rows = [
        build_record(
            summary,
            call_id="c",
            parent_call_id=None,
            session_id=None,
            messages="",
            latency_ms=3,
            created_at=1.0,
            source=source,
        ).latency_ms
        for summary in (AttemptSummary(latency_ms=0), AttemptSummary())
    ]
    assert rows == [0, 3]


def test_a_structured_attempt_still_goes_through_build_record() -> None:
    request = ChatRequest(messages=[{"role": "user", "content": "x"}], structured="json")
    recorder = ValuesRecorder()
    _rows_of(
        recorder, request, [(_source("main", "m"), "c", LLMResponse(content="{}"), 1)], pricing=None
    )
    assert recorder.from_values == [] and [r.call_id for r in recorder.records] == ["c"]


# --------------------------------------------------------------------------- backends


async def test_the_memory_cache_answers_the_same_with_and_without_a_coroutine() -> None:
    clock = FakeClock()
    cache = MemoryCache(clock=clock, max_entries=2)
    cache.set_nowait("a", "1", 10.0)
    await cache.set("b", "2", 10.0)
    assert (cache.get_nowait("a"), await cache.get("b")) == ("1", "2")
    cache.set_nowait("a", "1b", 10.0)  # overwriting makes "a" the most recent
    await cache.set("c", "3", 10.0)
    assert (cache.get_nowait("b"), cache.get_nowait("a"), await cache.get("c")) == (
        None,
        "1b",
        "3",
    )
    clock.advance(10.0)
    assert cache.get_nowait("a") is None
    with pytest.raises(TypeError):
        cache.set_nowait("k", 1, 10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        cache.set_nowait("k", "v", math.inf)


async def test_no_row_is_lost_across_many_batches(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), batch_size=100, flush_interval_s=0.01)
    records = [
        build_telemetry_record(
            ChatRequest(messages=[{"role": "user", "content": f"prompt {i} ü"}]),
            LLMResponse(content=f"answer {i}", cost=0.5 if i % 2 else None, latency_ms=i),
            call_id=f"call-{i}",
            latency_ms=i + 1,  # the governor's: the response's own goes in the row
            created_at=0.0 if i % 3 == 0 else 1000.0 + i,
        )
        for i in range(1050)
    ]
    for record in records:
        recorder.record_nowait(record)
    recorder.record_nowait(records[0])  # a duplicate call_id is ignored, not an error
    await recorder.aclose()
    with closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(
            "SELECT call_id, messages, response, cost, latency_ms, created_at FROM pgw_calls"
        ).fetchall()
    assert recorder.dropped == 0
    assert len(rows) == len(records)
    by_id = {row[0]: row for row in rows}
    for i, record in enumerate(records):
        _, messages, response, cost, latency_ms, created_at = by_id[record.call_id]
        assert (messages, response, cost, latency_ms) == (
            record.messages,
            record.response,
            record.cost,
            i,
        )
        if record.created_at:
            assert created_at == record.created_at
        else:  # a record without a timestamp is stamped when it is recorded
            assert created_at > 1_600_000_000


async def test_a_row_sqlite_cannot_bind_among_many_is_dropped_alone(tmp_path: Path) -> None:
    """Rows go in multi-row statements: one bad row still costs only itself."""
    path = tmp_path / "t.db"
    recorder = SQLiteRecorder(str(path), flush_interval_s=60.0)  # one batch, at close
    request = ChatRequest(messages=[{"role": "user", "content": "x"}])
    records = [
        build_telemetry_record(
            request,
            LLMResponse(content="ok", prompt_tokens=2**70 if i == 70 else i),
            call_id=f"call-{i}",
            latency_ms=1,
            created_at=1.0,
        )
        for i in range(150)
    ]
    for record in records:
        recorder.record_nowait(record)
    await recorder.aclose()
    with closing(sqlite3.connect(path)) as conn:
        stored = {row[0] for row in conn.execute("SELECT call_id FROM pgw_calls")}
    assert stored == {f"call-{i}" for i in range(150) if i != 70}
    assert recorder.dropped == 1


async def test_the_memory_cache_checks_every_new_ttl() -> None:
    cache = MemoryCache(clock=FakeClock())
    cache.set_nowait("a", "1", 10.0)
    for bad in (None, 0, -1.0, math.nan, True, "10"):
        with pytest.raises(ValueError, match="ttl"):
            cache.set_nowait("b", "2", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="ttl"):
            await cache.set("b", "2", bad)  # type: ignore[arg-type]
    assert cache.get_nowait("b") is None
    ttl = 5.0
    cache.set_nowait("c", "3", ttl)
    cache.set_nowait("d", "4", ttl)
    assert cache.remaining_ttl_s("d") == 5.0


_ROW_VALUES = (
    "c1", None, "s1", "gpt-x", "openai", "main", "[]", "hello", "", 3, 4, "measured", 12,
    1.5, 2.5, False, None, 0.001, 123.0, "LLM", "tenant", "", "c1",
)  # fmt: skip


@pytest.mark.parametrize(
    ("plain", "fast"),
    [
        # The classes' own (fast) __init__ against the definition: each field set by
        # object.__setattr__, as the dataclass's frozen __init__ does.
        (
            lambda: definition(TelemetryRecord, _ROW_VALUES, {}),
            lambda: TelemetryRecord(*_ROW_VALUES),
        ),
        (
            lambda: definition(CallStart, ("chat", 1.0, "LLM", "s", "p", "ns", True), {}),
            lambda: CallStart("chat", 1.0, "LLM", "s", "p", "ns", True),
        ),
        (
            lambda: GovernanceEvent("admitted", "main", "half_open", True),
            lambda: admitted_event("main", "half_open", True),
        ),
    ],
    ids=["TelemetryRecord", "CallStart", "admitted_event"],
)
def test_the_per_call_constructors_make_what_the_dataclass_makes(
    plain: Callable[[], Any], fast: Callable[[], Any]
) -> None:
    made, expected = fast(), plain()
    assert type(made) is type(expected)
    assert made == expected and hash(made) == hash(expected) and repr(made) == repr(expected)
    assert dataclasses.asdict(made) == dataclasses.asdict(expected)
    assert vars(made) == vars(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.scope = "other"
    field = dataclasses.fields(made)[0].name
    assert dataclasses.replace(made) == expected
    assert getattr(dataclasses.replace(made, **{field: "x"}), field) == "x"


# --------------------------------------------------------------------------- calling a layer


class _Layer:
    """A layer with its own ``__call__``."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, object]] = []

    async def __call__(self, request: Any, call_next: Any) -> Any:
        self.seen.append((request, call_next))
        return "layer"


class _InheritedLayer(_Layer):
    pass


class _StaticLayer:
    @staticmethod
    async def __call__(request: Any, call_next: Any) -> Any:
        return ("static", request, call_next)


async def _function_layer(request: Any, call_next: Any) -> Any:
    return ("function", request, call_next)


@pytest.mark.parametrize(
    "layer",
    [_Layer(), _InheritedLayer(), _StaticLayer(), _function_layer],
    ids=["own", "inherited", "staticmethod", "function"],
)
async def test_a_layer_is_called_through_its_bound_method_as_calling_it_does(
    layer: Any,
) -> None:
    call = _layer_call(layer)
    assert await call("request", "next") == await layer("request", "next")
    if isinstance(layer, _Layer):
        assert call.__self__ is layer and call.__func__ is type(layer).__call__
        assert layer.seen == [("request", "next")] * 2
    else:
        assert call is layer


async def test_an_instance_attribute_named_call_is_not_what_runs() -> None:
    """Calling an instance looks ``__call__`` up on its class: so does the bound method."""
    layer = _Layer()
    layer.__call__ = _function_layer  # type: ignore[method-assign]
    assert await _layer_call(layer)("request", "next") == await layer("request", "next")
    assert layer.seen == [("request", "next")] * 2


# --------------------------------------------------------------------------- milliseconds


@given(
    start=st.floats(-1e9, 1e9, allow_nan=False),
    now=st.floats(-1e9, 1e9, allow_nan=False),
)
def test_elapsed_ms_is_the_clamped_truncation(start: float, now: float) -> None:
    assert elapsed_ms(start, now) == max(0, int((now - start) * 1000.0))
    assert type(elapsed_ms(start, now)) is int


def test_elapsed_ms_refuses_what_int_refuses() -> None:
    for start, now in ((0.0, math.nan), (0.0, math.inf), (math.inf, 0.0)):
        with pytest.raises((ValueError, OverflowError)):
            elapsed_ms(start, now)


# --------------------------------------------------------------------------- a miss's entry


class _KeptObjects:
    """An object backend recording what the cache layer stores."""

    def __init__(self) -> None:
        self.stored: list[object] = []

    async def get(self, key: str) -> str | None:
        return None

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        raise AssertionError("an object backend gets objects")

    def get_object(self, key: str) -> object | None:
        return None

    def set_object(self, key: str, value: object, ttl_s: float) -> None:
        self.stored.append(value)


@settings(max_examples=300, deadline=None)
@given(
    responses,
    st.sampled_from([None, "stop", "length", "content_filter", "tool_calls"]),
    st.sampled_from(["", " \n", "text"]),
    st.booleans(),
)
async def test_a_miss_stores_what_is_cacheable_and_hit_fields_say(
    response: LLMResponse, finish_reason: str | None, content: str, structured: bool
) -> None:
    response = dataclasses.replace(
        response,
        finish_reason=finish_reason,
        content=content,
        structured_data={"parsed": True} if structured else None,
    )
    backend = _KeptObjects()
    layer = CacheMiddleware(
        backend,  # type: ignore[arg-type]
        namespace="n",
        ttl_s=60.0,
        model_identity="m",
        strategy=JsonRepairStrategy(),
    )

    async def answer(request: ChatRequest) -> LLMResponse:
        return response

    assert await layer(ChatRequest(messages=[{"role": "user", "content": "x"}]), answer) is response
    assert backend.stored == ([hit_fields(response)] if is_cacheable(response) else [])
