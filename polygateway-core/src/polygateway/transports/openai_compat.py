"""The builtin ``openai-compat`` transport: one attempt against an OpenAI-compatible endpoint.

Body assembly (model, messages untouched, forced ``stream_options.include_usage``,
``response_format``, the provider profile's thinking fields, ``extra_body`` last), the HTTP
exchange on a pluggable engine (``options["engine"]``: ``httptools`` (default), ``aiohttp`` (the
default with ``trust_env``), ``httpx``, ``httpx-aiohttp``, ``httpx2``), incremental SSE parsing
under the liveness watchdog, and the translation of every failure into the error classes of
ARCHITECTURE §6.2. No retries, limits or cache here.

Source options (``SourceConfig.options``; strings from the environment are accepted): ``engine``,
``trust_env`` (default false: proxy variables and netrc are read only when true, by the aiohttp
and httpx engines), ``read_timeout_s`` (default off, also ``off`` or 0: the watchdog
owns liveness), ``max_connections`` (default 1024, 0 = unlimited), ``keepalive_s`` (default 15, 0
keeps no idle connection; durations as ``15``, ``"15s"``, ``"500ms"``, see
``transports.engine_options``), ``headers`` (extra request headers, a mapping; values of 8+
characters are masked out of error messages like the key). ``SourceConfig.max_response_bytes`` caps
each response body, on the wire and decoded: the engines never decode on their own, ``BodyReader``
does, step by step.

Stream outcome rules:
- ``[DONE]`` seen, content empty and no tool calls -> ``TransientError`` (empty completion:
  never cached, another attempt usually answers), or ``ContentFilterError`` when the
  ``finish_reason`` is ``content_filter`` (a filtered answer with content is returned as is,
  its ``finish_reason`` telling the caller, and never cached);
- no ``[DONE]`` but ``finish_reason`` arrived and the body ended cleanly -> the answer is
  complete: accepted as is (usage as reported, not salvaged), whatever ``missing_done`` says;
- no ``[DONE]`` and no content -> ``TransientError`` (early EOF), whatever ``missing_done`` says;
- no ``[DONE]`` nor ``finish_reason``, with content (a cut stream) -> ``TransientError`` when
  ``missing_done == "retry"`` (default), or the partial answer with ``usage_source="estimated"``
  when ``"salvage"``;
- no usage reported -> tokens estimated from the text (about 4 characters per token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import urlsplit

from polygateway.digest import canonical_messages_json, reject_lone_surrogates
from polygateway.errors import (
    ConfigError,
    ContentFilterError,
    EmptyCompletionError,
    RequestRejectedError,
    TransientError,
)
from polygateway.options import parse_bool, parse_number
from polygateway.params import body_fields
from polygateway.ports import ProviderProfile
from polygateway.providers import builtin_profiles_by_name
from polygateway.settings import SourceConfig
from polygateway.streaming import CallDeadline, LivenessKind, LivenessMonitor, StreamLiveness
from polygateway.transports.engine_options import engine_options
from polygateway.transports.engines import (
    ACCEPT_ENCODING,
    EngineConfig,
    EngineResponse,
    HttpEngine,
    default_engine,
    make_engine,
)
from polygateway.transports.errors import Secrets, error_for_status, sanitize_message
from polygateway.transports.json_body import JsonBodyParser
from polygateway.transports.openai_chunks import (
    ChatStreamParser,
    DeltaTap,
    ParsedCompletion,
    parse_completion,
)
from polygateway.transports.sse import SSEDecoder, SSEProtocolError
from polygateway.types import ChatRequest, Message, TransportResult

if TYPE_CHECKING:
    from polygateway.context import CallContext

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional speed-up
    _orjson = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024
"""Bytes of an error body read for the message (the rest is not worth waiting for)."""

DRAIN_GRACE_S = 0.25
"""After ``[DONE]``, how long to wait for the end of the body so the connection can be reused."""

DRAIN_LIMIT = 64 * 1024

CHARS_PER_TOKEN = 4

_MIN_SECRET_CHARS = 8
"""Shorter header values are not masked (masking ``1`` would garble every number)."""


# --------------------------------------------------------------------------- JSON


def _jsonable(value: Any) -> Any:
    """``default`` hook: read-only mappings and sequences become dicts and lists."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (Sequence, Set)) and not isinstance(value, (str, bytes, bytearray)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _orjson_dumps(value: Any) -> bytes:
    return _orjson.dumps(value, default=_jsonable)


