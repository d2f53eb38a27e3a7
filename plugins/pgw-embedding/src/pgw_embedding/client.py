"""``EmbeddingClient``: governed embeddings for one scope (M2 §7), on the core's governor.

``await client.embed(texts)`` checks the texts before any request, cuts them into batches of
``{SCOPE}__BATCH_SIZE`` and runs each batch as one full governed call of
``polygateway.governance.Governor`` (source selection, breaker, limiter permit with a TPM
pre-charge estimated from the batch's texts and settled on the measured ``prompt_tokens``,
the error table, backoff and switching, the stall verdict, ``AllSourcesExhausted`` /
``CircuitOpenError``). Batches run one after the other, or ``{SCOPE}__BATCH_CONCURRENCY`` at a
time; the vectors come back in input order either way. The first batch that fails fails the
call: the batches still running are cancelled (their permits and probes released) and those
not started never start.

Merged response (M2 §7.3): vectors concatenated in input order, ``prompt_tokens`` and
``latency_ms`` summed over the batches, ``call_id`` / ``model`` / ``provider`` /
``source_name`` of the first batch, ``usage_source`` ``estimated`` when any batch's usage was,
``cost`` summed when every batch has a price.

Telemetry: one row per attempt of every batch (each attempt its own ``call_id``; the caller's
``session_id`` and ``parent_call_id`` on every row), ``messages`` a short summary of the batch's
texts (count, characters, sha256, the start of the first few), ``response``
``"<vectors n=N dim=D>"``: vectors are never stored; ``completion_tokens`` 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from os import PathLike
from types import TracebackType
from typing import Any

from polygateway.client import gather_bounded
from polygateway.config import CallKind
from polygateway.digest import canonical_json, sha256_hex
from polygateway.errors import ConfigError, ResultInvalidError
from polygateway.governance import Attempted, AttemptObserver, Governor, Outcome
from polygateway.governed import GovernedParts, load_kind_scope
from polygateway.ids import elapsed_ms
from polygateway.ports import (
    Clock,
    EmbeddingTransport,
    Pricing,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
)
from polygateway.records import AttemptRows, AttemptSummary
from polygateway.settings import GatewaySettings, ScopeSettings, SourceConfig
from polygateway.types import EmbeddingResponse, EmbeddingTransportResult

from pgw_embedding.inputs import check_texts, estimate_tokens, max_input_chars, split_batches
from pgw_embedding.vectors import check_dimension, l2_normalize

__all__ = ["EmbeddingClient", "texts_summary"]

logger = logging.getLogger(__name__)

DEFAULT_SCOPE = "EMBED"
EMBEDDING_CALLS = CallKind(transport_kind="embedding_transport", http_engine=True)
"""How the loader reads an embedding scope: its sources name embedding transports, which post
through the core's HTTP engines (so ``EMBED__OPENAI__1__KEEPALIVE_S`` and the other engine
fields are source fields, as for chat)."""
SUMMARY_TEXTS = 3
"""How many texts the ``messages`` summary of a row shows the start of."""
SUMMARY_CHARS = 80
"""How many characters of each of them."""


def texts_summary(texts: Sequence[str]) -> str:
    """The ``messages`` column of an embedding row: never the texts themselves (a batch can be
    megabytes), but enough to find them again: count, characters, the sha256 of their
    canonical JSON and the start of the first few."""
    return canonical_json(
        {
            "texts": len(texts),
            "chars": sum(map(len, texts)),
            "sha256": sha256_hex(canonical_json(list(texts))),
            "head": [text[:SUMMARY_CHARS] for text in texts[:SUMMARY_TEXTS]],
        }
    )


@dataclass(frozen=True, slots=True)
class _Batch:
    """One batch's successful attempt: the transport's result (normalised when asked) and the
    attempt's own latency."""

    result: EmbeddingTransportResult
    latency_ms: int


class _CallDim:
    """The dimension of one ``embed`` call, fixed by its first successful batch: a later
    batch of another dimension (another source, another model) cannot be merged."""

    __slots__ = ("dim",)

    def __init__(self, expected: int | None) -> None:
        self.dim = expected


