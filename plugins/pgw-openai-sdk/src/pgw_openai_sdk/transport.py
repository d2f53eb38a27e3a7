"""The ``openai-sdk`` transport: one attempt through the official ``AsyncOpenAI`` client.

The SDK's own retries are off (``max_retries=0``: the governance owns every retry); the HTTP
timeouts come from the source (``connect_timeout_s``; ``read_timeout_s`` option, off by
default) and the liveness watchdog (TTFT, inter-token, total) wraps every wait, the SDK's
chunk iterator included. The request body is the openai-compat body: ``model``, ``messages``
and ``stream`` as arguments, everything else (``stream_options``, ``response_format``, the
provider profile's thinking fields, the caller's ``extra_body``) through the SDK's
``extra_body``. Reasoning is read from the chunks' ``model_extra`` (the profile's
``reasoning_fields``), then inline think tags. SDK exceptions become the error classes through
the same helpers openai-compat uses, so both classify every upstream answer alike.

What the SDK cannot see: its iterator stops at ``[DONE]`` and also ends quietly when the body
ends without it. This transport therefore takes a ``finish_reason`` as the end of the answer:
a stream cut before the finish chunk is a ``TransientError`` (or salvaged, as openai-compat);
a stream cut after the finish chunk but before the usage chunk and ``[DONE]`` is accepted with
estimated usage, where openai-compat reports the missing ``[DONE]`` (see the README).

Source options: ``engine`` (the SDK's HTTP client: ``httpx2``, its default, or ``aiohttp``,
its aiohttp client; ``{SCOPE}__{P}__{N}__ENGINE``), ``trust_env`` (default false),
``read_timeout_s``, ``max_connections`` (default 1024), ``keepalive_s`` (default 15),
``headers``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx2
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from polygateway.digest import reject_lone_surrogates
from polygateway.errors import (
    ConfigError,
    PolyGatewayError,
    RequestRejectedError,
    SourceDeadError,
    TransientError,
)
from polygateway.ports import ProviderProfile
from polygateway.providers import builtin_profiles_by_name
from polygateway.settings import SourceConfig
from polygateway.streaming import LivenessMonitor
from polygateway.transports.engine_options import engine_options
from polygateway.transports.errors import (
    error_for_status,
    error_for_stream_event,
    sanitize_message,
    wire_error,
)
from polygateway.transports.openai_chunks import (
    DeltaTap,
    ParsedCompletion,
    ToolCallAssembler,
    tool_calls_of,
)
from polygateway.transports.openai_compat import (
    attempt_liveness,
    build_request_body,
    monitor_for_loop,
    option_bool,
    option_headers,
    source_secrets,
    transport_result,
)
from polygateway.transports.think_tags import ThinkTagSplitter, split_think
from polygateway.types import ChatRequest, TransportResult

logger = logging.getLogger(__name__)

HTTP_CLIENTS = ("httpx2", "aiohttp")

_DEFAULT_REASONING = ("reasoning_content", "reasoning")
_DEFAULT_TAGS = (("<think>", "</think>"),)

# The body fields passed to ``create`` by name; every other field goes through extra_body.
_NAMED = frozenset(("model", "messages", "stream"))


def _extra(model: Any) -> Mapping[str, Any]:
    """Fields the SDK's types do not declare (``model_extra``; ``{}`` when none)."""
    extra = getattr(model, "model_extra", None)
    return extra if isinstance(extra, Mapping) else {}


def _reasoning(extra: Mapping[str, Any], fields: tuple[str, ...]) -> str:
    for name in fields:
        value = extra.get(name)
        if value and isinstance(value, str):
            return value
    return ""


def _cache_tokens(usage: Any) -> tuple[int, int]:
    """``(cached, cache_written)`` prompt tokens from ``prompt_tokens_details``."""
    details = getattr(usage, "prompt_tokens_details", None)
    if details is None:
        return 0, 0
    cached = getattr(details, "cached_tokens", None)
    written = _extra(details).get("cache_write_tokens")
    return (
        cached if isinstance(cached, int) and cached > 0 else 0,
        written if isinstance(written, int) and written > 0 else 0,
    )


class _StreamState:
    """What the chunks of one stream said so far."""

    __slots__ = (
        "cache",
        "completion_tokens",
        "finish_reason",
        "has_tool_calls",
        "model",
        "prompt_tokens",
        "splitter",
        "tools",
    )

    def __init__(self, tags: tuple[tuple[str, str], ...]) -> None:
        # Reasoning fields and inline think tags both land in the splitter's thinking, in
        # arrival order (as the core parser does), where the delta tap reads them.
        self.splitter = ThinkTagSplitter(tags)
        self.model = ""
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cache = (0, 0)
        self.has_tool_calls = False
        self.tools = ToolCallAssembler()