def _stdlib_dumps(value: Any) -> bytes:
    text = json.dumps(value, default=_jsonable, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8")


json_dumps: Callable[[Any], bytes] = _orjson_dumps if _orjson is not None else _stdlib_dumps
"""Compact UTF-8 JSON (``orjson`` when installed: several times faster than ``json``)."""


# --------------------------------------------------------------------------- body


def build_request_body(
    request: ChatRequest, source: SourceConfig, profile: ProviderProfile | None
) -> dict[str, Any]:
    """The JSON body of one attempt (pure; raises ``RequestRejectedError`` for bad requests)."""
    if not request.messages:
        raise RequestRejectedError("messages must not be empty", source_name=source.name)
    stream = request.stream
    messages = request.messages
    params = request.params.over(source.params) if request.params is not None else source.params
    plain = params.is_empty()
    body: dict[str, Any] = {
        "model": source.model if plain or params.model is None else params.model,
        "messages": messages if isinstance(messages, list) else list(messages),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if not plain:
        field = profile.max_tokens_field if profile is not None else "max_tokens"
        body.update(body_fields(params, max_tokens_field=field))
    if request.response_format is not None:  # the native-schema strategy's, over the caller's
        body["response_format"] = request.response_format
    thinking = source.enable_thinking
    if thinking is not None and profile is not None and profile.thinking_body is not None:
        if thinking and profile.thinking_requires_stream and not stream:
            raise RequestRejectedError(
                f"source {source.name!r}: provider {profile.name!r} supports thinking only on "
                "streaming calls; call with stream=True or set enable_thinking=false",
                source_name=source.name,
            )
        body.update(profile.thinking_body(thinking))
    if request.extra_body:
        body.update(request.extra_body)
    if not plain and params.extra_body:
        body.update(params.extra_body)
    return body


def estimate_prompt_tokens(messages: Sequence[Message], context: CallContext | None = None) -> int:
    """About 4 characters per token of the messages' JSON, images counted by their digest
    (the JSON the call's ``context`` already holds, when there is one: nothing is hashed
    again)."""
    encoded = (
        context.canonical_messages(messages)
        if context is not None
        else canonical_messages_json(messages)
    )
    return max(1, math.ceil(len(encoded) / CHARS_PER_TOKEN))


def estimate_completion_tokens(content: str, thinking: str = "") -> int:
    chars = len(content) + len(thinking)
    return math.ceil(chars / CHARS_PER_TOKEN) if chars else 0


# --------------------------------------------------------------------------- options


def option_bool(options: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    """A boolean source option (``true``/``false`` strings from the environment accepted);
    ``ConfigError`` naming the source and the key otherwise. Shared by plugin transports."""
    value = options.get(key, default)
    try:
        return parse_bool(value)  # the vocabulary every option shares
    except ValueError as exc:
        raise ConfigError(f"source {source!r}: option {key!r} {exc}, got {value!r}") from None


def option_float(
    options: Mapping[str, Any], key: str, default: float | None, source: str
) -> float | None:
    """A number >= 0 (or ``None``/``""``/``"none"`` for off) from the source options."""
    value = options.get(key, default)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        number = parse_number(value)
    except ValueError:
        raise ConfigError(
            f"source {source!r}: option {key!r} must be a number, got {value!r}"
        ) from None
    if not number >= 0:
        raise ConfigError(f"source {source!r}: option {key!r} must be >= 0, got {value!r}")
    return number


def no_complete_answer(
    kind: LivenessKind, limit_s: float, *, source_name: str | None
) -> TransientError:
    """The timeout of a non-streaming call (its only deadline is the total one); a
    ``StreamLiveness`` ``timeout_error`` factory."""
    return TransientError(
        f"source {source_name!r}: no complete answer within {limit_s:g}s",
        source_name=source_name,
        reason="timeout",
    )


# --------------------------------------------------------------------------- outcome


def option_headers(source: SourceConfig) -> dict[str, str]:
    """The ``headers`` source option (extra request headers); ``ConfigError`` unless a mapping."""
    extra = source.options.get("headers")
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"source {source.name!r}: option 'headers' must be a mapping")
    return {str(k): str(v) for k, v in extra.items()}


def source_secrets(source: SourceConfig) -> tuple[str, ...]:
    """What every message of a source masks: the key, a password in the URL, and any extra
    header value long enough to be a credential (an upstream may echo request headers)."""
    try:
        password = urlsplit(source.base_url).password or ""
    except ValueError:  # an unparsable URL: the engine reports it
        password = ""
    values = (source.api_key_value(), password, *option_headers(source).values())
    return tuple(value for value in values if len(value) >= _MIN_SECRET_CHARS)


def engine_for_source(
    source: SourceConfig, headers: Mapping[str, str], secret: Secrets
) -> HttpEngine:
    """The HTTP engine of a source from its options (``engine``, ``read_timeout_s``,
    ``max_connections``, ``keepalive_s``, ``trust_env``) and ``max_response_bytes``, sending
    ``headers`` (plus the encodings the engines' BodyReader decodes itself) on every request;
    ``secret`` (see ``source_secrets``) is masked out of every error it raises."""
    options = source.options
    trust_env = option_bool(options, "trust_env", False, source.name)
    chosen = options.get("engine")
    engine_name = (
        default_engine(trust_env=trust_env) if chosen is None else str(chosen).strip().lower()
    )
    try:
        user = urlsplit(source.base_url).username
    except ValueError:  # an unparsable URL: the engine reports it
        user = None
    if user is not None and engine_name == "httpx-aiohttp":
        # httpx turns them into a header and hands aiohttp both: aiohttp refuses the pair.
        raise ConfigError(
            f"source {source.name!r}: engine 'httpx-aiohttp' cannot send credentials given "
            "in base_url (user:password@); put them in options.headers or use another engine"
        )
    pool = engine_options(options, source.name)
    return make_engine(
        engine_name,
        EngineConfig(
            source_name=source.name,
            headers={"Accept-Encoding": ACCEPT_ENCODING, **headers},
            connect_timeout_s=source.connect_timeout_s,
            read_timeout_s=pool.read_timeout_s,
            max_connections=pool.max_connections,
            keepalive_s=pool.keepalive_s,
            trust_env=trust_env,
            secret=secret,
            plain_http=source.base_url.strip().lower().startswith("http://"),
            max_response_bytes=source.max_response_bytes or None,
        ),
    )


@overload
def attempt_liveness(
    source: SourceConfig, *, stream: Literal[True], started: float, monitor: LivenessMonitor
) -> StreamLiveness: ...


@overload
def attempt_liveness(
    source: SourceConfig, *, stream: Literal[False], started: float, monitor: LivenessMonitor
) -> CallDeadline: ...


@overload
def attempt_liveness(
    source: SourceConfig, *, stream: bool, started: float, monitor: LivenessMonitor
) -> StreamLiveness | CallDeadline: ...


def attempt_liveness(
    source: SourceConfig, *, stream: bool, started: float, monitor: LivenessMonitor
) -> StreamLiveness | CallDeadline:
    """The deadlines of one attempt: TTFT, inter-token and total for a stream; only the total
    for a non-streaming call (it bounds the request and reading the answer, and reports
    itself as ``no_complete_answer``)."""
    if stream:
        return StreamLiveness(
            ttft_s=source.ttft_timeout_s,
            inter_token_s=source.inter_token_timeout_s,
            total_s=source.timeout_s,
            started_at=started,
            source_name=source.name,
            monitor=monitor,
        )
    return CallDeadline(source.timeout_s, started, monitor, source.name, no_complete_answer)


def monitor_for_loop(
    current: LivenessMonitor | None, loop: asyncio.AbstractEventLoop
) -> LivenessMonitor:
    """``current`` when it runs on ``loop``, else a new monitor (the old one closed): a
    transport keeps one monitor (one timer) for all its streams of one event loop."""
    if current is not None and current.loop is loop:
        return current
    if current is not None:
        current.close()
    return LivenessMonitor()


async def read_json_body(response: EngineResponse, first: bytes = b"") -> JsonBodyParser:
    """The rest of the body (after ``first``, already read) fed to a ``JsonBodyParser`` as it
    arrives: a large body is parsed a chunk at a time, never in one step that stops the loop.
    Call ``result()`` on what it returns (``ValueError`` when the body is not JSON)."""
    parser = JsonBodyParser()
    parser.feed(first)
    read_chunk = response.read_chunk
    at_eof = response.at_eof
    while chunk := await read_chunk():
        parser.feed(chunk)
        if at_eof():  # known to be the end: no read just to be told so
            break
    if parser.heavy:  # mostly structure: parsed in a thread that lets the loop run
        await asyncio.to_thread(parser.finish)
    return parser


async def drain_response(response: EngineResponse) -> None:
    """Read the (normally empty) rest after ``[DONE]`` so the connection can be reused."""
    drained = 0
    timeout = asyncio.timeout(DRAIN_GRACE_S)
    try:
        async with timeout:
            while drained < DRAIN_LIMIT:
                chunk = await response.read_chunk()
                if not chunk:
                    return
                drained += len(chunk)
    except TimeoutError:
        if not timeout.expired():
            raise
    except TransientError:
        pass  # the answer is complete; a broken tail only costs this connection


def _stream_parser(source: SourceConfig, profile: ProviderProfile | None) -> ChatStreamParser:
    if profile is None:
        return ChatStreamParser(source_name=source.name)
    return ChatStreamParser(
        reasoning_fields=profile.reasoning_fields,
        think_tags=profile.think_tags,
        source_name=source.name,
        error_rules=profile.error_rules,
    )


def transport_result(
    completion: ParsedCompletion,
    *,
    complete: bool,
    request: ChatRequest,
    source: SourceConfig,
    latency_s: float,
    ttft_ms: float | None,
    max_inter_token_ms: float | None,
    end_marker: str = "[DONE]",
) -> TransportResult:
    """The stream outcome rules of the module docstring, shared by every chat transport:
    ``complete`` says whether the stream's end marker (``end_marker``, named in the error)
    arrived. ``TransientError`` for an early EOF, a cut stream (unless salvaged) or an empty
    completion; tokens estimated when no usage was reported."""
    content = completion.content
    estimated = False
    salvaged = False
    if not complete and completion.finish_reason is not None:
        # Callers get here only on a clean end of body (a reset raises on the way): with the
        # finish_reason in hand only the end marker is missing, and the answer is whole.
        complete = True
    if not complete:
        if not content:
            raise TransientError(
                f"source {source.name!r}: stream ended before any content (early EOF)",
                source_name=source.name,
            )
        if source.missing_done != "salvage":
            raise TransientError(
                f"source {source.name!r}: stream ended without {end_marker}; the answer may "
                "be truncated",
                source_name=source.name,
            )
        # Salvaged: possibly truncated (never cached), and whatever usage arrived may not
        # cover the answer.
        salvaged = estimated = True
    elif not content and not completion.has_tool_calls:
        if completion.finish_reason == "content_filter":
            # The filter's verdict, not a fault: another attempt here gets the same one.
            raise ContentFilterError(
                f"source {source.name!r}: the answer was withheld by the content filter "
                "(finish_reason=content_filter)",
                source_name=source.name,
            )
        raise EmptyCompletionError(
            f"source {source.name!r}: empty completion (finish_reason={completion.finish_reason})",
            source_name=source.name,
        )
    prompt_tokens = completion.prompt_tokens
    completion_tokens = completion.completion_tokens
    if prompt_tokens is None or completion_tokens is None:
        estimated = True
        prompt_tokens = estimate_prompt_tokens(request.messages, request.context)
        completion_tokens = estimate_completion_tokens(content, completion.thinking)
    # Positional, in the field order (once per attempt; a test gives every field its own value).
    return TransportResult(
        content,
        completion.thinking,
        completion.model or source.model,
        prompt_tokens,
        completion_tokens,
        "estimated" if estimated else "measured",
        int(latency_s * 1000),
        ttft_ms,
        max_inter_token_ms,
        completion.finish_reason,
        salvaged,
        completion.cached_tokens,
        completion.cache_write_tokens,
        completion.tool_calls,
    )


# --------------------------------------------------------------------------- transport


class OpenAICompatTransport:
    """``Transport`` for OpenAI-compatible chat completions (one instance per source).

    The engine (URL, key, connection pool) is bound to the source given here; ``send`` reads
    the per-attempt settings (model, timeouts, thinking, ``missing_done``) from its ``source``.
    """

    def __init__(
        self, source: SourceConfig, *, providers: Mapping[str, ProviderProfile] | None = None
    ) -> None:
        base_url = source.base_url.strip().rstrip("/")
        if not base_url:
            raise ConfigError(f"source {source.name!r}: base_url is empty")
        self._url = f"{base_url}/chat/completions"
        self._providers: Mapping[str, ProviderProfile] = (
            dict(providers) if providers is not None else builtin_profiles_by_name()
        )
        headers = {"Content-Type": "application/json", **option_headers(source)}
        key = source.api_key_value()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._secret = source_secrets(source)
        self._engine: HttpEngine = engine_for_source(source, headers, self._secret)
        self._warned_thinking: set[str] = set()
        self._monitor: LivenessMonitor | None = None

    @property
    def engine(self) -> HttpEngine:
        return self._engine

    @property
    def url(self) -> str:
        return self._url

    @property
    def open_streams(self) -> int:
        """Streams currently under this transport's liveness deadlines."""
        return self._monitor.open_streams if self._monitor is not None else 0

    def _profile(self, source: SourceConfig) -> ProviderProfile | None:
        profile = self._providers.get(source.provider)
        if (
            source.enable_thinking is not None
            and (profile is None or profile.thinking_body is None)
            and source.provider not in self._warned_thinking
        ):
            self._warned_thinking.add(source.provider)
            logger.warning(
                "source %r: provider %r declares no thinking parameter; enable_thinking=%s is "
                "not sent (register a provider profile to send one)",
                source.name,
                source.provider,
                source.enable_thinking,
            )
        return profile

    async def send(
        self, request: ChatRequest, source: SourceConfig, *, call_id: str
    ) -> TransportResult:
        profile = self._profile(source)
        payload = build_request_body(request, source, profile)
        try:
            body = json_dumps(payload)
        except TypeError as exc:
            # orjson's error names no place: name the message and part when it is their text.
            reject_lone_surrogates(request.messages)
            raise RequestRejectedError(
                f"request body is not JSON serialisable: {exc}", source_name=source.name
            ) from exc
        del payload  # not held while the request is out: one object less per call in flight
        if request.stream:
            return await self._send_stream(body, request, source, profile, call_id)
        # Not streaming: the request and its reads are awaited here, not in a coroutine of
        # their own. One frame less on the stack of every call in flight, which the collector
        # walks: no gain at c=64, 653.5k -> 649.0k instructions a call at c=1024 together
        # with chat's dropped parameters (tools/bench/RESULTS.md, "2026-12-06 (late)").
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = attempt_liveness(
            source, stream=False, started=started, monitor=self._liveness_monitor(loop)
        )
        response: EngineResponse | None = None
        try:
            with deadline:
                response = await self._engine.post(self._url, body)
                if not 200 <= response.status < 300:
                    await self._raise_status_error(response, source, profile)
                parsed = await read_json_body(response)
        finally:
            deadline.close()
            if response is not None:
                await response.aclose()
        completion = self._parse_json(parsed, source, profile)
        return transport_result(
            completion,
            complete=True,
            request=request,
            source=source,
            latency_s=loop.time() - started,
            ttft_ms=None,
            max_inter_token_ms=None,
        )

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        await self._engine.aclose()

    def _liveness_monitor(self, loop: asyncio.AbstractEventLoop) -> LivenessMonitor:
        """The deadline monitor of this transport's streams on ``loop`` (one timer for all)."""
        monitor = self._monitor = monitor_for_loop(self._monitor, loop)
        return monitor

    # ------------------------------------------------------------------ streaming

    async def _send_stream(
        self,
        body: bytes,
        request: ChatRequest,
        source: SourceConfig,
        profile: ProviderProfile | None,
        call_id: str = "",
    ) -> TransportResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Every wait (headers, each body read) runs under the stream's deadlines; a received
        # chunk that carried a delta is a token.
        liveness = attempt_liveness(
            source, stream=True, started=started, monitor=self._liveness_monitor(loop)
        )
        response: EngineResponse | None = None
        completion: ParsedCompletion | None = None
        try:
            with liveness:
                response = await self._engine.post(self._url, body)
                if not 200 <= response.status < 300:
                    await self._raise_status_error(response, source, profile)
            read_chunk = response.read_chunk
            chunk = b""
            content_type = response.headers.get("content-type", "")
            if "json" in content_type and "event-stream" not in content_type:
                with liveness:
                    chunk = await read_chunk()
                if chunk.lstrip()[:1] == b"{":
                    # Some gateways ignore stream=true and answer a plain completion.
                    with liveness:
                        parsed = await read_json_body(response, chunk)
                    completion = self._parse_json(parsed, source, profile)
                    liveness.token()
                # Otherwise labelled JSON but not a JSON object: read it as the stream it
                # probably is.
            if completion is None:
                # Made once the headers are in, not before the request: calls admitted
                # together (a Redis batch) then allocate less in the same turn of the loop,
                # which the garbage collector counts as one wave.
                parser = _stream_parser(source, profile)
                tap = DeltaTap.for_request(
                    request,
                    call_id,
                    content=parser.content_parts,
                    thinking=parser.thinking_parts,
                    calls=parser.tools.calls,
                )
                await self._read_events(chunk, response, parser, liveness, tap)
                if parser.done and not response.at_eof():
                    await drain_response(response)
        finally:
            liveness.close()
            if response is not None:
                await response.aclose()
        if completion is not None:  # the upstream answered JSON to a stream request
            complete = True
        else:
            completion, complete = parser.result(), parser.done
        return transport_result(
            completion,
            complete=complete,
            request=request,
            source=source,
            latency_s=loop.time() - started,
            ttft_ms=liveness.ttft_ms,
            max_inter_token_ms=liveness.max_inter_token_ms,
        )

    async def _read_events(
        self,
        chunk: bytes,
        response: EngineResponse,
        parser: ChatStreamParser,
        liveness: StreamLiveness,
        tap: DeltaTap | None = None,
    ) -> None:
        """Feed the body to ``parser`` up to ``[DONE]`` or the end of the body, starting with
        ``chunk`` (already read, may be empty)."""
        decoder = SSEDecoder()
        feed = parser.feed_events
        read_chunk = response.read_chunk
        try:
            while True:
                if not chunk:
                    with liveness:
                        chunk = await read_chunk()
                    if not chunk:
                        feed(decoder.flush())
                        return
                if feed(decoder.feed(chunk)):
                    liveness.token()
                    if tap is not None:  # GatewayClient.stream: hand the new deltas on
                        tap.flush()
                if parser.done:
                    return
                chunk = b""
        except SSEProtocolError as exc:
            raise TransientError(f"{exc}", source_name=parser.source_name) from exc

    async def _raise_status_error(
        self, response: EngineResponse, source: SourceConfig, profile: ProviderProfile | None
    ) -> None:
        """The error class of a non-2xx answer (ARCHITECTURE §6.2), read from its status,
        headers and the start of its body, with the provider profile's error rules."""
        raise error_for_status(
            response.status,
            await response.read(ERROR_BODY_LIMIT),
            response.headers,
            source_name=source.name,
            secret=self._secret,
            rules=profile.error_rules if profile is not None else (),
        )

    # ------------------------------------------------------------------ non-streaming body

    def _parse_json(
        self, parsed: JsonBodyParser, source: SourceConfig, profile: ProviderProfile | None
    ) -> ParsedCompletion:
        try:
            payload = parsed.result()
        except ValueError:
            error = TransientError(
                f"source {source.name!r}: malformed completion body (not JSON): "
                f"{sanitize_message(repr(parsed.head), self._secret)}",
                source_name=source.name,
            )
        else:
            return self._completion(payload, source, profile)
        raise error  # outside the handler: the decoder's error (it holds the body) is left out

    def _completion(
        self, payload: Any, source: SourceConfig, profile: ProviderProfile | None
    ) -> ParsedCompletion:
        if profile is not None:
            return parse_completion(
                payload,
                reasoning_fields=profile.reasoning_fields,
                think_tags=profile.think_tags,
                source_name=source.name,
                error_rules=profile.error_rules,
            )
        return parse_completion(payload, source_name=source.name)

    # ------------------------------------------------------------------ outcome


__all__ = [
    "OpenAICompatTransport",
    "attempt_liveness",
    "build_request_body",
    "drain_response",
    "engine_for_source",
    "estimate_completion_tokens",
    "estimate_prompt_tokens",
    "json_dumps",
    "monitor_for_loop",
    "no_complete_answer",
    "option_bool",
    "option_float",
    "option_headers",
    "read_json_body",
    "source_secrets",
    "transport_result",
]
