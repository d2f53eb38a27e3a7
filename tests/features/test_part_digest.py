"""The digest of a non-text part is the one ``polygateway.digest`` defines, in both forms: a
plain reference built from the stdlib encoder gives the same sha256, the streamed form's input
decodes back to the part (nothing collides), and the pipeline stores and keys that digest."""

from __future__ import annotations

import hashlib
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.backends.memory.cache import MemoryCache
from polygateway.client import GatewayClient
from polygateway.digest import (
    STREAMED_MIN_CHARS,
    STREAMED_PREFIX,
    canonical_messages_json,
    messages_digest,
    part_sha256,
)
from polygateway.errors import RequestRejectedError
from polygateway.middleware.cache import CacheMiddleware
from polygateway.settings import (
    CacheSettings,
    RetrySettings,
    ScopeSettings,
    SourceConfig,
    TelemetrySettings,
)
from polygateway.structured.json_repair import JsonRepairStrategy
from polygateway.testing import FakeClock, FakeUpstream
from polygateway.types import ChatRequest


def reference_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_MARKER = re.compile(r'"\\u0000@(\d+)"')


def reference_stream(part: Any) -> bytes | None:
    """The streamed form's input, built the plain way: long strings swapped for numbered
    markers, the stdlib's JSON of that, the markers' order read off the text, then each
    marker rewritten as its placeholder. ``None`` when the plain form applies."""
    long_strings: list[str] = []

    def swap(value: Any, depth: int) -> Any:
        if isinstance(value, str):
            if len(value) >= STREAMED_MIN_CHARS:
                long_strings.append(value)
                return f"\x00@{len(long_strings) - 1}"
            return "\x00" + value if value.startswith("\x00") else value
        if isinstance(value, (dict, list, tuple)) and depth >= 32:
            raise RecursionError
        if isinstance(value, dict):
            return {key: swap(item, depth + 1) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [swap(item, depth + 1) for item in value]
        return value

    try:
        marked = reference_json(swap(part, 0))
    except RecursionError:
        return None
    if not long_strings:
        return None
    order = [long_strings[int(n)] for n in _MARKER.findall(marked)]
    skeleton = _MARKER.sub(
        lambda m: json.dumps(f"\x00#{len(long_strings[int(m[1])].encode('utf-8'))}"), marked
    )
    # json.dumps writes "\x00" as \u0000, as canonical JSON does.
    return STREAMED_PREFIX + skeleton.encode("utf-8") + b"\n" + "".join(order).encode("utf-8")


def reference_sha256(part: Any) -> str:
    stream = reference_stream(part)
    if stream is None:
        stream = reference_json(part).encode("utf-8")
    return hashlib.sha256(stream).hexdigest()


def decode_stream(stream: bytes) -> Any:
    """The part back from a streamed-form input: proof that two parts never share one."""
    assert stream.startswith(STREAMED_PREFIX)
    skeleton_json, _, rest = stream[len(STREAMED_PREFIX) :].partition(b"\n")
    skeleton = json.loads(skeleton_json)
    offset = 0

    def restore(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, str) and value.startswith("\x00#"):
            size = int(value[2:])
            data = rest[offset : offset + size]
            offset += size
            return data.decode("utf-8")
        if isinstance(value, str) and value.startswith("\x00"):
            return value[1:]
        if isinstance(value, dict):
            return {key: restore(item) for key, item in value.items()}
        if isinstance(value, list):
            return [restore(item) for item in value]
        return value

    value = restore(skeleton)
    assert offset == len(rest)
    return value


def outcome(function: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("value", function(*args))
    except Exception as exc:  # the comparison is the point
        return ("raised", type(exc))


def long_text(size: int = STREAMED_MIN_CHARS) -> st.SearchStrategy[str]:
    """Strings around the threshold, with the characters that matter to the framing."""
    alphabet = st.sampled_from(["A", "z", "/", "é", "日", "\U0001f600", "\x00", "#", "\n", '"'])
    return st.builds(
        lambda head, fill, extra: head + fill * (size - len(head) + extra),
        st.text(alphabet, max_size=6),
        alphabet,
        st.integers(-1, 3),
    )


short = st.text(max_size=8) | st.sampled_from(["\x00", "\x00#5", "\x00#1024", "\x00\x00", "#3"])
leaf = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | short | long_text()
keys = st.text(max_size=6) | st.sampled_from(["url", "\x00#4", "data", "é"])
values = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, values, max_size=4))
def test_part_digest_is_the_reference_in_either_form(part: dict[str, Any]) -> None:
    assert outcome(part_sha256, part) == outcome(reference_sha256, part)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, values, min_size=1, max_size=4))
