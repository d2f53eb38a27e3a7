"""THE telemetry row builder, for every call kind (ARCHITECTURE §7.8; the single-helper rule).

One attempt, cache hit or call refused before any attempt is one ``TelemetryRecord``. Rows of
every call kind are built here, so the 18 fields mean the same thing everywhere; kinds differ
only in what ``messages`` (the request) and ``response`` (the answer) summarise:

- chat: the canonical messages JSON (multimodal parts digested) and the completion text;
- embeddings, OCR (written by their clients): e.g. a JSON list of input digests and a short
  description of the result (``"3 vectors x 1024"``, the recognised text).

A successful outcome is anything with the attributes of ``RowSummary``: ``LLMResponse`` has
them; other call kinds pass an ``AttemptSummary``. A failed one is the exception.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from polygateway.ports import Pricing
from polygateway.settings import SourceConfig
from polygateway.types import TelemetryRecord, UsageSource

__all__ = ["CANCELLED", "AttemptSummary", "RowSummary", "build_record", "error_name"]

CANCELLED = "cancelled"
"""The ``error`` of a row whose attempt (or call) was cancelled."""


class RowSummary(Protocol):
    """What a row reads of a successful outcome (``LLMResponse`` and ``AttemptSummary``)."""

    @property
    def content(self) -> str:
        """The ``response`` column."""
        ...

    @property
    def thinking(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def provider(self) -> str: ...

    @property
    def source_name(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def usage_source(self) -> UsageSource: ...

    @property
    def latency_ms(self) -> int: ...

    @property
    def ttft_ms(self) -> float | None: ...

    @property
    def max_inter_token_ms(self) -> float | None: ...

    @property
    def cache_hit(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class AttemptSummary:
    """A ``RowSummary`` for call kinds without an ``LLMResponse`` (embeddings, OCR, ...).

    Empty ``model``/``provider``/``source_name`` fall back to the attempt's source; a
    ``latency_ms`` of 0 to the latency the governor measured.
    """

    content: str = ""
    model: str = ""
    provider: str = ""
    source_name: str = ""
    thinking: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_source: UsageSource = "measured"
    latency_ms: int = 0
    ttft_ms: float | None = None
    max_inter_token_ms: float | None = None
    cache_hit: bool = False


def error_name(outcome: BaseException) -> str:
    """The ``error`` column: the exception class name, or ``"cancelled"``."""
    if isinstance(outcome, asyncio.CancelledError):
        return CANCELLED
    return type(outcome).__name__


def build_record(
    outcome: RowSummary | BaseException,
    *,
    call_id: str,
    parent_call_id: str | None,
    session_id: str | None,
    messages: str,
    latency_ms: int,
    created_at: float,
    pricing: Pricing | None = None,
    source: SourceConfig | None = None,
) -> TelemetryRecord:
    """One row from what became of one attempt (or cache hit, or refused call).

    ``source`` is the source the attempt went to (``None`` for cache hits and for errors
    raised before any attempt); ``messages`` is the request's summary. Cost: ``0.0`` for a
    cache hit; otherwise ``pricing.cost`` of the source's configured model (``None`` without
    pricing, for an unknown model, or when no model is known).
    """
    source_model = source.model if source is not None else ""
    if not isinstance(outcome, BaseException):
        model = outcome.model or source_model
        prompt_tokens = outcome.prompt_tokens
        completion_tokens = outcome.completion_tokens
        cache_hit = outcome.cache_hit
        if cache_hit:
            cost: float | None = 0.0
        elif pricing is not None and (source_model or model):
            cost = pricing.cost(source_model or model, prompt_tokens, completion_tokens)
        else:
            cost = None
        # Positional, in field order: keywords cost a third more on this per-attempt path.
        return TelemetryRecord(
            call_id,
            parent_call_id,
            session_id,
            model,
            outcome.provider or (source.provider if source is not None else ""),  # provider
            outcome.source_name or (source.name if source is not None else ""),  # source_name
            messages,
            outcome.content,  # response
            outcome.thinking,
            prompt_tokens,
            completion_tokens,
            outcome.usage_source,
            # latency_ms: the outcome's own, so the row and what the caller saw agree.
            0 if cache_hit else (outcome.latency_ms or latency_ms),
            None if cache_hit else outcome.ttft_ms,
            None if cache_hit else outcome.max_inter_token_ms,
            cache_hit,
            None,  # error
            cost,
            created_at,
        )
    # A failed attempt: the upstream's usage is unknown, so tokens are 0 and marked estimated.
    return TelemetryRecord(
        call_id=call_id,
        parent_call_id=parent_call_id,
        session_id=session_id,
        model=source_model,
        provider=source.provider if source is not None else "",
        source_name=source.name if source is not None else "",
        messages=messages,
        response="",
        thinking="",
        prompt_tokens=0,
        completion_tokens=0,
        usage_source="estimated",
        latency_ms=latency_ms,
        ttft_ms=None,
        max_inter_token_ms=None,
        cache_hit=False,
        error=error_name(outcome),
        cost=pricing.cost(source_model, 0, 0) if pricing is not None and source_model else None,
        created_at=created_at,
    )