class OpenAISDKTransport:
    """``Transport`` on ``openai.AsyncOpenAI`` (one client per source and event loop)."""

    def __init__(
        self, source: SourceConfig, *, providers: Mapping[str, ProviderProfile] | None = None
    ) -> None:
        base_url = source.base_url.strip().rstrip("/")
        if not base_url:
            raise ConfigError(f"source {source.name!r}: base_url is empty")
        self._base_url = base_url
        self._providers: Mapping[str, ProviderProfile] = (
            dict(providers) if providers is not None else builtin_profiles_by_name()
        )
        profile = self._providers.get(source.provider)
        self._rules = profile.error_rules if profile is not None else ()
        options = source.options
        self._http_client = str(options.get("engine", "httpx2")).strip().lower()
        if self._http_client not in HTTP_CLIENTS:
            raise ConfigError(
                f"source {source.name!r}: engine {self._http_client!r} is not an HTTP client "
                f"of the openai SDK; choose one of {', '.join(HTTP_CLIENTS)}"
            )
        self._headers = option_headers(source)
        self._key = source.api_key_value()
        self._secret = source_secrets(source)
        pool = engine_options(options, source.name)
        read_timeout = pool.read_timeout_s
        self._timeout = httpx2.Timeout(
            connect=source.connect_timeout_s,
            read=read_timeout,
            write=read_timeout,
            pool=source.connect_timeout_s,
        )
        connections = pool.max_connections
        self._limits = httpx2.Limits(
            max_connections=connections or None,
            max_keepalive_connections=connections or None,
            keepalive_expiry=pool.keepalive_s,
        )
        self._trust_env = option_bool(options, "trust_env", False, source.name)
        self._source_name = source.name
        self._client: openai.AsyncOpenAI | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._monitor: LivenessMonitor | None = None

    # ------------------------------------------------------------------ client

    def _new_client(self) -> openai.AsyncOpenAI:
        http_client: httpx2.AsyncClient
        settings: dict[str, Any] = {
            "timeout": self._timeout,
            "limits": self._limits,
            # Redirects are not followed: a 3xx means a wrong base_url (openai-compat alike).
            "follow_redirects": False,
            "trust_env": self._trust_env,
        }
        if self._http_client == "aiohttp":
            http_client = openai.DefaultAioHttpClient(**settings)
        else:
            http_client = openai.DefaultAsyncHttpxClient(**settings)
        return openai.AsyncOpenAI(
            # The SDK insists on a key; a keyless local endpoint gets a placeholder.
            api_key=self._key or "no-key",
            base_url=self._base_url,
            max_retries=0,  # the governance owns retries and backoff
            timeout=self._timeout,
            default_headers=self._headers or None,
            http_client=http_client,
        )

    def _client_for(self, loop: asyncio.AbstractEventLoop) -> openai.AsyncOpenAI:
        client = self._client
        if client is None or self._loop is not loop:
            # A client's connections belong to the loop that opened them.
            client = self._client = self._new_client()
            self._loop = loop
        return client

    @property
    def client(self) -> openai.AsyncOpenAI | None:
        """The live SDK client, once one was made."""
        return self._client

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        client, self._client = self._client, None
        if client is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:  # pragma: no cover - aclose is async, a loop is running
                running = None
            if running is self._loop:
                await client.close()

    # ------------------------------------------------------------------ errors

    def _translate(self, exc: openai.OpenAIError) -> PolyGatewayError:
        """An SDK exception as the error class openai-compat raises for the same answer."""
        name, secret = self._source_name, self._secret
        if isinstance(exc, openai.APIStatusError):
            response = exc.response
            return error_for_status(
                response.status_code,
                response.content,
                response.headers,
                source_name=name,
                secret=secret,
                rules=self._rules,
            )
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__
            if isinstance(cause, (httpx2.UnsupportedProtocol, httpx2.InvalidURL)):
                return SourceDeadError(
                    sanitize_message(f"source {name!r}: unusable URL: {cause}", secret),
                    source_name=name,
                )
            timed_out = isinstance(exc, openai.APITimeoutError)
            return wire_error(
                cause if isinstance(cause, Exception) else exc,
                timeout=timed_out,
                source_name=name,
                secret=secret,
            )
        if isinstance(exc, openai.APIResponseValidationError):
            return TransientError(
                sanitize_message(f"source {name!r}: malformed answer: {exc.message}", secret),
                source_name=name,
            )
        if isinstance(exc, openai.APIError):
            # An error object in the stream (the SDK raises on it, with the object as body).
            body = exc.body if isinstance(exc.body, Mapping) else {"message": exc.message}
            return error_for_stream_event(
                {"error": body}, source_name=name, secret=secret, rules=self._rules
            )
        return TransientError(
            sanitize_message(f"source {name!r}: {type(exc).__name__}: {exc}", secret),
            source_name=name,
        )

    def _malformed(self, exc: Exception) -> TransientError:
        return TransientError(
            sanitize_message(
                f"source {self._source_name!r}: malformed answer (not JSON): {exc}", self._secret
            ),
            source_name=self._source_name,
        )

    # ------------------------------------------------------------------ send

    def _profile(self, source: SourceConfig) -> ProviderProfile | None:
        return self._providers.get(source.provider)

    async def send(
        self, request: ChatRequest, source: SourceConfig, *, call_id: str
    ) -> TransportResult:
        profile = self._profile(source)
        body = build_request_body(request, source, profile)
        extra = {k: v for k, v in body.items() if k not in _NAMED}
        loop = asyncio.get_running_loop()
        client = self._client_for(loop)
        monitor = self._monitor = monitor_for_loop(self._monitor, loop)
        started = loop.time()
        reasoning = profile.reasoning_fields if profile is not None else _DEFAULT_REASONING
        tags = profile.think_tags if profile is not None else _DEFAULT_TAGS
        try:
            if request.stream:
                return await self._send_stream(
                    client,
                    body,
                    extra,
                    request,
                    source,
                    monitor,
                    started,
                    reasoning,
                    tags,
                    call_id,
                )
            return await self._send_json(
                client, body, extra, request, source, monitor, started, reasoning, tags
            )
        except openai.OpenAIError as exc:
            raise self._translate(exc) from exc
        except (TypeError, UnicodeEncodeError) as exc:  # the SDK could not serialise the body
            reject_lone_surrogates(request.messages)  # then name the message and part
            raise RequestRejectedError(
                f"request body is not JSON serialisable: {exc}", source_name=source.name
            ) from exc

    async def _send_stream(
        self,
        client: openai.AsyncOpenAI,
        body: Mapping[str, Any],
        extra: dict[str, Any],
        request: ChatRequest,
        source: SourceConfig,
        monitor: LivenessMonitor,
        started: float,
        reasoning: tuple[str, ...],
        tags: tuple[tuple[str, str], ...],
        call_id: str,
    ) -> TransportResult:
        liveness = attempt_liveness(source, stream=True, started=started, monitor=monitor)
        state = _StreamState(tags)
        # GatewayClient.stream: each chunk's new text is handed on as it arrives.
        tap = DeltaTap.for_request(
            request,
            call_id,
            content=state.splitter.content,
            thinking=state.splitter.thinking,
            calls=state.tools.calls,
        )
        stream: openai.AsyncStream[ChatCompletionChunk] | None = None
        try:
            with liveness:
                stream = await client.chat.completions.create(
                    model=body["model"], messages=body["messages"], stream=True, extra_body=extra
                )
            next_chunk = stream.__anext__
            while True:
                with liveness:
                    try:
                        chunk = await next_chunk()
                    except StopAsyncIteration:
                        break
                    except ValueError as exc:  # a frame that is not JSON
                        raise self._malformed(exc) from exc
                if self._chunk(chunk, state, reasoning):
                    liveness.token()
                    if tap is not None:
                        tap.flush()
        finally:
            liveness.close()
            if stream is not None:
                await stream.close()
        content, thinking = state.splitter.finish()
        cached, written = state.cache
        return transport_result(
            ParsedCompletion(
                content,
                thinking,
                state.finish_reason,
                state.prompt_tokens,
                state.completion_tokens,
                state.model,
                state.has_tool_calls,
                cached,
                written,
                state.tools.result(),
            ),
            # The SDK hides whether [DONE] came: the finish chunk stands for the end.
            complete=state.finish_reason is not None,
            request=request,
            source=source,
            latency_s=asyncio.get_running_loop().time() - started,
            ttft_ms=liveness.ttft_ms,
            max_inter_token_ms=liveness.max_inter_token_ms,
            end_marker="a finish_reason",
        )

    def _chunk(
        self, chunk: ChatCompletionChunk, state: _StreamState, reasoning: tuple[str, ...]
    ) -> bool:
        """One chunk; ``True`` when it carried a token (content, reasoning, a tool call)."""
        # The SDK builds its models without validation: fields hold whatever arrived.
        kind: Any = chunk.object
        if kind == "error":  # a flat vLLM error object (no "error" key to raise on)
            raise error_for_stream_event(
                chunk.model_dump(),
                source_name=self._source_name,
                secret=self._secret,
                rules=self._rules,
            )
        if not state.model and isinstance(chunk.model, str):
            state.model = chunk.model
        usage = chunk.usage
        if usage is not None:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            if isinstance(prompt, int) and isinstance(completion, int):
                state.prompt_tokens, state.completion_tokens = prompt, completion
                state.cache = _cache_tokens(usage)
        choices = chunk.choices
        if not choices:
            return False  # the usage chunk: choices [] / null / missing
        choice = choices[0]
        if choice.index:
            return False  # only the first choice is read
        finish: Any = choice.finish_reason
        if finish:
            if finish == "error":  # OpenRouter's way of failing mid-stream
                raise TransientError(
                    f"source {self._source_name!r}: stream finished with finish_reason=error",
                    source_name=self._source_name,
                )
            state.finish_reason = str(finish)
        delta: Any = getattr(choice, "delta", None)
        if delta is None:
            return False
        token = False
        thought = _reasoning(_extra(delta), reasoning)
        if thought:
            state.splitter.thinking.append(thought)
            token = True
        if delta.tool_calls:
            state.has_tool_calls = True
            # The SDK's fragment objects, as the wire's dicts for the one assembler.
            state.tools.feed([call.model_dump(exclude_none=True) for call in delta.tool_calls])
            token = True
        content = delta.content
        if content and isinstance(content, str):
            state.splitter.feed(content)
            token = True
        return token

    async def _send_json(
        self,
        client: openai.AsyncOpenAI,
        body: Mapping[str, Any],
        extra: dict[str, Any],
        request: ChatRequest,
        source: SourceConfig,
        monitor: LivenessMonitor,
        started: float,
        reasoning: tuple[str, ...],
        tags: tuple[tuple[str, str], ...],
    ) -> TransportResult:
        deadline = attempt_liveness(source, stream=False, started=started, monitor=monitor)
        try:
            with deadline:
                try:
                    answer = await client.chat.completions.create(
                        model=body["model"],
                        messages=body["messages"],
                        stream=False,
                        extra_body=extra,
                    )
                except UnicodeEncodeError:
                    raise  # the request's text, not the answer: refused by send
                except ValueError as exc:  # a body that is not JSON
                    raise self._malformed(exc) from exc
        finally:
            deadline.close()
        return transport_result(
            self._parse_answer(answer, reasoning, tags),
            complete=True,
            request=request,
            source=source,
            latency_s=asyncio.get_running_loop().time() - started,
            ttft_ms=None,
            max_inter_token_ms=None,
        )

    def _parse_answer(
        self,
        answer: ChatCompletion | Any,
        reasoning: tuple[str, ...],
        tags: tuple[tuple[str, str], ...],
    ) -> ParsedCompletion:
        name = self._source_name
        if not isinstance(answer, ChatCompletion):
            raise TransientError(
                f"source {name!r}: malformed completion body (not a JSON object)",
                source_name=name,
            )
        extra = _extra(answer)
        kind: Any = answer.object
        if extra.get("error") or kind == "error":
            raise error_for_stream_event(
                answer.model_dump(), source_name=name, secret=self._secret, rules=self._rules
            )
        choices = getattr(answer, "choices", None)
        if not choices:
            raise TransientError("malformed completion body (no choices)", source_name=name)
        choice = choices[0]
        message = getattr(choice, "message", None)
        if message is None:
            raise TransientError("malformed completion body (no message)", source_name=name)
        thinking = _reasoning(_extra(message), reasoning)
        content = message.content if isinstance(message.content, str) else ""
        if content:
            content, inline = split_think(content, tags)
            thinking += inline
        usage = answer.usage
        prompt = usage.prompt_tokens if usage is not None else None
        completion = usage.completion_tokens if usage is not None else None
        cached, written = _cache_tokens(usage) if usage is not None else (0, 0)
        return ParsedCompletion(
            content,
            thinking,
            str(choice.finish_reason) if choice.finish_reason else None,
            prompt if isinstance(prompt, int) else None,
            completion if isinstance(completion, int) else None,
            answer.model if isinstance(answer.model, str) else "",
            bool(message.tool_calls),
            cached,
            written,
            tool_calls_of(message.model_dump(include={"tool_calls"}, exclude_none=True)),
        )


__all__ = ["HTTP_CLIENTS", "OpenAISDKTransport"]
