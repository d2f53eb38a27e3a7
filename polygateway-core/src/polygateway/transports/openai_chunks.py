"""OpenAI chat completions as pure, I/O-free parsers.

``ChatStreamParser`` interprets the SSE events of a chat completion stream: content and
reasoning deltas (``reasoning_content`` -> ``reasoning`` -> ``reasoning_details`` -> inline
``<think>`` tags, protocols §2), content given as a list of parts (Mistral: ``text`` parts are the
answer, ``thinking`` parts the reasoning), the usage chunk (``choices`` empty, null or missing;
Groq's ``x_groq.usage`` when there is no ``usage``), ``finish_reason``, ``[DONE]``; malformed
frames raise ``TransientError``, error events the class ``error_for_stream_event`` gives them
(``TransientError`` unless a deterministic client error). ``parse_completion`` does the same for
a non-streaming body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from polygateway.errors import TransientError
from polygateway.ports import DeltaSink, ErrorRule
from polygateway.transports.errors import error_for_stream_event, sanitize_message
from polygateway.transports.sse import SSEEvent
from polygateway.transports.think_tags import BODY, ThinkTagSplitter, opens_think_block, split_think
from polygateway.types import ChatRequest, StreamDelta, ToolCall

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional speed-up
    _orjson = None  # type: ignore[assignment]

json_loads: Callable[[bytes | str], Any] = _orjson.loads if _orjson is not None else json.loads
"""Parses one JSON document; ``orjson`` when installed (about 6x faster per chunk)."""


class ParsedCompletion(NamedTuple):
    """What a stream or a JSON body said, before the transport applies its rules.

    Immutable like the public types, but a named tuple: one is built per attempt and a
    tuple costs a fraction of a frozen dataclass (whose fields are set one by one).
    """

    content: str
    thinking: str
    finish_reason: str | None
    prompt_tokens: int | None
    """``None`` when the upstream reported no usage."""
    completion_tokens: int | None
    model: str
    has_tool_calls: bool = False
    cached_tokens: int = 0
    """Prompt tokens read from the provider's prompt cache (part of ``prompt_tokens``)."""
    cache_write_tokens: int = 0
    """Prompt tokens written to the provider's prompt cache (part of ``prompt_tokens``)."""
    tool_calls: tuple[ToolCall, ...] = ()


def _text(value: Any) -> str:
    return value if type(value) is str else ""


class ToolCallAssembler:
    """Tool calls from streamed fragments: each fragment names its call by ``index``; the
    first carries ``id`` and ``function.name``, later ones pieces of ``function.arguments``."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[int, list[Any]] = {}

    def feed(self, fragments: Any) -> None:
        if type(fragments) is not list:
            return
        for position, fragment in enumerate(fragments):
            if type(fragment) is not dict:
                continue
            index = fragment.get("index", position)
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = ["", "", []]
            if fragment.get("id"):
                call[0] = _text(fragment["id"])
            function = fragment.get("function")
            if type(function) is dict:
                if function.get("name"):
                    call[1] = _text(function["name"])
                arguments = function.get("arguments")
                if arguments and type(arguments) is str:
                    call[2].append(arguments)

    @property
    def calls(self) -> Mapping[int, list[Any]]:
        """``index -> [id, name, argument pieces]`` so far (read, never modify)."""
        return self._calls

    def result(self) -> tuple[ToolCall, ...]:
        return tuple(
            ToolCall(id_, name, "".join(parts))
            for _, (id_, name, parts) in sorted(self._calls.items(), key=lambda kv: kv[0])
        )


class DeltaTap:
    """Hands what a parser added since the last ``flush`` to a ``DeltaSink`` as
    ``StreamDelta``s (thinking, content, tool-call fragments), for ``GatewayClient.stream``.
    Reads the parser's growing lists; costs nothing on calls that do not stream."""

    __slots__ = ("_call_id", "_calls", "_content", "_seen", "_seen_calls", "_sink", "_thinking")

    def __init__(
        self,
        sink: DeltaSink,
        call_id: str,
        *,
        content: list[str],
        thinking: list[str],
        calls: Mapping[int, list[Any]],
    ) -> None:
        self._sink = sink
        self._call_id = call_id
        self._content = content
        self._thinking = thinking
        self._calls = calls
        self._seen = [0, 0]
        self._seen_calls: dict[int, int] = {}

    @classmethod
    def for_request(
        cls,
        request: ChatRequest,
        call_id: str,
        *,
        content: list[str],
        thinking: list[str],
        calls: Mapping[int, list[Any]],
    ) -> DeltaTap | None:
        """The tap of attempt ``call_id`` when its caller streams (``GatewayClient.stream``
        set ``request.context.stream``), else ``None``: nothing to hand on."""
        context = request.context
        sink = context.stream if context is not None else None
        if sink is None:
            return None
        return cls(sink, call_id, content=content, thinking=thinking, calls=calls)

    def flush(self) -> None:
        emit = self._sink.on_delta
        seen = self._seen
        for slot, parts, kind in ((0, self._thinking, "thinking"), (1, self._content, "content")):
            if len(parts) > seen[slot]:
                text = "".join(parts[seen[slot] :])
                seen[slot] = len(parts)
                if text:
                    emit(self._call_id, StreamDelta(kind, text))  # type: ignore[arg-type]
        for index, (id_, name, pieces) in self._calls.items():
            done = self._seen_calls.get(index)
            if done is None:
                self._seen_calls[index] = len(pieces)
                emit(self._call_id, StreamDelta("tool_call", "".join(pieces), index, id_, name))
            elif len(pieces) > done:
                self._seen_calls[index] = len(pieces)
                emit(self._call_id, StreamDelta("tool_call", "".join(pieces[done:]), index))


