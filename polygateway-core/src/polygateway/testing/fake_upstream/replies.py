"""What the fake upstream answers: :class:`Reply` (scripted per request) and what it saw:
:class:`ReceivedRequest`. Protocol-neutral: every protocol's answers read the same Reply."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "DEFAULT_CONTENT",
    "DIALECTS",
    "Dialect",
    "ReceivedRequest",
    "Reply",
    "ReplyKind",
    "check_delay",
    "estimate_tokens",
    "split",
]

DEFAULT_CONTENT: Final = "Hello from the fake upstream."

ReplyKind = Literal[
    "ok",
    "stall",
    "no_done",
    "empty",
    "error",
    "cut",
    "early_eof",
    "malformed",
    "mid_stream_error",
    "reset",
    "black_hole",
    "redirect",
    "flood",
    "garbage",
    "truncated",
]

Dialect = Literal["openai", "mistral", "openrouter", "groq"]
"""How an OpenAI-wire answer is shaped, after real providers (see ``Reply.ok``)."""

DIALECTS: Final[tuple[str, ...]] = ("openai", "mistral", "openrouter", "groq")

_MAX_DEFAULT_CHUNKS: Final = 20
_CHARS_PER_DEFAULT_CHUNK: Final = 4


def estimate_tokens(text: str) -> int:
    """The fake's deterministic token estimate: ``len(text) // 4``, at least 1."""
    return max(1, len(text) // 4)


def check_delay(name: str, value: float) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"Reply.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Reply:
    """What the fake upstream answers to one request. Build it with the class methods."""

    kind: ReplyKind
    content: str | Callable[[Any], str] = DEFAULT_CONTENT
    chunks: int | None = None
    reasoning: str | None = None
    think_inline: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = "stop"
    include_usage: bool | None = None
    headers_delay: float = 0.0
    first_token_delay: float = 0.0
    inter_token_delay: float = 0.0
    model: str | None = None
    status: int = 200
    error_code: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    retry_after: float | str | None = None
    quota: bool = False
    body: str | bytes | None = None
    after_chunks: int = 0
    after_headers: bool = False
    location: str | None = None
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    """``(id, name, arguments JSON)`` per tool call of an ``ok`` answer (OpenAI route)."""
    size: int = 0
    gzip: bool = False
    fill: str = "x"
    cached_tokens: int | None = None
    dialect: Dialect = "openai"
    headers: tuple[tuple[str, str], ...] = ()
    event_error: Mapping[str, Any] | None = None
    reject_prefill: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.content, str) or callable(self.content)):
            raise TypeError(
                f"Reply content must be a str or a callable, got {type(self.content).__name__}"
            )
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"Reply.chunks must be >= 1 or None, got {self.chunks!r}")
        for name in ("headers_delay", "first_token_delay", "inter_token_delay"):
            value = getattr(self, name)
            check_delay(name, value)
            # Plans tell delays from bytes by type: store ints as floats.
            object.__setattr__(self, name, float(value))
        if self.kind == "error" and not 400 <= self.status <= 599:
            raise ValueError(f"Reply.error status must be in 400..599, got {self.status!r}")
        if self.kind == "redirect" and not 300 <= self.status <= 399:
            raise ValueError(f"Reply.redirect status must be in 300..399, got {self.status!r}")
        if self.size < 0:
            raise ValueError(f"Reply.flood size must be >= 0, got {self.size!r}")
        if len(self.fill) != 1 or self.fill in '"\\' or not self.fill.isprintable():
            raise ValueError(f"Reply.flood fill must be one printable character, got {self.fill!r}")
        if self.after_chunks < 0:
            raise ValueError(f"Reply after_chunks must be >= 0, got {self.after_chunks!r}")
        if self.dialect not in DIALECTS:
            raise ValueError(f"Reply.dialect must be one of {DIALECTS}, got {self.dialect!r}")
        for name, value in self.headers:
            if not name or any(c in f"{name}{value}" for c in "\r\n") or ":" in name:
                raise ValueError(f"Reply.headers: not a valid header line {name!r}: {value!r}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Reply.{name} must be >= 0 or None, got {value!r}")

    @classmethod
    def ok(
        cls,
        content: str | Callable[[Any], str] = DEFAULT_CONTENT,
        *,
        chunks: int | None = None,
        reasoning: str | None = None,
        think_inline: bool = False,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        finish_reason: str = "stop",
        include_usage: bool | None = None,
        headers_delay: float = 0.0,
        first_token_delay: float = 0.0,
        inter_token_delay: float = 0.0,
        model: str | None = None,
        cached_tokens: int | None = None,
        dialect: Dialect = "openai",
        tool_calls: Sequence[tuple[str, str, str]] = (),
        reject_prefill: bool = False,
    ) -> Reply:
        """A normal completion (JSON or SSE, as the request asks).

        ``tool_calls``: ``(id, name, arguments JSON)`` each, answered as ``message.tool_calls``
        or, streamed, as OpenAI's fragments (the id and name first, then the arguments in
        pieces, by ``index``) after the content; pass ``finish_reason="tool_calls"`` with them.

        ``reject_prefill``: a request whose last message is the assistant's (a prefill) gets a
        400 instead, like providers that do not continue a partial answer.

        ``content`` may be a callable receiving the request JSON. Streaming splits content into
        ``chunks`` pieces (default: one per 4 characters, at most 20); ``reasoning`` streams first
        as ``reasoning_content`` deltas, or inline as ``<think>...</think>`` when
        ``think_inline``. ``include_usage=None`` follows the request's
        ``stream_options.include_usage``; True/False forces it (False also drops ``usage`` from
        a JSON answer). A JSON answer waits ``headers_delay + first_token_delay +
        inter_token_delay * (chunks - 1)`` before its status line (the generation time).
        ``cached_tokens``: the part of the prompt reported as read from the provider's prompt
        cache (OpenAI ``prompt_tokens_details.cached_tokens``, Anthropic
        ``cache_read_input_tokens``). Other protocols render ``reasoning`` their own way
        (Anthropic: thinking blocks, whatever ``think_inline`` says).

        ``dialect`` shapes an OpenAI-wire answer like a real provider's:
        ``"mistral"``: ``content`` is a list of parts, ``{"type":"text","text":...}`` for the
        answer and ``{"type":"thinking","thinking":[{"type":"text","text":...}]}`` for the
        reasoning (Magistral), in the JSON message and in every delta; ``"openrouter"``: the
        reasoning only in ``reasoning_details`` (``reasoning.text`` items; the JSON message adds
        a ``reasoning.encrypted`` one); ``"groq"``: the usage only in ``x_groq.usage`` (the
        stream's finish chunk, or the JSON body), never in ``usage``.
        """
        return cls(
            kind="ok",
            content=content,
            chunks=chunks,
            reasoning=reasoning,
            think_inline=think_inline,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            include_usage=include_usage,
            headers_delay=headers_delay,
            first_token_delay=first_token_delay,
            inter_token_delay=inter_token_delay,
            model=model,
            cached_tokens=cached_tokens,
            dialect=dialect,
            tool_calls=tuple(tuple(call) for call in tool_calls),  # type: ignore[misc]
            reject_prefill=reject_prefill,
        )

    @classmethod
    def error(
        cls,
        status: int,
        *,
        code: str | None = None,
        type: str | None = None,
        message: str | None = None,
        retry_after: float | str | None = None,
        quota: bool = False,
        body: str | bytes | None = None,
        headers_delay: float = 0.0,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """An HTTP error with an OpenAI-style body ``{"error":{message,type,param,code}}``.

        Defaults per status follow the real API (429: ``requests``/``rate_limit_exceeded``;
        ``quota=True``: ``insufficient_quota`` for both). ``retry_after`` adds a
        ``Retry-After`` header (seconds; a string is sent verbatim). ``body`` replaces the body.
        ``headers`` adds response headers (e.g. ``{"x-should-retry": "false"}``). Real
        providers' error bodies: ``polygateway.testing.fake_upstream.openai.provider_error``.
        """
        return cls(
            kind="error",
            status=status,
            error_code=code,
            error_type=type,
            error_message=message,
            retry_after=retry_after,
            quota=quota,
            body=body,
            headers_delay=headers_delay,
            headers=tuple((str(k), str(v)) for k, v in (headers or {}).items()),
        )

    @classmethod
    def cut(cls, after_chunks: int = 3) -> Reply:
        """Stream ``after_chunks`` content chunks, then end the body cleanly without the finish
        chunk, the usage chunk and ``[DONE]``. A JSON answer is truncated mid-body instead (the
        connection closes before ``Content-Length`` bytes were sent)."""
        return cls(kind="cut", after_chunks=after_chunks)

    @classmethod
    def no_done(cls, content: str = DEFAULT_CONTENT) -> Reply:
        """A complete stream (content, finish chunk, usage when asked) whose body then ends
        cleanly without ``[DONE]``. A JSON answer is a normal one."""
        return cls(kind="no_done", content=content)

    @classmethod
    def stall(cls, after_chunks: int = 3) -> Reply:
        """Stream ``after_chunks`` content chunks, then send nothing more (the connection stays
        open until the client leaves). A JSON answer never sends its body."""
        return cls(kind="stall", after_chunks=after_chunks)

    @classmethod
    def context_length_exceeded(cls, limit: int = 8192) -> Reply:
        """OpenAI's 400 for a prompt over the model's context window."""
        return cls.error(
            400,
            code="context_length_exceeded",
            type="invalid_request_error",
            message=f"This model's maximum context length is {limit} tokens. However, your "
            "messages resulted in more tokens. Please reduce the length of the messages.",
        )

    @classmethod
    def content_filter(cls) -> Reply:
        """A 400 content-policy rejection (Azure/OpenAI ``content_filter``)."""
        return cls.error(
            400,
            code="content_filter",
            type="invalid_request_error",
            message="The response was filtered due to the prompt triggering the content "
            "management policy.",
        )

    @classmethod
    def early_eof(cls) -> Reply:
        """200 headers, then the body ends with zero events (JSON: an empty body)."""
        return cls(kind="early_eof")

    @classmethod
    def malformed(cls, after_chunks: int = 1) -> Reply:
        """After ``after_chunks`` content chunks, a ``data:`` frame that is not valid JSON; the
        rest of the stream follows normally. A JSON answer is a 200 with an invalid JSON body."""
        return cls(kind="malformed", after_chunks=after_chunks)

    @classmethod
    def empty(cls) -> Reply:
        """A complete, well-formed answer whose content is empty (finish, usage, ``[DONE]``)."""
        return cls(kind="empty", content="")

    @classmethod
    def mid_stream_error(
        cls, after_chunks: int = 1, *, error: Mapping[str, Any] | None = None
    ) -> Reply:
        """After ``after_chunks`` content chunks, ``data: {"error":{...}}`` and the end of the
        body (no ``[DONE]``). A JSON answer is a 200 whose body is the error object.
        ``error`` replaces the error object (default: OpenAI's "Upstream provider
        disconnected" ``server_error``), e.g. Groq's ``tool_use_failed``."""
        return cls(kind="mid_stream_error", after_chunks=after_chunks, event_error=error)

    @classmethod
    def reset(cls, after_headers: bool = False) -> Reply:
        """Reset the TCP connection (RST) before, or right after, the response headers."""
        return cls(kind="reset", after_headers=after_headers)

    @classmethod
    def black_hole(cls) -> Reply:
        """Read the request and never answer (until the client leaves or the server stops)."""
        return cls(kind="black_hole")

    @classmethod
    def garbage(cls) -> Reply:
        """Bytes that are not an HTTP response at all, then the connection closes."""
        return cls(kind="garbage")

    @classmethod
    def truncated(cls, content: str = DEFAULT_CONTENT) -> Reply:
        """A chunked answer whose head spells its fields in odd case (``TRANSFER-ENCODING:
        Chunked``) and whose connection closes (FIN) before the body's last chunk: a stream
        without its last event (OpenAI's ``[DONE]``, Anthropic's ``message_stop``), a JSON
        answer whole. HTTP says the answer is incomplete, however well-formed what came is."""
        return cls(kind="truncated", content=content)

    @classmethod
    def redirect(cls, location: str, status: int = 307) -> Reply:
        """A redirect (``Location: location``, empty body). A client must not follow it: that
        would send the prompt and the credentials to another host."""
        return cls(kind="redirect", status=status, location=location)

    @classmethod
    def flood(cls, size: int, *, gzip: bool = False, fill: str = "x") -> Reply:
        """A well-formed answer of about ``size`` bytes (decompressed), made while it is sent
        and never held in memory: a stream of content events, or one JSON completion whose
        content is ``size`` bytes of ``fill`` (one printable character other than a quote or a
        backslash, e.g. ``{`` for hostile "JSON"); chunked. ``gzip=True`` compresses it
        (``Content-Encoding: gzip``, about 1000:1: a decompression bomb when large)."""
        return cls(kind="flood", size=size, gzip=gzip, fill=fill)


@dataclass(frozen=True, slots=True)
class ReceivedRequest:
    """One request as it reached the server."""

    source: str
    route: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    raw_body: bytes = field(repr=False)
    at: float = 0.0
    """When it arrived (the server clock's ``monotonic()``): gaps between attempts."""


def piece_count(text: str, pieces: int | None) -> int:
    """``len(split(text, pieces))``, without making the pieces (a JSON answer only counts
    them)."""
    if not text:
        return 0
    if pieces is None:
        pieces = min(_MAX_DEFAULT_CHUNKS, -(-len(text) // _CHARS_PER_DEFAULT_CHUNK))
    return max(0, min(pieces, len(text)))


def split(text: str, pieces: int | None) -> list[str]:
    """``text`` in ``pieces`` nearly equal pieces (default: one per 4 characters, at most 20)."""
    if not text:
        return []
    if pieces is None:
        pieces = min(_MAX_DEFAULT_CHUNKS, -(-len(text) // _CHARS_PER_DEFAULT_CHUNK))
    pieces = min(pieces, len(text))
    size = len(text)
    return [text[i * size // pieces : (i + 1) * size // pieces] for i in range(pieces)]