def test_streamed_form_input_decodes_back_to_the_part(part: dict[str, Any]) -> None:
    stream = outcome(reference_stream, part)
    if stream[0] == "raised" or stream[1] is None:
        return
    assert decode_stream(stream[1]) == json.loads(reference_json(part))


def image(size: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "A" * size, "detail": "high"}}


def test_only_parts_with_a_long_string_take_the_streamed_form() -> None:
    below, at = image(STREAMED_MIN_CHARS - 1), image(STREAMED_MIN_CHARS)
    plain = hashlib.sha256(reference_json(below).encode("utf-8")).hexdigest()
    assert part_sha256(below) == plain  # unchanged by version 2
    assert part_sha256(at) != hashlib.sha256(reference_json(at).encode("utf-8")).hexdigest()
    assert part_sha256(at) == reference_sha256(at)


def test_several_long_strings_are_streamed_in_the_key_order_of_the_json() -> None:
    a, b = "a" * 2000, "b" * 2000
    swapped = {"type": "file", "z": a, "m": b}
    assert part_sha256(swapped) == reference_sha256(swapped)
    assert part_sha256(swapped) != part_sha256({"type": "file", "z": b, "m": a})
    # A string moving between fields changes the digest even at equal lengths and bytes.
    assert part_sha256({"x": [a, b]}) != part_sha256({"x": [b, a]})
    assert part_sha256({"x": [a + b]}) != part_sha256({"x": [a, b]})


def test_strings_that_look_like_placeholders_do_not_collide() -> None:
    data = "A" * STREAMED_MIN_CHARS
    real = {"url": data, "note": f"\x00#{STREAMED_MIN_CHARS}"}
    assert part_sha256(real) == reference_sha256(real)
    assert part_sha256(real) != part_sha256({"url": data, "note": data})
    assert part_sha256({"url": data, "note": "\x00"}) != part_sha256({"url": data, "note": ""})


class LoudStr(str):
    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        return b"not the text"

    def __getitem__(self, index: Any) -> str:
        return "not the text"


def test_str_subclasses_and_long_non_ascii_strings_hash_their_text() -> None:
    text = "QUJD" * 40_000  # several hash pieces
    assert part_sha256({"url": LoudStr(text)}) == part_sha256({"url": text})
    assert part_sha256({"url": text}) == reference_sha256({"url": text})
    wide = "日本" * 40_000
    assert part_sha256({"url": wide}) == reference_sha256({"url": wide})


def test_deep_or_circular_parts_take_the_plain_form_and_its_errors() -> None:
    deep: Any = "A" * STREAMED_MIN_CHARS
    for _ in range(40):
        deep = [deep]
    assert part_sha256(deep) == hashlib.sha256(reference_json(deep).encode()).hexdigest()
    loop: dict[str, Any] = {"url": "A" * STREAMED_MIN_CHARS}
    loop["self"] = loop
    assert outcome(part_sha256, loop) == outcome(reference_json, loop)
    broken = {"url": "A" * STREAMED_MIN_CHARS + "\ud800"}
    assert outcome(part_sha256, broken) == outcome(reference_sha256, broken)
    assert outcome(part_sha256, {"url": "A" * 2000, "x": object()})[0] == "raised"


class LyingLengthStr(str):
    """A ``str`` whose own ``__len__`` and ``startswith`` say what its characters do not."""

    def __init__(self, text: str, length: int) -> None:
        self.length = length

    def __new__(cls, text: str, length: int) -> LyingLengthStr:
        return super().__new__(cls, text)

    def __len__(self) -> int:
        return self.length

    def startswith(self, *args: Any, **kwargs: Any) -> bool:
        return not super().startswith(*args, **kwargs)


@pytest.mark.parametrize("text", ["A" * 5000, "é" * 5000, "A" * 10, "\x00#5000"])
@pytest.mark.parametrize("length", [3, 5000, 10**9])
def test_a_str_subclass_own_length_has_no_say_in_the_framing(text: str, length: int) -> None:
    lying = {"type": "file", "data": LyingLengthStr(text, length), "note": LyingLengthStr(text, 1)}
    assert part_sha256(lying) == part_sha256({"type": "file", "data": text, "note": text})
    assert part_sha256(lying) == reference_sha256({"type": "file", "data": text, "note": text})


@pytest.mark.parametrize("fill", ["A", "é"], ids=["ascii", "non-ascii"])
@pytest.mark.parametrize("deep_side", ["the-string", "another-field"])
def test_a_part_too_deep_for_the_streamed_form_is_hashed_without_copying_its_json(
    fill: str, deep_side: str
) -> None:
    size = 4 << 20
    nest: Any = {"url": fill * size}  # a value of a dict, as in parts (an item of a list
    # costs one more copy: the stdlib's iterencode joins it to the separator)
    if deep_side == "the-string":
        for _ in range(40):
            nest = {"wrap": [nest]}
        part: Any = {"type": "file", "data": nest}
    else:
        deep: Any = "bottom"
        for _ in range(40):
            deep = [deep]
        part = {"type": "file", "data": nest, "deep": deep}
    expected = hashlib.sha256(reference_json(part).encode("utf-8")).hexdigest()
    tracemalloc.start()
    try:
        digest = part_sha256(part)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest == expected  # the plain form
    # One escaped copy of the string at most: neither the whole JSON and its UTF-8 at once.
    assert peak < 1.5 * size