def tool_calls_of(message: Mapping[str, Any]) -> tuple[ToolCall, ...]:
    """The ``tool_calls`` of a non-streamed ``message`` (``()`` when none)."""
    calls = message.get("tool_calls")
    if not calls or type(calls) is not list:
        return ()
    out = []
    for call in calls:
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict:
            continue
        arguments = function.get("arguments")
        if type(arguments) is not str:  # some servers send an object
            arguments = "" if arguments is None else json.dumps(arguments)
        out.append(ToolCall(_text(call.get("id")), _text(function.get("name")), arguments))
    return tuple(out)


def _as_tokens(value: Any) -> int:
    if type(value) is int:
        return value if value > 0 else 0
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, float) and value == value:  # not NaN
        return max(0, int(value))
    return 0


def _usage(usage: Any) -> tuple[int, int] | None:
    if type(usage) is not dict and not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int and prompt >= 0 and completion >= 0:
        return prompt, completion  # the usual report
    if prompt is None and completion is None:
        return None
    return _as_tokens(prompt), _as_tokens(completion)


def _chunk_usage(chunk: Mapping[str, Any]) -> Any:
    """A chunk's (or body's) ``usage``, else Groq's ``x_groq.usage``."""
    usage = chunk.get("usage")
    if usage:
        return usage
    extra = chunk.get("x_groq")
    return extra.get("usage") if type(extra) is dict else None


def _part_text(value: Any) -> str:
    """The text of a part's payload: a string, or a list of ``{"type":"text","text":...}``."""
    if type(value) is str:
        return value
    if type(value) is not list:
        return ""
    return "".join(
        item["text"] for item in value if type(item) is dict and type(item.get("text")) is str
    )


def content_parts(parts: list[Any]) -> tuple[str, str, bool]:
    """``(text, thinking, any_part)`` of content given as a list of parts (Mistral): ``text``
    parts are the answer, ``thinking`` parts (their ``thinking`` is text or a list of text
    parts) the reasoning; ``any_part`` is true when some part was one of the two."""
    text: list[str] = []
    thinking: list[str] = []
    seen = False
    for part in parts:
        if type(part) is not dict:
            continue
        kind = part.get("type")
        if kind == "text":
            seen = True
            value = part.get("text")
            if type(value) is str:
                text.append(value)
        elif kind == "thinking":
            seen = True
            thinking.append(_part_text(part.get("thinking")))
    return "".join(text), "".join(thinking), seen


def reasoning_details_text(details: list[Any]) -> str:
    """The readable reasoning of a ``reasoning_details`` array (OpenRouter):
    ``reasoning.text`` items' ``text`` and ``reasoning.summary`` items' ``summary``
    (encrypted items carry nothing readable)."""
    pieces: list[str] = []
    for item in details:
        if type(item) is not dict:
            continue
        value = item.get("text")
        if type(value) is not str:
            value = item.get("summary")
        if type(value) is str:
            pieces.append(value)
    return "".join(pieces)


