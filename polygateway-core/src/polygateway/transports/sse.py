"""Server-sent events and OpenAI chat chunks as pure, incremental, I/O-free parsers.

``SSEDecoder`` turns arbitrary byte chunks into events (protocols.md §1.3): events end at a
blank line (``\\n\\n``, ``\\r\\n\\r\\n``, ``\\r\\r``, mixed), ``:`` comment lines (keep-alives) are
ignored, ``data:`` with or without the space, several ``data:`` lines join with ``\\n``. Bytes are
only split at line ends, never decoded here, so a UTF-8 character cut between two chunks is
reassembled before anything decodes it.

``ChatStreamParser`` interprets the events of a chat completion stream: content and reasoning
deltas (``reasoning_content`` -> ``reasoning`` -> inline ``<think>`` tags, §2), the usage chunk
(``choices`` empty, null or missing), ``finish_reason``, ``[DONE]``; error events and malformed
frames raise ``TransientError``. ``parse_completion`` does the same for a non-streaming body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

from polygateway.errors import TransientError
from polygateway.transports.errors import describe_error_body, sanitize_message

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional speed-up
    _orjson = None  # type: ignore[assignment]

json_loads: Callable[[bytes | str], Any] = _orjson.loads if _orjson is not None else json.loads
"""Parses one JSON document; ``orjson`` when installed (about 6x faster per chunk)."""

DEFAULT_MAX_EVENT_BYTES = 16 * 1024 * 1024
"""An event larger than this is a protocol violation, not a reason to grow memory forever."""


class SSEProtocolError(ValueError):
    """The byte stream is not usable SSE (e.g. an event exceeds the size limit)."""


SSEEvent: TypeAlias = tuple[bytes, bytes | None]
"""``(data, event)``: the data lines joined by ``\\n`` (still bytes: the JSON parser decodes
them) and the ``event:`` field when one was sent (OpenAI sends none, except for errors).
A plain tuple: one is made per streamed chunk."""


class SSEDecoder:
    """Incremental SSE decoder: ``feed`` byte chunks, get completed events; ``flush`` at EOF."""

    __slots__ = ("_buf", "_max_event_bytes", "_scan_from")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self._scan_from = 0
        self._max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        scan_from = self._scan_from
        if b"\r" in buf:
            # Normalise line ends. A trailing \r may be the first half of \r\n: hold it back.
            held = buf.endswith(b"\r")
            if held:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            scan_from = 0
        else:
            held = False
        end = buf.find(b"\n\n", scan_from)
        if end < 0:
            if len(buf) > self._max_event_bytes:
                raise SSEProtocolError(f"SSE event larger than {self._max_event_bytes} bytes")
            self._buf = buf + b"\r" if held else buf
            # Next time only the tail can start a new blank line.
            self._scan_from = max(0, len(buf) - 1)
            return []
        cut = buf.rfind(b"\n\n")
        rest = buf[cut + 2 :]
        if len(rest) > self._max_event_bytes:
            raise SSEProtocolError(f"SSE event larger than {self._max_event_bytes} bytes")
        self._buf = rest + b"\r" if held else rest
        self._scan_from = max(0, len(rest) - 1)
        if buf.startswith(b"data: "):
            # The usual stream: nothing but single-line "data: ..." events. Then every line
            # end before ``cut`` belongs to an event separator, which one count proves.
            datas = buf[6:cut].split(b"\n\ndata: ")
            if buf.count(b"\n", 0, cut) == 2 * (len(datas) - 1):
                return [(data, None) for data in datas]
        return self._events(buf[:cut].split(b"\n\n"))

    def _events(self, parts: list[bytes]) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        for raw in parts:
            # Fast path: the usual single-line event "data: {...}".
            if raw.startswith(b"data: ") and b"\n" not in raw:
                events.append((raw[6:], None))
            elif raw:
                event = _parse_event(raw.split(b"\n"))
                if event is not None:
                    events.append(event)
        return events

    def flush(self) -> list[SSEEvent]:
        """End of stream: dispatch a last event whose lines are complete but whose blank line
        never came (lenient, common with ``data: [DONE]\\n``); an unterminated line is dropped."""
        buf = self._buf
        self._buf = b""
        self._scan_from = 0
        if not buf:
            return []
        buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        lines.pop()  # the unterminated tail (b"" when the buffer ended with a line end)
        event = _parse_event(lines)
        return [event] if event is not None else []

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete event held back (non-zero at EOF means a cut event)."""
        return len(self._buf)