NOT_UNICODE = [
    ([{"role": "user", "content": "a \ud800 b"}], "messages[0].content", "U+D800 at character 2"),
    (
        [
            {"role": "system", "content": "fine"},
            {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "input_audio",
             "input_audio": {"data": "é" * 3000 + "\udfff", "format": "wav"}}]},
        ],
        "messages[1].content[1].input_audio.data",
        "U+DFFF at character 3000",
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x\udc00"}}]}],
        "messages[0].content[0].image_url.url",
        "U+DC00 at character 1",
    ),
    (
        [{"role": "user", "content": [{"type": "file", "file": {"na\ud800me": "x"}}]}],
        "messages[0].content[0].file (a key)",
        "U+D800 at character 2",
    ),
    (
        [{"role": "user", "content": "A" * 5000, "name": "\ud83d"}],
        "messages[0].name",
        "U+D83D at character 0",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "place", "what"), NOT_UNICODE)
def test_text_that_is_not_unicode_is_refused_naming_its_place(
    messages: list[Any], place: str, what: str
) -> None:
    for function in (messages_digest, canonical_messages_json):
        with pytest.raises(RequestRejectedError) as caught:
            function(messages)
        assert str(caught.value).startswith(f"{place}: a lone surrogate {what} ")
    # A surrogate pair written as such is not text either; one character is.
    with pytest.raises(RequestRejectedError):
        messages_digest([{"role": "user", "content": "\ud83d\ude00"}])
    assert messages_digest([{"role": "user", "content": "\U0001f600"}])


async def test_a_lone_surrogate_is_refused_before_any_request(
    fake_upstream: FakeUpstream, tmp_path: Path
) -> None:
    source = SourceConfig(
        name="sur", provider="generic", base_url=fake_upstream.base_url("sur"), model="m"
    )
    settings = ScopeSettings(
        scope="LLM",
        sources=(source,),
        retry=RetrySettings(max_attempts=3),
        cache=CacheSettings(backend="memory", namespace="n", ttl_s=60),
        telemetry=TelemetrySettings(backend="sqlite", sqlite_path=str(tmp_path / "t.db")),
    )
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "\ud800"}}]}
    ]
    async with GatewayClient(settings) as client:
        for stream in (False, True):
            with pytest.raises(RequestRejectedError, match=r"messages\[0\]\.content\[0\]"):
                await client.chat(messages, stream=stream)
    assert fake_upstream.requests("sur") == 0


def large_image_request() -> ChatRequest:
    url = "data:image/png;base64," + "QUJD" * 1_000
    return ChatRequest(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in it?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ]
    )


def test_rows_and_cache_keys_carry_the_streamed_digest() -> None:
    request = large_image_request()
    part = request.messages[0]["content"][1]
    column = canonical_messages_json(request.messages)
    assert json.loads(column)[0]["content"][1] == {
        "type": "image_url",
        "sha256": reference_sha256(part),
    }
    assert messages_digest(request.messages) == hashlib.sha256(column.encode()).hexdigest()
    layer = CacheMiddleware(
        MemoryCache(clock=FakeClock()),
        namespace="tenant-1",
        ttl_s=60.0,
        model_identity="model-a",
        strategy=JsonRepairStrategy(),
    )
    assert layer.key(request) == GOLDEN_LARGE_IMAGE_KEY


# Version 2 keys of a part with a long string: they stay as they are within the version.
GOLDEN_LARGE_IMAGE_KEY = (
    "pgw:cache:2a8ce67326e0c0ae86a205fe8fd45bb4fe1a4ab6bfb665fb085647b160daa5e1"
)


def test_the_streamed_form_is_the_documented_byte_string() -> None:
    skeleton = b'{"image_url":{"detail":"high","url":"\\u0000#1024"},"type":"image_url"}'
    written = b"pgw-part-digest/2\n" + skeleton + b"\n" + b"A" * 1024
    assert part_sha256(image(1024)) == hashlib.sha256(written).hexdigest()
    assert part_sha256(image(1024)) == (
        "7b105d6253243b7e814db3f54b89530f618bf447145e59bf5066442e02d173bc"
    )
    assert part_sha256(image(5_000_000)) == (
        "ceecfa89fb1d96ff6eee111e9d1a13a8c058e605db82ebc0ff93d5abf0488fc1"
    )