def cache_usage(usage: Any) -> tuple[int, int]:
    """``(cached, cache_written)`` prompt tokens of a usage object
    (``prompt_tokens_details.cached_tokens`` / ``.cache_write_tokens``; 0 when absent)."""
    # ``None`` and ``type() is dict`` first: the usual values, without the ABC machinery.
    if type(usage) is not dict and not isinstance(usage, Mapping):
        return 0, 0
    details = usage.get("prompt_tokens_details")
    if details is None or (type(details) is not dict and not isinstance(details, Mapping)):
        return 0, 0
    return _as_tokens(details.get("cached_tokens")), _as_tokens(details.get("cache_write_tokens"))


_Layout = tuple[bytes, bytes, int, int]
"""A stream's learned frame layout: ``(prefix, suffix, len(prefix), len(suffix))``, the bytes
around the content's string literal of a plain content delta."""

_LAYOUT_LEARNS = 2
"""Layouts learned per stream: the first plain content delta's, and once more (a provider
whose ``created`` ticks over mid-stream)."""

_CONTENT_MARKER = b'"delta":{"content":'
_PROBE_TEXT = "\x00probe\u2603"
_PROBE_LITERAL = b'"\\u0000probe\\u2603"'


def _string_end(data: bytes, start: int) -> int:
    """The index just past the JSON string literal that starts at ``data[start]``, or -1."""
    if data[start : start + 1] != b'"':
        return -1
    at = start + 1
    while True:
        quote = data.find(b'"', at)
        if quote < 0:
            return -1
        backslashes = 0
        while data[quote - 1 - backslashes] == 0x5C:  # a backslash before the quote
            backslashes += 1
        if not backslashes % 2:
            return quote + 1
        at = quote + 1


