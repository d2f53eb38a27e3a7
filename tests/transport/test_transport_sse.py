"""Pure parsers: the SSE decoder, the think-tag splitter and the OpenAI chat chunk parser."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polygateway.errors import RequestRejectedError, SourceDeadError, TransientError
from polygateway.transports.openai_chunks import ChatStreamParser, parse_completion
from polygateway.transports.sse import SSEDecoder, SSEEvent, SSEProtocolError
from polygateway.transports.think_tags import ThinkTagSplitter, split_think


def decode_all(chunks: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.flush()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for point in points:
        pieces.append(data[start:point])
        start = point
    pieces.append(data[start:])
    return pieces


# --------------------------------------------------------------------------- SSE decoder

texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12
)


@settings(max_examples=150, deadline=None)
@given(
    payloads=st.lists(texts, min_size=1, max_size=6),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    space=st.booleans(),
    comments=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_decoder_survives_any_split(
    payloads: list[str], newline: str, space: bool, comments: bool, cuts: list[int]
) -> None:
    """Events come out whole whatever the chunking: inside UTF-8, inside CRLF, inside "data:"."""
    prefix = "data: " if space else "data:"
    wire = ""
    for text in payloads:
        if comments:
            wire += f": keep-alive{newline}"
        wire += f"{prefix}{text}{newline}{newline}"
    data = wire.encode("utf-8")
    events = decode_all(split_at(data, cuts))
    expected = [t[1:] if not space and t.startswith(" ") else t for t in payloads]
    assert [data.decode("utf-8") for data, _ in events] == expected


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_decoder_splits_inside_multibyte_characters(cuts: list[int]) -> None:
    text = "naïve 中文 ✓ 😀"
    frame = json.dumps({"choices": [{"delta": {"content": text}}]}, ensure_ascii=False)
    data = f"data: {frame}\n\ndata: [DONE]\n\n".encode()
    events = decode_all(split_at(data, cuts))
    assert [data for data, _ in events] == [frame.encode(), b"[DONE]"]
    assert json.loads(events[0][0])["choices"][0]["delta"]["content"] == text


def reference_events(wire: bytes) -> list[SSEEvent]:
    """Plain reading of the SSE spec for \n line ends: blank line ends an event."""
    out: list[SSEEvent] = []
    data: list[bytes] = []
    name: bytes | None = None
    for line in wire.split(b"\n"):
        if not line:
            if data:
                out.append((b"\n".join(data), name))
            data, name = [], None
            continue
        if line.startswith(b":"):
            continue
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value
    return out


sse_lines = st.one_of(
    texts.map(lambda t: f"data: {t}"),
    texts.map(lambda t: f"data:{t}"),
    texts.map(lambda t: f": {t}"),
    st.sampled_from(["event: error", "id: 3", "retry: 5", "data", "data: [DONE]", ""]),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.lists(sse_lines, min_size=1, max_size=3), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
)
def test_decoder_matches_the_spec_on_mixed_streams(
    events: list[list[str]], cuts: list[int]
) -> None:
    """Whole-buffer fast path or line-by-line path: the same events as a plain reading."""
    wire = "".join("\n".join(lines) + "\n\n" for lines in events).encode("utf-8")
    expected = reference_events(wire)
    assert decode_all([wire]) == expected
    assert decode_all(split_at(wire, cuts)) == expected


def test_decoder_one_byte_at_a_time_with_mixed_line_ends() -> None:
    data = b"data: a\r\n\r\ndata: b\n\ndata: c\r\rdata: d\n\r\n"
    decoder = SSEDecoder()
    out: list[bytes] = []
    for i in range(len(data)):
        out += [d for d, _ in decoder.feed(data[i : i + 1])]
    out += [d for d, _ in decoder.flush()]
    assert out == [b"a", b"b", b"c", b"d"]


def test_multi_line_data_comments_and_other_fields() -> None:
    data = (
        b": OPENROUTER PROCESSING\n\n"
        b"id: 7\nevent: error\ndata: first\ndata:second\nretry: 10\n\n"
        b":just a comment\n\n"
        b"data\n\n"
    )
    events = decode_all([data])
    assert events == [(b"first\nsecond", b"error"), (b"", None)]


def test_flush_dispatches_complete_lines_and_drops_a_cut_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]\n") == []
    assert decoder.flush() == [(b"[DONE]", None)]
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"choices": [{"del') == []
    assert decoder.pending_bytes > 0
    assert decoder.flush() == []


def test_oversized_event_is_a_protocol_error() -> None:
    decoder = SSEDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 40)
    with pytest.raises(SSEProtocolError):
        decoder.feed(b"x" * 40)


# --------------------------------------------------------------------------- think tags


@settings(max_examples=150, deadline=None)
@given(
    thinking=st.text(max_size=20).filter(lambda t: "</think>" not in t),
    answer=st.text(max_size=20).filter(lambda t: t == t.lstrip()),
    lead=st.sampled_from(["", " ", "\n"]),
    cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=10),
)
def test_think_block_split_anywhere(thinking: str, answer: str, lead: str, cuts: list[int]) -> None:
    text = f"{lead}<think>{thinking}</think>\n\n{answer}"
    splitter = ThinkTagSplitter()
    points = sorted({c % (len(text) + 1) for c in cuts})
    start = 0
    for point in [*points, len(text)]:
        if text[start:point]:
            splitter.feed(text[start:point])
        start = point
    assert splitter.finish() == (answer, thinking)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain answer", ("plain answer", "")),
        ("<b>bold</b> answer", ("<b>bold</b> answer", "")),
        # Original DeepSeek-R1 omits the opening tag: not guessed, the text stays content.
        ("reasoning here</think>answer", ("reasoning here</think>answer", "")),
        # A tag quoted mid-answer is content.
        ("use <think> tags", ("use <think> tags", "")),
        ("<think>unterminated", ("", "unterminated")),
        ("<thi", ("<thi", "")),
        ("◁think▷kimi◁/think▷answer", ("◁think▷kimi◁/think▷answer", "")),
    ],
)
def test_split_think_cases(text: str, expected: tuple[str, str]) -> None:
    assert split_think(text) == expected


def test_other_tag_pairs_from_a_profile() -> None:
    tags = (("<think>", "</think>"), ("◁think▷", "◁/think▷"))
    assert split_think("◁think▷kimi◁/think▷answer", tags) == ("answer", "kimi")
    assert split_think("no tags", ()) == ("no tags", "")


# --------------------------------------------------------------------------- chunks


def chunk(delta: dict[str, Any] | None = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "served"}
    if delta is not None:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
    body.update(extra)
    return json.dumps(body).encode()


def test_content_reasoning_usage_and_done() -> None:
    parser = ChatStreamParser()
    assert parser.feed_event(chunk({"role": "assistant", "content": ""})) is False
    assert parser.feed_event(chunk({"content": None, "reasoning_content": "think "})) is True
    assert parser.feed_event(chunk({"reasoning": "more"})) is True
    assert parser.feed_event(chunk({"content": "Hel"})) is True
    assert parser.feed_event(chunk({"content": "lo"})) is True
    finish = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert parser.feed_event(json.dumps(finish).encode()) is False
    for choices in ([], None, "missing"):
        usage = {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}
        if choices != "missing":
            usage["choices"] = choices
        assert parser.feed_event(json.dumps(usage).encode()) is False
    assert parser.feed_event(b"[DONE]") is False
    assert parser.done
    result = parser.result()
    assert (result.content, result.thinking) == ("Hello", "think more")
    assert (result.prompt_tokens, result.completion_tokens) == (5, 2)
    assert result.finish_reason == "length"
    assert result.model == "served"


chunk_bodies = st.one_of(
    st.builds(lambda c: chunk({"content": c}, usage=None), st.text(max_size=6)),
    st.builds(
        lambda c: chunk({"content": c}), st.sampled_from(["<think>", "a</think>b", " ", "x"])
    ),
    st.builds(lambda r: chunk({"content": None, "reasoning_content": r}), st.text(max_size=4)),
    st.just(chunk({"role": "assistant", "content": ""})),
    st.just(chunk({"tool_calls": [{"index": 0}]})),
    st.just(chunk({}, usage={"prompt_tokens": 3, "completion_tokens": 4})),
    st.just(json.dumps({"choices": [{"index": 1, "delta": {"content": "other"}}]}).encode()),
    st.just(json.dumps({"choices": [{"index": 0, "delta": {"content": "y"}}]}).encode()),
    st.just(
        json.dumps(
            {"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        ).encode()
    ),
    st.just(json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}).encode()),
    st.sampled_from([b"[DONE]", b"", b"not json", b"[1]", b'{"error": {"message": "x"}}']),
)


def _outcome(feed: Any) -> tuple[Any, ...]:
    parser = ChatStreamParser()
    try:
        tokens = feed(parser)
    except TransientError as exc:
        return ("error", str(exc))
    return ("ok", tokens, parser.done, parser.result())


def one_event_at_a_time(events: list[SSEEvent]) -> Any:
    """The definition ``feed_events`` is held to: ``feed_event`` on each event up to ``[DONE]``."""

    def feed(parser: ChatStreamParser) -> bool:
        token = False
        for data, name in events:
            if parser.feed_event(data, name):
                token = True
            if parser.done:
                break
        return token

    return feed


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(chunk_bodies, max_size=8))
def test_feed_events_is_feed_event_in_a_loop(frames: list[bytes]) -> None:
    events: list[SSEEvent] = [(frame, None) for frame in frames]

    assert _outcome(lambda parser: parser.feed_events(events)) == _outcome(
        one_event_at_a_time(events)
    )


# A stream's frames written compactly, as most servers do: the same bytes around each content
# literal, which the parser learns (its layout) and then decodes only the literal of.
_HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
_CONTENT_AT = _HEAD + b'"choices":[{"index":0,"delta":{"content":'
_CONTENT_END = b'},"logprobs":null,"finish_reason":null}]}'
_ROLE = _HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'


def compact(content: Any, *, head: bytes = _HEAD, **choice: Any) -> bytes:
    fields = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    fields.update(choice)
    return head + b'"choices":' + orjson.dumps([fields]) + b"}"


laid_out_frames = st.one_of(
    # Content of every kind: quotes, backslashes, controls, non-ASCII, lone braces.
    st.builds(compact, st.text(max_size=8)),
    st.builds(compact, st.sampled_from(['"', "\\", '"}', '\\"', "\x00", "é☃", "}]}", "\n"])),
    # The layout's bytes around a literal that is not (only) a string: the general path must
    # decide, and decide as it does alone.
    st.builds(
        lambda middle: _CONTENT_AT + middle + _CONTENT_END,
        st.sampled_from(
            [
                b'""',
                b"1",
                b"null",
                b'"a","x":1',
                b'"a"},"finish_reason":"stop","delta":{"content":"b"',
                b'"\\"',
                b'"\\u12"',
                b'"\xff"',
                b'"a\x01"',
                b' "spaced" ',
                b'{"text":"a"}',
            ]
        ),
    ),
    st.builds(lambda middle: _CONTENT_AT + middle + _CONTENT_END, st.binary(max_size=8)),
    # The same content with another layout: a new ``created``, a finish, extra fields.
    st.builds(
        lambda c: compact(c, head=_HEAD.replace(b"1700000000", b"1700000001")), st.text(max_size=3)
    ),
    st.builds(lambda c: compact(c, finish_reason="stop"), st.text(max_size=3)),
    # Bytes of the layout's length around the literal, other bytes: "st" is as long as null.
    st.builds(lambda c: compact(c, finish_reason="st"), st.text(max_size=3)),
    # A repeated key: the last one counts, so the bytes after the first literal are no layout.
    st.builds(
        lambda c: _CONTENT_AT + orjson.dumps(c) + b',"content":"dup"' + _CONTENT_END,
        st.text(max_size=3),
    ),
    st.builds(lambda c: compact(c, index=1), st.text(max_size=3)),
    st.builds(
        lambda c: compact(c)[:-1] + b',"usage":{"prompt_tokens":1,"completion_tokens":2}}',
        st.text(max_size=3),
    ),
    st.builds(lambda c: compact(c)[:-1] + b',"error":{"message":"boom"}}', st.text(max_size=3)),
    st.just(_ROLE),
    st.sampled_from([b"[DONE]", b"", b"not json"]),
)


@settings(max_examples=500, deadline=None)
@given(frames=st.lists(laid_out_frames, max_size=10), reads=st.integers(1, 3))
def test_the_learned_layout_decides_as_the_general_path(frames: list[bytes], reads: int) -> None:
    # Fed as a transport feeds them (in a few reads) against one event at a time; the opening
    # lets the parser learn the layout (its first plain content delta after the first token).
    opening = [_ROLE, compact("Hi"), compact(" there")]
    events: list[SSEEvent] = [(frame, None) for frame in [*opening, *frames]]
    cut = len(events) // reads or 1

    def in_reads(parser: ChatStreamParser) -> bool:
        token = False
        for at in range(0, len(events), cut):
            if parser.feed_events(events[at : at + cut]):
                token = True
            if parser.done:
                break
        return token

    assert _outcome(in_reads) == _outcome(one_event_at_a_time(events))


def test_a_compact_stream_is_read_by_its_layout() -> None:
    parser = ChatStreamParser()
    parser.feed_events([(_ROLE, None), (compact("Hel"), None), (compact("lo"), None)])
    assert parser._layout is not None  # learned on the first plain content delta
    frames = [compact(text) for text in ('"', "\\", "é☃", " wor", "ld")]
    assert parser.feed_events([(frame, None) for frame in frames]) is True
    # A frame of the layout whose literal is no string: the general path's error, unchanged.
    with pytest.raises(TransientError, match="malformed stream frame"):
        parser.feed_events([(_CONTENT_AT + b'"a","b' + _CONTENT_END, None)])
    assert parser.result().content == 'Hello"\\é☃ world'


def test_no_layout_is_learned_where_the_bytes_after_the_literal_change_its_meaning() -> None:
    duplicate = _CONTENT_AT + b'"%b","content":"last"' + _CONTENT_END
    parser = ChatStreamParser()
    parser.feed_events([(compact("a"), None), (duplicate % b"b", None), (duplicate % b"c", None)])
    assert parser._layout is None
    assert parser.result().content == "alastlast"


def test_a_stream_padded_per_frame_learns_no_layout() -> None:
    parser = ChatStreamParser()
    frames = [
        compact(text)[:-1] + b',"obfuscation":"%s"}' % pad
        for text, pad in (("a", b"x"), ("b", b"yy"), ("c", b"z"))
    ]
    parser.feed_events([(frame, None) for frame in frames])
    assert parser._layout is None and parser._learn_left == 0
    assert parser.result().content == "abc"


def test_a_layout_that_keeps_changing_is_given_up() -> None:
    parser = ChatStreamParser()
    parser.feed_events([(compact("a"), None), (compact("b"), None)])
    for tick in range(3):  # every frame another layout (a per-frame field, say)
        head = _HEAD.replace(b"1700000000", b"17000000%02d" % tick)
        parser.feed_events([(compact("c", head=head), None)])
    assert parser._layout is None and parser._learn_left == 0
    assert parser.feed_events([(compact("d"), None)]) is True
    assert parser.result().content == "abcccd"


def test_reasoning_field_order_prefers_reasoning_content() -> None:
    parser = ChatStreamParser()
    parser.feed_event(chunk({"reasoning_content": "A", "reasoning": "B"}))
    parser.feed_event(chunk({"content": "x"}))
    assert parser.result().thinking == "A"


def test_inline_think_tags_split_across_chunks() -> None:
    parser = ChatStreamParser()
    for piece in ["<th", "ink>ste", "p one</th", "ink>\n\nFinal"]:
        assert parser.feed_event(chunk({"content": piece})) is True
    result = parser.result()
    assert (result.content, result.thinking) == ("Final", "step one")


def test_usage_null_in_every_chunk_is_not_usage() -> None:
    parser = ChatStreamParser()
    parser.feed_event(chunk({"content": "x"}, usage=None))
    result = parser.result()
    assert result.prompt_tokens is None and result.completion_tokens is None


def test_tool_call_fragments_count_as_tokens() -> None:
    parser = ChatStreamParser()
    call = {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    assert parser.feed_event(chunk(call)) is True
    assert parser.result().has_tool_calls


@pytest.mark.parametrize(
    "frame",
    [
        b'{"error":{"message":"Upstream provider disconnected","type":"server_error"}}',
        b'{"object":"error","message":"boom","type":"BadRequestError","code":503}',
        b'{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"error"}]}',
    ],
)
def test_error_events_are_transient(frame: bytes) -> None:
    with pytest.raises(TransientError):
        ChatStreamParser(source_name="s").feed_event(frame)


def test_flat_error_event_with_a_client_error_status_is_rejected() -> None:
    # vLLM's integer code is the HTTP status: a 400 fails the same way on any source.
    frame = b'{"object":"error","message":"boom","type":"BadRequestError","code":400}'
    with pytest.raises(RequestRejectedError):
        ChatStreamParser(source_name="s").feed_event(frame)


def test_event_named_error_is_transient() -> None:
    with pytest.raises(TransientError):
        ChatStreamParser().feed_event(b'{"message":"overloaded"}', b"error")


@pytest.mark.parametrize("frame", [b'{"content":"unterminated', b"[1, 2]", b"not json"])
def test_malformed_frames_are_transient(frame: bytes) -> None:
    with pytest.raises(TransientError, match="malformed"):
        ChatStreamParser().feed_event(frame)


def test_empty_data_is_a_keep_alive() -> None:
    parser = ChatStreamParser()
    assert parser.feed_event(b"") is False
    assert not parser.has_content


def test_other_choice_indexes_are_ignored() -> None:
    parser = ChatStreamParser()
    other = {"choices": [{"index": 1, "delta": {"content": "no"}}]}
    assert parser.feed_event(json.dumps(other).encode()) is False
    assert parser.result().content == ""


# --------------------------------------------------------------------------- JSON completion


def test_parse_completion() -> None:
    body = {
        "model": "served",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "<think>hm</think> 42"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }
    parsed = parse_completion(body)
    assert (parsed.content, parsed.thinking) == ("42", "hm")
    assert (parsed.prompt_tokens, parsed.completion_tokens) == (9, 3)
    assert parsed.finish_reason == "stop" and parsed.model == "served"


def test_parse_completion_reasoning_field_and_tool_calls() -> None:
    message = {"content": None, "reasoning_content": "why", "tool_calls": [{"id": "t"}]}
    parsed = parse_completion({"choices": [{"message": message, "finish_reason": "tool_calls"}]})
    assert (parsed.content, parsed.thinking) == ("", "why")
    assert parsed.has_tool_calls
    assert parsed.prompt_tokens is None


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"choices": []},
        {"choices": [{"index": 0}]},
        {"error": {"message": "overloaded", "code": "server_error"}},
    ],
)
def test_parse_completion_rejects_unusable_bodies(body: Any) -> None:
    with pytest.raises(TransientError):
        parse_completion(body)


def test_parse_completion_error_body_with_a_quota_code_is_a_dead_source() -> None:
    # Exhausted quota whatever the status, also on a 200 whose body is the error.
    with pytest.raises(SourceDeadError):
        parse_completion({"error": {"message": "quota", "code": "insufficient_quota"}})


def test_named_error_event_with_plain_text_is_transient() -> None:
    with pytest.raises(TransientError, match="Overloaded"):
        ChatStreamParser().feed_event(b"Overloaded", b"error")


def test_json_after_extra_whitespace_still_parses() -> None:
    parser = ChatStreamParser()
    assert parser.feed_event(b' {"choices":[{"index":0,"delta":{"content":"x"}}]}') is True
    assert parser.has_content