def _parse_event(lines: Sequence[bytes]) -> SSEEvent | None:
    data: list[bytes] = []
    event: bytes | None = None
    for line in lines:
        if not line or line[:1] == b":":
            continue
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
        # id:, retry: and unknown fields do not matter for chat completions.
    if not data:
        return None
    return (data[0] if len(data) == 1 else b"\n".join(data), event)


# --------------------------------------------------------------------------- think tags

_START, _THINK, _BODY = 0, 1, 2


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ThinkTagSplitter:
    """Separates an inline ``<think>...</think>`` block from the answer, incrementally.

    Only a block that opens the content (after optional whitespace) is recognised: a model
    quoting a tag mid-answer keeps its text. A closing tag without an opening one (original
    DeepSeek-R1) is not guessed at: the text stays content. Tags split across chunks are held
    back until they can be decided.
    """

    __slots__ = ("_close", "_mode", "_pending", "_tags", "content", "found", "thinking")

    def __init__(self, tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),)) -> None:
        self._tags = tags if type(tags) is tuple else tuple(tags)
        self._mode = _START if self._tags else _BODY
        self._pending = ""
        self._close = ""
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.found = False

    @property
    def has_text(self) -> bool:
        """Whether any content or thinking arrived (held-back tag prefixes included)."""
        return bool(self.content or self.thinking or self._pending)

    def feed(self, text: str) -> None:
        if self._mode == _BODY:
            self.content.append(text)
            return
        if self._pending:
            text = self._pending + text
            self._pending = ""
        if self._mode == _START:
            stripped = text.lstrip()
            if not stripped:
                self._pending = text
                return
            for open_tag, close_tag in self._tags:
                if stripped.startswith(open_tag):
                    self._mode = _THINK
                    self._close = close_tag
                    self.found = True
                    text = stripped[len(open_tag) :]
                    break
            else:
                if any(tag.startswith(stripped) for tag, _ in self._tags):
                    self._pending = text  # maybe "<thi" of "<think>": decide later
                else:
                    self._mode = _BODY
                    self.content.append(text)
                return
        # Inside the think block.
        close = self._close
        index = text.find(close)
        if index >= 0:
            if index:
                self.thinking.append(text[:index])
            self._mode = _BODY
            rest = text[index + len(close) :]
            if rest:
                self.content.append(rest)
            return
        held = _held_suffix(text, close)
        if held:
            self._pending = text[-held:]
            text = text[:-held]
        if text:
            self.thinking.append(text)

    def finish(self) -> tuple[str, str]:
        """``(content, thinking)``; the answer after a think block loses its leading whitespace."""
        pending = self._pending
        self._pending = ""
        if pending:
            (self.thinking if self._mode == _THINK else self.content).append(pending)
        content = "".join(self.content)
        if self.found:
            content = content.lstrip()
        return content, "".join(self.thinking)


def split_think(
    text: str, tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),)
) -> tuple[str, str]:
    """One-shot ``ThinkTagSplitter``: ``(content, thinking)`` of a complete text."""
    splitter = ThinkTagSplitter(tags)
    splitter.feed(text)
    return splitter.finish()


def _opens_think_block(text: str, tags: Sequence[tuple[str, str]]) -> bool:
    """Whether ``text`` (after leading whitespace) starts with an opening tag: only then can
    ``split_think`` change it, so a complete answer without one skips the splitter."""
    stripped = text.lstrip()
    for open_tag, _ in tags:  # noqa: SIM110 - a plain loop: no generator per call
        if stripped.startswith(open_tag):
            return True
    return False


# --------------------------------------------------------------------------- chunks


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


def _error_from_payload(payload: Mapping[str, Any], source_name: str | None) -> TransientError:
    """An error object sent instead of an answer: ``TransientError`` (§6.2: SSE faults)."""
    code, kind, message = describe_error_body(payload)
    label = "/".join(str(x) for x in (kind, code) if x) or "error"
    prefix = f"source {source_name!r}: " if source_name else ""
    return TransientError(
        sanitize_message(f"{prefix}error event in the stream: {label}: {message}"),
        source_name=source_name,
    )


