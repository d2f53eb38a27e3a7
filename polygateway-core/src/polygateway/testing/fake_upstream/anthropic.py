"""The Anthropic Messages protocol's answers (``POST /v1/messages``), byte for byte like the API.

Streams are ``event: <name>\\ndata: <json>\\n\\n`` with ``data.type`` equal to the event name:
``message_start`` (usage so far), ``ping``, then per content block ``content_block_start``,
``content_block_delta``* and ``content_block_stop``, then ``message_delta`` (``stop_reason``,
cumulative ``output_tokens``) and ``message_stop``. A :class:`Reply` renders as follows:

- ``reasoning`` -> a ``thinking`` block (``thinking_delta`` pieces, then a ``signature_delta``)
  before the text block, whatever ``think_inline`` says (Claude never inlines tags);
- ``finish_reason`` -> ``stop_reason`` (``stop`` -> ``end_turn``, ``length`` -> ``max_tokens``,
  ``tool_calls`` -> ``tool_use``, ``content_filter`` -> ``refusal``; anything else verbatim, e.g.
  ``model_context_window_exceeded``, ``pause_turn``);
- a request whose ``tool_choice`` forces a tool (``{"type": "tool"}`` or ``{"type": "any"}``) is
  answered with a ``tool_use`` block (``input_json_delta`` pieces; the input is the reply content
  when it is a JSON object, else ``{"text": content}``);
- a request with a ``document`` block whose ``citations`` are enabled gets a ``citations_delta``
  after the first text delta;
- prompt caching: ``Reply.ok(cached_tokens=N)`` reports ``N`` cache-read tokens; otherwise
  blocks marked ``cache_control`` count as written to the cache the first time this server
  sees their prefix and as read from it afterwards (``input_tokens`` excludes both);
- errors: ``{"type":"error","error":{"type","message"},"request_id"}`` with the API's type per
  status (``Reply.error(..., type=...)`` overrides it, ``quota=True`` is ``billing_error``),
  ``request-id`` and, on 529/5xx, ``x-should-retry: true``; a ``mid_stream_error`` is an
  ``event: error`` (``overloaded_error`` unless the reply names a type) on HTTP 200.

Requests the real API refuses are refused the same way (HTTP 400 ``invalid_request_error``):
no ``max_tokens``, no ``messages``, a role other than ``user``/``assistant`` in ``messages``,
OpenAI-only fields (``stream_options``, ``response_format``, ``max_completion_tokens``), a
thinking budget not below ``max_tokens``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from typing import Any, Final

from polygateway.ports import Clock
from polygateway.testing.fake_upstream.replies import estimate_tokens, piece_count, split
from polygateway.testing.fake_upstream.wire import (
    CHUNKED_END,
    CONNECTION_CLOSE,
    Ask,
    Step,
    dumps,
    frame,
    json_head,
    json_plan,
)

ROUTES: Final[dict[tuple[str, str], str]] = {("POST", "/messages"): "messages"}
"""(method, path after ``/v1``) -> route name."""

STOP_REASONS: Final[dict[str, str]] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}

_ERROR_DEFAULTS: Final[dict[int, tuple[str, str]]] = {
    400: ("invalid_request_error", "Invalid request (scripted by the fake upstream)."),
    401: ("authentication_error", "invalid x-api-key"),
    403: (
        "permission_error",
        "Your API key does not have permission to use the specified resource.",
    ),
    404: ("not_found_error", "model: {model}"),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: (
        "rate_limit_error",
        "This request would exceed the rate limit for your organization of 50 requests per "
        "minute. For details, refer to: https://docs.claude.com/en/api/rate-limits.",
    ),
    500: ("api_error", "Internal server error"),
    504: ("timeout_error", "Request timed out"),
    529: ("overloaded_error", "Overloaded"),
}
_BILLING_MESSAGE: Final = (
    "Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing "
    "to upgrade or purchase credits."
)
_OPENAI_ONLY_FIELDS: Final = ("stream_options", "response_format", "max_completion_tokens")


def _event(name: str, payload: dict[str, Any]) -> bytes:
    """One SSE event as one HTTP chunk."""
    return frame(f"event: {name}\ndata: {dumps(payload)}\n\n".encode())


def _block_texts(content: Any) -> Iterator[tuple[str, bool]]:
    """``(text, marks a cache breakpoint)`` of each block of a ``system`` or message content."""
    if isinstance(content, str):
        yield content, False
        return
    if not isinstance(content, list):
        return
    for block in content:
        if not isinstance(block, dict):
            continue
        text = block.get("text")
        if not isinstance(text, str):
            source = block.get("source")
            text = dumps(source) if source is not None else ""
        yield text, "cache_control" in block


def _prompt_parts(body: dict[str, Any]) -> tuple[str, str]:
    """``(whole prompt text, the prefix up to the last cache breakpoint)``."""
    parts: list[str] = []
    cached_upto = 0
    contents: list[Any] = [body.get("system")]
    messages = body.get("messages")
    if isinstance(messages, list):
        contents += [m.get("content") for m in messages if isinstance(m, dict)]
    for content in contents:
        for text, breakpoint_ in _block_texts(content):
            parts.append(text)
            if breakpoint_:
                cached_upto = len(parts)
    return "".join(parts), "".join(parts[:cached_upto])


def _wants_citations(body: dict[str, Any]) -> bool:
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if (
                isinstance(block, dict)
                and block.get("type") == "document"
                and isinstance(block.get("citations"), dict)
                and block["citations"].get("enabled")
            ):
                return True
    return False


def _forced_tool(body: dict[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if not isinstance(choice, dict) or not isinstance(tools, list) or not tools:
        return None
    if choice.get("type") == "tool" and isinstance(choice.get("name"), str):
        return str(choice["name"])
    if choice.get("type") == "any" and isinstance(tools[0], dict):
        return str(tools[0].get("name"))
    return None


class AnthropicAnswers:
    """Plans of the Messages route. Remembers the cached prompt prefixes it has seen."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cached_prefixes: set[str] = set()

    def reset(self) -> None:
        self._cached_prefixes.clear()

    def plan(self, ask: Ask) -> list[Step]:
        reply = ask.reply
        if reply.kind == "error":
            return self._scripted_error_plan(ask)
        problem = self._refusal(ask.body)
        if problem is not None:
            return self.error(400, "invalid_request_error", problem, ask)
        if ask.body.get("stream"):
            return self._stream_plan(ask)
        return self._json_plan(ask)

    # -- errors ----------------------------------------------------------------------------

    def error(
        self, status: int, type_: str, message: str, ask: Ask, extra_headers: str = ""
    ) -> list[Step]:
        payload = {
            "type": "error",
            "error": {"type": type_, "message": message},
            "request_id": f"req_fake{ask.serial}",
        }
        data = dumps(payload).encode()
        extra = f"request-id: req_fake{ask.serial}\r\n{extra_headers}"
        if status == 529 or status >= 500:
            extra += "x-should-retry: true\r\n"
        return [json_head(len(data), ask.close, status, extra) + data]

    def _scripted_error_plan(self, ask: Ask) -> list[Step]:
        reply = ask.reply
        status = reply.status
        default_type, default_message = _ERROR_DEFAULTS.get(
            status, ("api_error" if status >= 500 else "invalid_request_error", "Error.")
        )
        if reply.quota:
            default_type, default_message = "billing_error", _BILLING_MESSAGE
        extra = ""
        if reply.retry_after is not None:
            value = reply.retry_after
            extra = f"retry-after: {value if isinstance(value, str) else f'{value:g}'}\r\n"
        if reply.body is not None:
            data = reply.body.encode() if isinstance(reply.body, str) else reply.body
            steps: list[Step] = [json_head(len(data), ask.close, status, extra) + data]
        else:
            steps = self.error(
                status,
                reply.error_type or default_type,
                reply.error_message or default_message.format(model=ask.model),
                ask,
                extra,
            )
        if reply.headers_delay:
            steps.insert(0, reply.headers_delay)
        return steps

    def _refusal(self, body: dict[str, Any]) -> str | None:
        """What the real API would answer 400 to, or ``None``."""
        for name in _OPENAI_ONLY_FIELDS:
            if name in body:
                return f"{name}: Extra inputs are not permitted"
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            return "max_tokens: Field required"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages: at least one message is required"
        for index, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant"):
                return (
                    f"messages.{index}.role: Input should be 'user' or 'assistant' "
                    f"(got {role!r}; a system prompt goes in the top-level system field)"
                )
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if not isinstance(budget, int) or budget < 1024:
                return (
                    "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
                )
            if budget >= max_tokens:
                return "`max_tokens` must be greater than `thinking.budget_tokens`"
        return None

    # -- answers ---------------------------------------------------------------------------

    def _text(self, ask: Ask) -> str:
        content = ask.reply.content
        text = content(ask.body) if callable(content) else content
        if not isinstance(text, str):
            raise TypeError(f"Reply content callable must return str, got {type(text).__name__}")
        return text

    def _usage(self, ask: Ask, text: str, reasoning: str | None) -> dict[str, Any]:
        reply = ask.reply
        prompt_text, prefix = _prompt_parts(ask.body)
        prompt = (
            reply.prompt_tokens if reply.prompt_tokens is not None else estimate_tokens(prompt_text)
        )
        read = written = 0
        if reply.cached_tokens is not None:
            read = reply.cached_tokens
        elif prefix:
            cached = min(prompt, estimate_tokens(prefix))
            if prefix in self._cached_prefixes:
                read = cached
            else:
                self._cached_prefixes.add(prefix)
                written = cached
        output = reply.completion_tokens
        if output is None:
            output = estimate_tokens(text) + (estimate_tokens(reasoning) if reasoning else 0)
        return {
            # input_tokens excludes what was read from or written to the cache.
            "input_tokens": max(0, prompt - read - written),
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "output_tokens": output,
        }

    def _tool_input(self, text: str) -> str:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        return dumps(value if isinstance(value, dict) else {"text": text})

    def _stop_reason(self, ask: Ask, tool: str | None) -> str:
        if tool is not None:
            return "tool_use"
        reason = ask.reply.finish_reason
        return STOP_REASONS.get(reason, reason)

    def _json_plan(self, ask: Ask) -> list[Step]:
        reply = ask.reply
        text = self._text(ask)
        reasoning = reply.reasoning
        tool = _forced_tool(ask.body)
        content: list[dict[str, Any]] = []
        if reasoning is not None:
            content.append(
                {"type": "thinking", "thinking": reasoning, "signature": _signature(reasoning)}
            )
        if tool is not None:
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_fake{ask.serial}",
                    "name": tool,
                    "input": json.loads(self._tool_input(text)),
                }
            )
        elif text or reply.kind != "empty":
            content.append({"type": "text", "text": text})
        answer = {
            "id": f"msg_fake{ask.serial}",
            "type": "message",
            "role": "assistant",
            "model": ask.model,
            "content": content,
            "stop_reason": self._stop_reason(ask, tool),
            "stop_sequence": None,
            "usage": self._usage(ask, text, reasoning),
        }
        error = dumps(
            {
                "type": "error",
                "error": {
                    "type": reply.error_type or "overloaded_error",
                    "message": reply.error_message or "Overloaded",
                },
            }
        ).encode()
        pieces = piece_count(text, reply.chunks) + piece_count(reasoning or "", None)
        return json_plan(reply, dumps(answer).encode(), error, ask.close, pieces)

    def _stream_plan(self, ask: Ask) -> list[Step]:
        reply = ask.reply
        text = self._text(ask)
        reasoning = reply.reasoning
        tool = _forced_tool(ask.body)
        usage = self._usage(ask, text, reasoning)
        kind = reply.kind
        steps: list[Step] = []
        if reply.headers_delay:
            steps.append(reply.headers_delay)
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n"
            b"request-id: req_fake%d\r\n%b\r\n"
            % (ask.serial, CONNECTION_CLOSE if ask.close else b"")
        )
        if kind == "early_eof":
            steps.append(head + CHUNKED_END)
            return steps
        start_usage = {**usage, "output_tokens": 1}
        pending = bytearray(head)
        pending += _event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": f"msg_fake{ask.serial}",
                    "type": "message",
                    "role": "assistant",
                    "model": ask.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": start_usage,
                },
            },
        )
        pending += _event("ping", {"type": "ping"})
        # The blocks as (start event, deltas, closing deltas that are not tokens).
        index = 0
        deltas: list[bytes] = []  # token-carrying delta events, in order, each a frame
        framing: list[tuple[int, bytes]] = []  # (insert before delta number, frame)
        if reasoning is not None:
            framing.append(
                (
                    len(deltas),
                    _event(
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": index,
                            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                        },
                    ),
                )
            )
            for piece in split(reasoning, None):
                deltas.append(
                    _event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "thinking_delta", "thinking": piece},
                        },
                    )
                )
            framing.append(
                (
                    len(deltas),
                    _event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {
                                "type": "signature_delta",
                                "signature": _signature(reasoning),
                            },
                        },
                    )
                    + _event("content_block_stop", {"type": "content_block_stop", "index": index}),
                )
            )
            index += 1
        if tool is not None:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": f"toolu_fake{ask.serial}",
                "name": tool,
                "input": {},
            }
            pieces = split(self._tool_input(text), reply.chunks)
            delta_type, field = "input_json_delta", "partial_json"
        else:
            block = {"type": "text", "text": ""}
            pieces = split(text, reply.chunks)
            delta_type, field = "text_delta", "text"
        framing.append(
            (
                len(deltas),
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": block},
                ),
            )
        )
        citations = tool is None and _wants_citations(ask.body)
        for number, piece in enumerate(pieces):
            deltas.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": delta_type, field: piece},
                    },
                )
            )
            if number == 0 and citations:
                framing.append((len(deltas), _citation(index, piece)))
        framing.append(
            (
                len(deltas),
                _event("content_block_stop", {"type": "content_block_stop", "index": index}),
            )
        )
        faulty = kind in ("cut", "malformed", "mid_stream_error")
        sent = reply.after_chunks if faulty else len(deltas)
        framing_by_position: dict[int, list[bytes]] = {}
        for position, data in framing:
            framing_by_position.setdefault(position, []).append(data)
        for number in range(sent):
            pending += b"".join(framing_by_position.get(number, ()))
            delay = reply.first_token_delay if number == 0 else reply.inter_token_delay
            if delay:
                steps += [bytes(pending), delay]
                pending.clear()
            pending += deltas[number]
        if kind == "cut":
            steps.append(bytes(pending + CHUNKED_END))
            return steps
        if kind == "mid_stream_error":
            pending += _event(
                "error",
                {
                    "type": "error",
                    "error": {
                        "type": reply.error_type or "overloaded_error",
                        "message": reply.error_message or "Overloaded",
                    },
                },
            )
            steps.append(bytes(pending + CHUNKED_END))
            return steps
        if kind == "malformed":
            pending += frame(
                b"event: content_block_delta\n"
                b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
                b'"text":"unterminated\n\n'
            )
            for number in range(sent, len(deltas)):
                pending += b"".join(framing_by_position.get(number, ()))
                pending += deltas[number]
        pending += b"".join(framing_by_position.get(len(deltas), ()))
        pending += _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": self._stop_reason(ask, tool), "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        )
        pending += _event("message_stop", {"type": "message_stop"})
        steps.append(bytes(pending + CHUNKED_END))
        return steps


def _signature(reasoning: str) -> str:
    return base64.b64encode(hashlib.sha256(reasoning.encode()).digest()).decode("ascii")


def _citation(index: int, cited: str) -> bytes:
    return _event(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": index,
            "delta": {
                "type": "citations_delta",
                "citation": {
                    "type": "char_location",
                    "cited_text": cited,
                    "document_index": 0,
                    "document_title": None,
                    "start_char_index": 0,
                    "end_char_index": len(cited),
                },
            },
        },
    )


__all__ = ["ROUTES", "STOP_REASONS", "AnthropicAnswers"]
