"""The ``openai-compat`` embedding transport: ``POST {base_url}/embeddings`` for one batch.

It posts through the same HTTP engine as the core's chat transport (``engine_for_source``:
engine choice, connection pool, body caps, no redirects followed; the key, a URL password and
credential-like extra headers masked out of every error, ``source_secrets``) and
translates failures with the same table (``polygateway.transports.errors.error_for_status``):
401/402/403/404/3xx and quota codes -> ``SourceDeadError``, 429/5xx/408 -> ``TransientError``,
400 and other 4xx -> ``RequestRejectedError``; connection faults and the source's total
``timeout_s`` (the deadline of a non-streaming chat call) -> ``TransientError``. A 200 answer
that is not a JSON object, or carries an error object, is a ``TransientError`` (as for chat);
usable JSON with unusable content (see
``pgw_embedding.vectors``) is a ``ResultInvalidError``.

Request: ``model``, ``input`` (the batch), ``encoding_format`` (``base64`` unless the source
option says ``float``), ``dimensions`` when the source option is set. Answers in either
encoding are accepted (some servers ignore ``base64`` and send floats) and put back in input
order by ``index``. Usage: ``usage.prompt_tokens`` when reported (``measured``), else about 4
characters per token (``estimated``). No retries, limits or breaker here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from polygateway.errors import ConfigError, TransientError
from polygateway.settings import SourceConfig
from polygateway.streaming import LivenessMonitor
from polygateway.transports.engines import EngineResponse, HttpEngine
from polygateway.transports.errors import (
    error_for_status,
    error_for_stream_event,
    sanitize_message,
)
from polygateway.transports.openai_chunks import json_loads
from polygateway.transports.openai_compat import (
    ERROR_BODY_LIMIT,
    attempt_liveness,
    engine_for_source,
    json_dumps,
    monitor_for_loop,
    option_headers,
    source_secrets,
)
from polygateway.types import EmbeddingTransportResult, UsageSource

from pgw_embedding.inputs import encoding_format, estimate_tokens, option_int
from pgw_embedding.vectors import vectors_from_data


class OpenAICompatEmbeddingTransport:
    """``EmbeddingTransport`` for OpenAI-compatible ``/embeddings`` (one instance per source).

    The engine (URL, key, pool) and the encoding options are bound to the source given here;
    ``embed`` reads the model and the timeout from its ``source`` argument.
    """

    def __init__(self, source: SourceConfig) -> None:
        base_url = source.base_url.strip().rstrip("/")
        if not base_url:
            raise ConfigError(f"source {source.name!r}: base_url is empty")
        self._url = f"{base_url}/embeddings"
        self._encoding = encoding_format(source.options, source.name)
        self._dimensions = option_int(source.options, "dimensions", source.name)
        headers = {"Content-Type": "application/json", **option_headers(source)}
        if source.api_key:
            headers["Authorization"] = f"Bearer {source.api_key_value()}"
        self._secret = source_secrets(source)
        self._engine: HttpEngine = engine_for_source(source, headers, self._secret)
        self._monitor: LivenessMonitor | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def engine(self) -> HttpEngine:
        return self._engine

    def request_body(self, texts: list[str], source: SourceConfig) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": source.model,
            "input": texts,
            "encoding_format": self._encoding,
        }
        if self._dimensions is not None:
            body["dimensions"] = self._dimensions
        return body

    async def embed(
        self, *, texts: list[str], source: SourceConfig, call_id: str
    ) -> EmbeddingTransportResult:
        body = json_dumps(self.request_body(texts, source))
        loop = asyncio.get_running_loop()
        monitor = self._monitor = monitor_for_loop(self._monitor, loop)
        # The source's total deadline bounds the request and reading the answer.
        deadline = attempt_liveness(source, stream=False, started=loop.time(), monitor=monitor)
        response: EngineResponse | None = None
        try:
            with deadline:
                response = await self._engine.post(self._url, body)
                if not 200 <= response.status < 300:
                    raise error_for_status(
                        response.status,
                        await response.read(ERROR_BODY_LIMIT),
                        response.headers,
                        source_name=source.name,
                        secret=self._secret,
                    )
                raw = await response.read()
        finally:
            deadline.close()
            if response is not None:
                await response.aclose()
        return self._result(raw, texts, source)

    def _result(
        self, raw: bytes, texts: list[str], source: SourceConfig
    ) -> EmbeddingTransportResult:
        try:
            payload = json_loads(raw)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            raise TransientError(
                f"source {source.name!r}: malformed embeddings body (not a JSON object): "
                f"{sanitize_message(repr(raw[:80]), self._secret)}",
                source_name=source.name,
            )
        if payload.get("error") or payload.get("object") == "error":
            raise error_for_stream_event(payload, source_name=source.name, secret=self._secret)
        vectors, dim = vectors_from_data(payload.get("data"), len(texts), source_name=source.name)
        usage = payload.get("usage")
        reported = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        tokens: int
        usage_source: UsageSource
        if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0:
            tokens, usage_source = reported, "measured"
        else:
            tokens, usage_source = estimate_tokens(texts), "estimated"
        model = payload.get("model")
        return EmbeddingTransportResult(
            vectors=vectors,
            dim=dim,
            prompt_tokens=tokens,
            usage_source=usage_source,
            model=model if isinstance(model, str) and model else source.model,
            raw={key: value for key, value in payload.items() if key != "data"},
        )

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        await self._engine.aclose()


__all__ = ["OpenAICompatEmbeddingTransport"]