HEALTH_PROBE_TEXTS: tuple[str, ...] = ("ping",)
"""The background health probe (``{SCOPE}__BREAKER__HEALTH_PROBE``): one short input, the
cheapest request ``/embeddings`` takes (an input is never empty)."""


async def _probe(
    transport: EmbeddingTransport, source: SourceConfig, call_id: str
) -> Attempted[None]:
    """One probe request to ``source``: it answers, or raises what a batch would."""
    try:
        result = await transport.embed(
            texts=list(HEALTH_PROBE_TEXTS), source=source, call_id=call_id
        )
    except ResultInvalidError:
        # Answered, with vectors a call could not use: a bad result, not a bad service
        # (as for a batch, the breaker counts a success).
        return Attempted(None, None)
    measured = result.usage_source == "measured"
    return Attempted(None, result.prompt_tokens if measured else None)


def _summary(batch: _Batch) -> AttemptSummary:
    """What a row says of a successful batch: never the vectors."""
    result = batch.result
    return AttemptSummary(
        content=f"<vectors n={len(result.vectors)} dim={result.dim}>",
        model=result.model,
        prompt_tokens=result.prompt_tokens,
        usage_source=result.usage_source,
        latency_ms=batch.latency_ms,
    )


class EmbeddingClient:
    """Governed embeddings for one scope (``EMBED`` by default).

    Parts passed in (limiter, breaker, selector, telemetry recorder, pricing, transports) stay
    the caller's: pass the same limiter/breaker to several clients to share their gates and
    breaker state. ``aclose()`` closes only what this client built and flushes the recorder.

    :param normalize: L2-normalise every vector (``x / max(norm, 1e-12)``).
    :param expected_dim: refuse batches whose vectors have another dimension
        (``ResultInvalidError``: a bad result, not a bad source; the breaker counts no failure).
    :raises ConfigError: no sources, no ``batch_size``, a failed startup guard, a name no plugin
        registered, or a bad ``expected_dim``.
    """

    __slots__ = (
        "_batch_concurrency",
        "_batch_size",
        "_clock",
        "_expected_dim",
        "_governor",
        "_limit",
        "_normalize",
        "_parts",
        "_pricing",
        "_rows",
        "_settings",
        "_transports",
    )

    def __init__(
        self,
        settings: ScopeSettings,
        *,
        registry: Any = None,
        clock: Clock | None = None,
        limiter: RateLimiter | None = None,
        breaker: ProviderGate | None = None,
        selector: SourceSelector | None = None,
        telemetry: TelemetryRecorder | None = None,
        pricing: Pricing | None = None,
        transports: Mapping[str, EmbeddingTransport] | None = None,
        normalize: bool = False,
        expected_dim: int | None = None,
    ) -> None:
        if not isinstance(settings, ScopeSettings):
            raise TypeError(
                "EmbeddingClient needs the ScopeSettings of one scope; use "
                "EmbeddingClient.from_settings(settings, scope=...) for GatewaySettings"
            )
        scope = settings.scope
        problems = _settings_problems(settings, expected_dim)
        if problems:
            raise ConfigError(problems)
        from polygateway.config import check_guards

        problems = list(check_guards(settings))
        if problems:
            raise ConfigError(problems)
        parts = GovernedParts(
            settings,
            call_kind=EMBEDDING_CALLS,
            registry=registry,
            clock=clock,
            limiter=limiter,
            breaker=breaker,
            selector=selector,
            telemetry=telemetry,
            pricing=pricing,
            transports=transports,
            health_probe=self._health_probe,  # runs only once a source opened, so once built
        )
        self._parts = parts
        self._settings = settings
        self._clock = parts.clock
        self._pricing = parts.pricing
        self._rows = parts.rows
        self._transports: Mapping[str, EmbeddingTransport] = parts.transports
        self._governor = parts.governor
        assert settings.batch_size is not None  # checked by _settings_problems
        self._batch_size = settings.batch_size
        self._batch_concurrency = settings.batch_concurrency
        self._limit = max_input_chars(settings.sources)
        self._normalize = bool(normalize)
        self._expected_dim = expected_dim
        logger.debug("embedding client for scope %r assembled", scope)

    async def _health_probe(self, source: SourceConfig, call_id: str) -> Attempted[None]:
        return await _probe(self._transports[source.name], source, call_id)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(
        cls,
        scope: str = DEFAULT_SCOPE,
        *,
        env: Mapping[str, str] | None = None,
        pipeline_path: str | PathLike[str] | None = None,
        dotenv_path: str | PathLike[str] | None = None,
        registry: Any = None,
        **parts: Any,
    ) -> EmbeddingClient:
        """Build the client of ``scope`` from the environment, ``.env`` and the pipeline file
        (``EMBED__{PROVIDER}__{N}__{FIELD}`` sources, ``EMBED__BATCH_SIZE`` required).

        ``env`` replaces ``os.environ`` (tests); plugins are filtered by ``PGW_PLUGINS``;
        ``parts`` are the constructor's keyword arguments (``limiter=``, ``breaker=``,
        ``telemetry=``, ``normalize=``...).
        """
        settings, registry = load_kind_scope(
            scope,
            call_kind=EMBEDDING_CALLS,
            env=env,
            pipeline_path=pipeline_path,
            dotenv_path=dotenv_path,
            registry=registry,
        )
        return cls(settings, registry=registry, **parts)

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings | ScopeSettings,
        scope: str = DEFAULT_SCOPE,
        **parts: Any,
    ) -> EmbeddingClient:
        """Build the client of ``scope`` from already resolved settings."""
        if isinstance(settings, GatewaySettings):
            settings = settings.scope(scope)
        return cls(settings, **parts)

    # ------------------------------------------------------------------ the call

    async def embed(
        self,
        texts: list[str],
        *,
        session_id: str | None = None,
        parent_call_id: str | None = None,
    ) -> EmbeddingResponse:
        """The vectors of ``texts``, in order: one governed call per batch.

        :raises RequestRejectedError: ``texts`` is not a list of non-empty strings, or holds a
            text longer than a source's ``max_input_chars`` (before any request).
        :raises ResultInvalidError: an answer without usable vectors (empty ``data``, mixed
            lengths) or of another dimension than ``expected_dim`` / the call's other batches.
        """
        if self._parts.closed:
            raise RuntimeError("this EmbeddingClient is closed")
        check_texts(texts, self._limit)
        if not texts:
            return EmbeddingResponse(
                vectors=[],
                dim=self._expected_dim or 0,
                model="",
                provider="",
                prompt_tokens=0,
                usage_source="measured",
                latency_ms=0,
                call_id="",
                source_name="",
                cost=None if self._pricing is None else 0.0,
            )
        call_dim = _CallDim(self._expected_dim)
        batches = split_batches(texts, self._batch_size)
        outcomes = await gather_bounded(
            [
                partial(self._embed_batch, batch, call_dim, session_id, parent_call_id)
                for batch in batches
            ],
            self._batch_concurrency,
        )
        return self._merge(outcomes)

    async def _embed_batch(
        self,
        texts: list[str],
        call_dim: _CallDim,
        session_id: str | None,
        parent_call_id: str | None,
    ) -> Outcome[_Batch]:
        """One batch, one governed call: its rows share a root_call_id of their own (a batch
        is answered or fails by itself)."""
        transports = self._transports
        clock = self._clock
        normalize = self._normalize

        async def attempt(source: SourceConfig, call_id: str) -> Attempted[_Batch]:
            started = clock.monotonic()
            result = await transports[source.name].embed(
                texts=texts, source=source, call_id=call_id
            )
            check_dimension(result.dim, call_dim.dim, source_name=source.name)
            call_dim.dim = result.dim
            if normalize:
                result = replace(result, vectors=l2_normalize(result.vectors))
            latency_ms = elapsed_ms(started, clock.monotonic())
            measured = result.usage_source == "measured"
            return Attempted(
                _Batch(result, latency_ms), tokens=result.prompt_tokens if measured else None
            )

        rows = self._rows
        observer = (
            AttemptRows(
                rows,
                messages=texts_summary(texts),
                summarise=_summary,
                parent_call_id=parent_call_id,
                session_id=session_id,
                operation="embeddings",
            )
            if rows is not None
            else None
        )
        started = clock.monotonic()
        if observer is None:
            return await self._governor.run(attempt, est_tokens=estimate_tokens(texts))
        watcher: AttemptObserver[_Batch] = observer
        try:
            outcome = await self._governor.run(
                attempt,
                est_tokens=estimate_tokens(texts),
                observer=watcher,
                events=observer.events,
            )
        except (Exception, asyncio.CancelledError) as exc:
            # A batch that never reached an attempt (no quota, breakers open, cancelled while
            # waiting) still leaves its row.
            if observer.attempts == 0:
                observer.no_attempt(exc, latency_ms=elapsed_ms(started, clock.monotonic()))
            observer.close(exc)
            raise
        observer.close(None)
        return outcome

    def _merge(self, outcomes: Sequence[Outcome[_Batch]]) -> EmbeddingResponse:
        first = outcomes[0]
        vectors: list[list[float]] = []
        prompt_tokens = latency_ms = 0
        estimated = False
        cost: float | None = 0.0 if self._pricing is not None else None
        for outcome in outcomes:
            result = outcome.value.result
            vectors.extend(result.vectors)
            prompt_tokens += result.prompt_tokens
            latency_ms += outcome.value.latency_ms
            estimated = estimated or result.usage_source == "estimated"
            if cost is not None and self._pricing is not None:
                price = self._pricing.cost(
                    outcome.source.model or result.model, result.prompt_tokens, 0
                )
                cost = None if price is None else cost + price
        return EmbeddingResponse(
            vectors=vectors,
            dim=first.value.result.dim,
            model=first.value.result.model,
            provider=first.source.provider,
            prompt_tokens=prompt_tokens,
            usage_source="estimated" if estimated else "measured",
            latency_ms=latency_ms,
            call_id=first.call_id,
            source_name=first.source.name,
            cost=cost,
        )

    # ------------------------------------------------------------------ parts and lifecycle

    @property
    def settings(self) -> ScopeSettings:
        return self._settings

    @property
    def limiter(self) -> RateLimiter:
        """Pass it to another client to share its gates."""
        return self._parts.limiter

    @property
    def breaker(self) -> ProviderGate:
        return self._parts.breaker

    @property
    def governor(self) -> Governor:
        """The scope's governor (cooldown memo, in-flight counts, health probes; read it)."""
        return self._governor

    @property
    def transports(self) -> Mapping[str, EmbeddingTransport]:
        """Source name -> the transport serving it."""
        return self._transports

    @property
    def closed(self) -> bool:
        return self._parts.closed

    async def aclose(self) -> None:
        """Close what this client built and flush telemetry. Idempotent."""
        await self._parts.aclose()

    async def __aenter__(self) -> EmbeddingClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        names = [s.name for s in self._settings.sources]
        state = "closed" if self._parts.closed else "open"
        return (
            f"<EmbeddingClient scope={self._settings.scope!r} sources={names} "
            f"batch_size={self._batch_size} {state}>"
        )


def _settings_problems(settings: ScopeSettings, expected_dim: object) -> list[str]:
    scope = settings.scope
    problems: list[str] = []
    if not settings.sources:
        problems.append(
            f"{scope}: no sources configured; set {scope}__<PROVIDER>__1__BASE_URL, "
            f"{scope}__<PROVIDER>__1__MODEL and {scope}__<PROVIDER>__1__API_KEY "
            "(or [[scopes.<scope>.sources]] in the pipeline file)"
        )
    size = settings.batch_size
    if size is None or type(size) is not int or size < 1:
        problems.append(
            f"{scope}__BATCH_SIZE (file: [scopes.{scope}].batch_size): required for an embedding "
            f"client, an integer >= 1 (got {size!r})"
        )
    concurrency = settings.batch_concurrency
    if type(concurrency) is not int or concurrency < 1:
        problems.append(
            f"{scope}__BATCH_CONCURRENCY (file: [scopes.{scope}].batch_concurrency): must be an "
            f"integer >= 1, got {concurrency!r}"
        )
    if expected_dim is not None and (type(expected_dim) is not int or expected_dim < 1):
        problems.append(f"expected_dim must be an integer >= 1 or None, got {expected_dim!r}")
    return problems
