"""Anthropic Messages answers (a JSON body, or the events of a stream) -> one parsed message.

Streaming events (protocols.md §4 and corrections): ``message_start`` (model, initial usage),
``content_block_start`` / ``content_block_delta`` / ``content_block_stop`` with ``text_delta``,
``thinking_delta``, ``signature_delta``, ``input_json_delta``, ``citations_delta``,
``message_delta`` (``stop_reason``, cumulative usage), ``message_stop`` (the stream is
complete), ``ping`` (keep-alive), ``error`` (classified by its type). Unknown event and delta
types are ignored: Anthropic documents that new ones may appear.

Usage: ``input_tokens`` excludes cache reads and writes; the prompt total is
``input + cache_creation + cache_read`` and the two cache counts are kept apart so that each is
priced at its own rate. ``message_delta`` usage is cumulative: its values replace earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from polygateway.errors import TransientError
from polygateway.transports.errors import Secrets, sanitize_message
from polygateway.transports.openai_chunks import json_loads
from polygateway.transports.sse import SSEEvent

from pgw_anthropic.errors import error_for_event

FINISH_REASONS: Mapping[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
"""Anthropic ``stop_reason`` -> the OpenAI ``finish_reason`` every transport reports (others,
``pause_turn`` and ``model_context_window_exceeded``, keep their own name)."""


class ParsedMessage(NamedTuple):
    content: str
    thinking: str
    stop_reason: str | None
    input_tokens: int | None
    """``None`` when no usage arrived."""
    output_tokens: int | None
    cache_read_tokens: int
    cache_write_tokens: int
    model: str
    has_tool_calls: bool


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(0, value)


class MessageParser:
    """Accumulates one message from its stream events (or from a whole JSON body)."""

    __slots__ = (
        "_content",
        "_thinking",
        "cache_read",
        "cache_write",
        "done",
        "has_tool_calls",
        "input_tokens",
        "model",
        "output_tokens",
        "secret",
        "source_name",
        "stop_reason",
    )

    def __init__(self, *, source_name: str | None = None, secret: Secrets = None) -> None:
        self._content: list[str] = []
        self._thinking: list[str] = []
        self.source_name = source_name
        self.secret = secret
        self.model = ""
        self.stop_reason: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cache_read = 0
        self.cache_write = 0
        self.has_tool_calls = False
        self.done = False

    @property
    def has_content(self) -> bool:
        return bool(self._content or self._thinking or self.has_tool_calls)

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, Mapping):
            return
        value = _count(usage.get("input_tokens"))
        if value is not None:
            self.input_tokens = value
        value = _count(usage.get("output_tokens"))
        if value is not None:
            self.output_tokens = value
        value = _count(usage.get("cache_read_input_tokens"))
        if value is not None:
            self.cache_read = value
        value = _count(usage.get("cache_creation_input_tokens"))
        if value is not None:
            self.cache_write = value

    def _block(self, block: Any) -> bool:
        """A content block of a JSON answer or a ``content_block_start``; True for a token."""
        if not isinstance(block, Mapping):
            return False
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                self._content.append(text)
                return True
        elif kind == "thinking":
            text = block.get("thinking")
            if isinstance(text, str) and text:
                self._thinking.append(text)
                return True
        elif kind in ("tool_use", "server_tool_use"):
            self.has_tool_calls = True
            return True
        return False

    def feed_events(self, events: Iterable[SSEEvent]) -> bool:
        """Feed decoded SSE events; True when any carried a token (text, thinking or a tool
        call fragment). Raises the classified error of an ``error`` event."""
        token = False
        for data, _event in events:
            if self.done:
                break
            if self._event(data):
                token = True
        return token

    def _event(self, data: bytes) -> bool:
        try:
            event = json_loads(data)
        except ValueError:
            raise TransientError(
                f"{self._where}malformed stream event (not JSON): "
                f"{sanitize_message(repr(data[:80]), self.secret)}",
                source_name=self.source_name,
            ) from None
        if not isinstance(event, dict):
            raise TransientError(
                f"{self._where}malformed stream event (not a JSON object)",
                source_name=self.source_name,
            )
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta")
            if not isinstance(delta, Mapping):
                return False
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                text = delta.get("text")
                if isinstance(text, str) and text:
                    self._content.append(text)
                    return True
            elif delta_type == "thinking_delta":
                text = delta.get("thinking")
                if isinstance(text, str) and text:
                    self._thinking.append(text)
                    return True
            elif delta_type == "input_json_delta":
                self.has_tool_calls = True
                return True
            # signature_delta, citations_delta: metadata of a block, not tokens.
            return False
        if kind == "content_block_start":
            return self._block(event.get("content_block"))
        if kind == "message_start":
            message = event.get("message")
            if isinstance(message, Mapping):
                model = message.get("model")
                if isinstance(model, str):
                    self.model = model
                self._usage(message.get("usage"))
            return False
        if kind == "message_delta":
            delta = event.get("delta")
            if isinstance(delta, Mapping) and isinstance(delta.get("stop_reason"), str):
                self.stop_reason = delta["stop_reason"]
            self._usage(event.get("usage"))
            return False
        if kind == "message_stop":
            self.done = True
            return False
        if kind == "error":
            raise error_for_event(event, source_name=self.source_name, secret=self.secret)
        return False  # ping, content_block_stop, and event types added after this was written

    def feed_message(self, body: Any) -> None:
        """A whole non-streaming answer (``{"type": "message", ...}``)."""
        if not isinstance(body, Mapping):
            raise TransientError(
                f"{self._where}malformed message body (not a JSON object)",
                source_name=self.source_name,
            )
        if body.get("type") == "error":
            raise error_for_event(body, source_name=self.source_name, secret=self.secret)
        content = body.get("content")
        if body.get("type") != "message" or not isinstance(content, list):
            raise TransientError(
                f"{self._where}malformed message body (no content blocks)",
                source_name=self.source_name,
            )
        for block in content:
            self._block(block)
        model = body.get("model")
        if isinstance(model, str):
            self.model = model
        stop = body.get("stop_reason")
        self.stop_reason = stop if isinstance(stop, str) else None
        self._usage(body.get("usage"))
        self.done = True

    @property
    def _where(self) -> str:
        return f"source {self.source_name!r}: " if self.source_name else ""

    def result(self) -> ParsedMessage:
        return ParsedMessage(
            content="".join(self._content),
            thinking="".join(self._thinking),
            stop_reason=self.stop_reason,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cache_read_tokens=self.cache_read,
            cache_write_tokens=self.cache_write,
            model=self.model,
            has_tool_calls=self.has_tool_calls,
        )


__all__ = ["FINISH_REASONS", "MessageParser", "ParsedMessage"]
