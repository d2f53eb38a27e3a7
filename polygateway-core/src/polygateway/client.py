"""``GatewayClient``: one governed client per scope (logical role), and ``gather_bounded``.

    client = GatewayClient.from_env()            # scope "LLM"
    resp = await client.chat(messages)

Every part can be injected instead of built from the configuration. Sharing is explicit:
passing the same limiter (or breaker) instance to two clients makes them share its gates;
nothing is shared implicitly (ARCHITECTURE §7.7).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, TypedDict, TypeVar, Unpack

from polygateway.assembly import build_pipeline
from polygateway.chat.messages import check_message_shape
from polygateway.clock import SystemClock
from polygateway.context import CallContext
from polygateway.errors import ConfigError, RequestRejectedError
from polygateway.ports import (
    CacheBackend,
    Clock,
    Components,
    Drainable,
    Handler,
    Pricing,
    ProviderGate,
    RateLimiter,
    SourceSelector,
    TelemetryRecorder,
    Transport,
)
from polygateway.settings import GatewaySettings, ScopeSettings
from polygateway.types import ChatRequest, LLMResponse, Message, StructuredSpec

__all__ = ["GatewayClient", "Injected", "gather_bounded"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Injected(TypedDict, total=False):
    """Parts a client can be given instead of building them (the caller keeps ownership)."""

    registry: Any
    clock: Clock
    limiter: RateLimiter
    breaker: ProviderGate
    cache: CacheBackend
    telemetry: TelemetryRecorder
    pricing: Pricing
    transports: Mapping[str, Transport]
    selector: SourceSelector


class GatewayClient:
    """A governed chat client for one scope: the middleware onion, assembled once.

    Parts passed in stay the caller's: ``aclose()`` closes only what this client built
    (transports, limiter, breaker, cache, telemetry recorder), and flushes the telemetry
    recorder either way so a graceful shutdown loses no row.
    """

    __slots__ = (
        "_closed",
        "_components",
        "_drains",
        "_handler",
        "_owned",
        "_owns_telemetry",
        "_settings",
        "_structured_on",
    )

    def __init__(
        self,
        settings: ScopeSettings,
        *,
        registry: Any = None,
        clock: Clock | None = None,
        limiter: RateLimiter | None = None,
        breaker: ProviderGate | None = None,
        cache: CacheBackend | None = None,
        telemetry: TelemetryRecorder | None = None,
        pricing: Pricing | None = None,
        transports: Mapping[str, Transport] | None = None,
        selector: SourceSelector | None = None,
    ) -> None:
        if not isinstance(settings, ScopeSettings):
            raise TypeError(
                "GatewayClient needs the ScopeSettings of one scope; use "
                "GatewayClient.from_settings(settings, scope=...) for GatewaySettings"
            )
        if registry is None:
            from polygateway.plugins import load_registry

            registry = load_registry()
        pipeline = build_pipeline(
            settings,
            registry,
            clock=clock if clock is not None else SystemClock(),
            limiter=limiter,
            breaker=breaker,
            cache=cache,
            telemetry=telemetry,
            pricing=pricing,
            transports=transports,
            selector=selector,
        )
        components = pipeline.components
        self._settings = settings
        self._handler: Handler = pipeline.handler
        self._components = components
        # Layers that hand work to the background (telemetry rows) and can wait for it.
        self._drains = [layer.drain for layer in pipeline.layers if isinstance(layer, Drainable)]
        self._structured_on = "structured" in settings.middleware
        # What this client built and therefore closes, in closing order.
        owned: list[tuple[str, Any]] = [
            (f"transport {name!r}", transport)
            for name, transport in components.transports.items()
            if transports is None or transports.get(name) is None
        ]
        if cache is None and components.cache is not None:
            owned.append(("cache", components.cache))
        if limiter is None:
            owned.append(("limiter", components.limiter))
        if breaker is None:
            owned.append(("breaker", components.breaker))
        self._owned: tuple[tuple[str, Any], ...] = tuple(owned)
        self._owns_telemetry = telemetry is None and components.telemetry is not None
        self._closed = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(
        cls,
        scope: str = "LLM",
        *,
        env: Mapping[str, str] | None = None,
        pipeline_path: str | PathLike[str] | None = None,
        dotenv_path: str | PathLike[str] | None = None,
        **injected: Unpack[Injected],
    ) -> GatewayClient:
        """Build the client of ``scope`` from the environment, ``.env`` and the pipeline file.

        ``env`` replaces ``os.environ`` (tests); plugins are filtered by ``PGW_PLUGINS``.
        """
        from polygateway.config import load_scope, plugin_filter

        registry = injected.get("registry")
        if registry is None:
            from polygateway.plugins import load_registry

            registry = injected["registry"] = load_registry(allowed=plugin_filter(env))
        # With the registry, the loader names unregistered implementations at the key.
        settings = load_scope(
            scope, env, pipeline_path=pipeline_path, dotenv_path=dotenv_path, registry=registry
        )
        return cls(settings, **injected)

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings | ScopeSettings,
        scope: str = "LLM",
        **injected: Unpack[Injected],
    ) -> GatewayClient:
        """Build the client of ``scope`` from already resolved settings."""
        if isinstance(settings, GatewaySettings):
            if scope not in settings.scopes:
                known = ", ".join(sorted(settings.scopes)) or "none"
                raise ConfigError(f"unknown scope {scope!r}; configured scopes: {known}")
            settings = settings.scope(scope)
        return cls(settings, **injected)

    # ------------------------------------------------------------------ the call

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        session_id: str | None = None,
        parent_call_id: str | None = None,
        cache_salt: str | None = None,
        cache_namespace: str | None = None,
        structured: StructuredSpec = None,
        stream: bool = True,
        deadline_s: float | None = None,
    ) -> LLMResponse:
        """One governed chat call (ARCHITECTURE §5.2).

        :param deadline_s: end-to-end deadline across every attempt, backoff and admission
            wait (default: the scope's ``retry.call_deadline_s``); past it the call raises
            ``AllSourcesExhausted(reason="retry_exhausted")``.
        :param structured: ``None`` raw text, ``"json"`` repaired JSON in
            ``structured_data``, or a pydantic model class (the full D14 ladder).
        :raises RequestRejectedError: malformed ``messages`` (before any network).
        """
        if self._closed:
            raise RuntimeError("this GatewayClient is closed")
        check_message_shape(messages)
        if structured is not None and not self._structured_on:
            raise RequestRejectedError(
                "structured output was requested but this client's middleware has no "
                f"'structured' layer (middleware: {list(self._settings.middleware)})"
            )
        request = ChatRequest(
            messages=messages,
            session_id=session_id,
            parent_call_id=parent_call_id,
            cache_salt=cache_salt,
            cache_namespace=cache_namespace,
            structured=structured,
            stream=stream,
            deadline_s=deadline_s,
            context=CallContext(),
        )
        return await self._handler(request)

    # ------------------------------------------------------------------ parts and lifecycle

    @property
    def settings(self) -> ScopeSettings:
        return self._settings

    @property
    def components(self) -> Components:
        """The assembled parts (read-only)."""
        return self._components

    @property
    def limiter(self) -> RateLimiter:
        """Pass it to another client to share its gates (global concurrency, RPM, TPM)."""
        return self._components.limiter

    @property
    def breaker(self) -> ProviderGate:
        return self._components.breaker

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Close what this client built and flush telemetry. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for what, part in self._owned:
            await _close_quietly(what, part.aclose)
        for drain in self._drains:
            await _close_quietly("telemetry rows in flight", drain)
        # Last, once nothing can produce rows any more; an injected recorder is flushed only.
        telemetry = self._components.telemetry
        if telemetry is not None:
            await _close_quietly("telemetry flush", telemetry.flush)
            if self._owns_telemetry:
                await _close_quietly("telemetry", telemetry.aclose)

    async def __aenter__(self) -> GatewayClient:
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
        state = "closed" if self._closed else "open"
        return f"<GatewayClient scope={self._settings.scope!r} sources={names} {state}>"


async def _close_quietly(what: str, close: Callable[[], Awaitable[None]]) -> None:
    try:
        await close()
    except Exception as exc:  # noqa: BLE001 - one part failing to close must not stop the rest
        logger.warning("closing %s failed: %s: %s", what, type(exc).__name__, exc)


# --------------------------------------------------------------------------- gather_bounded


async def gather_bounded(
    calls: Iterable[Callable[[], Awaitable[T]] | Awaitable[T]], concurrency: int
) -> list[T]:
    """Run ``calls`` with at most ``concurrency`` in flight; results in input order.

    Each item is a zero-argument coroutine function (started only when a slot is free) or an
    awaitable. The first exception cancels everything still running, closes what never
    started, and is raised as itself (not wrapped in a group).
    """
    if type(concurrency) is not int or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    items: list[Any] = list(calls)
    results: list[Any] = [None] * len(items)
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(items):
            index = position
            position += 1
            item = items[index]
            items[index] = None  # started: nothing left to close for it
            awaitable = item if inspect.isawaitable(item) else item()
            results[index] = await awaitable

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, len(items))):
                group.create_task(worker())
    except ExceptionGroup as failure:
        first = failure.exceptions[0]
        for other in failure.exceptions[1:]:
            first.add_note(f"also failed meanwhile: {type(other).__name__}: {other}")
        raise first from None
    finally:
        for item in items:
            _discard(item)
    return results


def _discard(item: Any) -> None:
    """Dispose of a call that never ran: close a coroutine, cancel a future."""
    if item is None:
        return
    if inspect.iscoroutine(item):
        item.close()
    elif isinstance(item, asyncio.Future):
        item.cancel()