class ChatStreamParser:
    """Interprets the SSE events of one chat completion stream.

    ``feed_event`` returns ``True`` when the event carried a delta that counts as a token
    (content, reasoning or a tool-call fragment). ``done`` turns true at ``[DONE]``.
    """

    __slots__ = (
        "_cache",
        "_layout",
        "_learn_left",
        "_reasoning_fields",
        "_rules",
        "_splitter",
        "_usage",
        "done",
        "finish_reason",
        "has_tool_calls",
        "model",
        "source_name",
        "tools",
    )

    def __init__(
        self,
        *,
        reasoning_fields: Sequence[str] = ("reasoning_content", "reasoning"),
        think_tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),),
        source_name: str | None = None,
        error_rules: Sequence[ErrorRule] = (),
    ) -> None:
        self._reasoning_fields = (
            reasoning_fields if type(reasoning_fields) is tuple else tuple(reasoning_fields)
        )
        self._rules = error_rules
        self._splitter = ThinkTagSplitter(think_tags)
        self._usage: tuple[int, int] | None = None
        self._cache = (0, 0)
        self.done = False
        self.finish_reason: str | None = None
        self.has_tool_calls = False
        self.model = ""
        self.source_name = source_name
        self.tools = ToolCallAssembler()
        self._layout: _Layout | None = None
        self._learn_left = _LAYOUT_LEARNS

    @property
    def has_content(self) -> bool:
        return self._splitter.has_text

    @property
    def content_parts(self) -> list[str]:
        """The content pieces so far (grows as events are fed; read, never modify)."""
        return self._splitter.content

    @property
    def thinking_parts(self) -> list[str]:
        return self._splitter.thinking

    def feed_event(self, data: bytes, event: bytes | None = None) -> bool:
        if not data:
            return False  # an empty data line is a keep-alive, not a frame
        if data[0] != 0x7B or event is not None:  # not "{": [DONE], a named event, junk
            if data.startswith(b"[DONE]"):
                self.done = True
                return False
            if event == b"error":
                raise error_for_stream_event(
                    self._load(data, strict=False),
                    source_name=self.source_name,
                    rules=self._rules,
                )
        return self._chunk(self._load(data, strict=True))

    def feed_events(self, events: Iterable[SSEEvent]) -> bool:
        """Feed events in order up to ``[DONE]`` (later ones are ignored); ``True`` when any
        of them carried a token. Same outcome as ``feed_event`` on each."""
        token = False
        splitter = self._splitter
        append = splitter.content.append
        # The straight path, once per streamed chunk: a plain content delta of the first
        # choice, once the model is known and past any think block. Anything else (and any
        # doubt) takes the general path, which is the definition.
        straight = splitter.mode == BODY and bool(self.model)
        layout = self._layout
        for data, event in events:
            if layout is not None and event is None:
                # The learned layout: only the content's string literal differs from the
                # frame it was learned on (see ``_learn_layout``).
                prefix, suffix, start, end = layout
                if len(data) > start + end and data.startswith(prefix) and data.endswith(suffix):
                    try:
                        content = json_loads(data[start:-end])
                    except ValueError:
                        content = None  # not one JSON value: the general path decides
                    if type(content) is str and content:
                        append(content)
                        token = True
                        continue
            if straight and event is None and data[:1] == b"{":
                try:
                    chunk = json_loads(data)
                except ValueError:
                    chunk = self._load(data, strict=True)  # raises the malformed-frame error
                if type(chunk) is not dict:
                    chunk = self._load(data, strict=True)  # raises: not a JSON object
                choices = chunk.get("choices")
                if type(choices) is list and choices and "error" not in chunk:
                    choice = choices[0]
                    if type(choice) is dict:
                        delta = choice.get("delta")
                        if (
                            type(delta) is dict
                            and len(delta) == 1
                            and not chunk.get("usage")
                            and not choice.get("finish_reason")
                            and not choice.get("index")
                        ):
                            content = delta.get("content")
                            if type(content) is str and content:
                                append(content)
                                token = True
                                if self._learn_left:
                                    layout = self._learn_layout(data, chunk, choices)
                                elif layout is not None:
                                    layout = self._layout = None  # it stopped fitting
                                continue
                if self._chunk(chunk):
                    token = True
            elif self.feed_event(data, event):
                token = True
            if self.done:
                break
            straight = splitter.mode == BODY and bool(self.model)
        return token

    def _learn_layout(
        self, data: bytes, chunk: dict[str, Any], choices: list[Any]
    ) -> _Layout | None:
        """The layout of ``data``, a plain content delta (as the straight path found it):
        the bytes before and after the content's string literal, when the frame is written
        compactly. Proven on a probe: the same bytes around another literal must parse as
        ``chunk`` with only that content changed. Then, JSON being context-free, the same
        bytes around any string literal are that chunk with that literal's text, and a frame
        of the layout needs only its literal decoded. Learned at most ``_LAYOUT_LEARNS``
        times per stream (a provider that varies every frame stops paying for it)."""
        self._learn_left -= 1
        self._layout = None
        if "obfuscation" in chunk:
            # OpenAI pads every frame with a random field: no two frames share a layout.
            self._learn_left = 0
            return None
        marker = data.find(_CONTENT_MARKER)
        if marker < 0 or data.find(_CONTENT_MARKER, marker + 1) >= 0:
            return None
        start = marker + len(_CONTENT_MARKER)
        end = _string_end(data, start)
        if end < 0:
            return None
        prefix, suffix = data[:start], data[end:]
        try:
            probe = json_loads(prefix + _PROBE_LITERAL + suffix)
        except ValueError:
            return None
        first = choices[0]
        expected = {
            **chunk,
            "choices": [{**first, "delta": {"content": _PROBE_TEXT}}, *choices[1:]],
        }
        if probe != expected:
            return None
        layout = self._layout = (prefix, suffix, len(prefix), len(suffix))
        return layout

    def _chunk(self, chunk: dict[str, Any]) -> bool:
        """One parsed chunk (a JSON object): the general path."""
        get = chunk.get
        if get("error"):
            raise error_for_stream_event(chunk, source_name=self.source_name, rules=self._rules)
        usage = _chunk_usage(chunk)
        if usage:
            self._usage = _usage(usage) or self._usage
            self._cache = cache_usage(usage)
        if not self.model:
            model = get("model")
            if type(model) is str:
                self.model = model
        choices = get("choices")
        if not choices:
            if get("object") == "error":  # flat vLLM error object
                raise error_for_stream_event(chunk, source_name=self.source_name, rules=self._rules)
            return False  # the usage chunk: choices [] / null / missing
        if type(choices) is not list:
            return False
        choice = choices[0]
        if type(choice) is not dict:
            return False
        get = choice.get
        if get("index", 0):
            return False  # only the first choice is read
        finish = get("finish_reason")
        if finish:
            if finish == "error":  # OpenRouter's way of failing mid-stream
                raise TransientError(
                    f"{self._where}stream finished with finish_reason=error",
                    source_name=self.source_name,
                )
            self.finish_reason = str(finish)
        delta = get("delta")
        if not delta or type(delta) is not dict:
            return False
        content = delta.get("content")
        token = False
        if content is None or len(delta) > 1:  # only then can other fields be present
            for name in self._reasoning_fields:
                reasoning = delta.get(name)
                if reasoning and type(reasoning) is str:
                    self._splitter.thinking.append(reasoning)
                    token = True
                    break
            else:
                details = delta.get("reasoning_details")
                if details and type(details) is list:
                    # Only when no plain field had it: OpenRouter may send both, the same text.
                    self._splitter.thinking.append(reasoning_details_text(details))
                    token = True  # encrypted reasoning too: the model is working
            fragments = delta.get("tool_calls")
            if fragments:
                self.has_tool_calls = True
                self.tools.feed(fragments)
                token = True
        if content and type(content) is str:
            self._splitter.feed(content)
            return True
        if content and type(content) is list:
            text, thinking, seen = content_parts(content)
            if thinking:
                self._splitter.thinking.append(thinking)
            if text:
                self._splitter.feed(text)
            # A thinking part is a token: it keeps the TTFT and inter-token deadlines satisfied.
            return token or seen
        return token

    @property
    def _where(self) -> str:
        return f"source {self.source_name!r}: " if self.source_name else ""

    def _load(self, data: bytes, *, strict: bool) -> dict[str, Any]:
        try:
            chunk = json_loads(data)
        except ValueError:
            if not strict:
                return {"message": data.decode("utf-8", "replace")}
            head = sanitize_message(repr(data[:80]))
            raise TransientError(
                f"{self._where}malformed stream frame (not JSON): {head}",
                source_name=self.source_name,
            ) from None
        if type(chunk) is not dict:
            if not strict:
                return {"message": str(chunk)}
            raise TransientError(
                f"{self._where}malformed stream frame (not a JSON object)",
                source_name=self.source_name,
            )
        return chunk

    def result(self) -> ParsedCompletion:
        content, thinking = self._splitter.finish()
        usage = self._usage
        return ParsedCompletion(
            content=content,
            thinking=thinking,
            finish_reason=self.finish_reason,
            prompt_tokens=usage[0] if usage else None,
            completion_tokens=usage[1] if usage else None,
            model=self.model,
            has_tool_calls=self.has_tool_calls,
            cached_tokens=self._cache[0],
            cache_write_tokens=self._cache[1],
            tool_calls=self.tools.result() if self.has_tool_calls else (),
        )


