"""The Messages stream/body parser and the error table, on the protocol's exact bytes."""

from __future__ import annotations

import pytest
from pgw_anthropic.errors import error_for_event, error_for_response
from pgw_anthropic.parse import MessageParser
from polygateway.errors import (
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    TransientError,
)
from polygateway.transports.sse import SSEDecoder

# Every event and delta type of the Messages stream, as the API frames them.
STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant",'
    b'"model":"claude-x","content":[],"stop_reason":null,"stop_sequence":null,"usage":{'
    b'"input_tokens":12,"cache_creation_input_tokens":100,"cache_read_input_tokens":900,'
    b'"output_tokens":1}}}\n\n'
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
    b'"thinking":"","signature":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    b'"thinking":"2 plus 2"}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta",'
    b'"signature":"EqQBCgIYAhIM"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta",'
    b'"text":"It is "}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"citations_delta","citation":'
    b'{"type":"char_location","cited_text":"4","document_index":0,"document_title":null,'
    b'"start_char_index":0,"end_char_index":1}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"4."}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":1}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":2,"content_block":{"type":"tool_use",'
    b'"id":"toolu_1","name":"calc","input":{}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta",'
    b'"partial_json":"{\\"x\\": 4}"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":2}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
    b'"usage":{"output_tokens":42}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)


@pytest.mark.parametrize("piece", [len(STREAM), 7, 1])
def test_every_event_type_of_the_stream(piece: int) -> None:
    parser = MessageParser(source_name="claude")
    decoder = SSEDecoder()
    tokens = 0
    for start in range(0, len(STREAM), piece):
        tokens += parser.feed_events(decoder.feed(STREAM[start : start + piece]))
    message = parser.result()
    assert parser.done
    assert tokens > 0
    assert (message.content, message.thinking) == ("It is 4.", "2 plus 2")
    assert message.has_tool_calls
    assert message.stop_reason == "tool_use"
    assert message.model == "claude-x"
    # input_tokens excludes the cache: the parts stay apart for pricing.
    assert (message.input_tokens, message.cache_read_tokens, message.cache_write_tokens) == (
        12,
        900,
        100,
    )
    assert message.output_tokens == 42  # message_delta's cumulative count replaces the start's


def test_mid_stream_error_event_on_http_200_is_classified_by_its_type() -> None:
    parser = MessageParser(source_name="claude")
    events = SSEDecoder().feed(
        STREAM[: STREAM.index(b"event: content_block_start")] + b"event: error\n"
        b'data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )
    with pytest.raises(TransientError, match="overloaded_error: Overloaded") as caught:
        parser.feed_events(events)
    assert caught.value.status is None
    bad = SSEDecoder().feed(
        b'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error",'
        b'"message":"prompt is too long"}}\n\n'
    )
    with pytest.raises(RequestRejectedError):
        MessageParser().feed_events(bad)


def test_non_streaming_body() -> None:
    parser = MessageParser()
    parser.feed_message(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Answer."},
            ],
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 7, "cache_read_input_tokens": 3},
        }
    )
    message = parser.result()
    assert (message.content, message.thinking, message.stop_reason) == (
        "Answer.",
        "hmm",
        "max_tokens",
    )
    assert (message.input_tokens, message.output_tokens, message.cache_read_tokens) == (5, 7, 3)


def _body(kind: str) -> bytes:
    return (
        b'{"type":"error","error":{"type":"%s","message":"scripted"},"request_id":"req_1"}'
        % kind.encode()
    )


@pytest.mark.parametrize(
    ("status", "kind", "expected"),
    [
        (529, "overloaded_error", TransientError),
        (500, "api_error", TransientError),
        (504, "timeout_error", TransientError),
        (429, "rate_limit_error", TransientError),
        (401, "authentication_error", SourceDeadError),
        (403, "permission_error", SourceDeadError),
        (400, "billing_error", SourceDeadError),
        (404, "not_found_error", SourceDeadError),
        (400, "invalid_request_error", RequestRejectedError),
        (413, "request_too_large", RequestRejectedError),
        # By type, never by status alone: a 500 that says invalid_request_error is the request.
        (500, "invalid_request_error", RequestRejectedError),
        (429, "overloaded_error", TransientError),
    ],
)
def test_errors_by_type(status: int, kind: str, expected: type[PolyGatewayError]) -> None:
    error = error_for_response(status, _body(kind), {"retry-after": "3"}, source_name="claude")
    assert type(error) is expected
    assert getattr(error, "status", None) == status
    assert kind in str(error)
    if expected is TransientError:
        assert isinstance(error, TransientError)
        assert error.retry_after_s == 3.0
        assert error.reason == {"rate_limit_error": "rate_limited", "timeout_error": "timeout"}.get(
            kind, "network_error"
        )


def test_a_body_without_an_error_type_falls_back_to_the_status() -> None:
    assert (
        type(error_for_response(413, b"<html>Request Entity Too Large</html>"))
        is RequestRejectedError
    )
    assert type(error_for_response(502, b"Bad gateway")) is TransientError
    assert (
        type(error_for_event({"type": "error", "error": {"type": "new_kind", "message": "?"}}))
        is TransientError
    )


def test_the_key_never_shows_in_an_error() -> None:
    key = "sk-ant-api03-0123456789abcdefghijklmnop"
    body = (
        b'{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key %s"}}'
        % key.encode()
    )
    error = error_for_response(401, body, source_name="claude", secret=key)
    assert key not in str(error)
