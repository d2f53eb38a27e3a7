"""The ``anthropic`` transport: one attempt against the Anthropic Messages API.

Built on the core's HTTP engines, SSE decoder and liveness watchdog (the same ones the
``openai-compat`` transport runs on), not on the ``anthropic`` SDK: see the README for the
measurement behind that choice.

Source options (strings from the environment are accepted): ``engine`` (as openai-compat),
``max_tokens`` (default 4096; the call's ``max_tokens``, or ``max_completion_tokens`` in
``extra_body``, override it per call), ``thinking_budget_tokens`` (default 1024),
``anthropic_version``
(default ``2023-06-01``), ``headers`` (extra request headers, e.g. ``anthropic-beta``),
``trust_env``, ``read_timeout_s``, ``max_connections``, ``keepalive_s``.

Thinking: ``enable_thinking`` on the source sends the provider profile's thinking body
(``anthropic``: ``{"thinking": {"type": "enabled", "budget_tokens": N}}``).

Outcome rules (as openai-compat, with ``message_stop`` in the role of ``[DONE]``): no
``message_stop`` -> ``TransientError`` (or the partial answer with ``missing_done="salvage"``);
no text and no tool call -> ``TransientError`` (empty completion), except a ``refusal`` with no
text, which is a ``RequestRejectedError`` (another attempt gets the same verdict);
``stop_reason: model_context_window_exceeded`` -> ``ContextWindowExceededError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from polygateway.digest import reject_lone_surrogates
from polygateway.errors import ConfigError, RequestRejectedError, TransientError
from polygateway.ports import ProviderProfile
from polygateway.providers import builtin_profiles_by_name
from polygateway.settings import SourceConfig
from polygateway.streaming import LivenessMonitor, StreamLiveness
from polygateway.transports.engines import EngineResponse, HttpEngine
from polygateway.transports.json_body import JsonBodyParser
from polygateway.transports.openai_chunks import DeltaTap, ParsedCompletion
from polygateway.transports.openai_compat import (
    ERROR_BODY_LIMIT,
    attempt_liveness,
    drain_response,
    engine_for_source,
    json_dumps,
    monitor_for_loop,
    option_float,
    option_headers,
    read_json_body,
    source_secrets,
    transport_result,
)
from polygateway.transports.sse import SSEDecoder, SSEProtocolError
from polygateway.types import ChatRequest, TransportResult

from pgw_anthropic.convert import apply_extra_body, apply_params, convert_messages
from pgw_anthropic.errors import ContextWindowExceededError, error_for_response
from pgw_anthropic.parse import FINISH_REASONS, MessageParser, ParsedMessage
from pgw_anthropic.profile import ANTHROPIC_PROFILE, DEFAULT_THINKING_BUDGET

logger = logging.getLogger(__name__)

ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096


def _option_int(options: Mapping[str, Any], key: str, default: int, source: str) -> int:
    value = option_float(options, key, default, source)
    if value is None or value < 1 or value != int(value):
        raise ConfigError(
            f"source {source!r}: option {key!r} must be a whole number >= 1, got {value!r}"
        )
    return int(value)


def build_messages_body(
    request: ChatRequest,
    source: SourceConfig,
    profile: ProviderProfile | None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    thinking_budget: int | None = None,
) -> dict[str, Any]:
    """The Messages API body of one attempt (pure; ``RequestRejectedError`` for bad input)."""
    if not request.messages:
        raise RequestRejectedError("messages must not be empty", source_name=source.name)
    if request.response_format is not None:
        raise RequestRejectedError(
            f"source {source.name!r}: response_format is not supported by the Messages API "
            "(the anthropic profile declares no native schema; use structured='json' or a model)",
            source_name=source.name,
        )
    system, messages = convert_messages(request.messages, source_name=source.name)
    body: dict[str, Any] = {"model": source.model, "max_tokens": max_tokens}
    if system is not None:
        body["system"] = system
    body["messages"] = messages
    body["stream"] = request.stream
    thinking = source.enable_thinking
    if thinking is not None and profile is not None and profile.thinking_body is not None:
        extra = dict(profile.thinking_body(thinking))
        setting = extra.get("thinking")
        if (
            thinking_budget is not None
            and isinstance(setting, Mapping)
            and "budget_tokens" in setting
        ):
            extra["thinking"] = {**setting, "budget_tokens": thinking_budget}
        body.update(extra)
    if request.extra_body:
        apply_extra_body(body, request.extra_body, source_name=source.name)
    params = request.params.over(source.params) if request.params is not None else source.params
    if not params.is_empty():
        apply_params(body, params, source_name=source.name)
    setting = body.get("thinking")
    if isinstance(setting, Mapping) and setting.get("type") == "enabled":
        budget = setting.get("budget_tokens")
        if isinstance(budget, int) and budget >= body["max_tokens"]:
            raise RequestRejectedError(
                f"source {source.name!r}: thinking budget_tokens ({budget}) must be below "
                f"max_tokens ({body['max_tokens']})",
                source_name=source.name,
            )
    return body


class AnthropicTransport:
    """``Transport`` for the Anthropic Messages API (one instance per source)."""

    def __init__(
        self, source: SourceConfig, *, providers: Mapping[str, ProviderProfile] | None = None
    ) -> None:
        base_url = source.base_url.strip().rstrip("/")
        if not base_url:
            raise ConfigError(f"source {source.name!r}: base_url is empty")
        self._url = f"{base_url}/messages"
        profiles = dict(providers) if providers is not None else builtin_profiles_by_name()
        profiles.setdefault(ANTHROPIC_PROFILE.name, ANTHROPIC_PROFILE)
        self._providers: Mapping[str, ProviderProfile] = profiles
        options = source.options
        self._max_tokens = _option_int(options, "max_tokens", DEFAULT_MAX_TOKENS, source.name)
        self._thinking_budget = (
            _option_int(options, "thinking_budget_tokens", DEFAULT_THINKING_BUDGET, source.name)
            if "thinking_budget_tokens" in options
            else None
        )
        headers = {
            "Content-Type": "application/json",
            "anthropic-version": str(options.get("anthropic_version", ANTHROPIC_VERSION)),
            **option_headers(source),
        }
        key = source.api_key_value()
        if key:
            headers["x-api-key"] = key
        self._secret = source_secrets(source)
        self._engine: HttpEngine = engine_for_source(source, headers, self._secret)
        self._monitor: LivenessMonitor | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def engine(self) -> HttpEngine:
        return self._engine

    def _liveness_monitor(self, loop: asyncio.AbstractEventLoop) -> LivenessMonitor:
        monitor = self._monitor = monitor_for_loop(self._monitor, loop)
        return monitor

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        await self._engine.aclose()

    def body(self, request: ChatRequest, source: SourceConfig) -> dict[str, Any]:
        """The request body this transport sends for ``request`` (for tests and tooling)."""
        return build_messages_body(
            request,
            source,
            self._providers.get(source.provider),
            max_tokens=self._max_tokens,
            thinking_budget=self._thinking_budget,
        )

    async def send(
        self, request: ChatRequest, source: SourceConfig, *, call_id: str
    ) -> TransportResult:
        payload = self.body(request, source)
        try:
            body = json_dumps(payload)
        except TypeError as exc:
            reject_lone_surrogates(request.messages)  # names the message and part
            raise RequestRejectedError(
                f"request body is not JSON serialisable: {exc}", source_name=source.name
            ) from exc
        loop = asyncio.get_running_loop()
        started = loop.time()
        parser = MessageParser(source_name=source.name, secret=self._secret)
        monitor = self._liveness_monitor(loop)
        # A stream's deadlines (TTFT, inter-token, total), or the total one alone.
        streaming = (
            attempt_liveness(source, stream=True, started=started, monitor=monitor)
            if request.stream
            else None
        )
        liveness = (
            streaming
            if streaming is not None
            else attempt_liveness(source, stream=False, started=started, monitor=monitor)
        )
        response: EngineResponse | None = None
        try:
            with liveness:
                response = await self._engine.post(self._url, body)
                if not 200 <= response.status < 300:
                    raise error_for_response(
                        response.status,
                        await response.read(ERROR_BODY_LIMIT),
                        response.headers,
                        source_name=source.name,
                        secret=self._secret,
                    )
                if not request.stream:
                    # Parsed while it arrives: a large body is never one parse on the loop.
                    body_parser = await read_json_body(response)
            if streaming is not None:
                context = request.context
                sink = context.stream if context is not None else None
                tap = None if sink is None else parser.delta_tap(sink, call_id)
                await self._read_events(response, parser, streaming, tap)
            else:
                self._parse_json(body_parser, parser, source)
        finally:
            liveness.close()
            if response is not None:
                await response.aclose()
        return self._result(
            parser.result(),
            complete=parser.done,
            request=request,
            source=source,
            latency_s=loop.time() - started,
            ttft_ms=streaming.ttft_ms if streaming is not None else None,
            max_inter_token_ms=streaming.max_inter_token_ms if streaming is not None else None,
        )

    async def _read_events(
        self,
        response: EngineResponse,
        parser: MessageParser,
        liveness: StreamLiveness,
        tap: DeltaTap | None = None,
    ) -> None:
        decoder = SSEDecoder()
        read_chunk = response.read_chunk
        try:
            while not parser.done:
                with liveness:
                    chunk = await read_chunk()
                if not chunk:
                    parser.feed_events(decoder.flush())
                    return
                if parser.feed_events(decoder.feed(chunk)):
                    liveness.token()
                    if tap is not None:  # GatewayClient.stream: hand the new deltas on
                        tap.flush()
            if not response.at_eof():
                await drain_response(response)
        except SSEProtocolError as exc:
            raise TransientError(f"{exc}", source_name=parser.source_name) from exc

    def _parse_json(
        self, body: JsonBodyParser, parser: MessageParser, source: SourceConfig
    ) -> None:
        try:
            payload = body.result()
        except ValueError:
            raise TransientError(
                f"source {source.name!r}: malformed message body (not JSON)",
                source_name=source.name,
            ) from None
        parser.feed_message(payload)

    def _result(
        self,
        message: ParsedMessage,
        *,
        complete: bool,
        request: ChatRequest,
        source: SourceConfig,
        latency_s: float,
        ttft_ms: float | None,
        max_inter_token_ms: float | None,
    ) -> TransportResult:
        content = message.content
        stop = message.stop_reason
        where = f"source {source.name!r}"
        if stop == "model_context_window_exceeded":
            raise ContextWindowExceededError(
                f"{where}: the request exceeds the model's context window "
                "(stop_reason=model_context_window_exceeded)",
                source_name=source.name,
            )
        if complete and not content and not message.has_tool_calls and stop == "refusal":
            raise RequestRejectedError(
                f"{where}: the model refused to answer (stop_reason=refusal)",
                source_name=source.name,
            )
        cache_read, cache_write = message.cache_read_tokens, message.cache_write_tokens
        prompt = message.input_tokens
        completion = ParsedCompletion(
            content=content,
            thinking=message.thinking,
            finish_reason=FINISH_REASONS.get(stop, stop) if stop is not None else None,
            # input_tokens excludes the cache reads and writes: the prompt is all three.
            prompt_tokens=None if prompt is None else prompt + cache_read + cache_write,
            completion_tokens=message.output_tokens,
            model=message.model,
            has_tool_calls=message.has_tool_calls,
            cached_tokens=cache_read,
            cache_write_tokens=cache_write,
            tool_calls=message.tool_calls,
        )
        return transport_result(
            completion,
            complete=complete,
            request=request,
            source=source,
            latency_s=latency_s,
            ttft_ms=ttft_ms,
            max_inter_token_ms=max_inter_token_ms,
            end_marker="message_stop",
        )


__all__ = ["ANTHROPIC_VERSION", "DEFAULT_MAX_TOKENS", "AnthropicTransport", "build_messages_body"]