def parse_completion(
    body: Any,
    *,
    reasoning_fields: Sequence[str] = ("reasoning_content", "reasoning"),
    think_tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),),
    source_name: str | None = None,
    error_rules: Sequence[ErrorRule] = (),
) -> ParsedCompletion:
    """Interpret a parsed non-streaming ``chat.completion`` body (protocols §1.2).

    An ``error`` object (some gateways answer 200 with one) raises what
    ``error_for_stream_event`` makes of it (``error_rules`` first); a body without a first
    choice raises ``TransientError``.
    """
    if not isinstance(body, dict):
        raise TransientError(
            "malformed completion body (not a JSON object)", source_name=source_name
        )
    get = body.get
    if get("error") or get("object") == "error":
        raise error_for_stream_event(body, source_name=source_name, rules=error_rules)
    choices = get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise TransientError("malformed completion body (no choices)", source_name=source_name)
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise TransientError("malformed completion body (no message)", source_name=source_name)
    thinking = ""
    for name in reasoning_fields:
        value = message.get(name)
        if value and isinstance(value, str):
            thinking = value
            break
    else:
        details = message.get("reasoning_details")
        if details and type(details) is list:
            thinking = reasoning_details_text(details)
    raw_content = message.get("content")
    if isinstance(raw_content, str):
        content = raw_content
    elif type(raw_content) is list:
        content, part_thinking, _ = content_parts(raw_content)
        thinking += part_thinking
    else:
        content = ""
    if content and opens_think_block(content, think_tags):
        content, inline_thinking = split_think(content, think_tags)
        if inline_thinking:
            thinking = thinking + inline_thinking if thinking else inline_thinking
    raw_usage = _chunk_usage(body)
    usage = _usage(raw_usage)
    cached, written = cache_usage(raw_usage) if usage else (0, 0)
    finish = choice.get("finish_reason")
    model = get("model")
    calls = message.get("tool_calls")
    # Positional: this runs once per non-streaming call.
    return ParsedCompletion(
        content,
        thinking,
        str(finish) if finish else None,
        usage[0] if usage else None,
        usage[1] if usage else None,
        model if isinstance(model, str) else "",
        bool(calls),
        cached,
        written,
        tool_calls_of(message) if calls else (),
    )


__all__ = [
    "ChatStreamParser",
    "DeltaTap",
    "ParsedCompletion",
    "ToolCallAssembler",
    "cache_usage",
    "content_parts",
    "json_loads",
    "parse_completion",
    "reasoning_details_text",
    "tool_calls_of",
]