class ChatStreamParser:
    """Interprets the SSE events of one chat completion stream.

    ``feed_event`` returns ``True`` when the event carried a delta that counts as a token
    (content, reasoning or a tool-call fragment). ``done`` turns true at ``[DONE]``.
    """

    __slots__ = (
        "_reasoning_fields",
        "_splitter",
        "_usage",
        "done",
        "finish_reason",
        "has_tool_calls",
        "model",
        "source_name",
    )

    def __init__(
        self,
        *,
        reasoning_fields: Sequence[str] = ("reasoning_content", "reasoning"),
        think_tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),),
        source_name: str | None = None,
    ) -> None:
        self._reasoning_fields = (
            reasoning_fields if type(reasoning_fields) is tuple else tuple(reasoning_fields)
        )
        self._splitter = ThinkTagSplitter(think_tags)
        self._usage: tuple[int, int] | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.has_tool_calls = False
        self.model = ""
        self.source_name = source_name

    @property
    def has_content(self) -> bool:
        return self._splitter.has_text

    def feed_event(self, data: bytes, event: bytes | None = None) -> bool:
        if not data:
            return False  # an empty data line is a keep-alive, not a frame
        if data[0] != 0x7B or event is not None:  # not "{": [DONE], a named event, junk
            if data.startswith(b"[DONE]"):
                self.done = True
                return False
            if event == b"error":
                raise _error_from_payload(self._load(data, strict=False), self.source_name)
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
        straight = splitter._mode == _BODY and bool(self.model)
        for data, event in events:
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
                                continue
                if self._chunk(chunk):
                    token = True
            elif self.feed_event(data, event):
                token = True
            if self.done:
                break
            straight = splitter._mode == _BODY and bool(self.model)
        return token

    def _chunk(self, chunk: dict[str, Any]) -> bool:
        """One parsed chunk (a JSON object): the general path."""
        get = chunk.get
        if get("error"):
            raise _error_from_payload(chunk, self.source_name)
        usage = get("usage")
        if usage:
            self._usage = _usage(usage) or self._usage
        if not self.model:
            model = get("model")
            if type(model) is str:
                self.model = model
        choices = get("choices")
        if not choices:
            if get("object") == "error":  # flat vLLM error object
                raise _error_from_payload(chunk, self.source_name)
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
            if delta.get("tool_calls"):
                self.has_tool_calls = True
                token = True
        if content and type(content) is str:
            self._splitter.feed(content)
            return True
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
        )


def parse_completion(
    body: Any,
    *,
    reasoning_fields: Sequence[str] = ("reasoning_content", "reasoning"),
    think_tags: Sequence[tuple[str, str]] = (("<think>", "</think>"),),
    source_name: str | None = None,
) -> ParsedCompletion:
    """Interpret a parsed non-streaming ``chat.completion`` body (protocols.md §1.2).

    An ``error`` object (some gateways answer 200 with one) or a body without a first choice
    raises ``TransientError``.
    """
    if not isinstance(body, dict):
        raise TransientError(
            "malformed completion body (not a JSON object)", source_name=source_name
        )
    get = body.get
    if get("error") or get("object") == "error":
        raise _error_from_payload(body, source_name)
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
    raw_content = message.get("content")
    content = raw_content if isinstance(raw_content, str) else ""
    if content and _opens_think_block(content, think_tags):
        content, inline_thinking = split_think(content, think_tags)
        if inline_thinking:
            thinking = thinking + inline_thinking if thinking else inline_thinking
    usage = _usage(get("usage"))
    finish = choice.get("finish_reason")
    model = get("model")
    # Positional: this runs once per non-streaming call.
    return ParsedCompletion(
        content,
        thinking,
        str(finish) if finish else None,
        usage[0] if usage else None,
        usage[1] if usage else None,
        model if isinstance(model, str) else "",
        bool(message.get("tool_calls")),
    )


__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "ChatStreamParser",
    "ParsedCompletion",
    "SSEDecoder",
    "SSEEvent",
    "SSEProtocolError",
    "ThinkTagSplitter",
    "json_loads",
    "parse_completion",
    "split_think",
]
